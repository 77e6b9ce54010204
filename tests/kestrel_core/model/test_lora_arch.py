"""LoRA adapters named in their base's own vocabulary: PEFT modules by the base architecture's Hugging Face names,
GGUF adapters of the base's architecture only; each merged one gives the logits of the base merged by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kestrel_core

from .lora_adapters import gguf_adapter, hand_merged, peft_adapter
from .parity import FIXTURES

IDS = list(range(5, 37))


def logits(model: Path, lora: Path | None = None) -> np.ndarray:
    with kestrel_core.load(str(model), backend="cpu", lora=None if lora is None else str(lora)) as engine:
        return engine.logits(IDS)


@pytest.mark.parametrize(("model", "targets"), [
    ("tiny-lfm2", ["self_attn.out_proj", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"]),
    ("tiny-granite4-h", ["mamba.out_proj"]),
    ("tiny-qwen3-next", ["linear_attn.out_proj"]),
    ("tiny-qwen3_5", ["linear_attn.out_proj"]),
    ("tiny-granite4-h", ["shared_mlp.input_linear", "shared_mlp.output_linear"]),
    ("tiny-granite4-h-moe", ["shared_mlp.input_linear", "shared_mlp.output_linear"]),
    ("tiny-phi3", ["self_attn.qkv_proj", "mlp.gate_up_proj"]),
    ("tiny-qwen3_5", ["self_attn.q_proj"]),
])
def test_a_peft_adapter_on_an_architectures_own_projection_names_is_merged(tmp_path: Path, model: str,
                                                                           targets: list[str]) -> None:
    """LFM2's out_proj and w1 / w3 / w2, the linear attention's and Mamba's out_proj are kestrel's o, gate, up and
    down; Granite-4.0-H's shared MLP (gate|up in one input_linear, then output_linear: the layer's MLP, or beside
    experts the shared expert), Phi-3's qkv_proj and gate_up_proj and gated attention's q_proj (each head's query,
    then its gate) hold several of kestrel's tensors, B @ A's rows theirs: merged, they give the hand-merged base's
    logits bit for bit (rank 4, alpha 8: s = 2)."""
    base = FIXTURES / model
    pairs = peft_adapter(tmp_path / "adapter", base, targets)
    assert pairs
    want = logits(hand_merged(tmp_path / "merged", base, [(pairs, 2.0)]))
    np.testing.assert_array_equal(logits(base, tmp_path / "adapter"), want)
    assert not np.allclose(logits(base), want, atol=1e-3)


@pytest.mark.parametrize("model", ["tiny-granite4-h.gguf", "tiny-granite4-h-moe.gguf"])
def test_an_adapter_of_granites_shared_mlp_merges_into_its_gguf_twin(tmp_path: Path, model: str) -> None:
    """The GGUF twin holds the shared MLP's gate and up apart (ffn_gate / ffn_up, or beside experts their _shexp):
    each becomes the twin's weight plus its rows of s * B @ A (gate's first), down the twin's plus all of it."""
    from kestrel_core.model.gguf_reader import GGUFCheckpoint
    from kestrel_core.model.lora import LoraSource, read_adapters

    pairs = peft_adapter(tmp_path / "adapter", FIXTURES / model.removesuffix(".gguf"),
                         ["shared_mlp.input_linear", "shared_mlp.output_linear"])
    base = GGUFCheckpoint(FIXTURES / model)
    merged = LoraSource(base, read_adapters(tmp_path / "adapter"), "granitehybrid")
    part = "shared_expert." if base.config.is_moe else ""
    for layer in range(base.config.num_layers):
        a, b = pairs[f"model.layers.{layer}.shared_mlp.input_linear"]
        delta = np.float32(2) * (b @ a)
        width = delta.shape[0] // 2
        want = {"gate": delta[:width], "up": delta[width:]}
        a, b = pairs[f"model.layers.{layer}.shared_mlp.output_linear"]
        want["down"] = np.float32(2) * (b @ a)
        for field, d in want.items():
            name = f"layers.{layer}.{part}{field}"
            np.testing.assert_allclose(merged.get(name), base.get(name) + d, rtol=1e-6, atol=1e-7)


FUSED_GGUF_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", "self_attn.q_proj": "attn_q"}
FUSED = [("tiny-phi3", "phi3", ["self_attn.qkv_proj", "mlp.gate_up_proj"]), ("tiny-glm4", "glm4", ["mlp.gate_up_proj"]),
         ("tiny-qwen3_5", "qwen35", ["self_attn.q_proj"]), ("tiny-qwen3-next", "qwen3next", ["self_attn.q_proj"])]


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize(("model", "arch", "targets"), FUSED)
def test_a_gguf_adapter_of_a_fused_tensor_merges_as_the_peft_one(tmp_path: Path, model: str, arch: str,
                                                                  targets: list[str], twin: bool) -> None:
    """llama.cpp's converter keeps Phi-3's Q|K|V (attn_qkv) and gate|up (ffn_up: gate rows, then up), GLM-4's
    gate|up and gated attention's attn_q (each head's query, then its gate) fused, in an adapter as in the base:
    B's rows split as the PEFT adapter's of qkv_proj, gate_up_proj and q_proj, its logits bit for bit, from the
    checkpoint and from its GGUF twin."""
    hf = FIXTURES / model
    base = FIXTURES / f"{model}.gguf" if twin else hf
    pairs = peft_adapter(tmp_path / "peft", hf, targets)
    adapter = gguf_adapter(tmp_path / "adapter.gguf", pairs, arch, 8, FUSED_GGUF_NAMES)
    want = logits(base, tmp_path / "peft")
    np.testing.assert_array_equal(logits(base, adapter), want)
    assert not np.allclose(logits(base), want, atol=1e-3)


@pytest.mark.parametrize(("model", "arch", "module", "change", "says"), [
    ("tiny-phi3", "phi3", "self_attn.qkv_proj", lambda a, b: (a, b[:-16]),
     "blk.0.attn_qkv.weight's lora_b has 112 rows, not the 128 of the model's layers.0.q, layers.0.k, layers.0.v "
     "(another base model's adapter?)"),
    ("tiny-phi3", "phi3", "mlp.gate_up_proj", lambda a, b: (a[:, :-8], b),
     "layers.0.gate is [128, 64] in the model but B @ A is [128, 56] (another base model's adapter?)"),
    ("tiny-qwen3_5", "qwen35", "self_attn.q_proj", lambda a, b: (a, b[: b.shape[0] // 2]),
     "blk.3.attn_q.weight's lora_b has 128 rows, not the 256 of the model's layers.3.q, layers.3.attn_gate "
     "(another base model's adapter?)"),
])
def test_a_wrong_shaped_gguf_adapter_of_a_fused_tensor_is_one_line(  # type: ignore[no-untyped-def]
        tmp_path: Path, model: str, arch: str, module: str, change, says: str) -> None:
    """B's rows that are not the fused weight's, or A's columns that are not its input's: refused in one line
    naming the tensor and both shapes."""
    from kestrel_core.errors import KestrelError
    from kestrel_core.model.loader import load_model

    pairs = {m: change(a, b) for m, (a, b) in peft_adapter(tmp_path / "peft", FIXTURES / model, [module]).items()}
    adapter = gguf_adapter(tmp_path / "adapter.gguf", pairs, arch, 8, FUSED_GGUF_NAMES)
    with pytest.raises(KestrelError) as info:
        load_model(str(FIXTURES / model), "q8", cache="off", lora=str(adapter))
    assert str(info.value) == f"LoRA adapter {adapter}: {says}"


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
ATTENTION = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]


def _heads(model: Path) -> tuple[int, int]:
    from kestrel_core.model.hf import HFCheckpoint

    c = HFCheckpoint(model).config
    return c.num_heads, c.num_kv_heads


@pytest.mark.parametrize("model", [name for name in sorted(p.name for p in FIXTURES.iterdir())
                                   if (FIXTURES / f"{name}.gguf").is_file()])
def test_a_checkpoints_llama_cpp_architecture_is_its_gguf_twins(model: str) -> None:
    """The architecture a GGUF adapter of a Hugging Face base must have is the one its GGUF twin has."""
    from kestrel_core.model.gguf_reader import GGUFCheckpoint
    from kestrel_core.model.hf_config import llama_cpp_architecture

    twin = GGUFCheckpoint(FIXTURES / f"{model}.gguf").field("general.architecture")
    assert llama_cpp_architecture(FIXTURES / model) == twin


def test_every_architecture_kestrel_reads_has_its_llama_cpp_name() -> None:
    """A Hugging Face base of any architecture kestrel reads gets a GGUF adapter's architecture checked, not a
    KeyError (the fixtures' GGUF twins check the names themselves)."""
    from kestrel_core.model.hf_config import (
        HF_ARCHITECTURES,
        LANGUAGE_MODEL_ARCHITECTURES,
        LLAMA_CPP_ARCHITECTURES,
        MODEL_TYPES,
    )

    named = set(HF_ARCHITECTURES.values()) | set(MODEL_TYPES.values())
    assert named - set(LANGUAGE_MODEL_ARCHITECTURES) <= set(LLAMA_CPP_ARCHITECTURES)


@pytest.mark.parametrize(("model_type", "gguf"), [("cohere2", "cohere2"), ("cohere", "command-r")])
def test_an_aya_vision_checkpoints_llama_cpp_architecture_is_its_language_models(
        tmp_path: Path, model_type: str, gguf: str) -> None:
    """llama.cpp converts no Aya Vision: a GGUF adapter of one is an adapter of its language model."""
    from kestrel_core.model.hf_config import llama_cpp_architecture

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["AyaVisionForConditionalGeneration"],
                                                      "text_config": {"model_type": model_type}}))
    assert llama_cpp_architecture(tmp_path) == gguf


@pytest.mark.parametrize(("adapter_arch", "base", "base_arch"), [
    ("gemma2", "tiny-llama", "llama"), ("qwen2", "tiny-llama.gguf", "llama"), ("foo", "tiny-llama", "llama"),
    ("llama", "tiny-olmo2.gguf", "olmo2"), ("llama", "tiny-qwen3", "qwen3"), ("qwen3", "tiny-qwen3-vl", "qwen3vl"),
])
def test_a_gguf_adapter_of_another_architecture_is_refused(tmp_path: Path, adapter_arch: str, base: str,
                                                           base_arch: str) -> None:
    """llama.cpp: "model arch and LoRA arch mismatch"; the tensors' names and shapes may well fit."""
    from kestrel_core.errors import KestrelError
    from kestrel_core.model.loader import load_model

    hf = FIXTURES / base.removesuffix(".gguf")
    pairs = peft_adapter(tmp_path / "peft", hf, ATTENTION)
    adapter = gguf_adapter(tmp_path / "adapter.gguf", pairs, adapter_arch, 8, GGUF_NAMES)
    with pytest.raises(KestrelError) as info:
        load_model(str(FIXTURES / base), "q8", cache="off", lora=str(adapter))
    assert str(info.value) == (f"LoRA adapter {adapter}: an adapter of a {adapter_arch} model (its "
                               f"general.architecture); the model is {base_arch}")


@pytest.mark.parametrize(("model", "arch", "permuted"), [
    ("tiny-mistral", "llama", True), ("tiny-ministral3", "mistral3", True), ("tiny-granite4-h", "granitehybrid", True),
    ("tiny-qwen3-vl", "qwen3vl", False), ("tiny-olmo3", "olmo2", False),
])
def test_a_gguf_adapter_of_the_bases_architecture_is_the_hand_merge(tmp_path: Path, model: str, arch: str,
                                                                    permuted: bool) -> None:
    """Named as llama.cpp names the base's architecture (Mistral's llama, OLMo 3's olmo2), its B rows of Q and K
    permuted where the converter permutes the base's (llama's family, Ministral 3, Granite-4.0-H): merged into
    the Hugging Face base it gives the hand-merged base's logits."""
    base = FIXTURES / model
    pairs = peft_adapter(tmp_path / "peft", base, ATTENTION)
    adapter = gguf_adapter(tmp_path / "adapter.gguf", pairs, arch, 8, GGUF_NAMES, _heads(base) if permuted else None)
    want = logits(hand_merged(tmp_path / "merged", base, [(pairs, 2.0)]))
    np.testing.assert_array_equal(logits(base, adapter), want)


@pytest.mark.parametrize("base", ["tiny-qwen3_5", "tiny-qwen3_5.gguf"])
def test_a_qwen3_5_gguf_adapter_of_ssm_out_merges_as_the_peft_one(tmp_path: Path, base: str) -> None:
    """llama.cpp's converter tiles the linear attention's value heads along ssm_out's columns, an adapter's A as the
    base's weight (2 key heads, 4 value heads: the order differs): merged, it gives the PEFT adapter's logits bit
    for bit, from the checkpoint (the hand-merged base's) and from its GGUF twin; taken as it is, it does not."""
    hf = FIXTURES / "tiny-qwen3_5"
    pairs = peft_adapter(tmp_path / "peft", hf, ["linear_attn.out_proj"])
    cfg = json.loads((hf / "config.json").read_text())["text_config"]
    value_heads = (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_value_head_dim"])
    assert value_heads[0] != value_heads[1]
    names = {"linear_attn.out_proj": "ssm_out"}
    adapter = gguf_adapter(tmp_path / "adapter.gguf", pairs, "qwen35", 8, names, value_heads=value_heads)
    want = logits(FIXTURES / base, tmp_path / "peft")
    if base == hf.name:
        np.testing.assert_array_equal(want, logits(hand_merged(tmp_path / "merged", hf, [(pairs, 2.0)])))
    np.testing.assert_array_equal(logits(FIXTURES / base, adapter), want)
    as_is = gguf_adapter(tmp_path / "as-is.gguf", pairs, "qwen35", 8, names)
    assert not np.allclose(logits(FIXTURES / base, as_is), want, atol=1e-3)


def test_a_gguf_adapter_tensor_gguf_py_cannot_dequantize_is_one_line(tmp_path: Path) -> None:
    """An I32 matrix (no LoRA type): named with its type, as a base's tensor of that type is."""
    from kestrel_core.errors import KestrelError
    from kestrel_core.model.loader import load_model

    base = FIXTURES / "tiny-llama"
    pairs = peft_adapter(tmp_path / "peft", base, ["self_attn.v_proj"])
    pairs = {name: (a.astype(np.int32), b) for name, (a, b) in pairs.items()}
    adapter = gguf_adapter(tmp_path / "adapter.gguf", pairs, "llama", 8, GGUF_NAMES)
    with pytest.raises(KestrelError, match=r"tensor blk\.0\.attn_v\.weight\.lora_a uses I32, which gguf-py cannot "
                                           "dequantize$"):
        load_model(str(base), "q8", cache="off", lora=str(adapter))
