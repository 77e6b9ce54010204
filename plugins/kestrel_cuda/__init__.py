"""kestrel_cuda: the CUDA backend on CuPy (kernels in the .cu files beside this module).

Importing this package needs neither CuPy nor a GPU: everything device-related happens in ``kestrel_open``
(``binding.open_device``), which binds all or nothing. Role modules: config (the settings, read once at open),
binding (prerequisites, all or nothing), kernels (the CUDA sources, NVRTC compilation), layout (the device
layout of a weight), weights (upload + K-major transpose), gemm (the hooks' launch API), cupy_alloc (the
cache's allocator), device (the handle and the host-layer contract), residency (weight cache, pool, window),
forward (whole-step decode) with forward_state (a model's device state), plan (its projections and K-split
planners), ops_cupy (its kernels' launches; the attention's in ops_attention, a mixture of experts' in
ops_moe), ops_numpy (their numpy mirror) and forward_launch (PDL and cluster launches).
"""

from __future__ import annotations

from typing import Any

import kestrel_core
from kestrel_core.hookspecs import API_VERSION, hookimpl
from kestrel_core.registry import BackendInfo

# Offloads below this many FLOPs (2*M*N*K) stay on the CPU; KESTREL_CUDA_MIN_FLOPS overrides it. Measured on
# the H200 machine with benchmarks/cuda_gemv.py (docs/performance.md, "## CUDA"): the crossover where the
# hook, transfers included, beats the CPU reference.
DEFAULT_MIN_FLOPS = 1 << 23  # 8.4 MFLOP: M=1 N=K=2048 is the first size the H200 hook wins


@hookimpl
def kestrel_backend_info() -> BackendInfo:
    return BackendInfo(name="cuda", version=kestrel_core.__version__, api_version=API_VERSION, kind="gpu",
                       min_flops=DEFAULT_MIN_FLOPS,
                       description="CuPy kernels: dp4a GEMV for decode, int8 mma.sync GEMM for prefill")


@hookimpl
def kestrel_open(options: dict[str, Any]) -> Any:
    from kestrel_cuda.binding import open_device

    return open_device(options)


@hookimpl
def kestrel_close(device: Any) -> None:
    device.close()


@hookimpl
def kestrel_gemm_q8(device: Any, a_codes: Any, a_scales: Any, weight: Any, wkey: int) -> Any:
    return device.gemm_q8(a_codes, a_scales, weight, wkey)


@hookimpl
def kestrel_gemm_f32(device: Any, a: Any, weight: Any, wkey: int) -> Any:
    return device.gemm_f32(a, weight, wkey)


@hookimpl
def kestrel_gemm_fused_q8(device: Any, a_codes: Any, a_scales: Any, weights: Any, wkeys: Any,
                          fused_wkey: int) -> Any:
    return device.gemm_fused_q8(a_codes, a_scales, weights, wkeys, fused_wkey)


@hookimpl
def kestrel_layer_boundary(device: Any, layer: int) -> None:
    device.layer_boundary(layer)


@hookimpl
def kestrel_preload(device: Any, model: Any) -> None:
    device.preload(model)


@hookimpl
def kestrel_forward_supports(device: Any, model: Any) -> Any:
    return device.forward_supports(model)


@hookimpl
def kestrel_forward(device: Any, model: Any, seq_id: int, tokens: Any, start: int, all_logits: bool) -> Any:
    return device.run_forward(model, seq_id, tokens, start, all_logits)


@hookimpl
def kestrel_forward_batch(device: Any, model: Any, batch: Any) -> Any:
    return device.run_forward_batch(model, batch)


@hookimpl
def kestrel_decode_greedy(device: Any, model: Any, seq_id: int, token: int, start: int, count: int) -> Any:
    return device.run_greedy(model, seq_id, token, start, count)


@hookimpl
def kestrel_release_sequence(device: Any, seq_id: int) -> None:
    device.release_sequence(seq_id)


@hookimpl
def kestrel_selftest_cases(device: Any) -> Any:
    from kestrel_cuda.selftest_cases import cuda_cases

    return cuda_cases()


@hookimpl
def kestrel_stats(device: Any) -> Any:
    return device.stats()
