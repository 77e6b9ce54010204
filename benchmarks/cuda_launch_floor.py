"""What a captured decode step's hand-overs cost on the GPU with no work in them: a graph of ``--launches``
kernels chained under programmatic dependent launch (PDL), each only waiting for its predecessor, reading one
value it wrote, or merging K splits of 128-column tiles the three ways the forward does (the last split to
arrive through an L2 counter, tagged slots polled by the last split, or one thread block cluster pushing into
block 0's shared memory), against the same graph launched without PDL.

    python benchmarks/cuda_launch_floor.py

The kernels are cuda_launch_floor.cu, after the forward's common.cuh and merge.cuh. A qwen3-30b-a3b decode step
is 241 such launches (five a layer, and lm_head's); its grids are 320-512 blocks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from cuda_e2e import _events_us
from cuda_required import require_cuda

# (kernel, tiles, splits, threads, cluster): the hand-over alone and with one round trip at q|k|v's 384 blocks;
# the merges at decode attention's grid (32 heads x 16 splits) and q|k|v's (40 tiles x 8 splits)
CASES = (
    ("floor_empty", 384, 1, 256, False),
    ("floor_round_trip", 384, 1, 256, False),
    ("floor_counter_merge", 32, 16, 128, False),
    ("floor_counter_merge", 40, 8, 256, False),
    ("floor_tagged_merge", 32, 16, 128, False),
    ("floor_cluster_merge", 40, 8, 256, True),
    ("floor_tagged_merge", 40, 8, 256, False),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=241, help="kernels in the graph (a qwen3-30b-a3b step's)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed")
    args = ap.parse_args()

    import cupy as cp

    from kestrel_cuda.forward_launch import ExLauncher, ptr_arg
    from kestrel_cuda.kernels import OPTIONS, source_text

    code = source_text(("common.cuh", "merge.cuh")) + (Path(__file__).parent / "cuda_launch_floor.cu").read_text()
    module = cp.RawModule(code=code, options=OPTIONS)
    launcher = ExLauncher()
    stream = cp.cuda.Stream(non_blocking=True)
    buf = cp.zeros(1 << 16, np.float32)
    part = cp.zeros(1 << 18, np.float32)
    counters = cp.zeros(1024, np.int32)
    kernel_args = (ptr_arg(buf), ptr_arg(part), ptr_arg(counters))
    print(f"{args.launches} launches a graph, {args.reps} replays; µs a launch")
    print(f"{'kernel':20s} {'grid':>12s} {'threads':>7s} {'PDL':>7s} {'no PDL':>7s}")

    def per_launch_us(kernel: object, grid: tuple[int, int], threads: int, pdl: bool,
                      cluster: tuple[int, int, int] | None) -> float:
        def step() -> None:
            for _ in range(args.launches):
                launcher.launch(kernel, grid, (threads,), kernel_args, 0, stream, pdl, cluster)

        with stream:
            counters.fill(0)  # the counter merge's arrivals, the tagged merge's epochs
            step()
            stream.begin_capture()
            step()
            graph = stream.end_capture()
        graph.upload(stream)
        for _ in range(3):
            graph.launch(stream)
        return _events_us(cp, stream, lambda: graph.launch(stream), args.reps) / args.launches

    for name, tiles, splits, threads, cluster in CASES:
        kernel = module.get_function(name)
        shape = (1, splits, 1) if cluster else None
        pdl, plain = (per_launch_us(kernel, (tiles, splits), threads, p, shape) for p in (True, False))
        grid = f"{tiles} x {splits}" + (" cl" if cluster else "")
        print(f"{name:20s} {grid:>12s} {threads:7d} {pdl:7.2f} {plain:7.2f}", flush=True)


if __name__ == "__main__":
    require_cuda()
    main()
