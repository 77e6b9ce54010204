"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) against transformers: each of its rules is needed
for the tiny fixtures to agree (the agreement itself: test_parity's CASES; figures in docs/parity.md)."""

from __future__ import annotations

import pytest

from kestrel_core.model import hf_config, hf_experts

from .test_parity import CASES, _with_config, measure


def _mla_with(monkeypatch, **fields) -> None:  # type: ignore[no-untyped-def]
    """Read the latent attention's config (hf_config._mla_fields) with ``fields`` in place of its own."""
    real = hf_config._mla_fields
    monkeypatch.setattr(hf_config, "_mla_fields", lambda *a: {**real(*a), **fields})


MLA_WRONG = {
    ("tiny-deepseek-v3", "RoPE in halves, not interleaved pairs"):
        lambda mp: _with_config(mp, lambda c: {**c, "rope_interleave": False}),
    ("tiny-deepseek-v3", "the softmax scale without YaRN's mscale squared"):
        lambda mp: _mla_with(mp, query_scale=24 ** -0.5),
    ("tiny-glm4-moe-lite", "the routed weights unscaled"):
        lambda mp: _with_config(mp, lambda c: {**c, "routed_scaling_factor": 1.0}),
    ("tiny-glm4-moe-lite", "RoPE in halves, not interleaved pairs"):
        lambda mp: _with_config(mp, lambda c: {**c, "rope_interleave": False}),
    ("tiny-deepseek-v2", "no shared experts"): lambda mp: _with_config(mp, lambda c: {**c, "n_shared_experts": 0}),
    ("tiny-deepseek-v2", "RoPE in halves, not interleaved pairs"): lambda mp: _mla_with(mp, rope_interleaved=False),
    ("tiny-deepseek-v2", "a sigmoid router"):
        lambda mp: mp.setattr(hf_experts, "_deepseek_v2_router_fields", lambda cfg, where: {
            **hf_experts._shared_dense_fields(cfg, where, 32, 1), "router_scoring": "sigmoid"}),
}


@pytest.mark.parametrize(("name", "wrong"), list(MLA_WRONG), ids=[f"{n}-{w}" for n, w in MLA_WRONG])
def test_latent_attention_done_wrong_leaves_the_limits(monkeypatch, name: str, wrong: str) -> None:  # type: ignore[no-untyped-def]
    MLA_WRONG[(name, wrong)](monkeypatch)
    case = next(c for c in CASES if c.name == name)
    fig = measure(case, "q8")
    assert not fig.within(case.limits("q8")), fig
