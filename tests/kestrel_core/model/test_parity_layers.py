"""Logits parity (parity.py) and each architecture's layer rules, shown needed (done wrong, agreement drops): sliding
windows and soft caps, fused and named projections, norms, biases and multipliers, the experts' routing (and
gpt-oss's sinks, biases and clamp), and the integer checkpoints' layouts."""

from __future__ import annotations

import numpy as np
import pytest

import kestrel_core
from kestrel_core.model import bnb, int_quant

from .parity import CASES, FIXTURES, MOE, TINY, Golden, _with_config, measure


def test_mistral_without_its_sliding_window_leaves_the_limits(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The window is what makes tiny-mistral agree: attending to every position instead fails the limits."""
    from kestrel_core.model import hf_config

    real = hf_config.config_from_hf

    def no_window(cfg, *args, **kwargs):  # type: ignore[no-untyped-def]
        return real({**cfg, "sliding_window": None}, *args, **kwargs)

    monkeypatch.setattr(hf_config, "config_from_hf", no_window)
    case = next(c for c in CASES if c.name == "tiny-mistral")
    fig = measure(case, "q8")
    assert not fig.within(TINY), fig


def test_phi3_with_gate_and_up_swapped_leaves_the_limits(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The fused gate_up_proj split is what makes tiny-phi3 agree: reading up before gate fails the limits."""
    from kestrel_core.model import hf

    monkeypatch.setitem(hf._FUSED_MAP, "mlp.gate_up_proj.weight", ("up", "gate"))
    case = next(c for c in CASES if c.name == "tiny-phi3")
    fig = measure(case, "q8")
    assert not fig.within(TINY), fig


GEMMA3_WRONG = {
    "norms as plain weights, not 1 + w": lambda mp: mp.setattr("kestrel_core.model.hf.GEMMA_NORMS", ()),
    "every layer global": lambda mp: _with_config(mp, lambda c: {**c, "layer_types": ["full_attention"] * 6}),
    "query scale of head_dim 256": lambda mp: _with_config(mp, lambda c: {**c, "query_pre_attn_scalar": 256}),
    "the sliding layers' RoPE on the global base": lambda mp: _with_config(mp, lambda c: {**c, "rope_parameters": {
        **c["rope_parameters"], "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}}),
}


def test_gemma2_without_its_soft_caps_agrees_less(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Gemma 2's tanh soft-capping: without the logits' cap tiny-gemma2 leaves the limits (median 0.45 of the
    range); without the attention scores' cap its largest error triples and its median nearly doubles (measured
    0.035 -> 0.110 and 0.0135 -> 0.0249)."""
    case = next(c for c in CASES if c.name == "tiny-gemma2")
    right = measure(case, "q8")
    with pytest.MonkeyPatch.context() as mp:
        _with_config(mp, lambda c: {**c, "final_logit_softcapping": None})
        assert not measure(case, "q8").within(TINY)
    _with_config(monkeypatch, lambda c: {**c, "attn_logit_softcapping": None})
    wrong = measure(case, "q8")
    assert wrong.max_rel > 2 * right.max_rel and wrong.median_rel > 1.5 * right.median_rel, (right, wrong)


@pytest.mark.parametrize("wrong", GEMMA3_WRONG, ids=list(GEMMA3_WRONG))
def test_gemma3_done_wrong_leaves_the_limits(monkeypatch, wrong: str) -> None:  # type: ignore[no-untyped-def]
    """Each of Gemma 3's own rules is needed for tiny-gemma3 to agree."""
    GEMMA3_WRONG[wrong](monkeypatch)
    fig = measure(next(c for c in CASES if c.name == "tiny-gemma3"), "q8")
    assert not fig.within(TINY), fig


OLMO2_WRONG = {"no q/k norms": ("q_norm", "k_norm"), "no norm after the attention": ("post_attn_norm",),
               "no norm after the MLP": ("post_mlp_norm",)}


@pytest.mark.parametrize("wrong", OLMO2_WRONG)
def test_olmo2_done_wrong_leaves_the_limits(wrong: str) -> None:
    """OLMo 2's norms, each needed (measured: top-1 0.10-0.30, median 0.29-0.55 of the range without one)."""
    from dataclasses import replace

    from kestrel_core.model.loader import load_model

    loaded = load_model(str(FIXTURES / "tiny-olmo2"), quant="q8", cache="off")
    for layer in loaded.model.layers:
        for field in OLMO2_WRONG[wrong]:
            setattr(layer, field, None)
    config = loaded.model.config
    if "q_norm" in OLMO2_WRONG[wrong]:
        config = replace(config, qk_norm=False, qk_norm_full=False)
    golden = Golden(FIXTURES / "tiny-olmo2" / "golden.npz")
    with kestrel_core.load(replace(loaded, model=replace(loaded.model, config=config)), backend="cpu",
                           activations="q8") as engine:
        fig = golden.figures(engine.logits(golden.ids))
    assert not fig.within(TINY), fig


GRANITE_WRONG = {"embedding_multiplier": 1.0, "attention_multiplier": 16 ** -0.5, "residual_multiplier": 1.0,
                 "logits_scaling": 1.0}


@pytest.mark.parametrize("field", GRANITE_WRONG)
def test_granite_without_a_multiplier_leaves_the_limits(monkeypatch, field: str) -> None:  # type: ignore[no-untyped-def]
    """Each of Granite's multipliers is needed (left at its Llama value, measured: top-1 0.18-1.00, median
    0.04-0.29 of the range)."""
    _with_config(monkeypatch, lambda c: {**c, field: GRANITE_WRONG[field]})
    fig = measure(next(c for c in CASES if c.name == "tiny-granite"), "q8")
    assert not fig.within(TINY), fig


def test_seed_oss_without_its_biases_leaves_the_limits(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Seed-OSS's q/k/v biases left out (measured: top-1 0.075, max 0.71, median 0.47 at q8)."""
    _with_config(monkeypatch, lambda c: {**c, "attention_bias": False})
    fig = measure(next(c for c in CASES if c.name == "tiny-seed-oss"), "q8")
    assert not fig.within(TINY), fig


MOE_WRONG = {
    ("tiny-qwen3-moe", "top-1 routing"): lambda c: {**c, "num_experts_per_tok": 1},
    ("tiny-mixtral", "top-1 routing"): lambda c: {**c, "num_experts_per_tok": 1},
    ("tiny-qwen2-moe", "no shared expert"): lambda c: {**c, "shared_expert_intermediate_size": 0},
}


@pytest.mark.parametrize(("name", "wrong"), list(MOE_WRONG), ids=[f"{n}-{w}" for n, w in MOE_WRONG])
def test_moe_routed_wrong_leaves_the_limits(monkeypatch, name: str, wrong: str) -> None:  # type: ignore[no-untyped-def]
    """The router's top-k and its weight normalisation are what make the MoE models agree."""
    _with_config(monkeypatch, MOE_WRONG[(name, wrong)])
    fig = measure(next(c for c in CASES if c.name == name), "q8")
    assert not fig.within(MOE), fig


def test_mixtral_with_w1_and_w3_swapped_leaves_the_limits(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Mixtral's w1 is the gate and w3 the up projection: read the other way round, agreement drops."""
    from kestrel_core.model import hf

    monkeypatch.setitem(hf._EXPERT_FIELDS, "w1", "up")
    monkeypatch.setitem(hf._EXPERT_FIELDS, "w3", "gate")
    fig = measure(next(c for c in CASES if c.name == "tiny-mixtral"), "q8")
    assert not fig.within(MOE), fig


def test_qwen3_moe_without_renormalised_weights_agrees_less(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """norm_topk_prob: the top-k weights summed to 1. Ignored, the model stays near (two experts' outputs only
    shrink), but its largest error about triples (measured: 0.024 -> 0.071 of the range)."""
    case = next(c for c in CASES if c.name == "tiny-qwen3-moe")
    right = measure(case, "q8")
    _with_config(monkeypatch, lambda c: {**c, "norm_topk_prob": False})
    wrong = measure(case, "q8")
    assert wrong.max_rel > 2 * right.max_rel, (right, wrong)


def _without(field: str):  # type: ignore[no-untyped-def]
    def drop(layer) -> None:  # type: ignore[no-untyped-def]
        for part in (layer, *layer.experts):
            if hasattr(part, field):
                setattr(part, field, None)
    return drop


def _experts_unbiased(layer) -> None:  # type: ignore[no-untyped-def]
    for expert in layer.experts:
        expert.gate_bias = expert.up_bias = expert.down_bias = None


GPT_OSS_WRONG = {
    "no attention sinks": _without("sinks"),
    "no output bias": _without("o_bias"),
    "no router bias": _without("router_bias"),
    "no expert biases": _experts_unbiased,
}
GPT_OSS_WRONG_CONFIG = {
    "SwiGLU not clamped": lambda c: {**c, "swiglu_limit": 1e6},
    "every layer global": lambda c: {**c, "layer_types": ["full_attention"] * c["num_hidden_layers"]},
}


@pytest.mark.parametrize("wrong", [*GPT_OSS_WRONG, *GPT_OSS_WRONG_CONFIG])
def test_gpt_oss_done_wrong_leaves_the_limits(monkeypatch, wrong: str) -> None:  # type: ignore[no-untyped-def]
    """Each of gpt-oss's own rules is needed: its sinks, its biases, its clamp, its sliding layers."""
    from kestrel_core.model.loader import load_model

    if wrong in GPT_OSS_WRONG_CONFIG:
        _with_config(monkeypatch, GPT_OSS_WRONG_CONFIG[wrong])
    loaded = load_model(str(FIXTURES / "tiny-gpt-oss"), quant="q8", cache="off")
    for layer in loaded.model.layers:
        GPT_OSS_WRONG.get(wrong, lambda layer: None)(layer)
    golden = Golden(FIXTURES / "tiny-gpt-oss" / "golden.npz")
    with kestrel_core.load(loaded, backend="cpu", activations="q8") as engine:
        fig = golden.figures(engine.logits(golden.ids))
    assert not fig.within(MOE), fig


INT_WRONG = {
    ("tiny-qwen3-awq", "AWQ's codes in column order"): lambda mp: mp.setattr(int_quant, "AWQ_ORDER", np.arange(8)),
    ("tiny-qwen3-gptq", "GPTQ's zero points as stored"): lambda mp: mp.setitem(int_quant.GPTQ_FORMATS, "gptq", 0),
    ("tiny-llama-gptq-int8", "GPTQ's zero points as stored"): lambda mp: mp.setitem(int_quant.GPTQ_FORMATS, "gptq",
                                                                                   0),
    ("tiny-qwen3-gptq", "act-order's g_idx ignored"): lambda mp: mp.setattr(
        int_quant, "_groups_of", lambda k, groups, size, g_idx, where, real=int_quant._groups_of: real(
            k, groups, size, None, where)),
    ("tiny-qwen3-bnb-4bit", "NF4's nibbles low first"): lambda mp: mp.setattr(
        bnb, "dequantize_4bit", lambda packed, *a, real=bnb.dequantize_4bit: real((packed << 4) | (packed >> 4), *a)),
    ("tiny-qwen3-bnb-4bit", "the scales' nested offset left out"): lambda mp: mp.setattr(
        bnb, "quant_state", lambda raw, where, real=bnb.quant_state: {**real(raw, where), "nested_offset": 0.0}),
    ("tiny-qwen3-moe-w4a16", "codes without their offset"): lambda mp: mp.setattr(
        int_quant, "_weight", lambda packed, bits, zeros, *a, real=int_quant._weight: real(
            packed, bits, zeros - (1 << (bits - 1)), *a)),
}


@pytest.mark.parametrize(("name", "wrong"), list(INT_WRONG), ids=[f"{n}-{w}" for n, w in INT_WRONG])
def test_an_integer_checkpoint_decoded_wrong_leaves_the_limits(monkeypatch, name: str, wrong: str) -> None:  # type: ignore[no-untyped-def]
    """Each rule of the GPTQ, AWQ and compressed-tensors layouts is needed for their twins to agree."""
    case = next(c for c in CASES if c.name == name)
    INT_WRONG[(name, wrong)](monkeypatch)
    fig = measure(case, "q8")
    assert not fig.within(case.limits("q8")), fig
