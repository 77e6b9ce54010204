"""The decoder's compiled row kernels (kestrel_core.model.kernels): SiLU's accuracy and its fixed bits."""

from __future__ import annotations

import numpy as np

from kestrel_core.model import kernels, paged_attention


def _gates() -> np.ndarray:
    rng = np.random.default_rng(3)
    edge = np.float32([0, -0.0, 1e-30, -1e-30, 20, -20, 87, -87, 88.8, -88.8, 1e30, -1e30, np.inf, -np.inf, np.nan])
    return np.concatenate([rng.standard_normal(4000).astype(np.float32) * 6, edge, np.zeros(1, np.float32)])


def test_silu_mul_is_within_a_few_ulp_of_float64() -> None:
    g = _gates()
    up = np.random.default_rng(4).standard_normal(g.size).astype(np.float32)
    got = g.copy()[None]
    kernels.silu_mul(got, up[None])
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        want = g64 / (1 + np.exp(-g64)) * up
    finite = np.isfinite(want) & (np.abs(want) < 1e30)
    tol = 4 * np.spacing(np.abs(want[finite]).astype(np.float32)) + 1e-35  # below e^-86: 0
    assert (np.abs(got[0][finite] - want[finite]) <= tol).all()
    assert np.isnan(got[0][np.isnan(g)]).all() and np.isnan(got[0][g == -np.inf]).all()
    assert got[0][g == np.inf] == np.inf * up[g == np.inf]


def test_silu_mul_takes_the_softmax_exp_step_for_step() -> None:
    # the numpy twin of the attention's exp, an independent formulation of the same float32 steps
    g = _gates()
    g = g[np.isfinite(g)]
    up = np.random.default_rng(5).standard_normal(g.size).astype(np.float32)
    e = paged_attention._exp(-np.abs(g))
    with np.errstate(over="ignore"):
        want = g * (np.where(g >= 0, np.float32(1), e) / (np.float32(1) + e)) * up
    got = g.copy()[None]
    kernels.silu_mul(got, up[None])
    assert np.array_equal(got[0].view(np.int32), want.view(np.int32))


def test_silu_mul_rows_do_not_depend_on_the_batch_and_match_plain_python() -> None:
    rng = np.random.default_rng(6)
    gate = rng.standard_normal((5, 96)).astype(np.float32) * 4
    up = rng.standard_normal((5, 96)).astype(np.float32)
    batch = gate.copy()
    kernels.silu_mul(batch, up)
    for r in range(5):
        one = gate[r:r + 1].copy()
        kernels.silu_mul(one, up[r:r + 1])
        assert np.array_equal(one[0].view(np.int32), batch[r].view(np.int32))
    plain = gate[:2].copy()
    kernels._silu_mul(plain, up[:2])  # the Python fallback: the same float32 steps one by one
    assert np.array_equal(plain.view(np.int32), batch[:2].view(np.int32))
