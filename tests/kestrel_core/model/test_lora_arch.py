"""LoRA adapters named in their base's own vocabulary: PEFT modules by the base architecture's Hugging Face names,
GGUF adapters of the base's architecture only; each merged one gives the logits of the base merged by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kestrel_core

from .lora_adapters import hand_merged, peft_adapter
from .test_parity import FIXTURES

IDS = list(range(5, 37))


def logits(model: Path, lora: Path | None = None) -> np.ndarray:
    with kestrel_core.load(str(model), backend="cpu", lora=None if lora is None else str(lora)) as engine:
        return engine.logits(IDS)


@pytest.mark.parametrize(("model", "targets"), [
    ("tiny-lfm2", ["self_attn.out_proj", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"]),
    ("tiny-granite4-h", ["mamba.out_proj"]),
    ("tiny-qwen3-next", ["linear_attn.out_proj"]),
    ("tiny-qwen3_5", ["linear_attn.out_proj"]),
])
def test_a_peft_adapter_on_an_architectures_own_projection_names_is_merged(tmp_path: Path, model: str,
                                                                           targets: list[str]) -> None:
    """LFM2's out_proj and w1 / w3 / w2, the linear attention's and Mamba's out_proj are kestrel's o, gate, up and
    down: merged, they give the hand-merged base's logits bit for bit (rank 4, alpha 8: s = 2)."""
    base = FIXTURES / model
    pairs = peft_adapter(tmp_path / "adapter", base, targets)
    assert pairs
    want = logits(hand_merged(tmp_path / "merged", base, [(pairs, 2.0)]))
    np.testing.assert_array_equal(logits(base, tmp_path / "adapter"), want)
    assert not np.allclose(logits(base), want, atol=1e-3)
