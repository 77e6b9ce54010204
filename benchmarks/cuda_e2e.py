"""End-to-end whole-step forward on a synthetic preset (default qwen3-8b): preload, prefill, graph decode,
per-kernel breakdown, the bandwidth roofline, and the residency window.

    python benchmarks/cuda_e2e.py [--preset qwen3-8b] [--quant q8] [--prompt 512] [--decode 128]
                                  [--window 1,4,16] [--sweep "default,PDL=0,CLUSTER=0"] [--json out.json]

Everything runs through the CUDA backend's own device (binding.open_device: its weight cache, preload,
stream and tiled GEMM) and kestrel_cuda.forward.DeviceForward, the object the kestrel_forward hook calls.
Wall-clock times include the Python work per step (token in, logits [1, vocab] back to a numpy array);
the GPU time of one decode step is measured with CUDA events around replays of its graph; the per-kind
breakdown replays each kind's launches of one step in a graph of their own, the prefill's each launch between
CUDA events (``CupyOps.on_launch``). ``--sweep`` times decode under several configurations, each a '+'-joined
list of KEY=VALUE settings of the forward (keys of ``CudaConfig``, any case: PDL=1|0, CLUSTER=1|0), over the
environment's, and the rest runs the fastest (``--sweep-breakdown``: with each one's per-kind breakdown).
Figures:
    copy_gb_s        device-to-device copy, bytes read + written per second (the bandwidth ceiling)
    bytes_per_token  weight codes + scales one decode step reads (every projection and lm_head)
    roofline_tok_s   copy_gb_s / bytes_per_token
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from typing import Any

import numpy as np
from cuda_required import require_cuda


def log(*a: Any) -> None:
    print(*a, flush=True)


def copy_bandwidth(cp: Any, nbytes: int = 2 << 30) -> float:
    src = cp.ones(nbytes // 4, np.float32)
    dst = cp.empty_like(src)
    for _ in range(3):
        cp.copyto(dst, src)
    times = []
    for _ in range(10):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        cp.copyto(dst, src)
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9


def lin_bytes(lin: Any) -> int:
    return int(lin.codes.nbytes) + int(lin.scales.nbytes)


def step_bytes(fwd: Any) -> int:
    """Weight bytes of one decode step: every projection and lm_head; of a mixture of experts' routed experts,
    the k a token chooses (k / E of them)."""
    st = fwd._st
    c = st.config
    total = lin_bytes(st.lm_head)
    for layer in st.layers:
        w = layer.weights
        routed = sum(lin_bytes(lin) for ex in w.experts[:c.num_experts] for lin in (*ex.gate_up, ex.down))
        total += sum(lin_bytes(lin) for lin in w.all_lins()) - routed * (c.num_experts - c.experts_per_token) \
            // max(1, c.num_experts)
    return total


_PROJ = {0: "q/k/v", 1: "q/k/v", 2: "q/k/v", 3: "o", 4: "gate/up", 5: "gate/up", 6: "down", 7: "lm_head",
         9: "q/k/v", 10: "gate/up"}


def gemv_kind(lin: Any, experts: Any) -> str:
    """A GEMV launch's kind in the breakdowns: "gemv <projection>", or "gemv experts <projection>" for a routed
    one (``experts``: its ``CupyOps.gemv`` argument)."""
    return ("gemv experts " if experts else "gemv ") + _PROJ.get((lin.wkey & 0xFFFF) - 1, "?")


def record_launches(ops: Any, run: Any, names: tuple[str, ...] = ("gemv", "qkv_rope", "attention", "embed",
                                                                   "norm_add", "moe_route", "moe_combine",
                                                                   "greedy_token"),
                    ) -> list[tuple[str, int, Any]]:
    """Run ``run()`` eagerly with ``ops``' methods ``names`` wrapped; its launches as (kind, weight bytes,
    replay closure)."""
    calls: list[tuple[str, int, Any]] = []
    orig = {name: getattr(ops, name) for name in names}
    own = {name for name in names if name in vars(ops)}  # instance attributes (else methods of the class)

    def wrap(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            if name == "gemv":
                lin, experts = args[0], kwargs.get("experts")
                kind = gemv_kind(lin, experts)
                nbytes = lin_bytes(lin) * (experts[2] if experts else 1)
            else:
                kind = name
                nbytes = 0
            calls.append((kind, nbytes, lambda: orig[name](*args, **kwargs)))
            orig[name](*args, **kwargs)
        return call

    for name in orig:
        setattr(ops, name, wrap(name))
    try:
        run()
    finally:
        for name, fn in orig.items():
            if name in own:
                setattr(ops, name, fn)
            else:
                delattr(ops, name)
    ops.stream.synchronize()
    return calls


def _events_us(cp: Any, stream: Any, fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return statistics.median(times)


def replay_breakdown(cp: Any, ops: Any, calls: list[tuple[str, int, Any]]) -> dict[str, Any]:
    """GPU microseconds per kind of recorded launches: each kind's launches captured in a graph of their own
    and replayed (the state they write is scrambled: timing only)."""
    kinds: dict[str, list[tuple[int, Any]]] = defaultdict(list)
    for kind, nbytes, fn in calls:
        kinds[kind].append((nbytes, fn))
    out = {}
    for kind, items in kinds.items():
        graph = ops.capture(lambda items=items: [fn() for _, fn in items])
        us = _events_us(cp, ops.stream, graph, 7)
        nbytes = sum(b for b, _ in items)
        out[kind] = {"launches": len(items), "us": round(us, 1),
                     "gb_s": round(nbytes / (us * 1e3), 1) if nbytes else None}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def kernel_breakdown(cp: Any, fwd: Any, model: Any, seq_id: int, token: int, pos: int) -> dict[str, Any]:
    """GPU microseconds per kernel kind of one decode step (replay_breakdown of an eager step)."""
    use_graph, fwd.use_graph = fwd.use_graph, False
    try:
        calls = record_launches(fwd.ops, lambda: fwd.forward(model, seq_id, np.array([token]), pos, False))
    finally:
        fwd.use_graph = use_graph
    return replay_breakdown(cp, fwd.ops, calls)


def prefill_breakdown(cp: Any, fwd: Any, model: Any, seq_id: int, prompt: np.ndarray) -> dict[str, Any]:
    """Eager prefill with CUDA events around each launch (kernels long enough for events)."""
    ops = fwd.ops
    records: list[tuple[str, Any, Any]] = []

    def timed(name: str, launch: Any) -> None:
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(ops.stream)
        launch()
        e1.record(ops.stream)
        records.append((name, e0, e1))

    saved, ops.on_launch = ops.on_launch, timed
    t0 = time.perf_counter()
    try:
        fwd.forward(model, seq_id, prompt, 0, False)
    finally:
        ops.on_launch = saved
    wall = time.perf_counter() - t0
    us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for name, e0, e1 in records:
        us[name] += cp.cuda.get_elapsed_time(e0, e1) * 1e3
        count[name] += 1
    out = {name: {"launches": count[name], "us": round(us[name], 1)} for name in sorted(us, key=lambda n: -us[n])}
    out["wall_s"] = round(wall, 4)
    return out


def graph_step_us(cp: Any, fwd: Any, seq_id: int, replays: int = 20) -> float:
    """Median GPU microseconds of one captured decode step (same position each time: timing only)."""
    seq = fwd._seqs[seq_id]
    stream = fwd.ops.stream
    times = []
    for _ in range(replays):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        seq.graph()
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return statistics.median(times)


def greedy(fwd: Any, model: Any, seq_id: int, prompt: np.ndarray, steps: int) -> tuple[list[int], list[float], float]:
    """Prefill then ``steps`` greedy decode steps; (tokens, per-step wall seconds, prefill seconds)."""
    t0 = time.perf_counter()
    tok = int(fwd.forward(model, seq_id, prompt, 0, False)[0].argmax())
    prefill_s = time.perf_counter() - t0
    tokens, times = [tok], []
    for i in range(steps):
        t0 = time.perf_counter()
        row = fwd.forward(model, seq_id, np.array([tok]), len(prompt) + i, False)
        tok = int(row[0].argmax())
        times.append(time.perf_counter() - t0)
        tokens.append(tok)
    return tokens, times, prefill_s


def pipelined(fwd: Any, model: Any, seq_id: int, prompt: np.ndarray, steps: int) -> tuple[list[int], float]:
    """Prefill then ``steps`` tokens of the pipelined greedy decode (``DeviceForward.greedy``, what the engine
    runs for greedy generation); (tokens, decode tok/s over the steps after the first two)."""
    tok = int(fwd.forward(model, seq_id, prompt, 0, False)[0].argmax())
    tokens, stamps = [tok], []
    for t in fwd.greedy(model, seq_id, tok, len(prompt), steps):
        stamps.append(time.perf_counter())
        tokens.append(t)
    return tokens, (len(stamps) - 3) / (stamps[-1] - stamps[2])


FORWARD_SWITCHES = ("fuse_rope", "fuse_attention")  # DeviceForward's own switches a configuration may set


def parse_config(text: str) -> dict[str, str]:
    """'PDL=0+CLUSTER=1' -> {'pdl': '0', 'cluster': '1'}: CudaConfig options, or FORWARD_SWITCHES ('' or
    'default': {})."""
    options = {}
    for item in text.split("+"):
        item = item.strip()
        if item and item != "default":
            name, _, value = item.partition("=")
            options[name.strip().lower()] = value.strip()
    return options


def make_forward(dev: Any, options: dict[str, str]) -> Any:
    """DeviceForward on the backend's device under its settings, ``options`` overriding them."""
    from kestrel_cuda.config import CudaConfig
    from kestrel_cuda.forward import DeviceForward

    options = dict(options)
    switches = {name: options.pop(name) != "0" for name in FORWARD_SWITCHES if name in options}
    return DeviceForward(dev.weight, None, config=CudaConfig.from_env(options), stream=dev.stream, gemm=dev.gemm,
                         pin=dev.cache.pin, unpin=dev.cache.unpin, **switches)


def decode_config(cp: Any, dev: Any, model: Any, prompt: np.ndarray, steps: int, name: str,
                  breakdown: bool = False) -> dict[str, Any]:
    """Decode speed under one configuration (see ``parse_config``), with its per-kind breakdown if asked."""
    fwd = make_forward(dev, parse_config(name))
    try:
        tokens, times, _ = greedy(fwd, model, 1, prompt, steps)
        warm = times[2:] or times
        piped, piped_tok_s = pipelined(fwd, model, 3, prompt, steps)
        extra = {"breakdown": kernel_breakdown(cp, fwd, model, 1, tokens[-1], len(prompt) + steps)} if breakdown else {}
        return {"config": name, "pdl": fwd.ops.pdl, "cluster": fwd.ops.cluster, "tokens": tokens,
                "decode_tok_s": round(1.0 / statistics.median(warm), 1),
                "pipelined_tok_s": round(piped_tok_s, 1), "pipelined_same_tokens": piped == tokens,
                "graph_step_us": round(graph_step_us(cp, fwd, 1), 1), **extra}
    finally:
        fwd.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import cupy as cp

    from kestrel_core.model.presets import preset_model
    from kestrel_cuda.binding import open_device
    from kestrel_cuda.forward import DeviceForward

    res: dict[str, Any] = {"preset": args.preset, "quant": args.quant, "prompt": args.prompt, "decode": args.decode}
    t0 = time.perf_counter()
    model = preset_model(args.preset, args.quant)
    res["build_model_s"] = round(time.perf_counter() - t0, 2)
    res["model_host_gb"] = round(model.nbytes / 1e9, 3)
    log(f"[{args.quant}] model built in {res['build_model_s']} s ({res['model_host_gb']} GB host)")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.vocab_size, args.prompt)
    short = prompt[:args.window_prompt]

    dev = open_device({"window": "0"})
    try:
        res["device"] = dev.description
        res["copy_gb_s"] = round(copy_bandwidth(cp), 1)
        t0 = time.perf_counter()
        dev.preload(model)
        res["preload_s"] = round(time.perf_counter() - t0, 3)
        res["preload_info"] = dict(dev.preload_info)
        log(f"[{args.quant}] preload {res['preload_s']} s {dev.preload_info}; copy {res['copy_gb_s']} GB/s")

        res["sweep"] = []
        first_tokens: list[int] = []
        for name in args.sweep:
            r = decode_config(cp, dev, model, prompt, args.sweep_steps, name, args.sweep_breakdown)
            if res["sweep"]:
                r["same_tokens_as_first"] = r["tokens"] == first_tokens
            else:
                first_tokens = r["tokens"]
            log(f"[{args.quant}] config {name!r} (pdl {int(r['pdl'])}, cluster {int(r['cluster'])}): "
                f"{r['decode_tok_s']} tok/s, pipelined {r['pipelined_tok_s']} (same tokens "
                f"{r['pipelined_same_tokens']}), GPU {r['graph_step_us']} us/step, same tokens "
                f"{r.get('same_tokens_as_first', True)}")
            if "breakdown" in r:
                log("    " + ", ".join(f"{k} {v['us']}" for k, v in r["breakdown"].items()))
            res["sweep"].append({k: v for k, v in r.items() if k != "tokens"})
        best = "default"
        if res["sweep"] and not args.keep_default:
            best = min(res["sweep"], key=lambda r: r["graph_step_us"])["config"]
        fwd = make_forward(dev, parse_config(best))
        res["config"] = {"name": best, "pdl": fwd.ops.pdl, "cluster": fwd.ops.cluster}
        log(f"[{args.quant}] running {res['config']}")
        t0 = time.perf_counter()
        fwd.forward(model, 99, prompt[:8], 0, False)
        res["first_call_s"] = round(time.perf_counter() - t0, 3)  # device state, weight lookups, KV, warmup
        prefill = []
        for r in range(3):
            t0 = time.perf_counter()
            fwd.forward(model, 100 + r, prompt, 0, False)
            prefill.append(args.prompt / (time.perf_counter() - t0))
            fwd.release(100 + r)
        res["prefill_tok_s_runs"] = [round(x, 1) for x in prefill]
        res["prefill_tok_s"] = round(statistics.median(prefill), 1)
        log(f"[{args.quant}] prefill {args.prompt} tokens: {res['prefill_tok_s']} tok/s {res['prefill_tok_s_runs']}")
        res["prefill_breakdown"] = prefill_breakdown(cp, fwd, model, 98, prompt)
        for name, v in res["prefill_breakdown"].items():
            log(f"    prefill {name:28s} {v}")

        tokens, times, _ = greedy(fwd, model, 1, prompt, args.decode)
        warm = times[2:] or times
        res["decode_ms_median"] = round(1e3 * statistics.median(warm), 3)
        res["decode_tok_s"] = round(1.0 / statistics.median(warm), 1)
        res["decode_tok_s_mean"] = round(len(warm) / sum(warm), 1)
        res["graph_step_us"] = round(graph_step_us(cp, fwd, 1), 1)
        piped, piped_tok_s = pipelined(fwd, model, 4, prompt, args.decode)
        res["pipelined_tok_s"] = round(piped_tok_s, 1)
        res["pipelined_same_tokens"] = piped == tokens
        res["bytes_per_token"] = step_bytes(fwd)
        res["roofline_tok_s"] = round(res["copy_gb_s"] * 1e9 / res["bytes_per_token"], 1)
        res["gpu_step_gb_s"] = round(res["bytes_per_token"] / (res["graph_step_us"] * 1e3), 1)
        log(f"[{args.quant}] pipelined greedy decode {res['pipelined_tok_s']} tok/s (same tokens as step by step: "
            f"{res['pipelined_same_tokens']})")
        log(f"[{args.quant}] decode {res['decode_tok_s']} tok/s (median {res['decode_ms_median']} ms wall; "
            f"GPU {res['graph_step_us']} us/step = {res['gpu_step_gb_s']} GB/s of weights; roofline "
            f"{res['roofline_tok_s']} tok/s at {res['bytes_per_token'] / 1e9:.2f} GB/token)")
        res["breakdown"] = kernel_breakdown(cp, fwd, model, 1, tokens[-1], args.prompt + args.decode)
        for name, v in res["breakdown"].items():
            log(f"    {name:16s} x{v['launches']:<4d} {v['us']:9.1f} us  {v['gb_s'] or '':>8} GB/s")
        res["forward_stats"] = fwd.stats()
        base_tokens = greedy(fwd, model, 2, short, args.window_steps)[0] if args.window else []
        fwd.close()
    finally:
        dev.close()

    res["window"] = {}
    for keep in args.window:
        dev = open_device({"window": str(keep)})
        try:
            wf = DeviceForward(dev.weight, dev.layer_boundary, stream=dev.stream, gemm=dev.gemm)
            toks, times, _ = greedy(wf, model, 1, short, args.window_steps)
            stats = dev.cache.stats()
            res["window"][keep] = {"ms_per_token": round(1e3 * statistics.median(times), 2),
                                   "same_tokens": toks == base_tokens, "evictions": stats.get("evictions"),
                                   "uploads": stats.get("uploads"), "pool_reuse": stats.get("pool_reuse")}
            log(f"[{args.quant}] window keep={keep}: {res['window'][keep]}")
            wf.close()
        finally:
            dev.close()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--quant", default="q8")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--window", default="1,4,16", help="comma-separated keep values ('' to skip)")
    p.add_argument("--window-prompt", type=int, default=8)
    p.add_argument("--window-steps", type=int, default=3)
    p.add_argument("--sweep", default="",
                   help="configurations to time, comma-separated, each '+'-joined KEY=VALUE settings of the "
                        "forward, e.g. PDL=0+CLUSTER=0 or FUSE_ATTENTION=0 ('default' = the environment as it is; "
                        "'' to skip)")
    p.add_argument("--sweep-steps", type=int, default=24)
    p.add_argument("--sweep-breakdown", action="store_true", help="per-kind GPU breakdown of every configuration")
    p.add_argument("--keep-default", action="store_true",
                   help="run the main measurements under the environment as it is, not the sweep's fastest")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.window = [int(x) for x in args.window.split(",") if x.strip()]
    args.sweep = [x.strip() for x in args.sweep.split(",") if x.strip()]
    res = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    require_cuda()
    main()
