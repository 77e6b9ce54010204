"""Compiled host maths of one decode step (numba): the decoder's float32 operations, fused per layer.

A decode step's non-GEMM work is tiny (one row of D or F values, one query against the KV cache), so in numpy
it is dominated by per-call overhead: ~15 numpy calls per norm/RoPE/attention/SiLU, each allocating a
temporary. Here each stage between two projections is one call that also quantizes the next projection's
input (the same ``_q8_rows`` as ``quantize_activations``, so codes and scales follow its exact semantics).

Element-wise maths is the same operation sequence as decoder.py's numpy path (no fastmath: no FMA
contraction, no reassociation), so it rounds identically; reductions (rmsnorm's sum of squares, attention's
dot products and softmax sum) are sequential float32 sums, which differ from numpy/BLAS only in summation
order. Attention dot products run with the positions as the inner, independent loop over the transposed key
cache [KV, hd, S], so LLVM vectorises them without reassociating anything.

``AVAILABLE`` is False where numba is missing or cannot compile; the decoder then runs its numpy path.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kestrel_core import contract

log = logging.getLogger("kestrel")


def _add_norm_quant(h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: np.float32, group: int,
                    x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
    # h: [1, D] residual, += delta [1, D] first when delta is not empty; x: [1, D] scratch for rmsnorm(h) *
    # weight, quantized into codes [1, D] int8 and scales [1, D/group].
    d = h.shape[1]
    if delta.shape[1]:
        for j in range(d):
            h[0, j] += delta[0, j]
    ss = np.float32(0)
    for j in range(d):
        ss += h[0, j] * h[0, j]
    inv = np.float32(1) / np.sqrt(ss / np.float32(d) + eps)
    for j in range(d):
        x[0, j] = h[0, j] * inv * weight[j]
    _q8_rows(x, group, codes, scales)


def _rope_attend_quant(q: np.ndarray, k: np.ndarray, v: np.ndarray, kt: np.ndarray, vc: np.ndarray, pos: int,
                       cos: np.ndarray, sin: np.ndarray, q_cos: np.ndarray, q_sin: np.ndarray, group: int,
                       scores: np.ndarray, attn: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
    # q: [H, hd], k/v: [KV, hd] of the new position; kt: [KV, hd, cap] keys (transposed), vc: [cap, KV, hd]
    # values of this layer; cos/sin/q_cos/q_sin: [hd] tables of ``pos`` (sin signed, q_ tables scaled);
    # scores: [>= pos+1] scratch; attn: [1, H*hd] out, quantized into codes/scales.
    n_heads, hd = q.shape
    n_kv = k.shape[0]
    g = n_heads // n_kv
    half = hd // 2
    s_len = pos + 1
    for kh in range(n_kv):  # RoPE into the cache: x * cos + rotate_half(x) * sin, as decoder._rope
        for j in range(hd):
            js = j + half if j < half else j - half
            kt[kh, j, pos] = k[kh, j] * cos[j] + k[kh, js] * sin[j]
            vc[pos, kh, j] = v[kh, j]
    qr = np.empty(hd, np.float32)
    for h in range(n_heads):
        kh = h // g  # HF's repeat_kv
        for j in range(hd):
            js = j + half if j < half else j - half
            qr[j] = q[h, j] * q_cos[j] + q[h, js] * q_sin[j]
        for s in range(s_len):
            scores[s] = np.float32(0)
        for j in range(hd):  # scores = q . k over positions: independent lanes, vectorised
            qj = qr[j]
            row = kt[kh, j]
            for s in range(s_len):
                scores[s] += qj * row[s]
        top = scores[0]
        for s in range(1, s_len):
            if scores[s] > top:
                top = scores[s]
        total = np.float32(0)
        for s in range(s_len):
            e = np.exp(scores[s] - top)
            scores[s] = e
            total += e
        base = h * hd
        for j in range(hd):
            attn[0, base + j] = np.float32(0)
        for s in range(s_len):  # P @ V, normalised after (as decoder._attention)
            p = scores[s]
            for j in range(hd):
                attn[0, base + j] += p * vc[s, kh, j]
        for j in range(hd):
            attn[0, base + j] /= total
    _q8_rows(attn, group, codes, scales)


def _silu_mul_quant(gate: np.ndarray, up: np.ndarray, group: int, codes: np.ndarray, scales: np.ndarray) -> None:
    # gate, up: [1, F]; gate becomes silu(gate) * up (as decoder._silu_mul), quantized into codes/scales.
    for j in range(gate.shape[1]):
        gate[0, j] = gate[0, j] / (np.exp(-gate[0, j]) + np.float32(1)) * up[0, j]
    _q8_rows(gate, group, codes, scales)


COMPILE_ERRORS: tuple[type[BaseException], ...] = ()
_q8_rows: Any = None
add_norm_quant: Any = None
rope_attend_quant: Any = None
silu_mul_quant: Any = None
AVAILABLE = False


def _build() -> bool:
    global _q8_rows, add_norm_quant, rope_attend_quant, silu_mul_quant, COMPILE_ERRORS
    compiled_q8 = contract._compiled_q8_rows()
    if compiled_q8 is None:
        return False
    try:
        from numba import njit
        from numba.core.errors import NumbaError
    except Exception as exc:  # numba missing: the decoder's numpy path
        log.debug("compiled decode step unavailable: %s", exc)
        return False
    COMPILE_ERRORS = (NumbaError,)
    _q8_rows = compiled_q8  # a global the jitted functions below call (resolved when they compile)
    jit = njit(cache=True, nogil=True)
    add_norm_quant = jit(_add_norm_quant)
    rope_attend_quant = jit(_rope_attend_quant)
    silu_mul_quant = jit(_silu_mul_quant)
    return True


AVAILABLE = _build()


def disable(exc: BaseException) -> None:
    """Fall back to the numpy path for good (a numba that cannot compile these)."""
    global AVAILABLE
    log.debug("compiled decode step unavailable: %s", exc)
    AVAILABLE = False
