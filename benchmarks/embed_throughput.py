"""Embedding throughput (``Engine.embed``, kestrel_core/model/embed.py): tokens/s of a batch of texts embedded in
one call (their chunks share each step's GEMMs, up to ``--budget`` tokens a step) against the same texts one call
each, runs alternating, on a synthetic preset (qwen3-0.6b has Qwen3-Embedding-0.6B's shapes).

    python benchmarks/embed_throughput.py [--preset qwen3-0.6b] [--texts 32] [--tokens 64] [--runs 3] [--backend cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kestrel_core.model.embed import EmbedJob
from kestrel_core.model.engine_load import load_preset
from kestrel_core.model.scheduler import default_token_budget


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--texts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget", type=int, default=None, help="tokens a step (default: the server's, 512 + 64)")
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()
    budget = args.budget or default_token_budget(64)
    with load_preset(args.preset, backend=args.backend) as engine:
        rng = np.random.default_rng(0)
        texts = [rng.integers(0, engine.config.vocab_size, args.tokens).tolist() for _ in range(args.texts)]

        def run(inputs: list[list[int]]) -> np.ndarray:
            job = EmbedJob(engine, inputs, budget=budget)
            while not job.done:
                job.step()
            return job.result()

        run(texts[:2])  # warm-up: kernel compiles
        rates: dict[str, list[float]] = {"batched": [], "one a call": []}
        for _ in range(args.runs):
            t0 = time.perf_counter()
            together = run(texts)
            rates["batched"].append(args.texts * args.tokens / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            alone = np.stack([run([t])[0] for t in texts])
            rates["one a call"].append(args.texts * args.tokens / (time.perf_counter() - t0))
            assert np.array_equal(together, alone)
        print(f"{args.preset} on {engine.backend_name}, {args.texts} texts of {args.tokens} tokens, budget {budget}")
        for name, values in rates.items():
            print(f"  {name:>10}: {statistics.median(values):8.1f} tok/s (runs: "
                  f"{', '.join(f'{v:.1f}' for v in values)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
