"""Build the sampling fixture: transformers' logits processors on seeded random logits.

Needs torch and transformers (the test that reads the output does not). Run from the repository root:

    python scripts/make_sampling_golden.py

Writes tests/kestrel_core/model/data/sampling_golden.json: for each case the logits, the prompt's and the
generated token ids, the parameters, and the probabilities transformers samples from after its repetition
penalty, temperature, top-k, top-p and min-p (in the order ``generate`` applies them), 0 for a removed token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

OUT = Path(__file__).resolve().parents[1] / "tests" / "kestrel_core" / "model" / "data" / "sampling_golden.json"

# (vocab, temperature, top_k, top_p, min_p, repetition_penalty): each sampler alone, then together as models
# recommend them (Qwen3: 0.6 / 20 / 0.95; Qwen2.5: 0.7 / 20 / 0.8 with a repetition penalty of 1.05)
CASES = [
    (64, 1.0, 0, 1.0, 0.1, 1.0),
    (64, 0.7, 0, 1.0, 0.05, 1.0),
    (64, 1.0, 0, 1.0, 0.0, 1.3),
    (64, 1.0, 0, 1.0, 0.0, 0.8),
    (1000, 0.6, 20, 0.95, 0.0, 1.0),
    (1000, 0.7, 20, 0.8, 0.0, 1.05),
    (1000, 0.8, 40, 0.9, 0.05, 1.1),
    (1000, 1.5, 0, 0.9, 0.2, 1.2),
]


def main() -> None:
    rng = np.random.default_rng(7)
    cases = []
    for vocab, temperature, top_k, top_p, min_p, penalty in CASES:
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)  # [V], both signs
        prompt = rng.choice(vocab, 12).tolist()  # repeats included
        generated = rng.choice(vocab, 6).tolist()
        processors = LogitsProcessorList()
        if penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(penalty))
        processors.append(TemperatureLogitsWarper(temperature))
        if top_k:
            processors.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
        if min_p:
            processors.append(MinPLogitsWarper(min_p))
        ids = torch.tensor([prompt + generated])
        scores = processors(ids, torch.from_numpy(logits.copy())[None, :])
        probs = torch.softmax(scores.double(), dim=-1)[0].numpy()
        cases.append({"logits": logits.tolist(), "prompt": prompt, "generated": generated,
                      "params": {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                                 "repetition_penalty": penalty},
                      "probs": probs.tolist()})
    OUT.write_text(json.dumps({"transformers": transformers.__version__, "cases": cases}) + "\n")
    print(f"wrote {OUT} ({len(cases)} cases)")


if __name__ == "__main__":
    main()
