"""A Hugging Face config's Cohere decoder as ModelConfig fields: Command R, Command R+, Aya 23 and Aya Expanse
(``CohereForCausalLM``), Command R7B and Command A (``Cohere2ForCausalLM``), and the language model of Aya Vision
(``AyaVisionForConditionalGeneration``: Command R7B's for the 8B, Aya Expanse's for the 32B). model/hf_config.py
reads the rest of the config.
"""

from __future__ import annotations

from typing import Any

from kestrel_core.errors import KestrelError
from kestrel_core.model.validate import MAX_POSITION, check_bool, check_float, check_int, sliding_layer_types

# CohereConfig's and Cohere2Config's defaults (the same) of what a text_config may leave out: Aya Vision's hub
# configs give little more than the sizes of its layers
TEXT_DEFAULTS = {
    "vocab_size": 256000,
    "hidden_size": 8192,
    "intermediate_size": 22528,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "max_position_embeddings": 8192,
    "bos_token_id": 5,
    "eos_token_id": 255001,
}
# Aya Vision's language model by its text_config's model_type
_AYA_VISION_LANGUAGE_MODELS = {"cohere": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM"}


def aya_vision_language_model(text: dict[str, Any] | None, where: str) -> str:
    """The causal LM an Aya Vision checkpoint's ``text`` config (None: it has none) describes, as AyaVisionConfig
    builds it: Cohere2's without a text_config, Llama's for one without a model_type (refused, as any but Cohere's)."""
    kind = "cohere2" if text is None else text.get("model_type", "llama")
    if kind not in _AYA_VISION_LANGUAGE_MODELS:
        raise KestrelError(
            f"{where}: Aya Vision's text_config model_type {kind!r} is not supported (kestrel reads "
            f"its Cohere language models: {', '.join(_AYA_VISION_LANGUAGE_MODELS)})"
        )
    return _AYA_VISION_LANGUAGE_MODELS[kind]


def cohere_fields(arch: str, cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Cohere's, as transformers' CohereForCausalLM and Cohere2ForCausalLM run them: LayerNorms without a bias
    (``layer_norm_eps``), the attention and the MLP in parallel from one norm, RoPE in interleaved pairs, the logits
    times ``logit_scale``. Command R: the context ``model_max_length`` where config.json has one (as llama.cpp
    reads it: Command R's and R+'s first releases were trained to 131072 positions, their max_position_embeddings
    8192), per-head q/k norms with a weight a head where ``use_qk_norm``. Cohere2: ``head_dim`` is hidden / heads,
    sliding layers (``layer_types``, else every ``sliding_window_pattern``-th layer full) with RoPE and full ones
    without; with no ``sliding_window``, no layer slides or turns."""
    out: dict[str, Any] = {
        "norm_type": "layer",
        "parallel_block": True,
        "rope_interleaved": True,
        "rms_norm_eps": check_float("layer_norm_eps", cfg.get("layer_norm_eps", 1e-5), 0.0, 1.0, lo_open=True),
        "logits_scaling": 1 / check_float("logit_scale", cfg.get("logit_scale", 0.0625), 0.0, lo_open=True),
    }
    layers = cfg["num_hidden_layers"]
    if arch == "cohere":
        qk = check_bool("use_qk_norm", cfg.get("use_qk_norm", False))
        if cfg.get("model_max_length") is not None:
            out["max_position"] = check_int("model_max_length", cfg["model_max_length"], 1, MAX_POSITION)
        return {**out, "qk_norm": qk, "qk_norm_heads": qk}
    out["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    window = cfg.get("sliding_window", 4096)
    if window is None:
        return {**out, "nope_layers": tuple(range(layers))}
    pattern = check_int("sliding_window_pattern", cfg.get("sliding_window_pattern", 4), 1)
    types = sliding_layer_types(cfg, where, pattern)
    return {
        **out,
        "layer_types": types,
        "sliding_window": window,
        "nope_layers": tuple(i for i, t in enumerate(types) if t == "full"),
    }
