"""The CUDA backend's own host work per batched decode step, no GPU needed: checking the batch
(``paged.check``), mapping its rows and page tables (``paged.row_map``) and splitting the returned ids per
entry (``paged.per_entry``), for S decode rows of ~700-position contexts.

    python benchmarks/cuda_batch_host.py [--rows 32,64] [--repeat 2000]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kestrel_core.batch import BatchEntry
from kestrel_cuda import paged

VOCAB, CONTEXT, POOL_BLOCKS, TABLE_WIDTH = 151936, 700, 20000, 64


def time_rows(s: int, repeat: int) -> dict[str, float]:
    """Microseconds per call of each step for ``s`` decode rows."""
    blocks = -(-(CONTEXT + 8) // paged.KV_BLOCK)
    batch = [BatchEntry(i, np.array([7], np.int64), CONTEXT - 1 + i % 8, 1,
                        tuple(range(i * blocks, (i + 1) * blocks)), paged.KV_BLOCK, POOL_BLOCKS, argmax_only=True)
             for i in range(s)]
    assert paged.check(batch, VOCAB, 40960, 512) is None
    fetched = [(np.full(s, 5, np.int32), {})]
    steps = {"check": lambda: paged.check(batch, VOCAB, 40960, 512),
             "row_map": lambda: paged.row_map(batch, 0, s, s, POOL_BLOCKS, TABLE_WIDTH),
             "per_entry": lambda: paged.per_entry(batch, fetched, VOCAB, False)}
    out = {}
    for name, fn in steps.items():
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        out[name] = (time.perf_counter() - t0) / repeat * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,64")
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args(argv)
    for s in (int(x) for x in args.rows.split(",")):
        cells = ", ".join(f"{name} {us:.0f} us" for name, us in time_rows(s, args.repeat).items())
        print(f"{s} rows: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
