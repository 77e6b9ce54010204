"""What the simulated NPU declines, with its reasons counted, and the CPU computing those calls instead."""

from __future__ import annotations

import numpy as np
import pytest

import kestrel_npu_sim as npu_sim
from kestrel_core.contract import quantize_activations
from kestrel_core.dispatch import DECLINED, Offload
from kestrel_core.registry import Registry

from .helpers import activations, weight


def test_unaligned_n_declined_when_padding_is_off(npu, npu_backend) -> None:  # noqa: ANN001
    npu.pad_n = False  # what KESTREL_NPU_SIM_PAD_N=0 sets at open
    registry = Registry()
    offload = Offload(npu_backend, registry.cpu())
    aligned, unaligned = weight(64, 96, 32, 8), weight(40, 96, 32, 8)
    codes, scales = quantize_activations(activations(2, 96), 32)
    cpu = registry.cpu()
    out = offload.gemm_q8(codes, scales, unaligned, 0)
    expected = cpu.hook.kestrel_gemm_q8(device=cpu.device, a_codes=codes, a_scales=scales, weight=unaligned, wkey=0)
    np.testing.assert_array_equal(out, expected)  # the CPU backend ran it
    offload.gemm_q8(codes, scales, aligned, 0)
    counters = offload.stats()["kestrel_gemm_q8"]
    assert counters["accepted"] == 1 and counters["declined_reasons"] == {DECLINED: 1}
    stats = offload.backend_stats()
    assert stats["npu_sim_declined_n_unaligned"] == 1 and stats["npu_sim_declined"] == 1
    registry.close()


def test_padding_env_is_read_at_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_NPU_SIM_PAD_N", "0")
    registry = Registry()
    backend = registry.bind("npu_sim")
    if not backend.bound:
        pytest.skip(backend.reason)
    assert backend.device.pad_n is False
    w = weight(40, 96, 32, 8)
    codes, scales = quantize_activations(activations(1, 96), 32)
    assert npu_sim.kestrel_gemm_q8(device=backend.device, a_codes=codes, a_scales=scales, weight=w, wkey=0) is None
    registry.close()


def test_non_finite_f32_declined(npu) -> None:  # noqa: ANN001
    w = weight(32, 64, 32, 8)
    x = activations(2, 64)
    x[1, 5] = np.inf
    assert npu_sim.kestrel_gemm_f32(device=npu, a=x, weight=w, wkey=0) is None
    x[1, 5] = np.nan
    assert npu_sim.kestrel_gemm_f32(device=npu, a=x, weight=w, wkey=0) is None
    assert npu.stats.declined["f32_non_finite"] == 2 and npu.stats.calls == 0


@pytest.mark.parametrize("bad", ["k", "scales", "dtype"])
def test_mismatched_operands_declined(npu, bad: str) -> None:  # noqa: ANN001
    w = weight(32, 64, 32, 8)
    codes, scales = quantize_activations(activations(2, 64 if bad != "k" else 96), 32)
    if bad == "scales":
        scales = scales[:, :1].copy()
    if bad == "dtype":
        codes = codes.astype(np.int16)
    assert npu_sim.kestrel_gemm_q8(device=npu, a_codes=codes, a_scales=scales, weight=w, wkey=0) is None
    assert npu.stats.declined["bad_operands"] == 1


def test_too_large_for_the_device_declined(npu, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(npu, "max_alloc", 64 * 96 - 1)  # one byte short of the packed weight
    w = weight(64, 96, 32, 8)
    x = activations(1, 96)
    codes, scales = quantize_activations(x, 32)
    assert npu_sim.kestrel_gemm_q8(device=npu, a_codes=codes, a_scales=scales, weight=w, wkey=0) is None
    assert npu_sim.kestrel_gemm_f32(device=npu, a=x, weight=w, wkey=0) is None
    assert npu.stats.declined["too_large"] == 2


def test_declined_f32_falls_back_to_cpu(npu, npu_backend) -> None:  # noqa: ANN001
    registry = Registry()
    offload = Offload(npu_backend, registry.cpu())
    w = weight(32, 64, 32, 4)
    x = activations(3, 64)
    x[0, 0] = np.nan
    cpu = registry.cpu()
    out = offload.gemm_f32(x, w, 0)
    np.testing.assert_array_equal(out, cpu.hook.kestrel_gemm_f32(device=cpu.device, a=x, weight=w, wkey=0))
    assert offload.backend_stats()["npu_sim_declined_f32_non_finite"] == 1
    registry.close()
