"""Routers whose choice adds a bias, and dense layers among the experts: each rule of GLM-4.5's (DeepSeek-V3's
sigmoid router) and ERNIE 4.5's (a softmax one) is needed for tiny-glm4-moe and tiny-ernie4_5-moe to agree with
transformers; the choice by hand on small cases, the config checks, and Qwen2-MoE's dense layers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import kestrel_core
from kestrel_core.errors import KestrelError
from kestrel_core.model import hf_config, hf_experts
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.decoder import route
from kestrel_core.model.validate import ValidationError
from kestrel_core.model.weights import LayerWeights

from .parity import CASES, FIXTURES, _with_config, measure

GLM = next(c for c in CASES if c.name == "tiny-glm4-moe")
GLM_GGUF = next(c for c in CASES if c.name == "tiny-glm4-moe.gguf")


def _with_router(monkeypatch, reader: str, **fields) -> None:  # type: ignore[no-untyped-def]
    """Read a router's config (hf_experts' function ``reader``) with ``fields`` in place of its own."""
    real = getattr(hf_experts, reader)
    monkeypatch.setattr(hf_experts, reader, lambda *args: {**real(*args), **fields})


ERNIE = next(c for c in CASES if c.name == "tiny-ernie4_5-moe")
LFM2 = next(c for c in CASES if c.name == "tiny-lfm2-moe")
MINIMAX = next(c for c in CASES if c.name == "tiny-minimax-m2")
DOTS = next(c for c in CASES if c.name == "tiny-dots1")
WRONG = {  # (case, what is wrong): how
    (GLM, "a softmax router"): lambda mp: _with_router(mp, "_sigmoid_router_fields", router_scoring="softmax",
                                                       router_choice_bias=False, router_groups=1, router_topk_groups=1),
    (GLM, "no choice bias"): lambda mp: _with_router(mp, "_sigmoid_router_fields", router_choice_bias=False),
    (GLM, "no groups"): lambda mp: _with_config(mp, lambda c: {**c, "n_group": 1, "topk_group": 1}),
    (GLM, "unscaled weights"): lambda mp: _with_config(mp, lambda c: {**c, "routed_scaling_factor": 1.0}),
    (GLM, "no shared expert"): lambda mp: _with_config(mp, lambda c: {**c, "n_shared_experts": 0}),
    (ERNIE, "no choice bias"): lambda mp: _with_router(mp, "_ernie_moe_fields", router_choice_bias=False),
    (ERNIE, "no shared experts"): lambda mp: _with_config(mp, lambda c: {**c, "moe_num_shared_experts": 0}),
    (LFM2, "no choice bias"): lambda mp: _with_config(mp, lambda c: {**c, "use_expert_bias": False}),
    (LFM2, "a softmax router"): lambda mp: _with_router(mp, "moe_fields", router_scoring="softmax"),
    (MINIMAX, "no choice bias"): lambda mp: _with_config(mp, lambda c: {**c, "use_routing_bias": False}),
    (MINIMAX, "a softmax router"): lambda mp: _with_router(mp, "moe_fields", router_scoring="softmax"),
    (DOTS, "no choice bias"): lambda mp: _with_router(mp, "_sigmoid_router_fields", router_choice_bias=False),
    (DOTS, "unscaled weights"): lambda mp: _with_config(mp, lambda c: {**c, "routed_scaling_factor": 1.0}),
    (DOTS, "no shared expert"): lambda mp: _with_config(mp, lambda c: {**c, "n_shared_experts": 0}),
}


@pytest.mark.parametrize(("case", "wrong"), list(WRONG), ids=[f"{c.name}-{w}" for c, w in WRONG])
def test_a_router_done_wrong_leaves_the_limits(monkeypatch, case, wrong: str) -> None:  # type: ignore[no-untyped-def]
    """GLM-4.5's sigmoid, choice bias, groups, scale and shared expert, ERNIE 4.5's choice bias and shared experts,
    LFM2-MoE's and MiniMax-M2's choice bias and sigmoid, dots.llm1's choice bias, scale and shared expert: each one
    left out moves the logits past the case's limits."""
    WRONG[(case, wrong)](monkeypatch)
    fig = measure(case, "q8")
    assert not fig.within(case.limits("q8")), fig


def test_ernie4_5_moe_layers_with_experts_are_every_interval_th_from_the_start() -> None:
    """transformers' rule, (i + 1) % moe_layer_interval == 0 within [start, end]; the GGUF twin's by llama.cpp's
    leading_dense_block_count and interleave_moe_layer_step."""
    cfg = json.loads((FIXTURES / ERNIE.name / "config.json").read_text())
    assert hf_config.config_from_hf(cfg).dense_layers == (0, 2)
    c = hf_config.config_from_hf({**cfg, "num_hidden_layers": 8, "moe_layer_start_index": 2,
                                  "moe_layer_end_index": 6, "moe_layer_interval": 1})
    assert c.dense_layers == (0, 1, 7)
    with kestrel_core.load(str(FIXTURES / "tiny-ernie4_5-moe.gguf"), backend="cpu") as engine:
        assert engine.model.config.dense_layers == (0, 2) and engine.model.config.router_choice_bias


def test_glm4_moe_gguf_reads_its_router_and_skips_its_mtp_block() -> None:
    """The GGUF twin's config is the checkpoint's: llama.cpp's router metadata, the nextn block not a layer."""
    with kestrel_core.load(str(FIXTURES / GLM.name), backend="cpu") as hf, \
            kestrel_core.load(str(FIXTURES / GLM_GGUF.name), backend="cpu") as gguf:
        a, b = hf.model.config, gguf.model.config
        for field in ("num_layers", "dense_layers", "num_experts", "experts_per_token", "expert_intermediate_size",
                      "shared_expert_intermediate_size", "shared_expert_gated", "router_scoring",
                      "router_choice_bias", "router_groups", "router_topk_groups", "routed_scaling", "norm_topk_prob",
                      "qkv_bias", "qk_norm", "rotary_dim"):
            assert getattr(a, field) == getattr(b, field), field
        assert a.num_layers == 3 and a.dense_layers == (0,) and a.router_groups == 2
        assert not gguf.model.layers[0].experts and len(gguf.model.layers[1].experts) == 8


def _layer(router: np.ndarray, choice_bias: np.ndarray | None = None) -> LayerWeights:
    return LayerWeights(router=router.astype(np.float32),
                        router_choice_bias=None if choice_bias is None else choice_bias.astype(np.float32))


def _config(**fields) -> ModelConfig:  # type: ignore[no-untyped-def]
    base = dict(arch="glm4_moe", vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=1,
                num_kv_heads=1, head_dim=4, num_experts=4, experts_per_token=2, expert_intermediate_size=4)
    return ModelConfig(**{**base, **fields})


def test_sigmoid_route_chooses_by_biased_scores_and_weighs_by_plain_ones() -> None:
    """Logits 0, 1, 2, 3 (x = 1 against one-hot rows): sigmoid scores; a bias of +5 on expert 0 makes it chosen,
    but its weight is its own sigmoid(0) = 0.5, renormalised with expert 3's, then scaled."""
    x = np.array([[0.0, 1.0, 2.0, 3.0]], np.float32)
    router = np.eye(4)
    c = _config(router_scoring="sigmoid", router_choice_bias=True, norm_topk_prob=True, routed_scaling=2.0)
    top, weights = route(x, _layer(router, np.array([5.0, 0, 0, 0])), c)
    s = 1 / (1 + np.exp(-np.array([0.0, 3.0])))
    assert top.tolist() == [[0, 3]]
    np.testing.assert_allclose(weights, [2.0 * s / s.sum()], rtol=1e-6)


def test_sigmoid_route_keeps_to_the_best_groups() -> None:
    """Groups {0, 1} and {2, 3}: the second holds the best expert (3) but the first the best pair (2.0 + 1.9), so
    with one group kept both choices come from the first."""
    x = np.array([[2.0, 1.9, -3.0, 2.5]], np.float32)
    c = _config(router_scoring="sigmoid", router_groups=2, router_topk_groups=1)
    top, _ = route(x, _layer(np.eye(4)), c)
    assert top.tolist() == [[0, 1]]
    top, _ = route(x, _layer(np.eye(4)), _config(router_scoring="sigmoid"))
    assert top.tolist() == [[3, 0]]


@pytest.mark.parametrize(("fields", "says"), [
    ({"router_groups": 2}, "router_groups needs a sigmoid router"),
    ({"router_scoring": "sigmoid", "router_groups": 3}, "must divide"),
    ({"router_scoring": "sigmoid", "router_groups": 4}, "groups of two or more"),
    ({"router_scoring": "sigmoid", "router_groups": 2, "router_topk_groups": 1, "experts_per_token": 3},
     "keeps fewer experts"),
    ({"router_scoring": "tanh"}, "router_scoring must be one of"),
    ({"dense_layers": (2,)}, "dense_layers must be layer indices"),
    ({"routed_scaling": 0.0}, "routed_scaling must be >"),
])
def test_router_config_checks(fields: dict, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        _config(**fields)


MINIMAX_HUB = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 512,
               "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
               "rope_theta": 5e6, "rotary_dim": 8, "use_qk_norm": True, "qk_norm_type": "per_layer",
               "scoring_func": "sigmoid", "use_routing_bias": True}


def test_minimax_m2_hub_config_reads_its_legacy_fields() -> None:
    """The released MiniMax-M2 config.json: RoPE on ``rotary_dim`` of each head (no partial_rotary_factor), q/k
    norms over the whole projection, a sigmoid router with its choice bias, every layer's experts as wide as
    intermediate_size."""
    c = hf_config.config_from_hf(MINIMAX_HUB)
    assert (c.arch, c.rotary_dim, c.qk_norm, c.qk_norm_full) == ("minimax_m2", 8, True, True)
    assert (c.router_scoring, c.router_choice_bias, c.norm_topk_prob, c.dense_layers) == ("sigmoid", True, True, ())
    assert (c.num_experts, c.experts_per_token, c.expert_intermediate_size) == (8, 2, 64)
    assert hf_config.config_from_hf({**MINIMAX_HUB, "rotary_dim": 16}).rotary_dim is None
    assert not hf_config.config_from_hf({**MINIMAX_HUB, "use_routing_bias": False}).router_choice_bias


@pytest.mark.parametrize(("change", "says"), [
    ({"use_qk_norm": False}, "use_qk_norm false is not supported"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type 'per_head' is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"rotary_dim": 7}, "rotary_dim 7 is odd"),
])
def test_minimax_m2_config_refuses_what_it_does_not_run(change: dict, says: str) -> None:
    with pytest.raises(KestrelError, match=says):
        hf_config.config_from_hf({**MINIMAX_HUB, **change})


def test_dots1_config_reads_its_sliding_layers_and_leaves_the_top_k_as_chosen() -> None:
    """Dots1Config's rules: sliding from layer max_window_layers on where sliding_window is set (layer_types, where
    given, instead), and the top k renormalised only where norm_topk_prob says."""
    cfg = json.loads((FIXTURES / "tiny-dots1" / "config.json").read_text())
    cfg.pop("layer_types")
    c = hf_config.config_from_hf({**cfg, "sliding_window": 8, "max_window_layers": 1})
    assert (c.layer_types, c.sliding_window) == (("full", "sliding"), 8)
    assert hf_config.config_from_hf({**cfg, "sliding_window": None}).layer_types == ()
    assert hf_config.config_from_hf({**cfg, "layer_types": ["sliding_attention"] * 2, "sliding_window": 4}
                                    ).layer_types == ("sliding", "sliding")
    assert not hf_config.config_from_hf({k: v for k, v in cfg.items() if k != "norm_topk_prob"}).norm_topk_prob
    c = hf_config.config_from_hf(cfg)
    assert (c.router_scoring, c.router_choice_bias, c.routed_scaling, c.dense_layers, c.qk_norm) == (
        "sigmoid", True, 2.5, (0,), True)


def test_qwen2_moe_sparse_step_makes_dense_layers(tmp_path: Path) -> None:
    """decoder_sparse_step 2 and mlp_only_layers: transformers' Qwen2MoeDecoderLayer rule for which layers are
    dense, read from config.json; a dense layer then needs its own MLP tensors, which this checkpoint lacks."""
    src = FIXTURES / "tiny-qwen2-moe"
    cfg = json.loads((src / "config.json").read_text())
    c = hf_config.config_from_hf({**cfg, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert c.dense_layers == (0, 2, 3)
    assert [c.has_experts(i) for i in range(4)] == [False, True, False, False]
    d = tmp_path / "m"
    shutil.copytree(src, d)
    (d / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [1]}))
    with pytest.raises(KestrelError, match="layers.1.gate"):
        kestrel_core.load(str(d), backend="cpu")
