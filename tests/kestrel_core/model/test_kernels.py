"""The decoder's compiled row kernels (kestrel_core.model.kernels): the MLP's SiLU and GELU, accurate and with fixed
bits."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_core.model import kernels, paged_attention

ACTS = pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])


def _gates() -> np.ndarray:
    rng = np.random.default_rng(3)
    edge = np.float32([0, -0.0, 1e-30, -1e-30, 20, -20, 87, -87, 88.8, -88.8, 1e30, -1e30, np.inf, -np.inf, np.nan])
    return np.concatenate([rng.standard_normal(4000).astype(np.float32) * 6, edge, np.zeros(1, np.float32)])


def _float64(g: np.ndarray, up: np.ndarray, gelu: bool) -> tuple[np.ndarray, np.ndarray]:
    """act(g) * up in float64, and the sigmoid's argument z."""
    g = g.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        # torch's gelu(approximate="tanh"), 0.5 g (1 + tanh(u)), as g sigmoid(2u): the same function, and exact
        # where 1 + tanh(u) cancels to 0 in float64 (u < -19)
        z = 2 * np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3) if gelu else g
        return g / (1 + np.exp(-z)) * up, z


@ACTS
def test_gated_mul_is_within_a_few_ulp_of_float64(gelu: bool) -> None:
    g = _gates()
    up = np.random.default_rng(4).standard_normal(g.size).astype(np.float32)
    got = g.copy()[None]
    kernels.gated_mul(got, up[None], gelu)
    want, z = _float64(g, up, gelu)
    finite = np.isfinite(want) & (np.abs(want) < 1e30)
    # z's float32 roundings (five for the GELU's) leave it up to ~2 ulp off, which e^z turns into up to 2 |z| ulp
    # of the result; below e^-86: 0
    tol = (4 + 2 * np.abs(z[finite])) * np.spacing(np.abs(want[finite]).astype(np.float32)) + 1e-35
    assert (np.abs(got[0][finite] - want[finite]) <= tol).all()
    assert np.isnan(got[0][np.isnan(g)]).all() and np.isnan(got[0][g == -np.inf]).all()
    assert got[0][g == np.inf] == np.inf * up[g == np.inf]


@ACTS
def test_gated_mul_takes_the_softmax_exp_step_for_step(gelu: bool) -> None:
    # the numpy twin of the attention's exp, an independent formulation of the same float32 steps
    g = _gates()
    g = g[np.isfinite(g)]
    up = np.random.default_rng(5).standard_normal(g.size).astype(np.float32)
    with np.errstate(over="ignore"):
        z = np.float32(2 * 0.7978845608028654) * (g + np.float32(0.044715) * (g * g * g)) if gelu else g
        e = paged_attention._exp(-np.abs(z))
        want = g * (np.where(z >= 0, np.float32(1), e) / (np.float32(1) + e)) * up
    got = g.copy()[None]
    kernels.gated_mul(got, up[None], gelu)
    assert np.array_equal(got[0].view(np.int32), want.view(np.int32))


@ACTS
def test_gated_mul_rows_do_not_depend_on_the_batch_and_match_plain_python(gelu: bool) -> None:
    rng = np.random.default_rng(6)
    gate = rng.standard_normal((5, 96)).astype(np.float32) * 4
    up = rng.standard_normal((5, 96)).astype(np.float32)
    batch = gate.copy()
    kernels.gated_mul(batch, up, gelu)
    for r in range(5):
        one = gate[r:r + 1].copy()
        kernels.gated_mul(one, up[r:r + 1], gelu)
        assert np.array_equal(one[0].view(np.int32), batch[r].view(np.int32))
    plain = gate[:2].copy()
    kernels._gated_mul(plain, up[:2], gelu)  # the Python fallback: the same float32 steps one by one
    assert np.array_equal(plain.view(np.int32), batch[:2].view(np.int32))
