"""The operations of the device forward, twice: CUDA kernels (``CupyOps``) and their numpy mirror (``NumpyOps``).

``DeviceForward`` only allocates arrays through ``ops.xp`` and calls the methods below, so the whole
orchestration (sequences, chunks, splits, graph record/replay, layouts) runs on the CPU against numpy
mirrors of the kernels in CI, and on the GPU against forward.cu. Arrays passed in are 2-D row views
(``x[:M]``, ``qkv[:M, col:col + n]``): CuPy kernels get the data pointer and the row stride.

The mirrors follow the kernels' definitions, not their summation order, so the two agree to float32
rounding: both compute exact integer block sums of the same codes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kestrel_core.contract import quantize_activations
from kestrel_cuda.residency import Geometry, pad_n

TILE_N = 128  # columns of a GEMV block (forward.cu TN)
SSQ_COLS = 32  # columns per entry of the residual stream's sums of squares (forward.cu)
CHUNK_K = 256  # rows of a GEMV chunk (forward.cu KC: one 32-row slot per warp), int8 and int4
SMALL_M = 8  # up to this many rows run through the fused GEMV (MR = 8); more through the tiled GEMM if any
MAX_CLUSTER = 8  # K splits of an M=1 GEMV launched as one thread block cluster, at most (forward.cu)
MERGE_SPLITS = 64  # K splits of an M=1 chunked GEMV, at most: slots per tile of its merge area (forward.cu)
CHUNK_BLOCKS_PER_SM = 4  # qgemv's resident blocks per SM at M = 1 (__launch_bounds__(NT, 4))
ONE_WAVE_SPLITS = 16  # a projection whose one wave of blocks gives each tile this many K splits runs one wave
STREAM_MAX_ROWS = 16384  # K rows one block of the M=1 GEMV (qgemv_m1) quantizes into shared memory (SMAXK)
STREAM_WARPS = 8  # warps of a qgemv_m1 block; each streams whole G-groups of the block's K run
STREAM_BLOCK_COST = 2  # a block's fixed work (prologue, reduction) in units of one group per warp (planner)
ATTN_SPLITS = 16  # position splits of decode attention (attn_decode<NS>): 16 measured faster than 32
MAX_HEAD_DIM = 128  # attention and qkv_rope keep hd/32 (<= 4) values per lane; attn_prefill tiles fit 48 KB
PRO_PLAIN, PRO_RMSNORM, PRO_SILU_MUL = 0, 1, 2
EPI_STORE, EPI_ADD = 0, 1
TOKEN_RING = 64  # greedy tokens kept in host memory by lm_finish, indexed by position modulo this
FINISH_COLS = 1024  # columns one lm_finish block reduces (forward.cu FIN_T x FIN_E)


@dataclass
class Lin:
    """One device projection in the K-major layout, and where its N outputs go in the output buffer.

    codes: uint8 [K][Npad] (8-bit codes, as int8 bits) or [K/8][4 * Npad] (4-bit words of 8 k, +8 biased);
    scales: float32 [K/G][Npad]; ``col``: first output column; ``ksplit``: K splits of the M=1 GEMV.
    """

    codes: Any
    scales: Any
    k: int
    n: int
    npad: int
    group_size: int
    bits: int
    col: int = 0
    ksplit: int = 1
    wkey: int = 0
    m1: str = ""  # the M=1 kernel planned for it ("stream" or "chunk"; "" = decided at launch)
    cluster: bool = False  # its M=1 K splits run as one thread block cluster per tile (plan_split)

    @classmethod
    def from_device_weight(cls, dw: Any, n: int, col: int = 0, wkey: int = 0) -> Lin:
        """A projection over a cache weight (``residency.DeviceWeight``), its codes viewed as pack_kmajor lays
        them out."""
        g = dw.geometry
        shape = (g.k, g.npad) if g.code_bits == 8 else (g.k // 8, 4 * g.npad)
        return cls(dw.codes.view(np.uint8).reshape(shape), dw.scales, g.k, n, g.npad, g.group_size, g.code_bits,
                   col, wkey=wkey)

    @property
    def tiles(self) -> int:
        return -(-self.npad // TILE_N)

    @property
    def chunks(self) -> int:
        return -(-self.k // CHUNK_K)


@dataclass
class QkvRope:
    """What qkv_rope does after the q|k|v projection, handed to that projection's M=1 GEMV when each of its
    column tiles is one head (head_dim == TILE_N): per-head norms (or None), RoPE tables, the position
    (``meta``), and where q and this layer's keys and values go."""

    heads: int
    kv_heads: int
    qnorm: Any
    knorm: Any
    eps: float
    cos: Any
    sin: Any
    meta: Any
    q: Any
    kc: Any
    vc: Any


def plan_ksplit(lin: Lin, target_blocks: int) -> int:
    """K splits of the chunked M=1 GEMV (``qgemv``, the default): enough blocks (tiles x splits) to fill the
    GPU, at most one per chunk. Where a split at or above that divides the chunks evenly and still gives every
    block two chunks or more, the smallest such, so that no block carries a chunk more than the others:
    qwen3-8b's fused gate|up (192 tiles, 16 chunks) runs 8 splits of 2 chunks instead of 6 of 2 or 3, 40-55 us
    a step faster at q8 and q4; the unfused gate/up (96 tiles: 11 splits) has no such split and keeps its own,
    which measured faster than 8 or 16 at q4 (docs/performance.md, seventh session)."""
    split = max(1, min(lin.chunks, MERGE_SPLITS, -(-target_blocks // lin.tiles)))
    even = (s for s in range(split, min(lin.chunks // 2, MERGE_SPLITS) + 1) if lin.chunks % s == 0)
    return next(even, split)


def one_wave_split(lin: Lin, sm_count: int) -> int:
    """K splits of a narrow projection's chunked M=1 GEMV as one wave of resident blocks, or 0 (use the
    two-wave target). Where one wave still gives every tile ONE_WAVE_SPLITS splits or more (qwen3-8b's down:
    32 tiles, 16 splits on 132 SMs, 3 chunks a block), it measured 60-100 us per step faster than the target's
    two waves of 33 splits (and, with the 512-row int4 chunks of then, 1.45 waves of 24): an extra wave's block
    starts and a merge of more partials cost more than the longer blocks; wider projections (q|k|v at q8: one
    wave = 11 splits) measured slower that way (docs/performance.md)."""
    split = min(lin.chunks, MERGE_SPLITS, CHUNK_BLOCKS_PER_SM * sm_count // lin.tiles)
    return split if split >= ONE_WAVE_SPLITS else 0


def cluster_split(lin: Lin, ksplit: int, sm_count: int) -> int:
    """K splits of the chunked M=1 GEMV to run as one thread block cluster per tile (their partial sums added
    in shared memory, not through L2), or 0 to keep ``ksplit`` and the global merge. Clusters measured faster
    only for a grid of one wave (CHUNK_BLOCKS_PER_SM per SM): larger grids lose more to the clusters' placement
    on whole GPCs than the merge saves. Within one wave, blocks of one chunk each always gained; blocks of
    several chunks gained where the grid still fills more than half the wave (q|k|v at q8: 384 blocks of two
    chunks, 80.5 against 77.0 % of copy, -40 us per step) and lost where it does not (q and o at q8: 256
    blocks, 64 against 74 %; docs/performance.md)."""
    split = min(ksplit, MAX_CLUSTER)
    blocks, wave = lin.tiles * split, CHUNK_BLOCKS_PER_SM * sm_count
    return split if split > 1 and blocks <= wave and (lin.chunks <= split or 2 * blocks > wave) else 0


def plan_stream_split(lin: Lin, resident: int) -> int:
    """K splits of the streaming M=1 GEMV (``qgemv_m1``): each split is one block's run of whole G-groups,
    dealt to its 8 warps. Time is modelled as waves of blocks (``resident`` run at once) x (groups of the
    busiest warp + a block's fixed cost); the smallest split that minimises it (fewer partial sums), with a
    block's run at most STREAM_MAX_ROWS rows."""
    groups = lin.k // lin.group_size
    best, best_cost = groups, None
    for s in range(1, groups + 1):
        per = -(-groups // s)
        if per * lin.group_size > STREAM_MAX_ROWS or -(-groups // per) != s:
            continue  # too long a run, or the same blocks as a smaller split
        cost = -(-lin.tiles * s // resident) * (-(-per // STREAM_WARPS) + STREAM_BLOCK_COST)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def m1_kernel(lin: Lin, gemv: str, sm_count: int) -> str:
    """The M=1 kernel of ``lin`` under the GEMV setting ``gemv`` (``CupyOps.gemv_kind``): "stream" or
    "chunk"; "hybrid" gives wide projections (at least one column tile per SM) and every int4 one to "chunk",
    the rest to "stream"."""
    if gemv == "hybrid":
        return "chunk" if lin.tiles >= sm_count or lin.bits == 4 else "stream"
    return gemv


def plan_split(lin: Lin, gemv: str, sm_count: int, target_blocks: int | None = None,
               clusters: bool = False) -> int:
    """Choose ``lin``'s M=1 kernel (sets ``lin.m1`` and ``lin.cluster``) and return its K splits;
    ``target_blocks`` (default ``default_target_blocks``) is the chunk planner's target or the stream planner's
    resident blocks; ``clusters``: the device runs cluster launches (``CupyOps.cluster``)."""
    lin.m1 = m1_kernel(lin, gemv, sm_count)
    target = target_blocks or default_target_blocks(sm_count, lin.m1)
    if lin.m1 != "chunk":
        lin.cluster = False
        return plan_stream_split(lin, target)
    default = target_blocks is None and not _env(BLOCKS_ENV, "")
    ksplit = (default and one_wave_split(lin, sm_count)) or plan_ksplit(lin, target)
    split = cluster_split(lin, ksplit, sm_count) if clusters else 0
    lin.cluster = split > 0
    return split or ksplit


def pack_kmajor(codes: np.ndarray, bits: int) -> np.ndarray:
    """Host packing of int8 codes [N][K] into the device layout: uint8 [K][Npad] or, 4-bit, [K/8][4 * Npad].

    The layout cuda-kernels' transpose kernels produce (Npad = (N+3) & ~3, padding zero). int4: 32-bit words of
    8 consecutive k of one column, +8 biased, byte b = k0 + b (low nibble) | k0 + 4 + b (high nibble), as
    common.cu describes. Used for the forward's own uploads when no weight cache is given, and by the mirrors.
    """
    n, k = codes.shape
    npad = pad_n(n)
    t = np.zeros((k, npad), np.int8)
    t[:, :n] = codes.T
    if bits == 8:
        return t.view(np.uint8)
    if k % 8:
        raise ValueError(f"int4 packing needs K % 8 == 0, got {k}")
    u = (t.astype(np.int16) + 8).astype(np.uint8).reshape(k // 8, 2, 4, npad)  # [kw][half][b][n]
    words = u[:, 0] | (u[:, 1] << 4)                                           # [kw][b][n]
    return np.ascontiguousarray(words.transpose(0, 2, 1)).reshape(k // 8, 4 * npad)


def unpack_kmajor(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``pack_kmajor``: int8 codes [K][Npad]."""
    if bits == 8:
        return packed.view(np.int8)
    kw, npad = packed.shape[0], packed.shape[1] // 4
    b = packed.reshape(kw, npad, 4).transpose(0, 2, 1)  # [kw][b][n]
    out = np.empty((kw, 2, 4, npad), np.int8)
    out[:, 0] = (b & 0x0F).astype(np.int8) - 8
    out[:, 1] = (b >> 4).astype(np.int8) - 8
    return out.reshape(8 * kw, npad)


# -- numpy mirror ------------------------------------------------------------------------------------


def _prologue(x: np.ndarray, k: int, pro: int, pw: np.ndarray | None, eps: float, xoff: int,
              ssq: np.ndarray | None = None) -> np.ndarray:
    xv = np.asarray(x, np.float32)
    if pro == PRO_RMSNORM:
        if ssq is None:
            ss = np.einsum("mk,mk->m", xv[:, :k], xv[:, :k])[:, None]  # [M, 1]
        else:  # M = 1: the producer's tile sums
            ss = ssq[:ssq_count(k)].sum(dtype=np.float32).reshape(1, 1)
        r = np.sqrt(ss / np.float32(k) + np.float32(eps))
        return xv[:, :k] / r * pw
    if pro == PRO_SILU_MUL:
        g = xv[:, :k]
        with np.errstate(over="ignore"):
            return g / (np.float32(1) + np.exp(-g)) * xv[:, xoff:xoff + k]
    return xv[:, :k]


def ssq_count(n: int) -> int:
    """Entries of the residual stream's sums of squares for a row of n (one per 32 columns, forward.cu)."""
    return -(-n // SSQ_COLS)


def _row_ssq(row: np.ndarray) -> np.ndarray:
    """Sums of squares per 32 columns of one row (what embed_rows / a residual-add GEMV leave in ssq_out)."""
    n = row.shape[-1]
    padded = np.zeros(ssq_count(n) * SSQ_COLS, np.float32)
    padded[:n] = row.reshape(-1)
    return (padded * padded).reshape(-1, SSQ_COLS).sum(axis=1, dtype=np.float32)


class NumpyOps:
    """The kernels' math in numpy on host arrays; ``capture`` records calls and replays them."""

    xp = np
    name = "numpy"

    def __init__(self) -> None:
        self._recording: list[Callable[[], None]] | None = None
        self.launches = 0

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
        return np.array(a[:rows], dtype=np.float32, copy=True)

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
              ssq_out: np.ndarray | None = None) -> None:
        def fn() -> None:
            tok = ids[:h.shape[0]].astype(np.int64)
            rows = codes[tok].astype(np.float32).reshape(len(tok), -1, group) * scales[tok][:, :, None]
            h[...] = rows.reshape(len(tok), -1)
            if ssq_out is not None:
                ssq_out[:ssq_count(h.shape[1])] = _row_ssq(h[0])
        self._run(fn)

    def gemv(self, lin: Lin, x: np.ndarray, pro: int, pw: np.ndarray | None, eps: float, xoff: int,
             y: np.ndarray, epi: int, bias: np.ndarray | None, ssq_in: np.ndarray | None = None,
             ssq_out: np.ndarray | None = None, rope: QkvRope | None = None) -> None:
        def fn() -> None:
            m, g = x.shape[0], lin.group_size
            a = _prologue(x, lin.k, pro, pw, eps, xoff, ssq_in)  # [M, K]
            a_codes, a_scales = quantize_activations(a, g)
            w = unpack_kmajor(lin.codes, lin.bits)[:lin.k]  # [K, Npad]
            ng = lin.k // g
            isum = np.einsum("mgi,gin->mgn", a_codes.reshape(m, ng, g).astype(np.int64),
                             w.reshape(ng, g, lin.npad).astype(np.int64))  # [M, ng, Npad], exact
            f = isum.astype(np.float32) * a_scales[:, :, None] * lin.scales[None]  # [M, ng, Npad]
            out = f.sum(axis=1, dtype=np.float32)[:, :lin.n]
            if bias is not None:
                out = out + bias
            if rope is not None:  # the epilogue does qkv_rope's work instead of storing
                _qkv_rope(out, rope, out.shape[1] // (rope.heads + 2 * rope.kv_heads))
                return
            y[...] = y + out if epi == EPI_ADD else out
            if ssq_out is not None:
                ssq_out[:ssq_count(lin.n)] = _row_ssq(y[0])
        self._run(fn)

    def greedy_token(self, logits: np.ndarray, scratch: Any, meta: np.ndarray, limit: int,
                     tokens: np.ndarray) -> None:
        def fn() -> None:
            pos, tok = int(meta[0]), int(np.argmax(logits[0]))
            meta[0], meta[1] = pos + 1 if pos + 1 < limit else pos, tok
            tokens[pos % len(tokens)] = tok
        self._run(fn)

    def qkv_rope(self, qkv: np.ndarray, heads: int, kv_heads: int, hd: int, qnorm: np.ndarray | None,
                 knorm: np.ndarray | None, eps: float, cos: np.ndarray, sin: np.ndarray, meta: np.ndarray,
                 q: np.ndarray, kc: np.ndarray, vc: np.ndarray) -> None:
        rope = QkvRope(heads, kv_heads, qnorm, knorm, eps, cos, sin, meta, q, kc, vc)
        self._run(lambda: _qkv_rope(qkv, rope, hd))

    def attention(self, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, heads: int, hd: int, scale: float,
                  meta: np.ndarray, out: np.ndarray) -> None:
        def fn() -> None:
            m = q.shape[0]
            p0 = int(meta[0])
            g = heads // kc.shape[0]
            for r in range(m):
                n = p0 + r + 1
                qh = q[r].reshape(heads, hd) * np.float32(scale)
                for h in range(heads):
                    s = kc[h // g, :n] @ qh[h]  # [n]
                    e = np.exp(s - s.max())
                    out[r, h * hd:(h + 1) * hd] = (e / e.sum()) @ vc[h // g, :n]
        self._run(fn)


def _qkv_rope(qkv: np.ndarray, r: QkvRope, hd: int) -> None:
    m, heads, kv_heads = qkv.shape[0], r.heads, r.kv_heads
    p0 = int(r.meta[0])
    qh = qkv[:, :heads * hd].reshape(m, heads, hd)
    kh = qkv[:, heads * hd:(heads + kv_heads) * hd].reshape(m, kv_heads, hd)
    vh = qkv[:, (heads + kv_heads) * hd:(heads + 2 * kv_heads) * hd].reshape(m, kv_heads, hd)
    if r.qnorm is not None:
        qh, kh = _head_norm(qh, r.qnorm, r.eps), _head_norm(kh, r.knorm, r.eps)
    c, s = r.cos[p0:p0 + m, None, :], r.sin[p0:p0 + m, None, :]
    r.q[...] = _rope(qh, c, s).reshape(m, heads * hd)
    r.kc[:, p0:p0 + m] = _rope(kh, c, s).transpose(1, 0, 2)
    r.vc[:, p0:p0 + m] = vh.transpose(1, 0, 2)


def _head_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ss = np.einsum("...d,...d->...", x, x)[..., None]
    return x / np.sqrt(ss / np.float32(x.shape[-1]) + np.float32(eps)) * w


def _rope(x: np.ndarray, c: np.ndarray, s: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


# -- CUDA ----------------------------------------------------------------------------------------------

# (bits, G, MR): qgemv with MR rows per block: M = 2..8 (MR = 8), and M = 1 when KESTREL_CUDA_GEMV=chunk
_GEMV_VARIANTS = [(bits, g, mr) for bits in (8, 4) for g in (32, 256) for mr in (1, SMALL_M)]
_M1_VARIANTS = [(bits, g) for bits in (8, 4) for g in (32, 256)]


FORWARD_OPTIONS = ("--fmad=false", "-std=c++17")  # NVRTC options of forward.cu


def forward_source() -> str:
    """forward.cu as NVRTC compiles it: after common.cu (benchmarks/cuda_gemv_chain.py appends its own kernels)."""
    here = Path(__file__).parent
    return "\n".join((here / name).read_text() for name in ("common.cu", "forward.cu"))


@lru_cache(maxsize=2)
def _module(defines: tuple[str, ...] = ()) -> Any:
    """forward.cu compiled (``defines``: extra ``-D`` options, e.g. benchmarks/cuda_timeline.py's)."""
    import cupy as cp

    source = forward_source()
    names = ([f"qgemv<{b},{g},{mr}>" for b, g, mr in _GEMV_VARIANTS]
             + ["qgemv_m1<{},{}>".format(*v) for v in _M1_VARIANTS]
             + [f"attn_decode<{ATTN_SPLITS}>", "quantize_rows<32>", "quantize_rows<256>"])
    mod = cp.RawModule(code=source, options=(*FORWARD_OPTIONS, *defines), name_expressions=tuple(names))
    mod.compile()
    return mod


def _i32(v: int) -> np.int32:
    return np.int32(v)


def _ptr(a: Any) -> np.uint64:
    """A kernel pointer argument: the data pointer of a CuPy array (view), or NULL."""
    return np.uint64(0 if a is None else a.data.ptr)


def _ld(a: Any) -> np.int32:
    """Row stride in elements of a 2-D view."""
    return np.int32(a.strides[0] // a.itemsize)


class CupyOps:
    """Launches forward.cu on one stream. ``gemm``: optional tiled GEMM for M > SMALL_M (see ``gemv``)."""

    name = "cuda"

    def __init__(self, stream: Any = None, gemm: Any = None) -> None:
        import cupy as cp
        import cupyx

        self.cp = cp
        self.cupyx = cupyx
        self.xp = cp
        self.stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
        mod = _module(kernel_defines())
        self._gemv = {v: mod.get_function("qgemv<{},{},{}>".format(*v)) for v in _GEMV_VARIANTS}
        self._gemv_m1 = {v: mod.get_function("qgemv_m1<{},{}>".format(*v)) for v in _M1_VARIANTS}
        self.gemv_kind = gemv_kind()
        self._attn_decode = mod.get_function(f"attn_decode<{ATTN_SPLITS}>")
        self._quant = {g: mod.get_function(f"quantize_rows<{g}>") for g in (32, 256)}
        self._fn = {name: mod.get_function(name) for name in
                    ("embed_rows", "qkv_rope", "attn_prefill", "add_rows", "lm_finish")}
        self.gemm = gemm
        self.launches = 0
        self.pdl = pdl_enabled()
        self.cluster = clusters_enabled() and int(cp.cuda.Device().compute_capability) >= 90
        self.merge_mode = merge_mode()
        self._ex: Any = None
        if self.pdl or self.cluster:
            try:
                from kestrel_cuda.forward_launch import ExLauncher

                self._ex = ExLauncher()
            except (OSError, AttributeError):  # no driver library / no cuLaunchKernelEx: plain launches
                self.pdl = self.cluster = False
        self._capturing = False
        self._captured = 0  # launches so far in the capture under way
        self.sm_count = cp.cuda.Device().attributes["MultiProcessorCount"]
        # scratch, sized by ``reserve``
        self.part = self.zeros(1, np.float32)  # split-K partials and counters: qgemv (one wave), qgemv_m1
        self.counters = self.zeros(1, np.int32)
        self.merge_tiles = 0  # tiles qgemv's tagged split-K slots and epochs (forward.cu) hold
        self.merge = self.zeros(1, np.uint64)
        self.epochs = self.zeros(1, np.uint32)
        self.attn_part = self.zeros(1, np.float32)
        self.attn_counters = self.zeros(1, np.int32)
        self._pinned: Any = None
        self._tiled_bufs: dict[str, Any] = {}

    def reserve(self, part: int, counters: int, attn_part: int, attn_counters: int, merge_tiles: int = 0) -> None:
        """Grow the split-K and attention scratch (counters start and end every launch at zero; the merge slots
        and their epochs only ever grow together, zeroed, so that no slot holds a tag its tile has not reached)."""
        if merge_tiles > self.merge_tiles:
            self.merge = self.zeros(merge_tiles * MERGE_SPLITS * TILE_N, np.uint64)
            self.epochs = self.zeros(merge_tiles, np.uint32)
            self.merge_tiles = merge_tiles
        if part > self.part.size:
            self.part = self.zeros(part, np.float32)
        if counters > self.counters.size:
            self.counters = self.zeros(counters, np.int32)
        if attn_part > self.attn_part.size:
            self.attn_part = self.zeros(attn_part, np.float32)
        if attn_counters > self.attn_counters.size:
            self.attn_counters = self.zeros(attn_counters, np.int32)

    # memory: on the forward's stream, so that nothing races with its kernels (it does not wait for the
    # legacy default stream)
    def upload(self, a: np.ndarray) -> Any:
        with self.stream:
            return self.cp.asarray(np.ascontiguousarray(a))

    def zeros(self, shape: Any, dtype: Any) -> Any:
        with self.stream:
            return self.cp.zeros(shape, dtype)

    def copy(self, dst: Any, src: Any) -> None:
        with self.stream:
            dst[...] = src

    def download(self, a: Any, rows: int) -> np.ndarray:
        size = rows * a.shape[1]
        if self._pinned is None or self._pinned.size < size:
            self._pinned = self.cupyx.empty_pinned(size, np.float32)
        host = self._pinned[:size].reshape(rows, a.shape[1])
        a[:rows].get(stream=self.stream, out=host, blocking=True)
        return host.copy()

    def write_meta(self, meta: Any, values: np.ndarray) -> None:
        meta[:len(values)].set(np.ascontiguousarray(values, np.int32), stream=self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def synchronize_device(self) -> None:
        self.cp.cuda.Device().synchronize()

    def mapped_ints(self, n: int) -> np.ndarray:
        """int32 [n] in pinned host memory that kernels write directly: with unified addressing (every 64-bit
        CUDA platform) a cudaHostAlloc pointer is also the device's pointer to it."""
        mem = self.cp.cuda.alloc_pinned_memory(4 * n)
        arr = np.frombuffer(mem, np.int32, n)  # keeps ``mem`` alive
        arr[:] = 0
        return arr

    def record(self) -> Any:
        event = self.cp.cuda.Event(block=False, disable_timing=True)
        event.record(self.stream)
        return event

    def wait(self, event: Any) -> None:
        event.synchronize()

    # graph
    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        s = self.stream
        with s:
            s.begin_capture()
            self._capturing, self._captured = True, 0
            try:
                body()
            finally:
                self._capturing = False
                graph = s.end_capture()

        def replay() -> None:
            self.launches += 1
            graph.launch(s)
        replay.graph = graph  # type: ignore[attr-defined]
        return replay

    def _launch(self, fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, smem: int = 0,
                cluster: int = 1) -> None:
        """Launch on the stream. Inside a graph capture with PDL on, every launch after the capture's first
        may overlap its predecessor (forward_launch; each kernel waits for it before reading its outputs).
        ``cluster`` > 1: grid y in clusters of that many blocks (the M=1 GEMV's K splits)."""
        self.launches += 1
        pdl = False
        if self._capturing:
            self._captured += 1
            pdl = self.pdl and self._captured > 1
        if pdl or cluster > 1:
            self._ex.launch(fn, grid, block, args, smem, self.stream, pdl, (1, cluster, 1) if cluster > 1 else None)
            return
        with self.stream:
            fn(grid, block, args, shared_mem=smem)

    # kernels
    def embed(self, codes: Any, scales: Any, group: int, ids: Any, h: Any, ssq_out: Any = None) -> None:
        m, d = h.shape
        self._launch(self._fn["embed_rows"], (-(-d // 256), m), (256,),
                     (_ptr(codes), _ptr(scales), _i32(d), _i32(group), _ptr(ids), _ptr(h),
                      _ptr(ssq_out if m == 1 else None)))

    def gemv(self, lin: Lin, x: Any, pro: int, pw: Any, eps: float, xoff: int, y: Any, epi: int,
             bias: Any, ssq_in: Any = None, ssq_out: Any = None, rope: QkvRope | None = None) -> None:
        """ssq_in / ssq_out (M = 1 only): the residual stream's tile sums of squares, read by an RMSNorm
        prologue (pro 1) instead of the row, written with a residual-add epilogue's outputs. ``rope`` (M = 1,
        the chunked kernel, one head per column tile): the epilogue does qkv_rope's work instead of storing."""
        m = x.shape[0]
        if m > 1:
            ssq_in = ssq_out = None
        if m > SMALL_M and self.gemm is not None:
            self._tiled(lin, x, pro, pw, eps, xoff, y, epi, bias)
            return
        if m == 1 and (lin.m1 or m1_kernel(lin, self.gemv_kind, self.sm_count)) == "stream":
            self._launch(self._gemv_m1[(lin.bits, lin.group_size)], (lin.tiles, lin.ksplit), (256,),
                         (_ptr(lin.codes), _ptr(lin.scales), _i32(lin.k), _i32(lin.n), _i32(lin.npad),
                          _ptr(x), _i32(pro), _ptr(pw), np.float32(eps), _i32(xoff),
                          _ptr(y), _i32(epi), _ptr(bias), _ptr(self.part), _ptr(self.counters),
                          _ptr(ssq_in), _ptr(ssq_out)))
            return
        mr = 1 if m == 1 else SMALL_M
        ksplit = lin.ksplit if m == 1 else 1
        fn = self._gemv[(lin.bits, lin.group_size, mr)]
        cluster = ksplit if m == 1 and lin.cluster and self.cluster else 1
        tagged = ksplit > 1 and cluster == 1 and tagged_merge(self.merge_mode, lin.tiles * ksplit, self.sm_count)
        if tagged and (lin.tiles > self.merge_tiles or ksplit > MERGE_SPLITS):
            raise RuntimeError(f"split-K merge area for {lin.tiles} tiles x {ksplit} splits not reserved")
        self._launch(fn, (lin.tiles, ksplit, -(-m // mr)), (256,),
                     (_ptr(lin.codes), _ptr(lin.scales), _i32(lin.k), _i32(lin.n), _i32(lin.npad),
                      _ptr(x), _ld(x), _i32(m), _i32(pro), _ptr(pw), np.float32(eps), _i32(xoff),
                      _ptr(y), _ld(y), _i32(epi), _ptr(bias), _ptr(self.part), _ptr(self.counters), _ptr(self.merge),
                      _ptr(self.epochs if tagged else None),
                      _ptr(ssq_in), _ptr(ssq_out), *_rope_args(rope)), cluster=cluster)

    def _tiled(self, lin: Lin, x: Any, pro: int, pw: Any, eps: float, xoff: int, y: Any, epi: int,
               bias: Any) -> None:
        """Prologue kernel -> codes/scales, the tiled GEMM (cuda-kernels) -> tmp, epilogue kernel -> y."""
        m, k, g = x.shape[0], lin.k, lin.group_size
        codes = self._scratch("codes", m * k, np.int8).reshape(m, k)
        scales = self._scratch("scales", m * (k // g), np.float32).reshape(m, k // g)
        tmp = self._scratch("tmp", m * lin.npad, np.float32).reshape(m, lin.npad)
        self._launch(self._quant[g], (-(-k // 256), m), (256,),
                     (_ptr(x), _ld(x), _i32(m), _i32(k), _i32(pro), _ptr(pw), np.float32(eps), _i32(xoff),
                      _ptr(codes), _ptr(scales)))
        self.launches += 1
        self.gemm.q8(codes, scales, _as_device_weight(lin), tmp, lin.n, self.stream)
        self._launch(self._fn["add_rows"], (-(-lin.n // 256), m), (256,),
                     (_ptr(tmp), _ld(tmp), _i32(m), _i32(lin.n), _ptr(y), _ld(y), _i32(epi), _ptr(bias)))

    def _scratch(self, name: str, size: int, dtype: Any) -> Any:
        """A flat scratch buffer of at least ``size`` elements (grown outside graph capture: prefill only)."""
        buf = self._tiled_bufs.get(name)
        if buf is None or buf.size < size:
            buf = self._tiled_bufs[name] = self.zeros(size, dtype)
        return buf[:size]

    def greedy_token(self, logits: Any, scratch: tuple[Any, Any, Any], meta: Any, limit: int,
                     tokens: np.ndarray) -> None:
        """The argmax of ``logits`` [1, N] to meta[1] and tokens[meta[0] % len(tokens)]; meta[0] advances while
        below ``limit`` (forward.cu lm_finish; ``scratch``: its per-block values, indices and counter)."""
        val, idx, count = scratch
        n = logits.shape[1]
        self._launch(self._fn["lm_finish"], (-(-n // FINISH_COLS),), (FINISH_COLS // 4,),
                     (_ptr(logits), _i32(n), _ptr(val), _ptr(idx), _ptr(count), _ptr(meta), _i32(limit),
                      np.uint64(tokens.ctypes.data), _i32(len(tokens))))

    def qkv_rope(self, qkv: Any, heads: int, kv_heads: int, hd: int, qnorm: Any, knorm: Any, eps: float,
                 cos: Any, sin: Any, meta: Any, q: Any, kc: Any, vc: Any) -> None:
        m = qkv.shape[0]
        self._launch(self._fn["qkv_rope"], (-(-(heads + 2 * kv_heads) // 4), m), (128,),
                     (_ptr(qkv), _ld(qkv), _i32(heads), _i32(kv_heads), _i32(hd), _ptr(qnorm), _ptr(knorm),
                      np.float32(eps), _ptr(cos), _ptr(sin), _ptr(meta), _ptr(q), _ptr(kc), _ptr(vc),
                      _i32(kc.shape[1])))

    def attention(self, q: Any, kc: Any, vc: Any, heads: int, hd: int, scale: float, meta: Any,
                  out: Any) -> None:
        m = q.shape[0]
        kv_heads, cap = kc.shape[0], kc.shape[1]
        if m == 1:
            self._launch(self._attn_decode, (heads, ATTN_SPLITS), (128,),
                         (_ptr(q), _ptr(kc), _ptr(vc), _i32(cap), _i32(heads), _i32(kv_heads), _i32(hd),
                          np.float32(scale), _ptr(meta), _ptr(self.attn_part), _ptr(self.attn_counters),
                          _ptr(out)))
            return
        smem = (32 * (hd + 4) + 32 * hd + 16 * hd) * 4
        self._launch(self._fn["attn_prefill"], (heads, -(-m // 16)), (256,),
                     (_ptr(q), _ptr(kc), _ptr(vc), _i32(cap), _i32(heads), _i32(kv_heads), _i32(hd),
                      np.float32(scale), _ptr(meta), _i32(m), _ptr(out)), smem)


def _rope_args(r: QkvRope | None) -> tuple[Any, ...]:
    """qgemv's trailing parameters: qkv_rope's work in the epilogue, or none (null q)."""
    if r is None:
        return (*(_ptr(None),) * 8, _i32(0), _i32(0), _i32(0))
    return (_ptr(r.qnorm), _ptr(r.knorm), _ptr(r.cos), _ptr(r.sin), _ptr(r.meta), _ptr(r.q), _ptr(r.kc),
            _ptr(r.vc), _i32(r.heads), _i32(r.kv_heads), _i32(r.kc.shape[1]))


def _as_device_weight(lin: Lin) -> Any:
    """The object cuda-kernels' GEMM takes (``residency.DeviceWeight``-like) for one projection."""
    dw = getattr(lin, "device_weight", None)
    if dw is not None:
        return dw
    from types import SimpleNamespace

    geometry = Geometry(lin.k, lin.npad, lin.k // lin.group_size, lin.bits)
    return SimpleNamespace(geometry=geometry, codes=lin.codes.reshape(-1).view(np.int8), scales=lin.scales)


def attn_part_size(heads: int, hd: int) -> int:
    return heads * ATTN_SPLITS * (hd + 2)


def gemv_scratch(lins: list[Lin]) -> tuple[int, int, int]:
    """(partial floats, counters, merge tiles) the M=1 GEMVs of these projections need (CupyOps.reserve)."""
    split = [lin for lin in lins if lin.ksplit > 1]
    part = max((lin.ksplit * lin.npad for lin in split), default=1)
    counters = max((lin.tiles for lin in lins), default=1)
    return part, counters, max((lin.tiles for lin in split), default=0)


BLOCKS_ENV = "KESTREL_CUDA_GEMV_BLOCKS"
GEMV_ENV = "KESTREL_CUDA_GEMV"
PDL_ENV = "KESTREL_CUDA_PDL"
NORM_TILES_ENV = "KESTREL_CUDA_NORM_TILES"
DEFINES_ENV = "KESTREL_CUDA_DEFINES"
CLUSTER_ENV = "KESTREL_CUDA_CLUSTER"
SPLITS_ENV = "KESTREL_CUDA_SPLITS"
FUSE_ROPE_ENV = "KESTREL_CUDA_FUSE_ROPE"
MERGE_ENV = "KESTREL_CUDA_MERGE"


def _env(name: str, default: str) -> str:
    import os

    return os.environ.get(name, "").strip() or default


def env_on(name: str) -> bool:
    """A default-on setting: off only when set to 0, false, no or off."""
    return _env(name, "1") not in ("0", "false", "no", "off")


def gemv_kind() -> str:
    """The M=1 GEMV (``KESTREL_CUDA_GEMV``, for benchmarks): "chunk" (default: qgemv for all), "stream"
    (qgemv_m1 for all) or "hybrid" (qgemv_m1 for int8 projections of fewer column tiles than SMs, qgemv for
    the rest). Measured on the H200 with the tile sums of squares (docs/performance.md), GPU us per qwen3-8b
    step in one run: q8 chunk 3,099, hybrid 3,194; q4 chunk 2,461, hybrid 2,471, stream 2,813."""
    raw = _env(GEMV_ENV, "chunk")
    return raw if raw in ("stream", "chunk", "hybrid") else "chunk"


def merge_mode() -> str:
    """``KESTREL_CUDA_MERGE``: how split M=1 chunked GEMVs add their K splits outside clusters: "tagged" (each
    split stores tagged partial sums and exits, the tile's last split polls for them), "counter" (the last
    block to arrive on an atomic counter reads them back) or "auto" (the default: ``tagged_merge``)."""
    raw = _env(MERGE_ENV, "auto")
    return raw if raw in ("auto", "tagged", "counter") else "auto"


def tagged_merge(mode: str, blocks: int, sm_count: int) -> bool:
    """Whether a split M=1 chunked GEMV of ``blocks`` blocks (not a cluster) merges tagged under ``mode``.

    "auto": grids of more than one wave of resident blocks. Measured on the H200 (docs/performance.md, seventh
    session): tagged, a split's block frees its SM slot as soon as its sums are stored, so the next wave starts
    sooner (qwen3-8b gate/up 16.5 -> 15.4 us at q8, 12.2 -> 9.9 us at q4); in one wave nothing waits for a slot
    and the fixed last split's polls cost more than the counter (o 6.3 -> 7.2 us at q8)."""
    return mode == "tagged" or (mode == "auto" and blocks > CHUNK_BLOCKS_PER_SM * sm_count)


def clusters_enabled() -> bool:
    """``KESTREL_CUDA_CLUSTER`` (default on; 0 turns it off): M=1 chunked GEMVs that ``cluster_split`` picks run
    their K splits as thread block clusters (sm_90+)."""
    return env_on(CLUSTER_ENV)


def split_overrides() -> dict[str, tuple[int, bool]]:
    """``KESTREL_CUDA_SPLITS`` (benchmarks: planner A/B runs): M=1 K splits by projection, ``down:12/qkv:8c``
    (names of ``kestrel_core.wkey.Proj``, lower case; a trailing ``c``: as one cluster per tile, at most
    MAX_CLUSTER splits); each is capped at the projection's chunks. Maps name -> (splits, cluster)."""
    out = {}
    for item in _env(SPLITS_ENV, "").split("/"):
        name, _, value = item.partition(":")
        value = value.strip().lower()
        cluster = value.endswith("c")
        value = value.removesuffix("c")
        if name.strip() and value.isdigit() and int(value) > 0:
            out[name.strip().lower()] = (int(value), cluster)
    return out


def fuse_rope_enabled() -> bool:
    """``KESTREL_CUDA_FUSE_ROPE`` (default on; 0 turns it off): at M = 1 with head_dim == TILE_N, the fused
    q|k|v GEMV's epilogue does qkv_rope's work (one head per column tile) and no qkv_rope kernel runs."""
    return env_on(FUSE_ROPE_ENV)


def kernel_defines() -> tuple[str, ...]:
    """Extra ``-D`` options for forward.cu (``KESTREL_CUDA_DEFINES``, space-separated): benchmarks/cuda_timeline.py
    sets ``-DKESTREL_TIMELINE``; A/B runs of a kernel variant behind a macro use it too."""
    return tuple(d for d in _env(DEFINES_ENV, "").split() if d.startswith("-D"))


def norm_tiles_enabled() -> bool:
    """``KESTREL_CUDA_NORM_TILES`` (default on): M = 1 RMSNorm prologues read the residual stream's tile sums
    of squares (forward.cu) instead of the whole row."""
    return env_on(NORM_TILES_ENV)


def pdl_enabled() -> bool:
    """Whether captured decode steps launch with programmatic dependent launch (``KESTREL_CUDA_PDL``,
    default on: measured ~300 us faster per qwen3-8b step; 0 turns it off)."""
    return env_on(PDL_ENV)


def default_target_blocks(sm_count: int, gemv: str = "stream") -> int:
    """GEMV blocks the M=1 K-split planner aims for (``KESTREL_CUDA_GEMV_BLOCKS`` overrides it).

    stream (qgemv_m1): the blocks resident at once, 2 per SM (__launch_bounds__(256, 2)); chunk (qgemv):
    8 per SM, measured fastest for that design on the H200 (docs/performance.md)."""
    raw = _env(BLOCKS_ENV, "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return (8 if gemv == "chunk" else 2) * sm_count


def head_scale(hd: int) -> float:
    return float(np.float32(1.0 / math.sqrt(hd)))
