"""Prefix caching: requests that share a long system prompt, with the prefix cache on and off.

    python benchmarks/prefix_cache.py                     # default model on the CPU, 8 requests, 448 shared + 64 own
    python benchmarks/prefix_cache.py --requests 16 --shared 960 --own 32 --decode 16
    python benchmarks/prefix_cache.py --preset qwen3-8b --backend cuda --shared 1984 --own 64  # the device's pool
    python benchmarks/prefix_cache.py --preset lfm2-1.2b --conversation --requests 4 --shared 192 --own 128

Each round runs the same requests through one ``Scheduler`` (all queued at once), alternating off and on, each
from an empty pool (the host's, and a device forward's), and reports the time to the first token (median and
worst over the requests) and the whole run's time. ``--conversation``: the requests are the turns of one chat,
run one after another, each prompt the one before and ``--own`` tokens more (what a model with recurrent layers
shares: the state kept at a prompt's end). On the CPU the tokens of the two runs are checked to be the
same; elsewhere the requests whose first or later tokens differ are counted (a prompt's rows computed in other
chunks round differently on a device, and a preset's random weights leave many near-ties).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import kestrel_core
from kestrel_core.model.engine_load import load_preset
from kestrel_core.model.kv_pool import KVPool
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler


def run(engine, prompts: list[list[int]], decode: int, one_by_one: bool = False
        ) -> tuple[list[float], float, list[list[int]]]:
    if one_by_one:
        each = [run(engine, [p], decode) for p in prompts]
        return [r[0][0] for r in each], sum(r[1] for r in each), [r[2][0] for r in each]
    scheduler = Scheduler(engine, max_batch=len(prompts))
    params = SamplingParams(max_tokens=decode, ignore_eos=True)
    start = time.perf_counter()
    requests = [scheduler.add(p, params) for p in prompts]
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while scheduler.has_work:
        for out in scheduler.step():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
            tokens[out.request_id].extend(out.new_token_ids)
    return [first[r.request_id] for r in requests], time.perf_counter() - start, [tokens[r.request_id]
                                                                                 for r in requests]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--preset", default=None, help="a preset's synthetic model instead (kestrel bench --preset)")
    ap.add_argument("--quant", default="q8")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--shared", type=int, default=448, help="tokens of the system prompt every request starts with")
    ap.add_argument("--own", type=int, default=64, help="tokens of each request's own")
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds, after an untimed one (default 2)")
    ap.add_argument("--conversation", action="store_true", help="the requests are one chat's turns, in turn")
    args = ap.parse_args()
    engine = (load_preset(args.preset, backend=args.backend, quant=args.quant) if args.preset else
              kestrel_core.load(args.model, backend=args.backend))
    with engine:
        rng = np.random.default_rng(0)
        vocab = engine.config.vocab_size
        shared = rng.integers(0, vocab, args.shared).tolist()
        owns = [rng.integers(0, vocab, args.own).tolist() for _ in range(args.requests)]
        prompts = [shared + sum(owns[:i + 1], []) if args.conversation else shared + owns[i]
                   for i in range(args.requests)]
        what = (f"{args.requests} turns of one chat, its prompt {args.shared} tokens and {args.own} more a turn"
                if args.conversation else
                f"{args.requests} requests of {args.shared} shared + {args.own} own prompt tokens")
        print(f"{engine.source}, {engine.backend_line}, activations {engine.activations}; {what}, {args.decode} "
              "generated each")
        results: dict[bool, list[tuple[list[float], float, list[list[int]]]]] = {False: [], True: []}
        for round_ in range(args.rounds + 1):  # an untimed round first: compiles, graph captures, caches
            for cached in (False, True):
                engine.prefix_cache = cached
                engine.pool = engine.decoder.pool = KVPool(engine.config, engine.pool.num_blocks)  # no earlier prefix
                forward = getattr(engine.backend.device, "forward_engine", None)
                if forward is not None and forward() is not None:
                    forward().reset_pool()
                result = run(engine, prompts, args.decode, args.conversation)
                if round_:
                    results[cached].append(result)
        want = results[False][0][2]
        if args.backend == "cpu":
            assert all(r[2] == want for rs in results.values() for r in rs), "tokens differ"
        else:
            pairs = [(a, b) for r in results[True] for a, b in zip(r[2], want)]
            print(f"against the first run without the prefix cache: first tokens differ in "
                  f"{sum(a[:1] != b[:1] for a, b in pairs)} of {len(pairs)} requests, later tokens in "
                  f"{sum(a != b for a, b in pairs)}")
        for cached, rs in results.items():
            ttft = [t for r in rs for t in r[0]]
            print(f"prefix cache {'on ' if cached else 'off'}: TTFT median {statistics.median(ttft) * 1e3:.0f} ms, "
                  f"worst {max(ttft) * 1e3:.0f} ms; run {statistics.median([r[1] for r in rs]):.2f} s "
                  f"(rounds: {', '.join(f'{r[1]:.2f}' for r in rs)})")


if __name__ == "__main__":
    main()
