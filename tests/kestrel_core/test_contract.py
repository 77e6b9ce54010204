"""The strip-cache contract: validation, gguf-py bit-identity, and the reference GEMM semantics."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel_core.contract import (
    StripCache,
    quantize_activations,
    quantize_weight,
    reference_gemm_f32,
    reference_gemm_q8,
)
from kestrel_core.errors import ContractError

BLOCK = 32


def gguf_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes [N, K], float16 scales [N, K/32]) as gguf-py's Q8_0 writes them."""
    raw = gguf_quantize(w.astype(np.float32), GGMLQuantizationType.Q8_0)  # [N, K/32*34] uint8
    blocks = raw.reshape(w.shape[0], -1, 34)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]
    codes = blocks[..., 2:].copy().view(np.int8).reshape(w.shape[0], -1)
    return codes, scales


def gguf_q4_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes in [-8, 7], float16 scales) as gguf-py's Q4_0 writes them, with its +8 offset removed."""
    raw = gguf_quantize(w.astype(np.float32), GGMLQuantizationType.Q4_0)  # [N, K/32*18]
    blocks = raw.reshape(w.shape[0], -1, 18)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]
    packed = blocks[..., 2:]  # low nibbles hold elements 0..15, high nibbles 16..31
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8) - 8
    return q.reshape(w.shape[0], -1), scales


def weights(seed: int, n: int, k: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if kind == "ties":  # values that land exactly on .5 after scaling exercise the rounding rule
        w = np.round(w * 4) / 4
        w[:, 0] = 127 / 4
    elif kind == "zeros":  # all-zero blocks must give scale 0 and codes 0
        w[:, :BLOCK] = 0
    elif kind == "outlier":
        w[:, 5] *= 1000
    return w


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "outlier"])
@pytest.mark.parametrize("seed", [0, 1])
def test_q8_codes_bit_identical_to_gguf(kind: str, seed: int) -> None:
    w = weights(seed, 24, 256, kind)
    sc = quantize_weight(w, bits=8, group_size=32)
    codes, scales = gguf_q8_0(w)
    np.testing.assert_array_equal(sc.codes, codes)
    np.testing.assert_array_equal(sc.scales.astype(np.float16), scales)


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "outlier"])
@pytest.mark.parametrize("seed", [0, 1])
def test_q4_codes_bit_identical_to_gguf(kind: str, seed: int) -> None:
    w = weights(seed, 24, 256, kind)
    sc = quantize_weight(w, bits=4, group_size=32)
    codes, scales = gguf_q4_0(w)
    np.testing.assert_array_equal(sc.codes, codes)
    np.testing.assert_array_equal(sc.scales.astype(np.float16), scales)


@pytest.mark.parametrize("bits", [8, 4])
def test_g256_blocks_follow_the_same_rule_as_gguf_on_wider_blocks(bits: int) -> None:
    """G=256 is Q8_0/Q4_0 over 256-wide blocks: the 32-wide gguf quantizer on a block's shared scale."""
    w = weights(3, 8, 512, "normal")
    sc = quantize_weight(w, bits=bits, group_size=256)
    blocks = w.reshape(8, 2, 256)
    if bits == 8:
        expect_scale = np.abs(blocks).max(axis=-1) / 127
    else:
        idx = np.abs(blocks).argmax(axis=-1)[..., None]
        expect_scale = np.take_along_axis(blocks, idx, axis=-1)[..., 0] / -8
    np.testing.assert_allclose(sc.scales, expect_scale.astype(np.float32), rtol=0, atol=0)
    # Within one 256-block every 32-wide sub-block sees the same scale; so gguf's codes on a tensor whose
    # every 32-block contains the 256-block's extreme value must equal ours.
    w2 = blocks.copy()
    ext = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)
    w2.reshape(8, 2, 8, 32)[..., 0] = ext  # plant the extreme in every 32-sub-block
    w2 = w2.reshape(8, 512)
    ours = quantize_weight(w2, bits=bits, group_size=256).codes
    theirs = (gguf_q8_0 if bits == 8 else gguf_q4_0)(w2)[0]
    np.testing.assert_array_equal(ours, theirs)


def test_activation_quantization_is_q8_0() -> None:
    a = weights(4, 5, 128, "ties")
    codes, scales = quantize_activations(a, 32)
    ref_codes, ref_scales = gguf_q8_0(a)
    np.testing.assert_array_equal(codes, ref_codes)
    np.testing.assert_array_equal(scales.astype(np.float16), ref_scales)


def test_float16_and_bfloat16_inputs_quantize_like_their_float32_values() -> None:
    w = weights(5, 4, 64, "normal").astype(np.float16)
    a = quantize_weight(w)
    b = quantize_weight(w.astype(np.float32))
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.scales, b.scales)


@pytest.mark.parametrize(("codes", "scales", "g", "bits", "msg"), [
    (np.zeros((4, 64), np.int16), np.zeros((4, 2), np.float32), 32, 8, "int8"),
    (np.zeros((4, 48), np.int8), np.zeros((4, 1), np.float32), 32, 8, "multiple of the group size"),
    (np.zeros((4, 64), np.int8), np.zeros((4, 3), np.float32), 32, 8, "scales must be float32 [4, 2]"),
    (np.zeros((4, 64), np.int8), np.zeros((4, 2), np.float64), 32, 8, "scales must be float32"),
    (np.full((4, 64), 8, np.int8), np.zeros((4, 2), np.float32), 32, 4, "[-8, 7]"),
    (np.full((4, 64), -128, np.int8), np.zeros((4, 2), np.float32), 32, 8, "[-127, 127]"),
    (np.zeros((4, 64), np.int8), np.zeros((4, 1), np.float32), 64, 8, "group size"),
    (np.zeros((4, 64), np.int8), np.zeros((4, 2), np.float32), 32, 6, "bits"),
])
def test_construction_rejects_broken_tensors(codes, scales, g, bits, msg) -> None:
    with pytest.raises(ContractError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        StripCache(codes, scales, g, bits)


def naive_gemm_q8(a_codes, a_scales, w: StripCache) -> tuple[np.ndarray, np.ndarray]:
    """The contract's formula written element by element (small shapes only), in float64, and the sum of the
    magnitudes of its per-group terms (what a float32 evaluation's rounding error scales with)."""
    m, k = a_codes.shape
    g = w.group_size
    out = np.zeros((m, w.n), np.float64)
    mag = np.zeros((m, w.n), np.float64)
    for i in range(m):
        for j in range(w.n):
            for b in range(k // g):
                s = sum(int(a_codes[i, b * g + t]) * int(w.codes[j, b * g + t]) for t in range(g))
                term = s * float(a_scales[i, b]) * float(w.scales[j, b])
                out[i, j] += term
                mag[i, j] += abs(term)
    return out, mag


shapes = st.tuples(st.integers(1, 4), st.integers(1, 7), st.integers(1, 3), st.sampled_from([32, 256]),
                   st.sampled_from([4, 8]), st.integers(0, 2**31 - 1))


@settings(max_examples=25, deadline=None)
@given(shapes)
def test_reference_gemms_match_the_formula(shape) -> None:
    m, n, nblocks, g, bits, seed = shape
    rng = np.random.default_rng(seed)
    k = nblocks * g
    w = quantize_weight(rng.standard_normal((n, k)).astype(np.float32), bits=bits, group_size=g)
    a = rng.standard_normal((m, k)).astype(np.float32)
    a_codes, a_scales = quantize_activations(a, g)
    got = reference_gemm_q8(a_codes, a_scales, w)
    assert got.dtype == np.float32 and got.shape == (m, n)
    exact, mag = naive_gemm_q8(a_codes, a_scales, w)
    # float32: two roundings per group term and one per addition, each at most eps/2 of what it touches; a
    # bound on the result alone fails where the groups cancel (hypothesis found 0.0192 from terms of ~36)
    eps = float(np.finfo(np.float32).eps)
    assert np.all(np.abs(got - exact) <= (nblocks + 2) * eps * mag + 1e-30)
    f32 = reference_gemm_f32(a, w)
    np.testing.assert_allclose(f32, a.astype(np.float64) @ w.dequantize().astype(np.float64).T,
                               rtol=1e-4, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.sampled_from([32, 256]), st.sampled_from([4, 8]),
       st.integers(0, 2**31 - 1))
def test_quantization_error_is_bounded_by_half_a_step(n, nblocks, g, bits, seed) -> None:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, nblocks * g)) * rng.uniform(0.01, 100)).astype(np.float32)
    sc = quantize_weight(w, bits=bits, group_size=g)
    err = np.abs(sc.dequantize() - w).reshape(n, nblocks, g).max(axis=-1)
    # Q8_0 rounds to nearest (half a step); Q4_0 truncates after +8.5, also within half a step, except
    # at the clipped +8 end where the error is at most one step.
    step = np.abs(sc.scales)
    assert np.all(err <= step * (0.5 if bits == 8 else 1.0) * (1 + 1e-5) + 1e-30)
    lo, hi = (-127, 127) if bits == 8 else (-8, 7)
    assert sc.codes.min() >= lo and sc.codes.max() <= hi
