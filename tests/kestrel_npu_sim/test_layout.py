"""The native layout and the K-segment / N-chunk plan, against index arithmetic written out element by
element from rknn_matmul_api.h's description (no OpenCL needed)."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_npu_sim.layout import geometry, repack


def native_offset(n: np.ndarray, k: np.ndarray, n_pad: int, k_total: int) -> np.ndarray:
    """Where W[n, k] lives in the packed weight: segments of 8192 once K > 10240, each [Np/32, Ks/32, 32, 32]."""
    seg_len = k_total if k_total <= 10240 else 8192
    s, kk = np.divmod(k, seg_len)
    seg_k = np.minimum(seg_len, k_total - s * seg_len)
    seg_start = n_pad * s * seg_len
    return seg_start + (((n // 32) * (seg_k // 32) + kk // 32) * 32 + n % 32) * 32 + kk % 32


@pytest.mark.parametrize(("n", "k"), [(64, 64), (40, 96), (96, 10240), (33, 10240 + 256), (64, 2 * 8192 + 512)])
def test_repack_matches_index_formula(n: int, k: int) -> None:
    rng = np.random.default_rng(n * k)
    codes = rng.integers(-127, 128, size=(n, k), dtype=np.int8)
    geo = geometry(n, k)
    packed = repack(codes, geo)
    n_pad = -(-n // 32) * 32
    assert geo.n_pad == n_pad and packed.shape == (n_pad * k,) and packed.dtype == np.int8
    nn, kk = np.meshgrid(np.arange(n), np.arange(k), indexing="ij")
    where = native_offset(nn, kk, n_pad, k)
    np.testing.assert_array_equal(packed[where], codes)
    padding = np.ones(packed.shape, bool)
    padding[where.ravel()] = False
    assert not packed[padding].any(), "padded rows must be zero"


def test_segments_and_chunks() -> None:
    assert geometry(64, 10240).segments == ((0, 10240),)
    assert geometry(64, 10240 + 32).segments == ((0, 8192), (8192, 10272))
    assert geometry(64, 20480).segments == ((0, 8192), (8192, 16384), (16384, 20480))
    assert geometry(4096, 64).chunks == ((0, 4096),)
    assert geometry(4097, 64).chunks == ((0, 4096), (4096, 4128))
    assert geometry(49152, 576).chunks == tuple((i, i + 4096) for i in range(0, 49152, 4096))
    with pytest.raises(ValueError):
        geometry(64, 48)


@pytest.mark.parametrize(("n", "k"), [(4096 + 64, 96), (96, 10240 + 512)])
def test_chunk_offsets_are_contiguous_slices(n: int, k: int) -> None:
    """An N-chunk of a segment is one contiguous slice: the NPU call's own native B buffer."""
    codes = np.random.default_rng(1).integers(-127, 128, size=(n, k), dtype=np.int8)
    geo = geometry(n, k)
    packed = repack(codes, geo)
    for s, (k0, k1) in enumerate(geo.segments):
        for n0, n1 in geo.chunks:
            start = geo.tile_offset(s, n0)
            own = repack(np.ascontiguousarray(codes[n0:n1, k0:k1]), geometry(n1 - n0, k1 - k0))
            np.testing.assert_array_equal(packed[start:start + own.size], own)
