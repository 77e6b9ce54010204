"""Per-block timeline of one captured decode step: where the GPU waits between the step's kernels.

    python benchmarks/cuda_timeline.py [--preset qwen3-8b] [--quant q4] [--prompt 512] [--layer 10] [--json F]
    python benchmarks/cuda_timeline.py --gemv o:8,o:4,q|k|v:4 [--json F]

forward.cu is compiled with -DKESTREL_TIMELINE: thread 0 of every block of the decode kernels records, in
%globaltimer nanoseconds, its entry, the end of its PDL wait, the end of its own work (before a split-K
merge) and its exit. For each kernel of the step, in order (averaged over the layers by kind, and one layer
in full):
  eff      last exit minus the previous kernel's last exit: its share of the step
  release  its first block's wait end minus the previous kernel's last exit (PDL hand-over)
  work     the 90th percentile of its blocks' work ends minus its first wait end (streaming)
  tail     its last exit minus that 90th percentile (stragglers, the split-K merge)
  pre      median time its blocks waited at the PDL wait (entry to wait end)
and for the one layer the quantiles of its blocks' wait ends and work ends (after its first wait end) and of
the merging blocks' merge (exit minus work end).

``--gemv SHAPE:BITS,...`` times instead a chain of one decode GEMV shape (benchmarks/cuda_gemv.py's Qwen3-8B
shapes, G = 32), launched as cuda_gemv.py --decode-only launches it (back to back with PDL, rotating weight
copies, one launch per copy), and gives the same columns per launch, averaged over the launches after the
first, with the medians of the merging blocks' merge and of the other blocks' hold (exit minus work end: the
split-K hand-over before they free their SM slot).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import defaultdict
from typing import Any

import numpy as np

FLAGS = 7  # low bits of a kernel id: 0/1 GEMV block (1: the block that merged), 2 qkv_rope, 4/5 attention


def _names(fwd: Any, seq: Any) -> dict[int, str]:
    st = fwd._st
    names: dict[int, str] = {}
    for i, layer in enumerate(st.layers):
        w = layer.weights
        for lin in w.qkv:
            names[lin.codes.data.ptr] = f"{i}:qkv"
        names[w.o.codes.data.ptr] = f"{i}:o"
        for lin in w.gate_up:
            names[lin.codes.data.ptr] = f"{i}:gate_up"
        names[w.down.codes.data.ptr] = f"{i}:down"
        kc = seq.kv[i, 0].data.ptr
        names[kc | 2] = f"{i}:qkv_rope"
        names[kc | 4] = f"{i}:attention"
    names[st.lm_head.codes.data.ptr] = "lm_head"
    names[0] = "lm_finish"
    return names


def analyse(recs: np.ndarray, names: dict[int, str]) -> list[dict[str, Any]]:
    groups: dict[str, list[np.ndarray]] = defaultdict(list)
    for r in recs:
        kid = int(r[4])
        flag = kid & FLAGS
        base = kid & ~FLAGS if flag in (0, 1) else kid & ~1 if flag in (4, 5) else kid
        groups[names.get(base, hex(base))].append(r)
    kernels = []
    for name, rows in groups.items():
        a = np.array(rows, dtype=np.int64)
        w0 = a[:, 1].min()
        merged = (a[:, 4] & FLAGS) % 2 == 1  # the blocks that merged the split partials of a tile
        kernels.append({"name": name, "blocks": len(a), "entry": a[:, 0].min(), "waited": w0,
                        "work90": np.percentile(a[:, 2], 90), "exit": a[:, 3].max(),
                        "pre_us": float(np.median(a[:, 1] - a[:, 0])) / 1e3,
                        # work ends after the first wait end: quantiles; the merge blocks' exit - work end
                        "work_q": [round(float(np.percentile(a[:, 2] - w0, q)) / 1e3, 2) for q in (0, 50, 90, 99, 100)],
                        "wait_q": [round(float(np.percentile(a[:, 1] - w0, q)) / 1e3, 2) for q in (0, 50, 90, 100)],
                        "merge_q": [round(float(np.percentile(a[merged, 3] - a[merged, 2], q)) / 1e3, 2)
                                    for q in (0, 50, 100)] if merged.any() else [],
                        "hold_q": [round(float(np.percentile(a[~merged, 3] - a[~merged, 2], q)) / 1e3, 2)
                                   for q in (0, 50, 100)] if merged.any() and (~merged).any() else []})
    kernels.sort(key=lambda k: k["entry"])
    t_start = kernels[0]["entry"]
    prev_exit = t_start
    out = []
    for k in kernels:
        out.append({"name": k["name"], "blocks": k["blocks"],
                    "eff_us": round((k["exit"] - prev_exit) / 1e3, 2),
                    "release_us": round((k["waited"] - prev_exit) / 1e3, 2),
                    "work_us": round((k["work90"] - k["waited"]) / 1e3, 2),
                    "tail_us": round((k["exit"] - k["work90"]) / 1e3, 2),
                    "pre_us": round(k["pre_us"], 2), "work_q": k["work_q"], "wait_q": k["wait_q"],
                    "merge_q": k["merge_q"], "hold_q": k["hold_q"]})
        prev_exit = k["exit"]
    return out


def by_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    kinds: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        kinds[r["name"].split(":")[-1]].append(r)
    return {kind: {"n": len(rs), **{f: round(statistics.mean(r[f] for r in rs), 2)
                                   for f in ("eff_us", "release_us", "work_us", "tail_us", "pre_us")},
                   "blocks": rs[0]["blocks"]}
            for kind, rs in kinds.items()}


def timeline_defines() -> tuple[str, ...]:
    """forward.cu's defines with the timeline stamps, set for the kernels this process compiles."""
    from kestrel_cuda import forward_ops

    defines = (*forward_ops.kernel_defines(), "-DKESTREL_TIMELINE")
    os.environ[forward_ops.DEFINES_ENV] = " ".join(defines)
    return defines


def read_records(cp: Any, mod: Any, replay: Any, stream: Any) -> tuple[np.ndarray, float]:
    """The block records of one ``replay()`` on ``stream`` and its GPU microseconds."""
    count = cp.ndarray((1,), np.uint32, mod.get_global("kt_n"))
    with stream:
        count[...] = 0
    stream.synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(stream)
    replay()
    e1.record(stream)
    e1.synchronize()
    n = int(count.get()[0])
    recs = cp.ndarray((n, 6), np.uint64, mod.get_global("kt_buf")).get()
    return recs, cp.cuda.get_elapsed_time(e0, e1) * 1e3


def gemv_chain(args: argparse.Namespace) -> dict[str, Any]:
    """--gemv: the timeline of back-to-back launches of each decode GEMV shape given."""
    import cupy as cp
    from cuda_gemv import DECODE_SHAPES, Bench, plan_decode

    from kestrel_cuda import forward_ops
    from kestrel_cuda.forward_ops import EPI_STORE, PRO_PLAIN, CupyOps, Lin

    mod = forward_ops._module(timeline_defines())
    bench = Bench(argparse.Namespace(quick=True))
    ops = CupyOps(bench.stream)
    res: dict[str, Any] = {"gemv": []}
    for spec in args.gemv.split(","):
        name, bits = spec.rsplit(":", 1)
        n, k = DECODE_SHAPES[name]
        ws = bench.weight_copies(n, k, 32, int(bits))
        copies = len(ws)
        lins = [Lin.from_device_weight(w, n) for w in ws]
        plan_decode(ops, lins)
        x = cp.asarray(np.random.default_rng(0).standard_normal((1, k)).astype(np.float32))
        y = cp.empty((1, n), dtype=cp.float32)
        graph = ops.capture(lambda lins=lins, x=x, y=y: [ops.gemv(lin, x, PRO_PLAIN, None, 0.0, 0, y, EPI_STORE, None)
                                                         for lin in lins])
        for _ in range(args.replays):
            recs, gpu_us = read_records(cp, mod, graph, bench.stream)
        rows = analyse(recs, {lin.codes.data.ptr: f"{i}:gemv" for i, lin in enumerate(lins)})[1:]

        def median_of(key: str, rows: list[dict[str, Any]] = rows) -> float | None:
            return round(statistics.median(r[key][1] for r in rows), 2) if rows[0][key] else None

        summary = {"shape": spec, "launches": copies, "us_per_launch": round(gpu_us / copies, 2),
                   "ksplit": lins[0].ksplit, "cluster": lins[0].cluster, **by_kind(rows)["gemv"],
                   "merge_us": median_of("merge_q"), "hold_us": median_of("hold_q")}
        res["gemv"].append(summary)
        print(json.dumps(summary), flush=True)
        bench.release(ws)
        del graph
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    import cupy as cp

    from kestrel_core.model.presets import preset_model
    from kestrel_cuda import forward_ops
    from kestrel_cuda.binding import open_device
    from kestrel_cuda.forward import DeviceForward

    defines = timeline_defines()
    model = preset_model(args.preset, args.quant)
    dev = open_device({})
    dev.preload(model)
    fwd = DeviceForward(dev.weight, None, stream=dev.stream, gemm=dev.gemm, pin=dev.cache.pin,
                        unpin=dev.cache.unpin)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt)
    tok = int(fwd.forward(model, 1, prompt, 0, False)[0].argmax())
    for i in range(4):  # the graph is captured on the first decode step
        tok = int(fwd.forward(model, 1, np.array([tok]), len(prompt) + i, False)[0].argmax())
    mod = forward_ops._module(defines)
    seq, stream = fwd._seqs[1], fwd.ops.stream
    res: dict[str, Any] = {"preset": args.preset, "quant": args.quant, "steps": []}
    for _ in range(args.replays):
        recs, gpu_us = read_records(cp, mod, seq.graph, stream)
        rows = analyse(recs, _names(fwd, seq))
        res["steps"].append({"gpu_us": round(gpu_us, 1), "records": len(recs),
                             "by_kind": by_kind(rows),
                             "layer": [r for r in rows if r["name"].startswith(f"{args.layer}:")]})
    fwd.close()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--quant", default="q4")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--layer", type=int, default=10)
    p.add_argument("--replays", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--gemv", default="", help="SHAPE:BITS,... (o:8,q|k|v:4): a chain of that decode GEMV instead")
    args = p.parse_args()
    if args.gemv:
        res = gemv_chain(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=float)
        return
    res = run(args)
    last = res["steps"][-1]
    print(f"{res['preset']} {res['quant']}: GPU {[s['gpu_us'] for s in res['steps']]} us/step "
          f"(timeline build), {last['records']} block records")
    print(f"{'kernel':12s} {'n':>3s} {'blocks':>6s} {'eff':>7s} {'release':>7s} {'work':>7s} {'tail':>7s} {'pre':>7s}")
    for kind, v in last["by_kind"].items():
        print(f"{kind:12s} {v['n']:3d} {v['blocks']:6d} {v['eff_us']:7.2f} {v['release_us']:7.2f} "
              f"{v['work_us']:7.2f} {v['tail_us']:7.2f} {v['pre_us']:7.2f}")
    print("layer", args.layer)
    for r in last["layer"]:
        print(f"{r['name']:12s}     {r['blocks']:6d} {r['eff_us']:7.2f} {r['release_us']:7.2f} "
              f"{r['work_us']:7.2f} {r['tail_us']:7.2f} {r['pre_us']:7.2f}  wait end q0/50/90/100 {r['wait_q']} "
              f"work end q0/50/90/99/100 {r['work_q']} merge q0/50/100 {r['merge_q']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=float)


if __name__ == "__main__":
    main()
