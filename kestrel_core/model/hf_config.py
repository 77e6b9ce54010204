"""A Hugging Face model's config.json (and generation_config.json) as a ModelConfig: which architectures kestrel
reads (HF_ARCHITECTURES, MODEL_TYPES), each one's fields as transformers resolves them, and what is refused by
name; hf_experts.py, hf_hybrid.py and hf_cohere.py read a mixture of experts', a hybrid decoder's and Cohere's
fields. model/hf.py reads
the tensors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kestrel_core.errors import KestrelError, os_error
from kestrel_core.model import hf_cohere, hf_experts, hf_hybrid
from kestrel_core.model.config import (
    SAMPLING_FIELDS,
    ModelConfig,
    normalize_rope_scaling,
    recommended_sampling,
    yarn_mscale,
)
from kestrel_core.model.validate import (
    ValidationError,
    check_bool,
    check_float,
    check_hf_config,
    check_int,
    check_regular_file,
    check_token_ids,
    is_int,
    named_layers,
    refuse_set,
    sliding_layer_types,
)

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                    "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
                    "Gemma3ForCausalLM": "gemma3",
                    "Gemma3ForConditionalGeneration": "gemma3", "Qwen2MoeForCausalLM": "qwen2_moe",
                    "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral", "GptOssForCausalLM": "gpt_oss",
                    "SmolLM3ForCausalLM": "smollm3", "GraniteForCausalLM": "granite", "Olmo2ForCausalLM": "olmo2",
                    "Olmo3ForCausalLM": "olmo3", "Ministral3ForCausalLM": "ministral3",
                    "Mistral3ForConditionalGeneration": "mistral3",
                    "Exaone4ForCausalLM": "exaone4", "SeedOssForCausalLM": "seed_oss",
                    "Glm4ForCausalLM": "glm4", "Ernie4_5ForCausalLM": "ernie4_5",
                    "Qwen3_5ForCausalLM": "qwen3_5", "Qwen3_5ForConditionalGeneration": "qwen3_5",
                    "Qwen3_5MoeForCausalLM": "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
                    "Qwen3NextForCausalLM": "qwen3_next", "Lfm2ForCausalLM": "lfm2", "Lfm2MoeForCausalLM": "lfm2_moe",
                    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
                    "Glm4MoeForCausalLM": "glm4_moe", "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
                    "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                    "Glm4MoeLiteForCausalLM": "glm4_moe_lite", "MiniMaxM2ForCausalLM": "minimax_m2",
                    "Dots1ForCausalLM": "dots1", "CohereForCausalLM": "cohere", "Cohere2ForCausalLM": "cohere2",
                    # Aya Vision's language model is Cohere's or Cohere2's, as its text_config says
                    "AyaVisionForConditionalGeneration": "aya_vision",
                    # Qwen3-VL's language models are Qwen3's and Qwen3-MoE's (_TEXT_CONFIGS names them so)
                    "Qwen3VLForConditionalGeneration": "qwen3_vl", "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
                    # the decoder without its head, as embedding checkpoints (e5-mistral, ...) name it
                    "LlamaModel": "llama", "Qwen2Model": "qwen2", "Qwen3Model": "qwen3", "MistralModel": "mistral"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "phi3": "phi3",
               "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3", "qwen2_moe": "qwen2_moe",
               "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "gpt_oss": "gpt_oss",
               "smollm3": "smollm3", "granite": "granite", "olmo2": "olmo2", "olmo3": "olmo3", "exaone4": "exaone4",
               "seed_oss": "seed_oss", "glm4": "glm4", "ernie4_5": "ernie4_5", "qwen3_5": "qwen3_5",
               "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe",
               "qwen3_next": "qwen3_next", "lfm2": "lfm2", "lfm2_moe": "lfm2_moe", "minimax_m2": "minimax_m2",
               "dots1": "dots1", "cohere": "cohere", "cohere2": "cohere2", "aya_vision": "aya_vision",
               "granitemoehybrid": "granitemoehybrid",
               "glm4_moe": "glm4_moe", "ernie4_5_moe": "ernie4_5_moe", "qwen3_vl": "qwen3_vl",
               "qwen3_vl_moe": "qwen3_vl_moe", "ministral3": "ministral3", "mistral3": "mistral3",
               "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3",
               "glm4_moe_lite": "glm4_moe_lite"}
WINDOWED = ("mistral", "phi3", "mixtral", "ministral3")  # architectures whose sliding_window applies to every layer
# Gemma3TextConfig's defaults: hub configs (the text_config of the multimodal checkpoints) leave many out
GEMMA3_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                   "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                   "sliding_window": 4096, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1}
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# linear attention (Gated DeltaNet) beside gated full attention, every RMSNorm but the gated one a 1 + weight factor
HYBRID_ARCHITECTURES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Qwen3_5TextConfig's defaults of what a text_config may leave out
QWEN3_5_DEFAULTS = {"head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                    "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
# Qwen3VLTextConfig's defaults of what a text_config may leave out
QWEN3_VL_DEFAULTS = {"head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 128000}
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # Gemma2Config's defaults
POST_NORMED = ("olmo2", "olmo3", "exaone4")
# architectures whose transformers config ties the output head to the embeddings where config.json does not say
TIED_BY_DEFAULT = ("gemma2", "gemma3", "smollm3", "ernie4_5", "ernie4_5_moe", "lfm2", "lfm2_moe", "cohere", "cohere2")
COHERE_ARCHITECTURES = ("cohere", "cohere2")  # LayerNorms, parallel blocks, interleaved RoPE, scaled logits
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")  # multi-head latent attention
ROPE_THETAS = {"gpt_oss": 150000.0, "cohere": 500000.0}  # transformers' default RoPE base where not 10000
# transformers' GptOssConfig default RoPE, for a config.json without one
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


# the general.architecture llama.cpp's convert_hf_to_gguf.py writes for each architecture (as _architecture names
# a config.json's, a multimodal wrapper's included): a GGUF of the checkpoint's, and its LoRA adapters', says it
LLAMA_CPP_ARCHITECTURES = {
    "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
    "gemma2": "gemma2", "gemma3": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss",
    "smollm3": "smollm3", "granite": "granite", "olmo2": "olmo2", "olmo3": "olmo2", "exaone4": "exaone4",
    "seed_oss": "seed_oss", "glm4": "glm4", "ernie4_5": "ernie4_5", "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe",
    "qwen3_next": "qwen3next", "lfm2": "lfm2", "lfm2_moe": "lfm2moe", "granitemoehybrid": "granitehybrid",
    "glm4_moe": "glm4moe", "ernie4_5_moe": "ernie4_5-moe", "ministral3": "mistral3", "mistral3": "mistral3",
    "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "glm4_moe_lite": "deepseek2",
    "minimax_m2": "minimax-m2", "dots1": "dots1", "qwen3_vl": "qwen3vl", "qwen3_vl_moe": "qwen3vlmoe",
    "cohere": "command-r", "cohere2": "cohere2"}
# multimodal checkpoints llama.cpp converts none of (Aya Vision): a GGUF adapter of one is its language model's
LANGUAGE_MODEL_ARCHITECTURES = ("aya_vision",)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise KestrelError(f"token id must be an int or a list of ints, got {value!r}")


def _architecture(cfg: dict[str, Any], where: str) -> str:
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None and not archs:
        arch = MODEL_TYPES.get(cfg.get("model_type", ""))
    if arch is None:
        named = ", ".join(archs) if archs else f"model_type {cfg.get('model_type')!r}"
        raise KestrelError(f"{where}: unsupported architecture {named} "
                           f"(kestrel supports {', '.join(HF_ARCHITECTURES)})")
    return arch


def llama_cpp_architecture(model_dir: Path) -> str:
    """The general.architecture of the GGUF file llama.cpp would convert the checkpoint at ``model_dir`` to (for
    LANGUAGE_MODEL_ARCHITECTURES, its language model)."""
    cfg, where = read_json(model_dir / "config.json"), str(model_dir)
    arch = _architecture(cfg, where)
    if arch in LANGUAGE_MODEL_ARCHITECTURES:
        arch = _architecture(_text_config(cfg, where), where)
    return LLAMA_CPP_ARCHITECTURES[arch]


def _named_arch(cfg: dict[str, Any]) -> str | None:
    """The architecture a config names, before its types are checked (check_hf_config refuses bad ones next)."""
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs:
        return next((HF_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in HF_ARCHITECTURES), None)
    return MODEL_TYPES.get(cfg.get("model_type")) if isinstance(cfg.get("model_type"), str) else None


# architectures whose multimodal checkpoints nest the language model's settings in text_config: the causal LM's
# name (None: the text_config's model_type says it), and the defaults its config class gives what a hub config leaves
# out
_TEXT_CONFIGS = {"gemma3": ("Gemma3ForCausalLM", GEMMA3_DEFAULTS), "qwen3_5": ("Qwen3_5ForCausalLM", QWEN3_5_DEFAULTS),
                 "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", {**QWEN3_5_DEFAULTS, "moe_intermediate_size": 512,
                                                           "num_experts": 256, "num_experts_per_tok": 8}),
                 "qwen3_vl": ("Qwen3ForCausalLM", QWEN3_VL_DEFAULTS),
                 "qwen3_vl_moe": ("Qwen3MoeForCausalLM", QWEN3_VL_DEFAULTS),
                 "mistral3": ("Ministral3ForCausalLM", {"head_dim": 128, "rms_norm_eps": 1e-5}),
                 "aya_vision": (None, hf_cohere.TEXT_DEFAULTS)}


def _text_config(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The language model's settings: a multimodal Gemma 3's, Qwen3.5's, Qwen3-VL's, Mistral 3's or Aya Vision's
    text_config (with its own defaults), or cfg."""
    arch = _named_arch(cfg)
    if arch not in _TEXT_CONFIGS:
        return cfg
    name, defaults = _TEXT_CONFIGS[arch]
    text = cfg.get("text_config", cfg)
    if not isinstance(text, dict):
        raise KestrelError(f"{where}: text_config must be an object, got {text!r}")
    if name is None:
        name = hf_cohere.aya_vision_language_model(None if text is cfg else text, where)
    out = {**defaults, **{k: v for k, v in text.items() if v is not None}}
    out["architectures"] = [name]
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):  # the outer config's win
        if text is not cfg and cfg.get(key) is not None:
            out[key] = cfg[key]
    return out


def _gemma_fields(arch: str, cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Gemma 2's and 3's own ModelConfig fields: layer types, RoPE (Gemma 3: a base per layer type), the query
    and embedding scales; Gemma 2's soft-capping."""
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise KestrelError(f"{where}: hidden_activation {act!r} is not supported (Gemma uses gelu_pytorch_tanh)")
    refuse_set(cfg, where, {"use_bidirectional_attention": "bidirectional attention"})
    out: dict[str, Any] = {}
    if arch == "gemma3":
        refuse_set(cfg, where, {"final_logit_softcapping": "tanh soft-capping of the logits",
                                "attn_logit_softcapping": "tanh soft-capping of attention scores"})
    else:
        for key, name in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
            cap = cfg.get(key, GEMMA2_SOFTCAPS[key])
            out[name] = None if cap is None else check_float(key, cap, 0.0, lo_open=True)
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6 if arch == "gemma3" else 2))
    check_int("sliding_window_pattern", pattern, 1)
    types = sliding_layer_types(cfg, where, pattern)
    rp = cfg.get("rope_parameters")
    if arch == "gemma2":  # one RoPE for every layer
        theta = cfg.get("rope_theta", (rp or {}).get("rope_theta", 1e4))
        scaling = cfg.get("rope_scaling") or (rp if (rp or {}).get("rope_type", "default") != "default" else None)
    else:
        theta, local_theta, scaling = _layer_type_rope(cfg, where, 1e6, cfg.get("rope_local_base_freq", 1e4))
        out["rope_local_theta"] = local_theta
    qpas = check_float("query_pre_attn_scalar", cfg.get("query_pre_attn_scalar", 256), 0.0, lo_open=True)
    return {
        **out,
        "layer_types": types,
        "rope_theta": check_float("rope_theta", theta, 0.0, lo_open=True),
        "rope_scaling": _rope_scaling(arch, cfg, scaling, where),
        "query_scale": qpas ** -0.5,
        "embed_scale": math.sqrt(cfg["hidden_size"]),
        "activation": "gelu_tanh",
        "post_norms": True,
        "qk_norm": arch == "gemma3",
        "sliding_window": cfg.get("sliding_window", 4096),
    }


def _attention_temperature(rope: dict[str, Any], where: str) -> dict[str, Any]:
    """Ministral 3's query temperature from its rope parameters (transformers' get_llama_4_attn_scale: beta
    ``llama_4_scaling_beta``, its length the pretraining context ``original_max_position_embeddings``)."""
    beta = rope.get("llama_4_scaling_beta")
    if not beta:
        return {}
    return {"attn_temperature_scale": check_float("llama_4_scaling_beta", beta, 0.0),
            "attn_temperature_length": check_int("original_max_position_embeddings",
                                                 rope.get("original_max_position_embeddings"), 1)}


def _layer_type_rope(cfg: dict[str, Any], where: str, theta: float, local_theta: float) -> tuple[float, float, Any]:
    """(the full layers' RoPE base, the sliding layers', the full layers' scaling) of a model whose sliding layers turn
    by their own unscaled RoPE (Gemma 3, OLMo 3): transformers 5's rope_parameters per layer type, or the classic
    rope_theta and rope_scaling (the full layers'), ``theta`` and ``local_theta`` where a config says neither."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise KestrelError(f"{where}: rope scaling of the sliding layers is not supported")
        theta, local_theta = full.get("rope_theta", theta), local.get("rope_theta", local_theta)
        scaling = full if full.get("rope_type", "default") != "default" else None
    else:
        theta, scaling = cfg.get("rope_theta", (rp or {}).get("rope_theta", theta)), cfg.get("rope_scaling")
    return theta, check_float("rope_local_base_freq", local_theta, 0.0, lo_open=True), scaling


def _olmo3_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """OLMo 3's: OLMo 2's norms, three sliding layers (window ``sliding_window``) to one full (or as ``layer_types``
    says); the sliding layers turn by plain RoPE at the same base, the full ones by the config's scaling (YaRN)."""
    theta, local_theta, scaling = _layer_type_rope(cfg, where, 500000.0, None)
    return {"layer_types": sliding_layer_types(cfg, where, 4), "sliding_window": cfg.get("sliding_window", 4096),
            "rope_theta": check_float("rope_theta", theta, 0.0, lo_open=True),
            "rope_local_theta": theta if local_theta is None else local_theta,
            "rope_scaling": _rope_scaling("olmo3", cfg, scaling, where)}


def _exaone4_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """EXAONE 4: norms after each block, per-head q/k norms, and with a sliding window its global layers (every
    ``sliding_window_pattern``-th, or as ``layer_types`` says) attend without RoPE; without one every layer is global
    and turns."""
    out: dict[str, Any] = {"qk_norm": True, "pre_norms": False, "post_norms": True}
    window = cfg.get("sliding_window")
    if window is None:
        return out
    pattern = cfg.get("sliding_window_pattern", 4)
    if isinstance(pattern, str):  # "LLLG": local, local, local, global
        pattern = len(pattern) if pattern and set(pattern) <= {"L", "G"} and pattern.endswith("G") else None
    if not is_int(pattern) or pattern < 1:
        raise KestrelError(f"{where}: sliding_window_pattern must be a number of layers or a pattern like 'LLLG'")
    types = sliding_layer_types(cfg, where, pattern)
    return {**out, "layer_types": types, "sliding_window": window,
            "nope_layers": tuple(i for i, t in enumerate(types) if t == "full")}


def _mla_fields(arch: str, cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Multi-head latent attention's (DeepSeek-V2/V3, GLM-4.7-Flash): the latent's and the query's ranks, a head's
    dims without RoPE and with (in interleaved pairs unless ``rope_interleave`` is false; DeepSeek-V2's always), the
    value's; the softmax scale times YaRN's mscale(mscale_all_dim) squared, as transformers' yarn_apply_mscale."""
    refuse_set(cfg, where, {"attention_bias": "biases on the latent attention's projections"})
    nope = check_int("qk_nope_head_dim", cfg.get("qk_nope_head_dim", 128), 1)
    rope = check_int("qk_rope_head_dim", cfg.get("qk_rope_head_dim", 64), 2)
    scale = (nope + rope) ** -0.5
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        factor = check_float("rope_scaling.factor", params.get("factor"), 0.0, lo_open=True)
        mscale_all = check_float("rope_scaling.mscale_all_dim", params["mscale_all_dim"], 0.0)
        scale *= yarn_mscale(factor, mscale_all) ** 2
    q_rank = cfg.get("q_lora_rank")
    return {"kv_lora_rank": check_int("kv_lora_rank", cfg.get("kv_lora_rank", 512), 1),
            "q_lora_rank": 0 if q_rank is None else check_int("q_lora_rank", q_rank, 1),
            "head_dim": nope + rope, "rotary_dim": rope, "num_kv_heads": cfg["num_attention_heads"],
            "v_head_dim": check_int("v_head_dim", cfg.get("v_head_dim", 128), 1), "query_scale": scale,
            "rope_interleaved": arch == "deepseek_v2"
            or check_bool("rope_interleave", cfg.get("rope_interleave", True))}


def _intermediate_size(arch: str, cfg: dict[str, Any]) -> int:
    """The MLP's width: config.json's, or what the architecture's config class computes from it (LFM2 adjusts
    ``block_ff_dim`` to 2/3, times ``block_ffn_dim_multiplier``, up to a multiple of ``block_multiple_of``); a
    Qwen3.5-MoE config has none (every layer's MLP is its experts)."""
    if arch == "qwen3_5_moe" and not cfg.get("intermediate_size"):
        return int(cfg["moe_intermediate_size"])
    if arch == "granitemoehybrid" and not cfg.get("num_local_experts", 8):  # the shared MLP is the layer's
        return int(cfg.get("shared_intermediate_size", 1024))
    if arch != "lfm2":
        return int(cfg["intermediate_size"])
    width = cfg.get("block_ff_dim", cfg.get("intermediate_size"))
    if not is_int(width):
        raise KestrelError("LFM2's intermediate_size (or block_ff_dim) must be an integer")
    if cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            width = int(check_float("block_ffn_dim_multiplier", multiplier, 0.0, lo_open=True) * width)
        step = check_int("block_multiple_of", cfg.get("block_multiple_of", 256), 1)
        width = step * ((width + step - 1) // step)
    return width


def _nope_layers(cfg: dict[str, Any], where: str) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: ``no_rope_layers`` (per layer, 1: RoPE, 0: none), else every
    ``no_rope_layer_interval``-th layer (default 4), as SmolLM3Config computes it."""
    layers = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        check_int("no_rope_layer_interval", interval, 1)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or not all(f in (0, 1) for f in flags):
        raise KestrelError(f"{where}: no_rope_layers must be a 0/1 flag for each of the {layers} layers")
    return tuple(i for i, f in enumerate(flags) if not f)


def _rope_scaling(arch: str, cfg: dict[str, Any], scaling: Any, where: str) -> dict[str, Any] | None:
    """The rope scaling as transformers resolves it: a top-level original_max_position_embeddings wins over the
    scaling's own (Phi3Config always has one, 4096 by default)."""
    original = cfg.get("original_max_position_embeddings", 4096 if arch == "phi3" else None)
    return normalize_rope_scaling(scaling, where, max_position=cfg.get("max_position_embeddings", 4096),
                                  original_max_position=original)


def _dots1_window(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """dots.llm1's sliding layers, as Dots1Config makes them: ``layer_types``, else every layer from
    ``max_window_layers`` on where ``sliding_window`` is set (the released config: none)."""
    window, layers = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", layers)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)]
    kinds = named_layers(types, {"sliding_attention": "sliding", "full_attention": "full"}, where)
    return {"layer_types": kinds, "sliding_window": window} if "sliding" in kinds else {}


def _minimax_m2_fields(cfg: dict[str, Any], head_dim: int, where: str) -> dict[str, Any]:
    """MiniMax-M2's attention: RMSNorm over the whole q and k projections (``qk_norm_type`` per_layer; released
    checkpoints' ``use_qk_norm``), and RoPE on ``rotary_dim`` of each head's dims (the released checkpoints' legacy
    spelling of partial_rotary_factor)."""
    if not check_bool("use_qk_norm", cfg.get("use_qk_norm", True)):
        raise KestrelError(f"{where}: use_qk_norm false is not supported (kestrel's MiniMax-M2 norms q and k)")
    if cfg.get("qk_norm_type", "per_layer") != "per_layer":
        raise KestrelError(f"{where}: qk_norm_type {cfg.get('qk_norm_type')!r} is not supported (kestrel's "
                           "MiniMax-M2 norms the whole q and k projections: per_layer)")
    out: dict[str, Any] = {"qk_norm": True, "qk_norm_full": True}
    rotary = cfg.get("rotary_dim")
    if rotary is not None and "partial_rotary_factor" not in cfg:
        check_int("rotary_dim", rotary, 2, head_dim)
        if rotary % 2:
            raise KestrelError(f"{where}: rotary_dim {rotary} is odd; RoPE turns pairs of dims")
        out["rotary_dim"] = None if rotary == head_dim else rotary
    return out


def _rotary_dim(cfg: dict[str, Any], head_dim: int, where: str, default: float | None = None) -> int | None:
    """The dims of a head RoPE turns, from partial_rotary_factor (else ``default``, the architecture's; None: all)."""
    partial = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", default))
    if partial is None or partial == 1:
        return None
    check_float("partial_rotary_factor", partial, 0.0, 1.0, lo_open=True)
    dim = int(head_dim * partial)
    if dim < 2 or dim % 2:
        raise KestrelError(f"{where}: partial_rotary_factor {partial!r} turns {dim} of each head's {head_dim} dims; "
                           "RoPE needs an even number")
    return dim


# transformers' GenerationConfig defaults: a value equal to its default is no recommendation (vLLM reads the file
# the same way, through ``to_diff_dict``)
_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def generation_sampling(generation: dict[str, Any] | None) -> dict[str, Any] | None:
    """The sampling generation_config.json recommends (None: none): its SAMPLING_FIELDS that differ from
    transformers' defaults, and with ``do_sample`` its temperature even at the default (1.0), which kestrel's
    own default (greedy) is not."""
    if not isinstance(generation, dict):
        return None
    sampled = generation.get("do_sample") is True
    try:
        return recommended_sampling({k: generation[k] for k in SAMPLING_FIELDS if generation.get(k) is not None
                                     and (generation[k] != _GENERATION_DEFAULTS[k] or sampled and k == "temperature")}
                                    | ({"temperature": 1.0} if sampled and generation.get("temperature") is None
                                       else {}))
    except ValidationError as exc:
        raise KestrelError(f"generation_config.json: {exc}") from None


def _tied(arch: str, cfg: dict[str, Any]) -> bool:
    """tie_word_embeddings, defaulting as the architecture's transformers config does (LFM2's also read as
    tie_embedding, the name LiquidAI's configs use)."""
    default = arch in TIED_BY_DEFAULT
    if arch in ("lfm2", "lfm2_moe"):
        default = check_bool("tie_embedding", cfg.get("tie_embedding", default))
    return check_bool("tie_word_embeddings", cfg.get("tie_word_embeddings", default))


def config_from_hf(cfg: dict[str, Any], generation: dict[str, Any] | None = None,
                   where: str = "config.json") -> ModelConfig:
    """A ModelConfig from HF's config.json dict (and generation_config.json, whose eos ids are added)."""
    if not isinstance(cfg, dict):
        raise KestrelError(f"{where}: expected a JSON object")
    cfg = _text_config(cfg, where)
    check_hf_config(cfg, where)  # types and ranges before int()/float() can coerce true, "3" or 3.5
    arch = _architecture(cfg, where)
    if cfg.get("mlp_bias"):
        raise KestrelError(f"{where}: mlp_bias is not supported")
    if arch in ("llama", "smollm3", "granite", "granitemoehybrid", *POST_NORMED, "gemma2", "gemma3", "qwen3",
                "qwen3_moe", "dots1", *COHERE_ARCHITECTURES) and cfg.get("attention_bias"):
        raise KestrelError(f"{where}: {arch} attention_bias (with an o_proj bias) is not supported")
    if cfg.get("is_causal") is False:
        raise KestrelError(f"{where}: is_causal false (bidirectional attention) is not supported")
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3") and cfg.get("use_sliding_window"):
        raise KestrelError(f"{where}: {arch} use_sliding_window (sliding-window attention from layer "
                           f"max_window_layers on) is not supported")
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers 5 moves rope_theta / rope_scaling into rope_parameters
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", rope.get("type", "default")) != "default"
                                              else None)
        if arch == "gpt_oss" and scaling is None:
            scaling = GPT_OSS_ROPE
        eos = _ids(cfg.get("eos_token_id"))
        check_token_ids(generation or {}, "eos_token_id", "generation_config.json")
        for extra in _ids((generation or {}).get("eos_token_id")):
            if extra not in eos:
                eos.append(extra)
        fields: dict[str, Any] = {
            "rope_theta": float(cfg.get("rope_theta", rope.get("rope_theta", ROPE_THETAS.get(arch, 1e4)))),
            "rope_scaling": None if arch in GEMMA_ARCHITECTURES else _rope_scaling(arch, cfg, scaling, where),
            "rotary_dim": _rotary_dim(cfg, int(cfg.get("head_dim") or hidden // heads), where,
                                      {"glm4": 0.5, "glm4_moe": 0.5, "qwen3_5": 0.25, "qwen3_5_moe": 0.25,
                                       "qwen3_next": 0.25}.get(arch)),
            "qk_norm": arch == "qwen3",
            "qkv_bias": arch in ("qwen2", "qwen2_moe"),
            "sliding_window": cfg.get("sliding_window") if arch in WINDOWED else None,
        }
        if arch in GEMMA_ARCHITECTURES:
            fields.update(_gemma_fields(arch, cfg, where))
        elif cfg.get("hidden_act", "silu") not in ("silu", "swish"):  # what every other architecture gates by
            raise KestrelError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported ({arch} gates its MLP "
                               "by SiLU)")
        if arch == "smollm3":
            fields["nope_layers"] = _nope_layers(cfg, where)
        if arch in ("olmo2", "olmo3"):  # norms after each block, and q/k norms over the whole projection
            fields.update(qk_norm=True, qk_norm_full=True, pre_norms=False, post_norms=True)
        if arch == "olmo3":
            fields.update(_olmo3_fields(cfg, where))
        if arch == "exaone4":
            fields.update(_exaone4_fields(cfg, where))
        if arch in COHERE_ARCHITECTURES:
            fields.update(hf_cohere.cohere_fields(arch, cfg, where))
        if arch == "glm4":  # interleaved RoPE pairs, Gemma's four norms, q/k/v biases (gate|up fused: _FUSED_MAP)
            fields.update(rope_interleaved=True, post_norms=True,
                          qkv_bias=check_bool("attention_bias", cfg.get("attention_bias", True)))
        if arch == "ministral3":  # Mistral's layers, YaRN, and Llama 4's attention temperature past the pretraining
            fields.update(_attention_temperature(rope or cfg.get("rope_scaling") or {}, where))  # context
        if arch in ("ernie4_5", "ernie4_5_moe"):  # Llama's layers with RoPE in interleaved pairs
            refuse_set(cfg, where, {"use_bias": "biases on every projection"})
            fields["rope_interleaved"] = True
        if arch == "seed_oss":  # Llama's layers with q/k/v biases (attention_bias) and maybe an o bias
            fields.update(qkv_bias=check_bool("attention_bias", cfg.get("attention_bias", True)),
                          o_bias=check_bool("attention_out_bias", cfg.get("attention_out_bias", False)))
        if arch == "granitemoehybrid":
            fields.update(hf_hybrid.granite_hybrid_fields(cfg, where))
        if arch in ("granite", "granitemoehybrid"):  # their four multipliers (GraniteConfig's defaults: 1)
            fields.update({name: check_float(key, cfg.get(key, 1.0), 0.0, lo_open=True) for key, name in (
                ("embedding_multiplier", "embed_scale"), ("attention_multiplier", "query_scale"),
                ("residual_multiplier", "residual_scale"), ("logits_scaling", "logits_scaling"))})
        if arch in HYBRID_ARCHITECTURES:
            fields.update(hf_hybrid.qwen3_5_fields(cfg, where))
        if arch in ("lfm2", "lfm2_moe"):
            fields.update(hf_hybrid.lfm2_fields(cfg, where))
        if arch == "dots1":  # Qwen3's attention (per-head q/k norms), sliding from layer max_window_layers on
            fields.update(qk_norm=True, **_dots1_window(cfg, where))
        if arch == "minimax_m2":  # Qwen3-MoE's layers with q/k norms over the whole projection, partial RoPE
            fields.update(_minimax_m2_fields(cfg, int(cfg.get("head_dim") or hidden // heads), where))
        if arch == "glm4_moe":  # q/k/v biases and q/k norms where set
            fields.update(qkv_bias=check_bool("attention_bias", cfg.get("attention_bias", False)),
                          qk_norm=check_bool("use_qk_norm", cfg.get("use_qk_norm", False)))
        if arch in ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_moe", "qwen3_next", "glm4_moe",
                    "ernie4_5_moe", "lfm2_moe", "minimax_m2", "dots1", *MLA_ARCHITECTURES):
            fields.update(hf_experts.moe_fields(arch, cfg, where))
        if arch in MLA_ARCHITECTURES:
            fields.update(_mla_fields(arch, cfg, where))
        if arch == "gpt_oss":  # sinks, and alternating sliding and full layers
            fields.update(attn_sinks=True, layer_types=sliding_layer_types(cfg, where, 2),
                          sliding_window=cfg.get("sliding_window", 128))
        return ModelConfig(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=_intermediate_size(arch, cfg),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            **{"num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
               "head_dim": int(cfg.get("head_dim") or hidden // heads),
               "rms_norm_eps": float(cfg.get("rms_norm_eps", cfg.get("norm_eps", 1e-6))),  # LFM2: norm_eps
               "max_position": int(cfg.get("max_position_embeddings", 4096)), **fields},
            tie_word_embeddings=_tied(arch, cfg),
            bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
            eos_token_ids=tuple(eos),
            sampling=generation_sampling(generation),
        )
    except KeyError as exc:
        raise KestrelError(f"{where}: missing {exc.args[0]!r}") from None
    except ValidationError as exc:
        raise KestrelError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise KestrelError(f"{where}: bad value ({exc})") from None


def read_hf_config(model_dir: Path) -> ModelConfig:
    gen_path = model_dir / "generation_config.json"
    generation = read_json(check_regular_file(gen_path, model_dir)) if gen_path.is_file() else None
    config_path = check_regular_file(model_dir / "config.json", model_dir)
    return config_from_hf(read_json(config_path), generation, str(config_path))


# sentence-transformers' Pooling modes kestrel pools by (config key -> kestrel's name)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KestrelError(f"{path}: file not found") from None
    except OSError as exc:
        raise os_error(exc, "cannot read", path) from None
    except UnicodeDecodeError as exc:
        raise KestrelError(f"{path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise KestrelError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise KestrelError(f"{path}: expected a JSON object")
    return data
