"""The CPU backend's compiled kernels against the contract's numpy reference (the definition of correct).

gemm_q8 follows the contract's float order and equals ``reference_gemm_q8`` bit for bit. gemm_f32's block
sums are float sums, which the reference leaves to BLAS: both lie within ``(K/G + 4) * eps32 * bound`` of
the exact value, where ``bound`` is the sum of |terms| (``sum_k |A| * |Wq*w_scale|``); the tests allow
twice that (test_tolerance_is_not_loose shows the bound still catches a 1e-4 relative mis-scaling).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
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
from kestrel_core.registry import Backend, Registry

kernels = pytest.importorskip("kestrel_cpu.kernels", reason="numba is a runtime dependency of kestrel_cpu")
packed = pytest.importorskip("kestrel_cpu.packed")

EPS32 = float(np.finfo(np.float32).eps)


def _bound(a_abs: np.ndarray, w: StripCache) -> np.ndarray:
    """sum_k |a[m,k]| * |Wq[n,k] * w_scale[n,g(k)]| in float64: [M, N]."""
    return a_abs.astype(np.float64) @ np.abs(w.dequantize().astype(np.float64)).T


def _tolerance(a_abs: np.ndarray, w: StripCache) -> np.ndarray:
    return 2 * (w.ngroups + 4) * EPS32 * _bound(a_abs, w) + 1e-30


def _q8_inputs(rng: np.random.Generator, m: int, n: int, k: int, g: int, bits: int
               ) -> tuple[np.ndarray, np.ndarray, StripCache, np.ndarray]:
    w = quantize_weight(rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3), bits, g)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, rng.integers(0, k)] *= 50  # one outlier column, as real activations have
    a_codes, a_scales = quantize_activations(x, g)
    a_abs = np.abs(a_codes.astype(np.float64)) * np.repeat(a_scales, g, axis=1)
    return a_codes, a_scales, w, a_abs


shapes = st.tuples(
    st.integers(1, 64),                                 # M
    st.integers(1, 97),                                 # N (mostly not a multiple of 4)
    st.integers(1, 6),                                  # K / G
    st.sampled_from([32, 256]),                         # G
    st.sampled_from([8, 4]),                            # bits
    st.integers(0, 2**32 - 1),                          # seed
)


@settings(max_examples=120, deadline=None)
@given(shapes)
def test_gemm_q8_matches_reference(shape: tuple[int, int, int, int, int, int]) -> None:
    m, n, blocks, g, bits, seed = shape
    rng = np.random.default_rng(seed)
    a_codes, a_scales, w, a_abs = _q8_inputs(rng, m, n, blocks * g, g, bits)
    ref = reference_gemm_q8(a_codes, a_scales, w)
    for vnni in sorted({False, kernels.VNNI}):  # the vpmaddwd kernels, and the VNNI ones where the CPU has them
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernels, "VNNI", vnni)
            got = kernels.gemm_q8(a_codes, a_scales, w.codes, w.scales)
        assert got.dtype == np.float32 and got.shape == (m, n)
        np.testing.assert_array_equal(got, ref)


def test_gemm_q8_keeps_negative_zero_and_the_block_order() -> None:
    """The sum starts at +0.0 (so -0.0 terms give +0.0, as numpy's sum does), and the terms are added in block
    order: 1e8 + 1 - 1e8 is 0 in float32 that order, 1 in another."""
    codes = np.zeros((1, 64), np.int8)
    w = StripCache(np.zeros((1, 64), np.int8), np.array([[-1.0, -1.0]], np.float32), 32, 8)
    got = kernels.gemm_q8(codes, np.ones((1, 2), np.float32), w.codes, w.scales)
    assert not np.signbit(got[0, 0]) and not np.signbit(reference_gemm_q8(codes, np.ones((1, 2), np.float32), w)[0, 0])
    a = np.ones((1, 96), np.int8)
    w = StripCache(np.ones((1, 96), np.int8), np.array([[1e8 / 32, 1 / 32, -1e8 / 32]], np.float32), 32, 8)
    got = kernels.gemm_q8(a, np.ones((1, 3), np.float32), w.codes, w.scales)
    np.testing.assert_array_equal(got, reference_gemm_q8(a, np.ones((1, 3), np.float32), w))
    assert got[0, 0] == 0.0


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_gemm_f32_matches_reference(shape: tuple[int, int, int, int, int, int]) -> None:
    m, n, blocks, g, bits, seed = shape
    rng = np.random.default_rng(seed)
    w = quantize_weight(rng.standard_normal((n, blocks * g)).astype(np.float32), bits, g)
    x = rng.standard_normal((m, blocks * g)).astype(np.float32)
    ref = reference_gemm_f32(x, w)
    for vnni in sorted({False, kernels.VNNI}):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernels, "VNNI", vnni)
            got = kernels.gemm_f32(x, w.codes, w.scales)
        assert got.dtype == np.float32 and got.shape == (m, n)
        err = np.abs(got.astype(np.float64) - ref)
        assert np.all(err <= _tolerance(np.abs(x), w))


@pytest.mark.parametrize("g", [32, 256])
@pytest.mark.parametrize("bits", [8, 4])
def test_block_sums_are_exact_integers(g: int, bits: int) -> None:
    """Extreme codes with unit scales: the result is an exact integer, so no rounding is allowed at all.

    Every block sum is +-127*127*G (or 127*8*G for int4), the largest the contract allows: an int16
    accumulator or a float accumulation of products would be off.
    """
    lo, hi = (-127, 127) if bits == 8 else (-8, 7)
    m, n, k = 5, 7, 2 * g
    rng = np.random.default_rng(g + bits)
    a_codes = np.where(rng.random((m, k)) < 0.5, -127, 127).astype(np.int8)
    codes = np.where(rng.random((n, k)) < 0.5, lo, hi).astype(np.int8)
    codes[0] = lo
    a_codes[0] = -127  # row 0 x row 0: every product is at its maximum
    w = StripCache(codes, np.ones((n, k // g), np.float32), g, bits)
    a_scales = np.ones((m, k // g), np.float32)
    exact = a_codes.astype(np.int64) @ codes.astype(np.int64).T
    assert np.abs(exact).max() < 2**24  # exactly representable in float32
    got = kernels.gemm_q8(a_codes, a_scales, w.codes, w.scales)
    np.testing.assert_array_equal(got, exact.astype(np.float32))
    np.testing.assert_array_equal(reference_gemm_q8(a_codes, a_scales, w), got)


def test_tolerance_is_not_loose() -> None:
    """The tolerance would catch a kernel that drops one block or mis-scales one row."""
    rng = np.random.default_rng(7)
    a_codes, a_scales, w, a_abs = _q8_inputs(rng, 3, 11, 96, 32, 8)
    ref = reference_gemm_q8(a_codes, a_scales, w)
    wrong_scale = w.scales.copy()
    wrong_scale[4, 1] *= np.float32(1 + 1e-4)
    got = kernels.gemm_q8(a_codes, a_scales, w.codes, wrong_scale)
    assert np.any(np.abs(got.astype(np.float64) - ref) > _tolerance(a_abs, w))


@pytest.mark.parametrize("m", [1, 9])
def test_serial_and_parallel_kernels_agree_exactly(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both builds run the same per-output arithmetic, so the thread split must not change a bit."""
    rng = np.random.default_rng(3)
    a_codes, a_scales, w, _ = _q8_inputs(rng, m, 301, 512, 256, 8)
    monkeypatch.setattr(kernels, "PARALLEL_MIN_MACS", 0)
    parallel = kernels.gemm_q8(a_codes, a_scales, w.codes, w.scales)
    monkeypatch.setattr(kernels, "PARALLEL_MIN_MACS", 1 << 62)
    serial = kernels.gemm_q8(a_codes, a_scales, w.codes, w.scales)
    np.testing.assert_array_equal(parallel, serial)


def test_decode_and_prefill_rows_agree() -> None:
    """A row's result does not depend on the tile it ran in (4x2, 4x1, 1x2, 1x1 on int16 or int8 inputs)."""
    rng = np.random.default_rng(5)
    a_codes, a_scales, w, _ = _q8_inputs(rng, 11, 45, 576, 32, 8)
    batch = kernels.gemm_q8(a_codes, a_scales, w.codes, w.scales)
    for i in range(11):
        one = kernels.gemm_q8(a_codes[i:i + 1], a_scales[i:i + 1], w.codes, w.scales)
        np.testing.assert_array_equal(one[0], batch[i])
    five = kernels.gemm_q8(a_codes[3:8], a_scales[3:8], w.codes[1:], w.scales[1:])
    np.testing.assert_array_equal(five, batch[3:8, 1:])


def test_empty_shapes() -> None:
    w = quantize_weight(np.ones((3, 32), np.float32))
    out = kernels.gemm_q8(np.zeros((0, 32), np.int8), np.zeros((0, 1), np.float32), w.codes, w.scales)
    assert out.shape == (0, 3)
    out = kernels.gemm_f32(np.zeros((0, 32), np.float32), w.codes, w.scales)
    assert out.shape == (0, 3)


# -- through the backend's hooks ---------------------------------------------------------------------------


@pytest.fixture
def cpu() -> Backend:
    backend = Registry().cpu()
    assert backend.bound, backend.reason
    return backend


def test_hooks_use_the_compiled_kernels(cpu: Backend) -> None:
    assert cpu.device.kernels is kernels
    assert "numba" in cpu.device.description
    rng = np.random.default_rng(11)
    a_codes, a_scales, w, a_abs = _q8_inputs(rng, 2, 19, 64, 32, 8)
    # Non-contiguous activations are accepted (copied), not misread.
    a_f = np.asfortranarray(a_codes)
    got = cpu.hook.kestrel_gemm_q8(device=cpu.device, a_codes=a_f, a_scales=a_scales, weight=w, wkey=0)
    np.testing.assert_array_equal(got, kernels.gemm_q8(a_codes, a_scales, w.codes, w.scales))
    x = rng.standard_normal((2, 64)).astype(np.float64)  # float64 input is cast like the reference does
    got = cpu.hook.kestrel_gemm_f32(device=cpu.device, a=x, weight=w, wkey=0)
    ref = reference_gemm_f32(x.astype(np.float32), w)
    assert np.all(np.abs(got - ref) <= _tolerance(np.abs(x), w))


def test_hooks_reject_mismatched_activations(cpu: Backend) -> None:
    w = quantize_weight(np.ones((3, 64), np.float32))
    a_codes, a_scales = quantize_activations(np.ones((2, 32), np.float32))
    with pytest.raises(ContractError, match="do not match"):
        cpu.hook.kestrel_gemm_q8(device=cpu.device, a_codes=a_codes, a_scales=a_scales, weight=w, wkey=0)
    with pytest.raises(ContractError, match="int8"):
        cpu.hook.kestrel_gemm_q8(device=cpu.device, a_codes=a_codes.astype(np.int16), a_scales=a_scales,
                                 weight=w, wkey=0)
    with pytest.raises(ContractError, match="do not match"):
        cpu.hook.kestrel_gemm_f32(device=cpu.device, a=np.ones((2, 32), np.float32), weight=w, wkey=0)


def test_reference_mode_runs_the_numpy_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    import kestrel_cpu

    monkeypatch.setenv(kestrel_cpu.REFERENCE_ENV, "1")
    device = kestrel_cpu.kestrel_open(options={})
    assert device.kernels is None and "numpy reference" in device.description
    rng = np.random.default_rng(2)
    a_codes, a_scales, w, _ = _q8_inputs(rng, 3, 10, 256, 256, 4)
    np.testing.assert_array_equal(
        kestrel_cpu.kestrel_gemm_q8(device=device, a_codes=a_codes, a_scales=a_scales, weight=w, wkey=0),
        reference_gemm_q8(a_codes, a_scales, w))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.lists(st.integers(1, 70), min_size=1, max_size=3), st.integers(1, 3),
       st.sampled_from([32, 256]), st.sampled_from([8, 4]), st.integers(0, 2**32 - 1))
def test_fused_hook_equals_separate_gemms(m: int, ns: list[int], blocks: int, g: int, bits: int,
                                          seed: int) -> None:
    """The fused pass computes each output exactly as gemm_q8 does, so it is bit-identical to it."""
    import kestrel_cpu

    rng = np.random.default_rng(seed)
    k = blocks * g
    ws = [quantize_weight(rng.standard_normal((n, k)).astype(np.float32), bits, g) for n in ns]
    a_codes, a_scales = quantize_activations(rng.standard_normal((m, k)).astype(np.float32), g)
    device = kestrel_cpu.kestrel_open(options={})
    outs = kestrel_cpu.kestrel_gemm_fused_q8(device=device, a_codes=a_codes, a_scales=a_scales, weights=ws,
                                             wkeys=[0] * len(ws), fused_wkey=0)
    assert len(outs) == len(ws)
    for out, w in zip(outs, ws):
        assert out.dtype == np.float32 and out.shape == (m, w.n)
        np.testing.assert_array_equal(out, kernels.gemm_q8(a_codes, a_scales, w.codes, w.scales))
        np.testing.assert_array_equal(out, reference_gemm_q8(a_codes, a_scales, w))


def test_fused_hook_declines_weights_that_do_not_share_k_and_g(cpu: Backend) -> None:
    a_codes, a_scales = quantize_activations(np.ones((1, 256), np.float32), 32)
    same_k_other_g = [quantize_weight(np.ones((4, 256), np.float32), 8, 32),
                      quantize_weight(np.ones((4, 256), np.float32), 8, 256)]
    other_k = [quantize_weight(np.ones((4, 256), np.float32)), quantize_weight(np.ones((4, 512), np.float32))]
    for ws in (same_k_other_g, other_k):
        assert cpu.hook.kestrel_gemm_fused_q8(device=cpu.device, a_codes=a_codes, a_scales=a_scales,
                                              weights=ws, wkeys=[0, 0], fused_wkey=0) is None


def test_parallel_and_serial_builds_have_their_own_disk_cache() -> None:
    """numba keys its on-disk cache by qualified name and line: one shared name made the parallel build load
    the serial build's code (one thread) whenever the serial one was cached first. The packed kernels' builds
    for int8 and int4 weights (each on its own tiles) are told apart the same way."""
    pairs = [(kernels._gemm_q8_parallel, kernels._gemm_q8_serial), (packed._pack_parallel, packed._pack_serial),
             (kernels._gemm_f32_parallel, kernels._gemm_f32_serial)]
    pairs += [(builds[bits, True], builds[bits, False]) for builds in (packed.Q8_BUILDS, packed.F32_BUILDS)
              for bits in (8, 4)]
    for par, ser in pairs:
        assert par.targetoptions.get("parallel") and not ser.targetoptions.get("parallel")
        assert par.py_func.__qualname__ != ser.py_func.__qualname__
        assert par.py_func.__code__ is ser.py_func.__code__  # the same arithmetic
    for builds in (packed.Q8_BUILDS, packed.F32_BUILDS):
        names = {build.py_func.__qualname__ for build in builds.values()}
        assert len(names) == len(builds) == 4
        assert builds[8, True].py_func.__globals__["_QUADS"] == 1 and builds[4, True].py_func.__globals__["_QUADS"] == 2


needs_packing = pytest.mark.skipif(not packed.PACKED_BITS, reason="this CPU has neither VNNI nor AVX2: the "
                                                                   "vpmaddwd kernels run")


def _packs(bits: int) -> None:
    if bits not in packed.PACKED_BITS:
        pytest.skip(f"this CPU's packed kernels take {packed.PACKED_BITS}-bit weights (int8 ones need VNNI)")


def _unpacked(pack: Any, k: int) -> np.ndarray:
    """The signed codes a ``Packed`` holds, [N padded to W, K], read back from its layout (W columns a vector)."""
    w = packed.PACK_COLS
    groups = pack.codes.shape[0]
    if pack.bits == 8:
        return pack.codes.reshape(groups, k // 4, w, 4).transpose(0, 2, 1, 3).reshape(groups * w, k).astype(
            np.int16) - 128
    octets = pack.codes.reshape(groups, k // 8, w, 4).transpose(0, 2, 1, 3)  # [groups, W, K/8, 4] bytes
    quads = np.stack([octets & 0x0F, octets >> 4], axis=3)  # [groups, W, K/8, 2, 4]: low nibbles first
    return quads.reshape(groups * w, k).astype(np.int16) - 8


@pytest.mark.parametrize(("m", "n", "k", "g", "bits"), [(1, 576, 576, 32, 8), (8, 17, 256, 256, 4),
                                                       (13, 48, 64, 32, 8), (64, 100, 512, 256, 8),
                                                       (1, 576, 576, 32, 4), (9, 33, 96, 32, 4)])
def test_packed_layout_holds_each_weight_exactly(m: int, n: int, k: int, g: int, bits: int) -> None:
    """Packed int8 codes are code + 128 at (column group, k-quad, column, k), int4 codes two k-quads a vector in
    its low and high nibbles (code + 8), zero codes in the padding; the VNNI result equals the reference's for
    rows beside padded columns, G = 256 too, extreme codes included, and the float32 GEMM gives the same bits
    on either layout."""
    _packs(bits)
    rng = np.random.default_rng(k + n)
    a_codes, a_scales, w, _ = _q8_inputs(rng, m, n, k, g, bits)
    a_codes[0, :32] = -127  # the bias's correction at its extremes
    lo, hi = (-127, 127) if bits == 8 else (-8, 7)
    w.codes[0, :8], w.codes[-1, :8] = lo, hi
    pack = kernels.Packed(w.codes, w.scales, bits)
    width = packed.PACK_COLS
    groups = -(-n // width)
    assert pack.codes.shape == (groups, k * width * bits // 8) and pack.n == n and pack.bits == bits
    layout = _unpacked(pack, k)
    np.testing.assert_array_equal(layout[:n], w.codes)
    assert (layout[n:] == 0).all()
    np.testing.assert_array_equal(kernels.gemm_q8(a_codes, a_scales, w.codes, w.scales, pack),
                                  reference_gemm_q8(a_codes, a_scales, w))
    x = (a_codes * np.repeat(a_scales, g, axis=1)).astype(np.float32)
    got = kernels.gemm_f32(x, w.codes, w.scales, pack)
    assert np.all(np.abs(got - reference_gemm_f32(x, w)) <= _tolerance(np.abs(x), w))
    np.testing.assert_array_equal(got, kernels.gemm_f32(x, w.codes, w.scales, kernels.Packed(w.codes, w.scales)))


@needs_packing
def test_int4_weights_pack_at_half_the_bytes_and_fuse_with_int8(cpu: Backend) -> None:
    """The backend packs a weight at its own bits (an int4 one in half the bytes of codes; an int8 one only with
    VNNI); a fused pass over weights of both kinds gives each one's reference bits."""
    import kestrel_cpu

    device = kestrel_cpu.kestrel_open(options={})
    rng = np.random.default_rng(21)
    a_codes, a_scales, w4, _ = _q8_inputs(rng, 3, 40, 64, 32, 4)
    w8 = quantize_weight(rng.standard_normal((24, 64)).astype(np.float32), 8, 32)
    padded = -(-40 // packed.PACK_COLS) * packed.PACK_COLS
    assert device.packed_for(3, w4).codes.nbytes == padded * 64 // 2  # two codes a byte
    assert (device.packed_for(4, w8) is None) == (8 not in packed.PACKED_BITS)
    outs = kestrel_cpu.kestrel_gemm_fused_q8(device=device, a_codes=a_codes, a_scales=a_scales,
                                             weights=[w4, w8, w4], wkeys=[3, 4, 3], fused_wkey=5)
    for out, w in zip(outs, (w4, w8, w4)):
        np.testing.assert_array_equal(out, reference_gemm_q8(a_codes, a_scales, w))


@needs_packing
def test_backend_packs_each_weight_once_under_its_wkey(cpu: Backend) -> None:
    """A wkey's packed weights are made once and reused; another array under the same wkey (another model's)
    replaces them; wkey 0 is never cached; closing the device drops them."""
    import kestrel_cpu

    device = kestrel_cpu.kestrel_open(options={})
    rng = np.random.default_rng(4)
    a_codes, a_scales, w, _ = _q8_inputs(rng, 3, 40, 64, 32, packed.PACKED_BITS[0])
    first = device.packed_for(7, w)
    assert device.packed_for(7, w) is first and set(device.packed) == {7}
    other = StripCache(w.codes.copy(), w.scales.copy(), w.group_size, w.bits)
    assert device.packed_for(7, other) is not first
    device.packed_for(0, w)
    assert set(device.packed) == {7}
    got = kestrel_cpu.kestrel_gemm_q8(device=device, a_codes=a_codes, a_scales=a_scales, weight=w, wkey=9)
    np.testing.assert_array_equal(got, reference_gemm_q8(a_codes, a_scales, w))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    kestrel_cpu.kestrel_gemm_f32(device=device, a=x, weight=w, wkey=9)
    assert set(device.packed) == {7, 9}  # the float32 GEMM shares the int8 one's packed weight
    kestrel_cpu.kestrel_close(device=device)
    assert not device.packed


@pytest.mark.parametrize("vnni", [False, True])
def test_f32_rows_do_not_depend_on_the_batch(vnni: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row of the float32 GEMM runs one fixed sequence of operations, alone or in a tile of 8: the
    scheduler's batched = alone guarantee holds for float32 prompts too."""
    if vnni and not kernels.VNNI:
        pytest.skip("this CPU has no VNNI")
    monkeypatch.setattr(kernels, "VNNI", vnni)
    rng = np.random.default_rng(8)
    w = quantize_weight(rng.standard_normal((45, 576)).astype(np.float32), 8, 32)
    x = rng.standard_normal((19, 576)).astype(np.float32)
    batch = kernels.gemm_f32(x, w.codes, w.scales)
    for i in (0, 7, 8, 18):
        np.testing.assert_array_equal(kernels.gemm_f32(x[i:i + 1], w.codes, w.scales)[0], batch[i])
    assert np.all(np.abs(batch - reference_gemm_f32(x, w)) <= _tolerance(np.abs(x), w))


@needs_packing
@pytest.mark.parametrize("bits", [8, 4])
def test_packing_can_be_turned_off_for_memory(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """KESTREL_CPU_PACKED=0: no packed copy is kept and the vpmaddwd kernels give the reference's bits."""
    import kestrel_cpu

    monkeypatch.setenv(kestrel_cpu.PACKED_ENV, "0")
    device = kestrel_cpu.kestrel_open(options={})
    assert not device.vnni and not device.packed_bits and "VNNI" not in device.description
    assert "packed" not in device.description
    rng = np.random.default_rng(12)
    a_codes, a_scales, w, _ = _q8_inputs(rng, 9, 40, 64, 32, bits)
    got = kestrel_cpu.kestrel_gemm_q8(device=device, a_codes=a_codes, a_scales=a_scales, weight=w, wkey=5)
    np.testing.assert_array_equal(got, reference_gemm_q8(a_codes, a_scales, w))
    assert device.packed == {}
