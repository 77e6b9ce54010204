"""quantize_activations' float32 fast paths (the engine's hot path) are bit-identical to the general path.

The general path (any other dtype, e.g. float64 holding the same float32 values) runs ``_quantize_q8``,
whose rounding is ``round_half_away`` (C's roundf, checked against gguf-py in tests/kestrel_core). The fast
path is compiled with numba where available, else a few numpy passes: every test runs both.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel_core import contract
from kestrel_core.contract import quantize_activations

HALF_DOWN = float(np.nextafter(np.float32(0.5), np.float32(0)))  # 0.49999997: floor(v + 0.5) gets it wrong
SCALED = [HALF_DOWN, 0.5, 1.5, 2.5, 126.5, 0.25, 3.4999998, 1 - 2**-24]


@pytest.fixture(params=["compiled", "numpy"], autouse=True)
def fast_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each test with the compiled fast path, then with the numpy one."""
    if request.param == "compiled":
        pytest.importorskip("numba")
        assert contract.compiled_q8_rows() is not None
    else:
        monkeypatch.setitem(contract._COMPILED, "q8_rows", None)
    return request.param


def _both(a: np.ndarray, g: int) -> None:
    fast_codes, fast_scales = quantize_activations(a.astype(np.float32), g)
    slow_codes, slow_scales = quantize_activations(a.astype(np.float64), g)
    np.testing.assert_array_equal(fast_codes, slow_codes)
    assert fast_scales.dtype == slow_scales.dtype == np.float32
    np.testing.assert_array_equal(fast_scales.view(np.uint32), slow_scales.view(np.uint32))


@pytest.mark.parametrize("g", [32, 256])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_exact_ties_and_the_value_below_one_half(g: int, sign: float) -> None:
    """Blocks whose scaled values are exactly the rounding edge cases (scale a power of two: no rounding)."""
    s = np.float32(2.0**-3)
    block = np.zeros(g, np.float32)
    block[0] = 127 * s  # the block maximum: d = s exactly, 1/d = 8 exactly
    block[1:1 + len(SCALED)] = np.array(SCALED, np.float32) * s * np.float32(sign)
    block[10] = -block[3]
    a = np.stack([block, -block, np.zeros(g, np.float32)])
    codes, _ = quantize_activations(a, g)
    assert codes[0, 1] == 0  # 0.49999997 rounds to 0
    assert codes[0, 2] == int(sign)  # 0.5 rounds away from zero
    _both(a, g)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 4), st.sampled_from([32, 256]), st.integers(0, 2**32 - 1),
       st.sampled_from(["normal", "outlier", "ties", "small"]))
def test_fast_path_is_bit_identical(m: int, blocks: int, g: int, seed: int, kind: str) -> None:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, blocks * g)).astype(np.float32)
    if kind == "outlier":
        a[:, rng.integers(0, blocks * g)] *= 1e4
    elif kind == "ties":  # many values on .5 after scaling by a power-of-two d
        a = (rng.integers(-254, 255, a.shape) / 2).astype(np.float32) / 8
        a[:, ::g] = 127 / 8
    elif kind == "small":
        a *= np.float32(1e-30)  # d stays a normal float (1/d of a subnormal d overflows in both paths)
    _both(a, g)


def test_non_contiguous_input(fast_path: str) -> None:
    a = np.random.default_rng(1).standard_normal((64, 6)).astype(np.float32).T  # [6, 64], Fortran order
    _both(a, 32)
