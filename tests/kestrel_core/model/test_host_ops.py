"""The decoder's row-wise norms against their formulas in float64, and a row's bits alone as in a batch."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_core.model.host_ops import NORMS, layernorm, rmsnorm


def _rms_formula(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x ** 2).mean(axis=-1, keepdims=True) + eps) * w


def _layer_formula(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    centred = x - x.mean(axis=-1, keepdims=True)
    return centred / np.sqrt((centred ** 2).mean(axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize(("norm", "formula"), [(rmsnorm, _rms_formula), (layernorm, _layer_formula)],
                         ids=["rms", "layer"])
def test_norms_agree_with_their_formula_alone_and_batched(norm, formula) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 96)) * 3 + 2).astype(np.float32)  # an offset mean: LayerNorm takes it out
    w = rng.standard_normal(96).astype(np.float32)
    np.testing.assert_allclose(norm(x, w, 1e-5), formula(x.astype(np.float64), w, 1e-5), rtol=1e-5, atol=1e-5)
    batched = norm(x, w, 1e-5)
    for i in range(5):
        np.testing.assert_array_equal(norm(x[i:i + 1], w, 1e-5), batched[i:i + 1])


def test_layernorm_is_not_an_rmsnorm_of_an_uncentred_row() -> None:
    """The mean is taken out: a row with a large offset normalizes to the row without it, which an RMSNorm does
    not (the two norms agree only on rows of mean 0)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x -= x.mean(axis=1, keepdims=True)
    w = np.ones(64, np.float32)
    np.testing.assert_allclose(layernorm(x + 5, w, 1e-5), layernorm(x, w, 1e-5), atol=1e-4)
    np.testing.assert_allclose(layernorm(x, w, 1e-5), rmsnorm(x, w, 1e-5), atol=1e-5)
    assert not np.allclose(rmsnorm(x + 5, w, 1e-5), rmsnorm(x, w, 1e-5), atol=0.1)


def test_every_norm_type_has_its_norm() -> None:
    from kestrel_core.model.config import NORM_TYPES

    assert set(NORMS) == set(NORM_TYPES)
