"""Qwen3-VL's language models (kestrel reads text; the vision tower is not read): the dense one is Qwen3's and the
MoE one Qwen3-MoE's, nested as the Hub's multimodal checkpoints nest them; the MoE's stacked experts read in the
Hub's x @ W layout and in transformers 5's nn.Linear one to the same logits, and read wrong they leave the limits."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import kestrel_core
from kestrel_core.model import hf
from kestrel_core.model.hf import HFCheckpoint

from .parity import CASES, FIXTURES, MOE, measure

MOE_VL = next(c for c in CASES if c.name == "tiny-qwen3-vl-moe")


def test_the_language_model_is_qwen3s_and_the_vision_tower_is_not_read() -> None:
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3-vl"), backend="cpu") as dense, \
            kestrel_core.load(str(FIXTURES / MOE_VL.name), backend="cpu") as moe:
        assert (dense.model.config.arch, moe.model.config.arch) == ("qwen3", "qwen3_moe")
        assert dense.model.config.qk_norm and moe.model.config.num_experts == 4
        assert not dense.model.config.tie_word_embeddings  # the outer config's, over its text_config's
    names = HFCheckpoint(FIXTURES / "tiny-qwen3-vl")._hf_names.values()
    assert not any(".visual." in n for n in names)


def test_transformers_5s_linear_experts_give_the_hubs_logits(fmt: SimpleNamespace, tmp_path: Path) -> None:
    """The same weights with the stacked experts as nn.Linear's ([E, 2F, D] gate|up, [E, D, F] down), as
    transformers 5 holds them: bit for bit the logits of the Hub's layout."""
    src, dst = FIXTURES / MOE_VL.name, tmp_path / "linear"
    shutil.copytree(src, dst)
    ckpt, tensors = HFCheckpoint(src), {}
    _, header = hf.safetensors_header(src / "model.safetensors")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        bits = ckpt._raw(src / "model.safetensors", name, "<u2")
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            bits = np.ascontiguousarray(bits.transpose(0, 2, 1))
        tensors[name] = (entry["dtype"], bits)
    fmt.write_raw_safetensors(dst / "model.safetensors", tensors)
    ids = np.load(src / "golden.npz")["ids"]
    with kestrel_core.load(str(src), backend="cpu") as hub, kestrel_core.load(str(dst), backend="cpu") as linear:
        assert np.array_equal(hub.logits(ids), linear.logits(ids))


def test_gate_and_up_swapped_leave_the_limits(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    real = hf.HFCheckpoint._halves_expert
    swap = {"gate": "up", "up": "gate", "down": "down"}
    monkeypatch.setattr(hf.HFCheckpoint, "_halves_expert",
                        lambda self, t, part, path, name: real(self, t, swap[part], path, name))
    fig = measure(MOE_VL, "q8")
    assert not fig.within(MOE), fig
