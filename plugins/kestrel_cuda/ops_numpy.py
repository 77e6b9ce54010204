"""The numpy mirror of the whole-step forward's kernels: ``NumpyOps``, the interface ``DeviceForward`` runs on.

``DeviceForward`` only allocates arrays through ``ops.xp`` and calls the methods below, so the whole
orchestration (sequences, chunks, splits, graph record/replay, layouts) runs on the CPU against these mirrors
in CI, and on the GPU against the kernels through ``ops_cupy.CupyOps``, which has the same methods. Arrays
passed in are 2-D row views (``x[:M]``, ``qkv[:M, col:col + n]``).

The mirrors follow the kernels' definitions, not their summation order, so the two agree to float32
rounding: both compute exact integer block sums of the same codes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kestrel_core.contract import quantize_activations
from kestrel_core.model.host_ops import gelu_tanh_mul, swiglu_oai_mul
from kestrel_cuda.gemm import SPLIT_MAX_M, split_fits
from kestrel_cuda.kernels import MMA_TILE_SPLIT_SMALL, MMA_TILES
from kestrel_cuda.layout import unpack_kmajor
from kestrel_cuda.plan import (
    EPI_ADD,
    KV_BLOCK,
    NO_SWIGLU,
    PRO_GELU_MUL,
    PRO_PLAIN,
    PRO_POSTNORM,
    PRO_RMSNORM,
    PRO_SILU_MUL,
    PRO_SWIGLU_OAI,
    SSQ_COLS,
    TILE_N,
    Lin,
    PostNorm,
    QkvRope,
    RouteFold,
    attend_folds,
    check_add_scale,
    check_expert_table,
    check_route_fold,
    expert_groups,
    ssq_count,
)


def _rms_from_tiles(tiles: np.ndarray, n: int, eps: float) -> np.float32:
    """A row's rms from its 32-column tiles' sums of squares, added in tile order (forward.cuh rms_from_tiles)."""
    return np.sqrt(tiles.sum(dtype=np.float32) / np.float32(n) + np.float32(eps))


def _prologue(x: np.ndarray, k: int, pro: int, pw: np.ndarray | None, eps: float, xoff: int,
              ssq: np.ndarray | None = None, swiglu: tuple[float, float] = NO_SWIGLU) -> np.ndarray:
    xv = np.asarray(x, np.float32)
    if pro == PRO_RMSNORM:  # the sum of squares of each row's 32-column tiles (M = 1: its producer's), in one order
        tiles = [ssq[:ssq_count(k)]] if ssq is not None else [_row_ssq(row) for row in xv[:, :k]]
        r = np.array([_rms_from_tiles(t, k, eps) for t in tiles], np.float32)[:, None]  # [M, 1]
        return xv[:, :k] / r * pw
    if pro == PRO_SILU_MUL:
        g = xv[:, :k]
        with np.errstate(over="ignore"):
            return g / (np.float32(1) + np.exp(-g)) * xv[:, xoff:xoff + k]
    if pro == PRO_GELU_MUL:
        return gelu_tanh_mul(xv[:, :k].copy(), xv[:, xoff:xoff + k])
    if pro == PRO_SWIGLU_OAI:
        return swiglu_oai_mul(xv[:, :k].copy(), xv[:, xoff:xoff + k], np.float32(swiglu[0]), np.float32(swiglu[1]))
    return xv[:, :k]


def _folded(x: np.ndarray, k: int, pw: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The norm fold's codes and scales of x * pw per 32 columns (gemm_tile.cuh NormFold) and each row's 1 / rms
    from its sums of squares per 128 columns, added in order (gemm_tma.cu row_rsqrt), [M, 1]."""
    h = np.asarray(x, np.float32)[:, :k]
    codes, scales = quantize_activations((h * pw[:k]).astype(np.float64), 32)
    tiles = (h * h).reshape(len(h), -1, 128).sum(axis=2, dtype=np.float32)  # [M, K / 128]
    ss = np.cumsum(tiles, axis=1, dtype=np.float32)[:, -1:]
    return codes, scales, np.float32(1) / np.sqrt(ss / np.float32(k) + np.float32(eps))


def _qgemv(lin: Lin, x: np.ndarray, pro: int, pw: np.ndarray | None, eps: float, xoff: int,
           ssq: np.ndarray | None, prenormed: bool = False, swiglu: tuple[float, float] = NO_SWIGLU) -> np.ndarray:
    """qgemv's sums [M, n]: exact integer block sums of the quantized prologue and ``lin``'s codes, scaled;
    ``prenormed``: the norm fold's codes of x instead, each row's sums times its 1 / rms."""
    m, g = x.shape[0], lin.group_size
    rinv = None
    if prenormed:
        a_codes, a_scales, rinv = _folded(x, lin.k, pw, eps)
    else:
        a_codes, a_scales = quantize_activations(_prologue(x, lin.k, pro, pw, eps, xoff, ssq, swiglu), g)  # [M, K]
    w = unpack_kmajor(lin.codes, lin.bits)[:lin.k]  # [K, Npad]
    ng = lin.k // g
    isum = np.einsum("mgi,gin->mgn", a_codes.reshape(m, ng, g).astype(np.int64),
                     w.reshape(ng, g, lin.npad).astype(np.int64))  # [M, ng, Npad], exact
    f = isum.astype(np.float32) * a_scales[:, :, None] * lin.scales[None]  # [M, ng, Npad]
    out = f.sum(axis=1, dtype=np.float32)[:, :lin.n]
    return out if rinv is None else out * rinv


def _postnorm(x: np.ndarray, k: int, pw: np.ndarray, eps: float, post: PostNorm) -> tuple[np.ndarray, np.ndarray]:
    """(h', rmsnorm(h', pw)) for h' = x + post.out (out·weight) / ro, the norms from post.stats as
    forward.cuh postnorm_rms forms them."""
    t = -(-k // TILE_N)
    s = post.stats[:4 * t].reshape(t, 4).sum(axis=0, dtype=np.float32)  # out², h·out·w, (out·w)², h²
    one, kf, e = np.float32(1), np.float32(k), np.float32(eps)
    ro = np.sqrt(s[0] * (one / kf) + e)
    io = one / ro
    rh = np.sqrt(np.maximum(s[3] + io * (np.float32(2) * s[1] + io * s[2]), 0) * (one / kf) + e)
    hn = np.asarray(x, np.float32)[:, :k] + post.out[:, :k] / ro
    return hn, hn / rh * pw


def _postnorm_stats(y: np.ndarray, post: PostNorm) -> np.ndarray:
    """The sums qgemv leaves for a post-norm, a float4 a column tile: y², h·y·w, (y·w)², h² (y: [1, D])."""
    d = y.shape[1]
    pad = -(-d // TILE_N) * TILE_N - d
    yv, h, w = (np.pad(np.asarray(a, np.float32).reshape(-1)[:d], (0, pad)).reshape(-1, TILE_N)
                for a in (y, post.h, post.weight))
    yw = yv * w
    return np.stack([yv * yv, h * yw, yw * yw, h * h], axis=1).sum(axis=2, dtype=np.float32).reshape(-1)


def _row_ssq(row: np.ndarray) -> np.ndarray:
    """Sums of squares per 32 columns of one row (what embed_rows / a residual-add GEMV leave in ssq_out)."""
    n = row.shape[-1]
    padded = np.zeros(ssq_count(n) * SSQ_COLS, np.float32)
    padded[:n] = row.reshape(-1)
    return (padded * padded).reshape(-1, SSQ_COLS).sum(axis=1, dtype=np.float32)


def _choose(logits: np.ndarray, experts: int, k: int, norm_topk: bool, sel: np.ndarray, wts: np.ndarray) -> None:
    """route.cuh route_top and route_weights on logits [M, R]: each row's k most probable experts into sel [M, k]
    (increasing), their weights (renormalised if norm_topk) into wts [M, k + 1], a shared gate's sigmoid last."""
    with np.errstate(over="ignore"):
        p = np.exp(logits[:, :experts] - logits[:, :experts].max(axis=1, keepdims=True))
    prob = p / p.sum(axis=1, keepdims=True)
    top = np.sort(np.argsort(-prob, axis=1, kind="stable")[:, :k], axis=1)  # [M, k], increasing
    w = np.take_along_axis(prob, top, axis=1)
    sel[...] = top
    wts[:, :k] = w / w.sum(axis=1, keepdims=True) if norm_topk else w
    if logits.shape[1] > experts:
        wts[:, k] = np.float32(1) / (np.float32(1) + np.exp(-logits[:, experts]))


def _route_fold(route: RouteFold, lin: Lin, x: np.ndarray, h: np.ndarray, hn: np.ndarray, eps: float) -> None:
    """The choice a RouteFold's blocks make beside the o projection: the router's totals over [h | Q(x)] (Q: the
    GEMV's own G = 32 codes times their scales), the experts of the most probable (the totals divided by the
    rms of h' = hn); the chosen totals (then the gate's) into wts, all of them into part, for moe_combine."""
    codes, scales = quantize_activations(np.asarray(x, np.float32)[:, :lin.k], 32)
    qa = (codes.reshape(-1, 32).astype(np.float32) * scales.reshape(-1, 1)).reshape(-1)  # [K]
    sums = (route.weights @ np.concatenate([np.asarray(h, np.float32).reshape(-1)[:lin.n], qa])).astype(np.float32)
    r = _rms_from_tiles(_row_ssq(hn[0]), lin.n, eps)
    _choose((sums / r)[None], route.experts, route.k, route.norm_topk, route.sel, route.wts)
    route.part[:route.rows] = sums  # the totals moe_combine weighs
    route.wts[0, :route.k] = sums[route.sel[0]]
    if route.rows > route.experts:
        route.wts[0, route.k] = sums[route.experts]


def _same_rows(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


class NumpyOps:
    """The kernels' math in numpy on host arrays; ``capture`` records calls and replays them."""

    xp = np
    name = "numpy"

    def __init__(self, cluster: bool = False) -> None:
        self.cluster = cluster  # plan M=1 GEMVs' K splits as clusters, as CupyOps does on sm_90
        self._recording: list[Callable[[], None]] | None = None
        self.launches = 0
        self._fold: tuple[np.ndarray, np.ndarray] | None = None  # (rows, norm) of the last norm fold

    def _run(self, fn: Callable[[], None]) -> None:
        if self._recording is not None:
            self._recording.append(fn)
        else:
            self.launches += 1
            fn()

    # memory
    def upload(self, a: np.ndarray) -> np.ndarray:
        return np.array(a, copy=True, order="C")

    def zeros(self, shape: Any, dtype: Any) -> np.ndarray:
        return np.zeros(shape, dtype)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = src

    def download(self, a: np.ndarray, rows: int) -> np.ndarray:
        return np.array(a[:rows], copy=True)

    def download_later(self, a: np.ndarray, rows: int) -> Callable[[], np.ndarray]:
        out: list[np.ndarray] = []
        self._run(lambda: out.append(np.array(a[:rows], copy=True)))
        return lambda: out[-1]

    def put_ids(self, dst: np.ndarray, at: np.ndarray, src: np.ndarray, take: np.ndarray) -> None:
        self._run(lambda: dst.__setitem__(at, src[take]))

    def write_meta(self, meta: np.ndarray, values: np.ndarray) -> None:
        meta[:len(values)] = values

    def synchronize(self) -> None:
        pass

    def synchronize_device(self) -> None:
        pass

    def mapped_ints(self, n: int) -> np.ndarray:
        return np.zeros(n, np.int32)

    def record(self) -> None:
        return None

    def wait(self, event: None) -> None:
        pass

    # graph
    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        calls: list[Callable[[], None]] = []
        self._recording = calls
        try:
            body()
        finally:
            self._recording = None

        def replay() -> None:
            for fn in calls:
                self.launches += 1
                fn()
        return replay

    # kernels
    def embed(self, codes: np.ndarray, scales: np.ndarray, group: int, ids: np.ndarray, h: np.ndarray,
              ssq_out: np.ndarray | None = None, mul: float = 1.0) -> None:
        def fn() -> None:
            tok = ids[:h.shape[0]].astype(np.int64)
            rows = codes[tok].astype(np.float32).reshape(len(tok), -1, group) * scales[tok][:, :, None]
            h[...] = rows.reshape(len(tok), -1) * np.float32(mul)
            if ssq_out is not None:
                ssq_out[:ssq_count(h.shape[1])] = _row_ssq(h[0])
        self._run(fn)

    def norm_add(self, x: np.ndarray, w: np.ndarray, eps: float, y: np.ndarray,
                 ssq_out: np.ndarray | None = None) -> None:
        def fn() -> None:
            y[...] = y + _prologue(x, x.shape[1], PRO_RMSNORM, w, eps, 0)
            if ssq_out is not None:
                ssq_out[:ssq_count(y.shape[1])] = _row_ssq(y[0])
        self._run(fn)

    def gemv(self, lin: Lin, x: np.ndarray, pro: int, pw: np.ndarray | None, eps: float, xoff: int,
             y: np.ndarray, epi: int, bias: np.ndarray | None, ssq_in: np.ndarray | None = None,
             ssq_out: np.ndarray | None = None, rope: QkvRope | None = None,
             experts: tuple[list[Lin], np.ndarray, int] | None = None, sel_ready: bool = False,
             post: PostNorm | None = None, quantized: bool = False, fold_norm: np.ndarray | None = None,
             prenormed: bool = False, route: RouteFold | None = None, add_scale: float = 1.0,
             swiglu: tuple[float, float] = NO_SWIGLU) -> None:
        # ``quantized``: CupyOps' codes written by attention; here x's rows are quantized as those were. The
        # norm fold: a ``prenormed`` GEMV reads the rows the last ``fold_norm`` residual add stored, for its norm
        if prenormed and (self._fold is None or self._fold[1] is not pw or not _same_rows(self._fold[0], x)):
            raise ValueError("prenormed rows without the norm fold of those rows for that norm")
        if epi == EPI_ADD:  # y's rows change
            self._fold = (y, fold_norm) if fold_norm is not None else None
        folded = experts is not None or post is not None or rope is not None
        if route is not None:
            check_route_fold(route, lin, x.shape[0], pro, epi, bias, folded)
        check_add_scale(add_scale, epi, folded or route is not None)

        def fn() -> None:
            if experts is not None:  # row j: expert sel[j] on row j of x (or its one row), its row of biases
                table, sel, slots = experts
                for j in range(slots):
                    xr = x[:1] if x.shape[0] == 1 else x[j:j + 1]
                    out = _qgemv(table[int(sel[j])], xr, pro, pw, eps, xoff, None, swiglu=swiglu)
                    if bias is not None:
                        out = out + bias[int(sel[j])]
                    y[j:j + 1] = y[j:j + 1] + out if epi == EPI_ADD else out
                return
            if post is not None and pro == PRO_POSTNORM:  # the GEMV after a post-norm: it stores h'
                post.h_next[...], a = _postnorm(x, lin.k, pw, eps, post)
                out = _qgemv(lin, a, PRO_PLAIN, None, eps, 0, None)
            else:
                out = _qgemv(lin, x, pro, pw, eps, xoff, ssq_in, prenormed, swiglu)
            if bias is not None:
                out = out + bias
            if rope is not None:  # the epilogue does qkv_rope's work instead of storing
                hd = out.shape[1] // (rope.heads + 2 * rope.kv_heads)
                _qkv_rope(out, rope, hd)
                if rope.attend is not None:
                    a = rope.attend
                    _attend(rope.q, rope.kc, rope.vc, rope.heads, hd, a.scale, rope.meta, a.out, window=a.window)
                return
            if post is not None and pro != PRO_POSTNORM:  # the projection before a post-norm
                post.stats[:4 * -(-lin.n // TILE_N)] = _postnorm_stats(out, post)
                out = out * post.weight[:lin.n]
            y[...] = y + out * np.float32(add_scale) if epi == EPI_ADD else out
            if ssq_out is not None:
                ssq_out[:ssq_count(lin.n)] = _row_ssq(y[0])
            if route is not None:
                _route_fold(route, lin, x, bias, y, eps)
        self._run(fn)

    def norm_fold(self, m: int, producer: Lin, consumers: Sequence[Lin]) -> bool:
        """CupyOps' rule on the H200 (gemm.DeviceGemm.norm_fold), every GEMM the tensor-copy block: 17..64 rows,
        int8 codes at G = 32 in whole stages and column tiles, the producer's columns whole tiles."""
        return (bool(consumers) and MMA_TILES[MMA_TILE_SPLIT_SMALL].bm < m <= SPLIT_MAX_M
                and producer.n == producer.npad
                and all(x.bits == 8 and x.group_size == 32 and split_fits(x.k, x.npad) for x in (producer, *consumers)))

    def expert_table(self, lins: list[Lin]) -> list[Lin]:
        check_expert_table(lins)
        return list(lins)

    def moe_route(self, h: np.ndarray, norm: np.ndarray, eps: float, router: np.ndarray, experts: int, k: int,
                  norm_topk: bool, xn: np.ndarray, scratch: Any, sel: np.ndarray, wts: np.ndarray,
                  ssq_in: np.ndarray | None = None, bias: np.ndarray | None = None) -> None:
        def fn() -> None:
            m = h.shape[0]
            x = _prologue(h, h.shape[1], PRO_RMSNORM, norm, eps, 0, ssq_in if m == 1 else None)  # [M, D]
            xn[...] = x
            logits = x @ router.T
            if bias is not None:
                logits[:, :experts] += bias
            _choose(logits, experts, k, norm_topk, sel, wts)
        self._run(fn)

    def moe_group(self, sel: np.ndarray, experts: int, source: np.ndarray, position: np.ndarray,
                  groups: np.ndarray, rows: int) -> None:
        def fn() -> None:
            src, pos, blocks = expert_groups(sel, rows)
            source[:] = src
            position[:] = pos
            groups[:] = 0
            groups[:len(blocks)] = blocks
        self._run(fn)

    def moe_combine(self, y: np.ndarray, k: int, wts: np.ndarray, h: np.ndarray, index: np.ndarray | None = None,
                    shared: np.ndarray | None = None, ssq_out: np.ndarray | None = None,
                    fold: tuple[RouteFold, np.ndarray, float] | None = None) -> None:
        def fn() -> None:
            m = h.shape[0]
            w = wts
            if fold is not None:  # the RouteFold's totals, weighed with h's rms
                route, ssq, eps = fold
                d = h.shape[1]
                r = _rms_from_tiles(ssq[:ssq_count(d)], d, eps)
                if route.norm_topk:  # a softmax over the k chosen totals (moe.cu), a shared gate's sigmoid last
                    t = (wts[0, :k + 1] / r).astype(np.float32)
                    e = np.exp(t[:k] - t[:k].max())
                    gate = np.zeros(1, np.float32)
                    if shared is not None:
                        gate = np.float32(1) / (np.float32(1) + np.exp(-t[k:]))
                    w = np.concatenate([e / np.add.reduce(e, dtype=np.float32), gate])[None]
                else:
                    w = np.zeros((1, k + 1), np.float32)
                    _choose((route.part[:route.rows] / r)[None].astype(np.float32), route.experts, k, False,
                            np.zeros((1, k), np.int32), w)
            rows = (np.arange(m * k) if index is None else index[:m * k]).reshape(m, k)
            acc = np.zeros_like(h)
            for j in range(k):
                acc += y[rows[:, j]] * w[:m, j:j + 1]
            if shared is not None:
                acc += shared[:m] * w[:m, k:k + 1]
            h[...] = h + acc
            if ssq_out is not None:
                ssq_out[:ssq_count(h.shape[1])] = _row_ssq(h[0])
        self._run(fn)

    def experts_gemm(self, lin: Lin, x: np.ndarray, pro: int, xoff: int, y: np.ndarray, table: list[Lin],
                     groups: np.ndarray, blocks: int, rows: int, swiglu: tuple[float, float] = NO_SWIGLU) -> None:
        def fn() -> None:
            for e, row0, count in groups[:blocks]:  # each at most ``rows`` positions: the kernel's tile only
                y[row0:row0 + count] = _qgemv(table[int(e)], x[row0:row0 + count], pro, None, 0.0, xoff, None,
                                              swiglu=swiglu)
        self._run(fn)

    def expert_bias(self, y: np.ndarray, groups: np.ndarray, bias: np.ndarray) -> None:
        def fn() -> None:
            for e, row0, count in groups:
                y[row0:row0 + count] += bias[int(e)]
        self._run(fn)

    def finish_logits(self, logits: np.ndarray, div: float, cap: float) -> None:
        def fn() -> None:
            x = logits / np.float32(div) if div != 1.0 else logits
            logits[...] = np.tanh(x / np.float32(cap)) * np.float32(cap) if cap > 0 else x
        self._run(fn)

    def greedy_token(self, logits: np.ndarray, scratch: Any, meta: np.ndarray, limit: int,
                     tokens: np.ndarray) -> None:
        def fn() -> None:
            pos, tok = int(meta[0]), int(np.argmax(logits[0]))
            meta[0], meta[1] = pos + 1 if pos + 1 < limit else pos, tok
            tokens[pos % len(tokens)] = tok
        self._run(fn)

    def argmax_rows(self, logits: np.ndarray, rows: int, scratch: Any) -> np.ndarray:
        ids = scratch[4]

        def fn() -> None:
            for r in range(rows):
                ids[r] = int(np.argmax(logits[r])) if np.isfinite(logits[r]).all() else -1
        self._run(fn)
        return ids[:rows]

    def qkv_rope(self, qkv: np.ndarray, heads: int, kv_heads: int, hd: int, qnorm: np.ndarray | None,
                 knorm: np.ndarray | None, eps: float, cos: np.ndarray, sin: np.ndarray, meta: np.ndarray,
                 q: np.ndarray, kc: np.ndarray, vc: np.ndarray, rows: np.ndarray | None = None,
                 tables: np.ndarray | None = None) -> None:
        rope = QkvRope(heads, kv_heads, qnorm, knorm, eps, cos, sin, meta, q, kc, vc)
        self._run(lambda: _qkv_rope(qkv, rope, hd, rows, tables))

    def attention(self, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, heads: int, hd: int, scale: float,
                  meta: np.ndarray, out: np.ndarray, rows: np.ndarray | None = None,
                  tables: np.ndarray | None = None, window: int = 0, quantize_for: Lin | None = None,
                  softcap: float = 0.0, sinks: np.ndarray | None = None) -> bool:
        self._run(lambda: _attend(q, kc, vc, heads, hd, scale, meta, out, rows, tables, window, softcap, sinks))
        return False  # the next gemv quantizes ``out`` itself

    def attend_folds(self, qkv: Lin, capacity: int) -> bool:
        """CupyOps' rule (plan.attend_folds)."""
        return attend_folds(qkv, capacity, self.cluster)

    def gather_rows(self, src: np.ndarray, index: np.ndarray, dst: np.ndarray) -> None:
        self._run(lambda: np.take(src, index, axis=0, out=dst))

    def write_rows(self, dst: np.ndarray, values: np.ndarray) -> None:
        dst[:len(values)] = values


def _attend(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, heads: int, hd: int, scale: float, meta: np.ndarray,
            out: np.ndarray, rows: np.ndarray | None = None, tables: np.ndarray | None = None, window: int = 0,
            softcap: float = 0.0, sinks: np.ndarray | None = None) -> None:
    """Decode attention and causal prefill: each row of q over its cache positions (the last ``window``), its
    scores soft-capped where ``softcap`` > 0; ``sinks`` [heads]: one more logit a head, with no value."""
    m = q.shape[0]
    pos, slots = _row_slots(m, meta, rows, tables)
    g = heads // kc.shape[0]
    for r in range(m):
        lo = max(0, pos[r] + 1 - window) if window > 0 else 0
        cache = slots[r][lo:pos[r] + 1]  # cache rows of positions lo..pos
        qh = q[r].reshape(heads, hd) * np.float32(scale)
        for h in range(heads):
            s = kc[h // g, cache] @ qh[h]  # [n]
            if softcap > 0:
                s = np.tanh(s / np.float32(softcap)) * np.float32(softcap)
            if sinks is None:
                e = np.exp(s - s.max())
                total = e.sum()
            else:
                top = max(s.max(), sinks[h])
                e = np.exp(s - top)
                total = e.sum() + np.exp(sinks[h] - top)
            out[r, h * hd:(h + 1) * hd] = (e / total) @ vc[h // g, cache]


def _row_slots(m: int, meta: np.ndarray, rows: np.ndarray | None,
               tables: np.ndarray | None) -> tuple[list[int], list[np.ndarray]]:
    """Each row's position and the cache rows of its positions 0..pos (rope.cuh kv_slot)."""
    if rows is None:
        p0 = int(meta[0])
        return [p0 + r for r in range(m)], [np.arange(p0 + r + 1) for r in range(m)]
    pos = [int(rows[r, 0]) for r in range(m)]
    slots = []
    for r in range(m):
        p = np.arange(pos[r] + 1)
        slots.append(tables[int(rows[r, 1])][p // KV_BLOCK] * KV_BLOCK + p % KV_BLOCK)
    return pos, slots


def _qkv_rope(qkv: np.ndarray, r: QkvRope, hd: int, rows: np.ndarray | None = None,
              tables: np.ndarray | None = None) -> None:
    m, heads, kv_heads = qkv.shape[0], r.heads, r.kv_heads
    pos, slots = _row_slots(m, r.meta, rows, tables)
    at = np.array(pos)  # [M] positions
    dest = np.array([s[-1] for s in slots])  # [M] cache rows
    qh = qkv[:, :heads * hd].reshape(m, heads, hd)
    kh = qkv[:, heads * hd:(heads + kv_heads) * hd].reshape(m, kv_heads, hd)
    vh = qkv[:, (heads + kv_heads) * hd:(heads + 2 * kv_heads) * hd].reshape(m, kv_heads, hd)
    if r.qnorm is not None:
        qh, kh = _head_norm(qh, r.qnorm, r.eps), _head_norm(kh, r.knorm, r.eps)
    c, s = r.cos[at, None, :], r.sin[at, None, :]
    r.q[...] = _rope(qh, c, s).reshape(m, heads * hd)
    r.kc[:, dest] = _rope(kh, c, s).transpose(1, 0, 2)
    r.vc[:, dest] = vh.transpose(1, 0, 2)


def _head_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ss = np.einsum("...d,...d->...", x, x)[..., None]
    return x / np.sqrt(ss / np.float32(x.shape[-1]) + np.float32(eps)) * w


def _rope(x: np.ndarray, c: np.ndarray, s: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
