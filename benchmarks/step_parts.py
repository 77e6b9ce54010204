"""Where a batched step's time goes under ``kestrel bench --concurrency``'s load: each decode step's start (the
host's work up to the launch: scheduling, the engine's entries, the backend's own host work) and its wait for
the results, against the whole step.

    python benchmarks/step_parts.py --preset qwen3-8b --backend cuda --quant q8 --concurrency 32,64
    python benchmarks/step_parts.py --preset qwen3-8b --backend cuda --quant q8 --ttft-under-load 32 [--profile]

Each level is ``run_concurrency_bench`` of its own (512-token prompts, 256 tokens each by default); the
figures are medians over the steps where every stream decodes one token. ``--ttft-under-load N``: instead,
N - 1 streams decode while a prompt arrives (three, one after another), and each step from its arrival to its
first token is listed (its rows: decode rows plus prompt tokens), the engine's time to first token without
HTTP. A tree before ``Engine.start_batch`` is timed through ``Engine.run_batch`` and the batched hook instead
(wait: the hook, start: the rest of the engine's call).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from typing import Any

from kestrel_core import dispatch
from kestrel_core.model import engine as engine_mod
from kestrel_core.model import scheduler as scheduler_mod
from kestrel_core.model.bench import run_concurrency_bench
from kestrel_core.model.engine_load import load_preset


def _instrument(rec: dict[str, Any]) -> None:
    """Wrap the engine's step calls so that each scheduler step records its rows, start and wait."""
    engine_cls = engine_mod.Engine
    if hasattr(engine_cls, "start_batch"):
        start, result = engine_cls.start_batch, engine_mod.Step.result

        def timed_start(self, work, argmax_only=()):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = start(self, work, argmax_only)
            rec.update(start=time.perf_counter() - t, rows=len(work), tokens=sum(len(w[1]) for w in work))
            return out

        def timed_result(self):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = result(self)
            rec["wait"] = time.perf_counter() - t
            return out

        engine_cls.start_batch, engine_mod.Step.result = timed_start, timed_result
        return
    run, hook = engine_cls.run_batch, dispatch.Offload.forward_batch

    def timed_hook(self, model, batch, vocab):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = hook(self, model, batch, vocab)
        rec["wait"] = time.perf_counter() - t
        return out

    def timed_run(self, work, argmax_only=()):  # type: ignore[no-untyped-def]
        rec["wait"] = 0.0  # a backend without the batched hook runs the step on the host: all "start"
        t = time.perf_counter()
        out = run(self, work, argmax_only)
        rec.update(start=time.perf_counter() - t - rec["wait"], rows=len(work),
                   tokens=sum(len(w[1]) for w in work))
        return out

    engine_cls.run_batch, dispatch.Offload.forward_batch = timed_run, timed_hook


def ttft_under_load(engine: Any, streams: int, prompt_tokens: int, decode_tokens: int, steps: list[dict[str, Any]],
                    budget: int | None, probes: int = 3, profile: Any = None) -> list[dict[str, Any]]:
    """Each probe's time to first token while ``streams - 1`` requests decode, and the steps it took;
    ``profile`` (a cProfile.Profile) runs over the probes' steps."""
    import numpy as np

    from kestrel_core.model.sampling import SamplingParams

    rng = np.random.default_rng(0)
    vocab = engine.config.vocab_size
    sched = scheduler_mod.Scheduler(engine, max_batch=streams, token_budget=budget)
    background = [sched.add(rng.integers(0, vocab, prompt_tokens).tolist(),
                            SamplingParams(max_tokens=decode_tokens, ignore_eos=True)) for _ in range(streams - 1)]
    while any(not r.output_ids for r in background):
        sched.step()
    out = []
    for _ in range(probes):
        steps.clear()
        t0 = time.perf_counter()
        probe = sched.add(rng.integers(0, vocab, prompt_tokens).tolist(), SamplingParams(max_tokens=1))
        if profile is not None:
            profile.enable()
        while not any(o.request_id == probe.request_id for o in sched.step()):
            pass
        ttft = time.perf_counter() - t0
        if profile is not None:
            profile.disable()
        if any(r.finished for r in background):
            raise SystemExit("a background stream ended before the probes: raise --decode-tokens")
        out.append({"ttft_ms": ttft * 1e3, "steps": [
            {k: round(v * 1e3, 2) if k in ("step", "start", "wait") else v for k, v in st.items()} for st in steps]})
    sched.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--quant", default="q8")
    ap.add_argument("--concurrency", default="32,64")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--kv-cache-mb", type=float, default=24576)
    ap.add_argument("--ttft-under-load", type=int, default=0, metavar="N")
    ap.add_argument("--token-budget", type=int, default=None, help="tokens per step (the scheduler's default)")
    ap.add_argument("--profile", action="store_true", help="with --ttft-under-load: a cProfile of the probes' steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rec: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []
    _instrument(rec)
    step = scheduler_mod.Scheduler.step

    def timed_step(self):  # type: ignore[no-untyped-def]
        rec.clear()
        t = time.perf_counter()
        out = step(self)
        steps.append({**rec, "step": time.perf_counter() - t})
        return out

    scheduler_mod.Scheduler.step = timed_step
    engine = load_preset(args.preset, backend=args.backend, quant=args.quant, kv_cache_mb=args.kv_cache_mb)
    out: list[dict[str, Any]] = []
    profile = cProfile.Profile() if args.profile else None
    if args.ttft_under_load > 1:
        for probe in ttft_under_load(engine, args.ttft_under_load, args.prompt_tokens, args.decode_tokens, steps,
                                     args.token_budget, profile=profile):
            out.append(probe)
            parts = ", ".join(f"{st.get('tokens', 0)} rows: start {st.get('start', 0):.2f} + wait "
                              f"{st.get('wait', 0):.2f} of {st['step']:.2f}" for st in probe["steps"])
            print(f"time to first token {probe['ttft_ms']:.1f} ms under {args.ttft_under_load - 1} streams; steps "
                  f"(ms): {parts}", flush=True)
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    for level in [int(c) for c in args.concurrency.split(",")] if not args.ttft_under_load else []:
        steps.clear()
        bench = run_concurrency_bench(engine, [level], prompt_tokens=args.prompt_tokens,
                                      decode_tokens=args.decode_tokens, token_budget=args.token_budget).levels[0]
        decode = [s for s in steps if s.get("rows") == level and s.get("tokens") == level and "wait" in s]
        fig = {"concurrency": level, "decode_tok_s": bench.decode_tok_s, "decode_steps": len(decode)}
        for part in ("step", "start", "wait"):
            fig[f"{part}_ms"] = statistics.median(s[part] for s in decode) * 1e3 if decode else 0.0
        out.append(fig)
        print(f"{level} streams: decode {fig['decode_tok_s']:.1f} tok/s; {len(decode)} decode steps, medians: "
              f"step {fig['step_ms']:.2f} ms, start {fig['start_ms']:.2f} ms, wait {fig['wait_ms']:.2f} ms",
              flush=True)
    engine.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
