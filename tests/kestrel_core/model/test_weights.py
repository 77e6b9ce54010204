"""The model view's own behaviour (its tensors' layout is checked by the loaders' and decoder's tests)."""

from __future__ import annotations

from kestrel_core.model.presets import synthetic_model

from .conftest import make_tiny_config


def test_a_models_repr_names_its_weights_by_shape_not_by_element() -> None:
    """``engine.model`` in a notebook showed every norm's elements and a summary of every weight's codes and
    scales: 760,000 characters for SmolLM2-135M, megabytes for a mixture of experts. Each weight is its shape."""
    c = make_tiny_config("qwen3", num_layers=2)
    model = synthetic_model(c, "q8", seed=1)
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim

    def strip(n: int, k: int) -> str:
        return f"StripCache([{n}, {k}], bits=8, group_size=32)"

    assert repr(model.layers[0]) == (
        f"LayerWeights(q={strip(c.num_heads * hd, d)}, k={strip(c.num_kv_heads * hd, d)}, "
        f"v={strip(c.num_kv_heads * hd, d)}, o={strip(d, c.num_heads * hd)}, attn_norm=array([{d}], float32), "
        f"mlp_norm=array([{d}], float32), gate={strip(f, d)}, up={strip(f, d)}, down={strip(d, f)}, "
        f"q_norm=array([{hd}], float32), k_norm=array([{hd}], float32))")
    assert repr(model) == (f"Model(config={c!r}, embedding={strip(c.vocab_size, d)}, layers=[2 LayerWeights], "
                           f"final_norm=array([{d}], float32), lm_head={strip(c.vocab_size, d)})")
