"""Weight quantization speed: the numpy reference against the compiled quantizer, in the same process.

    python benchmarks/quantize_speed.py                   # 4096 x 4096 weights, then a synthetic checkpoint
    python benchmarks/quantize_speed.py --no-checkpoint --json

Part 1 quantizes one [N, K] weight per input dtype (float16, bfloat16 as raw bits, float32) to q8 and q4
at G = 32 and 256, with ``quantize_weight_reference`` (numpy) and ``quantize_weight`` (numba, row chunks on
every core), checks that both give the same bits, and reports M params/s (best of ``--repeat`` runs; the
first compiled call, which may compile or load the numba cache, is not timed).

Part 2 decodes integer checkpoints' weights (model/int_quant.py: GPTQ 4-bit with and without act-order, GPTQ
8-bit, AWQ, compressed-tensors pack-quantized) of the same [N, K] to float32, compiled and numpy, the same bits
checked, in M params/s (the quantizer then takes the float32 weight as in part 1).

Part 3 writes a synthetic Llama-shaped BF16 Hugging Face directory (random weights, no tokenizer) and times
what ``kestrel quantize DIR -o OUT`` does (``load_model`` then ``write_artifact``: read, quantize, write the
.kst) in this process, with the compiled quantizer and then with the reference swapped in, and once more as
the ``kestrel quantize`` command in a fresh process (imports and start-up included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kestrel_core import contract
from kestrel_core.contract import BFloat16Bits, StripCache, quantize_weight, quantize_weight_reference


def _bf16(w: np.ndarray) -> BFloat16Bits:
    """Round-to-nearest-even float32 -> bfloat16 bits (what torch's .to(torch.bfloat16) does)."""
    u = w.view(np.uint32).astype(np.uint64)
    return BFloat16Bits(((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16))


def _best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _same(a: StripCache, b: StripCache) -> bool:
    return np.array_equal(a.codes, b.codes) and np.array_equal(a.scales.view(np.uint32), b.scales.view(np.uint32))


def bench_weights(n: int, k: int, repeat: int, ref_repeat: int) -> list[dict[str, Any]]:
    w32 = (np.random.default_rng(0).standard_normal((n, k)) * 0.02).astype(np.float32)  # [N, K]
    inputs: dict[str, Any] = {"float16": w32.astype(np.float16), "bfloat16": _bf16(w32), "float32": w32}
    rows = []
    for dtype, w in inputs.items():
        for bits in (8, 4):
            for g in (32, 256):
                quantize_weight(w, bits, g)  # compile or load the cache
                new = _best(lambda w=w, bits=bits, g=g: quantize_weight(w, bits, g), repeat)
                old = _best(lambda w=w, bits=bits, g=g: quantize_weight_reference(w, bits, g), ref_repeat)
                same = _same(quantize_weight(w, bits, g), quantize_weight_reference(w, bits, g))
                rows.append({"dtype": dtype, "bits": bits, "group_size": g, "numpy_mps": n * k / old / 1e6,
                             "compiled_mps": n * k / new / 1e6, "speedup": old / new, "same_bits": same})
                print(f"{dtype:>8}  q{bits}  G={g:<3}  numpy {rows[-1]['numpy_mps']:7.1f} M params/s   "
                      f"compiled {rows[-1]['compiled_mps']:7.1f} M params/s   x{rows[-1]['speedup']:5.1f}   "
                      f"same bits: {same}", flush=True)
    return rows


def bench_int_decoding(n: int, k: int, repeat: int, ref_repeat: int) -> list[dict[str, Any]]:
    from kestrel_core.model import int_quant as iq

    rng = np.random.default_rng(1)
    g = 128

    def words(rows: int, cols: int) -> np.ndarray:
        return rng.integers(0, 1 << 32, (rows, cols), dtype=np.uint64).astype(np.uint32).view(np.int32)

    scales = rng.uniform(1e-3, 1e-2, (k // g, n)).astype(np.float16)  # [G, N]
    gidx = np.argsort(rng.permutation(k)) // g
    q4, q8, z4, z8 = words(k // 8, n), words(k // 4, n), words(k // g, n // 8), words(k // g, n // 4)
    awq, packed = words(k, n // 8), words(n, k // 8)
    layouts: dict[str, Callable[[], np.ndarray]] = {
        "gptq 4-bit": lambda: iq.read_gptq(q4, z4, scales, None, iq.IntScheme("gptq", 4, g, 1), "w").to_float32(),
        "gptq 4-bit act-order": lambda: iq.read_gptq(q4, z4, scales, gidx, iq.IntScheme("gptq", 4, g, 1),
                                                     "w").to_float32(),
        "gptq 8-bit": lambda: iq.read_gptq(q8, z8, scales, None, iq.IntScheme("gptq", 8, g, 1), "w").to_float32(),
        "awq": lambda: iq.read_awq(awq, z4, scales, iq.IntScheme("awq", 4, g), "w").to_float32(),
        "compressed-tensors w4": lambda: iq.read_packed(packed, np.array([n, k]), scales.T, None, None,
                                                        iq.IntScheme("compressed-tensors", 4), "w").to_float32(),
    }
    rows = []
    for name, fn in layouts.items():
        compiled_out = fn()  # compiles or loads the cache
        new = _best(fn, repeat)
        saved = dict(iq._COMPILED)
        iq._COMPILED.update({kernel: None for kernel in saved})  # the numpy definitions
        try:
            reference_out = fn()
            old = _best(fn, ref_repeat)
        finally:
            iq._COMPILED.update(saved)
        same = np.array_equal(compiled_out.view(np.uint32), reference_out.view(np.uint32))
        rows.append({"layout": name, "numpy_mps": n * k / old / 1e6, "compiled_mps": n * k / new / 1e6,
                     "speedup": old / new, "same_bits": same})
        print(f"{name:>22}  numpy {rows[-1]['numpy_mps']:7.1f} M params/s   compiled "
              f"{rows[-1]['compiled_mps']:7.1f} M params/s   x{rows[-1]['speedup']:5.1f}   same bits: {same}",
              flush=True)
    return rows


# -- a synthetic checkpoint -----------------------------------------------------------------------------

def write_checkpoint(root: Path, hidden: int, inter: int, layers: int, vocab: int, heads: int,
                     kv_heads: int) -> int:
    """A BF16 Llama directory (one safetensors file, tied embeddings); returns its parameter count."""
    root.mkdir(parents=True, exist_ok=True)
    hd = hidden // heads
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 4096, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(cfg))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * hd, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * hd),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter),
                       p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    # matrices are cut from one pool of random BF16 values at rotating offsets: drawing 7.5 B normals took 243 s
    pool = _bf16(np.random.default_rng(1).standard_normal(1 << 25, dtype=np.float32) * 0.02).raw
    ones = _bf16(np.ones(hidden, np.float32)).raw.tobytes()
    at = 0
    with open(root / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for shape in shapes.values():
            if len(shape) == 1:
                f.write(ones)
                continue
            left = int(np.prod(shape))
            while left:
                at = (at + 4099) % pool.size  # tensors do not start where another did
                chunk = pool[at:at + left]
                f.write(chunk.tobytes())
                left -= chunk.size
    return sum(int(np.prod(s)) for s in shapes.values())


def _same_artifact(a: Path, b: Path) -> bool:
    """Equal tensors (bit for bit) and metadata; the header's key order is not fixed, so bytes can differ."""
    from safetensors import safe_open

    with safe_open(str(a), framework="numpy") as fa, safe_open(str(b), framework="numpy") as fb:
        if fa.metadata() != fb.metadata() or set(fa.keys()) != set(fb.keys()):
            return False
        return all(np.array_equal(fa.get_tensor(k).view(np.uint8), fb.get_tensor(k).view(np.uint8))
                   for k in fa.keys())


def bench_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    from kestrel_core.model import quantize as quantize_module
    from kestrel_core.model.loader import load_model, write_artifact

    with tempfile.TemporaryDirectory(prefix="kestrel-qbench-") as tmp:
        root = Path(tmp) / "model"
        params = write_checkpoint(root, args.hidden, args.intermediate, args.layers, args.vocab, args.heads,
                                  args.kv_heads)
        print(f"\ncheckpoint: {params / 1e6:.1f} M params, {(root / 'model.safetensors').stat().st_size / 1e6:.0f}"
              f" MB BF16 (hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
              f"vocab {args.vocab})", flush=True)

        def quantize_to(out: Path) -> float:
            t0 = time.perf_counter()
            write_artifact(load_model(root, quant=args.quant, cache="off"), out, force=True)  # quantized each time
            return time.perf_counter() - t0

        quantize_to(Path(tmp) / "warm.kst")  # page cache and compile cache warm for both
        new = min(quantize_to(Path(tmp) / "new.kst") for _ in range(args.repeat))
        saved = quantize_module.quantize_weight
        quantize_module.quantize_weight = quantize_weight_reference
        try:
            old = quantize_to(Path(tmp) / "old.kst")
        finally:
            quantize_module.quantize_weight = saved
        same = _same_artifact(Path(tmp) / "new.kst", Path(tmp) / "old.kst")
        t0 = time.perf_counter()
        cli = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "quantize", str(root), "-o",
                              str(Path(tmp) / "cli.kst"), "--quant", args.quant], capture_output=True, text=True,
                             env={**os.environ, "KESTREL_MODEL_CACHE": "0"})
        cli_s = time.perf_counter() - t0
        result = {"params": params, "quant": args.quant, "numpy_s": old, "compiled_s": new,
                  "numpy_mps": params / old / 1e6, "compiled_mps": params / new / 1e6, "same_artifact": same,
                  "cli_s": cli_s if cli.returncode == 0 else None, "cli_error": cli.stderr.strip()[-300:] or None}
        print(f"load_model + write_artifact ({args.quant}): numpy {old:.2f} s ({result['numpy_mps']:.1f} M params/s)"
              f", compiled {new:.2f} s ({result['compiled_mps']:.1f} M params/s), same artifact: {same}")
        if cli.returncode == 0:
            print(f"kestrel quantize, a fresh process: {cli_s:.2f} s ({params / cli_s / 1e6:.1f} M params/s)")
        else:
            print(f"kestrel quantize failed: {result['cli_error']}")
        return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=5, help="timed runs of the compiled path (best is kept)")
    p.add_argument("--ref-repeat", type=int, default=2, help="timed runs of the numpy reference")
    p.add_argument("--no-checkpoint", action="store_true", help="skip the synthetic checkpoint")
    p.add_argument("--no-int", action="store_true", help="skip the integer checkpoints' decoding")
    p.add_argument("--quant", default="q8")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    print(f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, threads used: "
          f"{contract._threads()}, numpy {np.__version__}", flush=True)
    result: dict[str, Any] = {"weights": bench_weights(args.n, args.k, args.repeat, args.ref_repeat)}
    if contract._compiled_weight_kernels() is None:
        print("the compiled quantizer is unavailable: both columns are the numpy reference")
    if not args.no_int:
        result["int_decoding"] = bench_int_decoding(args.n, args.k, args.repeat, args.ref_repeat)
    if not args.no_checkpoint:
        result["checkpoint"] = bench_checkpoint(args)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
