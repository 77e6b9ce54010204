"""The host KV pool's attention: keys and values stored as IEEE float16 (``rope_write``), read by paged attention
(``attend``) whose dot products run on LLVM vectors of float32.

Keys are stored transposed, [blocks, KV, hd, BS], so that one key dim of LANES consecutive positions is a vector
a query element multiplies broadcast; values [blocks, KV, BS, vdp], a position's dims contiguous and padded to
whole vectors (``padded_dims``). Either way a KV head's block is one contiguous run of memory. A block holds
whole vectors of positions (``BLOCK_MULTIPLE``).

Every row runs one fixed sequence of float32 operations, whatever the batch and however many query heads a work
item takes, so that batching and chunked prefill change no result (kernels.py says why that matters): a score is
q[j] * k[j] accumulated from 0 in order of j, an output dim p_s * v_s accumulated from 0 in order of position,
each step one fused multiply-add where the CPU has FMA (``llvm.fmuladd``: one choice for every row), and the
softmax's exp and total in the fixed steps of ``_exp`` and ``_softmax``. The vector kernels (numba intrinsics,
attention_vectors.py) hold the sums in registers (numba's own loops keep them in memory) and take the exp on
vectors (numba's is a libm call a score): a tile of query heads x vectors of positions for the scores (each key
vector widened from float16 once for up to four heads), VALUE_TILE vectors of dims for a head's weighted values;
docs/performance.md has the figures.

Keys and values are rounded to float16 to nearest, ties to even, as llama.cpp's and vLLM's caches hold them
(numpy's ``astype(np.float16)``, CUDA's ``__float2half_rn``): a device backend's cache holds the same values,
and the pool takes half the bytes of float32. numba has no float16, so the pool's arrays are passed as their
uint16 bit patterns. Where numba is missing the same functions run as plain Python and numpy, far slower, with
the results of a CPU without FMA (numpy's multiply and add round twice).

A pool may hold int8 keys and values instead (``KVPool``'s ``kv_type`` "q8"): every KV_GROUP dims of a head's
rotated key or value at a position quantized as the contract quantizes activations (Q8_0's codes, a float32 scale;
``contract.quantize_activations``), the scales beside the codes (keys' [blocks, KV, hd/G, BS], values' [blocks, KV,
BS, vdp/G]). A score is then the sum over the key's blocks, in order, of each block's scale times its codes' dot
product with q (that from 0 in order of j), and an output dim adds p_s times the block's scale times the code.
9/16 of float16's bytes: the pool holds 1.78x the positions.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kestrel_core.contract import quantize_activations
from kestrel_core.model.attention_vectors import (
    KV_GROUP,
    LANES,
    make_key_scores,
    make_softmax,
    make_value_sums,
    score_vectors,
)

# prange: numba's, or a plain range where numba is missing
from kestrel_core.model.kernels import EXP_FLOOR, EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_POLY, prange

log = logging.getLogger("kestrel")

BLOCK_MULTIPLE = LANES  # a KV block's positions come in whole key vectors
SCORE_TILE = 8  # vectors of positions a key_scores call covers
VALUE_TILE = 4  # vectors of dims one value_sums call sums at once


def padded_dims(dims: int) -> int:
    """A position's value dims as the pool stores them: whole vectors."""
    return -(-dims // LANES) * LANES


def _half_bits(x: np.ndarray, out: np.ndarray) -> None:
    # x: float32 [n] -> out: uint16 [n], the IEEE binary16 nearest each (ties to even). On the bits: add half a
    # float16 step less one (plus the kept lowest bit, for ties) and truncate, a carry into the exponent being
    # the right rounding up; 65520 and up overflow to infinity; below 2^-14 float16's subnormal steps of 2^-24.
    b = x.view(np.uint32)
    for i in range(b.shape[0]):
        sign = (b[i] >> 16) & 0x8000
        e = (b[i] >> 23) & 0xFF
        if e == 255:  # infinity, or NaN (kept a NaN)
            half = 0x7C00 | (0x200 if b[i] & 0x7FFFFF else 0)
        elif e >= 113:  # |x| >= 2^-14
            r = (b[i] & 0x7FFFFFFF) + 0xFFF + ((b[i] >> 13) & 1)
            half = 0x7C00 if r >= 0x47800000 else (r >> 13) - (112 << 10)
        else:  # subnormal steps, exact in float64 but the one rint
            half = np.int64(np.rint(np.float64(abs(x[i])) * 16777216.0))
        out[i] = sign | half


def _exp(x: np.ndarray) -> np.ndarray:
    """e^x of float32 x <= 0 on arrays (``kernels.EXP_FLOOR``), the vector kernels' exp step for step (the Python
    fallback's, and their reference)."""
    f32 = np.float32
    kept = x >= f32(EXP_FLOOR)
    xc = np.where(kept, x, f32(0))
    n = np.rint(xc * f32(EXP_LOG2E))
    r = (xc - n * f32(EXP_LN2_HI)) - n * f32(EXP_LN2_LO)
    y = np.full_like(r, f32(EXP_POLY[0]))
    for c in EXP_POLY[1:]:
        y = y * r + f32(c)
    y = (y * (r * r) + r) + f32(1)
    return np.where(kept, np.ldexp(y, n.astype(np.int32)), np.where(np.isnan(x), x, f32(0)))


def _softmax(p: np.ndarray, lo: int, count: int, sink: np.float32) -> np.float32:
    # p: float32 flat scores; p[lo:lo + count] become e^(p - top), top the largest of them and the sink. Returns
    # their total and the sink's e^(sink - top): position i adds into lane i % LANES, in order, the lanes then
    # summed in halves (8 + 8, 4 + 4, 2 + 2, 1 + 1), then the sink's. One order for every row, which a vector runs.
    # The compiled kernel also writes the rest of its last vector, up to p[lo + count + LANES - 2].
    x = p[lo:lo + count]
    top = max(x.max(), sink)
    e = _exp(x - top)
    p[lo:lo + count] = e
    lanes = np.zeros(LANES, np.float32)
    for i in range(0, count, LANES):
        chunk = e[i:i + LANES]
        lanes[:len(chunk)] += chunk
    width = LANES
    while width > 1:
        width //= 2
        lanes = lanes[:width] + lanes[width:2 * width]
    return lanes[0] + _exp(np.array([sink - top], np.float32))[0]


def _rope_write(k: np.ndarray, v: np.ndarray, kt: np.ndarray, vc: np.ndarray, ks: np.ndarray, vs: np.ndarray,
                slots: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    # k: [M, KV, hd] and v: [M, KV, vd] new keys/values; kt: [NB, KV, hd, BS] and vc: [NB, KV, BS, vdp] one layer's
    # pool (float16 bits, or int8 codes with their scales ks: [NB, KV, hd/G, BS] and vs: [NB, KV, BS, vdp/G]; empty
    # for float16); slots: [M] block * BS + offset of each row's position; cos/sin: [M, hd] (sin carries
    # rotate_half's sign). A value's padding dims are stored as zeros.
    m, n_kv, hd = k.shape
    vd = v.shape[2]
    vdp = vc.shape[3]
    bs = kt.shape[3]
    half = hd // 2
    row = np.zeros(hd + vdp, np.float32)  # a head's rotated key, then its value
    for r in range(m):
        blk, off = slots[r] // bs, slots[r] % bs
        for kh in range(n_kv):  # x * cos + rotate_half(x) * sin
            for j in range(hd):
                js = j + half if j < half else j - half
                row[j] = k[r, kh, j] * cos[r, j] + k[r, kh, js] * sin[r, j]
            for j in range(vd):
                row[hd + j] = v[r, kh, j]
            store_row(row, hd, kt, vc, ks, vs, blk, kh, off)


def _store_half(row: np.ndarray, hd: int, kt: np.ndarray, vc: np.ndarray, ks: np.ndarray, vs: np.ndarray,
                blk: int, kh: int, off: int) -> None:
    # row: KV head kh's rotated key [hd] then value [vdp], written as float16 bits at position off of block blk
    bits = np.empty(row.shape[0], np.uint16)
    half_bits(row, bits)
    for j in range(hd):
        kt[blk, kh, j, off] = bits[j]
    for j in range(vc.shape[3]):
        vc[blk, kh, off, j] = bits[hd + j]


def _store_q8(row: np.ndarray, hd: int, kt: np.ndarray, vc: np.ndarray, ks: np.ndarray, vs: np.ndarray,
              blk: int, kh: int, off: int) -> None:
    # the same as int8 codes and their scales
    n = row.shape[0]
    codes = np.empty((1, n), np.int8)
    scales = np.empty((1, n // KV_GROUP), np.float32)
    q8_rows(row.reshape(1, n), KV_GROUP, codes, scales)
    for j in range(hd):
        kt[blk, kh, j, off] = codes[0, j]
    for g in range(hd // KV_GROUP):
        ks[blk, kh, g, off] = scales[0, g]
    for j in range(vc.shape[3]):
        vc[blk, kh, off, j] = codes[0, hd + j]
    for g in range(vs.shape[3]):
        vs[blk, kh, off, g] = scales[0, hd // KV_GROUP + g]


def _store_row(row: np.ndarray, hd: int, kt: np.ndarray, vc: np.ndarray, ks: np.ndarray, vs: np.ndarray,
               blk: int, kh: int, off: int) -> None:
    """A head's rotated key and value into the pool at position ``off`` of block ``blk``, as the pool holds them:
    compiled, the choice is made by kt's type (``_build``), so a float16 pool's build has no int8 code."""
    (_store_q8 if kt.dtype == np.int8 else _store_half)(row, hd, kt, vc, ks, vs, blk, kh, off)


_SCORE_VECTORS = (0,) + tuple(score_vectors(h) for h in range(1, 5))  # by heads, for the compiled dispatch


def _key_scores(q: np.ndarray, q_off: int, heads: int, hd: int, kt: np.ndarray, ks: np.ndarray, offs: np.ndarray,
                soffs: np.ndarray, stride: int, scores: np.ndarray, s_off: int, s_head: int) -> None:
    # q: float32 flat, ``heads`` query heads of hd dims from q_off; kt: the keys' float16 bits, flat; offs:
    # [SCORE_TILE] where each vector's LANES positions start at dim 0, the next dim ``stride`` further.
    # scores[s_off + h*s_head + t*LANES + o] = 0 + q_h[0] * k_t[0, o] + q_h[1] * k_t[1, o] + ..., in that order
    # (the compiled kernels fuse each step). int8 keys kt: each KV_GROUP dims' sum so, times its scales (ks, flat,
    # a vector's from soffs[t], the next block's ``stride`` further) added into the score in order of block.
    quantized = kt.dtype == np.int8
    keys = kt if quantized else kt.view(np.float16)
    for h in range(heads):
        for t in range(SCORE_TILE):
            total = np.zeros(LANES, np.float32)
            acc = np.zeros(LANES, np.float32)
            for j in range(hd):
                at = offs[t] + j * stride
                acc = acc + q[q_off + h * hd + j] * keys[at:at + LANES].astype(np.float32)
                if quantized and (j + 1) % KV_GROUP == 0:
                    at = soffs[t] + j // KV_GROUP * stride
                    total = total + acc * ks[at:at + LANES]
                    acc = np.zeros(LANES, np.float32)
            at = s_off + h * s_head + t * LANES
            scores[at:at + LANES] = total if quantized else acc


def _value_sums(p: np.ndarray, p_off: int, count: int, vc: np.ndarray, vs: np.ndarray, v_off: int, v_stride: int,
                vs_off: int, vs_stride: int, d0: int, acc: np.ndarray, acc_off: int, vectors: int) -> None:
    # p: float32 flat, the weights of ``count`` positions from p_off; vc: the values' float16 bits, flat, the first
    # position's dims from v_off, the next ``v_stride`` further; acc[acc_off ...]: ``vectors`` vectors of dims
    # that each position's p_s * v_s is added to, in order of position (the compiled kernel fuses each step).
    # int8 values vc: p_s * (the scale of the vector's block) * the codes, the scales (vs, flat) of the first
    # position from vs_off, the next ``vs_stride`` further, the first vector's dims from d0.
    quantized = vc.dtype == np.int8
    values = vc if quantized else vc.view(np.float16)
    n = vectors * LANES
    sums = acc[acc_off:acc_off + n].copy()
    for s in range(count):
        at = v_off + s * v_stride
        if quantized:
            for c in range(vectors):
                w = p[p_off + s] * vs[vs_off + s * vs_stride + (d0 + c * LANES) // KV_GROUP]
                sums[c * LANES:(c + 1) * LANES] = (sums[c * LANES:(c + 1) * LANES]
                                                   + w * values[at + c * LANES:at + (c + 1) * LANES].astype(np.float32))
        else:
            sums = sums + p[p_off + s] * values[at:at + n].astype(np.float32)
    acc[acc_off:acc_off + n] = sums


def _attend(q: np.ndarray, kt: np.ndarray, vc: np.ndarray, ks: np.ndarray, vs: np.ndarray, tables: np.ndarray,
            row_seq: np.ndarray, firsts: np.ndarray, lengths: np.ndarray, q_cos: np.ndarray, q_sin: np.ndarray,
            softcap: np.float32, sinks: np.ndarray, heads: int, out: np.ndarray) -> None:
    # q: [M, H, hd] (RoPE applied here with the scaled q_ tables [M, hd]); kt/vc/ks/vs: one layer's pool (as
    # ``rope_write`` takes it);
    # tables: [S, max_blocks] block ids of each sequence; row_seq: [M] its sequence; each row sees positions
    # firsts[r] .. lengths[r] - 1 (its own position + 1; firsts 0 but under a sliding window); softcap > 0: each
    # score becomes tanh(score / softcap) * softcap (Gemma 2); sinks: [H] one more logit in each head's softmax,
    # which takes no value (gpt-oss; -inf: none, its exp is 0). out: [M, H*vd], vd the values' dims.
    # Work items are (row, KV head, ``heads`` query heads): a KV head's g query heads, each key vector widened once
    # for up to four of them, or one head an item where there are too few for the threads (``attend_heads``);
    # each head's operations are the same either way. Query head h reads KV head h // g (HF's repeat_kv); the softmax
    # is normalised after P @ V.
    m, n_heads, hd = q.shape
    n_kv = kt.shape[1]
    bs = kt.shape[3]
    vdp = vc.shape[3]
    vd = out.shape[1] // n_heads
    per_kv = n_heads // n_kv // heads  # items a (row, KV head)
    half = hd // 2
    block_vectors = bs // LANES
    value_vectors = vdp // LANES
    key_groups, value_groups = ks.shape[2], vs.shape[3]  # int8: scales a key, a value; float16: 0
    kt_flat, vc_flat, ks_flat, vs_flat = kt.reshape(-1), vc.reshape(-1), ks.reshape(-1), vs.reshape(-1)
    for item in prange(m * n_kv * per_kv):
        r, kh = item // (n_kv * per_kv), item // per_kv % n_kv
        g = heads
        h0 = kh * (n_heads // n_kv) + item % per_kv * heads  # the item's first query head
        table = tables[row_seq[r]]
        s0, s_len = firsts[r], lengths[r]
        b0, b1 = s0 // bs, (s_len + bs - 1) // bs  # the blocks the row sees
        base = b0 * bs  # the position of each head's first score
        n_vec = (b1 - b0) * block_vectors
        width = (n_vec + SCORE_TILE - 1) // SCORE_TILE * SCORE_TILE * LANES  # scores a head, whole tiles
        stride = width + LANES  # and room for softmax's last vector, which may start mid-block
        qr = np.empty(g * hd, np.float32)
        scores = np.empty(g * stride, np.float32)
        offs = np.empty(SCORE_TILE, np.int64)
        soffs = np.empty(SCORE_TILE, np.int64)
        for hh in range(g):
            h = h0 + hh
            for j in range(hd):
                js = j + half if j < half else j - half
                qr[hh * hd + j] = q[r, h, j] * q_cos[r, j] + q[r, h, js] * q_sin[r, j]
        for t0 in range(0, n_vec, SCORE_TILE):
            for t in range(SCORE_TILE):
                vec = min(t0 + t, n_vec - 1)  # a tile past the last vector repeats it; those scores are not read
                blk = table[b0 + vec // block_vectors]
                offs[t] = (blk * n_kv + kh) * hd * bs + vec % block_vectors * LANES
                soffs[t] = (blk * n_kv + kh) * key_groups * bs + vec % block_vectors * LANES
            key_scores(qr, 0, g, hd, kt_flat, ks_flat, offs, soffs, bs, scores, t0 * LANES, stride)
        pv = np.empty(vdp, np.float32)
        for hh in range(g):
            h = h0 + hh
            p = scores[hh * stride:(hh + 1) * stride]
            if softcap > 0:
                for s in range(s0 - base, s_len - base):
                    p[s] = np.float32(np.tanh(p[s] / softcap)) * softcap
            total = softmax(p, s0 - base, s_len - s0, sinks[h])
            pv[:] = np.float32(0)
            for b in range(b0, b1):  # P @ V, a block's positions at a time
                lo, hi = max(s0, b * bs), min(s_len, b * bs + bs)
                at = (table[b] * n_kv + kh) * bs + lo - b * bs  # the run's first position in the pool
                for c in range(0, value_vectors, VALUE_TILE):
                    value_sums(p, lo - base, hi - lo, vc_flat, vs_flat, at * vdp + c * LANES, vdp, at * value_groups,
                               value_groups, c * LANES, pv, c * LANES, min(VALUE_TILE, value_vectors - c))
            o0 = h * vd
            for j in range(vd):
                out[r, o0 + j] = pv[j] / total


def _num_threads() -> int:
    """numba's thread count where compiled; one in the Python fallback."""
    return 1


def attend_heads(m: int, n_heads: int, n_kv: int) -> int:
    """Query heads an ``attend`` work item takes: a KV head's all (sharing each key vector), or one where the
    (row, KV head) items would be fewer than twice the threads (a decode step)."""
    return 1 if m * n_kv < 2 * _num_threads() else n_heads // n_kv


def _q8_rows(x: np.ndarray, group: int, codes: np.ndarray, scales: np.ndarray) -> None:
    """``contract.compiled_q8_rows``'s call on numpy: x [M, K] into int8 codes [M, K] and scales [M, K/group]."""
    codes[:], scales[:] = quantize_activations(x, group)


half_bits: Any = _half_bits
q8_rows: Any = _q8_rows
store_row: Any = _store_row
rope_write: Any = _rope_write
key_scores: Any = _key_scores
value_sums: Any = _value_sums
softmax: Any = _softmax
attend: Any = _attend


def _build() -> None:
    global half_bits, q8_rows, rope_write, key_scores, value_sums, softmax, attend, _num_threads
    try:
        import numba
        from numba import njit, types
        from numba.extending import overload

        from kestrel_core.codegen import native_half
        from kestrel_core.contract import compiled_q8_rows
    except Exception as exc:  # numba missing: the plain-Python loops (correct, slow)
        log.debug("compiled attention kernels unavailable: %s", exc)
        return
    _num_threads = numba.get_num_threads
    native = native_half()
    scores_1, scores_2, scores_3, scores_4 = (make_key_scores(h, native) for h in range(1, 5))
    softmax = make_softmax()

    @njit(inline="always")
    def key_scores_any(q: Any, q_off: Any, heads: Any, hd: Any, kt: Any, ks: Any, offs: Any, soffs: Any,
                       stride: Any, scores: Any, s_off: Any, s_head: Any) -> None:
        h = 0
        while h < heads:  # four heads a kernel, then the rest; each head's sums are the same whichever
            n = min(4, heads - h)
            for o in range(0, SCORE_TILE, _SCORE_VECTORS[n]):
                at, s_at = q_off + h * hd, s_off + h * s_head + o * LANES
                if n == 4:
                    scores_4(q, at, hd, kt, ks, offs, soffs, o, stride, scores, s_at, s_head)
                elif n == 3:
                    scores_3(q, at, hd, kt, ks, offs, soffs, o, stride, scores, s_at, s_head)
                elif n == 2:
                    scores_2(q, at, hd, kt, ks, offs, soffs, o, stride, scores, s_at, s_head)
                else:
                    scores_1(q, at, hd, kt, ks, offs, soffs, o, stride, scores, s_at, s_head)
            h += n

    key_scores = key_scores_any
    sums_1, sums_2, sums_3, sums_4 = (make_value_sums(n, native) for n in range(1, VALUE_TILE + 1))

    @njit(inline="always")
    def value_sums_any(p: Any, p_off: Any, count: Any, vc: Any, vs: Any, v_off: Any, v_stride: Any, vs_off: Any,
                       vs_stride: Any, d0: Any, acc: Any, acc_off: Any, vectors: Any) -> None:
        if vectors == 4:
            sums_4(p, p_off, count, vc, vs, v_off, v_stride, vs_off, vs_stride, d0, acc, acc_off)
        elif vectors == 3:
            sums_3(p, p_off, count, vc, vs, v_off, v_stride, vs_off, vs_stride, d0, acc, acc_off)
        elif vectors == 2:
            sums_2(p, p_off, count, vc, vs, v_off, v_stride, vs_off, vs_stride, d0, acc, acc_off)
        else:
            sums_1(p, p_off, count, vc, vs, v_off, v_stride, vs_off, vs_stride, d0, acc, acc_off)

    value_sums = value_sums_any
    half_bits = njit(cache=True, nogil=True)(_half_bits)  # a global rope_write resolves when it compiles
    q8_rows = compiled_q8_rows()
    @overload(_store_row, inline="always")
    def _store_row_typed(row: np.ndarray, hd: int, kt: np.ndarray, vc: np.ndarray, ks: np.ndarray, vs: np.ndarray,
                         blk: int, kh: int, off: int) -> Any:  # numba compares it with the implementations' own
        return _store_q8 if kt.dtype == types.int8 else _store_half

    rope_write = njit(cache=True, nogil=True)(_rope_write)
    attend = njit(cache=True, nogil=True, parallel=True)(_attend)


_build()
