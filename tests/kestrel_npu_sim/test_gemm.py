"""The GEMM hooks on the OpenCL device against kestrel_core.contract's reference GEMMs."""

from __future__ import annotations

import numpy as np
import pytest

import kestrel_npu_sim as npu_sim
from kestrel_core.contract import quantize_activations
from kestrel_core.dispatch import Offload
from kestrel_core.registry import Registry
from kestrel_core.wkey import Proj, wkey
from kestrel_npu_sim.matmul import block_sums

from .helpers import activations, check_f32, check_q8, weight

SHAPES = [(bits, g, m) for bits in (8, 4) for g in (32, 256) for m in (1, 3, 9, 64)]


def _q8(npu, x: np.ndarray, w, key: int) -> np.ndarray:  # noqa: ANN001
    codes, scales = quantize_activations(x, w.group_size)
    return npu_sim.kestrel_gemm_q8(device=npu, a_codes=codes, a_scales=scales, weight=w, wkey=key)


@pytest.mark.parametrize(("bits", "g", "m"), SHAPES)
def test_gemm_q8_matches_reference(npu, bits: int, g: int, m: int) -> None:  # noqa: ANN001
    k = 512 if g == 256 else 96
    for n in (96, 37):  # 37: padded to 64 rows in the native layout, 27 columns dropped
        w = weight(n, k, g, bits)
        x = activations(m, k)
        got = _q8(npu, x, w, 0)
        check_q8(got, x, w)
    assert npu.stats.calls == 2 and sum(npu.stats.declined.values()) == 0
    assert npu.stats.runs == 2 * k // g  # one run per K-block: one segment, one chunk each


@pytest.mark.parametrize(("bits", "g", "m"), [(8, 32, 1), (4, 256, 3), (8, 256, 64)])
def test_gemm_f32_matches_reference(npu, bits: int, g: int, m: int) -> None:  # noqa: ANN001
    k = 512 if g == 256 else 96
    w = weight(40, k, g, bits)
    x = activations(m, k, seed=3)
    check_f32(npu_sim.kestrel_gemm_f32(device=npu, a=x, weight=w, wkey=0), x, w)
    assert npu.stats.f32_slices >= 4  # standard-normal blocks need several int8 slices


def test_gemm_f32_extreme_dynamic_range(npu) -> None:  # noqa: ANN001
    """Values 2**-100 beside 1.0 in one block: slices stop at 6, the dropped part is far below rounding."""
    w = weight(32, 64, 32, 8)
    x = activations(2, 64)
    x[0, ::2] *= np.float32(2.0**-100)
    x[1, :31] = 0
    check_f32(npu_sim.kestrel_gemm_f32(device=npu, a=x, weight=w, wkey=0), x, w)


@pytest.mark.parametrize(("m", "n", "k", "g"), [(1, 4096 + 64, 64, 32), (9, 4096 + 64, 64, 32),
                                                (2, 64, 10240 + 512, 32), (2, 64, 10240 + 512, 256)])
def test_block_sums_are_exact_across_chunks_and_segments(npu, m: int, n: int, k: int, g: int) -> None:  # noqa: ANN001
    w = weight(n, k, g, 8)
    a = np.random.default_rng(m).integers(-127, 128, size=(m, k), dtype=np.int8)
    expected = (a.astype(np.int64).reshape(m, -1, g).transpose(1, 0, 2)
                @ w.codes.astype(np.int64).reshape(n, -1, g).transpose(1, 2, 0))            # [ng, M, N]
    parts = list(block_sums(npu, a, npu.packed((w,), 0), g))
    assert [(n0, n1) for n0, n1, _ in parts] == [(0, 4096), (4096, n)] if n > 4096 else [(0, n)]
    np.testing.assert_array_equal(np.concatenate([s for _, _, s in parts], axis=2), expected)
    segments = 2 if k > 10240 else 1
    assert npu.stats.launches == segments * len(parts)


@pytest.mark.parametrize(("m", "n", "k", "g", "bits"), [(1, 4096 + 64, 64, 32, 8), (2, 64, 10240 + 512, 256, 4),
                                                        (3, 32, 10240 + 512, 32, 8)])
def test_split_and_segmented_gemm_matches_reference(npu, m: int, n: int, k: int, g: int, bits: int) -> None:  # noqa: ANN001
    w = weight(n, k, g, bits)
    x = activations(m, k)
    check_q8(_q8(npu, x, w, 0), x, w)
    check_f32(npu_sim.kestrel_gemm_f32(device=npu, a=x, weight=w, wkey=0), x, w)


def test_weights_are_repacked_once_per_wkey(npu) -> None:  # noqa: ANN001
    w, other = weight(64, 96, 32, 8, seed=1), weight(64, 96, 32, 8, seed=2)
    key = wkey(900, Proj.UP)
    x = activations(1, 96)
    for _ in range(3):
        check_q8(_q8(npu, x, w, key), x, w)
    assert npu.stats.repacks == 1 and npu.stats.uncached_repacks == 0
    check_q8(_q8(npu, x, other, key), x, other)  # same wkey, another tensor: repacked, not reused
    assert npu.stats.repacks == 2
    for _ in range(2):
        _q8(npu, x, w, 0)  # wkey 0: "do not cache"
    assert npu.stats.uncached_repacks == 2 and npu.stats.repacks == 4


def test_offload_accepts_and_matches_cpu(npu, npu_backend) -> None:  # noqa: ANN001
    registry = Registry()
    offload = Offload(npu_backend, registry.cpu())
    w = weight(96, 96, 32, 4)
    x = activations(5, 96)
    got = offload.linear(x, w, wkey(901, Proj.Q))
    check_q8(got, x, w)
    assert offload.stats()["kestrel_gemm_q8"]["accepted"] == 1
    stats = offload.backend_stats()
    assert stats["npu_sim_calls"] == 1 and stats["npu_sim_time_s"] > 0
    registry.close()


def test_empty_activations(npu) -> None:  # noqa: ANN001
    w = weight(64, 96, 32, 8)
    out = npu_sim.kestrel_gemm_q8(device=npu, a_codes=np.zeros((0, 96), np.int8),
                                  a_scales=np.zeros((0, 3), np.float32), weight=w, wkey=0)
    assert out.shape == (0, 64) and out.dtype == np.float32


@pytest.mark.parametrize(("ns", "g", "bits", "m"), [((64, 32, 32), 32, 8, 5), ((36, 17), 256, 4, 1),
                                                    ((576, 192, 192), 32, 8, 3)])
def test_fused_gemm_matches_reference_per_member(npu, ns: tuple[int, ...], g: int, bits: int, m: int) -> None:  # noqa: ANN001
    k = 512 if g == 256 else 96
    ws = [weight(n, k, g, bits, seed=i) for i, n in enumerate(ns)]
    x = activations(m, k)
    codes, scales = quantize_activations(x, g)
    key = wkey(902 + len(ns), Proj.QKV)
    outs = npu_sim.kestrel_gemm_fused_q8(device=npu, a_codes=codes, a_scales=scales, weights=ws,
                                         wkeys=[0] * len(ws), fused_wkey=key)
    assert len(outs) == len(ws)
    for out, w in zip(outs, ws):
        check_q8(out, x, w)
    # one set of runs over the stacked weight, each member but the last padded to whole 32-row tiles
    rows = sum(-(-n // 32) * 32 for n in ns[:-1]) + ns[-1]
    assert npu.stats.runs == len(npu.cache[key].geo.chunks) * k // g and npu.cache[key].geo.n == rows
    npu_sim.kestrel_gemm_fused_q8(device=npu, a_codes=codes, a_scales=scales, weights=ws,
                                  wkeys=[0] * len(ws), fused_wkey=key)
    assert npu.stats.repacks == 1  # cached under the fused wkey


def test_fused_members_must_share_k(npu) -> None:  # noqa: ANN001
    ws = [weight(32, 96, 32, 8), weight(32, 64, 32, 8)]
    codes, scales = quantize_activations(activations(1, 96), 32)
    assert npu_sim.kestrel_gemm_fused_q8(device=npu, a_codes=codes, a_scales=scales, weights=ws, wkeys=[0, 0],
                                         fused_wkey=0) is None
    assert npu.stats.declined["bad_operands"] == 1
