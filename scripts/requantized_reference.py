"""transformers' own top-1 agreement with its golden logits when it runs on kestrel's re-quantized weights.

Needs torch, transformers and accelerate (as scripts/make_golden.py). It loads SmolLM2-135M-Instruct.Q4_1.gguf
in transformers (float32, eager attention), measures the top-1 agreement of its logits with the committed
golden data (tests/fixtures/models/smollm2), then replaces every Linear weight and the embedding by what
kestrel's ``quantize_weight`` makes of it (``--quant``: q8 or q4, G = 32) and measures again. The second figure
is what an exact engine on kestrel's weights would reach: the part of the disagreement that comes from the
weights, not from the engine's arithmetic.

    python scripts/requantized_reference.py                 # q8
    python scripts/requantized_reference.py --quant q4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from kestrel_core.contract import quantize_weight
from kestrel_core.model.pull import default_model_path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "fixtures" / "models" / "smollm2" / "golden.npz"


def top1(model: torch.nn.Module, ids: np.ndarray, golden_top: np.ndarray) -> float:
    with torch.no_grad():
        logits = model(torch.from_numpy(ids[None])).logits[0].numpy()  # [T, V]
    return float((logits.argmax(-1) == golden_top).mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", choices=("q8", "q4"), default="q8")
    args = ap.parse_args()
    bits = 8 if args.quant == "q8" else 4
    gguf = default_model_path()
    golden = np.load(GOLDEN)
    ids, golden_top = golden["ids"], golden["top_ids"][:, 0]
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    exact = top1(model, ids, golden_top)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight.detach().numpy().astype(np.float32)
                module.weight.copy_(torch.from_numpy(quantize_weight(w, bits=bits, group_size=32).dequantize()))
        emb = model.model.embed_tokens.weight  # tied: lm_head too; kestrel keeps both at 8 bits
        emb.copy_(torch.from_numpy(quantize_weight(emb.detach().numpy(), bits=8, group_size=32).dequantize()))
    requantized = top1(model, ids, golden_top)
    print(f"transformers, float32, on the GGUF's weights: top-1 {exact:.3f} ({len(ids)} positions)")
    print(f"transformers, float32, on kestrel's {args.quant} weights: top-1 {requantized:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
