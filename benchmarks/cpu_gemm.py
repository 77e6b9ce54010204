"""Per-shape timing of the CPU backend's int8 GEMM against numpy float32 BLAS, on SmolLM2-135M's shapes.

    python benchmarks/cpu_gemm.py                  # M = 1 (decode) and 256 (prefill), q8 (int8, G=32)
    python benchmarks/cpu_gemm.py --m 1,16,64,256 --bits 4 --group 256 --json

For each projection shape [N, K] and each M it times kestrel's ``kestrel_gemm_q8`` hook (through the bound
cpu backend, as the engine calls it, each weight under its own wkey so a VNNI host packs it once), the same
hook on the vpmaddwd kernels (``kernels.VNNI`` off: what a CPU without VNNI runs), and ``A @ W.T`` in
float32 (numpy's BLAS, the fastest pure-numpy way
to apply a dequantized weight), in the same process, and reports the median time, GB/s of weight bytes read
(int8 codes + float32 scales for kestrel, float32 for BLAS) and GFLOP/s. At M=1 each call gets the next of
enough copies of the weight that it reads DRAM, as a decode step does (``--pool-mb``). The last rows add the
shapes up per forward as the model uses them (30 layers, the tied lm_head once): GEMM-only bounds on tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import cycle

import numpy as np
from rich.console import Console
from rich.table import Table

from kestrel_core.contract import StripCache, quantize_activations, quantize_weight
from kestrel_core.registry import Registry

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads / 3 kv heads of 64, 30 layers, vocab 49152 (tied).
SHAPES: list[tuple[str, int, int, int]] = [  # name, N, K, uses per token
    ("q / o", 576, 576, 60),
    ("k / v", 192, 576, 60),
    ("gate / up", 1536, 576, 60),
    ("down", 576, 1536, 30),
    ("lm_head", 49152, 576, 1),
]


@dataclass
class Row:
    shape: str
    m: int
    n: int
    k: int
    kestrel_us: float
    kestrel_gbs: float
    kestrel_gflops: float
    vpmaddwd_us: float
    blas_us: float
    blas_gbs: float
    blas_gflops: float


def median_time(fn: Callable[[], object], min_seconds: float, repeats: int) -> float:
    """Median over ``repeats`` batches of the per-call time, each batch running at least ``min_seconds``."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(min_seconds / once))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def blas_description() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "threadpoolctl not installed"
    return "; ".join(f"{i.get('internal_api')} {i.get('version')} {i.get('architecture', '')} "
                     f"threads={i.get('num_threads')}" for i in threadpool_info())


def pool(make: Callable[[], object], nbytes: int, pool_bytes: int) -> list[object]:
    """Enough copies of one weight that cycling through them streams from DRAM (decode reads each once)."""
    return [make() for _ in range(max(1, -(-pool_bytes // nbytes)))]


def time_kestrel(x: np.ndarray, weights: list[StripCache], min_seconds: float, repeats: int,
                 vnni: bool = True) -> float:
    from kestrel_cpu import kernels

    cpu = Registry().cpu()
    a_codes, a_scales = quantize_activations(x, weights[0].group_size)
    calls = cycle(list(enumerate(weights, start=1)))
    had = kernels.VNNI
    kernels.VNNI = had and vnni
    try:
        def one() -> object:
            key, w = next(calls)
            return cpu.hook.kestrel_gemm_q8(device=cpu.device, a_codes=a_codes, a_scales=a_scales, weight=w,
                                            wkey=key)
        for _ in weights:  # every copy packed before the clock starts, as a model's weights are after a step
            one()
        return median_time(one, min_seconds, repeats)
    finally:
        kernels.VNNI = had


def time_blas(x: np.ndarray, mats: list[np.ndarray], min_seconds: float, repeats: int) -> float:
    calls = cycle(mats)
    return median_time(lambda: np.matmul(x, next(calls).T), min_seconds, repeats)


def run(ms: list[int], bits: int, group: int, min_seconds: float, repeats: int, pool_mb: int) -> list[Row]:
    """kestrel timings for every shape first, then BLAS: neither's idle worker threads spin during the other."""
    rng = np.random.default_rng(0)
    cases = []
    for name, n, k, _ in SHAPES:
        w = quantize_weight(rng.standard_normal((n, k)).astype(np.float32), bits, group)
        cases += [(name, m, w, rng.standard_normal((m, k)).astype(np.float32)) for m in ms]
    kestrel_t, tiles_t = [], []
    for _, m, w, x in cases:
        copies = pool(lambda w=w: StripCache(w.codes.copy(), w.scales.copy(), w.group_size, w.bits), w.nbytes,
                      pool_mb << 20 if m == 1 else 0)
        kestrel_t.append(time_kestrel(x, copies, min_seconds, repeats))
        tiles_t.append(time_kestrel(x, copies, min_seconds, repeats, vnni=False))
    time.sleep(0.5)
    rows = []
    for (name, m, w, x), t_k, t_t in zip(cases, kestrel_t, tiles_t):
        mats = pool(w.dequantize, w.n * w.k * 4, pool_mb << 20 if m == 1 else 0)  # float32 [N, K] each
        t_b = time_blas(x, mats, min_seconds, repeats)
        flops = 2 * m * w.n * w.k
        rows.append(Row(name, m, w.n, w.k, t_k * 1e6, w.nbytes / t_k / 1e9, flops / t_k / 1e9, t_t * 1e6,
                        t_b * 1e6, w.n * w.k * 4 / t_b / 1e9, flops / t_b / 1e9))
    return rows


def per_token(rows: list[Row], m: int) -> tuple[float, float]:
    """(kestrel, BLAS) seconds per forward of M tokens, GEMMs only (lm_head only for the last token)."""
    uses = {name: u for name, _, _, u in SHAPES}
    pick = [r for r in rows if r.m == m]
    head = {r.shape: r for r in rows if r.m == 1}.get("lm_head")
    kt = sum(r.kestrel_us * uses[r.shape] for r in pick if r.shape != "lm_head") * 1e-6
    bt = sum(r.blas_us * uses[r.shape] for r in pick if r.shape != "lm_head") * 1e-6
    if head is not None:
        kt += head.kestrel_us * 1e-6
        bt += head.blas_us * 1e-6
    return kt, bt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,256", help="comma-separated activation rows (default 1,256)")
    ap.add_argument("--bits", type=int, default=8, choices=(8, 4))
    ap.add_argument("--group", type=int, default=32, choices=(32, 256))
    ap.add_argument("--min-seconds", type=float, default=0.05, help="per timing batch")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--pool-mb", type=int, default=96,
                    help="M=1 cycles through copies of each weight totalling this much, so every call reads "
                         "DRAM as a decode step does (default 96, three times this machine's L3); 0: cache-hot")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    rows = run(ms, args.bits, args.group, args.min_seconds, args.repeats, args.pool_mb)
    cpu = Registry().cpu()
    info = {"machine": f"{platform.processor() or platform.machine()}, {_cpu_model()}",
            "blas": blas_description(), "kestrel_cpu": cpu.device.description,
            "quant": f"int{args.bits} G={args.group}",
            "working set": f"M=1 from DRAM ({args.pool_mb} MB of copies per shape)" if args.pool_mb else "cache-hot"}
    totals = {m: per_token(rows, m) for m in ms}
    if args.json:
        print(json.dumps({**info, "rows": [asdict(r) for r in rows],
                          "per_forward_s": {m: {"kestrel": k, "blas": b} for m, (k, b) in totals.items()}},
                         indent=2))
        return
    console = Console(width=max(140, Console().width))
    for key, value in info.items():
        console.print(f"[bold]{key}[/]: {value}")
    table = Table(title="CPU GEMM: kestrel int8 (hook) vs numpy float32 BLAS (A @ W.T), median per call")
    for col in ("shape", "M", "N x K", "kestrel us", "kestrel GB/s", "kestrel GFLOP/s", "vpmaddwd us", "BLAS us",
                "BLAS GB/s", "BLAS GFLOP/s", "speed-up"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for r in rows:
        table.add_row(r.shape, str(r.m), f"{r.n} x {r.k}", f"{r.kestrel_us:.1f}", f"{r.kestrel_gbs:.2f}",
                      f"{r.kestrel_gflops:.1f}", f"{r.vpmaddwd_us:.1f}", f"{r.blas_us:.1f}", f"{r.blas_gbs:.2f}",
                      f"{r.blas_gflops:.1f}",
                      f"{r.blas_us / r.kestrel_us:.2f}x")
    for m, (kt, bt) in totals.items():
        what = "30 layers + lm_head" if 1 in ms else "30 layers (lm_head: --m 1)"
        table.add_row(f"per forward (M={m})", str(m), what, f"{kt * 1e6:.0f}", "", "", "",
                      f"{bt * 1e6:.0f}", "", "", f"{bt / kt:.2f}x", end_section=m == ms[0])
        unit = "decode tok/s" if m == 1 else "prefill tok/s"
        console.print(f"GEMM-only bound at M={m}: kestrel {m / kt:.0f} {unit}, BLAS {m / bt:.0f} {unit}")
    console.print(table)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return platform.platform()


if __name__ == "__main__":
    main()
