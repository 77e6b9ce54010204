"""Cohere's decoders (Command R, Command R7B) against transformers: each of their rules is needed for the tiny
fixtures to agree (the agreement itself: test_parity's CASES; figures in docs/parity.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import kestrel_core
from kestrel_core.model.gguf_reader import GGUFCheckpoint
from kestrel_core.model.hf import HFCheckpoint
from kestrel_core.model.loader import load_model

from .test_parity import CASES, FIXTURES, TINY, Golden, _glm4_halves


def _sequential(loaded) -> dict:  # type: ignore[no-untyped-def]
    """The MLP after the attention, reading the residual normed by the layer's one norm (Llama's order)."""
    for layer in loaded.model.layers:
        layer.mlp_norm = layer.attn_norm
    return {"parallel_block": False}


def _shared_head_norms(loaded) -> dict:  # type: ignore[no-untyped-def]
    """Every head's q/k norm by the first head's weight, as a model with one weight for all heads."""
    hd = loaded.model.config.head_dim
    for layer in loaded.model.layers:
        layer.q_norm, layer.k_norm = layer.q_norm[:hd].copy(), layer.k_norm[:hd].copy()
    return {"qk_norm_heads": False}


# (fixture, what is wrong) -> what the loaded model's layers and config get
COHERE_WRONG = {
    ("tiny-cohere", "RMSNorm for its LayerNorms"): lambda loaded: {"norm_type": "rms"},
    ("tiny-cohere", "the MLP after the attention, not beside it"): _sequential,
    ("tiny-cohere", "one q/k norm weight for every head"): _shared_head_norms,
    ("tiny-cohere", "the logits divided by logit_scale"):
        lambda loaded: {"logits_scaling": 1 / loaded.model.config.logits_scaling},
    ("tiny-cohere2", "the logits not scaled"): lambda loaded: {"logits_scaling": 1.0},
    ("tiny-cohere2", "its global layer turned by RoPE"): lambda loaded: {"nope_layers": ()},
    ("tiny-cohere2", "no sliding window"): lambda loaded: {"layer_types": (), "sliding_window": None},
    ("tiny-cohere2.gguf", "RMSNorm for its LayerNorms"): lambda loaded: {"norm_type": "rms"},
}


@pytest.mark.parametrize(("name", "wrong"), list(COHERE_WRONG), ids=[f"{n}-{w}" for n, w in COHERE_WRONG])
def test_cohere_done_wrong_leaves_the_limits(name: str, wrong: str) -> None:
    loaded = load_model(str(FIXTURES / name), quant="q8", cache="off")
    config = replace(loaded.model.config, **COHERE_WRONG[(name, wrong)](loaded))
    golden = Golden(FIXTURES / name.removesuffix(".gguf") / "golden.npz")
    with kestrel_core.load(replace(loaded, model=replace(loaded.model, config=config)), backend="cpu",
                           activations="q8") as engine:
        fig = golden.figures(engine.logits(golden.ids))
    assert not fig.within(TINY), fig


@pytest.mark.parametrize("name", ["tiny-cohere", "tiny-cohere2"])
def test_cohere_with_rope_in_halves_leaves_the_limits(monkeypatch, name: str) -> None:  # type: ignore[no-untyped-def]
    """Cohere turns interleaved pairs (rotate_half over the even and odd dims), as GLM-4 and ERNIE 4.5."""
    from .test_parity import measure

    _glm4_halves(monkeypatch)
    fig = measure(next(c for c in CASES if c.name == name), "q8")
    assert not fig.within(TINY), fig


@pytest.mark.parametrize("name", ["tiny-cohere", "tiny-cohere2"])
def test_a_cohere_gguf_reads_as_its_checkpoint(name: str) -> None:
    """llama.cpp's command-r and cohere2 metadata give the checkpoint's config: the LayerNorms' eps, the logit scale,
    the per-head q/k norms, the window, which layers slide and which turn."""
    hf = HFCheckpoint(FIXTURES / name).config
    gguf = GGUFCheckpoint(FIXTURES / f"{name}.gguf").config
    same = ("arch", "norm_type", "parallel_block", "rope_interleaved", "qk_norm", "qk_norm_heads", "layer_types",
            "sliding_window", "nope_layers", "head_dim", "tie_word_embeddings", "max_position")
    assert {f: getattr(gguf, f) for f in same} == {f: getattr(hf, f) for f in same}
    assert gguf.rms_norm_eps == hf.rms_norm_eps == 1e-5
    assert gguf.logits_scaling == pytest.approx(hf.logits_scaling, rel=1e-6)
