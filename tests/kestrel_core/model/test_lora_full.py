"""Weights a LoRA adapter holds in full (PEFT's modules_to_save, an embedding saved beside a resized vocabulary, the
norms llama.cpp's converter keeps from mergekit-extract-lora's adapters): each takes the base's place, as PEFT
loads it; the result is compared with the base given those weights and the LoRA deltas by hand."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kestrel_core
from kestrel_core.errors import KestrelError
from kestrel_core.model.loader import load_model

from .lora_adapters import gguf_adapter, hand_merged, peft_adapter, peft_pairs, trained_in_full
from .parity import FIXTURES

IDS = list(range(5, 37))
NORMS = ["model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"]
HELD = {"tiny-llama": [*NORMS, "model.embed_tokens.weight", "lm_head.weight"],
        "tiny-gemma2": [*NORMS, "model.layers.0.post_feedforward_layernorm.weight"]}


def logits(model: Path, lora: Path | list[str] | None = None) -> np.ndarray:
    paths = None if lora is None else lora if isinstance(lora, list) else str(lora)
    with kestrel_core.load(str(model), backend="cpu", lora=paths) as engine:
        return engine.logits(IDS)


@pytest.mark.parametrize("model", sorted(HELD))
def test_weights_a_peft_adapter_holds_in_full_replace_the_bases(tmp_path: Path, model: str) -> None:
    """Norms (Gemma's as the 1 + weight it multiplies by), the embedding and lm_head, beside a LoRA on v_proj: the
    hand-merged base's logits bit for bit; without them the logits differ."""
    base = FIXTURES / model
    full = trained_in_full(base, HELD[model])
    pairs = peft_adapter(tmp_path / "adapter", base, ["self_attn.v_proj"], full=full)
    want = logits(hand_merged(tmp_path / "merged", base, [(pairs, 2.0, full)]))
    np.testing.assert_array_equal(logits(base, tmp_path / "adapter"), want)
    assert not np.allclose(logits(hand_merged(tmp_path / "lora-only", base, [(pairs, 2.0)])), want, atol=1e-3)


def test_weights_held_in_full_replace_a_gguf_bases(tmp_path: Path) -> None:
    """Into the GGUF twin, the adapter's norms and embedding are the merged model's, whatever the GGUF held."""
    from kestrel_core.model.gguf_reader import GGUFCheckpoint
    from kestrel_core.model.lora import LoraSource, read_adapters

    base = FIXTURES / "tiny-llama"
    kestrel = {"model.norm.weight": "final_norm", "model.layers.0.input_layernorm.weight": "layers.0.attn_norm",
               "model.layers.1.post_attention_layernorm.weight": "layers.1.mlp_norm",
               "model.embed_tokens.weight": "embedding"}
    full = trained_in_full(base, list(kestrel))
    peft_adapter(tmp_path / "adapter", base, ["self_attn.v_proj"], full=full)
    twin = GGUFCheckpoint(FIXTURES / "tiny-llama.gguf")
    merged = LoraSource(twin, read_adapters(tmp_path / "adapter"), "llama")
    for hf, name in kestrel.items():
        assert not np.array_equal(twin.get(name), full[hf])
        np.testing.assert_array_equal(merged.get(name), full[hf])


@pytest.mark.parametrize(("model", "arch", "names"), [
    ("tiny-llama", "llama", {"model.norm.weight": "output_norm.weight",
                             "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
                             "model.layers.1.post_attention_layernorm.weight": "blk.1.ffn_norm.weight"}),
    ("tiny-gemma2", "gemma2", {"model.norm.weight": "output_norm.weight",
                               "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
                               "model.layers.1.post_attention_layernorm.weight": "blk.1.post_attention_norm.weight",
                               "model.layers.0.post_feedforward_layernorm.weight": "blk.0.post_ffw_norm.weight"}),
])
def test_the_norms_of_a_gguf_adapter_replace_the_bases(tmp_path: Path, model: str, arch: str,
                                                       names: dict[str, str]) -> None:
    """llama.cpp's converter keeps an adapter's norms, written as it writes the base's (Gemma's plus 1): they take
    the base's place (llama.cpp's loader passes over them), the hand-merged base's logits bit for bit."""
    base = FIXTURES / model
    full = trained_in_full(base, list(names))
    pairs = peft_adapter(tmp_path / "peft", base, ["self_attn.v_proj"])
    written = {names[n]: t + np.float32(arch == "gemma2") for n, t in full.items()}
    adapter = gguf_adapter(tmp_path / "adapter.gguf", pairs, arch, 8, {"self_attn.v_proj": "attn_v"}, full=written)
    want = logits(hand_merged(tmp_path / "merged", base, [(pairs, 2.0, full)]))
    np.testing.assert_array_equal(logits(base, adapter), want)


def test_stacked_adapters_replace_and_add_in_their_order(tmp_path: Path) -> None:
    """The first holds model.norm and v_proj in full; the second holds model.norm too and a LoRA on v_proj: the
    second's norm, and the first's v_proj plus the second's delta."""
    base = FIXTURES / "tiny-llama"
    first = trained_in_full(base, ["model.norm.weight", "model.layers.0.self_attn.v_proj.weight"], seed=3)
    second = trained_in_full(base, ["model.norm.weight"], seed=4)
    pairs = peft_adapter(tmp_path / "second", base, ["self_attn.v_proj"], full=second)
    peft_adapter(tmp_path / "first", base, ["self_attn.o_proj"], full=first, seed=5)
    want = logits(hand_merged(tmp_path / "merged", base, [(peft_pairs(tmp_path / "first"), 2.0, first),
                                                          (pairs, 2.0, second)]))
    np.testing.assert_array_equal(logits(base, [str(tmp_path / "first"), str(tmp_path / "second")]), want)


def _with(tmp_path: Path, model: str, change) -> Path:  # type: ignore[no-untyped-def]
    """A PEFT adapter of ``model`` on v_proj, its tensors changed by ``change``."""
    d = tmp_path / "adapter"
    peft_adapter(d, FIXTURES / model, ["self_attn.v_proj"])
    path = d / "adapter_model.safetensors"
    save_file(change(load_file(str(path))), str(path))
    return d


PREFIX = "base_model.model."


@pytest.mark.parametrize(("model", "change", "says"), [
    ("tiny-llama", lambda t: {**t, PREFIX + "score.weight": np.ones((2, 64), np.float32)},
     "score.weight, held in full, is not a weight of the model kestrel replaces"),
    ("tiny-gemma2", lambda t: {**t, PREFIX + "lm_head.weight": np.ones((512, 64), np.float32)},
     "lm_head.weight, held in full, is not a weight of the model kestrel replaces (the model's lm_head is its "
     "embedding)"),
    ("tiny-llama", lambda t: {**t, PREFIX + "model.norm.weight": np.ones(64, np.int64)},
     "is I64; a weight held in full must be F32, F16 or BF16"),
    ("tiny-llama", lambda t: {**t, PREFIX + "model.norm.weight": np.full(64, np.nan, np.float32)},
     "model.norm.weight has NaN or infinite values"),
    ("tiny-llama", lambda t: {**t, PREFIX + "model.norm.weight": np.ones(32, np.float32)},
     "final_norm is [64] in the model but [32] in the adapter"),
    ("tiny-llama", lambda t: {**t, PREFIX + "model.layers.0.self_attn.v_proj.weight": np.ones((32, 64), np.float32)},
     "it both adapts layers.0.v and holds it in full"),
    ("tiny-llama", lambda t: {**t, PREFIX + "model.embed_tokens.lora_embedding_A": np.ones((4, 512), np.float32)},
     "lora_embedding_A is not a LoRA A or B matrix"),
])
def test_a_weight_held_in_full_kestrel_cannot_replace_is_one_line(tmp_path: Path, model: str, change, says: str
                                                                  ) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KestrelError, match=re.escape(says)) as info:
        load_model(str(FIXTURES / model), "q8", cache="off", lora=str(_with(tmp_path, model, change)))
    assert "\n" not in str(info.value)


def test_a_gguf_adapters_tensor_kestrel_cannot_place_is_one_line(tmp_path: Path) -> None:
    """Neither a LoRA matrix nor one of the model's weights (llama.cpp's loader refuses it too)."""
    base = FIXTURES / "tiny-llama"
    pairs = peft_adapter(tmp_path / "peft", base, ["self_attn.v_proj"])
    adapter = gguf_adapter(tmp_path / "adapter.gguf", pairs, "llama", 8, {"self_attn.v_proj": "attn_v"},
                           full={"blk.0.attn_extra.weight": np.ones(64, np.float32)})
    with pytest.raises(KestrelError, match=re.escape("blk.0.attn_extra.weight, held in full, is not a weight of the "
                                                     "model kestrel replaces")):
        load_model(str(base), "q8", cache="off", lora=str(adapter))
