"""Time the host pool's paged attention (``kestrel_core.model.paged_attention.attend``) on a preset's shapes.

    python benchmarks/cpu_attention.py                               # SmolLM2-135M's shapes, 2,048 positions
    python benchmarks/cpu_attention.py --preset qwen3-0.6b --context 4096 --rows 1,64 --kv-cache-type q8

Each case runs every attention layer of the model once, each layer over its own pool of float16 keys and values
(or int8 ones with their scales, ``--kv-cache-type``; random, blocks in order as a fresh pool hands them out), so
the keys and values come from DRAM as in a decode step; the rows are a decode step's (one row a sequence,
``--rows 1``) or a prompt chunk's last rows (``--rows 64``: the causal positions before the context's end). The
cache types alternate, ``--repeats`` passes each. It reports the median time a layer, the heads a work item takes
(``attend_heads``) and, for a decode step, the key and value bytes a layer reads per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kestrel_core.contract import quantize_activations
from kestrel_core.model import paged_attention
from kestrel_core.model.kv_pool import BLOCK_SIZE
from kestrel_core.model.presets import preset_config


def _pass(calls: list[tuple]) -> float:
    """Seconds a layer of one ``attend`` call per layer."""
    t = time.perf_counter()
    for call in calls:
        paged_attention.attend(*call)
    return (time.perf_counter() - t) / len(calls)


def _pool(rng: np.random.Generator, kv_type: str, blocks: int, n_kv: int, hd: int, vdp: int) -> tuple:
    """A layer's random keys and values as ``attend`` takes them (``KVPool.layer_arrays``)."""
    keys = rng.standard_normal((blocks, n_kv, BLOCK_SIZE, hd)).astype(np.float32)  # [blocks, KV, BS, hd]
    values = rng.standard_normal((blocks, n_kv, BLOCK_SIZE, vdp)).astype(np.float32)
    if kv_type == "f16":
        empty = np.zeros((0, 0, 0, 0), np.float32)
        return (np.ascontiguousarray(keys.transpose(0, 1, 3, 2)).astype(np.float16).view(np.uint16),
                values.astype(np.float16).view(np.uint16), empty, empty)
    (kc, ks), (vc, vs) = (quantize_activations(x.reshape(-1, x.shape[-1]), paged_attention.KV_GROUP)
                          for x in (keys, values))
    kc, ks = kc.reshape(keys.shape), ks.reshape(*keys.shape[:-1], -1)
    return (np.ascontiguousarray(kc.transpose(0, 1, 3, 2)), vc.reshape(values.shape),
            np.ascontiguousarray(ks.transpose(0, 1, 3, 2)), vs.reshape(*values.shape[:-1], -1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=2048, help="positions the last row sees")
    ap.add_argument("--rows", default="1,64", help="comma-separated rows a call (1: a decode step)")
    ap.add_argument("--kv-cache-type", default="f16,q8", help="comma-separated cache types, alternating")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    config = preset_config(args.preset)
    n_kv, hd, vd = config.attention_dims
    n_heads, layers = config.num_heads, len(config.attention_layers)
    blocks = -(-args.context // BLOCK_SIZE)
    rng = np.random.default_rng(0)
    kinds = args.kv_cache_type.split(",")
    pools = {kind: [_pool(rng, kind, blocks, n_kv, hd, paged_attention.padded_dims(vd)) for _ in range(layers)]
             for kind in kinds}
    print(f"{args.preset}: {layers} attention layers, {n_heads} heads / {n_kv} KV heads, key {hd} / value {vd} "
          f"dims, {args.context} positions")
    for m in (int(r) for r in args.rows.split(",")):
        q = (rng.standard_normal((m, n_heads, hd)) / np.sqrt(hd)).astype(np.float32)
        heads = paged_attention.attend_heads(m, n_heads, n_kv)
        common = (np.arange(blocks, dtype=np.int64)[None], np.zeros(m, np.int64), np.zeros(m, np.int64),
                  np.arange(args.context - m + 1, args.context + 1, dtype=np.int64), np.ones((m, hd), np.float32),
                  np.zeros((m, hd), np.float32), np.float32(0), np.full(n_heads, -np.inf, np.float32), heads,
                  np.empty((m, n_heads * vd), np.float32))
        calls = {kind: [(q, *pools[kind][layer], *common) for layer in range(layers)] for kind in kinds}
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for kind in kinds:
            _pass(calls[kind])  # compiles
        for _ in range(args.repeats):
            for kind in kinds:
                times[kind].append(_pass(calls[kind]))
        for kind in kinds:
            per_layer = statistics.median(times[kind])
            kv_bytes = sum(a.nbytes for a in pools[kind][0])
            read = f", {kv_bytes / per_layer / 1e9:.1f} GB/s of keys and values" if m == 1 else ""
            print(f"  {kind}, {m} row{'s' if m > 1 else ''} ({'decode' if m == 1 else 'prefill'}, {heads} head"
                  f"{'s' if heads > 1 else ''} an item): {per_layer * 1e6:,.0f} us a layer "
                  f"({kv_bytes / 2 ** 20:.2f} MiB){read}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
