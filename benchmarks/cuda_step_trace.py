"""A captured decode step's critical path by kind of launch, from the forward's diagnostic build
(``KESTREL_CUDA_TRACE``, kestrel_cuda/trace.py): every block records when its PDL wait returned, and a launch's
share of the path is the next launch's release less its own.

    python benchmarks/cuda_step_trace.py [--preset qwen3-30b-a3b] [--quant q8] [--prompt 64] [--reps 20]
                                         [--save records.npz]

The step is the one ``cuda_e2e.py`` times (a synthetic preset, every weight preloaded, a greedy decode after a
``--prompt``-token prompt), its graph replayed ``--reps`` times with the records reset before each; the kinds
come from one eager step at the same position (a GEMV by its projection, else the kernel's name). Per kind:
its launches, its µs of the path (the median replay's), and how late its blocks' releases trail its first (the
median over its launches: blocks that were not resident when the predecessor completed). The traced step runs
a little slower than the plain one, whose GPU time is shown beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from typing import Any

import numpy as np
from cuda_e2e import gemv_kind, graph_step_us, greedy, log, make_forward
from cuda_required import require_cuda


def launch_kinds(fwd: Any, model: Any, seq_id: int, token: int, pos: int) -> list[str]:
    """The kind of each launch of one eager decode step, in order: "gemv <projection>" for a GEMV (its expert
    GEMVs "gemv experts <projection>"), else the kernel's name."""
    ops = fwd.ops
    kinds: list[str] = []
    current = [""]
    gemv = ops.gemv

    def named_gemv(lin: Any, *args: Any, **kwargs: Any) -> None:
        current[0] = gemv_kind(lin, kwargs.get("experts"))
        try:
            gemv(lin, *args, **kwargs)
        finally:
            current[0] = ""

    def observe(name: str, launch: Any) -> None:
        kinds.append(current[0] or name)
        launch()

    saved, use_graph = ops.on_launch, fwd.use_graph
    ops.gemv, ops.on_launch, fwd.use_graph = named_gemv, observe, False
    try:
        fwd.forward(model, seq_id, np.array([token]), pos, False)
    finally:
        del ops.gemv  # the class's method again
        ops.on_launch, fwd.use_graph = saved, use_graph
    ops.stream.synchronize()
    return kinds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--quant", default="q8")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--save", default="", help="write the last replay's records and the kinds here (.npz)")
    args = ap.parse_args()

    import cupy as cp

    from kestrel_core.model.presets import preset_model
    from kestrel_cuda.binding import open_device
    from kestrel_cuda.trace import critical_path, releases

    model = preset_model(args.preset, args.quant)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt)
    dev = open_device({"window": "0"})
    try:
        dev.preload(model)
        plain = make_forward(dev, {})
        tokens, _, _ = greedy(plain, model, 1, prompt, 4)
        plain_us = graph_step_us(cp, plain, 1)
        plain.close()
        fwd = make_forward(dev, {"trace": "1"})
        traced_tokens, _, _ = greedy(fwd, model, 1, prompt, 4)  # captures sequence 1's decode graph
        traced_us = graph_step_us(cp, fwd, 1)
        kinds = launch_kinds(fwd, model, 1, traced_tokens[-1], len(prompt) + 4)
        replays: list[dict[str, tuple[int, float]]] = []
        late: dict[str, list[float]] = defaultdict(list)
        seq, trace, stream = fwd._seqs[1], fwd.ops.trace, fwd.ops.stream
        for _ in range(args.reps):
            trace.reset(stream)
            seq.graph()
            stream.synchronize()
            rows, dropped = trace.read()
            if args.save:
                np.savez(args.save, rows=rows, kinds=np.array(kinds))
            launches = releases(rows)
            if dropped or len(launches) != len(kinds):
                log(f"{len(launches)} launches traced ({dropped} records dropped), {len(kinds)} launched: "
                    "a launch whose blocks do not wait, or the buffer is too small")
                return 1
            replays.append(critical_path(launches, kinds))
            for kind, launch in zip(kinds, launches, strict=True):
                late[kind].append((launch[2] - launch[1]) / 1e3)
        fwd.close()
    finally:
        dev.close()
    totals = [sum(us for _, us in r.values()) for r in replays]
    median = replays[int(np.argsort(totals)[len(totals) // 2])]
    same = "the same as" if traced_tokens == tokens else "NOT the same as"
    log(f"{args.preset} {args.quant}, {args.prompt}-token prompt: {len(kinds)} launches a step; GPU a step "
        f"{plain_us:.1f} µs (traced {traced_us:.1f}); the traced build's tokens {same} the plain one's")
    log(f"critical path of the median replay: {sum(us for _, us in median.values()):.1f} µs to the last launch's "
        f"release (the last, {kinds[-1]}, not in it)")
    log(f"{'kind':28s} {'launches':>8s} {'µs':>8s} {'µs each':>8s} {'blocks late µs':>15s}")
    for kind, (n, us) in sorted(median.items(), key=lambda kv: -kv[1][1]):
        log(f"{kind:28s} {n:8d} {us:8.1f} {us / n:8.2f} {statistics.median(late[kind]):15.2f}")
    return 0 if traced_tokens == tokens else 1


if __name__ == "__main__":
    require_cuda()
    sys.exit(main())
