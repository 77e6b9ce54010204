# ruff: noqa: B023  (every closure below is timed and dropped inside the loop iteration that made it)
"""Prefill GEMM benchmark (M = 512 on Qwen3-8B shapes): the tensor-core kernel in every block shape of
``kestrel_cuda.kernels.MMA_TILES`` against cuBLAS fp16, with bitwise checks on fresh random data, and the GEMM
total of one 512-token qwen3-8b prefill.

    python benchmarks/cuda_prefill.py [--json out.json] [--m 512]

At M <= SPLIT_MAX_M (decode batches: ``--m 8``) the tensor-core kernel splits K (``gemm.mma_splits``); the
table adds it without splits (``nosplit``), with the splits for other grid targets (``--split-targets``) and,
at M <= 8, the decode GEMV (``gemv``: a weight pass per row).

Timing as in ``cuda_gemv.py`` (whose helpers this reuses): CUDA events around a captured graph of many launches,
rotating over weight copies totalling >= 4x the L2, median of 7 replays. Checks: every block shape's output on
the same random operands (int8 codes over the whole range, signed scales) must equal the others of its kind
bit for bit (beyond 64 rows the unsplit ones and auto, up to 64 the split ones and auto; auto is left out
where its last rows run through the split shapes, ``gemm.split_rows``), and on one host-quantized weight per
mode every unsplit one must equal ``reference_gemm_q8`` itself (the split ones and such an auto: within a
bound for their fused scaling and re-added partial sums; ``gemv``: not checked).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cuda_gemv import L2_BYTES, LAYERS, Bench, log  # noqa: E402
from cuda_required import require_cuda  # noqa: E402

SHAPES = {  # name: (N, K); q/o, k/v, gate/up, down as in the model, qkv and gate_up as the engine fuses them
    "q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (12288, 4096), "down": (4096, 12288),
    "qkv": (6144, 4096), "gate_up": (24576, 4096),
}
LAYER = ("qkv", "q/o", "gate_up", "down")  # the GEMMs of one prefill layer as the engine runs them
LM_HEAD = (151936, 4096)  # last prompt token only: M = 1, the decode GEMV
MODES = ((8, 32), (4, 32), (8, 256))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PrefillBench(Bench):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        from kestrel_cuda import kernels

        self.tiles = list(kernels.MMA_TILES)
        self.results["tiles"] = {
            name: {"bm": t.bm, "bn": t.bn, "threads": t.threads,
                   "regs": self.dev.kernels.mma[(8, 32, name)].attributes.get("num_regs"),
                   "local_bytes": self.dev.kernels.mma[(8, 32, name)].attributes.get("local_size_bytes")}
            for name, t in kernels.MMA_TILES.items()}

    def kernels_for(self, m: int) -> dict[str, Any]:
        """label -> launch(a, s, w, out, n) for every kernel under test at M = m; the tiles and "auto" first
        (equal bit for bit), then the others."""
        from kestrel_cuda.gemm import SPLIT_MAX_M, gemv_warp_variant, mma_splits

        q8 = self.dev.gemm.q8
        ks: dict[str, Any] = {}
        for t in self.tiles:
            ks[t] = lambda a, s, w, out, n, t=t: q8(a, s, w, out, n, self.stream, mma_tile=t)
        ks["auto"] = lambda a, s, w, out, n: q8(a, s, w, out, n, self.stream)  # gemm.mma_tile_for
        if m <= SPLIT_MAX_M:
            ks["nosplit"] = lambda a, s, w, out, n: q8(a, s, w, out, n, self.stream, splits=1)
            for t in self.args.split_targets:
                ks[f"{t}/SM"] = lambda a, s, w, out, n, t=t: q8(a, s, w, out, n, self.stream, splits=mma_splits(
                    w.geometry.k, w.geometry.npad, w.geometry.group_size, self.dev.gemm.sm_count, t)[0])
        if m <= 8:
            ks["gemv"] = lambda a, s, w, out, n: q8(
                a, s, w, out, n, self.stream, variant=gemv_warp_variant(w.geometry.npad, w.geometry.code_bits))
        return ks

    def exact(self, m: int) -> list[str]:
        """The labels whose outputs are equal bit for bit (compared with the first): the unsplit block shapes
        beyond SPLIT_MAX_M rows, the split ones up to it, and "auto" unless its last rows run apart."""
        from kestrel_cuda.gemm import SPLIT_MAX_M
        from kestrel_cuda.kernels import MMA_TILES

        if m > SPLIT_MAX_M:
            return [t for t in self.tiles if not MMA_TILES[t].split] + self._auto_in_order(m)
        return [t for t in self.tiles if MMA_TILES[t].split] + ["auto"]

    def in_order(self, m: int) -> list[str]:
        """The labels that compute and add the groups' terms as the reference does (bitwise equal to
        reference_gemm_q8): the unsplit block shapes (the split ones scale with a fused multiply-add)."""
        from kestrel_cuda.gemm import SPLIT_MAX_M
        from kestrel_cuda.kernels import MMA_TILES

        unsplit = [t for t in self.tiles if not MMA_TILES[t].split]
        return [*unsplit, *self._auto_in_order(m)] if m > SPLIT_MAX_M else unsplit

    @staticmethod
    def _auto_in_order(m: int) -> list[str]:
        """["auto"] where it runs every row through an unsplit shape (gemm.split_rows: the timed shapes take
        the split shapes)."""
        from kestrel_cuda.gemm import split_rows

        return [] if split_rows(m, 4096, 4096) else ["auto"]

    def random_acts(self, m: int, k: int, g: int, seed: int) -> tuple[Any, Any]:
        cp = self.cp
        rs = cp.random.RandomState(seed)
        with self.stream:
            a = rs.randint(-128, 128, size=(m, k), dtype=cp.int32).astype(cp.int8)  # the whole int8 range
            s = (rs.uniform(1e-3, 2e-2, size=(m, k // g)) * (rs.randint(0, 2, size=(m, k // g)) * 2 - 1))
            return a, s.astype(cp.float32)

    # -- bitwise check against the CPU reference ----------------------------------------------------------

    def reference_check(self, m: int) -> None:
        with self.stream:
            self._reference_check(m)

    def _reference_check(self, m: int) -> None:
        from kestrel_core.contract import quantize_activations, quantize_weight, reference_gemm_q8
        from kestrel_core.wkey import NO_CACHE

        cp = self.cp
        rows = np.unique(np.r_[0:min(32, m), max(0, m - 32):m])  # the reference is slow on the host
        out_rows = {}
        for (bits, g), n in itertools.product(MODES, (1000, 1024)):
            # 1000: Npad % 16 == 8, the word-copy path of B (the unsplit shapes only); 1024: whole column tiles
            rng = np.random.default_rng([bits, g])
            k = 4096
            w = quantize_weight(rng.standard_normal((n, k)).astype(np.float32), bits, g)
            a_codes, a_scales = quantize_activations(rng.standard_normal((m, k)).astype(np.float32), g)
            ref = reference_gemm_q8(a_codes[rows], a_scales[rows], w)
            dw = self.dev.weight(NO_CACHE, [w])
            a, s = cp.asarray(a_codes), cp.asarray(a_scales)
            for label, launch in self.kernels_for(m).items():
                if label == "gemv" or (n % 128 and label not in self.in_order(m) and label != "auto"):
                    continue
                out = cp.full((m, n), np.nan, dtype=cp.float32)
                launch(a, s, dw, out, n)
                self.stream.synchronize()
                got = cp.asnumpy(out)[rows]
                if label not in self.in_order(m):  # K splits re-add partial sums
                    bound = 4 * np.abs(ref).max() * np.finfo(np.float32).eps * k / g  # split sums re-added
                    same = bool(np.all(np.abs(got - ref) <= bound))
                else:
                    same = bool(np.array_equal(got, ref))
                out_rows[f"q{bits}/{g} N={n} {label}"] = same
            self.dev.cache.release(dw)
        self.results["reference_check"] = out_rows
        log("reference check (bitwise vs reference_gemm_q8, rows 0-31 and M-32..M-1):", out_rows)

    # -- timing ---------------------------------------------------------------------------------------------

    def run(self, m: int) -> None:
        with self.stream:  # the device stream is non-blocking: keep every fill and copy ordered with the kernels
            self._run(m)

    def _run(self, m: int) -> None:
        cp = self.cp
        rows = []
        for bits, g in MODES:
            for name, (n, k) in SHAPES.items():
                w0 = self.device_weight(n, k, g, bits, 11)
                copies = max(2, _cdiv(4 * L2_BYTES, w0.geometry.nbytes))
                ws = [w0] + [self.device_weight(n, k, g, bits, 12 + i) for i in range(copies - 1)]
                a, s = self.random_acts(m, k, g, 7)
                count = max(2 * copies, 10)
                row: dict[str, Any] = {"shape": name, "M": m, "N": n, "K": k, "bits": bits, "G": g}
                outs = {}
                for label, launch in self.kernels_for(m).items():
                    out = cp.full((m, n), np.nan, dtype=cp.float32)
                    launch(a, s, ws[1], out, n)  # fresh random data, poisoned output
                    outs[label] = out
                    o = cp.empty((m, n), dtype=cp.float32)
                    us, _ = self.graph_time_us(lambda i: launch(a, s, ws[i % copies], o, n), count)
                    row[f"us_{label}"] = round(us, 1)
                    row[f"tops_{label}"] = round(2 * m * n * k / (us * 1e-6) / 1e12, 1)
                self.stream.synchronize()
                base = outs[self.exact(m)[0]]
                for label, out in outs.items():
                    ok = bool(cp.all(cp.isfinite(out)))
                    if label in self.exact(m):
                        ok = ok and bool(cp.array_equal(out, base))
                    row[f"same_{label}"] = ok
                if (bits, g) == (8, 32) and name in LAYER:
                    a16 = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
                    b16 = cp.random.standard_normal((k, n), dtype=cp.float32).astype(cp.float16)
                    o16 = cp.empty((m, n), dtype=cp.float16)
                    us16, mode = self.graph_time_us(lambda i: cp.matmul(a16, b16, out=o16), 10)
                    row["us_cublas16"], row["cublas_mode"] = round(us16, 1), mode
                self.release(ws)
                outs.clear()
                rows.append(row)
                log(json.dumps(row))
        self.results["rows"] = rows
        totals = {}
        for bits, g in MODES:
            lm = self.lm_head_us(bits, g)
            for label in self.kernels_for(m):
                layer = sum(r[f"us_{label}"] for r in rows if r["shape"] in LAYER and (r["bits"], r["G"]) == (bits, g))
                ms = (LAYERS * layer + lm) / 1000
                totals[f"q{bits}/{g} {label}"] = {"gemm_ms": round(ms, 2), "tok_s": round(m / (ms / 1000)),
                                                  "lm_head_us": round(lm, 1)}
        self.results["totals"] = totals

    def lm_head_us(self, bits: int, g: int) -> float:
        cp = self.cp
        n, k = LM_HEAD
        ws = [self.device_weight(n, k, g, bits, 40 + i) for i in range(2)]
        a, s = self.random_acts(1, k, g, 3)
        with self.stream:
            out = cp.empty((1, n), dtype=cp.float32)
        us, _ = self.graph_time_us(lambda i: self.dev.gemm.q8(a, s, ws[i % 2], out, n, self.stream), 4)
        self.release(ws)
        return us


def table(res: dict[str, Any], labels: list[str]) -> None:
    log(f"\n== GEMM (M = {res['rows'][0]['M']}), us and TOPS; ok = bitwise equal to the others of its kind (the"
        " rest: finite) ==")
    log(f"device {res['device']}; tiles {res['tiles']}")
    head = f"{'mode':7} {'shape':8} {'N':>6} {'K':>6} " + " ".join(f"{lb:>17}" for lb in labels) + "  cuBLAS16"
    log(head)
    for r in res["rows"]:
        cells = []
        for lb in labels:
            same = " ok" if r.get(f"same_{lb}") else " BAD"
            cells.append(f"{r[f'us_{lb}']:>7.1f} {r[f'tops_{lb}']:>5.1f}{same:>4}")
        log(f"q{r['bits']}/{r['G']:<4} {r['shape']:8} {r['N']:>6} {r['K']:>6} " + " ".join(f"{c:>17}" for c in cells)
            + (f"  {r['us_cublas16']}" if "us_cublas16" in r else ""))
    log(f"M = {res['rows'][0]['M']} on qwen3-8b, all GEMMs (36 x [qkv, o, gate_up, down] + lm_head GEMV at M=1):")
    for key, v in res["totals"].items():
        log(f"  {key:22} {v['gemm_ms']:>7.2f} ms  {v['tok_s']:>7} tok/s (GEMMs only)")
    if "reference_check" in res:
        log(f"reference check: {res['reference_check']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="")
    p.add_argument("--m", type=int, default=512)
    p.add_argument("--split-targets", default="", type=lambda t: [int(x) for x in t.split(",") if x],
                   help="at M <= 64: also the K splits for these blocks per SM (e.g. 2,4,6)")
    args = p.parse_args(argv)
    b = PrefillBench(args)
    b.reference_check(args.m)
    b.run(args.m)
    b.save(args.json)
    table(b.results, list(b.kernels_for(args.m)))
    b.dev.close()
    return 0


if __name__ == "__main__":
    require_cuda()
    sys.exit(main())
