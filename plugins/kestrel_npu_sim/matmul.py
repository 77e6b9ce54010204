"""The GEMM hooks' work: integer block sums on the simulated NPU, scales and float accumulation on the host.

The NPU applies only per-layer or per-channel scales, so a strip-cache GEMM with one scale per K-block
becomes one integer matmul per block (``block_sums``); the host then applies ``a_scale * w_scale`` per
block and sums the blocks in float32 exactly as ``kestrel_core.contract.reference_gemm_q8`` does. Integer
block sums are exact, so results equal the reference's up to the order of the float accumulation.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np

from kestrel_core.contract import StripCache

from .device import NpuSimDevice, PackedWeight
from .layout import TILE_K, TILE_N, geometry, padded_n
from .slicing import int8_slices, recombine
from .stats import BAD_OPERANDS, N_UNALIGNED, NON_FINITE, TOO_LARGE

ROWS_PER_GROUP = 8  # activation rows per work-group of the wide kernel


def block_sums(dev: NpuSimDevice, a_codes: np.ndarray, packed: PackedWeight,
               group_size: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """a_codes int8 [R, K] -> per N-chunk (n0, n1, int32 [K/G, R, n1-n0]): one launch per K-segment.

    Only real columns come back: the padded rows N..n_pad are computed (as the NPU would) and dropped.
    """
    cl, queue, geo = dev.cl, dev.queue, packed.geo
    r, k = a_codes.shape
    ngroups = k // group_size
    a_host = np.ascontiguousarray(a_codes)  # alive until the first blocking read: the copy is asynchronous
    a_buf = dev.scratch("a", a_host.nbytes)
    cl.enqueue_copy(queue, a_buf, a_host, is_blocking=False)
    rows = ROWS_PER_GROUP if r >= ROWS_PER_GROUP else 1
    kernel = dev.kernels[rows]
    for n0, n1 in geo.chunks:
        nc = n1 - n0
        c_buf = dev.scratch("c", ngroups * r * nc * 4)
        for s, (k0, k1) in enumerate(geo.segments):
            kernel(queue, (nc, -(-r // rows)), (TILE_N, 1),
                   a_buf, k, k0, packed.buffer, geo.tile_offset(s, n0), (k1 - k0) // TILE_K,
                   group_size // TILE_K, (k1 - k0) // group_size,
                   c_buf, (k0 // group_size) * r * nc, nc, r)
            dev.stats.launches += 1
        host = np.empty((ngroups, r, nc), dtype=np.int32)                      # [K/G, R, Nc]
        cl.enqueue_copy(queue, host, c_buf)
        real = min(n1, geo.n) - n0
        if real > 0:
            yield n0, n0 + real, host[:, :, :real]


def _decline_reason(dev: NpuSimDevice, k: int, weights: Sequence[StripCache], rows: int) -> str | None:
    if any(w.k != k or w.group_size != weights[0].group_size for w in weights):
        return BAD_OPERANDS
    if any(w.n % TILE_N for w in weights) and not dev.pad_n:
        return N_UNALIGNED
    geo = geometry(sum(padded_n(w.n) for w in weights[:-1]) + weights[-1].n, k)
    widest = max(n1 - n0 for n0, n1 in geo.chunks)
    if max(geo.nbytes, weights[0].ngroups * rows * widest * 4, rows * k) > dev.max_alloc:
        return TOO_LARGE
    return None


def _gemm_q8(dev: NpuSimDevice, a_codes: np.ndarray, a_scales: np.ndarray, weights: Sequence[StripCache],
             wkey: int) -> list[np.ndarray] | None:
    """a_codes int8 [M, K], a_scales float32 [M, K/G] times each weight -> float32 [M, N_i] each, or None."""
    started = time.perf_counter()
    g = weights[0].group_size
    ok = (isinstance(a_codes, np.ndarray) and isinstance(a_scales, np.ndarray) and a_codes.ndim == 2
          and a_codes.dtype == np.int8 and a_scales.dtype == np.float32
          and a_scales.shape == (a_codes.shape[0], a_codes.shape[1] // g))
    reason = _decline_reason(dev, a_codes.shape[1], weights, a_codes.shape[0]) if ok else BAD_OPERANDS
    if reason:
        dev.stats.declined[reason] += 1
        return None
    m = a_codes.shape[0]
    if not m:
        dev.stats.calls += 1
        return [np.zeros((0, w.n), dtype=np.float32) for w in weights]
    packed = dev.packed(weights, wkey)
    out = np.empty((m, packed.geo.n), dtype=np.float32)
    a_scales_t = a_scales.T                                                     # [K/G, M]
    for n0, n1, sums in block_sums(dev, a_codes, packed, g):
        # the reference's expression, term for term: (block sum * a_scale) * w_scale, summed over blocks
        scaled = sums.astype(np.float32) * a_scales_t[:, :, None] * packed.scales_t[:, None, n0:n1]
        out[:, n0:n1] = scaled.sum(axis=0, dtype=np.float32)
    dev.stats.charge(dev.cost.gemm(m, packed.geo, g), m)
    dev.stats.calls += 1
    dev.stats.wall_s += time.perf_counter() - started
    if len(weights) == 1:
        return [out]
    return [np.ascontiguousarray(out[:, off:off + w.n]) for off, w in zip(packed.offsets, weights)]


def gemm_q8(dev: NpuSimDevice, a_codes: np.ndarray, a_scales: np.ndarray, weight: StripCache,
            wkey: int) -> np.ndarray | None:
    """a_codes int8 [M, K], a_scales float32 [M, K/G] -> float32 [M, N], or None (declined, counted)."""
    out = _gemm_q8(dev, a_codes, a_scales, (weight,), wkey)
    return None if out is None else out[0]


def gemm_fused_q8(dev: NpuSimDevice, a_codes: np.ndarray, a_scales: np.ndarray, weights: Sequence[StripCache],
                  fused_wkey: int) -> list[np.ndarray] | None:
    """Weights sharing K (Q|K|V, gate|up) stacked along N into one native weight: one set of NPU runs
    instead of one per weight, each member starting on a fresh 32-row tile."""
    return _gemm_q8(dev, a_codes, a_scales, tuple(weights), fused_wkey)


def gemm_f32(dev: NpuSimDevice, a: np.ndarray, weight: StripCache, wkey: int) -> np.ndarray | None:
    """Float activations [M, K] as exact int8 slices (see slicing.py): L integer matmuls per block."""
    started = time.perf_counter()
    if not isinstance(a, np.ndarray) or a.ndim != 2 or not np.issubdtype(a.dtype, np.floating):
        dev.stats.declined[BAD_OPERANDS] += 1
        return None
    a = a.astype(np.float32)  # the reference computes in float32 too
    if not np.all(np.isfinite(a)):
        dev.stats.declined[NON_FINITE] += 1
        return None
    m, k = a.shape
    reason = _decline_reason(dev, k, (weight,), 0)
    if reason is None and m:
        slices, exps = int8_slices(a, weight.group_size)                        # [L, M, K], [M, K/G]
        reason = _decline_reason(dev, k, (weight,), len(slices) * m)
    if reason:
        dev.stats.declined[reason] += 1
        return None
    out = np.zeros((m, weight.n), dtype=np.float32)
    if m:
        n_slices = len(slices)
        packed = dev.packed((weight,), wkey)
        stacked = slices.reshape(n_slices * m, k)                              # [L*M, K]
        for n0, n1, sums in block_sums(dev, stacked, packed, weight.group_size):
            exact = recombine(sums.reshape(weight.ngroups, n_slices, m, n1 - n0), exps)  # [K/G, M, Nc]
            scaled = exact.astype(np.float32) * packed.scales_t[:, None, n0:n1]
            out[:, n0:n1] = scaled.sum(axis=0, dtype=np.float32)
        dev.stats.f32_slices += n_slices
        dev.stats.charge(dev.cost.gemm(n_slices * m, packed.geo, weight.group_size), m)
    dev.stats.calls += 1
    dev.stats.wall_s += time.perf_counter() - started
    return out
