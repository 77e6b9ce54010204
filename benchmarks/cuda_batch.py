"""The CUDA backend's batched decode step alone (``kestrel_forward_batch``), rows against time per step.

    python benchmarks/cuda_batch.py --preset qwen3-8b --quant q8 --rows 1,8,32,64 --context 512

For each row count M: M sequences of ``--context`` prompt tokens prefilled through the hook, then ``--steps``
decode steps of all M at once (one token each, their greedy tokens downloaded as greedy requests receive them,
or with ``--logits`` the whole logits as sampled requests do): milliseconds
per step and decode tok/s of the hook (M = 1: the lone sequence's captured step; more: the captured step of
the batch's bucket). ``--breakdown`` adds, at each M > 1, the GPU time of one step per kernel kind (each kind's
launches replayed in a graph of their own) and of the tiled GEMM alone; ``--kernels`` the same per kernel name
(every launch of one eager step, each name's in a graph of its own) and of all of them in one graph.
``--profile`` adds the host's share of a scheduler step at the largest M (cProfile of ``Scheduler.step``, top
entries by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from dataclasses import replace

import numpy as np
from cuda_required import require_cuda

from kestrel_core.batch import BatchEntry
from kestrel_core.model.engine_load import load_preset


def _decode_rows(entries: list[BatchEntry], pos: int, argmax: bool) -> list[BatchEntry]:
    """A decode step of ``entries``' sequences at position ``pos``: one token each (greedy ids back if ``argmax``)."""
    return [BatchEntry(e.seq_id, np.array([7]), pos, 1, e.blocks, e.block_size, e.num_blocks, argmax_only=argmax)
            for e in entries]


def _time_rows(engine, fwd, m: int, context: int, steps: int, seed: int,  # type: ignore[no-untyped-def]
               breakdown: dict | None = None, argmax: bool = True, prompt: int = 0,
               kernels: dict | None = None) -> float:
    """Seconds per decode step of ``m`` sequences through ``forward_batch``; with ``breakdown`` (a dict, M > 1),
    GPU microseconds per kernel kind of one more step, and of the tiled GEMM's core alone, filled in."""
    model, pool = engine.model, engine.pool
    rng = np.random.default_rng(seed)
    seqs = [engine.new_sequence() for _ in range(m)]
    try:
        for s in seqs:
            pool.reserve(s.cache, context + steps + 5)
        entries = [BatchEntry(s.seq_id, rng.integers(0, model.config.vocab_size, context), 0, 1,
                              tuple(s.cache.blocks), pool.block_size, pool.num_blocks) for s in seqs]
        for e in entries:  # one prefill each (a batch of one: the sequence's own cache)
            fwd.forward_batch(model, [e])
        times = []
        for i in range(steps + 2):  # two warm-up steps: the bucket's eager step and its capture
            batch = _decode_rows(entries, context + i, argmax)
            t0 = time.perf_counter()
            out = fwd.forward_batch(model, batch)
            times.append(time.perf_counter() - t0)
            assert out is not None, fwd.last_decline
        if breakdown is not None and m > 1:
            _breakdown(fwd, model, entries, context + steps + 2, breakdown)
        if kernels is not None and m > 1:
            _kernels(fwd, model, entries, context + steps + 2, kernels)
        if prompt:
            seqs.append(engine.new_sequence())
            pool.reserve(seqs[-1].cache, prompt + 1)
            _mixed(fwd, model, entries, context + steps + 2, BatchEntry(
                seqs[-1].seq_id, rng.integers(0, model.config.vocab_size, prompt), 0, 1, tuple(seqs[-1].cache.blocks),
                pool.block_size, pool.num_blocks), breakdown)
        return float(np.median(times[2:]))
    finally:
        for s in seqs:
            engine.release(s)


def _mixed(fwd, model, entries, pos: int, prompt: BatchEntry, breakdown: dict | None) -> None:  # type: ignore[no-untyped-def]
    """The step that takes ``prompt`` whole beside the decode rows (a prompt arriving under load): its
    wall time (median of 3, greedy ids downloaded) and, with ``breakdown``, its GPU time per kernel kind."""
    import cupy as cp
    from cuda_e2e import record_launches, replay_breakdown

    def step():  # type: ignore[no-untyped-def]
        batch = _decode_rows(entries, pos, True)
        return fwd.forward_batch(model, batch + [replace(prompt, argmax_only=True)])

    times = []
    for _ in range(3):  # the decode rows' positions rewritten in place, the prompt's from 0 again
        t0 = time.perf_counter()
        assert step() is not None, fwd.last_decline
        times.append(time.perf_counter() - t0)
    print(f"  a {len(prompt.tokens)}-token prompt beside {len(entries)} decode rows: {np.median(times) * 1e3:.2f} ms "
          f"a step", flush=True)
    if breakdown is not None:
        kinds = replay_breakdown(cp, fwd.ops, record_launches(fwd.ops, step, ("gemv", "qkv_rope", "attention",
                                                                               "embed", "gather_rows")))
        breakdown["mixed"] = {"ms": float(np.median(times) * 1e3), "kinds": kinds}
        print(f"  its GPU us per kind (sum {sum(v['us'] for v in kinds.values()):.0f}):", json.dumps(kinds),
              flush=True)


def _breakdown(fwd, model, entries, pos: int, out: dict) -> None:  # type: ignore[no-untyped-def]
    import cupy as cp
    from cuda_e2e import record_launches, replay_breakdown

    def step(at: int):  # type: ignore[no-untyped-def]
        batch = _decode_rows(entries, at, False)
        return lambda: fwd.forward_batch(model, batch)

    use_graph, fwd.use_graph = fwd.use_graph, False
    try:
        kinds = record_launches(fwd.ops, step(pos), ("gemv", "qkv_rope", "attention", "embed", "gather_rows"))
        core = record_launches(fwd.ops, step(pos + 1), ("_gemm_q8",))
    finally:
        fwd.use_graph = use_graph
    out["kinds"] = replay_breakdown(cp, fwd.ops, kinds)
    out["tiled_gemm_core"] = replay_breakdown(cp, fwd.ops, core)
    total = sum(v["us"] for v in out["kinds"].values())
    print(f"  GPU us per kind (sum {total:.0f}):", json.dumps(out["kinds"]), flush=True)
    print("  tiled GEMM core:", json.dumps(out["tiled_gemm_core"]), flush=True)


def _kernels(fwd, model, entries, pos: int, out: dict) -> None:  # type: ignore[no-untyped-def]
    import cupy as cp
    from cuda_e2e import _events_us, replay_breakdown

    ops, calls = fwd.ops, []
    batch = _decode_rows(entries, pos, True)
    use_graph, fwd.use_graph = fwd.use_graph, False
    observer, ops.on_launch = ops.on_launch, lambda name, launch: (calls.append((name, 0, launch)), launch())
    try:
        assert fwd.forward_batch(model, batch) is not None, fwd.last_decline
    finally:
        ops.on_launch, fwd.use_graph = observer, use_graph
    whole = ops.capture(lambda: [launch() for _, _, launch in calls])
    out["all_us"] = round(_events_us(cp, ops.stream, whole, 7), 1)
    out["kernels"] = replay_breakdown(cp, ops, calls)
    print(f"  GPU us of its {len(calls)} launches in one graph: {out['all_us']:.0f}; per kernel:",
          json.dumps(out["kernels"]), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--quant", default="q8")
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kv-cache-mb", type=float, default=24576)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="GPU time per kernel kind at each M > 1")
    ap.add_argument("--kernels", action="store_true", help="GPU time per kernel name at each M > 1")
    ap.add_argument("--logits", action="store_true", help="download every row's logits, not its greedy token")
    ap.add_argument("--prompt", type=int, default=0, metavar="N",
                    help="also: the step that takes an N-token prompt beside each M's decode rows (with --breakdown: "
                         "its GPU time per kind)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = load_preset(args.preset, backend="cuda", quant=args.quant, kv_cache_mb=args.kv_cache_mb)
    fwd = engine.backend.device.forward_engine()
    rows = [int(r) for r in args.rows.split(",")]
    out = {"preset": args.preset, "quant": args.quant, "context": args.context, "rows": {}}
    print(f"{args.preset} {args.quant} on cuda, {args.context}-token contexts; ms per decode step (tok/s)")
    print(f"{'M':>4} {'ms a step':>10} {'tok/s':>8}")
    for m in rows:
        parts: dict | None = {} if args.breakdown else None
        names: dict | None = {} if args.kernels else None
        sec = _time_rows(engine, fwd, m, args.context, args.steps, seed=m, breakdown=parts, argmax=not args.logits,
                         prompt=args.prompt if m > 1 else 0, kernels=names)
        out["rows"][m] = {"ms": sec * 1e3, "tok_s": m / sec, **({"breakdown": parts} if parts else {}),
                          **({"kernels": names} if names else {})}
        print(f"{m:>4} {sec * 1e3:>10.2f} {m / sec:>8.0f}", flush=True)
    if args.profile:
        from kestrel_core.model.sampling import SamplingParams
        from kestrel_core.model.scheduler import Scheduler

        m = max(rows)
        sched = Scheduler(engine, max_batch=m, max_waiting=m)
        rng = np.random.default_rng(0)
        for _ in range(m):
            sched.add(rng.integers(0, engine.config.vocab_size, args.context).tolist(),
                      SamplingParams(max_tokens=40, ignore_eos=True))
        while sched.num_waiting:
            sched.step()
        for _ in range(3):
            sched.step()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(20):
            sched.step()
        prof.disable()
        step = (time.perf_counter() - t0) / 20
        print(f"scheduler step at {m} rows: {step * 1e3:.2f} ms ({m / step:.0f} tok/s)")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        out["scheduler_step_ms"] = step * 1e3
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    engine.close()
    return 0


if __name__ == "__main__":
    require_cuda()
    raise SystemExit(main())
