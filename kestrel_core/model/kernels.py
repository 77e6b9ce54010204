"""Compiled host maths of the decoder (numba): norms, RoPE, paged attention, MoE routing, linear attention (Gated
DeltaNet), short convolutions and Mamba-2 scans over the rows of a batch.

Every kernel computes each row on its own, with one fixed sequence of float32 operations (no fastmath: no
FMA contraction, no reassociation) and sequential sums, so a row's bits do not depend on how many rows run
with it, which sequences they belong to, or how a prompt was split into chunks: a token's logits are the
same whether it is decoded alone, in a batch of 64, or teacher-forced in a prefill. Batching and chunked
prefill therefore change no result, and a preempted sequence recomputed later gets its cache back bit for bit.

Keys and values are cached at float16 precision, rounded to nearest, ties to even (``_f16``), as llama.cpp's
and vLLM's caches hold them: a device backend stores them in half the bytes of float32 and reads them back
exactly. The host pool keeps them in float32 arrays.

Attention dot products run with the positions as the inner, independent loop over keys stored transposed
([blocks, KV, hd, block]), so LLVM vectorises them without reassociating anything.

Where numba is missing the same functions run as plain Python, with the same results and far slower (numba is
a dependency: this only keeps a broken install working).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger("kestrel")


def _rmsnorm_rows(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    # x, out: [R, D]; weight: [D]. out = x / sqrt(mean(x^2) + eps) * weight, a sequential sum per row.
    r, d = x.shape
    for i in range(r):
        ss = np.float32(0)
        for j in range(d):
            ss += x[i, j] * x[i, j]
        inv = np.float32(1) / np.sqrt(ss / np.float32(d) + eps)
        for j in range(d):
            out[i, j] = x[i, j] * inv * weight[j]


def _f16(x: np.ndarray) -> None:
    # x: float32 [n], rounded in place to the nearest IEEE binary16 value (ties to even), kept as float32:
    # an 11-bit significand from 2^-14 up, steps of 2^-24 below, +-inf from 65520 on (CUDA's
    # __float2half_rn, numpy's astype(float16)). On the bits: add half a float16 step less one (plus the
    # kept lowest bit, for ties) and truncate; a carry into the exponent is the right rounding up.
    b = x.view(np.uint32)
    for i in range(b.shape[0]):
        e = (b[i] >> 23) & 0xFF
        if e >= 113 and e < 255:  # |x| >= 2^-14, finite
            r = (b[i] + np.uint32(0xFFF) + ((b[i] >> 13) & 1)) & np.uint32(0xFFFFE000)
            if (r & np.uint32(0x7FFFFFFF)) >= np.uint32(0x47800000):  # 65536 and up: overflow
                r = (b[i] & np.uint32(0x80000000)) | np.uint32(0x7F800000)
            b[i] = r
        elif e < 113:  # float16's subnormal steps, exact in float64 but the one rint
            x[i] = np.float32(np.rint(np.float64(x[i]) * 16777216.0) / 16777216.0)


def _rope_write(k: np.ndarray, v: np.ndarray, kt: np.ndarray, vc: np.ndarray, slots: np.ndarray,
                cos: np.ndarray, sin: np.ndarray) -> None:
    # k: [M, KV, hd] and v: [M, KV, vd] new keys/values; kt: [NB, KV, hd, BS] and vc: [NB, BS, KV, vd] one layer's
    # pool; slots: [M] block * BS + offset of each row's position; cos/sin: [M, hd] (sin carries rotate_half's
    # sign). Both are stored rounded to float16 (f16).
    m, n_kv, hd = k.shape
    vd = v.shape[2]
    bs = kt.shape[3]
    half = hd // 2
    row = np.empty(hd + vd, np.float32)  # a head's rotated key, then its value
    for r in range(m):
        blk, off = slots[r] // bs, slots[r] % bs
        for kh in range(n_kv):  # x * cos + rotate_half(x) * sin
            for j in range(hd):
                js = j + half if j < half else j - half
                row[j] = k[r, kh, j] * cos[r, j] + k[r, kh, js] * sin[r, j]
            for j in range(vd):
                row[hd + j] = v[r, kh, j]
            f16(row)
            for j in range(hd):
                kt[blk, kh, j, off] = row[j]
            for j in range(vd):
                vc[blk, off, kh, j] = row[hd + j]


def _attend(q: np.ndarray, kt: np.ndarray, vc: np.ndarray, tables: np.ndarray, row_seq: np.ndarray,
            firsts: np.ndarray, lengths: np.ndarray, q_cos: np.ndarray, q_sin: np.ndarray, softcap: np.float32,
            sinks: np.ndarray, heads: int, out: np.ndarray) -> None:
    # q: [M, H, hd] (RoPE applied here with the scaled q_ tables [M, hd]); kt/vc: one layer's pool; tables:
    # [S, max_blocks] block ids of each sequence; row_seq: [M] its sequence; each row sees positions
    # firsts[r] .. lengths[r] - 1 (its own position + 1; firsts 0 but under a sliding window); softcap > 0: each
    # score becomes tanh(score / softcap) * softcap (Gemma 2); sinks: [H] one more logit in each head's softmax,
    # which takes no value (gpt-oss; -inf: none, exp gives exactly 0). out: [M, H*vd], vd the values' dims.
    # Work items are (row, KV head, ``heads`` query heads): a KV head's g query heads share each key load, or one
    # head an item where there are too few for the threads (``attend_heads``); each head's operations are the
    # same either way. Query head h reads KV head h // g (HF's repeat_kv); softmax normalised after P @ V.
    m, n_heads, hd = q.shape
    n_kv = kt.shape[1]
    bs = kt.shape[3]
    vd = vc.shape[3]
    per_kv = n_heads // n_kv // heads  # items a (row, KV head)
    half = hd // 2
    for item in prange(m * n_kv * per_kv):
        r, kh = item // (n_kv * per_kv), item // per_kv % n_kv
        g = heads
        h0 = kh * (n_heads // n_kv) + item % per_kv * heads  # the item's first query head
        table = tables[row_seq[r]]
        s0, s_len = firsts[r], lengths[r]
        n_blocks = (s_len + bs - 1) // bs
        qr = np.empty((g, hd), np.float32)
        scores = np.empty((g, n_blocks * bs), np.float32)
        acc = np.empty((g, bs), np.float32)
        for hh in range(g):
            h = h0 + hh
            for j in range(hd):
                js = j + half if j < half else j - half
                qr[hh, j] = q[r, h, j] * q_cos[r, j] + q[r, h, js] * q_sin[r, j]
        for b in range(n_blocks):  # scores = q . k, summed over j in order for every position
            keys = kt[table[b], kh]  # [hd, BS]
            acc[:] = np.float32(0)
            for j in range(hd):
                row = keys[j]
                for hh in range(g):
                    qj = qr[hh, j]
                    for o in range(bs):  # independent lanes, vectorised
                        acc[hh, o] += qj * row[o]
            for hh in range(g):
                for o in range(bs):
                    score = acc[hh, o]
                    if softcap > 0:
                        score = np.float32(np.tanh(score / softcap)) * softcap
                    scores[hh, b * bs + o] = score
        pv = np.empty(vd, np.float32)
        for hh in range(g):
            h = h0 + hh
            sink = sinks[h]
            top = scores[hh, s0]
            for s in range(s0 + 1, s_len):
                if scores[hh, s] > top:
                    top = scores[hh, s]
            if sink > top:
                top = sink
            total = np.float32(0)
            for s in range(s0, s_len):
                e = np.exp(scores[hh, s] - top)
                scores[hh, s] = e
                total += e
            total += np.exp(sink - top)
            pv[:] = np.float32(0)
            for s in range(s0, s_len):  # P @ V
                p = scores[hh, s]
                vrow = vc[table[s // bs], s % bs, kh]  # [vd]
                for j in range(vd):
                    pv[j] += p * vrow[j]
            o0 = h * vd
            for j in range(vd):
                out[r, o0 + j] = pv[j] / total


def _heads_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    # x: [M, H, K]; w: [H, K, N] float32 (each head its own matrix); out: [M, H, N] = x[m, h] @ w[h], summed over k in
    # order for every (m, h), N the vectorised lanes (a latent attention's absorbed key and value projections)
    m, n_heads, k = x.shape
    n = w.shape[2]
    for item in prange(m * n_heads):
        r, h = item // n_heads, item % n_heads
        acc = np.zeros(n, np.float32)
        for j in range(k):
            xj = x[r, h, j]
            wj = w[h, j]
            for c in range(n):  # independent lanes, vectorised
                acc[c] += xj * wj[c]
        out[r, h] = acc


# rows_dot's partial sums: element j goes to lane j % DOT_LANES, the lanes then summed pairwise. One order for every
# M, and one LLVM vectorizes, where a single sequential sum runs one dependent add at a time: decoder.route at
# qwen3-30b-a3b's shapes (one row, 128 experts of width 2048) 231 -> 43 us; 8 to 32 lanes stayed scalar (~78 us
# for the dot alone, against 28 at 64)
DOT_LANES = 64


def _rows_dot(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    # x: [M, D]; w: [N, D] float32 (a router); out: [M, N] = x @ w.T in DOT_LANES strided partial sums
    m, d = x.shape
    n = w.shape[0]
    body = d - d % DOT_LANES
    acc = np.zeros(DOT_LANES, np.float32)
    for r in range(m):
        xr = x[r]
        for e in range(n):
            wr = w[e]
            acc[:] = 0
            for j in range(0, body, DOT_LANES):
                for lane in range(DOT_LANES):
                    acc[lane] += xr[j + lane] * wr[j + lane]
            for j in range(body, d):
                acc[j - body] += xr[j] * wr[j]
            width = DOT_LANES
            while width > 1:
                width //= 2
                for lane in range(width):
                    acc[lane] += acc[lane + width]
            out[r, e] = acc[0]


def _conv_step(st: np.ndarray, conv_w: np.ndarray, ch: int, v: np.float32, acc: np.float32) -> np.float32:
    # Channel ch of a causal depthwise convolution at a new input v: acc (0, or a bias) plus conv_w[ch] [W] (oldest
    # tap first) over st[:, ch], the channel's last W-1 inputs (oldest first), and v; st then moves on to v.
    w = conv_w.shape[1]
    for j in range(w - 1):
        acc += conv_w[ch, j] * st[j, ch]
    acc += conv_w[ch, w - 1] * v
    for j in range(w - 2):
        st[j, ch] = st[j + 1, ch]
    if w > 1:
        st[w - 2, ch] = v
    return acc


def _gated_delta(qkv: np.ndarray, beta_in: np.ndarray, alpha_in: np.ndarray, conv_w: np.ndarray, decay: np.ndarray,
                 dt_bias: np.ndarray, conv_state: np.ndarray, ssm: np.ndarray, row_slot: np.ndarray, n_k: int,
                 dk: int, dv: int, out: np.ndarray) -> None:
    # One linear-attention layer (Gated DeltaNet) over the rows, each sequence's rows in position order.
    # qkv: [M, C] q|k|v before the causal depthwise convolution conv_w [C, W] (oldest tap first); beta_in, alpha_in:
    # [M, Hv]; decay: [Hv] (-exp(A_log)); conv_state: [slots, W-1, C] each sequence's last W-1 inputs, oldest
    # first; ssm: [slots, Hv, dk, dv]; row_slot: [M] each row's state slot. out: [M, Hv*dv] the delta rule's output.
    # Per row: x = silu(conv), q and k L2-normed per head (q also by 1/sqrt(dk)); value head h reads key head
    # h // (Hv / Hk); S = S * exp(decay * softplus(alpha + dt_bias)); S += k (beta (v - S^T k))^T; o = S^T q.
    m, c = qkv.shape
    n_v = out.shape[1] // dv
    kd = n_k * dk
    group = n_v // n_k
    scale = np.float32(1) / np.sqrt(np.float32(dk))
    x = np.empty(c, np.float32)
    qn = np.empty(kd, np.float32)
    kn = np.empty(kd, np.float32)
    for r in range(m):
        st = conv_state[row_slot[r]]  # [W-1, C]
        for ch in range(c):
            acc = conv_step(st, conv_w, ch, qkv[r, ch], np.float32(0))
            x[ch] = acc / (np.float32(1) + np.exp(-acc))
        for h in range(n_k):
            sq = np.float32(0)
            sk = np.float32(0)
            for j in range(dk):
                sq += x[h * dk + j] * x[h * dk + j]
                sk += x[kd + h * dk + j] * x[kd + h * dk + j]
            iq = np.float32(1) / np.sqrt(sq + np.float32(1e-6))
            ik = np.float32(1) / np.sqrt(sk + np.float32(1e-6))
            for j in range(dk):
                qn[h * dk + j] = x[h * dk + j] * iq * scale
                kn[h * dk + j] = x[kd + h * dk + j] * ik
        s = ssm[row_slot[r]]  # [Hv, dk, dv]
        for hv in prange(n_v):
            k0 = (hv // group) * dk
            v0 = 2 * kd + hv * dv
            beta = np.float32(1) / (np.float32(1) + np.exp(-beta_in[r, hv]))
            a = alpha_in[r, hv] + dt_bias[hv]
            soft = a if a > np.float32(20) else np.float32(np.log1p(np.exp(a)))  # torch's softplus
            gate = np.float32(np.exp(decay[hv] * soft))
            delta = np.zeros(dv, np.float32)
            for j in range(dk):
                kj = kn[k0 + j]
                for e in range(dv):
                    s[hv, j, e] *= gate
                    delta[e] += s[hv, j, e] * kj
            for e in range(dv):
                delta[e] = (x[v0 + e] - delta[e]) * beta
                out[r, hv * dv + e] = np.float32(0)
            for j in range(dk):
                kj = kn[k0 + j]
                qj = qn[k0 + j]
                for e in range(dv):
                    s[hv, j, e] += kj * delta[e]
                    out[r, hv * dv + e] += s[hv, j, e] * qj


def _short_conv(bcx: np.ndarray, conv_w: np.ndarray, conv_state: np.ndarray, row_slot: np.ndarray,
                out: np.ndarray) -> None:
    # One short-convolution layer (LFM2) over the rows, each sequence's rows in position order. bcx: [M, 3D] the
    # rows' B | C | x; conv_w: [D, W] (oldest tap first); conv_state: [slots, W-1, D] each sequence's last W-1
    # values of B * x, oldest first; row_slot: [M]. out: [M, D] = C * conv(B * x).
    m = bcx.shape[0]
    d = conv_w.shape[0]
    for r in range(m):
        st = conv_state[row_slot[r]]  # [W-1, D]
        for ch in range(d):
            bx = bcx[r, ch] * bcx[r, 2 * d + ch]
            out[r, ch] = bcx[r, d + ch] * conv_step(st, conv_w, ch, bx, np.float32(0))


def _mamba2(proj: np.ndarray, conv_w: np.ndarray, conv_b: np.ndarray, a: np.ndarray, dt_bias: np.ndarray,
            d_skip: np.ndarray, conv_state: np.ndarray, ssm: np.ndarray, row_slot: np.ndarray, groups: int,
            n: int, out: np.ndarray) -> None:
    # One Mamba-2 layer's selective scan over the rows, each sequence's rows in position order. proj: [M, inner +
    # C + H] the rows' z | x|B|C | dt (z is the caller's); conv_w: [C, W] (oldest tap first), conv_b: [C];
    # a: [H] (-exp(A_log)); dt_bias, d_skip: [H]; conv_state: [slots, W-1, C]; ssm: [slots, H, P, N];
    # row_slot: [M]. out: [M, inner] = per head h (P channels, group g = h // (H / groups)):
    # dt = softplus(dt_in + dt_bias); S = S * exp(dt * a) + dt * x (x) B_g; y = S C_g + D * x, x|B|C = silu(conv).
    m = proj.shape[0]
    c = conv_w.shape[0]
    inner = out.shape[1]
    h_count = a.shape[0]
    p = inner // h_count
    per_group = h_count // groups
    xbc = np.empty(c, np.float32)
    for r in range(m):
        st = conv_state[row_slot[r]]  # [W-1, C]
        for ch in range(c):
            acc = conv_step(st, conv_w, ch, proj[r, inner + ch], conv_b[ch])
            xbc[ch] = acc / (np.float32(1) + np.exp(-acc))
        s = ssm[row_slot[r]]  # [H, P, N]
        for h in prange(h_count):
            g = h // per_group
            b0, c0 = inner + g * n, inner + groups * n + g * n
            t = proj[r, inner + c + h] + dt_bias[h]
            dt = t if t > np.float32(20) else np.float32(np.log1p(np.exp(t)))  # torch's softplus
            decay = np.float32(np.exp(dt * a[h]))
            for q in range(p):
                xv = xbc[h * p + q]
                acc = np.float32(0)
                for k in range(n):
                    s[h, q, k] = s[h, q, k] * decay + dt * xv * xbc[b0 + k]
                    acc += s[h, q, k] * xbc[c0 + k]
                out[r, h * p + q] = acc + d_skip[h] * xv


def prange(*args: int) -> range:
    """numba's parallel range where compiled; a plain range in the Python fallback."""
    return range(*args)


def _num_threads() -> int:
    """numba's thread count where compiled; one in the Python fallback."""
    return 1


def attend_heads(m: int, n_heads: int, n_kv: int) -> int:
    """Query heads an ``attend`` work item takes: a KV head's all (its key loads shared), or one where the (row,
    KV head) items would be fewer than twice the threads (a decode step)."""
    return 1 if m * n_kv < 2 * _num_threads() else n_heads // n_kv


f16: Any = _f16
conv_step: Any = _conv_step
rmsnorm_rows: Any = _rmsnorm_rows
rope_write: Any = _rope_write
attend: Any = _attend
rows_dot: Any = _rows_dot
heads_matmul: Any = _heads_matmul
gated_delta: Any = _gated_delta
short_conv: Any = _short_conv
mamba2: Any = _mamba2


def _build() -> None:
    global f16, conv_step, rmsnorm_rows, rope_write, attend, rows_dot, heads_matmul, gated_delta, short_conv, mamba2
    global prange, _num_threads
    try:
        import numba
        from numba import njit
    except Exception as exc:  # numba missing: the plain-Python loops (correct, slow)
        log.debug("compiled decoder kernels unavailable: %s", exc)
        return
    prange = numba.prange  # a global the parallel kernels resolve when they compile
    _num_threads = numba.get_num_threads
    jit = njit(cache=True, nogil=True)
    f16 = jit(_f16)  # a global rope_write resolves when it compiles
    conv_step = njit(cache=True, nogil=True, inline="always")(_conv_step)  # inlined into the recurrent kernels
    rmsnorm_rows = jit(_rmsnorm_rows)
    rope_write = jit(_rope_write)
    rows_dot = jit(_rows_dot)
    short_conv = jit(_short_conv)
    attend = njit(cache=True, nogil=True, parallel=True)(_attend)
    heads_matmul = njit(cache=True, nogil=True, parallel=True)(_heads_matmul)
    gated_delta = njit(cache=True, nogil=True, parallel=True)(_gated_delta)
    mamba2 = njit(cache=True, nogil=True, parallel=True)(_mamba2)


_build()
