"""Binding decisions of the CUDA backend: every prerequisite checked once at open, all or nothing.

CuPy importable, at least one CUDA device, a driver of at least the CUDA major version CuPy's runtime has, compute
capability >= 8.0 (int8 ``mma.sync`` and ``__dp4a``), and every kernel compiled: any failure raises
``BackendUnavailable`` with a one-line reason (``kestrel backends`` shows it) and nothing stays half
initialised; kestrel then runs on the CPU exactly as without this plugin. Works with whichever CuPy wheel is
installed (cupy-cuda12x or cupy-cuda13x): nothing here names a CUDA version.
"""

from __future__ import annotations

import importlib
from typing import Any

from kestrel_core.errors import BackendUnavailable, KestrelError
from kestrel_cuda.config import CudaConfig

MIN_COMPUTE_CAPABILITY = 80


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def import_cupy() -> Any:
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise BackendUnavailable("CuPy is not installed") from exc
    except Exception as exc:  # a broken wheel (missing CUDA libraries) must not take kestrel down
        raise BackendUnavailable(f"CuPy failed to import ({_short(exc)})") from exc


def check_device(cp: Any, index: int) -> int:
    """Validate driver and device; returns the compute capability as an int (90 for sm_90)."""
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise BackendUnavailable(f"no CUDA device ({_short(exc)})") from exc
    if count < 1:
        raise BackendUnavailable("no CUDA device")
    if not 0 <= index < count:
        raise BackendUnavailable(f"CUDA device {index} does not exist ({count} found)")
    try:
        driver = cp.cuda.runtime.driverGetVersion()
        runtime = cp.cuda.runtime.runtimeGetVersion()
        cc = int(cp.cuda.Device(index).compute_capability)
    except Exception as exc:
        raise BackendUnavailable(f"CUDA device {index} is not usable ({_short(exc)})") from exc
    if driver // 1000 < runtime // 1000:  # minor version compatibility: any driver of the same major works
        raise BackendUnavailable(f"CUDA driver {_version(driver)} is older than the CUDA {_version(runtime)} "
                                 "runtime CuPy uses; update the driver or install a CuPy for an older CUDA")
    if cc < MIN_COMPUTE_CAPABILITY:
        raise BackendUnavailable(f"GPU compute capability {cc // 10}.{cc % 10} is below 8.0 "
                                 "(int8 tensor-core kernels)")
    return cc


def open_device(options: dict[str, Any]) -> Any:
    """Everything or nothing: a ready ``CudaDevice``, or BackendUnavailable with the reason. The settings are
    read here, once (``CudaConfig.from_env``: the environment, overridden by ``options``)."""
    from kestrel_cuda.kernels import KernelCompileError, compile_kernels

    try:
        config = CudaConfig.from_env(options)
    except KestrelError as exc:
        raise BackendUnavailable(str(exc)) from None
    cp = import_cupy()
    index = config.device
    cc = check_device(cp, index)
    try:
        with cp.cuda.Device(index):
            kernels = compile_kernels(cp)
    except KernelCompileError as exc:
        raise BackendUnavailable(f"kernel compilation failed ({exc})") from exc
    from kestrel_cuda.device import CudaDevice

    try:
        return CudaDevice(cp, kernels, config, cc)
    except Exception as exc:
        raise BackendUnavailable(f"CUDA device {index} could not be initialised ({_short(exc)})") from exc
