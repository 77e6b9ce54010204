"""A persistent chain of decode GEMVs (cuda_gemv_chain.cu) against the decode step's per-launch GEMV, one run.

    python benchmarks/cuda_gemv_chain.py [--kernel chain|ctl] [--shapes o:8,o:4,q|k|v:8,q|k|v:4]
                                         [--clusters 4,8] [--depths 2,4] [--max-clusters N] [--stages 8,40]
                                         [--timeline] [--no-baseline] [--json F]

The experiment behind issue 4's last goal (decode GEMV >= 80 % of the copy bandwidth for o and the int4
q|k|v). Each stage is one M = 1 GEMV of the shape (int8 or int4, G = 32) whose input is the RMSNorm of the
previous stage's first K outputs (the same full dependency as o -> gate|up or down -> q|k|v in the decode
step), with no kernel boundary between stages (see the .cu file). Stages rotate over weight copies four
times the L2, so they stream from device memory. Per stage time = (time of a chain of S2 stages - time of S1)
/ (S2 - S1), so the launch and the first stage's ramp cancel. Before the timing, one launch is checked: the
first three stages' outputs against numpy from the previous stage's output (the contract's activation
quantization, int64 block sums), and every stage's outputs for this launch's tag. docs/performance.md ("Ninth
session") has the results: slower than the per-launch GEMV on every shape.

In the same process: the copy bandwidth and, unless --no-baseline, cuda_gemv.py --decode-only (the decode
step's qgemv per shape, back to back with PDL).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from cuda_gemv import DECODE_SHAPES, Bench, log

HERE = Path(__file__).resolve().parent
KC, TN, EPS = 256, 128, 1e-6
DESC_WORDS = 12  # ChainStage in cuda_gemv_chain.cu


def compile_chain(cp: Any) -> dict[tuple[str, int], Any]:
    from kestrel_cuda.forward_ops import FORWARD_OPTIONS, forward_source

    code = forward_source() + "\n" + (HERE / "cuda_gemv_chain.cu").read_text()
    names = {(kind, bits): f"{fn}<{bits}>" for kind, fn in (("chain", "gemv_chain"), ("ctl", "gemv_chain_ctl"))
             for bits in (8, 4)}
    mod = cp.RawModule(code=code, options=FORWARD_OPTIONS, name_expressions=tuple(names.values()))
    return {key: mod.get_function(name) for key, name in names.items()}


def slot_bytes(bits: int) -> int:
    return KC * TN * bits // 8 + KC // 32 * TN * 4


def max_active_clusters(kernel: Any, cluster: int, smem: int, sm_count: int) -> int:
    """cuOccupancyMaxActiveClusters for ``cluster`` blocks of 256 threads with ``smem`` dynamic bytes."""
    from kestrel_cuda.forward_launch import CLUSTER_DIMENSION, _LaunchAttr, _LaunchConfig

    lib = ctypes.CDLL("libcuda.so.1")
    attrs = (_LaunchAttr * 1)()
    attrs[0].id = CLUSTER_DIMENSION
    attrs[0].value[0], attrs[0].value[1], attrs[0].value[2] = cluster, 1, 1
    cfg = _LaunchConfig(sm_count // cluster * cluster, 1, 1, 256, 1, 1, smem, None, attrs, 1)
    n = ctypes.c_int(0)
    err = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(kernel.kernel.ptr), ctypes.byref(cfg))
    if err != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed with CUresult {err}")
    return n.value


TMAP_UINT8, TMAP_UINT32, TMAP_FLOAT32 = 0, 2, 7  # CUtensorMapDataType
TMAP_L2_256B = 3  # CUtensorMapL2promotion


def encode_tmap(dtype: int, base: int, inner: int, rows: int, row_bytes: int, box_inner: int,
                box_rows: int) -> bytes:
    """A 2-D CUtensorMap (128 bytes) of ``rows`` rows of ``inner`` elements, ``row_bytes`` apart, boxes of
    ``box_inner`` x ``box_rows``, no swizzle (the box lands dense, row after row)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    raw = (ctypes.c_uint8 * 256)()
    at = (ctypes.addressof(raw) + 63) // 64 * 64
    dims = (ctypes.c_uint64 * 2)(inner, rows)
    strides = (ctypes.c_uint64 * 1)(row_bytes)
    box = (ctypes.c_uint32 * 2)(box_inner, box_rows)
    estr = (ctypes.c_uint32 * 2)(1, 1)
    err = fn(ctypes.c_void_p(at), ctypes.c_int(dtype), ctypes.c_uint(2), ctypes.c_void_p(base), dims, strides, box,
             estr, ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(TMAP_L2_256B), ctypes.c_int(0))
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err}")
    return ctypes.string_at(at, 128)


def weight_tmaps(w: Any, k: int) -> bytes:
    """The codes' and the scales' tensor maps of one device weight (cuda_gemv_chain.cu chain_issue's boxes)."""
    g = w.geometry
    if g.code_bits == 8:
        codes = encode_tmap(TMAP_UINT8, w.codes.data.ptr, g.npad, k, g.npad, TN, KC)
    else:
        codes = encode_tmap(TMAP_UINT32, w.codes.data.ptr, g.npad, k // 8, 4 * g.npad, TN, KC // 8)
    return codes + encode_tmap(TMAP_FLOAT32, w.scales.data.ptr, g.npad, k // 32, 4 * g.npad, TN, KC // 32)


def tagged(cp: Any, values: Any, tag: int) -> Any:
    return (cp.uint64(tag) << cp.uint64(32)) | values.astype(cp.float32).view(cp.uint32).astype(cp.uint64)


def untag(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    low = (words & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return (words >> np.uint64(32)).astype(np.uint32), low.view(np.float32)


def host_codes(w: Any, k: int, n: int) -> np.ndarray:
    """The weight's codes as int64 [K][N], from qgemv's layout (int4: 8-k words, +8 offset)."""
    g = w.geometry
    raw = w.codes.get()
    if g.code_bits == 8:
        return raw.reshape(k, g.npad)[:, :n].astype(np.int64)
    words = raw.view(np.uint32).reshape(k // 8, g.npad)[:, :n]
    out = np.empty((k, n), dtype=np.int64)
    for j in range(4):
        byte = (words >> np.uint32(8 * j)) & np.uint32(0xFF)
        out[j::8] = (byte & 0xF).astype(np.int64) - 8
        out[4 + j::8] = (byte >> 4).astype(np.int64) - 8
    return out


def reference_stage(x: np.ndarray, ssq: np.ndarray, pw: np.ndarray, codes: np.ndarray,
                    scales: np.ndarray) -> np.ndarray:
    """y = W rmsnorm(x) as the kernel defines it: the norm from the per-32 sums of squares, the activations
    quantized per 32 (half away from zero), exact integer block sums, float64 after that."""
    k = x.shape[0]
    r = np.sqrt(np.float32(ssq.astype(np.float32).sum(dtype=np.float32)) / np.float32(k) + np.float32(EPS))
    v = (x / r * pw).astype(np.float32).reshape(-1, 32)
    d = (np.abs(v).max(axis=1) / np.float32(127)).astype(np.float32)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    t = v * inv[:, None]
    q = (np.sign(t) * np.floor(np.abs(t) + 0.5)).astype(np.int64)  # roundf
    blocks = np.einsum("gk,gkn->gn", q, codes.reshape(-1, 32, codes.shape[1]))  # [K/32, N], exact
    return (blocks.astype(np.float64) * d[:, None].astype(np.float64) * scales.astype(np.float64)).sum(axis=0)


class Chain:
    """One shape's chain: weight copies, per-stage tagged outputs, descriptors; launches and checks."""

    def __init__(self, bench: Bench, kernel: Any, kind: str, n: int, k: int, bits: int, stages: int) -> None:
        from kestrel_cuda.forward_launch import ExLauncher

        cp = bench.cp
        self.cp, self.bench, self.n, self.k, self.bits = cp, bench, n, k, bits
        self.cluster = 1  # blocks per cluster: set before each launch
        self.launcher = ExLauncher()
        if k > 4096 or n < k:
            raise ValueError(f"shape {n}x{k} outside the prototype's limits (K <= 4096, N >= K)")
        self.kernel = kernel
        self.kernel_kind = kind
        self.ws = bench.weight_copies(n, k, 32, bits)
        self.stage_bytes = self.ws[0].geometry.nbytes
        self.stages = stages
        rng = np.random.default_rng(3)
        self.pw = cp.asarray(rng.uniform(0.5, 1.5, k).astype(np.float32))
        x0 = rng.standard_normal(k).astype(np.float32)
        self.x0 = cp.asarray(x0)
        self.x0ssq = cp.asarray((x0.reshape(-1, 32) ** 2).sum(axis=1).astype(np.float32))
        self.xw = cp.zeros(k, dtype=cp.uint64)
        self.xq = cp.zeros(k // 32, dtype=cp.uint64)
        self.y = cp.zeros((stages, n), dtype=cp.uint64)
        self.yq = cp.zeros((stages, n // 32), dtype=cp.uint64)
        self.err = cp.zeros(1, dtype=cp.int32)
        self.count = cp.zeros(stages, dtype=cp.int32)  # merged tiles per stage (zeroed per launch)
        maps = b"".join(weight_tmaps(w, k) for w in self.ws)
        self.tmaps = cp.asarray(np.frombuffer(maps, dtype=np.uint8))  # 256 bytes a copy: codes, scales
        desc = np.zeros((stages, DESC_WORDS), dtype=np.int64)
        for s in range(stages):
            w = self.ws[s % len(self.ws)]
            x = self.xw.data.ptr if s == 0 else self.y[s - 1].data.ptr
            xq = self.xq.data.ptr if s == 0 else self.yq[s - 1].data.ptr
            desc[s] = [w.codes.data.ptr, w.scales.data.ptr, self.pw.data.ptr, x, xq, self.y[s].data.ptr,
                       self.yq[s].data.ptr, n, k, w.geometry.npad, self.tmaps.data.ptr + 256 * (s % len(self.ws)),
                       self.tmaps.data.ptr + 256 * (s % len(self.ws)) + 128]
        self.desc = cp.asarray(desc)
        self.base = 0

    def prepare(self) -> None:
        """New tags for the chain's input (outputs of an earlier launch never match) and zeroed counters."""
        cp = self.cp
        self.base += 1 << 10
        with self.bench.stream:
            self.xw[...] = tagged(cp, self.x0, self.base)
            self.xq[...] = tagged(cp, self.x0ssq, self.base)
            self.count.fill(0)

    def launch(self, nstages: int, depth: int, clusters: int, stamps: Any = None) -> None:
        """One chain of ``nstages`` stages, after ``prepare``."""
        smem = depth * slot_bytes(self.bits) + 128
        self.launcher.launch(self.kernel, (clusters * self.cluster,), (256,),
                             (np.uint64(self.desc.data.ptr), np.int32(nstages), np.int32(depth),
                              np.int32(self.base), np.float32(EPS), np.uint64(self.count.data.ptr),
                              np.uint64(self.err.data.ptr), np.uint64(0 if stamps is None else stamps.data.ptr)),
                             smem, self.bench.stream, pdl=False, cluster=(self.cluster, 1, 1))

    def time_us(self, nstages: int, depth: int, clusters: int, reps: int = 7) -> float:
        """Median microseconds of one launch (its preparation done and finished before the start event)."""
        cp, s = self.cp, self.bench.stream
        self.prepare()
        self.launch(nstages, depth, clusters)
        s.synchronize()
        times = []
        for _ in range(reps):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            self.prepare()
            s.synchronize()
            start.record(s)
            self.launch(nstages, depth, clusters)
            end.record(s)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0)
        return statistics.median(times)

    def check(self, nstages: int, depth: int, clusters: int, stages_checked: int = 3) -> dict[str, Any]:
        """Launch once and compare stages 0 .. stages_checked - 1 with numpy; every tag must be this launch's."""
        self.prepare()
        self.launch(nstages, depth, clusters)
        self.bench.stream.synchronize()
        err = int(self.err.get()[0])
        tags, ys = untag(self.y[:nstages].get())
        qtags, qs = untag(self.yq[:nstages].get())
        want = self.base + 1 + np.arange(nstages, dtype=np.uint32)[:, None]
        tags_ok = bool((tags == want).all() and (qtags == want).all())
        x, xq = self.x0.get(), self.x0ssq.get()
        pw = self.pw.get()
        worst = 0.0
        for s in range(min(stages_checked, nstages)):
            w = self.ws[s % len(self.ws)]
            ref = reference_stage(x, xq, pw, host_codes(w, self.k, self.n), w.scales.get()[:, :self.n])
            worst = max(worst, float(np.abs(ys[s] - ref).max() / np.abs(ref).max()))
            x, xq = ys[s][:self.k], qs[s][:self.k // 32]
        ok = err == 0 and tags_ok and worst < 1e-3
        return {"check_ok": ok, "timeout_flag": err, "tags_ok": tags_ok, "max_rel_err": worst}

    def timeline(self, depth: int, clusters: int) -> dict[str, Any]:
        """Medians (us) over the steady stages of one launch with stamps (cuda_gemv_chain.cu, CH_NSTAMP): the
        period (last release to last release) and, per role of block, its stage start after the previous
        stage's last release, then the intervals between its stamps: wait (for the inputs), inputs (read and
        quantized, or copied from rank 0), first_chunk (its weights landed), items (to the last tile), merge."""
        cp = self.cp
        stamps = cp.zeros((clusters * self.cluster, self.stages, 6), dtype=cp.uint64)
        self.prepare()
        self.launch(self.stages, depth, clusters, stamps)
        self.bench.stream.synchronize()
        t = stamps.get().astype(np.int64)
        t = t - t[t > 0].min()
        end = t[:, :, 4].max(axis=0)
        steady = range(2, self.stages)
        med = lambda v: round(float(np.median(v)) / 1000, 3)  # noqa: E731
        out: dict[str, Any] = {"period": med([end[s] - end[s - 1] for s in steady])}
        roles = {"all": slice(None)} if self.kernel_kind == "chain" else {
            "control": slice(0, None, self.cluster), "stream": np.arange(t.shape[0]) % self.cluster != 0}
        for role, sel in roles.items():
            r = t[sel]
            out[role] = {"start_after_release": med([r[:, s, 0] - end[s - 1] for s in steady]),
                         "wait": med([r[:, s, 1] - r[:, s, 0] for s in steady]),
                         "inputs": med([r[:, s, 5] - r[:, s, 1] for s in steady]),
                         "first_chunk": med([r[:, s, 2] - r[:, s, 5] for s in steady]),
                         "items": med([r[:, s, 3] - r[:, s, 2] for s in steady]),
                         "merge": med([r[:, s, 4] - r[:, s, 3] for s in steady])}
        return out

    def release(self) -> None:
        self.bench.release(self.ws)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="o:8,o:4,q|k|v:8,q|k|v:4")
    p.add_argument("--depths", default="2,4", help="ring slots per block at int8 (int4 slots are half the bytes: x2)")
    p.add_argument("--kernel", choices=("chain", "ctl"), default="chain",
                   help="ctl: rank 0 of each cluster reads and quantizes the inputs and merges; the others stream")
    p.add_argument("--clusters", default="4,8", help="blocks per cluster to measure")
    p.add_argument("--stages", default="8,40", help="S1,S2: the per-stage time is the slope between them")
    p.add_argument("--max-clusters", type=int, default=0, help="at most this many clusters (0: all that fit)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--timeline", action="store_true", help="also one launch with per-block stamps, analysed")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    args.splits = "plan"  # for Bench.decode_gemv
    bench = Bench(args)
    copy_bw = bench.copy_bandwidth()
    cp = bench.cp
    kernels = compile_chain(cp)
    s1, s2 = (int(v) for v in args.stages.split(","))
    rows = []
    for spec in args.shapes.split(","):
        name, bits_s = spec.rsplit(":", 1)
        bits = int(bits_s)
        n, k = DECODE_SHAPES[name]
        chain = Chain(bench, kernels[args.kernel, bits], args.kernel, n, k, bits, s2)
        for csize, d in ((int(c), int(v)) for c in args.clusters.split(",") for v in args.depths.split(",")):
            if args.kernel == "chain" and (k // KC // csize > 4 or k // KC < csize):
                continue
            if args.kernel == "ctl" and (csize < 2 or k // KC < csize - 1):
                continue
            chain.cluster = csize
            depth = d if bits == 8 else 2 * d
            smem = depth * slot_bytes(bits) + 128  # (the kernel aligns the ring to 128 bytes)
            chain.kernel.max_dynamic_shared_size_bytes = smem
            clusters = min(max_active_clusters(chain.kernel, csize, smem, bench.dev.sm_count),
                           bench.dev.sm_count // csize, args.max_clusters or 1 << 30)
            if args.kernel == "ctl" and -(-(n // TN) // clusters) > 4:  # CTL_MAXT
                continue
            row: dict[str, Any] = {"kernel": args.kernel, "shape": name, "bits": bits, "N": n, "K": k, "depth": depth,
                                   "cluster": csize, "clusters": clusters,
                                   "weight_MB": round(chain.stage_bytes / 1e6, 2)}
            row.update(chain.check(s2, depth, clusters))
            if row["timeout_flag"]:  # a block waited for an input that never came: no timing
                rows.append(row)
                log(json.dumps(row))
                continue
            t1, t2 = chain.time_us(s1, depth, clusters), chain.time_us(s2, depth, clusters)
            us = (t2 - t1) / (s2 - s1)
            bw = chain.stage_bytes / (us * 1e-6) / 1e12
            row.update({"us_per_stage": round(us, 3), "tb_s": round(bw, 3), "pct_copy": round(100 * bw / copy_bw, 1),
                        f"chain_{s1}_us": round(t1, 1), f"chain_{s2}_us": round(t2, 1)})
            if args.timeline:
                row["timeline_us"] = chain.timeline(depth, clusters)
            rows.append(row)
            log(json.dumps(row))
        chain.release()
    bench.results["chain"] = rows
    if not args.no_baseline:
        bench.decode_gemv(copy_bw)
    bench.save(args.json)
    bench.dev.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
