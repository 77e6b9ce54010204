"""Time to the first token from a Hugging Face BF16 checkpoint: uncached, building the cache, a cache hit.

    python benchmarks/hf_load.py --dir /tmp/hf8b --backend cuda          # Llama-3-8B shapes, 16 GB of BF16
    python benchmarks/hf_load.py --dir /tmp/hf --layers 2 --backend cpu  # a small smoke run

Writes a synthetic BF16 Llama directory (random bit patterns with |x| < 2, one safetensors file), then times
``kestrel_core.load(dir, backend=B)`` plus one generated token in fresh processes: with the artifact cache off
(``KESTREL_HF_CACHE=0``: read and quantize every tensor), the first cached load (quantize, write the entry,
read it back) and a cache hit. Each child reports the load, the first token and its RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import kestrel_core
engine = kestrel_core.load(sys.argv[1], backend=sys.argv[2])
t1 = time.perf_counter()
token = list(engine.generate([1, 2, 3, 4], max_tokens=1, stop_at_eos=False))
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "first_token_s": t2 - t0, "backend": engine.backend_name,
                  "maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}))
"""


def write_checkpoint(root: Path, hidden: int, inter: int, layers: int, vocab: int, heads: int, kv: int) -> int:
    """A BF16 Llama directory; returns its parameter count."""
    root.mkdir(parents=True, exist_ok=True)
    hd = hidden // heads
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(cfg))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                          "lm_head.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * hd, hidden),
                       p + "self_attn.k_proj.weight": (kv * hd, hidden),
                       p + "self_attn.v_proj.weight": (kv * hd, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * hd),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(1)
    with open(root / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for shape in shapes.values():
            n = int(np.prod(shape))
            for start in range(0, n, 1 << 26):  # 128 MB at a time
                bits = rng.integers(0, 1 << 16, min(1 << 26, n - start), dtype=np.uint16) & np.uint16(0xBFFF)
                f.write(bits.tobytes())
    return sum(int(np.prod(s)) for s in shapes.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "kestrel-hf-load")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    params = write_checkpoint(args.dir / "model", args.hidden, args.intermediate, args.layers, args.vocab, 32, 8)
    print(f"wrote {params / 1e9:.2f} B parameters of BF16 in {time.perf_counter() - t0:.1f} s", flush=True)
    home = args.dir / "home"
    out: dict[str, object] = {"params": params, "backend": args.backend}
    for label, env in (("uncached", {"KESTREL_HF_CACHE": "0"}), ("first cached", {}), ("cache hit", {})):
        run_env = {**os.environ, "KESTREL_HOME": str(home), **env}
        done = subprocess.run([sys.executable, "-c", CHILD, str(args.dir / "model"), args.backend],
                              capture_output=True, text=True, env=run_env)
        if done.returncode:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        fig = json.loads(done.stdout.strip().splitlines()[-1])
        out[label] = fig
        print(f"{label:>13}: load {fig['load_s']:.1f} s, first token at {fig['first_token_s']:.1f} s "
              f"({fig['backend']}), max RSS {fig['maxrss_gb']:.1f} GB", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
