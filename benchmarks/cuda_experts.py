"""A decode step's mixture of experts alone on the CUDA backend, at a preset's expert shapes (default
qwen3-30b-a3b): ``moe_route``, the chosen experts' gate|up and down GEMVs and ``moe_combine`` for ``--steps`` rows,
with random experts, router and rows, so that each row chooses its own experts. Each kind's launches are replayed
in a graph of their own, then all of them in one, against the device copy bandwidth. It needs no model, so it is
also a target for Nsight Compute:

    python benchmarks/cuda_experts.py --preset qwen3-30b-a3b --quant q8
    ncu --clock-control none --kernel-name regex:qgemv --launch-count 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section LaunchStats python benchmarks/cuda_experts.py --steps 1
"""

from __future__ import annotations

import argparse

import numpy as np
from cuda_e2e import _events_us, copy_bandwidth, lin_bytes, log, replay_breakdown
from cuda_required import require_cuda

from kestrel_core.model.presets import preset_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--quant", default="q8", choices=("q8", "q4"))
    ap.add_argument("--steps", type=int, default=48, help="rows, one decode step's experts each")
    ap.add_argument("--chosen", type=int, default=0, help="experts chosen a row (default: the preset's)")
    ap.add_argument("--rows-alike", action="store_true",
                    help="every row the same, so each launch reads the experts the one before read (from L2)")
    args = ap.parse_args()

    import cupy as cp

    from kestrel_cuda.layout import pack_kmajor, pad_n
    from kestrel_cuda.ops_cupy import CupyOps
    from kestrel_cuda.ops_numpy import _row_ssq
    from kestrel_cuda.plan import EPI_STORE, PRO_PLAIN, PRO_SILU_MUL, Lin, plan_routed

    c = preset_config(args.preset)
    if not c.is_moe:
        raise SystemExit(f"{args.preset} is not a mixture of experts")
    e, d, f, s = c.num_experts, c.hidden_size, c.expert_intermediate_size, args.steps
    k = args.chosen or c.experts_per_token
    bits = 8 if args.quant == "q8" else 4
    ops = CupyOps()
    rng = np.random.default_rng(0)

    def expert(n: int, kk: int) -> Lin:
        lo, hi = (-127, 128) if bits == 8 else (-8, 8)
        codes = rng.integers(lo, hi, size=(n, kk), dtype=np.int8)
        scales = np.zeros((kk // 32, pad_n(n)), np.float32)
        scales[:, :n] = 0.01
        lin = Lin(ops.upload(pack_kmajor(codes, bits)), ops.upload(scales), kk, n, pad_n(n), 32, bits)
        lin.ksplit = plan_routed(lin, k, ops.sm_count, ops.cluster)
        return lin

    gate_ups, downs = [expert(2 * f, d) for _ in range(e)], [expert(d, f) for _ in range(e)]
    gate_up, down = gate_ups[0], downs[0]
    tables = ops.expert_table(gate_ups), ops.expert_table(downs)
    ops.reserve(k * max(gate_up.ksplit * gate_up.npad, down.ksplit * down.npad), k * (gate_up.tiles + down.tiles),
                1, 1)
    norm = ops.upload(np.ones(d, np.float32))
    router = ops.upload((0.05 * rng.standard_normal((e, d))).astype(np.float32))
    rows = rng.standard_normal((s, d)).astype(np.float32)
    if args.rows_alike:
        rows[:] = rows[0]
    h, ssq = ops.upload(rows), ops.upload(np.stack([_row_ssq(r) for r in rows]))
    xn, logits, counters = ops.zeros((s, d), np.float32), ops.zeros((s, e + 1), np.float32), ops.zeros(s, np.int32)
    sel, wts = ops.zeros((s, k), np.int32), ops.zeros((s, k + 1), np.float32)
    gu, ys = ops.zeros((s * k, 2 * f), np.float32), ops.zeros((s * k, d), np.float32)
    expert_bytes = k * (lin_bytes(gate_up) + lin_bytes(down))

    calls = []
    for i in range(s):
        slots = slice(i * k, (i + 1) * k)
        calls += [
            ("moe_route", 0, lambda i=i: ops.moe_route(h[i:i + 1], norm, c.rms_norm_eps, router, e, k, c.norm_topk_prob,
                                                       xn[i:i + 1], (logits[i:i + 1], counters[i:i + 1]), sel[i:i + 1],
                                                       wts[i:i + 1], ssq_in=ssq[i])),
            ("gate|up", k * lin_bytes(gate_up),
             lambda i=i, slots=slots: ops.gemv(gate_up, xn[i:i + 1], PRO_PLAIN, None, 0.0, 0, gu[slots], EPI_STORE,
                                               None, experts=(tables[0], sel[i], k))),
            ("down", k * lin_bytes(down),
             lambda i=i, slots=slots: ops.gemv(down, gu[slots], PRO_SILU_MUL, None, 0.0, f, ys[slots], EPI_STORE,
                                               None, experts=(tables[1], sel[i], k), sel_ready=True)),
            ("moe_combine", 0, lambda i=i, slots=slots: ops.moe_combine(ys[slots], k, wts[i:i + 1], h[i:i + 1],
                                                                        ssq_out=ssq[i])),
        ]
    for _, _, fn in calls:  # eager: the choices every replay then reads
        fn()
    ops.synchronize()
    chosen = cp.asnumpy(sel)
    log(f"{args.preset} {args.quant}: {e} experts, {k} chosen a row, D={d}, F={f}; gate|up splits {gate_up.ksplit}, "
        f"down {down.ksplit}; {len(np.unique(chosen))} experts chosen over {s} rows")
    copy = copy_bandwidth(cp)
    for kind, v in replay_breakdown(cp, ops, calls).items():
        rate = f", {v['gb_s'] / 1e3:.2f} TB/s ({100 * v['gb_s'] / copy:.0f} % of copy)" if v["gb_s"] else ""
        log(f"  {kind:12s} {v['us'] / v['launches']:7.2f} us a launch{rate}")
    us = _events_us(cp, ops.stream, ops.capture(lambda: [fn() for _, _, fn in calls]), 7) / s
    log(f"  all four, one graph: {us:.2f} us a row ({expert_bytes / us / 1e6:.2f} TB/s of the chosen experts); "
        f"copy {copy / 1e3:.2f} TB/s")


if __name__ == "__main__":
    require_cuda()
    main()
