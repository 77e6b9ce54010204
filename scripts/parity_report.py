"""Print the logits-parity table (kestrel vs transformers golden data) that docs/parity.md shows.

    python scripts/parity_report.py                 # every fixture and mode, SmolLM2 if pulled
    python scripts/parity_report.py --no-default-model
    python scripts/parity_report.py --backend cuda  # the same golden data through another backend
    python scripts/parity_report.py --kv-cache-type q8  # an int8 KV cache, on the fixtures that can hold one
    python scripts/parity_report.py --models tiny-qwen3-awq,tiny-qwen3-gptq --modes q8

The figures are measured by the parity tests' own ``measure`` (tests/kestrel_core/model/parity.py, imported
from the file, so the table and the tests cannot disagree on what they compute), on the CPU backend unless
``--backend`` names another (the limits printed are the CPU tests' limits).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARITY_FILE = ROOT / "tests" / "kestrel_core" / "model" / "parity.py"


def _parity_module():  # noqa: ANN202 (a module loaded from a file path)
    spec = importlib.util.spec_from_file_location("kestrel_test_parity", PARITY_FILE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-default-model", action="store_true", help="skip SmolLM2 even if it was pulled")
    ap.add_argument("--backend", default="cpu", help="backend to measure (default cpu, as the tests)")
    ap.add_argument("--modes", default="", help="only these quant modes (comma-separated)")
    ap.add_argument("--models", default="", help="only these fixtures (comma-separated names)")
    ap.add_argument("--kv-cache-type", default="f16", choices=("f16", "q8"),
                    help="what the KV cache holds (q8: the fixtures whose dims come in blocks of 32, KV_INT8)")
    args = ap.parse_args(argv)
    tp = _parity_module()
    rows = ["| model | quant | positions | top-1 agreement | max rel. error | median rel. error | limits "
            "(top-1 >=, max <=, median <=) | within |",
            "|---|---|---|---|---|---|---|---|"]
    for case in tp.CASES:
        if args.models and case.name not in args.models.split(","):
            continue
        if args.kv_cache_type == "q8" and case.name not in tp.KV_INT8:
            continue
        if case.default_model:
            if args.no_default_model:
                continue
            from kestrel_core.model.pull import default_model_path

            if not default_model_path().exists():
                print(f"note: {case.name} skipped: the default model is not pulled (`kestrel pull`)",
                      file=sys.stderr)
                continue
        for quant in case.modes:
            if args.modes and quant not in args.modes.split(","):
                continue
            fig = tp.measure(case, quant, args.backend, kv_cache_type=args.kv_cache_type)
            lim = case.limits(quant)
            rows.append(f"| {case.name} | {quant} | {fig.positions} | {fig.top1:.3f} | {fig.max_rel:.4f} | "
                        f"{fig.median_rel:.4f} | {lim.top1_min}, {lim.max_rel_max}, {lim.median_rel_max} | "
                        f"{'yes' if fig.within(lim) else 'NO'} |")
            print(rows[-1], file=sys.stderr)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
