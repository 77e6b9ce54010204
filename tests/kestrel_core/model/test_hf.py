"""Hugging Face directories: config.json variants, single / sharded safetensors, f32 / f16 / bf16, bad input."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kestrel_core.artifact import model_tensors
from kestrel_core.contract import BFloat16Bits, StripCache
from kestrel_core.errors import KestrelError
from kestrel_core.model.hf import HFCheckpoint, kestrel_name
from kestrel_core.model.hf_config import config_from_hf
from kestrel_core.model.quantize import quantize_model

from ..waits import HANG_GUARD_S

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"


def test_name_mapping() -> None:
    assert kestrel_name("model.layers.12.self_attn.k_proj.bias") == "layers.12.k_bias"
    assert kestrel_name("model.layers.0.mlp.down_proj.weight") == "layers.0.down"
    assert kestrel_name("lm_head.weight") == "lm_head"
    assert kestrel_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype,shards", [("f32", 1), ("f16", 3), ("bf16", 2)])
def test_reads_every_tensor_exactly(tmp_path: Path, synth_source, fmt, arch: str, dtype: str, shards: int) -> None:
    src = synth_source(arch, seed=7)
    ckpt = HFCheckpoint(fmt.write_hf_dir(tmp_path / "m", src, dtype, shards))
    assert ckpt.config == src.config
    for name, want in src.tensors.items():
        got = ckpt.get(name)
        if dtype == "f32":
            np.testing.assert_array_equal(got, want)
        elif dtype == "f16":
            np.testing.assert_array_equal(got, want.astype(np.float16))
        else:
            expected = (fmt.to_bf16_bits(want).astype(np.uint32) << 16).view(np.float32)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, expected)
            assert np.abs(got - want).max() <= np.abs(want).max() / 128  # bf16 keeps 8 significant bits
    model = quantize_model(ckpt, "q8")
    assert (model.lm_head is model.embedding) == src.config.tie_word_embeddings


@pytest.mark.parametrize("mode", ["q8", "q4-g256"])
def test_bf16_weights_reach_the_quantizer_as_bits(tmp_path: Path, synth_source, fmt, mode: str) -> None:
    """The quantizer widens BF16 itself (no float32 copy of the tensor), to the same codes as from float32."""
    src = synth_source("qwen2", seed=3)
    ckpt = HFCheckpoint(fmt.write_hf_dir(tmp_path / "m", src, "bf16", 2))
    w = ckpt.get_weight("layers.0.q")
    assert isinstance(w, BFloat16Bits) and w.shape == src.tensors["layers.0.q"].shape
    np.testing.assert_array_equal(w.to_float32(), ckpt.get("layers.0.q"))
    widened = synth_source("qwen2", seed=3)
    widened.tensors = {name: ckpt.get(name) for name in src.tensors}
    got, want = model_tensors(quantize_model(ckpt, mode)), model_tensors(quantize_model(widened, mode))
    assert got.keys() == want.keys()
    for name, a in got.items():
        b = want[name]
        if isinstance(a, StripCache):
            np.testing.assert_array_equal(a.codes, b.codes, err_msg=name)
            np.testing.assert_array_equal(a.scales, b.scales, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_bf16_known_bit_patterns(tmp_path: Path) -> None:
    # hand-checked bfloat16 values: sign/exponent/7-bit mantissa
    bits = np.array([0x3F80, 0xC000, 0x3FC0, 0x4049, 0x0000, 0x8000, 0x3C00, 0x7F7F], dtype=np.uint16)
    expected = np.array([1.0, -2.0, 1.5, 3.140625, 0.0, -0.0, 2.0 ** -7, 3.3895313892515355e38], np.float32)
    header = {"model.embed_tokens.weight": {"dtype": "BF16", "shape": [2, 4], "data_offsets": [0, 16]}}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    root = tmp_path / "m"
    root.mkdir()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + bits.tobytes())
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 2, "hidden_size": 4, "intermediate_size": 4,
           "num_hidden_layers": 1, "num_attention_heads": 1}
    (root / "config.json").write_text(json.dumps(cfg))
    got = HFCheckpoint(root).get("embedding")
    np.testing.assert_array_equal(got.reshape(-1), expected)
    assert np.signbit(got.reshape(-1)[5])


def test_config_variants() -> None:
    base = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4}
    c = config_from_hf({**base, "architectures": ["LlamaForCausalLM"], "eos_token_id": [5, 7],
                        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
                       generation={"eos_token_id": [7, 9]})
    assert c.arch == "llama" and c.num_kv_heads == 4 and c.head_dim == 16 and not c.tie_word_embeddings
    assert c.eos_token_ids == (5, 7, 9)
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    # transformers 5 spelling: rope_parameters
    c = config_from_hf({**base, "architectures": ["LlamaForCausalLM"], "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert c.rope_theta == 500000.0 and c.rope_scaling["factor"] == 8.0
    c = config_from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "eos_token_id": 3,
                        "tie_word_embeddings": True, "rope_scaling": None})
    assert (c.arch, c.head_dim, c.qk_norm, c.qkv_bias, c.tie_word_embeddings) == ("qwen3", 128, True, False, True)
    assert c.eos_token_ids == (3,) and c.rope_scaling is None
    c = config_from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": {"type": "default"}})
    assert c.qkv_bias and not c.qk_norm and c.rope_scaling is None
    c = config_from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert (c.arch, c.sliding_window, c.qkv_bias, c.qk_norm) == ("mistral", 4096, False, False)
    c = config_from_hf({**base, "architectures": ["Phi3ForCausalLM"], "sliding_window": 2047})
    assert (c.arch, c.sliding_window) == ("phi3", 2047)
    c = config_from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None})
    assert c.sliding_window is None  # Mistral v0.2 and later: full attention
    assert config_from_hf({**base, "architectures": ["LlamaForCausalLM"], "sliding_window": 8}).sliding_window is None


def test_cohere_configs_read_as_transformers_reads_them() -> None:
    """CohereConfig's and Cohere2Config's defaults and rules: layer_norm_eps 1e-5, logit_scale 0.0625 (the logits
    times it), RoPE base 500000 (Command R's, where config.json has none), q/k norms only with use_qk_norm; Cohere2's
    head_dim hidden / heads whatever config.json says, every sliding_window_pattern-th layer full and unturned, and
    without a window no layer sliding or turned. Command R's context is its model_max_length (llama.cpp's)."""
    base = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4}
    c = config_from_hf({**base, "architectures": ["CohereForCausalLM"], "model_max_length": 131072})
    assert (c.norm_type, c.parallel_block, c.rope_interleaved, c.tie_word_embeddings) == ("layer", True, True, True)
    assert (c.rms_norm_eps, c.logits_scaling, c.rope_theta, c.qk_norm, c.max_position) == (
        1e-5, 16.0, 500000.0, False, 131072)
    c = config_from_hf({**base, "architectures": ["CohereForCausalLM"], "use_qk_norm": True, "logit_scale": 0.125})
    assert (c.qk_norm, c.qk_norm_heads, c.logits_scaling, c.max_position) == (True, True, 8.0, 4096)
    c = config_from_hf({**base, "architectures": ["Cohere2ForCausalLM"], "head_dim": 32, "sliding_window": 16,
                        "sliding_window_pattern": 2})
    assert (c.head_dim, c.layer_types, c.nope_layers) == (16, ("sliding", "full") * 2, (1, 3))
    c = config_from_hf({**base, "architectures": ["Cohere2ForCausalLM"], "sliding_window": None})
    assert (c.layer_types, c.sliding_window, c.nope_layers) == ((), None, (0, 1, 2, 3))


# the context fields of the released configs: (architecture, max_position_embeddings, model_max_length), the
# context their model cards give
RELEASED_CONTEXTS = {
    "c4ai-command-r-v01": ("CohereForCausalLM", 8192, 131072, 131072),
    "c4ai-command-r-plus": ("CohereForCausalLM", 8192, 131072, 131072),
    "c4ai-command-r-08-2024": ("CohereForCausalLM", 131072, None, 131072),
    "aya-expanse-8b": ("CohereForCausalLM", 8192, None, 8192),
    "c4ai-command-r7b-12-2024": ("Cohere2ForCausalLM", 8192, None, 8192),
    "c4ai-command-a-03-2025": ("Cohere2ForCausalLM", 131072, None, 131072),
}


@pytest.mark.parametrize("model", list(RELEASED_CONTEXTS))
def test_a_cohere_models_context_is_the_one_it_was_trained_for(model: str) -> None:
    """Command R's and R+'s first releases say max_position_embeddings 8192 (transformers' and vLLM's context) and
    model_max_length 131072, the context they were trained for, which kestrel takes as llama.cpp's converter does;
    the later releases and Aya's say it in max_position_embeddings. Cohere2's configs have no model_max_length,
    and llama.cpp's converter reads none there (Command R7B's card gives 128K, its config 8192: kestrel's is 8192)."""
    arch, positions, longest, context = RELEASED_CONTEXTS[model]
    cfg = {"architectures": [arch], "vocab_size": 10, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": positions,
           **({} if longest is None else {"model_max_length": longest})}
    assert config_from_hf(cfg).max_position == context
    if arch == "Cohere2ForCausalLM":
        assert config_from_hf({**cfg, "model_max_length": 4 * positions}).max_position == positions


AYA_VISION = {"architectures": ["AyaVisionForConditionalGeneration"], "model_type": "aya_vision",
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}, "image_token_index": 255036}


def test_aya_vision_configs_read_their_language_model_as_transformers_does() -> None:
    """aya-vision-8b's config.json, whose text_config gives little more than its sizes, is Command R7B's language
    model with Cohere2Config's defaults (the vocabulary, the context, the window, the ids); without a text_config,
    Cohere2Config's own; a Cohere text_config (aya-vision-32b's) is Command R's, its RoPE base CohereConfig's."""
    eight = {**AYA_VISION, "text_config": {
        "hidden_size": 4096, "intermediate_size": 14336, "logit_scale": 0.25, "model_type": "cohere2",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rope_theta": 50000,
        "torch_dtype": "float16", "use_qk_norm": False}}
    c = config_from_hf(eight)
    assert (c.arch, c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "cohere2", 256000, 4096, 32, 32, 8, 128)
    assert (c.max_position, c.rope_theta, c.logits_scaling, c.sliding_window) == (8192, 50000.0, 4.0, 4096)
    assert c.layer_types == ("sliding", "sliding", "sliding", "full") * 8 and c.nope_layers == tuple(range(3, 32, 4))
    assert (c.bos_token_id, c.eos_token_ids, c.tie_word_embeddings, c.norm_type) == (5, (255001,), True, "layer")
    bare = config_from_hf(AYA_VISION)
    assert (bare.arch, bare.hidden_size, bare.num_layers, bare.num_heads) == ("cohere2", 8192, 40, 64)
    c = config_from_hf({**AYA_VISION, "text_config": {"model_type": "cohere", "hidden_size": 64,
                                                      "num_attention_heads": 4, "num_hidden_layers": 2}})
    assert (c.arch, c.rope_theta, c.max_position, c.parallel_block) == ("cohere", 500000.0, 8192, True)


@pytest.mark.parametrize(("fixture", "key"), [("tiny-gemma2", "tie_word_embeddings"),
                                              ("tiny-smollm3", "tie_word_embeddings"),
                                              ("tiny-ernie4_5", "tie_word_embeddings"), ("tiny-lfm2", "tie_embedding"),
                                              ("tiny-cohere", "tie_word_embeddings"),
                                              ("tiny-cohere2", "tie_word_embeddings")])
def test_a_config_silent_on_ties_ties_as_transformers_does(fixture: str, key: str) -> None:
    """These architectures' transformers configs tie by default (google/gemma-2-27b's config.json does not say;
    LiquidAI's LFM2 configs say tie_embedding), and their checkpoints ship no lm_head."""
    cfg = json.loads((FIXTURES / fixture / "config.json").read_text())
    assert cfg.pop("tie_word_embeddings") is True
    assert config_from_hf(cfg).tie_word_embeddings
    assert not config_from_hf({**cfg, key: False}).tie_word_embeddings


@pytest.mark.parametrize("cfg,match", [
    ({"architectures": ["GemmaForCausalLM"]}, "unsupported architecture GemmaForCausalLM"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "use_sliding_window"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": True}, "sliding_window"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window"),
    ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.1}, "turns 1 of each head's 16 dims"),
    ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 1.5}, "partial_rotary_factor must be"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
     "longrope rope scaling lacks long_factor"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "su", "short_factor": [1.0] * 8,
                                                             "long_factor": [1.0] * 7}},
     "long_factor must be a list of 8 factors"),
    ({"architectures": ["Qwen3ForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": -4.0,
                                                              "original_max_position_embeddings": 32}},
     "yarn rope_scaling.factor"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
     "rope scaling type 'dynamic' is not supported"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "llama3", "factor": 4.0}},
     "llama3 rope scaling lacks"),
    ({"architectures": ["LlamaForCausalLM"], "attention_bias": True}, "attention_bias"),
    ({"architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "qwen3 attention_bias"),  # q, k, v and o
    ({"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": True}, "qwen3_moe attention_bias"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"architectures": ["CohereForCausalLM"], "attention_bias": True}, "cohere attention_bias"),  # q, k, v and o
    ({"architectures": ["Cohere2ForCausalLM"], "sliding_window_pattern": 0}, "sliding_window_pattern must be"),
    ({"architectures": ["CohereForCausalLM"], "model_max_length": 1 << 40}, "model_max_length must be"),
    ({**AYA_VISION, "text_config": {"hidden_size": 64}}, "Aya Vision's text_config model_type 'llama'"),
    ({**AYA_VISION, "text_config": {"model_type": "qwen3"}}, "Aya Vision's text_config model_type 'qwen3'"),
    ({**AYA_VISION, "text_config": [1]}, "text_config must be an object"),
    ({"architectures": ["Qwen3ForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 1e308,
                                                              "original_max_position_embeddings": 32}},
     "yarn rope_scaling.factor must be <= 1024"),
])
def test_unsupported_configs_are_named(cfg: dict, match: str) -> None:
    base = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4}
    with pytest.raises(KestrelError, match=match):
        config_from_hf({**base, **cfg})
    with pytest.raises(KestrelError, match="missing 'num_attention_heads'"):
        config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 3})


def test_generation_config_eos_is_added(tmp_path: Path, synth_source, fmt) -> None:
    ckpt = HFCheckpoint(fmt.write_hf_dir(tmp_path / "m", synth_source("qwen3"), generation_eos=[2, 11]))
    assert ckpt.config.eos_token_ids == (2, 11)


@pytest.mark.parametrize(("generation", "sampling"), [
    ({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}, {"temperature": 0.6, "top_p": 0.95,
                                                                           "top_k": 20}),
    # transformers' defaults are no recommendation (vLLM reads the file the same way); top_k -1 is off
    ({"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}, None),
    ({"top_k": -1, "min_p": 0.05, "repetition_penalty": 1.05}, {"top_k": 0, "min_p": 0.05, "repetition_penalty": 1.05}),
    ({"eos_token_id": 2}, None),
    # do_sample at transformers' default temperature samples at 1.0, not kestrel's greedy default
    ({"do_sample": True, "top_k": 64, "top_p": 0.95}, {"temperature": 1.0, "top_k": 64, "top_p": 0.95}),
    ({"do_sample": True, "temperature": 1.0, "top_k": 50}, {"temperature": 1.0}),
    ({"do_sample": False, "top_k": 20}, {"top_k": 20}),
])
def test_generation_config_sampling_is_the_models_recommendation(tmp_path: Path, synth_source, fmt,
                                                                  generation: dict, sampling: dict | None) -> None:
    root = fmt.write_hf_dir(tmp_path / "m", synth_source("qwen3"))
    (root / "generation_config.json").write_text(json.dumps(generation))
    assert HFCheckpoint(root).config.sampling == sampling


@pytest.mark.parametrize(("generation", "message"), [
    ({"top_p": 1.5}, "generation_config.json: sampling.top_p must be in (0, 1], got 1.5"),
    ({"temperature": "0.7"}, "generation_config.json: sampling.temperature must be a number"),
    ({"repetition_penalty": 0}, "generation_config.json: sampling.repetition_penalty must be in (0, 10]"),
])
def test_a_bad_recommendation_is_one_line(tmp_path: Path, synth_source, fmt, generation: dict, message: str) -> None:
    root = fmt.write_hf_dir(tmp_path / "m", synth_source("qwen3"))
    (root / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(KestrelError) as exc:
        HFCheckpoint(root)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_bad_directories_are_one_line_errors(tmp_path: Path, synth_source, fmt) -> None:
    def err(path: Path) -> str:
        with pytest.raises(KestrelError) as exc:
            HFCheckpoint(path)
        assert "\n" not in str(exc.value)
        return str(exc.value)

    assert "no config.json" in err(tmp_path)
    root = fmt.write_hf_dir(tmp_path / "sharded", synth_source("llama"), shards=3)
    (root / "model-00002-of-00003.safetensors").unlink()
    assert "shard model-00002-of-00003.safetensors named by the index is missing" in err(root)

    root = fmt.write_hf_dir(tmp_path / "trunc", synth_source("llama"))
    data = (root / "model.safetensors").read_bytes()
    (root / "model.safetensors").write_bytes(data[: len(data) - 100])
    assert "truncated or corrupt" in err(root)

    root = fmt.write_hf_dir(tmp_path / "badjson", synth_source("llama"))
    (root / "config.json").write_text("{not json")
    assert "invalid JSON" in err(root)

    root = fmt.write_hf_dir(tmp_path / "pickle", synth_source("llama"))
    (root / "model.safetensors").unlink()
    (root / "pytorch_model.bin").write_bytes(b"\x80\x04 pickle")
    assert "safetensors only" in err(root)

    root = fmt.write_hf_dir(tmp_path / "escape", synth_source("llama"), shards=2)
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../evil.safetensors"}}))
    assert "outside the model directory" in err(root)


def test_missing_tensor_names_the_hf_tensor(tmp_path: Path, synth_source, fmt) -> None:
    src = synth_source("llama")
    del src.tensors["layers.1.gate"]
    ckpt = HFCheckpoint(fmt.write_hf_dir(tmp_path / "m", src))
    with pytest.raises(KestrelError, match=r"model\.layers\.1\.mlp\.gate_proj\.weight"):
        quantize_model(ckpt, "q8")


def test_a_fused_tensor_too_small_for_its_config_is_one_line(tmp_path: Path) -> None:
    """Phi-3's qkv_proj split by the config's head counts: a config asking for more rows than the tensor
    holds is an error naming the tensor, not a silently shifted split."""
    import json
    import shutil

    src = FIXTURES / "tiny-phi3"
    d = tmp_path / "phi3"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 4  # q, k, v of 64 rows each: 192 > the tensor's 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KestrelError, match="fused tensor model.layers.0.self_attn.qkv_proj.weight has shape"):
        HFCheckpoint(d).get("layers.0.v")


GPT_OSS_MXFP4 = FIXTURES / "tiny-gpt-oss-mxfp4"


def _mxfp4_copy(tmp_path: Path, change) -> Path:  # type: ignore[no-untyped-def]
    """tiny-gpt-oss-mxfp4 with ``change(tensors)`` applied to its safetensors (numpy, BF16 kept as raw bits)."""
    import shutil

    from safetensors import safe_open
    from safetensors.numpy import save_file

    d = tmp_path / "gpt-oss"
    shutil.copytree(GPT_OSS_MXFP4, d)
    tensors = {}
    with safe_open(str(GPT_OSS_MXFP4 / "model.safetensors"), "numpy") as f:
        for name in f.keys():
            if f.get_slice(name).get_dtype() == "U8":
                tensors[name] = f.get_tensor(name)
    change(tensors)
    # the BF16 tensors are not numpy's: keep them out and rebuild the file from the U8 ones and float32 copies
    src = HFCheckpoint(GPT_OSS_MXFP4)
    for hf_name, path in src._paths.items():
        if hf_name not in tensors and not hf_name.endswith(("_blocks", "_scales")):
            bits = src._raw(path, hf_name, "<u2")
            tensors[hf_name] = BFloat16Bits(np.ascontiguousarray(bits)).to_float32()
    save_file({k: v for k, v in tensors.items() if v is not None}, str(d / "model.safetensors"))
    return d


def test_mxfp4_experts_are_decoded_as_transformers_writes_them(tmp_path: Path) -> None:
    """The MXFP4 twin gives each expert's weights exactly (its golden logits are tiny-gpt-oss's, test_parity);
    a blocks tensor without its scales, or a scale of 255 (E8M0's NaN: 2^128 overflows), is one line naming it."""
    twin = HFCheckpoint(GPT_OSS_MXFP4)
    plain = HFCheckpoint(GPT_OSS_MXFP4.parent / "tiny-gpt-oss")
    for name in ("layers.1.experts.3.gate", "layers.1.experts.3.up", "layers.0.experts.2.down",
                 "layers.0.experts.1.up_bias"):
        np.testing.assert_array_equal(twin.get(name), plain.get(name))
    assert twin.get("layers.0.experts.0.gate").shape == (64, 64)
    no_scales = _mxfp4_copy(tmp_path / "a", lambda t: t.update({"model.layers.0.mlp.experts.down_proj_scales": None}))
    with pytest.raises(KestrelError, match="down_proj_blocks has no model.layers.0.mlp.experts.down_proj_scales"):
        HFCheckpoint(no_scales).get("layers.0.experts.0.down")

    def nan_scale(t: dict) -> None:
        t["model.layers.1.mlp.experts.gate_up_proj_scales"][2, 5, 1] = 255

    with pytest.raises(KestrelError, match=r"layers\.1\.experts\.2\.(gate|up).*(NaN|infinit)"):
        quantize_model(HFCheckpoint(_mxfp4_copy(tmp_path / "b", nan_scale)), "q8")


def test_q4_of_mxfp4_experts_says_what_it_costs(caplog) -> None:  # type: ignore[no-untyped-def]
    from kestrel_core.model.loader import load_model

    for path, quant, warned in ((GPT_OSS_MXFP4, "q4", True), (GPT_OSS_MXFP4, "q8", False),
                                (GPT_OSS_MXFP4.parent / "tiny-gpt-oss", "q4", False),
                                (GPT_OSS_MXFP4.parent / "tiny-gpt-oss.gguf", "q4-g256", True)):
        caplog.clear()
        load_model(str(path), quant, cache="off")
        assert any("experts are MXFP4" in r.getMessage() for r in caplog.records) == warned, (path, quant)


def _reshaped_copy(tmp_path: Path, model: str, name: str, shape: list[int]) -> Path:
    """A fixture directory whose safetensors tensor ``name`` holds the first elements of its bytes as ``shape``
    (its dtype kept, raw), the header and offsets rewritten."""
    import shutil

    src = FIXTURES / model
    d = tmp_path / model
    shutil.copytree(src, d)
    raw = (src / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    out, at = bytearray(), 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        a, b = entry["data_offsets"]
        chunk = data[a:b]
        if key == name:
            size = (b - a) // int(np.prod(entry["shape"]))
            entry["shape"], chunk = shape, chunk[:size * int(np.prod(shape))]
        entry["data_offsets"] = [at, at + len(chunk)]
        out += chunk
        at += len(chunk)
    head = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + bytes(out))
    return d


@pytest.mark.parametrize(("model", "name", "shape", "get", "says"), [
    ("tiny-lfm2", "model.layers.0.conv.conv.weight", [], "layers.0.conv", "is a scalar, not a convolution"),
    ("tiny-gpt-oss", "model.layers.0.mlp.experts.down_proj", [2, 64, 64], "layers.0.experts.2.down",
     r"down_proj of shape \[2, 64, 64\] has no expert 2"),
])
def test_a_tensor_too_small_for_its_role_is_named(tmp_path: Path, model: str, name: str, shape: list[int],
                                                  get: str, says: str) -> None:
    with pytest.raises(KestrelError, match=says):
        HFCheckpoint(_reshaped_copy(tmp_path, model, name, shape)).get(get)


def test_a_shard_that_cannot_be_read_is_said_to_be_unreadable(tmp_path: Path, unprivileged: list[str]) -> None:
    """Not "No such file or directory" (safetensors' word for any file it cannot open): the shard, and why."""
    model = shutil.copytree(FIXTURES / "tiny-llama", tmp_path / "tiny-llama")
    shard = model / "model-00002-of-00003.safetensors"
    shard.chmod(0)
    done = subprocess.run([*unprivileged, sys.executable, "-m", "kestrel_core.entry", "run", "--model", str(model),
                           "--backend", "cpu", "-n", "1", "hi"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.strip().splitlines()[-1] == f"error: cannot read {shard}: permission denied", done.stderr
