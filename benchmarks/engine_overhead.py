"""Host time per decoded token that is not the backend's: the engine loop, the dispatcher, the hook call and
greedy sampling, measured with a backend whose whole-step forward returns fixed logits at once.

    python benchmarks/engine_overhead.py [--preset qwen3-8b] [--tokens 512] [--runs 3]
    python benchmarks/engine_overhead.py --concurrency 32,64 [--profile]

``--concurrency``: the scheduler's batched steps instead (``kestrel bench --concurrency``, 16-token prompts):
the host's time per step of N rows, whose greedy tokens the stub hands over as the CUDA backend does (token
ids; logits as views of one array where a request needs them); ``--profile`` adds the top entries of a
cProfile of the largest level.

The stub backend is written to a temporary directory and bound through KESTREL_BACKEND_PATH, like any third
party backend; the preset keeps its vocabulary (the logits' size) but one layer, since no weight is read.
Subtract this from a backend's `kestrel bench` time per token to see what its own forward costs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

STUB = '''
import numpy as np
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_gemm_q8, kestrel_open  # noqa: F401

LOGITS = {}


@hookimpl
def kestrel_backend_info():
    return BackendInfo("stub_forward", "1", API_VERSION, "gpu")


@hookimpl
def kestrel_forward(device, model, seq_id, tokens, start, all_logits):
    vocab = model.config.vocab_size
    if vocab not in LOGITS:
        LOGITS[vocab] = np.random.default_rng(0).standard_normal((1, vocab)).astype(np.float32)
    return LOGITS[vocab].copy()  # a device backend hands over a fresh host array too


ROWS = {}


@hookimpl
def kestrel_forward_batch(device, model, batch):
    vocab, total = model.config.vocab_size, sum(e.logit_rows for e in batch)
    if ROWS.get(vocab, np.empty((0, 0))).shape[0] < total:
        ROWS[vocab] = np.random.default_rng(0).standard_normal((total, vocab)).astype(np.float32)
    outs, at = [], 0
    for e in batch:  # views of one array, like the CUDA backend's pinned download; greedy ones get token ids
        rows = ROWS[vocab][at:at + e.logit_rows]
        outs.append(np.full(e.logit_rows, 7, np.int64) if e.argmax_only else rows)
        at += e.logit_rows
    return outs
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", default="", help="batched steps at these levels (e.g. 32,64)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "stub_forward.py").write_text(STUB, encoding="utf-8")
        os.environ["KESTREL_BACKEND_PATH"] = tmp
        from kestrel_core.model.bench import run_bench
        from kestrel_core.model.engine_load import load_preset

        engine = load_preset(args.preset, backend="stub_forward", quant="q8", num_layers=1)
        if args.concurrency:
            return _batched(engine, [int(x) for x in args.concurrency.split(",")], args)
        result = run_bench(engine, prompt_tokens=16, decode_tokens=args.tokens, runs=args.runs)
    per_token = [1e6 / r for r in result.decode_tok_s_runs]
    print(f"{args.preset} (vocabulary {engine.config.vocab_size}): engine + dispatch + sampling "
          f"{1e6 / result.decode_tok_s:.1f} us per token (median of {args.runs}; runs "
          f"{', '.join(f'{t:.1f}' for t in per_token)})")
    return 0


def _batched(engine, levels: list[int], args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    import cProfile
    import pstats

    from kestrel_core.model.bench import run_concurrency_bench

    prof = cProfile.Profile() if args.profile else None
    for level in levels:
        if prof is not None and level == max(levels):
            prof.enable()
        result = run_concurrency_bench(engine, [level], prompt_tokens=16, decode_tokens=args.tokens)
        if prof is not None and level == max(levels):
            prof.disable()
        r = result.levels[0]
        print(f"{args.preset} (vocabulary {engine.config.vocab_size}), {level} streams: host "
              f"{level / r.decode_tok_s * 1e3:.2f} ms per step ({r.decode_tok_s:.0f} tok/s at most)", flush=True)
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    sys.exit(main())
