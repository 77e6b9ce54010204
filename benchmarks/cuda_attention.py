"""Batched decode attention (``attn_rows``) against reads of the same bytes, on the GPU.

    python benchmarks/cuda_attention.py --rows 64 --context 640

qwen3-8b's shapes by default (32 query heads over 8 KV heads of head_dim 128, 36 layers, float16 keys and
values in a paged pool as 24 GiB of KV cache lays it out): GPU µs of every layer's attention of one decode step
of ``--rows`` sequences at position ``--context`` (``CupyOps.attention``, writing the o projection's codes as
the step does), each launch kind in a graph of its own, against two reads of the same keys and values
(cuda_attention_read.cu): page by page with attention's grid (a block per row and KV head), and as one flat
range of as many bytes, the bound at the copy speed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from cuda_e2e import _events_us
from cuda_required import require_cuda


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--pool-blocks", type=int, default=5461, help="pages of the pool (24 GiB of qwen3-8b's KV)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import cupy as cp

    from kestrel_cuda.gemm import DeviceGemm
    from kestrel_cuda.kernels import compile_kernels
    from kestrel_cuda.ops_cupy import CupyOps
    from kestrel_cuda.plan import KV_BLOCK, KV_DTYPE, Lin, head_scale

    m, h, kv, hd, layers = args.rows, args.heads, args.kv_heads, args.head_dim, args.layers
    stream = cp.cuda.Stream(non_blocking=True)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    gemm = DeviceGemm(cp, compile_kernels(cp), sms)
    gemm.workspace(stream)
    ops = CupyOps(stream, gemm)
    pages = -(-(args.context + 1) // KV_BLOCK)
    width = pages + 2  # each sequence's pages, in order, as a fresh pool hands them out
    cap = (args.pool_blocks + 1) * KV_BLOCK
    if m * width > args.pool_blocks:
        raise SystemExit(f"{m} sequences of {args.context} positions need more than {args.pool_blocks} pages")
    pool = cp.zeros((layers, 2, kv, cap, hd), KV_DTYPE)
    with stream:
        used = m * width * KV_BLOCK
        for layer in range(layers):
            pool[layer, :, :, :used] = cp.random.standard_normal((2, kv, used, hd), np.float32).astype(KV_DTYPE)
        tables = cp.arange(m * width, dtype=cp.int32).reshape(m, width)
        rows = cp.asarray(np.array([[args.context, i] for i in range(m)], np.int32))
        q = cp.random.standard_normal((m, h * hd), np.float32)
        out = cp.zeros((m, h * hd), np.float32)
    o_proj = Lin(None, None, h * hd, 4096, 4096, 32, 8)
    scale = head_scale(hd)

    def attention() -> None:
        for layer in range(layers):
            ops.attention(q, pool[layer, 0], pool[layer, 1], h, hd, scale, None, out, rows, tables,
                          quantize_for=o_proj)

    module = cp.RawModule(code=(Path(__file__).parent / "cuda_attention_read.cu").read_text())
    page_read, flat_read = module.get_function("page_read"), module.get_function("flat_read")
    sink = cp.zeros(1, np.uint32)
    head16, page16 = cap * hd * 2 // 16, KV_BLOCK * hd * 2 // 16
    attn_bytes = layers * 2 * kv * m * (args.context + 1) * hd * 2

    def pages_read() -> None:
        for layer in range(layers):
            page_read((kv, m), (256,), (pool[layer, 0], pool[layer, 1], np.int64(head16), tables, np.int32(width),
                                         np.int32(pages), np.int32(page16), sink))

    def flat() -> None:
        for layer in range(layers):
            flat_read((8 * sms,), (256,), (pool[layer], np.int64(attn_bytes // layers // 16), sink))

    results = {}
    for name, body, nbytes in (("attn_rows", attention, attn_bytes),
                               ("page_read", pages_read, layers * 2 * kv * m * pages * page16 * 16),
                               ("flat_read", flat, attn_bytes)):
        with stream:
            body()
        stream.synchronize()
        graph = ops.capture(body)
        us = _events_us(cp, stream, graph, args.reps)
        results[name] = {"us": round(us, 1), "tb_s": round(nbytes / us / 1e6, 2)}
    print(f"{m} rows at position {args.context}, {layers} layers: {attn_bytes / 1e9:.2f} GB of keys and values")
    for name, r in results.items():
        print(f"  {name:10s} {r['us']:9.1f} us  {r['tb_s']:5.2f} TB/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    require_cuda()
    raise SystemExit(main())
