"""A Hugging Face config's hybrid decoder as ModelConfig fields: the kind of each layer and the fields of its
recurrent ones, for Qwen3.5 and Qwen3-Next (Gated DeltaNet linear attention), LFM2 (gated short convolutions) and
Granite 4.0-H (Mamba-2). model/hf_config.py reads the rest of the config.
"""

from __future__ import annotations

import math
from typing import Any

from kestrel_core.errors import KestrelError
from kestrel_core.model.validate import check_bool, check_int, named_layers, refuse_set


def qwen3_5_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Qwen3.5's: linear-attention layers (layer_types, else every ``full_attention_interval``-th layer full), their
    Gated DeltaNet's heads, dims and convolution, gated full attention with per-head q/k norms. Its interleaved
    multimodal RoPE turns text positions as plain RoPE does (every section gets the same position)."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise KestrelError(f"{where}: hidden_act {act!r} is not supported (Qwen3.5 uses silu)")
    refuse_set(cfg, where, {"attention_bias": "biases on the attention's projections"})
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        check_int("full_attention_interval", interval, 1)
        types = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(cfg["num_hidden_layers"])]
    types = named_layers(types, {"linear_attention": "linear", "full_attention": "full"}, where)
    return {"layer_types": types, "qk_norm": True, "attn_output_gate": True,
            "linear_key_heads": cfg["linear_num_key_heads"], "linear_key_dim": cfg["linear_key_head_dim"],
            "linear_value_heads": cfg["linear_num_value_heads"], "linear_value_dim": cfg["linear_value_head_dim"],
            "linear_conv_kernel": cfg["linear_conv_kernel_dim"]}


def lfm2_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """LFM2's: gated short-convolution layers (``conv_L_cache`` wide) beside attention with per-head q/k norms, as
    ``layer_types`` (or the attention layers ``full_attn_idxs``) says."""
    refuse_set(cfg, where, {"conv_bias": "biases on the short convolutions and their projections"})
    types = cfg.get("layer_types")
    if types is None:
        full = cfg.get("full_attn_idxs")
        if not isinstance(full, list):
            raise KestrelError(f"{where}: missing 'layer_types' (or 'full_attn_idxs')")
        types = ["full_attention" if i in full else "conv" for i in range(cfg["num_hidden_layers"])]
    return {"layer_types": named_layers(types, {"conv": "conv", "full_attention": "full"}, where), "qk_norm": True,
            "short_conv_kernel": check_int("conv_L_cache", cfg.get("conv_L_cache", 3), 1)}


GRANITE_HYBRID_LAYERS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full", "full_attention": "full"}


def granite_hybrid_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Granite 4.0-H's: Mamba-2 layers beside attention (without RoPE unless position_embedding_type says rope), its
    MLP the shared one (``shared_intermediate_size`` wide: the layer's MLP, or beside routed experts an ungated
    shared expert; experts ``intermediate_size`` wide, their top-k logits softmaxed)."""
    refuse_set(cfg, where, {"mamba_proj_bias": "biases on the Mamba-2 projections"})
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise KestrelError(f"{where}: hidden_act {act!r} is not supported (Granite 4.0-H uses silu)")
    limit = cfg.get("time_step_limit")
    if limit is not None and (not isinstance(limit, list) or len(limit) != 2 or limit[0] != 0
                              or limit[1] not in (math.inf, {"__float__": "Infinity"})):
        raise KestrelError(f"{where}: time_step_limit {limit!r} is not supported (kestrel clamps no time step)")
    types = cfg.get("layer_types", cfg.get("layers_block_type"))
    types = named_layers(types, GRANITE_HYBRID_LAYERS, where)
    hidden, heads = cfg["hidden_size"], check_int("mamba_n_heads", cfg.get("mamba_n_heads", 128), 1)
    inner = check_int("mamba_expand", cfg.get("mamba_expand", 2), 1) * hidden
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else check_int("mamba_d_head", head_dim, 1)
    if heads * head_dim != inner:
        raise KestrelError(f"{where}: mamba_n_heads {heads} x mamba_d_head {head_dim} is not mamba_expand x "
                           f"hidden_size ({inner})")
    rope = cfg.get("position_embedding_type") == "rope"
    out: dict[str, Any] = {
        "layer_types": types, "nope_layers": () if rope else tuple(i for i, t in enumerate(types) if t == "full"),
        "mamba_heads": heads, "mamba_head_dim": head_dim,
        "mamba_groups": check_int("mamba_n_groups", cfg.get("mamba_n_groups", 1), 1),
        "mamba_state": check_int("mamba_d_state", cfg.get("mamba_d_state", 256), 1),
        "mamba_conv_kernel": check_int("mamba_d_conv", cfg.get("mamba_d_conv", 4), 1),
        "mamba_conv_bias": check_bool("mamba_conv_bias", cfg.get("mamba_conv_bias", True))}
    experts = check_int("num_local_experts", cfg.get("num_local_experts", 8), 0)
    if experts:
        out.update(num_experts=experts, experts_per_token=cfg.get("num_experts_per_tok", 2),
                   expert_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                   shared_expert_intermediate_size=cfg.get("shared_intermediate_size", 1024),
                   shared_expert_gated=False)
    return out
