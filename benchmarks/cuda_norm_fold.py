"""The norm fold's two roles in the tensor-copy GEMM against the same GEMM on plain codes, on the GPU.

    python benchmarks/cuda_norm_fold.py --rows 64

qwen3-8b's shapes at q8 G = 32 by default (q|k|v, gate|up, o, down): GPU µs a launch of ``--reps`` launches of
one shape in one graph (with PDL, as the step launches them), for the plain GEMM, the reader (``row_ssq``: its
rows' sums times 1 / rms from the fold's sums of squares) and, where ``norm_fold`` takes the shape, the folding
residual add (``fold``: the next norm's codes, scales and sums of squares written in its store).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from cuda_required import require_cuda

SHAPES = "6144x4096,24576x4096,4096x4096,4096x12288"  # N x K


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--shapes", default=SHAPES, help="N x K, comma-separated")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import cupy as cp

    from kestrel_core.contract import quantize_activations, quantize_weight
    from kestrel_core.wkey import NO_CACHE
    from kestrel_cuda.binding import open_device
    from kestrel_cuda.weights import geometry_for

    dev = open_device({})
    rng = np.random.default_rng(0)
    m, results = args.rows, {}
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = quantize_weight(rng.standard_normal((n, k)).astype(np.float32), 8, 32)
        dw = dev.weight(NO_CACHE, [w])
        codes, scales = (cp.asarray(a) for a in quantize_activations(rng.standard_normal((m, k)), 32))
        out = cp.zeros((m, n), cp.float32)
        variants = {"plain": {}, "row_ssq": {"row_ssq": (cp.ones((k // 128, m), cp.float32), 1e-6)}}
        if dev.gemm.norm_fold(m, geometry_for([w]), n, [geometry_for([w])]):
            fold = (cp.ones(n, cp.float32), cp.zeros((m, n), cp.int8), cp.zeros((m, n // 32), cp.float32),
                    cp.zeros((n // 128, m), cp.float32))
            variants["fold"] = {"fold": fold, "accumulate": True}
        for name, kw in variants.items():
            dev.gemm.q8(codes, scales, dw, out, n, dev.stream, **kw)  # compiled and warm before the capture
            dev.stream.synchronize()
            dev.stream.begin_capture()
            for _ in range(args.reps):
                dev.gemm.q8(codes, scales, dw, out, n, dev.stream, pdl=True, **kw)
            graph = dev.stream.end_capture()
            graph.launch(dev.stream)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(dev.stream)
            graph.launch(dev.stream)
            end.record(dev.stream)
            end.synchronize()
            results[f"{shape} {name}"] = us = cp.cuda.get_elapsed_time(start, end) / args.reps * 1e3
            print(f"{shape:>12} {name:8s} {us:8.1f} us", flush=True)
        dev.cache.release(dw)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": m, "us": results}, indent=1))
    return 0


if __name__ == "__main__":
    require_cuda()
    raise SystemExit(main())
