# ruff: noqa: B023  (every closure below is timed and dropped inside the loop iteration that made it)
"""CUDA kernel benchmarks on Qwen3-8B shapes: decode GEMV vs copy bandwidth and cuBLAS fp16, prefill GEMM,
activation quantization, the hook's CPU/GPU crossover (the default min FLOPs), and preload.

    python benchmarks/cuda_gemv.py [--json out.json] [--quick] [--no-preload] [--no-crossover] [--decode-only]
                                   [--splits plan,8,8c,16] [--shapes "q|k|v=8192:3840,o=3840:4096"]

Two decode GEMVs are measured: the hook path's (``gemm.q8`` on pre-quantized activations, gemv_warp.cu),
and the whole-step decode's (gemv.cu ``qgemv`` through ``CupyOps.gemv``: activation quantization fused,
the planner's K split and clusters, launched back to back with programmatic dependent launch as the
captured decode step launches it; ``--decode-only`` runs the copy and this one alone).

Timing: device work is timed with CUDA events over a captured CUDA graph of many launches (so Python launch
overhead is not measured), rotating over enough weight copies that the working set is several times the L2,
median of several replays. Host-visible paths (the hooks, preload) use wall-clock time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
from cuda_required import require_cuda

SHAPES = {  # name: (N, K) of Qwen3-8B's projections (HF orientation [out, in])
    "q": (4096, 4096), "k/v": (1024, 4096), "o": (4096, 4096), "gate/up": (12288, 4096),
    "down": (4096, 12288), "lm_head": (151936, 4096),
}
DECODE_SHAPES = {**SHAPES, "q|k|v": (6144, 4096)}  # the decode step runs q|k|v as one fused GEMV
# one 512-token prefill of Qwen3-8B: fused QKV (6144) and gate|up (24576) per layer, 36 layers, lm_head once
PREFILL_LAYER = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
LAYERS = 36
L2_BYTES = 60 << 20


def log(*a: Any) -> None:
    print(*a, flush=True)


def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    """``--shapes``: "name=N:K,..." (another model's projections), or DECODE_SHAPES for ""."""
    if not text:
        return DECODE_SHAPES
    shapes = {}
    for item in text.split(","):
        name, nk = item.split("=")
        n, k = nk.split(":")
        shapes[name] = (int(n), int(k))
    return shapes


def plan_decode(ops: Any, lins: list[Any], setting: str = "plan") -> None:
    """Plan the M=1 GEMV of each of ``lins`` as the decode step does ("plan": the planner's K split and
    clusters; "N" or "Nc": N splits, "c" as one cluster per tile), and reserve the split-K scratch they need."""
    from kestrel_cuda.plan import MAX_CLUSTER, gemv_scratch, plan_split

    for lin in lins:
        lin.ksplit = plan_split(lin, ops.sm_count, clusters=ops.cluster)
        if setting != "plan":
            lin.ksplit = min(int(setting.rstrip("c")), lin.chunks)
            lin.cluster = ops.cluster and setting.endswith("c") and lin.ksplit <= MAX_CLUSTER
    part, counters, merge_tiles = gemv_scratch(lins)
    ops.reserve(part, counters, 1, 1, merge_tiles)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import cupy as cp

        from kestrel_cuda.binding import open_device

        self.cp = cp
        self.args = args
        t0 = time.perf_counter()
        self.dev = open_device({})
        self.open_s = time.perf_counter() - t0
        self.stream = self.dev.stream
        self.results: dict[str, Any] = {"device": self.dev.description, "open_s": round(self.open_s, 2),
                                        "kernel_compile_s": round(self.dev.kernels.compile_s, 2),
                                        "kernel_info": self.dev.kernels.info}

    # -- timing helpers ------------------------------------------------------------------------------

    def graph_time_us(self, launch, count: int, replays: int = 7) -> tuple[float, str]:
        """Median microseconds per launch of ``launch(i)`` for i in 0..count-1 captured in one graph."""
        s = self.stream
        with s:
            for i in range(min(count, 4)):
                launch(i)
        s.synchronize()
        mode = "graph"
        try:
            s.begin_capture()
            try:
                with s:  # library calls (cuBLAS) launch on the current stream
                    for i in range(count):
                        launch(i)
            finally:
                graph = s.end_capture()
            run = lambda: graph.launch(s)  # noqa: E731
        except Exception as exc:  # capture unsupported for this call: eager launches instead
            mode = f"eager ({type(exc).__name__})"

            def run() -> None:
                with s:
                    for i in range(count):
                        launch(i)
        return self.replay_us(run, count, replays), mode

    def replay_us(self, run, count: int, replays: int = 7) -> float:
        """Median microseconds per launch of ``run()``, ``count`` launches on the stream, after one warm-up."""
        cp, s = self.cp, self.stream
        run()
        s.synchronize()
        times = []
        for _ in range(replays):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(s)
            run()
            end.record(s)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0 / count)
        return statistics.median(times)

    # -- device weights without host generation ------------------------------------------------------

    def device_weight(self, n: int, k: int, g: int, bits: int, seed: int):
        """A random resident weight in the kernels' layout, made on the device (uploads are timed apart)."""
        from kestrel_cuda.layout import Geometry, pad_n
        from kestrel_cuda.residency import DeviceWeight

        cp = self.cp
        geo = Geometry(k, pad_n(n), k // g, 4 if bits == 4 else 8)
        buf = self.dev.allocator.alloc(geo.nbytes)
        w = DeviceWeight(0, geo, buf, None, True, None)
        rs = cp.random.RandomState(seed)
        with self.stream:  # random bytes: timing does not depend on the code values
            words = rs.randint(0, 2**31 - 1, size=geo.codes_nbytes // 4, dtype=cp.int32)
            w.codes[...] = words.view(cp.int8)
            w.scales[...] = rs.uniform(1e-3, 2e-2, size=(geo.ngroups, geo.npad)).astype(cp.float32)
        return w

    def weight_copies(self, n: int, k: int, g: int, bits: int) -> list[Any]:
        """Enough random copies of one weight (at least two) to read four times the L2 per rotation, so that
        back-to-back launches over them stream from device memory."""
        first = self.device_weight(n, k, g, bits, 1)
        copies = max(2, -(-4 * L2_BYTES // first.geometry.nbytes))
        return [first] + [self.device_weight(n, k, g, bits, 2 + i) for i in range(copies - 1)]

    def decode_ops(self) -> Any:
        """The whole-step forward's kernels on the device's stream, under the device's settings (PDL, clusters)."""
        from kestrel_cuda.ops_cupy import CupyOps

        cfg = self.dev.config
        return CupyOps(self.stream, pdl=cfg.pdl, cluster=cfg.cluster)

    def save(self, path: str) -> None:
        """Write the results as JSON to ``path`` (nothing when it is empty)."""
        if path:
            with open(path, "w") as f:
                json.dump(self.results, f, indent=1)

    def release(self, weights) -> None:
        for w in weights:
            self.dev.allocator.free(w.buffer)
            w.buffer = None

    # -- 1. copy bandwidth ---------------------------------------------------------------------------

    def copy_bandwidth(self) -> float:
        """A 16-byte-per-thread copy kernel and cudaMemcpy D2D; the faster is the ceiling."""
        cp = self.cp
        nbytes = 2 << 30
        src = cp.ones(nbytes, dtype=cp.uint8)
        dst = cp.empty_like(src)
        kern = cp.RawKernel(r"""
extern "C" __global__ void copy16(const uint4* __restrict__ s, uint4* __restrict__ d, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        d[i] = s[i];
}""", "copy16")
        n16 = np.int64(nbytes // 16)
        blocks = self.dev.sm_count * 8
        us_k, mode = self.graph_time_us(lambda i: kern((blocks,), (256,), (src, dst, n16)), 5)
        us_m, _ = self.graph_time_us(
            lambda i: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3, self.stream.ptr), 5)
        bw_k, bw_m = (2 * nbytes / (us * 1e-6) / 1e12 for us in (us_k, us_m))
        bw = max(bw_k, bw_m)
        self.results.update(copy_tb_s=round(bw, 3), copy_kernel_tb_s=round(bw_k, 3),
                            copy_memcpy_tb_s=round(bw_m, 3))
        log(f"device copy (read+write, 2 GiB, {mode}): kernel {bw_k:.2f} TB/s, memcpy {bw_m:.2f} TB/s")
        return bw

    # -- 2. decode GEMV ------------------------------------------------------------------------------

    def gemv(self, copy_bw: float) -> None:
        cp = self.cp
        rows = []
        for name, (n, k) in SHAPES.items():
            for bits, g in ((8, 32), (4, 32), (8, 256)):
                if self.args.quick and (bits, g) != (8, 32):
                    continue
                ws = self.weight_copies(n, k, g, bits)
                w0, copies = ws[0], len(ws)
                wbytes = w0.geometry.nbytes
                a = cp.asarray(np.random.default_rng(0).integers(-127, 128, (1, k), dtype=np.int8))
                s = cp.asarray(np.random.default_rng(1).uniform(0.001, 0.01, (1, k // g)).astype(np.float32))
                out = cp.empty((1, n), dtype=cp.float32)
                count = 8 * copies if wbytes < (256 << 20) else copies * 2
                res = {}
                from kestrel_cuda.gemm import gemv_warp_variant

                auto = gemv_warp_variant(w0.geometry.npad, w0.geometry.code_bits)
                variants: dict[str, Any] = {"auto": None}
                if bits == 8 and g == 32 and not self.args.quick:
                    variants.update({"warp4": ("warp", 1, 4, 8)})
                    if n <= 4096:
                        variants.update({f"split{sp}": ("warp", 1, 8, 8, sp) for sp in (4, 8, 16)})
                for label, var in variants.items():
                    sp = None
                    if var is not None and var[0] == "warp" and len(var) == 5:
                        var, sp = var[:4], var[4]
                    us, mode = self.graph_time_us(
                        lambda i, var=var, sp=sp: self.dev.gemm.q8(a, s, ws[i % copies], out, n, self.stream,
                                                                   variant=var, splits=sp), count)
                    res[label] = us
                us = res["auto"]
                bw = wbytes / (us * 1e-6) / 1e12
                row = {"shape": name, "N": n, "K": k, "bits": bits, "G": g, "us": round(us, 2),
                       "weight_MB": round(wbytes / 1e6, 1), "tb_s": round(bw, 3),
                       "pct_copy": round(100 * bw / copy_bw, 1), "variant": list(auto), "mode": mode,
                       **{f"us_{kk}": round(v, 2) for kk, v in res.items() if kk != "auto"}}
                self.release(ws)
                if bits == 8 and g == 32:
                    row.update(self.cublas_fp16(n, k))
                rows.append(row)
                log(json.dumps(row))
        self.results["gemv"] = rows

    def cublas_fp16(self, n: int, k: int) -> dict[str, Any]:
        cp = self.cp
        wbytes = 2 * n * k
        copies = max(2, -(-4 * L2_BYTES // wbytes))
        if copies * wbytes > (8 << 30):
            copies = 2
        ws = [cp.random.standard_normal((k, n), dtype=cp.float32).astype(cp.float16) for _ in range(copies)]
        x = cp.random.standard_normal((1, k), dtype=cp.float32).astype(cp.float16)
        out = cp.empty((1, n), dtype=cp.float16)
        count = 8 * copies if wbytes < (256 << 20) else copies * 2
        us, mode = self.graph_time_us(lambda i: cp.matmul(x, ws[i % copies], out=out), count)
        ws.clear()
        return {"cublas_fp16_us": round(us, 2), "cublas_tb_s": round(wbytes / (us * 1e-6) / 1e12, 3),
                "cublas_mode": mode}

    def decode_gemv(self, copy_bw: float) -> None:
        """The whole-step decode's M=1 GEMV per shape (float activations, quantized in its prologue), int8 and
        int4 at G = 32, rotating over weight copies four times the L2, in one captured graph with PDL; with
        ``--splits``, once per K split given ("plan": the planner's; "8c": 8 splits as one cluster per tile)."""
        cp = self.cp
        from kestrel_cuda.plan import EPI_STORE, PRO_PLAIN, Lin

        # CupyOps.capture, not graph_time_us's plain capture: its launches carry PDL as in the decode step
        ops = self.decode_ops()
        rows = []
        for name, (n, k) in parse_shapes(self.args.shapes).items():
            for bits in (8, 4):
                ws = self.weight_copies(n, k, 32, bits)
                copies, wbytes = len(ws), ws[0].geometry.nbytes
                lins = [Lin.from_device_weight(w, n) for w in ws]
                x = cp.asarray(np.random.default_rng(0).standard_normal((1, k)).astype(np.float32))
                y = cp.empty((1, n), dtype=cp.float32)
                count = 8 * copies if wbytes < (256 << 20) else copies * 2
                floor_us = self.read_floor_us(ops, ws, count)
                for setting in self.args.splits.split(","):
                    plan_decode(ops, lins, setting)
                    graph = ops.capture(lambda: [ops.gemv(lins[i % copies], x, PRO_PLAIN, None, 0.0, 0, y,
                                                          EPI_STORE, None) for i in range(count)])
                    us = self.replay_us(graph, count)
                    del graph
                    bw = wbytes / (us * 1e-6) / 1e12
                    row = {"shape": name, "N": n, "K": k, "bits": bits, "G": 32, "us": round(us, 2),
                           "weight_MB": round(wbytes / 1e6, 1), "tb_s": round(bw, 3),
                           "pct_copy": round(100 * bw / copy_bw, 1), "splits": setting, "ksplit": lins[0].ksplit,
                           "cluster": lins[0].cluster, "pdl": ops.pdl, "read_floor_us": round(floor_us, 2),
                           "read_floor_pct_copy": round(100 * wbytes / (floor_us * 1e-6) / 1e12 / copy_bw, 1),
                           "pct_read_floor": round(100 * floor_us / us, 1)}
                    if bits == 8 and setting == "plan":
                        row.update(self.cublas_fp16(n, k))
                    rows.append(row)
                    log(json.dumps(row))
                self.release(ws)
        self.results["decode_gemv"] = rows

    def read_floor_us(self, ops, ws, count: int) -> float:
        """Microseconds per launch of a kernel that only reads a weight's bytes (16-byte loads, 8 blocks of 256
        threads per SM), launched like the decode GEMV (back to back with PDL, the same rotating copies; it
        waits for its predecessor before its one store per block): the floor any M=1 GEMV of that many bytes
        has on this GPU, whatever its arithmetic."""
        cp = self.cp
        kern = cp.RawKernel(r"""
extern "C" __global__ void read_floor(const uint4* __restrict__ p, long long n, unsigned* __restrict__ out) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    unsigned acc = 0;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += step) {
        const uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicXor(out + blockIdx.x, acc);
}""", "read_floor")
        blocks = 8 * self.dev.sm_count
        out = cp.zeros(blocks, dtype=cp.uint32)
        args = [(np.uint64(w.buffer.data.ptr), np.uint64(w.geometry.nbytes // 16), np.uint64(out.data.ptr))
                for w in ws]  # numpy scalars, as forward_launch takes them
        graph = ops.capture(lambda: [ops.launch(kern, (blocks,), (256,), args[i % len(ws)]) for i in range(count)])
        us = self.replay_us(graph, count)
        del graph
        return us

    # -- 3. prefill GEMM ------------------------------------------------------------------------------

    def prefill(self) -> None:
        cp = self.cp
        m = 512
        rows = []
        total = {}
        for bits in (8, 4):
            layer_us = 0.0
            for name, (n, k) in PREFILL_LAYER.items():
                g = 32
                w = self.device_weight(n, k, g, bits, 5)
                a = cp.asarray(np.random.default_rng(0).integers(-127, 128, (m, k), dtype=np.int8))
                s = cp.asarray(np.random.default_rng(1).uniform(0.001, 0.01, (m, k // g)).astype(np.float32))
                out = cp.empty((m, n), dtype=cp.float32)
                us, mode = self.graph_time_us(lambda i: self.dev.gemm.q8(a, s, w, out, n, self.stream), 10)
                tops = 2 * m * n * k / (us * 1e-6) / 1e12
                row = {"gemm": name, "M": m, "N": n, "K": k, "bits": bits, "us": round(us, 1),
                       "tops": round(tops, 1)}
                if bits == 8:
                    a16 = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
                    b16 = cp.random.standard_normal((k, n), dtype=cp.float32).astype(cp.float16)
                    o16 = cp.empty((m, n), dtype=cp.float16)
                    us16, _ = self.graph_time_us(lambda i: cp.matmul(a16, b16, out=o16), 10)
                    row["cublas_fp16_us"] = round(us16, 1)
                self.release([w])
                layer_us += us
                rows.append(row)
                log(json.dumps(row))
            # lm_head runs on the last prompt token only (M=1): timed in the GEMV table, add it here
            lm = next((r["us"] for r in self.results.get("gemv", []) if r["shape"] == "lm_head"
                       and r["bits"] == 8 and r["G"] == 32), 0.0)
            total[bits] = LAYERS * layer_us + lm
        self.results["prefill"] = rows
        self.results["prefill_512_gemm_ms"] = {f"q{b}": round(v / 1000, 2) for b, v in total.items()}
        self.results["prefill_512_gemm_only_tok_s"] = {f"q{b}": round(512 / (v * 1e-6)) for b, v in total.items()}

    # -- 4. activation quantization ------------------------------------------------------------------

    def quantize(self) -> None:
        cp = self.cp
        out = {}
        for m, k in ((1, 4096), (512, 4096), (512, 12288)):
            x = cp.random.standard_normal((m, k), dtype=cp.float32)
            c = cp.empty((m, k), dtype=cp.int8)
            sc = cp.empty((m, k // 32), dtype=cp.float32)
            us, _ = self.graph_time_us(lambda i: self.dev.gemm.quantize(x, 32, c, sc, self.stream), 50)
            out[f"M{m}xK{k}"] = round(us, 2)
        self.results["quantize_us"] = out
        log("quantize us:", out)

    # -- 5. crossover: hook (transfers included) vs the CPU backend ------------------------------------

    def crossover(self) -> None:
        from kestrel_core.contract import quantize_activations, quantize_weight
        from kestrel_core.registry import Registry
        from kestrel_core.wkey import Proj, wkey

        cpu = Registry().cpu()
        rng = np.random.default_rng(0)
        rows = []
        for m in (1, 8, 64):
            for size in (64, 128, 256, 512, 1024, 2048, 4096):
                w = quantize_weight(rng.standard_normal((size, size)).astype(np.float32), 8, 32)
                a_codes, a_scales = quantize_activations(rng.standard_normal((m, size)).astype(np.float32), 32)
                key = wkey(5000 + size, Proj.O)
                self.dev.gemm_q8(a_codes, a_scales, w, key)  # upload once: the weights stay resident

                def best(fn, reps: int = 15) -> float:
                    fn()
                    ts = []
                    for _ in range(reps):
                        t = time.perf_counter()
                        fn()
                        ts.append(time.perf_counter() - t)
                    return statistics.median(ts) * 1e6

                gpu = best(lambda: self.dev.gemm_q8(a_codes, a_scales, w, key))
                cpu_us = best(lambda: cpu.hook.kestrel_gemm_q8(device=cpu.device, a_codes=a_codes,
                                                               a_scales=a_scales, weight=w, wkey=key))
                rows.append({"M": m, "N=K": size, "flops": 2 * m * size * size, "gpu_hook_us": round(gpu, 1),
                             "cpu_us": round(cpu_us, 1)})
        rows.sort(key=lambda r: r["flops"])
        # the threshold: the smallest FLOPs from which the GPU hook wins at every larger measured size
        threshold = None
        for i, r in enumerate(rows):
            if all(x["gpu_hook_us"] < x["cpu_us"] for x in rows[i:]):
                threshold = r["flops"]
                break
        self.results["crossover"] = rows
        self.results["crossover_min_flops"] = threshold
        for r in rows:
            log(json.dumps(r))
        log("crossover min flops:", threshold)

    # -- 6. preload of the qwen3-8b preset -----------------------------------------------------------

    def preload(self) -> None:
        from kestrel_core.model.presets import preset_model

        for quant in ("q8", "q4"):
            t0 = time.perf_counter()
            model = preset_model("qwen3-8b", quant)
            build_s = time.perf_counter() - t0
            self.dev.cache.clear()
            self.dev.preload(model)
            info = dict(self.dev.preload_info)
            info.update(model_build_s=round(build_s, 2), weights_gb=round(model.nbytes / 1e9, 2))
            self.results[f"preload_{quant}"] = info
            log(f"preload {quant}:", info)
            self.dev.cache.clear()
            del model


def table(res: dict[str, Any]) -> None:
    log("\n== CUDA benchmark summary ==")
    log(f"device {res['device']}; copy {res.get('copy_tb_s')} TB/s; kernel compile {res['kernel_compile_s']} s")
    log(f"{'shape':8} {'N':>6} {'K':>6} {'q':>6} {'us':>8} {'TB/s':>6} {'%copy':>6} {'cuBLAS16 us':>11} "
        f"{'speedup':>7}")
    for r in res.get("gemv", []):
        cb = r.get("cublas_fp16_us")
        sp = f"{cb / r['us']:.2f}x" if cb else ""
        others = " ".join(f"{k[3:]}={v}" for k, v in r.items() if k.startswith("us_"))
        log(f"{r['shape']:8} {r['N']:>6} {r['K']:>6} {('q' + str(r['bits']) + '/' + str(r['G'])):>6} "
            f"{r['us']:>8.2f} {r['tb_s']:>6.2f} {r['pct_copy']:>6.1f} {cb if cb else '':>11} {sp:>7} {others}")
    for r in res.get("prefill", []):
        log(f"prefill {r['gemm']:8} M{r['M']} N{r['N']} K{r['K']} q{r['bits']}: {r['us']} us, {r['tops']} TOPS"
            + (f" (cuBLAS fp16 {r['cublas_fp16_us']} us)" if "cublas_fp16_us" in r else ""))
    if "prefill_512_gemm_ms" in res:
        log(f"512-token prefill, all GEMMs: {res['prefill_512_gemm_ms']} ms -> "
            f"{res['prefill_512_gemm_only_tok_s']} tok/s (GEMMs only)")
    if "quantize_us" in res:
        log(f"activation quantize: {res['quantize_us']} us")
    if "crossover_min_flops" in res:
        log(f"hook crossover (transfers included) min FLOPs: {res['crossover_min_flops']}")
    for q in ("q8", "q4"):
        if f"preload_{q}" in res:
            log(f"preload qwen3-8b {q}: {res[f'preload_{q}']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-preload", action="store_true")
    p.add_argument("--no-crossover", action="store_true")
    p.add_argument("--decode-only", action="store_true", help="the copy and the whole-step decode GEMV only")
    p.add_argument("--splits", default="plan", help='decode GEMV K splits to measure, e.g. "plan,8,8c,16"')
    p.add_argument("--shapes", default="", help='decode GEMV shapes "name=N:K,..." (default: Qwen3-8B\'s)')
    args = p.parse_args(argv)
    b = Bench(args)
    bw = b.copy_bandwidth()
    if args.decode_only:
        b.decode_gemv(bw)
        b.save(args.json)
        b.dev.close()
        return 0
    steps = [("copy", None), ("gemv", None), ("decode_gemv", None), ("prefill", None), ("quantize", None)]
    for name, _ in steps[1:]:
        try:
            b.gemv(bw) if name == "gemv" else b.decode_gemv(bw) if name == "decode_gemv" else getattr(b, name)()
        except Exception as exc:  # keep the other measurements
            log(f"{name} failed: {type(exc).__name__}: {exc}")
            b.results[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
    for name, skip in (("crossover", args.no_crossover), ("preload", args.no_preload)):
        if skip:
            continue
        try:
            getattr(b, name)()
        except Exception as exc:
            log(f"{name} failed: {type(exc).__name__}: {exc}")
            b.results[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
    b.save(args.json)
    table(b.results)
    b.dev.close()
    return 0


if __name__ == "__main__":
    require_cuda()
    sys.exit(main())
