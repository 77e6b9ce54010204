"""Read a Hugging Face model directory: config.json (+ generation_config.json) and *.safetensors shards.

Tensors are read lazily, one at a time, and handed out under kestrel names (see quantize.TensorSource).
numpy has no bfloat16, and safetensors' numpy framework refuses BF16 tensors, so those are read as raw
uint16 at the offsets of the safetensors header: the quantizer takes those bits (contract.BFloat16Bits) and
widens them a row at a time; ``get`` widens them to float32 (bf16 is the top half of an f32).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from kestrel_core.contract import BFloat16Bits
from kestrel_core.errors import KestrelError
from kestrel_core.model.config import SAMPLING_FIELDS, ModelConfig, normalize_rope_scaling, recommended_sampling
from kestrel_core.model.quantize import fused_rows, layer_name, map_tensor_name
from kestrel_core.model.validate import (
    ValidationError,
    check_bool,
    check_float,
    check_hf_config,
    check_int,
    check_regular_file,
    is_int,
)
from kestrel_core.model.weights import expert_field

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                    "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
                    "Gemma3ForCausalLM": "gemma3",
                    "Gemma3ForConditionalGeneration": "gemma3", "Qwen2MoeForCausalLM": "qwen2_moe",
                    "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral", "GptOssForCausalLM": "gpt_oss",
                    "SmolLM3ForCausalLM": "smollm3", "GraniteForCausalLM": "granite", "Olmo2ForCausalLM": "olmo2",
                    "Exaone4ForCausalLM": "exaone4", "SeedOssForCausalLM": "seed_oss",
                    "Glm4ForCausalLM": "glm4", "Ernie4_5ForCausalLM": "ernie4_5",
                    # the decoder without its head, as embedding checkpoints (e5-mistral, ...) name it
                    "LlamaModel": "llama", "Qwen2Model": "qwen2", "Qwen3Model": "qwen3", "MistralModel": "mistral"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "phi3": "phi3",
               "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3", "qwen2_moe": "qwen2_moe",
               "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "gpt_oss": "gpt_oss",
               "smollm3": "smollm3", "granite": "granite", "olmo2": "olmo2", "exaone4": "exaone4",
               "seed_oss": "seed_oss", "glm4": "glm4", "ernie4_5": "ernie4_5"}
WINDOWED = ("mistral", "phi3", "mixtral")  # architectures whose sliding_window applies to every layer
# Gemma3TextConfig's defaults: hub configs (the text_config of the multimodal checkpoints) leave many out
GEMMA3_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                   "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
                   "sliding_window": 4096, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1}
GEMMA_NORMS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm", "final_norm")
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # Gemma2Config's defaults

_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
# Gemma 2 and 3 name their four norms by position around the attention and the MLP
_GEMMA_LAYER_MAP = {**_LAYER_MAP, "post_attention_layernorm.weight": "post_attn_norm",
                     "pre_feedforward_layernorm.weight": "mlp_norm",
                     "post_feedforward_layernorm.weight": "post_mlp_norm"}
# OLMo 2 and EXAONE 4 norm the attention's and the MLP's outputs, not their inputs
POST_NORMED = ("olmo2", "exaone4")
_OLMO2_LAYER_MAP = {**_LAYER_MAP, "post_attention_layernorm.weight": "post_attn_norm",
                    "post_feedforward_layernorm.weight": "post_mlp_norm"}
# GLM-4's four norms: before and after the attention, before (its post_attention_layernorm) and after the MLP
_GLM4_LAYER_MAP = {**_LAYER_MAP, "post_self_attn_layernorm.weight": "post_attn_norm",
                   "post_mlp_layernorm.weight": "post_mlp_norm"}
# the router and the experts of Qwen3-MoE (mlp.*) and Mixtral (block_sparse_moe.*, w1/w3/w2 = gate/up/down)
_EXPERT_RE = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_FIELDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")
# gpt-oss: the attention's output bias and sinks, the router's bias
_GPT_OSS_MAP = {"self_attn.o_proj.bias": "o_bias", "self_attn.sinks": "sinks", "mlp.router.bias": "router_bias"}
# gpt-oss's experts, stacked [E, ...] in one tensor each: gate|up interleaved by row ([E, D, 2F], or MXFP4 blocks
# [E, 2F, D/32, 16] and scales [E, 2F, D/32]), down ([E, F, D], or MXFP4 [E, D, F/32, 16]), and their biases
_GPT_OSS_EXPERTS = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
# transformers' GptOssConfig default RoPE, for a config.json without one
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
# Qwen2-MoE's shared expert and its gate
_SHARED_MAP = {"mlp.shared_expert.gate_proj.weight": "shared_expert.gate",
               "mlp.shared_expert.up_proj.weight": "shared_expert.up",
               "mlp.shared_expert.down_proj.weight": "shared_expert.down",
               "mlp.shared_expert_gate.weight": "shared_expert_gate"}
# the language model inside a multimodal checkpoint (Gemma3ForConditionalGeneration), as transformers 4 and 5
# name it
_LM_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                ("language_model.lm_head.", "lm_head."),
                # a decoder saved without its head (embedding checkpoints): no ``model.`` prefix
                ("layers.", "model.layers."), ("embed_tokens.", "model.embed_tokens."), ("norm.", "model.norm."))
# Phi-3 checkpoints hold Q|K|V and gate|up as one tensor each: rows split into these kestrel tensors
_FUSED_MAP = {"self_attn.qkv_proj.weight": ("q", "k", "v"), "mlp.gate_up_proj.weight": ("gate", "up")}
_GLOBAL_MAP = {"model.embed_tokens.weight": "embedding", "model.norm.weight": "final_norm",
               "lm_head.weight": "lm_head"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)  # FP4 E2M1 by code, as the OCP MX format defines it
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def kestrel_name(hf_name: str, arch: str = "llama") -> str | None:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``layers.3.q`` (``...mlp.experts.5.up_proj.weight`` ->
    ``layers.3.experts.5.up``); None for tensors kestrel does not use."""
    for prefix, plain in _LM_PREFIXES:
        if hf_name.startswith(prefix):
            hf_name = plain + hf_name[len(prefix):]
            break
    m = _LAYER_RE.match(hf_name)
    if m is not None:
        e = _EXPERT_RE.match(m.group(2))
        if e is not None:
            return layer_name(int(m.group(1)), expert_field(int(e.group(1)), _EXPERT_FIELDS[e.group(2)]))
        if m.group(2) in _ROUTERS:
            return layer_name(int(m.group(1)), "router")
        if m.group(2) in _SHARED_MAP:
            return layer_name(int(m.group(1)), _SHARED_MAP[m.group(2)])
        if arch == "gpt_oss" and m.group(2) in _GPT_OSS_MAP:
            return layer_name(int(m.group(1)), _GPT_OSS_MAP[m.group(2)])
    layer_map = (_GEMMA_LAYER_MAP if arch in GEMMA_ARCHITECTURES else _OLMO2_LAYER_MAP if arch in POST_NORMED
                 else _GLM4_LAYER_MAP if arch == "glm4" else _LAYER_MAP)
    return map_tensor_name(hf_name, _GLOBAL_MAP, _LAYER_RE, layer_map)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KestrelError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KestrelError(f"{path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise KestrelError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise KestrelError(f"{path}: expected a JSON object")
    return data


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


def _is_gemma3(cfg: dict[str, Any]) -> bool:
    """Gemma 3 by name, before the config's types are checked (check_hf_config refuses bad ones next)."""
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs:
        return any(HF_ARCHITECTURES.get(a) == "gemma3" for a in archs if isinstance(a, str))
    return MODEL_TYPES.get(cfg.get("model_type")) == "gemma3" if isinstance(cfg.get("model_type"), str) else False


def _text_config(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The language model's settings: a multimodal Gemma 3's text_config (with its own defaults), or cfg."""
    if not _is_gemma3(cfg):
        return cfg
    text = cfg.get("text_config", cfg)
    if not isinstance(text, dict):
        raise KestrelError(f"{where}: text_config must be an object, got {text!r}")
    out = {**GEMMA3_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    out["architectures"] = ["Gemma3ForCausalLM"]
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):  # the outer config's win
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    return out


def _refuse_set(cfg: dict[str, Any], where: str, keys: dict[str, str]) -> None:
    """Refuse, by name, each of ``keys`` (config key -> what it is) the config sets to a truthy value."""
    for key, what in keys.items():
        if cfg.get(key):
            raise KestrelError(f"{where}: {key} ({what}) is not supported")


def _gemma_fields(arch: str, cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Gemma 2's and 3's own ModelConfig fields: layer types, RoPE (Gemma 3: a base per layer type), the query
    and embedding scales; Gemma 2's soft-capping."""
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise KestrelError(f"{where}: hidden_activation {act!r} is not supported (Gemma uses gelu_pytorch_tanh)")
    _refuse_set(cfg, where, {"use_bidirectional_attention": "bidirectional attention"})
    out: dict[str, Any] = {}
    if arch == "gemma3":
        _refuse_set(cfg, where, {"final_logit_softcapping": "tanh soft-capping of the logits",
                                 "attn_logit_softcapping": "tanh soft-capping of attention scores"})
    else:
        for key, name in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
            cap = cfg.get(key, GEMMA2_SOFTCAPS[key])
            out[name] = None if cap is None else check_float(key, cap, 0.0, lo_open=True)
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6 if arch == "gemma3" else 2))
    check_int("sliding_window_pattern", pattern, 1)
    types = _layer_types(cfg, where, pattern)
    rp = cfg.get("rope_parameters")
    if arch == "gemma2":  # one RoPE for every layer
        theta = cfg.get("rope_theta", (rp or {}).get("rope_theta", 1e4))
        scaling = cfg.get("rope_scaling") or (rp if (rp or {}).get("rope_type", "default") != "default" else None)
    elif isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        theta, local_theta = full.get("rope_theta", 1e6), local.get("rope_theta", 1e4)
        scaling = full if full.get("rope_type", "default") != "default" else None
        if local.get("rope_type", "default") != "default":
            raise KestrelError(f"{where}: rope scaling of the sliding layers is not supported")
        out["rope_local_theta"] = check_float("rope_local_base_freq", local_theta, 0.0, lo_open=True)
    else:
        theta, scaling = cfg.get("rope_theta", 1e6), cfg.get("rope_scaling")
        out["rope_local_theta"] = check_float("rope_local_base_freq", cfg.get("rope_local_base_freq", 1e4), 0.0,
                                              lo_open=True)
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
    types = _layer_types(cfg, where, pattern)
    return {**out, "layer_types": types, "sliding_window": window,
            "nope_layers": tuple(i for i, t in enumerate(types) if t == "full")}


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


def _moe_fields(arch: str, cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The experts of Qwen2-MoE and Qwen3-MoE (moe_intermediate_size wide, norm_topk_prob as set; Qwen2-MoE's
    shared expert) and Mixtral (intermediate_size wide, always renormalised)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
        raise KestrelError(f"{where}: missing 'num_experts'")
    out = {"num_experts": experts, "experts_per_token": cfg.get("num_experts_per_tok", 2)}
    if arch in ("qwen2_moe", "qwen3_moe"):
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise KestrelError(f"{where}: mlp_only_layers / decoder_sparse_step (dense MLP layers between the "
                               "expert layers) are not supported")
        if arch == "qwen3_moe":
            _refuse_set(cfg, where, {"shared_expert_intermediate_size": "a shared expert"})
        else:
            shared = cfg.get("shared_expert_intermediate_size", 0)
            check_int("shared_expert_intermediate_size", shared, 0)
            out["shared_expert_intermediate_size"] = shared
        norm = cfg.get("norm_topk_prob", False)
        check_bool("norm_topk_prob", norm)
        out.update(expert_intermediate_size=cfg.get("moe_intermediate_size"), norm_topk_prob=norm,
                   qk_norm=arch == "qwen3_moe")
    elif arch == "gpt_oss":  # softmax over the top-k logits (renormalised), biases everywhere, sinks
        bias = cfg.get("attention_bias", True)
        check_bool("attention_bias", bias)
        limit = check_float("swiglu_limit", cfg.get("swiglu_limit", 7.0), 0.0, lo_open=True)
        alpha = check_float("swiglu_alpha", cfg.get("swiglu_alpha", 1.702), 0.0, lo_open=True)
        out.update(expert_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True, moe_bias=True,
                   qkv_bias=bias, o_bias=bias, attn_sinks=True, activation="swiglu_oai", swiglu_limit=limit,
                   swiglu_alpha=alpha, layer_types=_layer_types(cfg, where, 2),
                   sliding_window=cfg.get("sliding_window", 128))
    else:
        out.update(expert_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    return out


def _layer_types(cfg: dict[str, Any], where: str, pattern: int) -> tuple[str, ...]:
    """config.json's layer_types, or every ``pattern``-th layer global and the others sliding."""
    types = cfg.get("layer_types")
    if types is None:
        layers = cfg["num_hidden_layers"]
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    if not isinstance(types, list) or not all(t in names for t in types):
        raise KestrelError(f"{where}: layer_types must be a list of sliding_attention / full_attention")
    return tuple(names[t] for t in types)


# transformers' GenerationConfig defaults: a value equal to its default is no recommendation (vLLM reads the file
# the same way, through ``to_diff_dict``)
_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def generation_sampling(generation: dict[str, Any] | None) -> dict[str, Any] | None:
    """The sampling generation_config.json recommends (None: none): its SAMPLING_FIELDS that differ from
    transformers' defaults."""
    if not isinstance(generation, dict):
        return None
    try:
        return recommended_sampling({k: generation[k] for k in SAMPLING_FIELDS
                                     if generation.get(k) is not None and generation[k] != _GENERATION_DEFAULTS[k]})
    except ValidationError as exc:
        raise KestrelError(f"generation_config.json: {exc}") from None


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
    if arch in ("llama", "smollm3", "granite", *POST_NORMED, "gemma2", "gemma3") and cfg.get("attention_bias"):
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
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if arch == "gpt_oss" and scaling is None:
            scaling = GPT_OSS_ROPE
        eos = _ids(cfg.get("eos_token_id"))
        for extra in _ids((generation or {}).get("eos_token_id")):
            if extra not in eos:
                eos.append(extra)
        fields: dict[str, Any] = {
            "rope_theta": float(cfg.get("rope_theta", rope.get("rope_theta", 150000.0 if arch == "gpt_oss" else 1e4))),
            "rope_scaling": None if arch in GEMMA_ARCHITECTURES else _rope_scaling(arch, cfg, scaling, where),
            "rotary_dim": _rotary_dim(cfg, int(cfg.get("head_dim") or hidden // heads), where,
                                      0.5 if arch == "glm4" else None),
            "qk_norm": arch == "qwen3",
            "qkv_bias": arch in ("qwen2", "qwen2_moe"),
            "sliding_window": cfg.get("sliding_window") if arch in WINDOWED else None,
        }
        if arch in GEMMA_ARCHITECTURES:
            fields.update(_gemma_fields(arch, cfg, where))
        if arch == "smollm3":
            fields["nope_layers"] = _nope_layers(cfg, where)
        if arch == "olmo2":  # norms after each block, and q/k norms over the whole projection
            fields.update(qk_norm=True, qk_norm_full=True, pre_norms=False, post_norms=True)
        if arch == "exaone4":
            fields.update(_exaone4_fields(cfg, where))
        if arch == "glm4":  # interleaved RoPE pairs, Gemma's four norms, q/k/v biases (gate|up fused: _FUSED_MAP)
            fields.update(rope_interleaved=True, post_norms=True,
                          qkv_bias=check_bool("attention_bias", cfg.get("attention_bias", True)))
        if arch == "ernie4_5":  # Llama's layers with RoPE in interleaved pairs
            _refuse_set(cfg, where, {"use_bias": "biases on every projection"})
            fields["rope_interleaved"] = True
        if arch == "seed_oss":  # Llama's layers with q/k/v biases (attention_bias) and maybe an o bias
            fields.update(qkv_bias=check_bool("attention_bias", cfg.get("attention_bias", True)),
                          o_bias=check_bool("attention_out_bias", cfg.get("attention_out_bias", False)))
        if arch == "granite":  # its four multipliers (GraniteConfig's defaults: 1)
            fields.update({name: check_float(key, cfg.get(key, 1.0), 0.0, lo_open=True) for key, name in (
                ("embedding_multiplier", "embed_scale"), ("attention_multiplier", "query_scale"),
                ("residual_multiplier", "residual_scale"), ("logits_scaling", "logits_scaling"))})
        if arch in ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss"):
            fields.update(_moe_fields(arch, cfg, where))
        return ModelConfig(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
            eos_token_ids=tuple(eos),
            sampling=generation_sampling(generation),
            **fields,
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
_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_OTHER_POOLING = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens")


def sentence_transformers_pooling(model_dir: Path) -> tuple[str, bool] | None:
    """(pooling, normalized) of a sentence-transformers directory (modules.json: the model, a Pooling module,
    maybe a Normalize), None for a directory without modules.json; other modules are refused by name."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    try:
        modules = json.loads(check_regular_file(path, model_dir).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KestrelError(f"{path}: cannot read it ({exc})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                and isinstance(m.get("path", ""), str) for m in modules):
        raise KestrelError(f"{path}: expected a list of modules with a type and a path")
    pooling, normalized = None, False
    for module in modules:
        kind = module["type"].rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling = _st_pooling_mode(check_regular_file(model_dir / module["path"] / "config.json", model_dir))
        elif kind == "Normalize":
            normalized = True
        elif kind != "Transformer" or module.get("path", "") != "":
            raise KestrelError(f"{path}: module {module['type']} at {module.get('path')!r} is not supported "
                               "(kestrel reads the model itself, Pooling and Normalize)")
    if pooling is None:
        raise KestrelError(f"{path}: no Pooling module")
    return pooling, normalized


def _st_pooling_mode(path: Path) -> str:
    cfg = read_json(path)
    other = [k for k in _ST_OTHER_POOLING if cfg.get(k)]
    modes = [mode for key, mode in _ST_POOLING.items() if cfg.get(key)]
    if other or len(modes) != 1:
        named = ", ".join(other) if other else f"{len(modes)} modes"
        raise KestrelError(f"{path}: pooling by {named} is not supported (kestrel pools by one of "
                           f"{', '.join(_ST_POOLING)})")
    return modes[0]


def _safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, the header dict) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def weight_files(model_dir: Path) -> list[str]:
    """The safetensors files of a checkpoint: the shards its index names, else every ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(check_regular_file(index, model_dir)).get("weight_map")
        if not isinstance(weight_map, dict):
            raise KestrelError(f"{index}: no weight_map")
        shards = sorted({str(v) for v in weight_map.values()})
        for shard in shards:
            if "/" in shard or "\\" in shard or shard.startswith("."):
                raise KestrelError(f"{index}: shard name {shard!r} points outside the model directory")
            if not (model_dir / shard).is_file():
                raise KestrelError(f"{model_dir}: shard {shard} named by the index is missing")
            check_regular_file(model_dir / shard, model_dir)  # a symlink out of the directory is refused
        return shards
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not shards:
        if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
            raise KestrelError(f"{model_dir}: only pickle checkpoints (.bin/.pt) found; kestrel reads "
                               "safetensors only (pickle files can run code)")
        raise KestrelError(f"{model_dir}: no *.safetensors weights found")
    for shard in shards:  # a FIFO would block safe_open; a symlink out of the directory is refused
        check_regular_file(model_dir / shard, model_dir)
    return shards


class HFCheckpoint:
    """A HF model directory as a TensorSource (float tensors by kestrel name, read on demand)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self.description = str(self.dir)
        if not (self.dir / "config.json").is_file():
            raise KestrelError(f"{self.dir}: not a Hugging Face model directory (no config.json)")
        self.config = read_hf_config(self.dir)
        self._files: dict[str, Path] = {}  # kestrel name -> shard
        self._hf_names: dict[str, str] = {}  # kestrel name -> HF name
        self._rows: dict[str, tuple[int, int]] = {}  # kestrel name -> its rows of a fused HF tensor
        self._expert_part: dict[str, tuple[int, str]] = {}  # kestrel name -> (expert, part) of a stacked tensor
        self._paths: dict[str, Path] = {}  # HF name -> shard
        self._handles: dict[Path, Any] = {}
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}
        self._index()
        self.fp4_experts = any(name.endswith("_blocks") for name in self._paths)  # gpt-oss as OpenAI ships it
        pooling = sentence_transformers_pooling(self.dir)
        if pooling is not None:  # an embedding model; its unused output head, often left out, is the embedding's
            tied = self.config.tie_word_embeddings or not self.has("lm_head")
            self.config = replace(self.config, pooling=pooling[0], normalize_embeddings=pooling[1],
                                  tie_word_embeddings=tied)

    def _index(self) -> None:
        for shard in weight_files(self.dir):
            path = self.dir / shard
            for hf_name in self._handle(path).keys():
                self._paths[hf_name] = path
                for name, rows in self._names(hf_name):
                    self._files[name] = path
                    self._hf_names[name] = hf_name
                    if rows is not None:
                        self._rows[name] = rows

    def _names(self, hf_name: str) -> list[tuple[str, tuple[int, int] | None]]:
        """The kestrel tensors ``hf_name`` holds: one, or the row ranges of a fused Q|K|V / gate|up."""
        name = kestrel_name(hf_name, self.config.arch)
        if name is not None:
            return [(name, None)]
        m = _LAYER_RE.match(hf_name)
        stacked = _GPT_OSS_EXPERTS.match(m.group(2)) if m is not None and self.config.arch == "gpt_oss" else None
        if stacked is not None:
            proj, suffix = stacked.groups()
            if suffix == "_scales":  # read beside its blocks
                return []
            parts = ("gate", "up") if proj == "gate_up_proj" else ("down",)
            if suffix == "_bias":
                parts = tuple(f"{p}_bias" for p in parts)
            out = []
            for e in range(self.config.num_experts):
                for part in parts:
                    name = layer_name(int(m.group(1)), expert_field(e, part))
                    self._expert_part[name] = (e, part)
                    out.append((name, None))
            return out
        if m is None or m.group(2) not in _FUSED_MAP:
            return []
        out, start = [], 0
        for member in _FUSED_MAP[m.group(2)]:
            rows = self.config.rows_of(member)
            out.append((layer_name(int(m.group(1)), member), (start, start + rows)))
            start += rows
        return out

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="numpy")
            except SafetensorError as exc:
                raise KestrelError(f"{path}: truncated or corrupt safetensors file ({exc})") from None
            except OSError as exc:
                raise KestrelError(f"{path}: cannot read it ({exc.strerror or exc})") from None
        return self._handles[path]

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 or float16 (BF16 widened exactly to float32); Gemma's norms as the factor they
        multiply by, 1 + weight in float32 (its RMSNorm's ``1.0 + self.weight.float()``)."""
        t = self.get_weight(name)
        t = t.to_float32() if isinstance(t, BFloat16Bits) else t
        if self.config.arch in GEMMA_ARCHITECTURES and name.rsplit(".", 1)[-1] in GEMMA_NORMS:
            return np.float32(1) + t.astype(np.float32)
        return t

    def get_weight(self, name: str) -> np.ndarray | BFloat16Bits:
        """Like get, but a BF16 tensor stays its raw bits: the quantizer widens it a row at a time."""
        if name not in self._files:
            raise KestrelError(f"{self.dir}: the checkpoint has no tensor for {name} "
                               f"({_hf_name_hint(name)})")
        path, hf_name = self._files[name], self._hf_names[name]
        if name in self._expert_part:
            return self._expert_tensor(name, path, hf_name)
        handle = self._handle(path)
        dtype = handle.get_slice(hf_name).get_dtype()
        rows = self._rows.get(name)
        try:
            if dtype == "BF16":
                bits = self._bf16_bits(path, hf_name)
                return BFloat16Bits(bits if rows is None else fused_rows(bits, rows, str(path), hf_name))
            if dtype not in _FLOAT_DTYPES:
                raise KestrelError(f"{path}: tensor {hf_name} has dtype {dtype}; kestrel reads BF16, F16, F32")
            t = handle.get_tensor(hf_name)
        except SafetensorError as exc:
            raise KestrelError(f"{path}: cannot read tensor {hf_name} ({exc})") from None
        t = t if rows is None else fused_rows(t, rows, str(path), hf_name)
        return t if t.dtype in (np.float32, np.float16) else t.astype(np.float32)

    def _expert_tensor(self, name: str, path: Path, hf_name: str) -> np.ndarray:
        """One expert's part of gpt-oss's stacked tensors, float32 in kestrel's orientation: gate [F, D] (the
        even rows of gate|up as transformers computes x @ W), up [F, D] (the odd ones), down [D, F], or a bias."""
        e, part = self._expert_part[name]
        try:
            if hf_name.endswith("_blocks"):
                rows = self._mxfp4_rows(path, hf_name, e)  # [2F, D] or [D, F]
                return np.ascontiguousarray(rows[0::2] if part == "gate" else rows[1::2] if part == "up" else rows)
            t = self._stacked_slice(path, hf_name, e)
        except SafetensorError as exc:
            raise KestrelError(f"{path}: cannot read tensor {hf_name} ({exc})") from None
        if t.ndim != (1 if part.endswith("_bias") else 2):
            raise KestrelError(f"{path}: tensor {hf_name} has {t.ndim + 1} dimensions")
        if part in ("gate", "up"):  # [D, 2F]: gate and up interleaved by column
            t = t[:, 0::2].T if part == "gate" else t[:, 1::2].T
        elif part == "down":  # [F, D]
            t = t.T
        elif part in ("gate_bias", "up_bias"):
            t = t[0::2] if part == "gate_bias" else t[1::2]
        return np.ascontiguousarray(t, dtype=np.float32)

    def _stacked_slice(self, path: Path, hf_name: str, e: int) -> np.ndarray:
        """Expert ``e``'s slice of a stacked tensor [E, ...] as float32."""
        dtype = self._handle(path).get_slice(hf_name).get_dtype()
        if dtype == "BF16":
            return BFloat16Bits(np.ascontiguousarray(self._bf16_bits(path, hf_name)[e])).to_float32()
        if dtype not in _FLOAT_DTYPES:
            raise KestrelError(f"{path}: tensor {hf_name} has dtype {dtype}; kestrel reads BF16, F16, F32")
        return np.asarray(self._handle(path).get_slice(hf_name)[e:e + 1][0], dtype=np.float32)

    def _mxfp4_rows(self, path: Path, hf_name: str, e: int) -> np.ndarray:
        """Expert ``e``'s rows [N, K] of MXFP4 blocks [E, N, K/32, 16] (two FP4 E2M1 codes a byte, the low
        nibble first) and their power-of-two scales [E, N, K/32] (E8M0, bias 127), as transformers decodes them."""
        scales_name = hf_name.removesuffix("_blocks") + "_scales"
        if scales_name not in self._paths:
            raise KestrelError(f"{path}: {hf_name} has no {scales_name} beside it")
        blocks_slice = self._handle(path).get_slice(hf_name)
        scales_slice = self._handle(self._paths[scales_name]).get_slice(scales_name)
        if blocks_slice.get_dtype() != "U8" or scales_slice.get_dtype() != "U8":
            raise KestrelError(f"{path}: MXFP4 tensors {hf_name} and {scales_name} must be U8")
        blocks, scales = blocks_slice[e:e + 1][0], scales_slice[e:e + 1][0]  # [N, G, 16], [N, G]
        if blocks.ndim != 3 or blocks.shape[2] != 16 or scales.shape != blocks.shape[:2]:
            raise KestrelError(f"{path}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} of "
                               f"{hf_name} do not match")
        values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # [N, G, 16, 2]
        with np.errstate(over="ignore"):  # E8M0's 255 (NaN) overflows to inf, which the quantizer refuses by name
            scale = np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
        values = values.reshape(*scales.shape, 32) * scale
        return values.reshape(scales.shape[0], -1).astype(np.float32)

    def _bf16_bits(self, path: Path, hf_name: str) -> np.ndarray:
        """The tensor's bfloat16 bit patterns, uint16 in its shape, mapped from the file at the header's offsets."""
        if path not in self._headers:
            self._headers[path] = _safetensors_header(path)
        base, header = self._headers[path]
        entry = header[hf_name]
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != 2 * count:
            raise KestrelError(f"{path}: tensor {hf_name} has {end - start} bytes for shape {list(shape)}")
        if base + end > path.stat().st_size:
            raise KestrelError(f"{path}: truncated while reading {hf_name}")
        # mapped, not read: the quantizer reads the page cache itself, and the mapping (its pages in this
        # process's RSS) goes with the array
        raw = np.memmap(path, dtype="<u2", mode="r", offset=base + start, shape=(count,))
        return raw.astype(np.uint16, copy=False).reshape(shape)  # native order for the kernels


def _hf_name_hint(name: str) -> str:
    for hf, kn in _GLOBAL_MAP.items():
        if kn == name:
            return hf
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    if m:
        for hf, kn in _LAYER_MAP.items():
            if kn == m.group(2):
                return f"model.layers.{m.group(1)}.{hf}"
    return name
