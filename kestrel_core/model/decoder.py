"""The layer-by-layer numpy forward of the decoder (the model math every backend's forward must match).

Every projection goes through the offload dispatcher with its wkey, so a backend that accepts GEMMs runs
them and the host does the rest (norms, RoPE, attention, SiLU) in float32. The host keeps its own KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from kestrel_core.dispatch import Offload
from kestrel_core.errors import KestrelError
from kestrel_core.model import kernels
from kestrel_core.model.config import ModelConfig, normalize_rope_scaling
from kestrel_core.model.weights import Model
from kestrel_core.wkey import Proj, fused_wkey, lm_head_wkey, wkey

CACHE_CHUNK = 256  # KV cache and RoPE tables grow by this many positions at a time
PREFILL_CHUNK = 512  # longer inputs run in chunks so scores [H, T, S] and MLP activations stay bounded
QUERY_BLOCK = 64  # prefill attention per block of queries, over only the keys they see (causal)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [hd/2] in float32, as transformers computes them (default or llama3 scaling)."""
    hd = config.head_dim
    exponents = np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / np.float32(hd)
    inv_freq = (np.float32(1.0) / np.power(np.float32(config.rope_theta), exponents)).astype(np.float32)
    scaling = normalize_rope_scaling(config.rope_scaling, "model config")
    if scaling is None:
        return inv_freq
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


class RopeTables:
    """cos/sin of absolute positions laid out for ``_rope``: [P, 2, hd/2] (HF's halves), extended on demand.

    ``sin`` carries rotate_half's sign ([-sin, sin]); the ``q_`` tables also carry the attention scale
    1/sqrt(hd), so the query needs no separate multiply.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = rope_inv_freq(config)  # [hd/2]
        self.max_position = config.max_position
        self.scale = np.float32(1.0 / math.sqrt(config.head_dim))
        half = len(self.inv_freq)
        self.cos = self.sin = self.q_cos = self.q_sin = np.empty((0, 2, half), np.float32)

    def upto(self, n: int) -> None:
        if n <= len(self.cos):
            return
        size = min(max(n, len(self.cos) + CACHE_CHUNK), max(self.max_position, n))
        positions = np.arange(size, dtype=np.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]  # [P, hd/2], float32 like HF
        cos, sin = np.cos(freqs), np.sin(freqs)
        self.cos = np.stack([cos, cos], axis=1)  # [P, 2, hd/2]
        self.sin = np.stack([-sin, sin], axis=1)
        self.q_cos = self.cos * self.scale
        self.q_sin = self.sin * self.scale


class KVCache:
    """Host keys/values of one sequence, grown in chunks, ``length`` used.

    Keys are stored transposed, ``kt`` float32 [L, KV, hd, capacity], the layout attention multiplies by (and
    the compiled decode step's dot products run over contiguous positions); ``k`` is the [L, capacity, KV, hd]
    view of them. Values: ``v`` float32 [L, capacity, KV, hd].
    """

    def __init__(self, config: ModelConfig, capacity: int = 0) -> None:
        self.config = config
        self.length = 0
        c = config
        self.kt = np.empty((c.num_layers, c.num_kv_heads, c.head_dim, 0), np.float32)
        self.v = np.empty((c.num_layers, 0, c.num_kv_heads, c.head_dim), np.float32)
        if capacity:
            self.reserve(capacity)

    @property
    def k(self) -> np.ndarray:
        return self.kt.transpose(0, 3, 1, 2)  # [L, capacity, KV, hd], a view

    @property
    def capacity(self) -> int:
        return self.v.shape[1]

    def reserve(self, n: int) -> None:
        """Room for ``n`` positions; grows by whole chunks (copying only the used part)."""
        if n <= self.capacity:
            return
        if n > self.config.max_position:
            raise KestrelError(f"the sequence needs {n} positions; the model's context is "
                               f"{self.config.max_position}")
        cap = min(-(-n // CACHE_CHUNK) * CACHE_CHUNK, self.config.max_position)
        c = self.config
        kt = np.empty((c.num_layers, c.num_kv_heads, c.head_dim, cap), np.float32)
        kt[..., :self.length] = self.kt[..., :self.length]
        v = np.empty((c.num_layers, cap, c.num_kv_heads, c.head_dim), np.float32)
        v[:, :self.length] = self.v[:, :self.length]
        self.kt, self.v = kt, v

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)


def _blas_controllers() -> list[Any]:
    try:  # a BLAS that threadpoolctl cannot read keeps its thread count
        return list(ThreadpoolController().select(user_api="blas").lib_controllers)
    except Exception:
        return []


_BLAS: list[Any] | None = None


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """BLAS on one thread while the decoder runs: its matmuls (attention) are small, and on a few cores its
    spinning worker threads fight the GEMM kernels' threads (measured on 2 cores under load: a 256-token
    prefill's host work took 1.7 s of CPU with 2 OpenBLAS threads, 0.34 s with 1)."""
    global _BLAS
    if _BLAS is None:
        _BLAS = _blas_controllers()
    previous = [lib.num_threads for lib in _BLAS]
    for lib in _BLAS:
        lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, n in zip(_BLAS, previous):
            lib.set_num_threads(n)


@dataclass(frozen=True)
class _LayerKeys:
    qkv: tuple[int, int, int]
    qkv_fused: int
    o: int
    gate_up: tuple[int, int]
    gate_up_fused: int
    down: int


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, float32."""
    if x.ndim == 2 and x.shape[0] == 1:  # a decode step: scalar maths, half the numpy calls
        row = x[0]
        inv = np.float32(1) / np.sqrt(np.dot(row, row) / np.float32(row.shape[0]) + np.float32(eps))
        out = x * inv
        out *= weight
        return out
    ms = np.einsum("...d,...d->...", x, x)[..., None] / np.float32(x.shape[-1])  # [..., 1]
    ms += np.float32(eps)
    np.sqrt(ms, out=ms)
    out = x / ms
    out *= weight
    return out


class Decoder:
    """Runs tokens through the model on the host, appending to a ``KVCache``."""

    def __init__(self, model: Model, offload: Offload) -> None:
        c = model.config
        if c.num_heads % c.num_kv_heads:
            raise KestrelError(f"num_heads={c.num_heads} is not a multiple of num_kv_heads={c.num_kv_heads}")
        if c.head_dim % 2:
            raise KestrelError(f"head_dim={c.head_dim} must be even for RoPE")
        self.model = model
        self.config = c
        self.offload = offload
        self.rope = RopeTables(c)
        # The compiled decode step hands the dispatcher quantized activations (gemm_q8*), which skips an
        # Offload subclass's own linear/linear_fused (e.g. one that perturbs inputs): those keep numpy.
        kind = type(offload)
        self.compiled_step = kind.linear is Offload.linear and kind.linear_fused is Offload.linear_fused
        self.eps = np.float32(c.rms_norm_eps)
        self.keys = [_LayerKeys(qkv=(wkey(i, Proj.Q), wkey(i, Proj.K), wkey(i, Proj.V)),
                                qkv_fused=fused_wkey(i, Proj.QKV), o=wkey(i, Proj.O),
                                gate_up=(wkey(i, Proj.GATE), wkey(i, Proj.UP)),
                                gate_up_fused=fused_wkey(i, Proj.GATE_UP), down=wkey(i, Proj.DOWN))
                     for i in range(c.num_layers)]

    def new_cache(self, capacity: int = 0) -> KVCache:
        return KVCache(self.config, capacity)

    def forward(self, tokens: np.ndarray, cache: KVCache, all_logits: bool = False,
                logits: bool = True) -> np.ndarray | None:
        """Append ``tokens`` [T] at positions cache.length.. and return float32 logits.

        [T, vocab] if all_logits else [1, vocab] (the last token); None when ``logits`` is False (only the
        cache is filled, e.g. to catch up with tokens a device ran).
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not len(tokens):
            raise KestrelError("no tokens to run")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise KestrelError(f"token id out of range [0, {self.config.vocab_size})")
        cache.reserve(cache.length + len(tokens))
        outs = []
        # SiLU's exp(-x) overflows to inf for very negative x, which gives the right limit
        with np.errstate(over="ignore"), single_threaded_blas():
            for s in range(0, len(tokens), PREFILL_CHUNK):
                chunk = tokens[s:s + PREFILL_CHUNK]
                last = s + PREFILL_CHUNK >= len(tokens)
                h = self._layers(chunk, cache)
                if logits and (all_logits or last):
                    outs.append(self._logits(h if all_logits else h[-1:]))
        return np.concatenate(outs) if len(outs) > 1 else (outs[0] if outs else None)

    def _logits(self, h: np.ndarray) -> np.ndarray:
        lm_head = self.model.lm_head
        if len(h) == 1 and self.compiled_step and kernels.AVAILABLE:
            codes, scales = _q8_buffers(h.shape[1], lm_head.group_size)
            kernels.add_norm_quant(h, _NO_DELTA, self.model.final_norm, self.eps, lm_head.group_size,
                                   np.empty_like(h), codes, scales)
            return self.offload.gemm_q8(codes, scales, lm_head, lm_head_wkey())  # [1, vocab]
        x = rmsnorm(h, self.model.final_norm, self.eps)  # [T, D]
        return self.offload.linear(x, lm_head, lm_head_wkey())  # [T, vocab]

    def _layers(self, tokens: np.ndarray, cache: KVCache) -> np.ndarray:
        """All layers over tokens [T] at positions cache.length..; returns the final hidden state [T, D]."""
        if len(tokens) == 1 and self.compiled_step and kernels.AVAILABLE:
            try:
                return self._decode_step(tokens, cache)
            except kernels.COMPILE_ERRORS as exc:  # numba compiles on layer 0's calls; numpy redoes the step
                kernels.disable(exc)
        c, off = self.config, self.offload
        start, t = cache.length, len(tokens)
        end = start + t
        rope = self.rope
        rope.upto(end)
        half = c.head_dim // 2
        cos, sin = rope.cos[start:end, None], rope.sin[start:end, None]  # [T, 1, 2, hd/2]
        q_cos, q_sin = rope.q_cos[start:end, None], rope.q_sin[start:end, None]
        blocks = _causal_blocks(start, t) if t > 1 else []  # the same for every layer
        h = self.model.embedding.dequantize(tokens)  # [T, D]
        for i, lw in enumerate(self.model.layers):
            off.layer_boundary(i)
            keys = self.keys[i]
            x = rmsnorm(h, lw.attn_norm, self.eps)  # [T, D]
            q, k, v = off.linear_fused(x, (lw.q, lw.k, lw.v), keys.qkv, keys.qkv_fused)
            if lw.q_bias is not None:
                q += lw.q_bias
                k += lw.k_bias
                v += lw.v_bias
            q = q.reshape(t, c.num_heads, 2, half)  # [T, H, 2, hd/2]: the halves rotate_half swaps
            k = k.reshape(t, c.num_kv_heads, 2, half)
            if lw.q_norm is not None:
                q = rmsnorm(q.reshape(t, c.num_heads, -1), lw.q_norm, self.eps).reshape(q.shape)
                k = rmsnorm(k.reshape(t, c.num_kv_heads, -1), lw.k_norm, self.eps).reshape(k.shape)
            q = _rope(q, q_cos, q_sin, np.empty_like(q)).reshape(t, c.num_heads, c.head_dim)  # scaled
            cache.k[i, start:end] = _rope(k, cos, sin, np.empty_like(k)).reshape(t, c.num_kv_heads, c.head_dim)
            cache.v[i, start:end] = v.reshape(t, c.num_kv_heads, c.head_dim)
            if t == 1:
                attn = self._attention(q, cache.kt[i, :, :, :end], cache.v[i, :end], None)  # [1, H*hd]
            else:
                attn = np.empty((t, c.num_heads * c.head_dim), np.float32)  # [T, H*hd]
                for q0, q1, mask in blocks:
                    attn[q0:q1] = self._attention(q[q0:q1], cache.kt[i, :, :, :start + q1],
                                                  cache.v[i, :start + q1], mask)
            h += off.linear(attn, lw.o, keys.o)
            x = rmsnorm(h, lw.mlp_norm, self.eps)
            gate, up = off.linear_fused(x, (lw.gate, lw.up), keys.gate_up, keys.gate_up_fused)  # [T, F]
            h += off.linear(_silu_mul(gate, up), lw.down, keys.down)
        cache.length = end
        return h

    def _decode_step(self, token: np.ndarray, cache: KVCache) -> np.ndarray:
        """One position through every layer with the compiled host maths (``kernels``); returns h [1, D].

        Each stage between two projections is one compiled call that also quantizes the next projection's
        input, which then goes to the dispatcher already quantized (``gemm_q8``/``gemm_q8_fused``, the same
        hooks and counters as ``linear``/``linear_fused``). A residual add is fused into the next norm.
        """
        c, off = self.config, self.offload
        pos = cache.length
        rope = self.rope
        rope.upto(pos + 1)
        cos, sin = rope.cos[pos].reshape(-1), rope.sin[pos].reshape(-1)  # [hd]: the [2, hd/2] halves in a row
        q_cos, q_sin = rope.q_cos[pos].reshape(-1), rope.q_sin[pos].reshape(-1)
        hd, n_heads, n_kv = c.head_dim, c.num_heads, c.num_kv_heads
        h = self.model.embedding.dequantize(token)  # [1, D]
        d = h.shape[1]
        x = np.empty_like(h)  # rmsnorm scratch
        scores = np.empty(pos + 1, np.float32)
        delta = _NO_DELTA  # the projection output still to add to h
        for i, lw in enumerate(self.model.layers):
            off.layer_boundary(i)
            keys = self.keys[i]
            group = lw.q.group_size
            codes, scales = _q8_buffers(d, group)
            kernels.add_norm_quant(h, delta, lw.attn_norm, self.eps, group, x, codes, scales)
            q, k, v = off.gemm_q8_fused(codes, scales, (lw.q, lw.k, lw.v), keys.qkv, keys.qkv_fused)
            if lw.q_bias is not None:
                q = q + lw.q_bias
                k = k + lw.k_bias
                v = v + lw.v_bias
            q = np.ascontiguousarray(q).reshape(n_heads, hd)
            k = np.ascontiguousarray(k).reshape(n_kv, hd)
            v = np.ascontiguousarray(v).reshape(n_kv, hd)
            if lw.q_norm is not None:
                q = rmsnorm(q, lw.q_norm, self.eps)
                k = rmsnorm(k, lw.k_norm, self.eps)
            group = lw.o.group_size
            attn = np.empty((1, n_heads * hd), np.float32)
            codes, scales = _q8_buffers(n_heads * hd, group)
            kernels.rope_attend_quant(q, k, v, cache.kt[i], cache.v[i], pos, cos, sin, q_cos, q_sin, group,
                                      scores, attn, codes, scales)
            delta = np.ascontiguousarray(off.gemm_q8(codes, scales, lw.o, keys.o))
            group = lw.gate.group_size
            codes, scales = _q8_buffers(d, group)
            kernels.add_norm_quant(h, delta, lw.mlp_norm, self.eps, group, x, codes, scales)
            gate, up = off.gemm_q8_fused(codes, scales, (lw.gate, lw.up), keys.gate_up, keys.gate_up_fused)
            gate, up = np.ascontiguousarray(gate), np.ascontiguousarray(up)
            group = lw.down.group_size
            codes, scales = _q8_buffers(gate.shape[1], group)
            kernels.silu_mul_quant(gate, up, group, codes, scales)
            delta = off.gemm_q8(codes, scales, lw.down, keys.down)
        h += delta
        cache.length = pos + 1
        return h

    def _attention(self, q: np.ndarray, kt: np.ndarray, v: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        """Causal GQA: q [T, H, hd] (already scaled), kt [KV, hd, S], v [S, KV, hd] (cache views) -> [T, H*hd].

        Query head h reads kv head h // g (HF's repeat_kv); the softmax is normalised after P @ V.
        """
        t, n_heads, hd = q.shape
        n_kv = kt.shape[0]
        g = n_heads // n_kv
        vt = v.transpose(1, 0, 2)  # [KV, S, hd]: a strided view BLAS reads directly
        if t == 1:
            scores = np.matmul(q.reshape(n_kv, g, hd), kt)  # [KV, g, S]
        else:
            qg = q.reshape(t, n_kv, g, hd).transpose(1, 2, 0, 3).reshape(n_kv, g * t, hd)  # [KV, g*T, hd]
            scores = np.matmul(qg, kt).reshape(n_kv, g, t, -1)  # [KV, g, T, S]
            scores += mask
        scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        total = np.add.reduce(scores, axis=-1, keepdims=True)  # [KV, g, (T,) 1]
        if t == 1:
            out = np.matmul(scores, vt)  # [KV, g, hd]
            out /= total
            return out.reshape(1, n_heads * hd)
        out = np.matmul(scores.reshape(n_kv, g * t, -1), vt).reshape(n_kv, g, t, hd)
        out /= total
        return out.transpose(2, 0, 1, 3).reshape(t, n_heads * hd)


_NO_DELTA = np.zeros((1, 0), np.float32)  # add_norm_quant's "nothing to add"


def _q8_buffers(k: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Fresh codes int8 [1, K] and scales float32 [1, K/G] (new per call: a backend may keep what it gets)."""
    return np.empty((1, k), np.int8), np.empty((1, k // group), np.float32)


def _causal_blocks(start: int, t: int) -> list[tuple[int, int, np.ndarray]]:
    """Query blocks (q0, q1, mask) of a prefill at positions start..start+t: block rows attend to the keys
    0..start+q1 only, and mask [q1-q0, start+q1] hides the later ones (query q0+i sees keys <= start+q0+i)."""
    out = []
    for q0 in range(0, t, QUERY_BLOCK):
        q1 = min(q0 + QUERY_BLOCK, t)
        mask = np.triu(np.full((q1 - q0, start + q1), -np.inf, np.float32), k=start + q0 + 1)
        out.append((q0, q1, mask))
    return out


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray) -> np.ndarray:
    """HF RoPE, x * cos + rotate_half(x) * sin: x [T, heads, 2, hd/2], tables [T, 1, 2, hd/2] (sin signed).

    rotate_half(x) is x with its halves swapped (a view) times [-1, 1], which the sin table carries.
    """
    np.multiply(x, cos, out=out)
    out += x[:, :, ::-1] * sin
    return out


def _silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, in place in ``gate``: [T, F]."""
    t = np.negative(gate)
    np.exp(t, out=t)
    t += np.float32(1)
    gate /= t
    gate *= up
    return gate
