"""The strip-cache contract: validation, gguf-py bit-identity, compiled = numpy quantizers, reference GEMMs."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel_core import contract
from kestrel_core.contract import (
    BFloat16Bits,
    StripCache,
    quantize_activations,
    quantize_weight,
    quantize_weight_reference,
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
    elif kind == "signs":  # +-x of equal magnitude: Q4_0 takes the first one's sign
        w[:, 1::BLOCK] = -w[:, 0::BLOCK]
        w[: n // 2, 0::BLOCK] = 9
    elif kind == "wide":  # rows from 1e-30 to 1e30: scales far from 1, in both directions
        w *= (10.0 ** rng.uniform(-30, 30, (n, 1))).astype(np.float32)
    return w


QUANTIZERS = {"compiled": quantize_weight, "reference": quantize_weight_reference}


GGUF_KINDS = ["normal", "ties", "zeros", "outlier", "signs", "wide"]


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kind", GGUF_KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_q8_codes_bit_identical_to_gguf(quantizer: str, dtype: str, kind: str, seed: int) -> None:
    w = weights(seed, 24, 256, kind).clip(-6e4, 6e4).astype(dtype)  # within float16's range
    sc = QUANTIZERS[quantizer](w, bits=8, group_size=32)
    codes, scales = gguf_q8_0(w)
    np.testing.assert_array_equal(sc.codes, codes)
    np.testing.assert_array_equal(sc.scales.astype(np.float16), scales)


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kind", GGUF_KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_q4_codes_bit_identical_to_gguf(quantizer: str, dtype: str, kind: str, seed: int) -> None:
    w = weights(seed, 24, 256, kind).clip(-6e4, 6e4).astype(dtype)  # within float16's range
    sc = QUANTIZERS[quantizer](w, bits=4, group_size=32)
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


def bf16_bits(w: np.ndarray) -> BFloat16Bits:
    """The top halves of float32 values (truncation: every pattern is a bfloat16 all the same)."""
    return BFloat16Bits((np.ascontiguousarray(w, np.float32).view(np.uint32) >> 16).astype(np.uint16))


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
def test_float16_and_bfloat16_inputs_quantize_like_their_float32_values(quantizer: str) -> None:
    quantize = QUANTIZERS[quantizer]
    w = weights(5, 4, 64, "normal")
    w16 = w.astype(np.float16)
    wb = bf16_bits(w)
    for x, x32 in ((w16, w16.astype(np.float32)), (wb, wb.to_float32())):
        for bits in (8, 4):
            a, b = quantize(x, bits), quantize(x32, bits)
            np.testing.assert_array_equal(a.codes, b.codes)
            np.testing.assert_array_equal(a.scales, b.scales)


def test_ml_dtypes_bfloat16_arrays_are_read_as_bfloat16() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    w = weights(6, 8, 64, "normal")
    wb = bf16_bits(w)
    arr = wb.raw.view(ml_dtypes.bfloat16)
    for quantize in QUANTIZERS.values():
        a, b = quantize(arr, 4), quantize(wb.to_float32(), 4)
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.scales, b.scales)


# -- the compiled weight quantizer against the numpy reference, bit for bit -------------------------------

def adversarial(seed: int, n: int, k: int, kind: str) -> np.ndarray:
    """float32 [n, k] built to hit the quantizers' edges."""
    rng = np.random.default_rng(seed)
    nb = k // BLOCK
    if kind == "ties8":  # a power-of-two scale (max 127 * 2**e): every x.5 is an exact tie of Q8_0's rounding
        t = rng.integers(-127, 128, (n, nb, BLOCK)) + rng.choice([0.0, 0.5, -0.5], (n, nb, BLOCK))
        t[..., 0] = rng.choice([127.0, -127.0], (n, nb))
        t[..., 1] = rng.choice([0.49999997, -0.49999997], (n, nb))  # below the tie: floor(|v| + 0.5) gives 1
        w = (t.clip(-127, 127) * 2.0 ** rng.integers(-20, 20, (n, nb, 1))).reshape(n, k)
    elif kind == "ties4":  # scale 2**e for Q4_0: x / d + 8.5 lands exactly on integers and on .75 / .25
        t = rng.integers(-8, 8, (n, nb, BLOCK)) + rng.choice([0.0, 0.5, -0.5, 0.25], (n, nb, BLOCK))
        t[..., 0] = rng.choice([-8.0, 8.0], (n, nb))
        w = (t.clip(-8, 7.5) * 2.0 ** rng.integers(-20, 20, (n, nb, 1))).reshape(n, k)
    elif kind == "bits":  # random float32 bit patterns, every finite magnitude and both signs
        u = rng.integers(0, 1 << 32, (n, k), dtype=np.uint64).astype(np.uint32)
        w = u.view(np.float32)
        w = np.where(np.isfinite(w), w, np.float32(1.5))
    elif kind == "zeros":  # all-zero blocks, +0 and -0, and ties of magnitude between signs
        w = rng.standard_normal((n, k))
        w[:, ::3] = 0
        w[::2, : 2 * BLOCK] = 0
        w[1::4, BLOCK : 2 * BLOCK] = -0.0
        w[:, 7::BLOCK] = -np.abs(w[:, 8::BLOCK])
    elif kind == "tiny":  # blocks whose scale is subnormal or so small that 1/d overflows: codes 0
        w = rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-45, -36, (n, 1))
    elif kind == "huge":
        w = (rng.standard_normal((n, k)) * 1e37).clip(-3e38, 3e38)
    else:
        raise AssertionError(kind)
    return np.asarray(w, dtype=np.float32)


def every_16bit_pattern(seed: int, width: int, bfloat: bool) -> np.ndarray | BFloat16Bits:
    """All 65536 bit patterns (non-finite ones replaced by 0) in a shuffled [65536 / width, width] array."""
    u = np.random.default_rng(seed).permutation(np.arange(1 << 16, dtype=np.uint32)).astype(np.uint16)
    vals = (u.astype(np.uint32) << 16).view(np.float32) if bfloat else u.view(np.float16)
    u = np.where(np.isfinite(vals), u, np.uint16(0)).reshape(-1, width)
    return BFloat16Bits(u) if bfloat else u.view(np.float16)


def as_dtype(w: np.ndarray, dtype: str) -> np.ndarray | BFloat16Bits:
    if dtype == "bfloat16":
        return bf16_bits(w)
    with np.errstate(over="ignore"):
        x = w.astype(dtype)
    return np.where(np.isfinite(x), x, 0).astype(dtype)  # float16 overflows: 0 instead of inf


def assert_same_bits(a: StripCache, b: StripCache) -> None:
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.scales.view(np.uint32), b.scales.view(np.uint32))  # -0.0 too


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("group_size", [32, 256])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", ["ties8", "ties4", "bits", "zeros", "tiny", "huge"])
def test_compiled_quantizer_equals_the_reference_bitwise(kind: str, bits: int, group_size: int,
                                                         dtype: str) -> None:
    w = as_dtype(adversarial(11, 40, 512, kind), dtype)
    got = quantize_weight(w, bits, group_size)
    assert contract._compiled_weight_kernels() is not None, "the compiled quantizer did not build"
    assert_same_bits(got, quantize_weight_reference(w, bits, group_size))


@pytest.mark.parametrize("group_size", [32, 256])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bfloat", [False, True])
def test_compiled_quantizer_widens_every_16bit_pattern_like_numpy(bfloat: bool, bits: int,
                                                                  group_size: int) -> None:
    w = every_16bit_pattern(3, group_size, bfloat)
    assert_same_bits(quantize_weight(w, bits, group_size), quantize_weight_reference(w, bits, group_size))


def test_tiny_blocks_quantize_to_zero_codes() -> None:
    """A block whose scale is too small to invert (|d| < 2**-128) has codes 0 and keeps its scale."""
    w = np.full((2, 32), 1e-38, np.float32)
    w[1] = -w[1]
    for quantize in QUANTIZERS.values():
        for bits in (8, 4):
            sc = quantize(w, bits)
            assert not sc.codes.any()
            assert np.all(sc.scales != 0)


def test_row_chunks_on_threads_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contract, "_MIN_PARALLEL_WEIGHTS", 1)
    monkeypatch.setattr(contract, "_threads", lambda: 3)
    for dtype in ("float32", "float16", "bfloat16"):
        w = as_dtype(adversarial(5, 31, 256, "bits"), dtype)
        for bits in (8, 4):
            assert_same_bits(quantize_weight(w, bits), quantize_weight_reference(w, bits))


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_naming_the_first_row(monkeypatch: pytest.MonkeyPatch, quantizer: str,
                                                             bad: float) -> None:
    monkeypatch.setattr(contract, "_MIN_PARALLEL_WEIGHTS", 1)  # the bad rows in different threads' chunks
    monkeypatch.setattr(contract, "_threads", lambda: 2)
    w = weights(2, 8, 64, "normal")
    w[6, 40] = bad
    w[3, 33] = bad
    for x in (w, w.astype(np.float16), bf16_bits(w)):
        for bits in (8, 4):
            with pytest.raises(ContractError, match=r"NaN or infinity \(first in row 3\)"):
                QUANTIZERS[quantizer](x, bits)


def test_without_numba_the_reference_quantizes(monkeypatch: pytest.MonkeyPatch) -> None:
    w = adversarial(4, 8, 256, "ties4")
    want = quantize_weight_reference(w, 4)
    monkeypatch.setitem(contract._COMPILED, "weights", None)  # as where numba is missing
    assert_same_bits(quantize_weight(w, 4), want)


def test_a_kernel_that_fails_falls_back_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    w = adversarial(4, 8, 256, "ties8")
    want = quantize_weight_reference(w, 8)
    assert contract._compiled_weight_kernels() is not None
    monkeypatch.setitem(contract._COMPILED, "weights", contract._COMPILED["weights"])  # restored afterwards

    def broken(*args: object) -> int:
        raise RuntimeError("cannot compile")

    monkeypatch.setattr(contract, "_run_weight_kernel", broken)
    assert_same_bits(quantize_weight(w, 8), want)
    assert contract._COMPILED["weights"] is None


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
def test_bad_weight_arguments_are_contract_errors(quantizer: str) -> None:
    quantize = QUANTIZERS[quantizer]
    with pytest.raises(ContractError, match="2-D"):
        quantize(np.zeros(64, np.float32))
    with pytest.raises(ContractError, match="K=48 is not a multiple"):
        quantize(np.zeros((2, 48), np.float32))
    with pytest.raises(ContractError, match="K=64 is not a multiple of the group size G=256"):
        quantize(np.zeros((2, 64), np.float32), 8, 256)
    with pytest.raises(ContractError, match="bits"):
        quantize(np.zeros((2, 64), np.float32), 6)
    with pytest.raises(ContractError, match="uint16"):
        BFloat16Bits(np.zeros((2, 64), np.int16))


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
