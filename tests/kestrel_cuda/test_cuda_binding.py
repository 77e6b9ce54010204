"""CPU tests of the CUDA backend's binding decisions: each missing prerequisite leaves the backend not
bound, with its reason, and kestrel on the CPU. CuPy is replaced by fake modules (or hidden), so these run
everywhere, GPU machine included."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kestrel_core.contract import quantize_activations, quantize_weight
from kestrel_core.dispatch import Offload
from kestrel_core.registry import Registry
from kestrel_core.wkey import Proj, wkey
from kestrel_cuda.kernels import MMA_TILES


class _Ctx:
    def __init__(self, *_: Any) -> None:
        pass

    def __enter__(self) -> _Ctx:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def fake_cupy(*, count: int = 1, count_error: Exception | None = None, driver: int = 13000,
              runtime: int = 13000, cc: str = "90", compile_error: Exception | None = None,
              missing_kernel: str | None = None) -> SimpleNamespace:
    """A stand-in for the parts of CuPy that binding touches before any device work."""

    def get_device_count() -> int:
        if count_error is not None:
            raise count_error
        return count

    class Device(_Ctx):
        compute_capability = cc

    class Module:
        def get_function(self, name: str) -> Any:
            if name == missing_kernel:
                raise RuntimeError(f"named symbol not found: {name}")
            return SimpleNamespace(name=name, attributes={})

    def raw_module(**_: Any) -> Module:
        if compile_error is not None:
            raise compile_error
        return Module()

    rt = SimpleNamespace(getDeviceCount=get_device_count, driverGetVersion=lambda: driver,
                         runtimeGetVersion=lambda: runtime)
    return SimpleNamespace(cuda=SimpleNamespace(runtime=rt, Device=Device), RawModule=raw_module)


def bind_reason(monkeypatch: pytest.MonkeyPatch, cupy: Any,
                options: dict[str, str] | None = None) -> tuple[Registry, str]:
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    registry = Registry(options)
    backend = registry.bind("cuda")
    assert not backend.bound
    assert backend.device is None and backend.pm is None  # nothing half-bound
    return registry, backend.reason


def test_cupy_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    _, reason = bind_reason(monkeypatch, None)  # None in sys.modules: "import cupy" raises ImportError
    assert reason == "CuPy is not installed"


def test_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _, reason = bind_reason(monkeypatch, fake_cupy(count=0))
    assert reason == "no CUDA device"


def test_device_query_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    _, reason = bind_reason(monkeypatch, fake_cupy(count_error=RuntimeError("cudaErrorNoDevice")))
    assert reason.startswith("no CUDA device (") and "cudaErrorNoDevice" in reason


def test_driver_too_old(monkeypatch: pytest.MonkeyPatch) -> None:
    _, reason = bind_reason(monkeypatch, fake_cupy(driver=12080, runtime=13020))
    assert "driver 12.8 is older than the CUDA 13.2 runtime" in reason


def test_newer_minor_runtime_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA minor version compatibility (seen on the H200 machine: driver 13.0, CuPy's runtime 13.2)."""
    _, reason = bind_reason(monkeypatch, fake_cupy(driver=13000, runtime=13020,
                                                   compile_error=RuntimeError("stop here")))
    assert reason.startswith("kernel compilation failed")


def test_old_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _, reason = bind_reason(monkeypatch, fake_cupy(cc="75"))
    assert "compute capability 7.5 is below 8.0" in reason


def test_bad_device_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_CUDA_DEVICE", "3")
    _, reason = bind_reason(monkeypatch, fake_cupy(count=1))
    assert reason == "CUDA device 3 does not exist (1 found)"


def test_device_option_overrides_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_CUDA_DEVICE", "0")
    _, reason = bind_reason(monkeypatch, fake_cupy(count=2), {"device": "5"})
    assert reason == "CUDA device 5 does not exist (2 found)"


@pytest.mark.parametrize("env, options, expect", [
    ({"KESTREL_CUDA_STREAM": "1"}, None, "KESTREL_CUDA_STREAM was renamed KESTREL_CUDA_WINDOW"),
    ({"KESTREL_CUDA_MAX_CONTEXT": "lots"}, None, "KESTREL_CUDA_MAX_CONTEXT must be"),
    ({}, {"window": "x"}, "backend option window must be"),
])
def test_bad_settings_leave_the_backend_unbound(env: dict[str, str], options: dict[str, str] | None, expect: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Read before anything else: the reason is the setting's own line, not a later failure's."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _, reason = bind_reason(monkeypatch, fake_cupy(), options)
    assert reason.startswith(expect) and "\n" not in reason


def test_compile_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    _, reason = bind_reason(monkeypatch, fake_cupy(compile_error=RuntimeError("gemv_warp.cu(12): error: bad")))
    assert reason.startswith("kernel compilation failed (") and "gemv_warp.cu(12): error: bad" in reason


def test_missing_kernel_is_a_compile_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    name = next(iter(MMA_TILES.values())).name(8, 256)  # a tensor-core kernel, not the first one looked up
    _, reason = bind_reason(monkeypatch, fake_cupy(missing_kernel=name))
    assert "kernel compilation failed" in reason and name in reason


def test_unbound_cuda_leaves_the_cpu_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA, auto selection runs the CPU backend: its own result, bit for bit."""
    registry, _ = bind_reason(monkeypatch, None)
    chosen = registry.select("auto")
    assert chosen.name != "cuda"
    rng = np.random.default_rng(0)
    w = quantize_weight(rng.standard_normal((24, 64)).astype(np.float32), 8, 32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    cpu = registry.cpu()
    out = Offload(chosen, cpu).linear(x, w, wkey(0, Proj.Q))
    a_codes, a_scales = quantize_activations(x, 32)
    alone = cpu.hook.kestrel_gemm_q8(device=cpu.device, a_codes=a_codes, a_scales=a_scales, weight=w,
                                     wkey=wkey(0, Proj.Q))
    np.testing.assert_array_equal(out, alone)


def test_import_needs_neither_cupy_nor_gguf() -> None:
    code = ("import sys; sys.modules['cupy'] = None; import kestrel_cuda, kestrel_cuda.binding, "
            "kestrel_cuda.gemm, kestrel_cuda.weights, kestrel_cuda.device, kestrel_cuda.selftest_cases; "
            "assert 'gguf' not in sys.modules, 'gguf imported'; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_backend_info_declares_gpu_and_threshold() -> None:
    import kestrel_cuda

    info = kestrel_cuda.kestrel_backend_info()
    assert (info.name, info.kind) == ("cuda", "gpu")
    assert info.min_flops == kestrel_cuda.DEFAULT_MIN_FLOPS > 0
