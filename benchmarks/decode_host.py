"""Where a decoded token's wall time goes on the CUDA backend, beyond the GPU's own step: the engine loop
(as `kestrel bench` runs it), the device forward's host work, and each host piece of a step timed alone.

    python benchmarks/decode_host.py [--preset qwen3-8b] [--quant q8] [--prompt 512] [--steps 128] [--json F]
                                     [--profile]

Pieces (median microseconds over --reps, the GPU idle before each): write_meta (position and token to the
device), the graph launch call, the wait for the step, the logits' download (device to pinned host memory,
then a copy the caller owns), greedy argmax, and the forward's Python around them. ``--profile``: the
engine's decode loop once more under cProfile, its functions by own time. Run on the GPU machine.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from typing import Any

import numpy as np
from cuda_required import require_cuda


def _median_us(fn: Any, reps: int, before: Any = None) -> float:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import cupy as cp

    from kestrel_core.model.engine_load import load_preset

    res: dict[str, Any] = {"preset": args.preset, "quant": args.quant}
    engine = load_preset(args.preset, backend="cuda", quant=args.quant)
    prompt = np.random.default_rng(0).integers(0, engine.config.vocab_size, args.prompt).tolist()
    per_token = []
    for _ in range(3):  # the first run captures the graph
        n = sum(1 for _ in engine.generate(prompt, max_tokens=args.steps + 1, stop_at_eos=False))
        assert n == args.steps + 1
        per_token.append(engine.last.decode_s / engine.last.decode_tokens * 1e6)
    res["engine_us_per_token"] = [round(t, 1) for t in per_token[1:]]

    fwd = engine.backend.device.forward
    model, ops = engine.model, fwd.ops
    row = fwd.forward(model, 99, np.asarray(prompt), 0, False)
    tok, pos = int(row[0].argmax()), len(prompt)
    walls = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        row = fwd.forward(model, 99, np.array([tok]), pos + i, False)
        tok = int(np.argmax(row[0]))
        walls.append(time.perf_counter() - t0)
    res["forward_argmax_us"] = round(statistics.median(walls[2:]) * 1e6, 1)

    st, seq, stream = fwd._st, fwd._seqs[99], ops.stream
    gpu = []
    for _ in range(args.reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        seq.graph()
        e1.record(stream)
        e1.synchronize()
        gpu.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    res["gpu_step_us"] = round(statistics.median(gpu), 1)

    meta = np.array([pos + args.steps, tok], np.int32)
    pinned = ops.cupyx.empty_pinned(st.logits.shape[1], np.float32).reshape(1, -1)
    host = np.array(pinned)
    sync = stream.synchronize
    pieces = {
        "write_meta": lambda: ops.write_meta(st.meta, meta),
        "graph_launch_call": seq.graph,
        "download (D2H pinned + copy)": lambda: ops.download(st.logits, 1),
        "D2H into pinned": lambda: st.logits[:1].get(stream=stream, out=pinned, blocking=True),
        "D2H into pageable": lambda: st.logits[:1].get(stream=stream, blocking=True),
        "copy of the pinned row": lambda: pinned.copy(),
        "argmax": lambda: np.argmax(host[0]),
    }
    res["pieces_us"] = {name: _median_us(fn, args.reps, sync) for name, fn in pieces.items()}
    res["wait_after_launch_us"] = _median_us(sync, args.reps, lambda: (sync(), seq.graph()))
    res["host_us_per_token"] = round(statistics.median(per_token[1:]) - res["gpu_step_us"], 1)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        sum(1 for _ in engine.generate(prompt, max_tokens=args.steps + 1, stop_at_eos=False))
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(24)
        res["profile"] = text.getvalue().splitlines()
    engine.close()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--quant", default="q8")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", default="")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    res = run(args)
    print("\n".join(res.pop("profile", [])))
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    require_cuda()
    main()
