"""Device-side launch API of the GEMM kernels, for the hooks and for the whole-step forward.

Every call here is asynchronous on the given stream (``None``: CuPy's current stream), allocates nothing
and never synchronises with the host, so a sequence of them can be captured in a CUDA graph. Outputs and
workspaces are preallocated by the caller.

    gemm = DeviceGemm(cp, kernels, sm_count, clusters)
    ws = gemm.workspace(stream)                     # once per stream, before any capture
    gemm.quantize(x, G, codes_out, scales_out, stream)      # x float32 [M,K] -> int8 [M,K], f32 [M,K/G]
    gemm.q8(a_codes, a_scales, weight, out, n, stream)      # out float32 [M, >=n] <- A (x) weight
    gemm.f32(a, weight, out, n, stream)                     # float activations variant

``weight`` is a ``residency.DeviceWeight`` (see ``weights.py`` for its layout); ``n`` is how many output
columns to write: the weight's N, or its NG for a fused buffer (members side by side, in order); ``out``'s
rows must be contiguous, its row stride is its own (a column slice of a wider buffer is written in place).
M <= GEMV_MAX_M runs the decode GEMV (``gemv_warp.cu``), larger M the tensor-core kernel (``gemm_mma.cu``,
block shape by ``mma_tile_for``); up to SPLIT_MAX_M rows (decode batches) it splits K over enough blocks to
keep the memory system busy (``mma_splits``), and with ``clusters`` (sm_90) each tile's splits run as one
thread block cluster that adds their sums in shared memory; so do the last few rows of a larger M past whole
large blocks (``split_rows``). On sm_90, 17..64 rows of int8 codes at G = 32 run the tensor-copy block
(``gemm_tma.cu``, ``tile_for``), its weights and activations requested through tensor maps; from 33 rows in
half as many K splits (``tma_splits``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kestrel_cuda.forward_launch import ExLauncher, TensorMapEncoder
from kestrel_cuda.forward_launch import ptr_arg as _ptr
from kestrel_cuda.kernels import (
    BLOCK_SHAPES,
    MMA_BK,
    MMA_TILE_DEFAULT,
    MMA_TILE_SMALL_GRID,
    MMA_TILE_SPLIT,
    MMA_TILE_SPLIT_SMALL,
    MMA_TILES,
    TMA_TILE,
    TMA_TILES,
)
from kestrel_cuda.layout import Geometry
from kestrel_cuda.plan import GROUPED_ROWS, GROUPED_ROWS_FEW, MAX_CLUSTER
from kestrel_cuda.residency import DeviceWeight

GEMV_MAX_M = 1
# a mixture of experts' grouped GEMM by its positions a block (plan.grouped_rows): a prefill's (~32 rows an
# expert at 512 tokens, 8 of 128 experts) or a decode batch's (one or two rows an expert)
GROUPED_TILES = {GROUPED_ROWS: "64x128", GROUPED_ROWS_FEW: "16x128"}
NULL = np.uint64(0)
SPLIT_MAX_M = 64  # up to this many rows the tensor-core GEMM splits K (the 16x128s or 32x128s block)
SPLIT_BLOCKS_PER_SM = 2  # the split GEMM's grid target, in blocks per SM
ROW_SPLIT_MIN = 512  # rows in whole large blocks from which a GEMM's last few rows run apart (split_rows)
GW_THREADS = 256  # gemv_warp.cu: 8 warps, one 32-row slice each
GW_SLICES = 8
F32_THREADS, F32_MT = 128, 4
QUANT_THREADS = 256
BLOCKS_PER_SM = 4  # GEMV grid target: enough resident warps to keep the memory system busy
PARTIAL_FLOATS = 1 << 22  # split-K partial sums: 16 MiB per stream
COUNTERS = 1 << 16

i32 = np.int32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Workspace:
    """Split-K scratch of the GEMV: partial sums and per-column-tile arrival counters (kept at zero)."""

    partial: Any  # float32 [PARTIAL_FLOATS]
    counters: Any  # uint32 [COUNTERS]

    @classmethod
    def create(cls, cp: Any) -> Workspace:
        return cls(cp.empty(PARTIAL_FLOATS, dtype=cp.float32), cp.zeros(COUNTERS, dtype=cp.uint32))


def row_stride(out: Any) -> int:
    """The elements between two rows of a 2-D output whose rows are contiguous (a column slice of a wider
    buffer included)."""
    if out.ndim != 2 or out.strides[1] != out.itemsize or out.strides[0] % out.itemsize:
        raise ValueError(f"output rows must be contiguous (shape {out.shape}, strides {out.strides})")
    return out.strides[0] // out.itemsize


def gemv_warp_variant(npad: int, bits: int) -> tuple[str, int, int, int]:
    """("warp", MT, VEC, BITS): the GEMV for Npad columns (one row a launch); see gemv_warp.cu."""
    return "warp", 1, 8 if npad % 8 == 0 else 4, bits


def split_fits(k: int, npad: int) -> bool:
    """Whether the split block shapes take a K x Npad weight: whole stages and whole column tiles (they copy
    without bounds checks)."""
    return k % MMA_BK == 0 and npad % MMA_TILES[MMA_TILE_SPLIT].bn == 0


def split_rows(m: int, k: int, npad: int) -> int:
    """The rows of an M-row GEMM that run apart from the rest (0: none): beyond ROW_SPLIT_MIN rows, the last
    1..SPLIT_MAX_M rows past a whole number of large blocks run through the split shapes, which read the
    weights again rather than leave most of a padded row block idle (a 512-token prompt beside 32 decode rows,
    M = 544: the qwen3-8b GEMMs 39.5 ms against 46.6 / 53.3 in the 64- / 128-row blocks alone, cuda_prefill.py
    --m 544)."""
    rows = m % MMA_TILES[MMA_TILE_DEFAULT].bm
    return rows if m - rows >= ROW_SPLIT_MIN and 0 < rows <= SPLIT_MAX_M and split_fits(k, npad) else 0


def mma_tile_for(m: int, npad: int, sm_count: int, k: int | None = None) -> str:
    """The tensor-core block shape for an M x Npad GEMM (of depth ``k``; None: one the split shapes take). Up
    to SPLIT_MAX_M rows, the 16-row split block up to 16 rows and the 32-row one beyond (two row blocks at 64
    rows: as fast as one 64-row block of 8 warps). Beyond, the large block (one per SM) unless its grid would
    leave the last wave less than half full, where the 64-row block (two per SM) is faster: it halves the tail,
    and a block left alone on an SM at the end runs faster than two sharing it."""
    if m <= SPLIT_MAX_M and split_fits(MMA_BK if k is None else k, npad):
        return MMA_TILE_SPLIT_SMALL if m <= MMA_TILES[MMA_TILE_SPLIT_SMALL].bm else MMA_TILE_SPLIT
    big = MMA_TILES[MMA_TILE_DEFAULT]
    tail = (_cdiv(m, big.bm) * _cdiv(npad, big.bn)) % sm_count
    return MMA_TILE_SMALL_GRID if 0 < tail < sm_count // 2 else MMA_TILE_DEFAULT


def mma_splits(k: int, npad: int, group_size: int, sm_count: int,
               blocks_per_sm: int = SPLIT_BLOCKS_PER_SM) -> tuple[int, int]:
    """(K splits, stages a split) of the tensor-core GEMM at 2..SPLIT_MAX_M rows: splits of whole groups, enough
    for ``blocks_per_sm`` blocks per SM, at most MAX_CLUSTER (one cluster) and as many as the workspace holds
    at SPLIT_MAX_M rows. Independent of M, so a row's sums are added in the same order in every batch of that
    range (batch-invariant bits; the tensor-copy block halves them from 33 rows: ``tma_splits``), and of
    whether the splits run as a cluster."""
    tiles = _cdiv(npad, MMA_TILES[MMA_TILE_DEFAULT].bn)
    want = _cdiv(blocks_per_sm * sm_count, tiles)
    return split_stages(k, group_size, min(want, MAX_CLUSTER, PARTIAL_FLOATS // (SPLIT_MAX_M * npad)))


def tma_splits(m: int, block_rows: int, splits: int) -> int:
    """K splits of the tensor-copy GEMM (gemm_tma.cu) for the split target's ``splits``: as many at one row
    block, half as many from two, so that the grid stays as deep as one row block's (one wave). A row's bits
    are the same in every batch of 2-32 rows and in every batch of 33-64, not between the two."""
    return splits if m <= block_rows else _cdiv(splits, 2)


def split_stages(k: int, group_size: int, splits: int) -> tuple[int, int]:
    """(K splits, stages a split) for at most ``splits`` splits of whole groups (at least one, at most one a
    group)."""
    unit = max(1, group_size // MMA_BK)  # stages of one group
    stages = _cdiv(k, MMA_BK)
    groups = _cdiv(stages, unit)
    per = unit * _cdiv(groups, max(1, min(splits, groups)))
    return _cdiv(stages, per), per


def _launch(kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, stream: Any,
            shared_mem: int = 0) -> None:
    with stream if stream is not None else contextlib.nullcontext():
        kernel(grid, block, args, shared_mem=shared_mem)


class DeviceGemm:
    """``clusters``: the split GEMM's K splits of a tile run as one thread block cluster (sm_90, through
    cuLaunchKernelEx); otherwise the last split to arrive adds them from the workspace. Both add them in split
    order: the same bits."""

    def __init__(self, cp: Any, kernels: Any, sm_count: int, clusters: bool = False) -> None:
        self.cp = cp
        self.kernels = kernels
        self.sm_count = sm_count
        self._workspaces: dict[int, Workspace] = {}
        self.launches = {"gemv": 0, "mma": 0, "f32": 0, "quantize": 0}
        self._ex: Any = None  # cuLaunchKernelEx, for clusters and programmatic dependent launch
        self._tma: Any = None
        self._maps: dict[tuple, Any] = {}
        with contextlib.suppress(OSError, AttributeError):  # none: the workspace merge, plain launches
            self._ex = ExLauncher()
            self._tma = TensorMapEncoder()
        self._clusters = clusters and self._ex is not None

    @property
    def clusters(self) -> bool:
        return self._clusters

    @property
    def tensor_copies(self) -> bool:
        """Whether the 17-64-row split GEMM at int8 G = 32 runs the tensor-copy block (gemm_tma.cu): sm_90 with
        clusters on, and the driver's tensor-map encoder."""
        return self._clusters and self._tma is not None

    def workspace(self, stream: Any | None = None) -> Workspace:
        """The split-K workspace of ``stream`` (created on first use: call it before a graph capture)."""
        key = 0 if stream is None else int(stream.ptr)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = Workspace.create(self.cp)
        return ws

    # -- activations ---------------------------------------------------------------------------------

    def quantize(self, x: Any, group_size: int, codes_out: Any, scales_out: Any, stream: Any = None) -> None:
        """Q8_0 per block of ``group_size``, bit-identical to kestrel_core.contract.quantize_activations."""
        m, k = x.shape
        if k % group_size or codes_out.shape != (m, k) or scales_out.shape != (m, k // group_size):
            raise ValueError("quantize: shapes do not match")
        warps = m * (k // group_size)
        _launch(self.kernels.quantize[group_size], (_cdiv(warps * 32, QUANT_THREADS),), (QUANT_THREADS,),
                (x, codes_out, scales_out, i32(m), i32(k)), stream)
        self.launches["quantize"] += 1

    # -- GEMMs ---------------------------------------------------------------------------------------

    def q8(self, a_codes: Any, a_scales: Any, weight: DeviceWeight, out: Any, n: int | None = None,
           stream: Any = None, *, pdl: bool = False, accumulate: bool = False, variant: tuple | None = None,
           splits: int | None = None, mma_tile: str | None = None, fold: tuple[Any, Any, Any, Any] | None = None,
           row_ssq: tuple[Any, float] | None = None) -> None:
        """out[:M, :n] = int8 GEMM of a_codes [M,K] (scales [M,K/G]) with ``weight``; with ``accumulate``
        (the tensor-core kernel) out[:M, :n] += it instead (the residual add, bits as out + a stored result).

        The norm fold (``norm_fold`` says where it runs; gemm_tile.cuh NormFold): ``fold`` (w, codes, scales,
        ssq) also quantizes out's rows times the norm's weights w for the next normed GEMM, codes [M, n] and
        scales [M, n / 32] as of the row before its norm, and leaves its sums of squares ssq [n / 128, M];
        ``row_ssq`` (ssq, eps): a_scales are such a row's, its sums stored times its 1 / rms from ssq.

        ``pdl`` (the tensor-core kernel, inside a graph capture): launched with programmatic stream
        serialization, so it copies its first weights while the previous kernel still runs (gemm_mma.cu).

        Benchmarks and tests may force a kernel: ``variant`` ("warp", MT, VEC, BITS) of the GEMV, ``splits`` its
        split-K (or the tensor-core kernel's), ``mma_tile`` the tensor-core kernel (a ``kernels.MMA_TILES``
        block shape) at any M.
        """
        g = weight.geometry
        m, k = a_codes.shape
        n = g.npad if n is None else n
        ldo = row_stride(out)
        if k != g.k or a_scales.shape != (m, g.ngroups) or out.shape[0] < m or out.shape[1] < n or n > g.npad:
            raise ValueError(f"q8: shapes do not match (A {a_codes.shape}, weight K={g.k} Npad={g.npad})")
        if (m <= GEMV_MAX_M or variant is not None) and mma_tile is None:
            if accumulate or fold is not None or row_ssq is not None:
                raise ValueError("q8: accumulate and the norm fold are the tensor-core kernel's (M > 1)")
            self._gemv_warp(a_codes, a_scales, weight, out, n, ldo, stream, variant, splits)
            return
        plain = mma_tile is None and splits is None and fold is None and row_ssq is None
        rest = split_rows(m, k, g.npad) if plain else 0
        if rest:  # the last rows through the split shapes, one row too (the GEMV has no ``accumulate``)
            head = m - rest
            self.q8(a_codes[:head], a_scales[:head], weight, out[:head], n, stream, pdl=pdl, accumulate=accumulate)
            self.q8(a_codes[head:], a_scales[head:], weight, out[head:m], n, stream, pdl=pdl, accumulate=accumulate,
                    mma_tile=self.tile_for(rest, g))
            return
        name = mma_tile or self.tile_for(m, g)
        tile = BLOCK_SHAPES[name]
        if tile.split and not split_fits(k, g.npad):
            raise ValueError(f"q8: the split block shapes take whole stages and tiles (K={k}, Npad={g.npad})")
        kern = self.kernels.mma.get((g.code_bits, g.group_size, name))
        if kern is None:
            raise ValueError(f"no tensor-core kernel for int{g.code_bits} G={g.group_size}")
        nz, per, grid = self._grid(m, g, name, splits)
        ws = self.workspace(stream)
        if nz > 1 and (nz * m * g.npad > PARTIAL_FLOATS or grid[0] * grid[1] > COUNTERS):
            raise ValueError(f"q8: {nz} K splits of {m} x {g.npad} do not fit the workspace")
        # blockIdx.x walks M, so the blocks resident together share one weight tile
        smem = tile.smem_bytes(g.code_bits, g.group_size)
        cluster = (1, 1, grid[2]) if 1 < grid[2] <= MAX_CLUSTER and self._clusters else None
        if (fold is not None and (cluster is None or name not in TMA_TILES or n != g.npad)
                or row_ssq is not None and (name not in TMA_TILES or fold is not None)):
            raise ValueError(f"q8: no norm fold in the {name} GEMM of {m} rows (K={k}, N={n}, Npad={g.npad})")
        if name in TMA_TILES:  # tensor maps of the weight codes, weight scales and activation codes
            kern = self.kernels.tma[1 if row_ssq is not None else 2 if fold is not None else 0]
            if not self.tensor_copies:
                raise ValueError("q8: the tensor-copy GEMM needs sm_90's clusters and tensor maps")
            enc = self._tma
            tw = self._map(weight.codes.data.ptr, enc.UINT8, (g.npad, k), g.npad, (tile.bn, MMA_BK), True)
            tws = self._map(weight.scales.data.ptr, enc.FLOAT32, (g.npad, g.ngroups), 4 * g.npad,
                            (tile.bn, MMA_BK // 32), False)
            ta = self._map(a_codes.data.ptr, enc.UINT8, (k, m), k, (MMA_BK, tile.bm), True)
            fw, fcodes, fscales, fssq = fold or (None, None, None, None)
            rssq, eps = row_ssq or (None, 0.0)
            args = (tw, tws, ta, _ptr(a_scales), i32(m), _ptr(out), i32(ldo), i32(accumulate), i32(n), i32(k),
                    i32(per), _ptr(fw), _ptr(fcodes), _ptr(fscales), _ptr(fssq), _ptr(rssq), np.float32(eps))
        else:
            args = (_ptr(a_codes), _ptr(a_scales), i32(m), _ptr(weight.codes), _ptr(weight.scales), _ptr(out),
                    i32(ldo), i32(accumulate), i32(n), i32(k), i32(g.npad), _ptr(ws.partial), _ptr(ws.counters),
                    i32(per), NULL, NULL)
        if (cluster or pdl or name in TMA_TILES) and self._ex is not None:
            self._ex.launch(kern, grid, (tile.threads,), args, smem,
                            stream if stream is not None else self.cp.cuda.get_current_stream(), pdl, cluster)
        else:
            _launch(kern, grid, (tile.threads,), args, stream, smem)
        self.launches["mma"] += 1

    def _grid(self, m: int, g: Geometry, name: str, splits: int | None = None
              ) -> tuple[int, int, tuple[int, int, int]]:
        """(K splits, stages a split, grid) of ``q8``'s M-row launch in block shape ``name``."""
        tile = BLOCK_SHAPES[name]
        stages = _cdiv(g.k, MMA_BK)
        nz, per = mma_splits(g.k, g.npad, g.group_size, self.sm_count) if m <= SPLIT_MAX_M else (1, stages)
        if not tile.split:
            nz, per = 1, stages
        elif splits is not None:
            nz, per = split_stages(g.k, g.group_size, splits)
        elif name in TMA_TILES:
            nz, per = split_stages(g.k, g.group_size, tma_splits(m, tile.bm, nz))
        return nz, per, (_cdiv(m, tile.bm), _cdiv(g.npad, tile.bn), nz)

    def norm_fold(self, m: int, producer: Geometry, n: int, consumers: Sequence[Geometry]) -> bool:
        """Whether an M-row residual add into ``producer`` (n columns) takes ``q8(fold=...)`` and each of the
        normed GEMMs after it ``q8(row_ssq=...)``: all of them the tensor-copy block, the producer's K splits
        one cluster a tile (the fold's rows are whole in the cluster's store) and its columns whole tiles."""
        names = [self.tile_for(m, g) for g in (producer, *consumers)]
        if any(name not in TMA_TILES for name in names) or n != producer.npad or not consumers:
            return False
        return 1 < self._grid(m, producer, names[0])[2][2] <= MAX_CLUSTER

    def tile_for(self, m: int, geometry: Geometry) -> str:
        """The block shape ``q8`` runs an M-row GEMM with: ``mma_tile_for``'s, with the tensor-copy block in
        place of the 32-row split one at int8 G = 32 where ``tensor_copies``."""
        g = geometry
        name = mma_tile_for(m, g.npad, self.sm_count, g.k)
        if name == MMA_TILE_SPLIT and self.tensor_copies and g.code_bits == 8 and g.group_size == 32:
            return TMA_TILE
        return name

    def _map(self, ptr: int, dtype: int, dims: tuple[int, int], row_bytes: int, box: tuple[int, int],
             swizzle128: bool) -> Any:
        key = (ptr, dtype, dims, row_bytes, box)
        tmap = self._maps.get(key)
        if tmap is None:
            if len(self._maps) > 4096:
                self._maps.clear()
            tmap = self._maps[key] = self._tma.tiled(ptr, dtype, dims, row_bytes, box, swizzle128)
        return tmap

    def grouped(self, a_codes: Any, a_scales: Any, geometry: Geometry, table: Any, groups: Any, blocks: int,
                out: Any, n: int, stream: Any = None, rows: int = GROUPED_ROWS) -> None:
        """A mixture of experts' GEMMs in one launch: a_codes [P,K] (scales [P,K/G]) are every expert's rows,
        sorted by expert; ``groups`` int32 [blocks, 3] names each block row's (expert, first row, rows) (at
        most ``rows``, a key of GROUPED_TILES), ``table`` uint64 [E, 2] the experts' (codes, scales) pointers,
        all of ``geometry``; out[:P, :n] gets each row's outputs."""
        g = geometry
        name = GROUPED_TILES[rows]
        tile = MMA_TILES[name]
        assert tile.bm == rows and not tile.split
        kern = self.kernels.mma.get((g.code_bits, g.group_size, name))
        if kern is None or a_codes.shape[1] != g.k or out.shape[1] < n or n > g.npad:
            raise ValueError(f"grouped: no kernel or shapes do not match (A {a_codes.shape}, K={g.k})")
        ws = self.workspace(stream)
        _launch(kern, (blocks, _cdiv(g.npad, tile.bn), 1), (tile.threads,),
                (a_codes, a_scales, i32(a_codes.shape[0]), NULL, NULL, out, i32(row_stride(out)), i32(0), i32(n),
                 i32(g.k), i32(g.npad), ws.partial, ws.counters, i32(_cdiv(g.k, MMA_BK)), groups, table), stream,
                tile.smem_bytes(g.code_bits, g.group_size))
        self.launches["mma"] += 1

    def _gemv_warp(self, a_codes: Any, a_scales: Any, weight: DeviceWeight, out: Any, n: int, ldo: int,
                   stream: Any, variant: tuple | None, splits: int | None) -> None:
        g = weight.geometry
        m = a_codes.shape[0]
        _, mt, vec, bits = variant or gemv_warp_variant(g.npad, g.code_bits)
        if g.npad % vec or bits != g.code_bits or g.group_size not in (32, 256):
            raise ValueError(f"GEMV variant {(mt, vec, bits)} does not fit {g}")
        kern = self.kernels.gemv_warp[(mt, vec, bits)]
        ws = self.workspace(stream)
        gx = _cdiv(g.npad, 32 * vec)
        max_split = _cdiv(g.k // 32, GW_SLICES)
        gy = splits or min(max_split, max(1, _cdiv(BLOCKS_PER_SM * self.sm_count, gx)))
        gy = max(1, min(gy, max_split, PARTIAL_FLOATS // (mt * g.npad)))
        if gx > COUNTERS:
            gy = 1
        for m0 in range(0, m, mt):
            _launch(kern, (gx, gy), (GW_THREADS,),
                    (a_codes[m0:], a_scales[m0:], i32(min(mt, m - m0)), weight.codes, weight.scales, out[m0:],
                     i32(ldo), i32(n), ws.partial, ws.counters, i32(g.k), i32(g.npad), i32(g.group_size)), stream)
            self.launches["gemv"] += 1

    def f32(self, a: Any, weight: DeviceWeight, out: Any, n: int | None = None, stream: Any = None) -> None:
        """out[:M, :n] = float32 activations a [M,K] times ``weight`` (float block sums, then scales)."""
        g = weight.geometry
        m, k = a.shape
        n = g.npad if n is None else n
        ldo = row_stride(out)
        if k != g.k or out.shape[0] < m or out.shape[1] < n or n > g.npad:
            raise ValueError("f32: shapes do not match")
        _launch(self.kernels.f32[g.code_bits], (_cdiv(g.npad // 4, F32_THREADS), _cdiv(m, F32_MT)),
                (F32_THREADS,), (a, i32(m), weight.codes, weight.scales, out, i32(ldo), i32(n), i32(k),
                                 i32(g.npad), i32(g.group_size)), stream)
        self.launches["f32"] += 1
