"""End-to-end whole-step forward on a synthetic preset (default qwen3-8b): preload, prefill, graph decode,
per-kernel breakdown, the bandwidth roofline, and the residency window.

    python benchmarks/cuda_e2e.py [--preset qwen3-8b] [--quant q8] [--prompt 512] [--decode 128]
                                  [--window 1,4,16] [--json out.json]

Everything runs through the CUDA backend's own device (binding.open_device: its weight cache, preload,
stream and tiled GEMM) and kestrel_cuda.forward.DeviceForward, the object the kestrel_forward hook calls.
Wall-clock times include the Python work per step (token in, logits [1, vocab] back to a numpy array);
the GPU time of one decode step is measured with CUDA events around replays of its graph. Figures:
    copy_gb_s        device-to-device copy, bytes read + written per second (the bandwidth ceiling)
    bytes_per_token  weight codes + scales one decode step reads (every projection and lm_head)
    roofline_tok_s   copy_gb_s / bytes_per_token
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from typing import Any

import numpy as np


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


def step_bytes(fwd: Any) -> int:
    st = fwd._st
    lins = [lin for layer in st.layers for lin in
            (*layer.weights.qkv, layer.weights.o, *layer.weights.gate_up, layer.weights.down)] + [st.lm_head]
    return sum(int(lin.codes.nbytes) + int(lin.scales.nbytes) for lin in lins)


def kernel_breakdown(cp: Any, fwd: Any, model: Any, seq_id: int, token: int, pos: int) -> dict[str, Any]:
    """One eager decode step with CUDA events around every launch: GPU microseconds per kernel kind."""
    ops = fwd.ops
    records: list[tuple[str, int, Any, Any]] = []
    label = {"name": "", "bytes": 0}
    names = {0: "q/k/v", 1: "q/k/v", 2: "q/k/v", 3: "o", 4: "gate/up", 5: "gate/up", 6: "down", 7: "lm_head",
             9: "q/k/v", 10: "gate/up"}
    orig_gemv, orig_launch = ops.gemv, ops._launch

    def gemv(lin, *args, **kw):  # type: ignore[no-untyped-def]
        label["name"] = "gemv " + names.get((lin.wkey & 0xFFFFFFFF) - 1, "?")
        label["bytes"] = int(lin.codes.nbytes) + int(lin.scales.nbytes)
        try:
            orig_gemv(lin, *args, **kw)
        finally:
            label["name"], label["bytes"] = "", 0

    def launch(fn, grid, block, args, smem=0):  # type: ignore[no-untyped-def]
        name = label["name"] or getattr(fn, "kernel_name", None) or _kernel_name(ops, fn)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(ops.stream)
        orig_launch(fn, grid, block, args, smem)
        e1.record(ops.stream)
        records.append((name, label["bytes"], e0, e1))

    ops.gemv, ops._launch = gemv, launch
    use_graph = fwd.use_graph
    fwd.use_graph = False
    try:
        fwd.forward(model, seq_id, np.array([token]), pos, False)
    finally:
        ops.gemv, ops._launch = orig_gemv, orig_launch
        fwd.use_graph = use_graph
    ops.stream.synchronize()
    us: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    for name, b, e0, e1 in records:
        us[name] += cp.cuda.get_elapsed_time(e0, e1) * 1e3
        nbytes[name] += b
        count[name] += 1
    return {name: {"launches": count[name], "us": round(us[name], 1),
                   "gb_s": round(nbytes[name] / (us[name] * 1e3), 1) if nbytes[name] else None}
            for name in sorted(us, key=lambda n: -us[n])}


def _kernel_name(ops: Any, fn: Any) -> str:
    for name, f in ops._fn.items():
        if f is fn:
            return name
    return "quantize_rows" if fn in ops._quant.values() else "?"


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    import cupy as cp

    from kestrel_core.model.presets import preset_model
    from kestrel_cuda.binding import open_device
    from kestrel_cuda.forward import DeviceForward

    os.environ.pop("KESTREL_CUDA_STREAM", None)
    res: dict[str, Any] = {"preset": args.preset, "quant": args.quant, "prompt": args.prompt, "decode": args.decode}
    t0 = time.perf_counter()
    model = preset_model(args.preset, args.quant)
    res["build_model_s"] = round(time.perf_counter() - t0, 2)
    res["model_host_gb"] = round(model.nbytes / 1e9, 3)
    log(f"[{args.quant}] model built in {res['build_model_s']} s ({res['model_host_gb']} GB host)")

    dev = open_device({})
    try:
        res["device"] = dev.description
        res["copy_gb_s"] = round(copy_bandwidth(cp), 1)
        t0 = time.perf_counter()
        dev.preload(model)
        res["preload_s"] = round(time.perf_counter() - t0, 3)
        res["preload_info"] = dict(dev.preload_info)
        log(f"[{args.quant}] preload {res['preload_s']} s {dev.preload_info}; copy {res['copy_gb_s']} GB/s")

        fwd = DeviceForward(dev.weight, None, stream=dev.stream, gemm=dev.gemm, pin=dev.cache.pin,
                            unpin=dev.cache.unpin)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, model.config.vocab_size, args.prompt)
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

        tokens, times, _ = greedy(fwd, model, 1, prompt, args.decode)
        warm = times[2:] or times
        res["decode_ms_median"] = round(1e3 * statistics.median(warm), 3)
        res["decode_tok_s"] = round(1.0 / statistics.median(warm), 1)
        res["decode_tok_s_mean"] = round(len(warm) / sum(warm), 1)
        res["graph_step_us"] = round(graph_step_us(cp, fwd, 1), 1)
        res["bytes_per_token"] = step_bytes(fwd)
        res["roofline_tok_s"] = round(res["copy_gb_s"] * 1e9 / res["bytes_per_token"], 1)
        res["gpu_step_gb_s"] = round(res["bytes_per_token"] / (res["graph_step_us"] * 1e3), 1)
        log(f"[{args.quant}] decode {res['decode_tok_s']} tok/s (median {res['decode_ms_median']} ms wall; "
            f"GPU {res['graph_step_us']} us/step = {res['gpu_step_gb_s']} GB/s of weights; roofline "
            f"{res['roofline_tok_s']} tok/s at {res['bytes_per_token'] / 1e9:.2f} GB/token)")
        res["breakdown"] = kernel_breakdown(cp, fwd, model, 1, tokens[-1], args.prompt + args.decode)
        for name, v in res["breakdown"].items():
            log(f"    {name:16s} x{v['launches']:<4d} {v['us']:9.1f} us  {v['gb_s'] or '':>8} GB/s")
        res["forward_stats"] = fwd.stats()
        short = prompt[:args.window_prompt]
        base_tokens, base_times, _ = greedy(fwd, model, 2, short, args.window_steps)
        res["window_base_ms"] = round(1e3 * statistics.median(base_times), 3)
        fwd.close()
    finally:
        dev.close()

    res["window"] = {}
    for keep in args.window:
        os.environ["KESTREL_CUDA_STREAM"] = str(keep)
        dev = open_device({})
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
            os.environ.pop("KESTREL_CUDA_STREAM", None)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--quant", default="q8")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--window", default="1,4,16", help="comma-separated keep values ('' to skip)")
    p.add_argument("--window-prompt", type=int, default=16)
    p.add_argument("--window-steps", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.window = [int(x) for x in args.window.split(",") if x.strip()]
    res = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
