"""Speculative decoding by prompt lookup (``--speculate``, kestrel_core/model/speculate.py): greedy decode tok/s of
the default model on the CPU without it and with 4 and 8 draft tokens, runs alternating, on a task whose answer
repeats its prompt (edit this code) and one whose answer does not (a story), at 1 and 4 concurrent streams;
with the acceptance rate, and a check that every setting gives the same tokens.

    python benchmarks/speculate.py [--tokens 128] [--runs 3] [--backend cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import kestrel_core
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler

CODE = '''def load(path):
    with open(path) as f:
        return json.load(f)


def save(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def merge(a, b):
    out = dict(a)
    for key, value in b.items():
        if key in out and isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
'''
TASKS = {"edit code": f"Rename the function merge to deep_merge in this code and show the whole code:\n\n{CODE}",
         "story": "Write a long story about a cat who learns to sail."}


def run(engine: kestrel_core.Engine, ids: list[int], streams: int, tokens: int, speculate: int
        ) -> tuple[float, list[list[int]], int, int]:
    """(decode tok/s over all streams, each stream's tokens, drafted, accepted)."""
    engine.speculate = speculate
    scheduler = Scheduler(engine, max_batch=streams)
    requests = [scheduler.add(ids, SamplingParams(max_tokens=tokens, ignore_eos=True)) for _ in range(streams)]
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    first = None
    while any(not r.finished for r in requests):
        for o in scheduler.step():
            out[o.request_id] += o.new_token_ids
        if first is None:  # the prompts' step is prefill: decode is timed from here
            first = time.perf_counter()
            counted = sum(len(v) for v in out.values())
    seconds = time.perf_counter() - first
    generated = sum(len(v) for v in out.values()) - counted
    return generated / seconds, [out[r.request_id] for r in requests], scheduler.drafted, scheduler.accepted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()
    with kestrel_core.load(None, backend=args.backend) as engine:
        for task, text in TASKS.items():
            ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
            for streams in (1, 4):
                run(engine, ids, streams, 8, 4)  # warm-up
                rates: dict[int, list[float]] = {0: [], 4: [], 8: []}
                kept: dict[int, tuple[int, int]] = {}
                answers = set()
                for _ in range(args.runs):
                    for speculate in rates:
                        rate, tokens, drafted, accepted = run(engine, ids, streams, args.tokens, speculate)
                        rates[speculate].append(rate)
                        kept[speculate] = (drafted, accepted)
                        answers.add(tuple(map(tuple, tokens)))
                same = "same tokens" if len(answers) == 1 else "TOKENS DIFFER"
                print(f"{task}, {streams} stream(s), {args.tokens} tokens each ({same}):")
                for speculate, values in rates.items():
                    drafted, accepted = kept[speculate]
                    share = f", {accepted}/{drafted} drafts kept" if drafted else ""
                    print(f"  speculate {speculate}: {statistics.median(values):7.1f} tok/s "
                          f"(runs {', '.join(f'{v:.1f}' for v in values)}){share}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
