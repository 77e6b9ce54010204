"""Fixtures of the GPU test modules: a CUDA stream, and cuda-kernels' tiled GEMM on it (module-scoped: one each a
module that asks for them). CuPy is imported when a fixture is set up, so the CPU test modules here need none."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def stream():  # type: ignore[no-untyped-def]
    import cupy as cp

    return cp.cuda.Stream(non_blocking=True)


@pytest.fixture(scope="module")
def gemm(stream):  # type: ignore[no-untyped-def]
    """cuda-kernels' tiled GEMM, used by prefill chunks of more than 8 rows."""
    import cupy as cp

    from kestrel_cuda.gemm import DeviceGemm
    from kestrel_cuda.kernels import compile_kernels

    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    g = DeviceGemm(cp, compile_kernels(cp), sm)
    g.workspace(stream)
    return g
