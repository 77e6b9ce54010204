"""Batched steps over the paged pool on the GPU: test_forward_batch_host.py's scenarios through CupyOps (the
kernels of rope.cu and attention.cu with page tables, the GEMVs and the tiled GEMM at M rows), and the real
CUDA backend serving concurrent requests. Skipped where CuPy or a CUDA device is missing (CI)."""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from kestrel_cuda.forward import DeviceForward  # noqa: E402

from .forward_check import FACTOR, SMALL_CONFIGS, cpu_logits, cuda_device_count, greedy_agrees, jitter_effect  # noqa: E402,E501
from .test_forward_batch_host import (  # noqa: E402, F401  (collected here with this module's make_fwd)
    _prompts,
    serve_all,
    test_a_sequence_moves_between_its_own_cache_and_the_pool,
    test_declines_what_the_pool_cannot_run,
    test_eager_and_captured_batches_agree_bitwise,
    test_every_batched_row_is_the_cpu_decoders_within_the_band,
    test_mixed_batch_of_decode_rows_and_prompt_chunks,
    test_padding_rows_of_a_bucket_touch_no_sequence,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


@pytest.fixture(scope="module")
def stream():  # type: ignore[no-untyped-def]
    return cp.cuda.Stream(non_blocking=True)


@pytest.fixture(scope="module")
def gemm(stream):  # type: ignore[no-untyped-def]
    from kestrel_cuda.gemm import DeviceGemm
    from kestrel_cuda.kernels import compile_kernels

    g = DeviceGemm(cp, compile_kernels(cp), cp.cuda.Device().attributes["MultiProcessorCount"])
    g.workspace(stream)
    return g


@pytest.fixture
def make_fwd(stream, gemm):  # type: ignore[no-untyped-def]
    """DeviceForward(**kwargs) on the GPU, rows above 8 through the tiled GEMM."""
    return lambda **kw: DeviceForward(stream=stream, gemm=gemm, **kw)


@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_the_cuda_backend_serves_concurrent_requests_in_batches(quant: str) -> None:
    """Four greedy requests through the scheduler on the real backend: its batched hook takes the steps, and
    every request's tokens are the CPU's choice at each step (or tie with it within the nudge's range)."""
    import kestrel_core
    from kestrel_core.model.presets import synthetic_model
    from kestrel_core.model.sampling import SamplingParams

    model = synthetic_model(SMALL_CONFIGS["qwen3"], quant, seed=9)
    prompts = [p.tolist() for p in _prompts(model, (4, 70, 11, 33), seed=6)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with kestrel_core.load(model, backend="cuda") as engine:
        got = serve_all(engine, prompts, params)
        offload = engine.stats["offload"]
    assert offload["kestrel_forward_batch"]["accepted"] >= 8
    for p, tokens in zip(prompts, got):
        seq = np.array(p + tokens)
        ref = cpu_logits(model, seq, len(seq))
        tol = FACTOR * jitter_effect(model, seq, len(seq), ref)[1]
        assert greedy_agrees(tokens, model, np.array(p), tol) == [], (p, tokens)
