"""Compiled host maths of the decoder (numba): norms (RMSNorm, LayerNorm), the MLP's SiLU and GELU, MoE routing,
latent attention's per-head projections, linear attention (Gated DeltaNet), short convolutions and Mamba-2 scans over
the rows of a batch (paged attention is paged_attention.py's).

Every kernel computes each row on its own, with one fixed sequence of float32 operations (no fastmath: no
FMA contraction, no reassociation) and sequential sums, so a row's bits do not depend on how many rows run
with it, which sequences they belong to, or how a prompt was split into chunks: a token's logits are the
same whether it is decoded alone, in a batch of 64, or teacher-forced in a prefill. Batching and chunked
prefill therefore change no result, and a preempted sequence recomputed later gets its cache back bit for bit.

Where numba is missing the same functions run as plain Python, with the same results and far slower (numba is
a dependency: this only keeps a broken install working).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger("kestrel")

# e^x for float32 x <= 0 (a softmax's shifted logits, SiLU's e^-|g|) in float32 steps that vectorize (numba's np.exp is
# a scalar libm call a value): Cephes' expf, x = n ln2 + r with ln2 in two parts, a degree-7 polynomial in r, 2^n put
# into the exponent; within 2 ulp of e^x. Below EXP_FLOOR (e^x < 4.4e-38, under float32's normal range) it gives 0;
# NaN stays NaN. The same steps: ``gated_mul`` here, paged_attention's vector softmax and its numpy twin ``_exp``.
EXP_FLOOR = -86.0
EXP_LOG2E = 1.44269504088896341
EXP_LN2_HI, EXP_LN2_LO = 0.693359375, -2.12194440e-4
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_FLOOR32, _LOG2E32, _HI32, _LO32 = (np.float32(v) for v in (EXP_FLOOR, EXP_LOG2E, EXP_LN2_HI, EXP_LN2_LO))
_ZERO32, _ONE32 = np.float32(0), np.float32(1)
_P0, _P1, _P2, _P3, _P4, _P5 = (np.float32(c) for c in EXP_POLY)
_TWO_SQRT_2_OVER_PI, _GELU_CUBIC = np.float32(2 * 0.7978845608028654), np.float32(0.044715)


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


def _layernorm_rows(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    # x, out: [R, D]; weight: [D]. out = (x - mean) / sqrt(mean((x - mean)^2) + eps) * weight (a LayerNorm without a
    # bias, Cohere's), the mean and the variance each a sequential sum per row.
    r, d = x.shape
    for i in range(r):
        s = np.float32(0)
        for j in range(d):
            s += x[i, j]
        mean = s / np.float32(d)
        ss = np.float32(0)
        for j in range(d):
            t = x[i, j] - mean
            ss += t * t
        inv = np.float32(1) / np.sqrt(ss / np.float32(d) + eps)
        for j in range(d):
            out[i, j] = (x[i, j] - mean) * inv * weight[j]


def _gated_mul(gate: np.ndarray, up: np.ndarray, gelu: bool) -> None:
    # gate, up: [M, F]; gate becomes act(gate) * up with act(g) = g * sigmoid(z): z = g (SiLU), or for the tanh
    # GELU (0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), as torch's approximate="tanh") z = 2u. The
    # sigmoid is 1 / (1 + e) for z >= 0 and e / (1 + e) below, e = e^-|z| (an exp that cannot overflow). Three
    # passes a row, each vectorized: the exp's polynomial, its 2^n added into the exponent bits, the rest.
    m, f = gate.shape
    z = np.empty(f, np.float32)
    y = np.empty(f, np.float32)
    n = np.empty(f, np.int32)
    y_bits = y.view(np.int32)
    for i in range(m):
        for j in range(f):
            g = gate[i, j]
            z[j] = _TWO_SQRT_2_OVER_PI * (g + _GELU_CUBIC * (g * g * g)) if gelu else g
            x = -abs(z[j])
            xc = x if x >= _FLOOR32 else _ZERO32
            nf = np.rint(xc * _LOG2E32)
            r = (xc - nf * _HI32) - nf * _LO32
            p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
            y[j] = (p * (r * r) + r) + _ONE32
            n[j] = np.int32(nf)
        for j in range(f):
            y_bits[j] += n[j] << 23
        for j in range(f):
            x = -abs(z[j])
            e = y[j] if x >= _FLOOR32 else (x if x != x else _ZERO32)
            gate[i, j] = gate[i, j] * ((_ONE32 if z[j] >= _ZERO32 else e) / (_ONE32 + e)) * up[i, j]


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


conv_step: Any = _conv_step
rmsnorm_rows: Any = _rmsnorm_rows
layernorm_rows: Any = _layernorm_rows
gated_mul: Any = _gated_mul
rows_dot: Any = _rows_dot
heads_matmul: Any = _heads_matmul
gated_delta: Any = _gated_delta
short_conv: Any = _short_conv
mamba2: Any = _mamba2


def _build() -> None:
    global conv_step, rmsnorm_rows, layernorm_rows, gated_mul, rows_dot, heads_matmul, gated_delta, short_conv, mamba2
    global prange
    try:
        import numba
        from numba import njit
    except Exception as exc:  # numba missing: the plain-Python loops (correct, slow)
        log.debug("compiled decoder kernels unavailable: %s", exc)
        return
    prange = numba.prange  # a global the parallel kernels resolve when they compile
    jit = njit(cache=True, nogil=True)
    conv_step = njit(cache=True, nogil=True, inline="always")(_conv_step)  # inlined into the recurrent kernels
    rmsnorm_rows = jit(_rmsnorm_rows)
    layernorm_rows = jit(_layernorm_rows)
    gated_mul = jit(_gated_mul)
    rows_dot = jit(_rows_dot)
    short_conv = jit(_short_conv)
    heads_matmul = njit(cache=True, nogil=True, parallel=True)(_heads_matmul)
    gated_delta = njit(cache=True, nogil=True, parallel=True)(_gated_delta)
    mamba2 = njit(cache=True, nogil=True, parallel=True)(_mamba2)


_build()
