"""An example kestrel backend: dequantized weights (cached by wkey) times activations through BLAS.

Integer block sums are not exact here (the products are rounded in float32), which is well inside the
selftest's bound for every shape kestrel uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kestrel_core import API_VERSION, BackendInfo, StripCache, hookimpl
from kestrel_core.wkey import NO_CACHE


class ExampleDevice:
    description = "host CPU, dequantized float32 BLAS"

    def __init__(self) -> None:
        self.cache: dict[int, np.ndarray] = {}  # wkey -> float32 [K, N]

    def weight(self, weight: StripCache, wkey: int) -> np.ndarray:
        if wkey == NO_CACHE:
            return weight.dequantize().T
        if wkey not in self.cache:
            self.cache[wkey] = np.ascontiguousarray(weight.dequantize().T)
        return self.cache[wkey]


@hookimpl
def kestrel_backend_info() -> BackendInfo:
    return BackendInfo(name="example", version="0.1.0", api_version=API_VERSION, kind="cpu", min_flops=64_000,
                       description="example third-party backend")


@hookimpl
def kestrel_open(options: dict[str, Any]) -> ExampleDevice:
    return ExampleDevice()


@hookimpl
def kestrel_close(device: ExampleDevice) -> None:
    device.cache.clear()


@hookimpl
def kestrel_gemm_f32(device: ExampleDevice, a: np.ndarray, weight: StripCache, wkey: int) -> np.ndarray:
    return a.astype(np.float32) @ device.weight(weight, wkey)  # [M, K] @ [K, N]


@hookimpl
def kestrel_gemm_q8(device: ExampleDevice, a_codes: np.ndarray, a_scales: np.ndarray, weight: StripCache,
                    wkey: int) -> np.ndarray:
    g = weight.group_size
    # a: [M, K] dequantized activations
    a = (a_codes.reshape(a_codes.shape[0], -1, g) * a_scales[:, :, None]).reshape(a_codes.shape)
    return a.astype(np.float32) @ device.weight(weight, wkey)
