"""GPU tests of the CUDA kernels against the CPU reference (kestrel_core.contract).

Tolerance of the int8 GEMMs. Every kernel forms each block sum exactly in int32 (dp4a or mma.sync). The
GEMV and the unsplit tensor-core shapes form each per-group term exactly as the reference does, t_g =
((float)sum_g * a_scale) * w_scale (two float32 roundings, no FMA: --fmad=false); the split tensor-core
shapes (decode batches) form sum_g * a' with one rounding, a' the row scale rounded to 22 significant bits
(within 4u of a_scale), and add it times w_scale with a fused multiply-add: a term within 7u * |t_g| of the
reference's. Beyond that only the order in which the terms of the ng groups are added differs (the
reference adds them sequentially; the GEMV splits K over lanes, warps and blocks, the split shapes over
blocks). Any summation order of n terms is within (n-1) * u * sum|t_g| of the exact sum (u = 2^-24), so two
orders differ by at most 2 * (ng-1) * u * sum|t_g|; the bound below uses 2 * ng + 6. The unsplit
tensor-core shapes add the groups in the reference's order, so they must match bit for bit. The block
shape and split choices, host-side, are tested in test_gemm_plan.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_core.contract import (
    StripCache,
    quantize_activations,
    quantize_weight,
    reference_gemm_f32,
    reference_gemm_q8,
)
from kestrel_core.wkey import NO_CACHE, Proj, wkey

cp = pytest.importorskip("cupy", reason="CuPy is not installed")

from .forward_check import cuda_device_count  # noqa: E402

if cuda_device_count() < 1:
    pytest.skip("no CUDA device", allow_module_level=True)

pytestmark = pytest.mark.cuda

from kestrel_cuda.binding import open_device  # noqa: E402
from kestrel_cuda.gemm import (  # noqa: E402
    GEMV_MAX_M,
    SPLIT_MAX_M,
    DeviceGemm,
    gemv_warp_variant,
    mma_splits,
    mma_tile_for,
    split_rows,
    tma_splits,
)
from kestrel_cuda.kernels import (  # noqa: E402
    BLOCK_SHAPES,
    GEMV_WARP_VARIANTS,
    MMA_TILE_SPLIT,
    MMA_TILE_SPLIT_SMALL,
    MMA_TILES,
    TMA_TILE,
)
from kestrel_cuda.layout import pad_n  # noqa: E402
from kestrel_cuda.weights import geometry_for  # noqa: E402

U = 2.0 ** -24


@pytest.fixture(scope="module")
def dev():
    device = open_device({})
    yield device
    device.close()


def rand_weight(rng: np.random.Generator, n: int, k: int, g: int, bits: int) -> StripCache:
    return quantize_weight(rng.standard_normal((n, k)).astype(np.float32), bits, g)


def term_bound(a_codes: np.ndarray, a_scales: np.ndarray, w: StripCache) -> np.ndarray:
    """sum_g |t_g| per output element, in float64."""
    g = w.group_size
    m = a_codes.shape[0]
    a = a_codes.reshape(m, -1, g).transpose(1, 0, 2).astype(np.float64)
    b = w.codes.reshape(w.n, -1, g).transpose(1, 2, 0).astype(np.float64)
    sums = np.abs(np.matmul(a, b))                                            # [ng, M, N] exact
    return (sums * np.abs(a_scales.T[:, :, None]) * np.abs(w.scales.T[:, None, :])).sum(axis=0)


def assert_close_q8(got: np.ndarray, a_codes: np.ndarray, a_scales: np.ndarray, w: StripCache) -> None:
    ref = reference_gemm_q8(a_codes, a_scales, w)
    assert got.shape == ref.shape and got.dtype == np.float32
    assert np.all(np.isfinite(got))
    tol = (2 * w.ngroups + 6) * U * term_bound(a_codes, a_scales, w) + 1e-30
    err = np.abs(got.astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert np.all(err <= tol), f"err {err[worst]:.3g} > tol {tol[worst]:.3g} at {worst}"


def run_q8(dev, a_codes, a_scales, w, key=NO_CACHE, gemm=None, init=None, **kw) -> np.ndarray:
    """The GEMM's output, written over NaN (every element must be written) or over ``init``."""
    with dev.stream:  # the device stream is non-blocking: the poison fill must be ordered before the GEMM
        a = cp.asarray(a_codes)
        s = cp.asarray(a_scales)
        out = cp.full((a_codes.shape[0], w.n), np.nan, dtype=cp.float32) if init is None else cp.asarray(init)
    dw = dev.weight(key, [w])
    (gemm or dev.gemm).q8(a, s, dw, out, w.n, dev.stream, **kw)
    dev.stream.synchronize()
    dev.cache.release(dw)
    return cp.asnumpy(out)


# -- activation quantization -------------------------------------------------------------------------


@pytest.mark.parametrize("g", [32, 256])
def test_quantize_bit_identical(dev, g: int) -> None:
    rng = np.random.default_rng(g)
    m, k = 9, 2048
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 100, (m, 1))).astype(np.float32)
    x[0, :g] = 0.0  # an all-zero block: scale 0, codes 0
    x[1, :g] = np.linspace(-1, 1, g, dtype=np.float32) * 127 / 2  # many exact .5 ties: half away from zero
    x[2, :g] = np.float32(0.49999997)  # roundf gives 0 where floor(|v| + 0.5) would give 1
    x[2, 0] = np.float32(127.0)
    codes = cp.empty((m, k), dtype=cp.int8)
    scales = cp.empty((m, k // g), dtype=cp.float32)
    dev.gemm.quantize(cp.asarray(x), g, codes, scales, dev.stream)
    dev.stream.synchronize()
    # float64 input takes the contract's defining path (_quantize_q8 with round_half_away = C's roundf); its
    # float32 fast path rounds 0.49999997 up (trunc(v + 0.5)), which the contract itself calls wrong
    want_codes, want_scales = quantize_activations(x.astype(np.float64), g)
    np.testing.assert_array_equal(cp.asnumpy(codes), want_codes)
    np.testing.assert_array_equal(cp.asnumpy(scales), want_scales)


# -- upload layout -----------------------------------------------------------------------------------


def expected_layout(strips: list[StripCache], npad: int) -> tuple[np.ndarray, np.ndarray]:
    k = strips[0].k
    codes = np.zeros((k, npad), dtype=np.int8)
    scales = np.zeros((strips[0].ngroups, npad), dtype=np.float32)
    off = 0
    for s in strips:
        codes[:, off:off + s.n] = s.codes.T
        scales[:, off:off + s.n] = s.scales.T
        off += s.n
    if strips[0].bits == 4:
        u = (codes.astype(np.int16) + 8).astype(np.uint8)
        u[:, off:] = 0  # padding columns are zero bytes, not +8
        # words of 8 k of one column: byte b = k0 + b | (k0 + 4 + b) << 4
        halves = u.reshape(k // 8, 2, 4, npad)                         # [kw][half][b][n]
        packed = (halves[:, 0] | (halves[:, 1] << 4)).transpose(0, 2, 1)  # [kw][n][b]
        return np.ascontiguousarray(packed).reshape(k // 8, 4 * npad).view(np.int8), scales
    return codes, scales


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("g", [32, 256])
@pytest.mark.parametrize("ns", [(37,), (1000,), (64, 32, 32)])
def test_upload_layout(dev, bits: int, g: int, ns: tuple[int, ...]) -> None:
    rng = np.random.default_rng([bits, g, *ns])
    k = 512
    strips = [rand_weight(rng, n, k, g, bits) for n in ns]
    dw = dev.weight(wkey(900 + len(ns), Proj.Q), strips)
    dev.stream.synchronize()
    npad = dw.geometry.npad
    assert npad == (pad_n(ns[0]) if len(ns) == 1 else sum(ns))
    want_codes, want_scales = expected_layout(strips, npad)
    got_codes = cp.asnumpy(dw.codes).reshape(want_codes.shape)
    np.testing.assert_array_equal(got_codes, want_codes)
    np.testing.assert_array_equal(cp.asnumpy(dw.scales), want_scales)


# -- int8 GEMM ---------------------------------------------------------------------------------------

SHAPES = [  # (M, N, K): GEMV (M = 1) with every column-vector width, the tensor-core kernel split over K (2-64
    # rows of whole 128-column tiles and 128-deep stages) and whole
    (1, 256, 4096), (1, 37, 512), (1, 136, 1024), (1, 4096, 4096), (2, 1000, 2048), (3, 200, 1024),
    (4, 136, 4096), (7, 37, 1024), (8, 512, 1024), (9, 37, 512), (17, 384, 1024), (64, 256, 1024),
    (130, 200, 2048), (512, 384, 2048),
]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("g", [32, 256])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_q8(dev, bits: int, g: int, m: int, n: int, k: int) -> None:
    rng = np.random.default_rng([m, n, k, g, bits])
    w = rand_weight(rng, n, k, g, bits)
    a_codes, a_scales = quantize_activations(rng.standard_normal((m, k)).astype(np.float32), g)
    got = run_q8(dev, a_codes, a_scales, w)
    assert_close_q8(got, a_codes, a_scales, w)
    if m > GEMV_MAX_M and not MMA_TILES[mma_tile_for(m, pad_n(n), dev.gemm.sm_count, k)].split:
        # the unsplit block shapes compute and add the groups' terms as the reference: identical results
        np.testing.assert_array_equal(got, reference_gemm_q8(a_codes, a_scales, w))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("g", [32, 256])
def test_split_gemm_is_batch_invariant(dev, bits: int, g: int) -> None:
    """2..SPLIT_MAX_M rows split K the same way whatever M (and so the block shape), so a row's result has the
    same bits in every batch (the tensor-copy block: in every batch of 2-32 rows and in every batch of 33-64,
    whose splits are half as many); the splits' sums added by a cluster (sm_90) and from the workspace by the
    last split to arrive are the same bits too."""
    rng = np.random.default_rng([bits, g, 3])
    k = 3072
    w = rand_weight(rng, 1024, k, g, bits)
    splits = mma_splits(k, pad_n(w.n), g, dev.gemm.sm_count)[0]
    assert splits > 1
    assert dev.gemm.clusters == (dev.compute_capability >= 90)
    a_codes, a_scales = quantize_activations(rng.standard_normal((SPLIT_MAX_M, k)).astype(np.float32), g)
    full = run_q8(dev, a_codes, a_scales, w)
    assert_close_q8(full, a_codes, a_scales, w)
    target = run_q8(dev, a_codes, a_scales, w, mma_tile=MMA_TILE_SPLIT)  # the cp.async block: the target's splits
    if dev.gemm.tile_for(SPLIT_MAX_M, geometry_for([w])) == TMA_TILE:
        assert not np.array_equal(full, target)
        half = tma_splits(SPLIT_MAX_M, BLOCK_SHAPES[TMA_TILE].bm, splits)
        np.testing.assert_array_equal(full, run_q8(dev, a_codes, a_scales, w, splits=half, mma_tile=MMA_TILE_SPLIT))
    else:
        np.testing.assert_array_equal(full, target)
    for m in (2, 5, 16, 17, 32, 33, 40):
        assert MMA_TILES[mma_tile_for(m, pad_n(w.n), dev.gemm.sm_count, k)].split
        np.testing.assert_array_equal(run_q8(dev, a_codes[-m:], a_scales[-m:], w), (full if m > 32 else target)[-m:])
    merged = DeviceGemm(cp, dev.kernels, dev.sm_count, clusters=False)
    for m in (5, SPLIT_MAX_M):
        np.testing.assert_array_equal(run_q8(dev, a_codes[:m], a_scales[:m], w, gemm=merged), target[:m])
    one = run_q8(dev, a_codes[:40], a_scales[:40], w, splits=1)
    assert_close_q8(one, a_codes[:40], a_scales[:40], w)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("g", [32, 256])
@pytest.mark.parametrize("m", [544, 513])
def test_rows_past_whole_blocks_run_apart(dev, bits: int, g: int, m: int) -> None:
    """544 / 513 rows: the first 512 through the large block as the reference adds them (identical), the last
    32 / 1 through the split shapes (the last row alone too, not the GEMV), within the bound and with the bits
    that block gives them alone."""
    rng = np.random.default_rng([bits, g, m])
    w = rand_weight(rng, 384, 2048, g, bits)
    a_codes, a_scales = quantize_activations(rng.standard_normal((m, w.k)).astype(np.float32), g)
    assert split_rows(m, w.k, pad_n(w.n)) == m - 512
    got = run_q8(dev, a_codes, a_scales, w)
    np.testing.assert_array_equal(got[:512], reference_gemm_q8(a_codes[:512], a_scales[:512], w))
    assert_close_q8(got[512:], a_codes[512:], a_scales[512:], w)
    tile = dev.gemm.tile_for(m - 512, geometry_for([w]))
    assert BLOCK_SHAPES[tile].split
    np.testing.assert_array_equal(got[512:], run_q8(dev, a_codes[512:], a_scales[512:], w, mma_tile=tile))


@pytest.mark.parametrize("tile", [t for t in MMA_TILES if not MMA_TILES[t].split])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("g", [32, 256])
@pytest.mark.parametrize("n", [200, 400])  # Npad % 16 != 0 (word copies of B) and == 0 (16-byte copies)
def test_every_mma_tile(dev, tile: str, bits: int, g: int, n: int) -> None:
    rng = np.random.default_rng([len(tile), bits, g, n])
    w = rand_weight(rng, n, 1280 if g == 256 else 1120, g, bits)  # G=32: K ends in half a 64-wide stage
    a_codes, a_scales = quantize_activations(rng.standard_normal((70, w.k)).astype(np.float32), g)  # M % 64 != 0
    got = run_q8(dev, a_codes, a_scales, w, mma_tile=tile)
    np.testing.assert_array_equal(got, reference_gemm_q8(a_codes, a_scales, w))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("g", [32, 256])
@pytest.mark.parametrize("m", [3, 40, 70])  # one row block with rows past M, two and a half, three unsplit
def test_split_mma_tiles(dev, bits: int, g: int, m: int) -> None:
    """The split block shapes (fused multiply-add scaling: within the bound, not the reference's bits) agree
    bit for bit with each other at every M, and refuse a weight of partial stages or column tiles."""
    rng = np.random.default_rng([bits, g, m])
    w = rand_weight(rng, 384, 1280, g, bits)
    a_codes, a_scales = quantize_activations(rng.standard_normal((m, w.k)).astype(np.float32), g)
    small = run_q8(dev, a_codes, a_scales, w, mma_tile=MMA_TILE_SPLIT_SMALL)
    assert_close_q8(small, a_codes, a_scales, w)
    np.testing.assert_array_equal(run_q8(dev, a_codes, a_scales, w, mma_tile=MMA_TILE_SPLIT), small)
    odd = rand_weight(rng, 200, 1280, g, bits)
    with pytest.raises(ValueError, match="whole stages and tiles"):
        run_q8(dev, a_codes, a_scales, odd, mma_tile=MMA_TILE_SPLIT)


@pytest.mark.parametrize("m", [3, 17, 40, 64])
def test_tensor_copy_split_block(dev, m: int) -> None:
    """The tensor-copy block (sm_90, int8 G = 32) has the bits of the cp.async split block with the same K splits
    at every M (rows past M arrive as zeros), is the one 17..64 rows run with, and takes no other code width."""
    assert dev.gemm.tensor_copies == (dev.compute_capability >= 90 and dev.gemm.clusters)
    if not dev.gemm.tensor_copies:
        pytest.skip("tensor copies need sm_90 with clusters")
    rng = np.random.default_rng([8, 32, m])
    w = rand_weight(rng, 640, 3072, 32, 8)
    a_codes, a_scales = quantize_activations(rng.standard_normal((m, w.k)).astype(np.float32), 32)
    got = run_q8(dev, a_codes, a_scales, w, mma_tile=TMA_TILE)
    assert_close_q8(got, a_codes, a_scales, w)
    target = mma_splits(w.k, pad_n(w.n), 32, dev.gemm.sm_count)[0]
    splits = tma_splits(m, BLOCK_SHAPES[TMA_TILE].bm, target)  # half from 33 rows
    np.testing.assert_array_equal(got, run_q8(dev, a_codes, a_scales, w, splits=splits, mma_tile=MMA_TILE_SPLIT))
    np.testing.assert_array_equal(run_q8(dev, a_codes, a_scales, w, splits=1, mma_tile=TMA_TILE),
                                  run_q8(dev, a_codes, a_scales, w, splits=1, mma_tile=MMA_TILE_SPLIT))
    assert dev.gemm.tile_for(m, geometry_for([w])) == (TMA_TILE if m > MMA_TILES[MMA_TILE_SPLIT_SMALL].bm else
                                              MMA_TILE_SPLIT_SMALL)
    q4 = rand_weight(rng, 640, 3072, 32, 4)
    assert dev.gemm.tile_for(m, geometry_for([q4])) != TMA_TILE
    with pytest.raises(ValueError, match="no tensor-core kernel"):
        run_q8(dev, a_codes, a_scales, q4, mma_tile=TMA_TILE)


@pytest.mark.parametrize("m,n,kw", [
    (3, 640, {}), (40, 640, {}), (40, 640, {"splits": 1}), (64, 640, {"mma_tile": MMA_TILE_SPLIT}),
    (5, 640, {"merged": True}), (70, 200, {}), (544, 384, {}), (513, 384, {}), (512, 4096, {})])
def test_accumulate_adds_the_product_to_what_out_holds(dev, m: int, n: int, kw: dict) -> None:
    """``accumulate`` (the residual add in the GEMM's own store): out + the product the same call would
    store, bit for bit, in every shape: the split blocks (a cluster's merge, one split, the workspace merge of
    the last split to arrive), the tensor-copy block, the unsplit blocks (a width whose last columns take
    scalar stores; the large block) and rows past whole large blocks (one row too: the split block's)."""
    rng = np.random.default_rng([m, n])
    w = rand_weight(rng, n, 2048, 32, 8)
    a_codes, a_scales = quantize_activations(rng.standard_normal((m, w.k)).astype(np.float32), 32)
    kw = dict(kw)
    if kw.pop("merged", False):
        kw["gemm"] = DeviceGemm(cp, dev.kernels, dev.sm_count, clusters=False)
    stored = run_q8(dev, a_codes, a_scales, w, **kw)
    residual = rng.standard_normal(stored.shape).astype(np.float32)
    got = run_q8(dev, a_codes, a_scales, w, init=residual, accumulate=True, **kw)
    np.testing.assert_array_equal(got, residual + stored)
    with pytest.raises(ValueError, match="accumulate"):
        run_q8(dev, a_codes[:1], a_scales[:1], w, accumulate=True)


@pytest.mark.parametrize("m,splits", [(24, None), (40, None), (64, 3)])  # one chunk a block; two; a cluster of 2
def test_the_norm_fold(dev, m: int, splits: int | None) -> None:
    """The norm fold: a residual add in the tensor-copy block also writes its new rows times the norm's weights
    as quantize_activations makes their codes and scales, and the rows' sums of squares per 128 columns
    (tile-major); the GEMM that reads those codes with ``row_ssq`` multiplies each row's sums by its 1 / rms
    from them (the split block's bound against the reference on the scales times 1 / rms). The sums out holds
    are the plain residual add's."""
    if not dev.gemm.tensor_copies:
        pytest.skip("tensor copies need sm_90 with clusters")
    rng = np.random.default_rng([m, 7])
    w, after = rand_weight(rng, 512, 2048, 32, 8), rand_weight(rng, 384, 512, 32, 8)
    a_codes, a_scales = quantize_activations(rng.standard_normal((m, w.k)).astype(np.float32), 32)
    residual = rng.standard_normal((m, w.n)).astype(np.float32)
    norm, eps = rng.uniform(0.5, 1.5, w.n).astype(np.float32), 1e-6
    assert dev.gemm.norm_fold(m, geometry_for([w]), w.n, [geometry_for([after])])
    codes = cp.full((m, w.n), 99, dtype=cp.int8)
    scales, ssq = cp.full((m, w.n // 32), np.nan, dtype=cp.float32), cp.full((w.n // 128, m), np.nan, cp.float32)
    kw = {} if splits is None else {"splits": splits}
    got = run_q8(dev, a_codes, a_scales, w, init=residual, accumulate=True,
                 fold=(cp.asarray(norm), codes, scales, ssq), **kw)
    np.testing.assert_array_equal(got, run_q8(dev, a_codes, a_scales, w, init=residual, accumulate=True, **kw))
    want_codes, want_scales = quantize_activations((got * norm).astype(np.float64), 32)
    np.testing.assert_array_equal(cp.asnumpy(codes), want_codes)
    np.testing.assert_array_equal(cp.asnumpy(scales), want_scales)
    sums = cp.asnumpy(ssq).T  # [M, N / 128]
    np.testing.assert_allclose(sums, (got.astype(np.float64) ** 2).reshape(m, -1, 128).sum(axis=2), rtol=1e-5)
    ss = np.cumsum(sums, axis=1, dtype=np.float32)[:, -1:]
    rinv = np.float32(1) / np.sqrt(ss / np.float32(w.n) + np.float32(eps))
    out = run_q8(dev, codes, scales, after, row_ssq=(ssq, eps))
    assert_close_q8(out, want_codes, (want_scales * rinv).astype(np.float32), after)
    assert not dev.gemm.norm_fold(8, geometry_for([w]), w.n, [geometry_for([after])])
    with pytest.raises(ValueError, match="no norm fold"):
        run_q8(dev, a_codes[:8], a_scales[:8], w, init=residual[:8], accumulate=True,
               fold=(cp.asarray(norm), codes, scales, ssq))


@pytest.mark.parametrize("g", [32, 256])
@pytest.mark.parametrize("n", [136, 256])  # the unsplit and the split block shapes
def test_mma_extreme_block_sums(dev, g: int, n: int) -> None:
    """Block sums at the ends of their range (|s| up to 256 * 128 * 127 for G=256) stay exact: the kernel forms
    (float)s as __int_as_float(0x4B400000 + s) - 1.5 * 2^23, exact only for |s| <= 2^22."""
    rng = np.random.default_rng(g)
    m, k = 40, 1024
    a_codes = rng.choice(np.array([-128, 127], dtype=np.int8), size=(m, k))
    a_codes[0] = -128  # row 0 x column 0: every block sum is 128 * 127 * G, the largest in magnitude
    codes = rng.choice(np.array([-127, 127], dtype=np.int8), size=(n, k))
    codes[0] = -127
    codes[1] = 127
    w = StripCache(codes, rng.uniform(1e-3, 2e-2, (n, k // g)).astype(np.float32), g, 8)
    a_scales = rng.uniform(1e-3, 2e-2, (m, k // g)).astype(np.float32)
    got = run_q8(dev, a_codes, a_scales, w, splits=1)
    if MMA_TILES[mma_tile_for(m, pad_n(n), dev.gemm.sm_count, k)].split:
        assert_close_q8(got, a_codes, a_scales, w)
    else:
        np.testing.assert_array_equal(got, reference_gemm_q8(a_codes, a_scales, w))


GEMV_CASES = [("warp", *v) for v in GEMV_WARP_VARIANTS]


@pytest.mark.parametrize("variant", GEMV_CASES, ids=[str(v) for v in GEMV_CASES])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("g", [32, 256])
def test_every_gemv_variant(dev, variant: tuple, splits: int, g: int) -> None:
    _, mt, vec, bits = variant
    n = 116 if vec == 4 else 112  # Npad % 8 != 0 for the 4-column variants
    rng = np.random.default_rng([mt, vec, bits, splits, g])
    w = rand_weight(rng, n, 3072, g, bits)
    m = mt + 1  # more rows than one tile: two launches
    a_codes, a_scales = quantize_activations(rng.standard_normal((m, 3072)).astype(np.float32), g)
    got = run_q8(dev, a_codes, a_scales, w, variant=variant, splits=splits)
    assert_close_q8(got, a_codes, a_scales, w)


def test_gemv_is_deterministic(dev) -> None:
    rng = np.random.default_rng(5)
    w = rand_weight(rng, 1024, 4096, 32, 8)
    a_codes, a_scales = quantize_activations(rng.standard_normal((1, 4096)).astype(np.float32), 32)
    first = run_q8(dev, a_codes, a_scales, w, key=wkey(950, Proj.K))
    for _ in range(3):
        np.testing.assert_array_equal(run_q8(dev, a_codes, a_scales, w, key=wkey(950, Proj.K)), first)


def test_variant_choice() -> None:
    assert gemv_warp_variant(4096, 8) == ("warp", 1, 8, 8)
    assert gemv_warp_variant(40, 4) == ("warp", 1, 8, 4)
    assert gemv_warp_variant(36, 8) == ("warp", 1, 4, 8)
    assert all(gemv_warp_variant(n, b)[1:] in GEMV_WARP_VARIANTS for n in (36, 4096) for b in (8, 4))


# -- float activations -------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("g", [32, 256])
@pytest.mark.parametrize("m,n", [(1, 37), (5, 256), (33, 64)])
def test_gemm_f32(dev, bits: int, g: int, m: int, n: int) -> None:
    """Block sums are float here: each of the ng block sums of G products may round differently (the
    reference's BLAS order is unknown), so the bound is 2 * (G + ng) * u * sum |a w s|."""
    rng = np.random.default_rng([m, n, g, bits])
    k = 1024
    w = rand_weight(rng, n, k, g, bits)
    x = rng.standard_normal((m, k)).astype(np.float32)
    out = cp.full((m, n), np.nan, dtype=cp.float32)
    dw = dev.weight(NO_CACHE, [w])
    dev.gemm.f32(cp.asarray(x), dw, out, n, dev.stream)
    dev.stream.synchronize()
    dev.cache.release(dw)
    got = cp.asnumpy(out)
    ref = reference_gemm_f32(x, w)
    absw = np.abs(w.codes.astype(np.float64)) * np.repeat(np.abs(w.scales), g, axis=1)  # Q4_0 scales < 0
    tol = 2 * (g + w.ngroups) * U * (np.abs(x.astype(np.float64)) @ absw.T) + 1e-30
    assert np.all(np.abs(got - ref) <= tol)
