"""The forward's diagnostic build (KESTREL_CUDA_TRACE) on the GPU: the same bits as the plain build, and a
replayed decode step leaves one release a launch, in launch order. Skipped where CuPy or a CUDA device is
missing (CI); run on the H200 machine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from kestrel_core.model.presets import synthetic_model  # noqa: E402
from kestrel_cuda.config import CudaConfig  # noqa: E402
from kestrel_cuda.forward import DeviceForward  # noqa: E402
from kestrel_cuda.trace import releases  # noqa: E402

from .forward_check import SMALL_CONFIGS, cuda_device_count, device_logits, random_tokens  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


@pytest.mark.parametrize("model_name", ["qwen3", "tiny-qwen3-moe"])
def test_a_traced_step_has_the_plain_bits_and_a_release_a_launch(model_name: str) -> None:
    """The mixture of experts' decode step has every kind of launch: the router folded into o, routed GEMVs."""
    from kestrel_core.model.loader import load_model
    from kestrel_cuda.gemm import DeviceGemm
    from kestrel_cuda.kernels import compile_kernels

    stream = cp.cuda.Stream(non_blocking=True)
    gemm = DeviceGemm(cp, compile_kernels(cp), cp.cuda.Device().attributes["MultiProcessorCount"])
    gemm.workspace(stream)
    if model_name in SMALL_CONFIGS:
        model = synthetic_model(SMALL_CONFIGS[model_name], "q8", seed=3)
    else:
        model = load_model(str(Path(__file__).resolve().parents[1] / "fixtures" / "models" / model_name), "q8",
                           cache="off").model
    toks = random_tokens(model.config, 12)
    plain = DeviceForward(config=CudaConfig(), stream=stream, gemm=gemm)
    traced = DeviceForward(config=CudaConfig(trace=True), stream=stream, gemm=gemm)
    assert np.array_equal(device_logits(traced, model, toks, 8), device_logits(plain, model, toks, 8))

    launched: list[str] = []
    traced.ops.on_launch = lambda name, launch: (launched.append(name), launch())
    traced.use_graph = False
    traced.forward(model, 1, toks[-1:], len(toks), False)  # an eager step: its launches, counted
    traced.ops.on_launch, traced.use_graph = None, True
    trace = traced.ops.trace
    trace.reset(stream)
    traced._seqs[1].graph()  # the captured decode step
    stream.synchronize()
    rows, dropped = trace.read()
    launches = releases(rows)
    assert dropped == 0 and len(launches) == len(launched) > 4
    assert np.all(np.diff(launches[:, 1]) > 0) and np.all(launches[:, 3] > 0)
    assert np.all(launches[:, 2] >= launches[:, 1])
