"""Float activations as int8 slices: exact reconstruction, slice ranges, and the recombination."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kestrel_npu_sim.slicing import MAX_SLICES, int8_slices, recombine


def _rebuild(slices: np.ndarray, e: np.ndarray, g: int) -> np.ndarray:
    """sum_j slice_j * 2**(e - 7j), element by element, in float64."""
    steps = np.ldexp(1.0, np.repeat(e, g, axis=1)[None] - 7 * np.arange(len(slices))[:, None, None])
    return (slices.astype(np.float64) * steps).sum(axis=0)


@settings(max_examples=60, deadline=None)
@given(g=st.sampled_from([32, 256]), rows=st.integers(1, 3), top=st.integers(-60, 60),
       data=st.data())
def test_slices_are_exact_within_the_dynamic_range(g: int, rows: int, top: int, data: st.DataObject) -> None:
    # magnitudes within 2**17 of each other (and zeros) in every block: at most 6 slices, exactly
    mags = data.draw(arrays(np.float64, (rows, g), elements=st.floats(1.0, 2.0**17 - 1)))
    signs = data.draw(arrays(np.int8, (rows, g), elements=st.sampled_from([-1, 0, 1])))
    a = (np.ldexp(mags, top) * signs).astype(np.float32)
    slices, e = int8_slices(a, g)
    assert slices.dtype == np.int8 and len(slices) <= MAX_SLICES
    assert np.abs(slices[0]).max() <= 127 and (len(slices) == 1 or np.abs(slices[1:]).max() <= 64)
    np.testing.assert_array_equal(_rebuild(slices, e, g), a.astype(np.float64))


def test_beyond_the_range_the_remainder_is_tiny() -> None:
    a = np.array([[1.0, 2.0**-60, 3.0 * 2.0**-30] + [0.5] * 29], dtype=np.float32)
    slices, e = int8_slices(a, 32)
    assert len(slices) == MAX_SLICES
    err = np.abs(_rebuild(slices, e, 32) - a)
    assert err.max() <= 2.0**-41 * np.abs(a).max()


def test_recombine_weights_each_slice_by_its_power_of_two() -> None:
    rng = np.random.default_rng(0)
    sums = rng.integers(-(2**20), 2**20, size=(3, 4, 2, 5), dtype=np.int32)  # [ng, L, M, N]
    e = rng.integers(-30, 30, size=(2, 3))                                  # [M, ng]
    expected = np.zeros((3, 2, 5))
    for g in range(3):
        for j in range(4):
            for m in range(2):
                expected[g, m] += sums[g, j, m] * 2.0 ** (e[m, g] - 7 * j)
    np.testing.assert_array_equal(recombine(sums, e), expected)
