"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) against transformers: each of its rules is needed
for the tiny fixtures to agree (the agreement itself: parity.py's CASES; figures in docs/parity.md)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kestrel_core.model import hf_config, hf_experts
from kestrel_core.model.gguf_reader import GGUFCheckpoint
from kestrel_core.model.hf import HFCheckpoint

from .parity import CASES, FIXTURES, _with_config, measure

MLA = ("tiny-deepseek-v3", "tiny-deepseek-v2", "tiny-glm4-moe-lite")


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


@pytest.mark.parametrize("name", MLA)
def test_a_deepseek2_gguf_reads_as_its_checkpoint(name: str) -> None:
    """llama.cpp's deepseek2 metadata gives the checkpoint's config: the latent's and the query's ranks, a head's key
    and value dims (from key_length_mla, or a file from before it), the turned dims, the softmax scale (YaRN's
    mscale from yarn_log_multiplier), the router and the dense layers. GLM-4.7-Flash's file names no architecture of
    its own (deepseek2, sigmoid-routed: DeepSeek-V3's)."""
    hf = HFCheckpoint(FIXTURES / name).config
    gguf = GGUFCheckpoint(FIXTURES / f"{name}.gguf").config
    assert gguf.query_scale == pytest.approx(hf.query_scale, rel=1e-6)
    same = ("arch", "query_scale", "max_position", "rope_scaling", "eos_token_ids")
    assert {k: v for k, v in dataclasses.asdict(gguf).items() if k not in same} == \
        {k: v for k, v in dataclasses.asdict(hf).items() if k not in same}
    assert gguf.eos_token_ids == (*hf.eos_token_ids, 0)  # and <|endoftext|>, which llama.cpp finds by its text
    assert gguf.arch == ("deepseek_v2" if name == "tiny-deepseek-v2" else "deepseek_v3")
    if hf.rope_scaling is not None:
        assert {k: gguf.rope_scaling[k] for k in ("factor", "attention_factor")} == \
            {k: hf.rope_scaling[k] for k in ("factor", "attention_factor")}


def test_llama_cpp_split_latent_up_projection_is_hf_kv_b() -> None:
    """attn_k_b (each head's key rows, transposed) and attn_v_b put back together are the checkpoint's kv_b."""
    hf = HFCheckpoint(FIXTURES / "tiny-deepseek-v3").get("layers.1.kv_b")
    gguf = GGUFCheckpoint(FIXTURES / "tiny-deepseek-v3.gguf").get("layers.1.kv_b")
    np.testing.assert_array_equal(gguf, np.float16(hf).astype(np.float32))  # written as float16


def test_a_deepseek2_gguf_renormalises_only_where_it_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's converter writes expert_weights_norm only where norm_topk_prob is true, and reads deepseek2 without
    it as not renormalised: so does kestrel, whichever the router."""
    from kestrel_core.model.gguf_meta import GGUFMetadata

    path = FIXTURES / "tiny-deepseek-v3.gguf"
    assert GGUFCheckpoint(path).config.norm_topk_prob
    real = GGUFMetadata._typed
    monkeypatch.setattr(GGUFMetadata, "_typed", lambda self, key, *a: None if key.endswith(".expert_weights_norm")
                        else real(self, key, *a))
    assert not GGUFCheckpoint(path).config.norm_topk_prob
