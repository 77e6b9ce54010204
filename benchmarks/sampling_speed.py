"""Host sampling per row of logits: milliseconds of ``Sampler`` (temperature, top-k, top-p) and of
``logprobs_of`` (five alternatives) on one row of a 151,936-token vocabulary, the cost a sampled request (or
one that asks for logprobs) adds to every step of a batch.

    python benchmarks/sampling_speed.py [--vocab 151936] [--json out.json]

The logits are a normal draw with a spread of 3 (a language model's next-token logits spread about that
much), the same seed every run; median of 50 calls after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from kestrel_core.model.sampling import Sampler, SamplingParams, logprobs_of

SETTINGS = [(0.7, 0, 1.0), (0.7, 0, 0.9), (0.7, 40, 1.0), (0.8, 50, 0.95), (1.0, 0, 0.95)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logits = (np.random.default_rng(0).standard_normal(args.vocab) * 3).astype(np.float32)
    rows = []
    for temperature, top_k, top_p in SETTINGS:
        sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1))
        ms = _median_ms(lambda sampler=sampler: sampler(logits))
        rows.append({"temperature": temperature, "top_k": top_k, "top_p": top_p, "ms": ms})
        print(f"temperature {temperature:<4} top_k {top_k:<3} top_p {top_p:<5} {ms:8.3f} ms a row", flush=True)
    ms = _median_ms(lambda: logprobs_of(logits, 7, 5))
    rows.append({"logprobs": 5, "ms": ms})
    print(f"logprobs, 5 alternatives            {ms:8.3f} ms a row", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": args.vocab, "rows": rows}, f, indent=2)
    return 0


def _median_ms(fn: Callable[[], object], calls: int = 50) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    raise SystemExit(main())
