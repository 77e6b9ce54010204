"""kestrel_cpu: the reference backend. Always bound; the definition of "correct"."""

from __future__ import annotations

from typing import Any

import numpy as np

import kestrel_core
from kestrel_core.contract import StripCache, reference_gemm_f32, reference_gemm_q8
from kestrel_core.hookspecs import API_VERSION, hookimpl
from kestrel_core.registry import BackendInfo


class CpuDevice:
    description = "host CPU (numpy)"


@hookimpl
def kestrel_backend_info() -> BackendInfo:
    return BackendInfo(name="cpu", version=kestrel_core.__version__, api_version=API_VERSION, kind="cpu",
                       description="numpy reference")


@hookimpl
def kestrel_open(options: dict[str, Any]) -> CpuDevice:
    return CpuDevice()


@hookimpl
def kestrel_close(device: CpuDevice) -> None:
    pass


@hookimpl
def kestrel_gemm_q8(device: CpuDevice, a_codes: np.ndarray, a_scales: np.ndarray, weight: StripCache,
                    wkey: int) -> np.ndarray:
    return reference_gemm_q8(a_codes, a_scales, weight)


@hookimpl
def kestrel_gemm_f32(device: CpuDevice, a: np.ndarray, weight: StripCache, wkey: int) -> np.ndarray:
    return reference_gemm_f32(a, weight)
