"""The cost model: its arithmetic by hand, its fit to rknn-llm's figures, and what the hooks charge."""

from __future__ import annotations

import pytest

import kestrel_npu_sim as npu_sim
from kestrel_core.contract import quantize_activations
from kestrel_npu_sim.calibration import (
    NOMINAL_MAC_RATE,
    RKNN_LLM_DECODE_G512_TOK_S,
    RKNN_LLM_DECODE_TOK_S,
    RKNN_LLM_TTFT_S,
    calibrate,
    llama3_8b_step,
    report,
)
from kestrel_npu_sim.cost import CostModel
from kestrel_npu_sim.layout import geometry

from .helpers import activations, weight


def test_one_gemm_by_hand() -> None:
    model = CostModel(launch_s=10e-6, bandwidth=1e9, mac_rate=1e9)
    # M=2, N=4096+64 (chunks 4096 and 64), K=10240+256 (segments 8192 and 2304), G=256
    cost = model.gemm(2, geometry(4096 + 64, 10240 + 256), 256)
    blocks = 8192 // 256 + 2304 // 256  # 32 + 9 per chunk
    assert cost.runs == 2 * blocks
    assert cost.macs == 2 * (4096 + 64) * (10240 + 256)
    per_run_bytes = {n: n * 256 + 2 * 256 + 4 * 2 * n for n in (4096, 64)}
    assert cost.bytes == blocks * sum(per_run_bytes.values())
    # M=2 runs are bandwidth-bound at these rates: bytes/BW > macs/rate
    expected = blocks * sum(10e-6 + max(2 * n * 256 / 1e9, b / 1e9) for n, b in per_run_bytes.items())
    assert cost.seconds == pytest.approx(expected, rel=1e-12)


def test_compute_bound_run_by_hand() -> None:
    model = CostModel(launch_s=0.0, bandwidth=1e12, mac_rate=1e9)
    cost = model.gemm(64, geometry(64, 64), None)  # per-channel: one run over the whole K
    assert cost.runs == 1 and cost.seconds == pytest.approx(64 * 64 * 64 / 1e9)


def test_constants_reproduce_the_published_figures() -> None:
    model = CostModel()
    assert 1 / llama3_8b_step(model, 1, None).seconds == pytest.approx(RKNN_LLM_DECODE_TOK_S, rel=2e-3)
    assert 1 / llama3_8b_step(model, 1, 512).seconds == pytest.approx(RKNN_LLM_DECODE_G512_TOK_S, rel=2e-3)
    assert llama3_8b_step(model, 64, None).seconds == pytest.approx(RKNN_LLM_TTFT_S, rel=2e-3)
    assert model.mac_rate < NOMINAL_MAC_RATE  # never faster than the vendor's 6 TOPS


def test_constants_are_the_fit() -> None:
    fit, used = calibrate(), CostModel()
    assert used.launch_s == pytest.approx(fit.launch_s, rel=2e-3)
    assert used.bandwidth == pytest.approx(fit.bandwidth, rel=2e-3)
    assert used.mac_rate == pytest.approx(fit.mac_rate, rel=2e-3)
    # the fit's premises: decode runs are bandwidth-bound, 64-token prefill layer runs compute-bound
    q = geometry(4096, 4096)
    assert fit.gemm(1, q, None).macs / fit.mac_rate < fit.gemm(1, q, None).bytes / fit.bandwidth
    assert fit.gemm(64, q, None).macs / fit.mac_rate > fit.gemm(64, q, None).bytes / fit.bandwidth
    assert "29.36 GB/s" in report()


def test_hooks_charge_the_model(npu) -> None:  # noqa: ANN001
    w = weight(96, 512, 256, 8)
    x = activations(3, 512)
    codes, scales = quantize_activations(x, 256)
    npu_sim.kestrel_gemm_q8(device=npu, a_codes=codes, a_scales=scales, weight=w, wkey=0)
    expected = npu.cost.gemm(3, geometry(96, 512), 256)
    assert (npu.stats.runs, npu.stats.macs, npu.stats.bytes) == (expected.runs, expected.macs, expected.bytes)
    assert npu.stats.time_s == pytest.approx(expected.seconds)
    npu_sim.kestrel_gemm_f32(device=npu, a=x, weight=w, wkey=0)
    slices = npu.stats.f32_slices
    assert npu.stats.macs == expected.macs + npu.cost.gemm(3 * slices, geometry(96, 512), 256).macs
    stats = npu_sim.kestrel_stats(device=npu)
    assert stats["npu_sim_calls"] == 2 and stats["npu_sim_time_s"] == pytest.approx(npu.stats.time_s)
