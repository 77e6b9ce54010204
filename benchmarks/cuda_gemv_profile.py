"""The whole-step decode's M=1 GEMV on Qwen3-8B shapes, launched eagerly (no graph, no PDL) a few times each,
for a profiler to attach to: Nsight Compute's counters (memory throughput, stall reasons per SASS line).

    ncu --clock-control none -k regex:qgemv -o gemv python benchmarks/cuda_gemv_profile.py q:8 o:8 gate/up:4

Each argument is shape:bits (shapes of benchmarks/cuda_gemv.py, bits 8 or 4, G = 32), launched ``--launches``
times with the planner's K splits (KESTREL_CUDA_* settings apply, as in the decode step).
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("configs", nargs="+", help="shape:bits, e.g. q:8 gate/up:4")
    p.add_argument("--launches", type=int, default=2)
    args = p.parse_args()

    import cupy as cp
    from cuda_gemv import SHAPES

    from kestrel_cuda.binding import open_device
    from kestrel_cuda.forward_ops import EPI_STORE, PRO_PLAIN, CupyOps, Lin, gemv_scratch, plan_split
    from kestrel_cuda.residency import DeviceWeight, Geometry, pad_n

    dev = open_device({})
    ops = CupyOps(dev.stream)
    shapes = {**SHAPES, "q|k|v": (6144, 4096)}
    for config in args.configs:
        name, _, bits_text = config.partition(":")
        n, k = shapes[name]
        bits = int(bits_text or 8)
        geo = Geometry(k, pad_n(n), k // 32, 4 if bits == 4 else 8)
        w = DeviceWeight(0, geo, dev.allocator.alloc(geo.nbytes), None, True, None)
        with dev.stream:
            w.codes[...] = cp.random.randint(0, 2**31 - 1, size=geo.codes_nbytes // 4, dtype=cp.int32).view(cp.int8)
            w.scales[...] = cp.random.uniform(1e-3, 2e-2, size=w.scales.shape).astype(cp.float32)
        lin = Lin.from_device_weight(w, n)
        lin.ksplit = plan_split(lin, ops.gemv_kind, ops.sm_count, clusters=ops.cluster)
        part, counters, merge_tiles = gemv_scratch([lin])
        ops.reserve(part, counters, 1, 1, merge_tiles)
        x = cp.asarray(np.random.default_rng(0).standard_normal((1, k)).astype(np.float32))
        y = cp.empty((1, n), dtype=cp.float32)
        for _ in range(args.launches):
            ops.gemv(lin, x, PRO_PLAIN, None, 0.0, 0, y, EPI_STORE, None)
        dev.stream.synchronize()
        print(f"{config}: {lin.ksplit} splits, cluster {lin.cluster}, {geo.nbytes / 1e6:.1f} MB", flush=True)
        dev.allocator.free(w.buffer)


if __name__ == "__main__":
    main()
