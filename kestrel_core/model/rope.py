"""RoPE as transformers computes it: the one definition of its angles and tables every forward uses.

A head's pair (i, i + hd/2) turns by position * inv_freq[i] (transformers' rotate_half layout). A model whose RoPE
turns only its first ``rotary_dim`` dims (transformers' ``partial_rotary_factor``) pairs (i, i + rotary_dim/2)
instead, and GLM-4's pairs (2i, 2i + 1) (``rope_interleaved``); kestrel stores such a model's q and k rows reordered
within each head (``rotary_first``) so that those pairs sit at (i, i + hd/2) and the rest turn by no angle. Every
backend then runs one layout: the reorder permutes q and k alike, so attention scores do not change.
"""

from __future__ import annotations

import math

import numpy as np

from kestrel_core.model.config import ModelConfig

ROTARY_FIELDS = ("q", "k", "q_bias", "k_bias", "q_norm", "k_norm")  # what rotary_first reorders


def rope_inv_freq(config: ModelConfig, layer: int | None = None) -> np.ndarray:
    """Inverse frequencies [hd/2] in float32 of ``layer``'s RoPE (None: the model's, rope_theta and rope_scaling):
    plain, linear, llama3, yarn or longrope, as transformers computes them; the pairs past rotary_dim/2 have 0. hd is
    the width of the keys attention reads (``ModelConfig.attention_dims``: a latent attention's cached key).

    longrope has two sets of factors: the long one where the context (``max_position``) exceeds the pretraining
    one, as vLLM and llama.cpp choose, so a sequence's keys all turn by one rule whatever its length."""
    dim = config.rotary
    theta, scaling = (config.rope_theta, config.rope_scaling) if layer is None else config.rope_of(layer)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    base = np.power(np.float32(theta), exponents)  # [dim/2]
    kind = None if scaling is None else scaling["rope_type"]
    hd = config.attention_dims[1]
    if kind == "none":  # a NoPE layer (SmolLM3): no pair turns
        return np.zeros(hd // 2, np.float32)
    if kind == "longrope":
        long = config.max_position > scaling["original_max_position_embeddings"]
        ext = np.asarray(scaling["long_factor" if long else "short_factor"], np.float32)
        inv_freq = np.float32(1.0) / (ext * base)
    else:
        inv_freq = np.float32(1.0) / base
    if kind == "linear":
        inv_freq = inv_freq / np.float32(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq = _yarn(base, theta, dim, scaling)
    return np.concatenate([inv_freq, np.zeros((hd - dim) // 2, np.float32)]).astype(np.float32)


def rope_attention_factor(config: ModelConfig, layer: int | None = None) -> float:
    """The factor yarn and longrope put on the turned dims' cos and sin (1: none)."""
    scaling = config.rope_scaling if layer is None else config.rope_of(layer)[1]
    return float((scaling or {}).get("attention_factor", 1.0))


def rope_tables(config: ModelConfig, positions: int, layer: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [positions, hd/2] float32 of angle = position * inv_freq of ``layer``'s RoPE (None: the model's),
    the turned pairs' times the attention factor: x' = x * cos + rotate_half(x) * sin, as transformers."""
    inv_freq = rope_inv_freq(config, layer)
    freqs = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]  # [P, hd/2], float32 like HF
    cos, sin = np.cos(freqs), np.sin(freqs)
    factor = rope_attention_factor(config, layer)
    if factor != 1.0:
        turned = config.rotary // 2
        cos[:, :turned] *= np.float32(factor)
        sin[:, :turned] *= np.float32(factor)
    return cos, sin


def rotary_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> np.ndarray:
    """Each head's dims in kestrel's order: the turned pairs' first and second dims (the two halves of the turned
    dims, or with ``interleaved`` their even and odd dims) at the front of the head's two halves."""
    half, turned = head_dim // 2, rotary_dim // 2
    passed = half - turned
    firsts = 2 * np.arange(turned) if interleaved else np.arange(turned)
    seconds = firsts + 1 if interleaved else turned + np.arange(turned)
    return np.concatenate([firsts, rotary_dim + np.arange(passed), seconds, rotary_dim + passed + np.arange(passed)])


def rotary_rows(config: ModelConfig, count: int) -> np.ndarray:
    """The indices that put ``count`` rows (whole heads of ``head_dim``) in kestrel's order, each head's reordered
    (``rotary_order``)."""
    hd = config.head_dim
    order = rotary_order(hd, config.rotary, config.rope_interleaved)
    return (np.arange(count // hd)[:, None] * hd + order).reshape(-1)


def rotary_first(config: ModelConfig, rows: np.ndarray) -> np.ndarray:
    """q or k rows [heads * hd, K], their bias [heads * hd] or a q/k norm [hd] of a checkpoint, reordered within
    each head (``rotary_rows``) for a model whose RoPE turns part of each head, or interleaved pairs."""
    return np.ascontiguousarray(rows[rotary_rows(config, len(rows))])


def _llama3(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """transformers' _compute_llama3_parameters, float32 like its tensors."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth_factor = ((np.float32(old_context_len) / wavelen - np.float32(low_freq_factor))
                     / np.float32(high_freq_factor - low_freq_factor))
    smoothed = ((np.float32(1) - smooth_factor) * inv_freq_llama / np.float32(factor)
                + smooth_factor * inv_freq_llama)
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama).astype(np.float32)


def _yarn(base: np.ndarray, theta: float, dim: int, scaling: dict) -> np.ndarray:
    """transformers' _compute_yarn_parameters: pairs that turn fewer than beta_slow times over the pretraining
    context are interpolated (divided by factor), those turning more than beta_fast times kept, a ramp between."""
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    kept = np.float32(1) - ramp.astype(np.float32)  # [dim/2]: 1 extrapolates (keeps), 0 interpolates
    extrapolated = np.float32(1.0) / base
    interpolated = np.float32(1.0) / (np.float32(scaling["factor"]) * base)
    return (interpolated * (np.float32(1) - kept) + extrapolated * kept).astype(np.float32)
