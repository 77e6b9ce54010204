"""The whole-step decode's M=1 GEMV on Qwen3-8B shapes, launched eagerly (no graph, no PDL) a few times each,
for a profiler to attach to: Nsight Compute's counters (memory throughput, stall reasons per SASS line).

    ncu --clock-control none -k regex:qgemv -o gemv python benchmarks/cuda_gemv_profile.py q:8 o:8 gate/up:4

Each argument is shape:bits (shapes of benchmarks/cuda_gemv.py, bits 8 or 4, G = 32), launched ``--launches``
times with the planner's K splits (the device's settings apply, as in the decode step).
"""

from __future__ import annotations

import argparse

import numpy as np
from cuda_required import require_cuda


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("configs", nargs="+", help="shape:bits, e.g. q:8 gate/up:4")
    p.add_argument("--launches", type=int, default=2)
    args = p.parse_args()

    import cupy as cp
    from cuda_gemv import DECODE_SHAPES, Bench, plan_decode

    from kestrel_cuda.plan import EPI_STORE, PRO_PLAIN, Lin

    bench = Bench(args)
    ops = bench.decode_ops()
    for config in args.configs:
        name, _, bits_text = config.partition(":")
        n, k = DECODE_SHAPES[name]
        w = bench.device_weight(n, k, 32, int(bits_text or 8), 1)
        lin = Lin.from_device_weight(w, n)
        plan_decode(ops, [lin])
        x = cp.asarray(np.random.default_rng(0).standard_normal((1, k)).astype(np.float32))
        y = cp.empty((1, n), dtype=cp.float32)
        for _ in range(args.launches):
            ops.gemv(lin, x, PRO_PLAIN, None, 0.0, 0, y, EPI_STORE, None)
        bench.stream.synchronize()
        print(f"{config}: {lin.ksplit} splits, cluster {lin.cluster}, {w.geometry.nbytes / 1e6:.1f} MB", flush=True)
        bench.release([w])


if __name__ == "__main__":
    require_cuda()
    main()
