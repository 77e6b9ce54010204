"""A Hugging Face config's mixture of experts as ModelConfig fields, as transformers resolves each architecture's:
its experts' count, top-k and width, its router (softmax or sigmoid, a choice bias, groups, a scale), its shared
experts and the dense layers among the expert layers. model/hf_config.py reads the rest of the config.
"""

from __future__ import annotations

from typing import Any

from kestrel_core.errors import KestrelError
from kestrel_core.model.validate import check_bool, check_float, check_int, is_int


def moe_fields(arch: str, cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The experts of Qwen2-MoE and Qwen3-MoE (moe_intermediate_size wide, norm_topk_prob as set; Qwen2-MoE's
    shared expert; dense layers among them), Mixtral (intermediate_size wide, always renormalised), gpt-oss,
    Qwen3.5-MoE and Qwen3-Next, GLM-4.5, ERNIE 4.5, MiniMax-M2 and dots.llm1 (their routers choose with a bias)."""
    if arch == "ernie4_5_moe":
        return _ernie_moe_fields(cfg, where)
    experts = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
    if experts is None:
        raise KestrelError(f"{where}: missing 'num_experts'")
    out = {"num_experts": experts, "experts_per_token": cfg.get("num_experts_per_tok", 2)}
    if arch in ("glm4_moe", "glm4_moe_lite", "deepseek_v3"):
        if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise KestrelError(f"{where}: topk_method {cfg.get('topk_method')!r} with scoring_func "
                               f"{cfg.get('scoring_func')!r} is not supported (kestrel's {arch} router is noaux_tc, "
                               "sigmoid)")
        return {**out, **_sigmoid_router_fields(cfg, where, 3 if arch == "deepseek_v3" else 1)}
    if arch == "deepseek_v2":
        return {**out, **_deepseek_v2_router_fields(cfg, where)}
    if arch == "dots1":  # DeepSeek-V3's router and shared experts; Dots1Config leaves the top k as chosen
        return {**out, **_sigmoid_router_fields(cfg, where, 0),
                "norm_topk_prob": check_bool("norm_topk_prob", cfg.get("norm_topk_prob", False))}
    if arch == "minimax_m2":  # every layer's experts intermediate_size wide, chosen by a sigmoid router (with a bias
        scoring = cfg.get("scoring_func", "sigmoid")  # where use_routing_bias), the top k always renormalised
        if scoring != "sigmoid":
            raise KestrelError(f"{where}: scoring_func {scoring!r} is not supported (kestrel's MiniMax-M2 router is "
                               "a sigmoid)")
        return {**out, "expert_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True,
                "router_scoring": "sigmoid",
                "router_choice_bias": check_bool("use_routing_bias", cfg.get("use_routing_bias", True))}
    if arch == "lfm2_moe":  # LFM2's layers, the first num_dense_layers dense; a sigmoid router with a choice bias
        return {**out, "expert_intermediate_size": cfg.get("moe_intermediate_size", 1792),
                "dense_layers": tuple(range(min(cfg.get("num_dense_layers", 2), cfg["num_hidden_layers"]))),
                "norm_topk_prob": check_bool("norm_topk_prob", cfg.get("norm_topk_prob", True)),
                "router_scoring": "sigmoid",
                "router_choice_bias": check_bool("use_expert_bias", cfg.get("use_expert_bias", True)),
                "routed_scaling": cfg.get("routed_scaling_factor", 1.0)}
    if arch in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        out["dense_layers"] = _sparse_step_dense_layers(cfg, where)
        if arch == "qwen3_moe" and cfg.get("shared_expert_intermediate_size"):
            raise KestrelError(f"{where}: shared_expert_intermediate_size (a shared expert) is not supported")
        else:
            shared = cfg.get("shared_expert_intermediate_size", 0)
            check_int("shared_expert_intermediate_size", shared, 0)
            out["shared_expert_intermediate_size"] = shared
        norm = cfg.get("norm_topk_prob", arch == "qwen3_next")  # Qwen3NextConfig's default: true
        check_bool("norm_topk_prob", norm)
        out.update(expert_intermediate_size=cfg.get("moe_intermediate_size"), norm_topk_prob=norm,
                   qk_norm=arch in ("qwen3_moe", "qwen3_next"))
    elif arch == "qwen3_5_moe":  # Qwen2-MoE's shared expert, the top-k always renormalised
        shared = cfg.get("shared_expert_intermediate_size", 512)
        check_int("shared_expert_intermediate_size", shared, 0)
        out.update(expert_intermediate_size=cfg.get("moe_intermediate_size", 512), norm_topk_prob=True,
                   shared_expert_intermediate_size=shared)
    elif arch == "gpt_oss":  # softmax over the top-k logits (renormalised), biases everywhere, the clamped SwiGLU
        bias = cfg.get("attention_bias", True)
        check_bool("attention_bias", bias)
        limit = check_float("swiglu_limit", cfg.get("swiglu_limit", 7.0), 0.0, lo_open=True)
        alpha = check_float("swiglu_alpha", cfg.get("swiglu_alpha", 1.702), 0.0, lo_open=True)
        out.update(expert_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True, moe_bias=True,
                   qkv_bias=bias, o_bias=bias, activation="swiglu_oai", swiglu_limit=limit, swiglu_alpha=alpha)
    else:
        out.update(expert_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    return out


def _sparse_step_dense_layers(cfg: dict[str, Any], where: str) -> tuple[int, ...]:
    """Qwen2-MoE's dense layers: those of ``mlp_only_layers``, and those not on a ``decoder_sparse_step``."""
    layers, only, step = cfg["num_hidden_layers"], cfg.get("mlp_only_layers") or [], cfg.get("decoder_sparse_step", 1)
    if not isinstance(only, list) or not all(is_int(i) and 0 <= i < layers for i in only):
        raise KestrelError(f"{where}: mlp_only_layers must be layer indices below {layers}, got {only!r}")
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def _sigmoid_router_fields(cfg: dict[str, Any], where: str, dense_default: int) -> dict[str, Any]:
    """GLM-4.5's, GLM-4.7-Flash's and DeepSeek-V3's experts: the first ``first_k_dense_replace`` layers dense (or
    those ``mlp_layer_types`` says), a sigmoid router with a choice bias, groups and a scale, shared experts as one
    ungated expert ``n_shared_experts`` times as wide."""
    width = cfg.get("moe_intermediate_size", 1408)
    return {**_shared_dense_fields(cfg, where, width, dense_default),
            "norm_topk_prob": check_bool("norm_topk_prob", cfg.get("norm_topk_prob", True)),
            "router_scoring": "sigmoid", "router_choice_bias": True, "router_groups": cfg.get("n_group", 1),
            "router_topk_groups": cfg.get("topk_group", 1), "routed_scaling": cfg.get("routed_scaling_factor", 1.0)}


def _deepseek_v2_router_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """DeepSeek-V2's experts: a softmax router choosing the top k of every expert (``topk_method`` greedy), its
    weights the chosen probabilities (never renormalised) times routed_scaling_factor; shared experts and dense layers
    as DeepSeek-V3's."""
    method = cfg.get("topk_method", "greedy")
    if method != "greedy":
        raise KestrelError(f"{where}: topk_method {method!r} is not supported (kestrel's DeepSeek-V2 router is greedy)")
    freq = cfg.get("moe_layer_freq", 1)
    if freq != 1:
        raise KestrelError(f"{where}: moe_layer_freq {freq!r} is not supported (experts in every layer past "
                           "first_k_dense_replace)")
    return {**_shared_dense_fields(cfg, where, cfg.get("moe_intermediate_size", 1407), 0),
            "routed_scaling": cfg.get("routed_scaling_factor", 1.0)}


def _shared_dense_fields(cfg: dict[str, Any], where: str, width: Any, dense_default: int) -> dict[str, Any]:
    """DeepSeek's experts ``width`` wide, its ungated shared experts as one ``n_shared_experts`` times as wide, and its
    dense layers: ``mlp_layer_types`` ("dense" / "sparse" a layer), else the first ``first_k_dense_replace``."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise KestrelError(f"{where}: hidden_act {act!r} is not supported (kestrel's DeepSeek-style experts use silu)")
    layers = cfg["num_hidden_layers"]
    types = cfg.get("mlp_layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or not set(types) <= {"dense", "sparse"}:
            raise KestrelError(f"{where}: mlp_layer_types must be 'dense' or 'sparse' for each of the {layers} layers")
        dense = tuple(i for i, t in enumerate(types) if t == "dense")
    else:
        first = cfg.get("first_k_dense_replace", dense_default)
        dense = tuple(range(min(check_int("first_k_dense_replace", first, 0), layers)))
    return {"expert_intermediate_size": width,
            "shared_expert_intermediate_size": width * cfg.get("n_shared_experts", 1),
            "shared_expert_gated": False, "dense_layers": dense}


def _ernie_moe_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """ERNIE 4.5's experts: every ``moe_layer_interval``-th layer from ``moe_layer_start_index`` to
    ``moe_layer_end_index`` (-1: the last) a mixture of experts, the others dense; a softmax router whose choice
    adds a bias (``moe_statics``), the top-k renormalised; ``moe_num_shared_experts`` ungated shared experts as one
    that many times as wide."""
    layers, experts = cfg["num_hidden_layers"], cfg.get("moe_num_experts", 64)
    start, interval = cfg.get("moe_layer_start_index", 1), cfg.get("moe_layer_interval", 1)
    end = cfg.get("moe_layer_end_index", -1)
    if not is_int(end) or end < -1:
        raise KestrelError(f"{where}: moe_layer_end_index must be a layer index or -1, got {end!r}")
    end = layers - 1 if end == -1 else end
    width = cfg.get("moe_intermediate_size", 1536)
    return {"num_experts": experts, "experts_per_token": cfg.get("moe_k", 6), "expert_intermediate_size": width,
            "shared_expert_intermediate_size": width * cfg.get("moe_num_shared_experts", 2),
            "shared_expert_gated": False, "norm_topk_prob": True, "router_choice_bias": True,
            "dense_layers": tuple(i for i in range(layers) if (i + 1) % interval or not start <= i <= end)}
