"""What a grammar costs a decode (SamplingParams.grammar, kestrel_core/model/grammar.py): greedy decode tok/s of
the default model on the CPU with no grammar, a grammar that allows any text, and a JSON Schema, runs alternating;
and the milliseconds of one row's mask (``Constraint.allow``) at the start of the JSON answer.

    python benchmarks/grammar_overhead.py [--tokens 96] [--runs 3] [--backend cpu]

Every run generates ``--tokens`` tokens past the end of text (``ignore_eos``), so each one decodes as many.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import kestrel_core
from kestrel_core.model.sampling import SamplingParams

SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()
    with kestrel_core.load(None, backend=args.backend) as engine:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Write a long story about a cat."}])
        grammars = {"no grammar": None, "any text": kestrel_core.regex_grammar(r"(.|\n){0,100000}"),
                    "JSON Schema": kestrel_core.json_schema_grammar(SCHEMA)}
        rates: dict[str, list[float]] = {name: [] for name in grammars}
        list(engine.stream(ids, SamplingParams(max_tokens=8)))  # warm-up
        for _ in range(args.runs):
            for name, grammar in grammars.items():
                list(engine.stream(ids, SamplingParams(max_tokens=args.tokens, ignore_eos=True, grammar=grammar)))
                rates[name].append(engine.stats["decode_tok_s"])
        for name, values in rates.items():
            print(f"{name:12s} decode {statistics.median(values):7.1f} tok/s  (runs: "
                  f"{', '.join(f'{v:.1f}' for v in values)})")
        constraint = engine.constraint(grammars["JSON Schema"])
        z = np.zeros(engine.config.vocab_size, np.float32)
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            constraint.allow(z)
            times.append(time.perf_counter() - t0)
        print(f"one row's mask over {engine.config.vocab_size} tokens: {statistics.median(times) * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
