"""The RK3588 matmul geometry: the native int8 weight layout, K-segments and N-chunks.

Limits of the RKNPU2 matmul API (``rknn_matmul_api.h``, ``rknn_matmul_set_io_mem``): int8 x int8 -> int32;
B (the weight) in the native layout ``[N/32, K/32, 32, 32]``; K a multiple of 32 and at most 10240 per
matmul, a longer K split into segments of 8192 (each segment its own native buffer); N a multiple of 32
and at most 4096 per matmul, a wider N split into chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kestrel_core.contract import StripCache

TILE_N = 32  # int8 native tile height (output columns)
TILE_K = 32  # native tile width (reduction)
TILE_BYTES = TILE_N * TILE_K
K_MAX = 10240  # longest K one matmul takes
K_SEGMENT = 8192  # segment length once K exceeds K_MAX
N_MAX = 4096  # widest N one matmul takes


@dataclass(frozen=True)
class Geometry:
    """How one [N, K] weight is cut into NPU matmuls: K-segments x N-chunks (over the padded N)."""

    n: int
    k: int
    n_pad: int
    segments: tuple[tuple[int, int], ...]  # [k0, k1) column ranges
    chunks: tuple[tuple[int, int], ...]  # [n0, n1) ranges of the padded N, each <= N_MAX

    @property
    def nbytes(self) -> int:
        return self.n_pad * self.k

    def segment_offset(self, s: int) -> int:
        """Byte offset of segment ``s``'s native buffer in the packed weight (segments are stored in order)."""
        return self.n_pad * self.segments[s][0]

    def tile_offset(self, s: int, n0: int) -> int:
        """Byte offset of the chunk starting at padded row ``n0`` inside segment ``s``: a contiguous slice."""
        k0, k1 = self.segments[s]
        return self.segment_offset(s) + (n0 // TILE_N) * ((k1 - k0) // TILE_K) * TILE_BYTES


def padded_n(n: int) -> int:
    return -(-n // TILE_N) * TILE_N


def split_k(k: int) -> tuple[tuple[int, int], ...]:
    if k <= K_MAX:
        return ((0, k),)
    return tuple((k0, min(k0 + K_SEGMENT, k)) for k0 in range(0, k, K_SEGMENT))


def split_n(n_pad: int) -> tuple[tuple[int, int], ...]:
    return tuple((n0, min(n0 + N_MAX, n_pad)) for n0 in range(0, n_pad, N_MAX))


def geometry(n: int, k: int) -> Geometry:
    """The matmul plan of an [N, K] weight; K must be a multiple of 32 (every strip-cache K is)."""
    if k % TILE_K:
        raise ValueError(f"K={k} is not a multiple of {TILE_K}")
    n_pad = padded_n(n)
    return Geometry(n, k, n_pad, split_k(k), split_n(n_pad))


def repack(codes: np.ndarray, geo: Geometry) -> np.ndarray:
    """Strip-cache codes int8 [N, K] -> the packed native weight: int8 [n_pad * K], segment after segment.

    Segment s holds ``native[nt, kt, i, j] = W[nt*32 + i, k0 + kt*32 + j]``, shape [n_pad/32, Kseg/32, 32, 32];
    rows N..n_pad are zero, so padded output columns compute to zero and are dropped.
    """
    padded = np.zeros((geo.n_pad, geo.k), dtype=np.int8)
    padded[: geo.n] = codes
    parts = []
    for k0, k1 in geo.segments:
        seg = padded[:, k0:k1]                                                            # [n_pad, Kseg]
        tiles = seg.reshape(geo.n_pad // TILE_N, TILE_N, (k1 - k0) // TILE_K, TILE_K)   # [nt, i, kt, j]
        parts.append(np.ascontiguousarray(tiles.transpose(0, 2, 1, 3)).reshape(-1))    # [nt, kt, i, j]
    return np.concatenate(parts)


def fuse(weights: Sequence[StripCache]) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """Weights sharing K stacked along N, each but the last padded to whole native tiles:
    (codes int8 [N', K], scales float32 [N', K/G], first row of each member). One weight passes through."""
    if len(weights) == 1:
        return weights[0].codes, weights[0].scales, (0,)
    offsets, rows = [], 0
    for i, w in enumerate(weights):
        offsets.append(rows)
        rows += w.n if i == len(weights) - 1 else padded_n(w.n)
    codes = np.zeros((rows, weights[0].k), dtype=np.int8)
    scales = np.zeros((rows, weights[0].ngroups), dtype=np.float32)
    for off, w in zip(offsets, weights):
        codes[off:off + w.n] = w.codes
        scales[off:off + w.n] = w.scales
    return codes, scales, tuple(offsets)
