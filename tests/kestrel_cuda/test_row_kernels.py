"""rows.cu's quantize_rows, the tiled GEMM's prologue, against numpy: the RMSNorm prologue bit for bit (its sum
of squares added in the kernel's order), the plain one bit for bit, SiLU(gate) * up within one code (the
device's expf is not numpy's). Skipped where CuPy or a CUDA device is missing (CI); run on the H200 machine."""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from kestrel_core.contract import quantize_activations  # noqa: E402

from .forward_check import cuda_device_count  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]

NT = 256  # threads of a block (forward.cuh)


def block_ssq(row: np.ndarray) -> np.float32:
    """A row's sum of squares in quantize_rows' float32 order: thread t adds x[t + NT i]^2 over i, each warp's
    32 partials by an xor butterfly, then the warps' sums in order."""
    k = row.shape[0]
    cols = np.zeros(-(-k // NT) * NT, np.float32)
    cols[:k] = row
    part = np.zeros(NT, np.float32)
    for chunk in cols.reshape(-1, NT):
        part = part + chunk * chunk
    lanes = part.reshape(NT // 32, 32)
    for o in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[:, np.arange(32) ^ o]
    total = np.float32(0)
    for w in lanes[:, 0]:
        total = np.float32(total + w)
    return total


def quantize_on_device(x: np.ndarray, k: int, g: int, pro: int, w: np.ndarray | None, eps: float,
                       xoff: int) -> tuple[np.ndarray, np.ndarray]:
    from kestrel_cuda.ops_cupy import CupyOps

    ops = CupyOps()
    m = x.shape[0]
    codes = cp.full((m, k), 99, cp.int8)  # poison: every code must be written
    scales = cp.full((m, k // g), np.nan, cp.float32)
    ops._quantize_rows(ops.upload(x), m, k, g, pro, None if w is None else ops.upload(w), eps, xoff, codes, scales)
    ops.synchronize()
    return codes.get(), scales.get()


@pytest.mark.parametrize("g", [32, 256])
@pytest.mark.parametrize("k", [256, 4096, 6144, 12288])
def test_quantize_rows_rmsnorm_is_bitwise_the_reference(k: int, g: int) -> None:
    """One chunk of a row (256, 4096: its values loaded once) and several (6144, 12288: the norm from a pass
    over the whole row), each giving the norm's bits in the same order."""
    rng = np.random.default_rng(k + g)
    m, eps = 3, 1e-6
    x = (rng.standard_normal((m, k)) * rng.uniform(0.05, 30, (m, 1))).astype(np.float32)
    x[1, :g] = 0.0  # an all-zero group: scale 0
    w = rng.uniform(0.5, 1.5, k).astype(np.float32)
    codes, scales = quantize_on_device(x, k, g, 1, w, eps, 0)
    for r in range(m):
        rms = np.sqrt(np.float32(block_ssq(x[r]) / np.float32(k)) + np.float32(eps))
        want = (x[r] / rms) * w
        want_codes, want_scales = quantize_activations(want[None].astype(np.float64), g)
        np.testing.assert_array_equal(codes[r], want_codes[0])
        np.testing.assert_array_equal(scales[r], want_scales[0])


@pytest.mark.parametrize("g", [32, 256])
def test_quantize_rows_plain_and_silu_mul(g: int) -> None:
    rng = np.random.default_rng(g)
    m, k = 5, 6144
    x = rng.standard_normal((m, 2 * k)).astype(np.float32) * 4
    codes, scales = quantize_on_device(x[:, :k].copy(), k, g, 0, None, 0.0, 0)
    want_codes, want_scales = quantize_activations(x[:, :k].astype(np.float64), g)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scales, want_scales)

    codes, scales = quantize_on_device(x, k, g, 2, None, 0.0, k)
    gate, up = x[:, :k].astype(np.float64), x[:, k:].astype(np.float64)
    act = (gate / (1 + np.exp(-gate)) * up).astype(np.float32)
    want_codes, want_scales = quantize_activations(act.astype(np.float64), g)
    np.testing.assert_allclose(scales, want_scales, rtol=1e-6)
    diff = np.abs(codes.astype(np.int16) - want_codes)
    assert diff.max() <= 1 and np.count_nonzero(diff) <= codes.size // 1000
