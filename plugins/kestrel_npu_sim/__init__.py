"""kestrel_npu_sim: the Rockchip RK3588 NPU's matmul, simulated with OpenCL kernels.

A ``simulator`` backend (never picked by ``--backend auto``; use ``--backend npu_sim``). Strip-cache
weights are repacked once per wkey into the NPU's native int8 layout; every GEMM runs as one integer
matmul per K-block on the OpenCL device, with scales and float accumulation on the host, and is charged
simulated NPU time by a cost model fitted to rknn-llm's published figures (docs/backends/npu_sim.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kestrel_core
from kestrel_core.contract import StripCache
from kestrel_core.hookspecs import API_VERSION, BackendInfo, BackendUnavailable, hookimpl
from kestrel_core.model.weights import engine_weights

from . import matmul
from .device import NpuSimDevice, open_device
from .layout import K_MAX, N_MAX, TILE_N
from .stats import NpuSimStats


@hookimpl
def kestrel_backend_info() -> BackendInfo:
    return BackendInfo(name="npu_sim", version=kestrel_core.__version__, api_version=API_VERSION,
                       kind="simulator", description="RK3588 NPU matmul model on OpenCL (pyopencl)")


def _self_check(dev: NpuSimDevice) -> None:
    """Exact integer block sums on this device for both kernels, or the backend does not bind."""
    rng = np.random.default_rng(5)
    weight = StripCache(rng.integers(-127, 128, size=(40, 64), dtype=np.int8),
                        np.ones((40, 2), dtype=np.float32), 32, 8)
    for m in (3, 9):
        a = rng.integers(-127, 128, size=(m, 64), dtype=np.int8)
        expected = (a.astype(np.int64).reshape(m, 2, 32).transpose(1, 0, 2)
                    @ weight.codes.astype(np.int64).reshape(40, 2, 32).transpose(1, 2, 0))  # [2, M, N]
        got = np.concatenate([s for _, _, s in matmul.block_sums(dev, a, dev.packed((weight,), 0), 32)], axis=2)
        if not np.array_equal(got, expected):
            raise BackendUnavailable(f"kernel self-check failed on {dev.description}: wrong integer block sums")


@hookimpl
def kestrel_open(options: dict[str, Any]) -> NpuSimDevice:
    dev = open_device(options)
    try:
        _self_check(dev)
    except BaseException:
        dev.close()
        raise
    dev.stats = NpuSimStats()  # the self-check is not the user's work
    return dev


@hookimpl
def kestrel_close(device: NpuSimDevice) -> None:
    device.close()


@hookimpl
def kestrel_gemm_q8(device: NpuSimDevice, a_codes: np.ndarray, a_scales: np.ndarray, weight: StripCache,
                    wkey: int) -> np.ndarray | None:
    return matmul.gemm_q8(device, a_codes, a_scales, weight, wkey)


@hookimpl
def kestrel_gemm_f32(device: NpuSimDevice, a: np.ndarray, weight: StripCache, wkey: int) -> np.ndarray | None:
    return matmul.gemm_f32(device, a, weight, wkey)


@hookimpl
def kestrel_gemm_fused_q8(device: NpuSimDevice, a_codes: np.ndarray, a_scales: np.ndarray,
                          weights: list[StripCache], wkeys: list[int], fused_wkey: int) -> list[np.ndarray] | None:
    return matmul.gemm_fused_q8(device, a_codes, a_scales, weights, fused_wkey)


@hookimpl
def kestrel_preload(device: NpuSimDevice, model: Any) -> None:
    """Repack every weight the engine will multiply at load, so none of it lands in the first prefill."""
    for key, weights in engine_weights(model):
        shared = all(w.k == weights[0].k and w.group_size == weights[0].group_size for w in weights)
        if shared and (device.pad_n or all(w.n % TILE_N == 0 for w in weights)):
            device.packed(weights, key)


@hookimpl
def kestrel_stats(device: NpuSimDevice) -> dict[str, Any]:
    out = device.stats.as_dict()
    out["npu_sim_cached_weights"] = len(device.cache)
    out["npu_sim_cached_bytes"] = device.cached_bytes
    return out


@hookimpl
def kestrel_selftest_cases(device: NpuSimDevice) -> list[Any]:
    """Shapes the default suite does not reach: N split into NPU calls, K split into segments."""
    from kestrel_core.selftest import SelfTestCase

    wide, long_k = N_MAX + 64, K_MAX + 256
    return [SelfTestCase("kestrel_gemm_q8", 1, (wide,), 64, 32, 8, 0),
            SelfTestCase("kestrel_gemm_q8", 2, (32,), long_k, 256, 4, 0),
            SelfTestCase("kestrel_gemm_f32", 3, (wide,), 64, 32, 4, 0)]
