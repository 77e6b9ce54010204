"""RoPE's inverse frequencies, as transformers computes them: the one definition every forward uses."""

from __future__ import annotations

import math

import numpy as np

from kestrel_core.model.config import ModelConfig, normalize_rope_scaling


def rope_inv_freq(config: ModelConfig, layer: int | None = None) -> np.ndarray:
    """Inverse frequencies [hd/2] in float32 (default, linear or llama3 scaling) of ``layer`` (None: the
    model's global RoPE, rope_theta and rope_scaling); position p rotates the pair (i, i + hd/2) of each head
    by p * inv_freq[i] (transformers' rotate_half layout)."""
    hd = config.head_dim
    theta, scaling_config = (config.rope_theta, config.rope_scaling) if layer is None else config.rope_of(layer)
    exponents = np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / np.float32(hd)
    inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)
    scaling = normalize_rope_scaling(scaling_config, "model config")
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = float(scaling["original_max_position_embeddings"])
    # Mirrors transformers' _compute_llama3_parameters, float32 like its tensors.
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
