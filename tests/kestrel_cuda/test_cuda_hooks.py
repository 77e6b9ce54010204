"""GPU tests of the CUDA backend's hooks through the registry and the core dispatcher: binding, the
conformance self-test, the 0/1 contract on errors and out-of-memory, KESTREL_FORCE_CPU, preload, and the
residency window's output invariance."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_core.contract import quantize_activations, reference_gemm_q8
from kestrel_core.dispatch import Offload
from kestrel_core.registry import Registry
from kestrel_core.selftest import run_selftest
from kestrel_core.wkey import Proj, fused_wkey, wkey

cp = pytest.importorskip("cupy", reason="CuPy is not installed")

from .forward_check import cuda_device_count  # noqa: E402

if cuda_device_count() < 1:
    pytest.skip("no CUDA device", allow_module_level=True)

pytestmark = pytest.mark.cuda

from kestrel_cuda.allocator import DeviceOutOfMemory  # noqa: E402

SMALL = dict(num_layers=2, vocab_size=2048)  # qwen3-0.6b shapes per layer, a short vocabulary


@pytest.fixture
def registry():
    reg = Registry()
    yield reg
    reg.close()


@pytest.fixture
def cuda(registry):
    backend = registry.bind("cuda")
    assert backend.bound, backend.reason
    return backend


def test_binds_with_a_description(cuda) -> None:
    assert cuda.kind == "gpu"
    assert "sm_" in cuda.device_description


def test_selftest_passes(registry) -> None:
    report = run_selftest("cuda", seeds=1, registry=registry)
    bad = [c for c in report.cases if not c.passed or c.declined]
    assert report.ok and not bad, bad[:5]
    assert len(report.cases) > 100


def test_fused_and_unfused_through_the_dispatcher(registry, cuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_CUDA_MIN_FLOPS", "0")  # these shapes are far below the default threshold
    rng = np.random.default_rng(3)
    off = Offload(cuda, registry.cpu())
    from kestrel_core.contract import quantize_weight

    x = rng.standard_normal((1, 256)).astype(np.float32)
    fusable = [quantize_weight(rng.standard_normal((n, 256)).astype(np.float32), 8, 32) for n in (64, 32, 32)]
    odd = [quantize_weight(rng.standard_normal((n, 256)).astype(np.float32), 8, 32) for n in (64, 30)]
    a_codes, a_scales = quantize_activations(x, 32)
    for i, ws in enumerate((fusable, odd)):
        keys = [wkey(i, p) for p in (Proj.Q, Proj.K, Proj.V)][: len(ws)]
        outs = off.linear_fused(x, ws, keys, fused_wkey(i, Proj.QKV))
        for out, w in zip(outs, ws):
            np.testing.assert_allclose(out, reference_gemm_q8(a_codes, a_scales, w), rtol=1e-5, atol=1e-5)
    assert off.counters["kestrel_gemm_fused_q8"].accepted == 2
    assert cuda.device.cache.contains(fused_wkey(0, Proj.QKV))  # fused buffer for the fusable one
    assert cuda.device.cache.contains(wkey(1, Proj.Q)) and cuda.device.cache.contains(wkey(1, Proj.K))


def test_unsupported_input_declines(cuda) -> None:
    from kestrel_core.contract import quantize_weight

    w = quantize_weight(np.ones((8, 64), np.float32), 8, 32)
    dev = cuda.device
    assert dev.gemm_q8(np.zeros((2, 32), np.int8), np.zeros((2, 1), np.float32), w, wkey(0, Proj.Q)) is None
    assert dev.gemm_q8(np.zeros((2, 64), np.float32), np.zeros((2, 2), np.float32), w, wkey(0, Proj.Q)) is None
    assert dev.stats()["declined_unsupported_input"] == 2


def test_out_of_memory_declines_then_recovers(cuda, monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_core.contract import quantize_weight

    dev = cuda.device
    w = quantize_weight(np.random.default_rng(1).standard_normal((48, 128)).astype(np.float32), 8, 32)
    a_codes, a_scales = quantize_activations(np.ones((1, 128), np.float32), 32)
    key = wkey(7, Proj.O)

    def no_memory(nbytes: int):
        raise DeviceOutOfMemory("test: device full")

    dev.cache.clear()
    monkeypatch.setattr(dev.allocator, "alloc", no_memory)
    assert dev.gemm_q8(a_codes, a_scales, w, key) is None
    assert dev.stats()["errors_DeviceOutOfMemory"] >= 1
    assert not dev.cache.contains(key)  # nothing half-made
    monkeypatch.undo()
    out = dev.gemm_q8(a_codes, a_scales, w, key)
    np.testing.assert_allclose(out, reference_gemm_q8(a_codes, a_scales, w), rtol=1e-5, atol=1e-6)


def test_cuda_error_declines(cuda, monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel_core.contract import quantize_weight

    dev = cuda.device
    w = quantize_weight(np.ones((16, 64), np.float32), 8, 32)
    a_codes, a_scales = quantize_activations(np.ones((1, 64), np.float32), 32)

    def launch_fails(*args, **kwargs):
        raise cp.cuda.runtime.CUDARuntimeError(719)  # cudaErrorLaunchFailure

    monkeypatch.setattr(dev.gemm, "q8", launch_fails)
    assert dev.gemm_q8(a_codes, a_scales, w, wkey(3, Proj.O)) is None
    assert dev.stats()["errors_CUDARuntimeError"] == 1


def _engine(backend: str = "cuda", **overrides):
    from kestrel_core.model.engine_load import load_preset

    return load_preset("qwen3-0.6b", backend=backend, quant="q8", seed=1, **{**SMALL, **overrides})


def test_preload_makes_every_weight_resident() -> None:
    with _engine() as engine:
        stats = engine.offload.backend_stats()
        layers = SMALL["num_layers"]
        assert stats["preload_weights"] == 4 * layers + 1  # QKV, O, gate|up, down per layer, lm_head
        uploads = stats["cache_uploads"]
        list(engine.generate(list(range(12)), max_tokens=4, stop_at_eos=False))
        after = engine.offload.backend_stats()
        assert after["cache_uploads"] == uploads  # every GEMM hit the preloaded cache
        assert after["cache_hits"] > 0


def test_force_cpu_keeps_uploads_but_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_FORCE_CPU", "1")
    with _engine() as engine:
        stats = engine.offload.backend_stats()
        assert stats["preload_weights"] == 4 * SMALL["num_layers"] + 1
        list(engine.generate(list(range(8)), max_tokens=2, stop_at_eos=False))
        accepted, declined = engine.offload.totals()
        assert accepted == 0 and declined > 0


def test_window_is_output_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = list(range(3, 40))
    with _engine() as engine:
        want = list(engine.generate(prompt, max_tokens=6, stop_at_eos=False))
    # A layer is about 16 MB: 25 MiB holds lm_head and one layer, so neither layer can stay beside the window's
    # own; the default budget keeps both, and nothing streams.
    for keep, budget in (("1", "25"), ("2", "25"), ("1", None)):
        monkeypatch.setenv("KESTREL_CUDA_WINDOW", keep)
        if budget is None:
            monkeypatch.delenv("KESTREL_CUDA_CACHE_MB", raising=False)
        else:
            monkeypatch.setenv("KESTREL_CUDA_CACHE_MB", budget)
        with _engine() as engine:
            got = list(engine.generate(prompt, max_tokens=6, stop_at_eos=False))
            stats = engine.offload.backend_stats()
            assert stats["window_streamed_layers"] == (2 if budget else 0)
            assert stats["cache_kept_layers"] == (0 if budget else 2)
            if budget is None:  # everything kept: the window is as good as off, decode steps captured
                assert stats["cache_window_evictions"] == 0 and stats["cache_uploads"] == stats["preload_weights"]
                assert stats["forward_graph_captures"] >= 1
        assert got == want


def test_window_prefetch_is_output_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five layers of 16.9 MiB and a 2.3 MiB lm_head: 75 MiB keeps two layers beside keep = 1 and its prefetch,
    80 MiB one beside keep = 2; the rest stream, each uploaded on the upload stream while the layer before it
    computes: the tokens are the window-off ones, and the run reports the pinned bus bandwidth and the uploads'
    GPU time."""
    prompt = list(range(3, 40))
    with _engine(num_layers=5) as engine:
        want = list(engine.generate(prompt, max_tokens=6, stop_at_eos=False))
    for keep, budget, streamed in (("1", "75", 3), ("2", "80", 4)):
        monkeypatch.setenv("KESTREL_CUDA_WINDOW", keep)
        monkeypatch.setenv("KESTREL_CUDA_CACHE_MB", budget)
        with _engine(num_layers=5) as engine:
            got = list(engine.generate(prompt, max_tokens=6, stop_at_eos=False))
            stats = engine.offload.backend_stats()
            assert (stats["window_streamed_layers"], stats["cache_kept_layers"]) == (streamed, 5 - streamed)
            assert stats["cache_prefetched_layers"] > 0 and stats["cache_bytes_resident"] <= stats["cache_budget_bytes"]
            assert stats["bus_h2d_pinned_gb_s"] > 0 and stats["weight_upload_s"] > 0
            assert stats["weight_upload_bytes"] / stats["weight_upload_s"] < 1e12  # GPU time, not launch time
        assert got == want, (keep, budget)
