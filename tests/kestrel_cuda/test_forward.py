"""The whole-step device forward on the GPU (its kernels through CupyOps) against the CPU decoder.

Skipped where CuPy or a CUDA device is missing (CI); run on the H200 machine. The tolerance is measured,
not fixed (forward_check explains why): the CPU is re-run with its linear inputs and outputs nudged by a
few ulps, and the device must stay within FACTOR times that effect, its argmax must be the CPU's or tie
with it within the nudge's range, and greedy decoding must pick the CPU's tokens.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import kestrel_core  # noqa: E402
from kestrel_core.model.decoder import PREFILL_CHUNK  # noqa: E402
from kestrel_core.model.presets import synthetic_model  # noqa: E402
from kestrel_cuda.config import CudaConfig  # noqa: E402
from kestrel_cuda.forward import CAP_CHUNK, DeviceForward  # noqa: E402

from .forward_check import (  # noqa: E402
    DECLINING_BACKEND,
    FACTOR,
    SMALL_CONFIGS,
    compare,
    cpu_logits,
    cuda_device_count,
    device_logits,
    greedy_agrees,
    jitter_effect,
    random_tokens,
    stepwise_greedy,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]

QUANTS = ("q8", "q4", "q8-g256", "q4-g256")


@pytest.fixture(scope="module")
def stream():  # type: ignore[no-untyped-def]
    return cp.cuda.Stream(non_blocking=True)


@pytest.fixture(scope="module")
def gemm(stream):  # type: ignore[no-untyped-def]
    """cuda-kernels' tiled GEMM, used by prefill chunks of more than 8 rows."""
    from kestrel_cuda.gemm import DeviceGemm
    from kestrel_cuda.kernels import compile_kernels

    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    g = DeviceGemm(cp, compile_kernels(cp), sm)
    g.workspace(stream)
    return g


def _check(model, toks, n_prefill, got):  # type: ignore[no-untyped-def]
    ref = cpu_logits(model, toks, n_prefill)
    result = compare(got, ref, jitter_effect(model, toks, n_prefill, ref))
    print(f"{model.config.arch}: {result}")
    assert result.ok, str(result)
    assert result.argmax_same >= 0.9 * len(toks), str(result)
    return result


@pytest.mark.parametrize("n_prefill", [8, 20])
def test_a_sliding_window_matches_the_cpu(n_prefill, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """Mistral with a window of 12: attn_prefill within and past it, then captured attn_decode steps past it."""
    model = synthetic_model(replace(SMALL_CONFIGS["llama"], arch="mistral", sliding_window=12), "q8", seed=3)
    toks = random_tokens(model.config, 40)
    _check(model, toks, n_prefill, device_logits(DeviceForward(stream=stream, gemm=gemm), model, toks, n_prefill))


@pytest.mark.parametrize("fixture", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen2-moe"])
def test_a_mixture_of_experts_matches_the_cpu(fixture, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """Routed on the device: a 12-token prefill (tiled GEMMs on each chosen expert's rows), then captured
    decode steps (the chosen experts' GEMVs over the layer's expert tables)."""
    from kestrel_core.model.loader import load_model

    model = load_model(str(Path(__file__).resolve().parents[1] / "fixtures" / "models" / fixture), "q8",
                       cache="off").model
    toks = random_tokens(model.config, 20)
    fwd = DeviceForward(stream=stream, gemm=gemm)
    _check(model, toks, 12, device_logits(fwd, model, toks, 12))
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["graph_replays"] == 8


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", list(SMALL_CONFIGS))
def test_prefill_and_decode_logits_match_the_cpu(arch, quant, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """24-token prefill (tiled GEMM path), then 16 graph-replayed decode steps, teacher-forced."""
    model = synthetic_model(SMALL_CONFIGS[arch], quant, seed=3)
    toks = random_tokens(model.config, 40)
    fwd = DeviceForward(stream=stream, gemm=gemm)
    _check(model, toks, 24, device_logits(fwd, model, toks, 24))
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["graph_replays"] == 16


@pytest.mark.parametrize("pdl", ("0", "1"))
@pytest.mark.parametrize("arch", list(SMALL_CONFIGS))
def test_graph_decode_with_and_without_pdl_matches_the_cpu(arch, pdl, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """The captured decode step with its kernels launched in plain stream order and with programmatic
    dependent launch (pdl: each kernel may start under its predecessor's tail)."""
    model = synthetic_model(SMALL_CONFIGS[arch], "q4", seed=14)
    toks = random_tokens(model.config, 30)
    fwd = DeviceForward(config=CudaConfig(pdl=pdl == "1"), stream=stream, gemm=gemm)
    assert fwd.ops.pdl == (pdl == "1")
    _check(model, toks, 10, device_logits(fwd, model, toks, 10))
    assert fwd.counters["graph_replays"] == 20


@pytest.mark.parametrize("n_prefill", (5, 24))
def test_fused_gemv_prefill_without_the_tiled_gemm(n_prefill, stream) -> None:  # type: ignore[no-untyped-def]
    """Without cuda-kernels' GEMM every prefill row runs the fused GEMV (8 rows per weight pass)."""
    model = synthetic_model(SMALL_CONFIGS["qwen2"], "q8", seed=4)
    toks = random_tokens(model.config, n_prefill + 6)
    _check(model, toks, n_prefill, device_logits(DeviceForward(stream=stream), model, toks, n_prefill))


@pytest.mark.parametrize("kind", ("counter", "tagged", "cluster"))
@pytest.mark.parametrize("n, k, group", ((509, 2048, 32), (509, 2048, 256), (8, 512, 32), (8, 512, 256),
                                         (24, 800, 32)))  # 800: a last chunk of 32 rows
@pytest.mark.parametrize("bits", (8, 4))
def test_m1_gemv_kernel_matches_the_reference_at_every_split(bits, group, n, k, kind, stream) -> None:  # type: ignore[no-untyped-def]
    """One M=1 projection with a plain input (its activation codes are the contract's, bit for bit): every
    K split the kernel may be given (empty blocks included) equals the exact block sums scaled per group
    within float32 summation-order error, with bias and the residual add."""
    from kestrel_core.contract import quantize_activations
    from kestrel_cuda.layout import pack_kmajor, pad_n
    from kestrel_cuda.ops_cupy import CupyOps
    from kestrel_cuda.plan import EPI_ADD, PRO_PLAIN, Lin

    ops = CupyOps(stream, merge="tagged" if kind == "tagged" else "counter")
    rng = np.random.default_rng(bits * 1000 + group + n)
    lo, hi = (-127, 127) if bits == 8 else (-8, 7)
    codes = rng.integers(lo, hi + 1, size=(n, k)).astype(np.int8)
    scales = rng.uniform(-0.02, 0.02, size=(n, k // group)).astype(np.float32)
    npad = pad_n(n)
    sc = np.zeros((k // group, npad), np.float32)
    sc[:, :n] = scales.T
    x = rng.standard_normal((1, k)).astype(np.float32)
    a_codes, a_scales = quantize_activations(x, group)
    ng = k // group
    isum = np.einsum("gi,ngi->gn", a_codes.reshape(ng, group).astype(np.int64), codes.reshape(n, ng, group))
    terms = (isum.astype(np.float32) * a_scales[0][:, None]).astype(np.float64) * scales.T  # [ng, n]
    y0 = rng.standard_normal(n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    expect = y0.astype(np.float64) + bias + terms.sum(0)
    bound = (ng + 3) * 2.0 ** -23 * (np.abs(terms).sum(0) + np.abs(y0) + np.abs(bias))
    lin = Lin(ops.upload(pack_kmajor(codes, bits)), ops.upload(sc), k, n, npad, group, bits)
    xd, bd = ops.upload(x), ops.upload(bias)
    splits = sorted({1, 2, 3, 7, ng} & set(range(1, ng + 1)))
    for ksplit in splits:
        lin.ksplit = ksplit
        lin.cluster = kind == "cluster" and ops.cluster and ksplit <= 8  # partial sums in shared memory
        ops.reserve(ksplit * npad, lin.tiles, 1, 1, lin.tiles)
        y = ops.upload(y0[None])
        ops.gemv(lin, xd, PRO_PLAIN, None, 0.0, 0, y, EPI_ADD, bd)
        ops.synchronize()
        err = np.abs(y.get()[0] - expect)
        assert np.all(err <= bound), f"ksplit {ksplit}: max err {err.max()} over bound {bound[err.argmax()]}"


@pytest.mark.parametrize(("experts", "k", "shared", "m", "d"), (
    (128, 8, False, 1, 2048), (128, 8, False, 5, 2048), (60, 4, True, 1, 2048), (60, 4, True, 3, 2048),
    (8, 2, False, 1, 2048), (10, 3, True, 1, 2048), (16, 4, False, 1, 6144), (16, 4, False, 2, 6144),
    (16, 10, False, 1, 2048)))
def test_moe_route_and_the_chosen_experts_match_the_mirrors(experts, k, shared, m, d, stream) -> None:  # type: ignore[no-untyped-def]
    """moe_route at Qwen3-MoE's and Qwen2-MoE's router shapes (D = 2048; M = 1 reads the tile sums) and a row
    wider than one pass of its loads (D = 6144) against its numpy mirror (itself checked against the CPU
    decoder's route): the same experts, weights within float32 summation order; then the chosen experts'
    GEMVs (split over K, merged through the counters and as clusters) and moe_combine at M = 1 (k = 10: past
    the slots it holds in registers)."""
    from kestrel_cuda.layout import pack_kmajor, pad_n
    from kestrel_cuda.ops_cupy import CupyOps
    from kestrel_cuda.ops_numpy import NumpyOps, _row_ssq
    from kestrel_cuda.plan import EPI_STORE, PRO_PLAIN, Lin, plan_routed

    ops, ref = CupyOps(stream), NumpyOps()
    rng = np.random.default_rng(experts + m)
    f = 96
    h = rng.standard_normal((m, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    router = (0.05 * rng.standard_normal((experts + shared, d))).astype(np.float32)
    ssq = _row_ssq(h[0]) if m == 1 else None
    outs = []
    for o in (ops, ref):
        sel, wts = o.zeros((m, k), np.int32), o.zeros((m, k + 1), np.float32)
        xn = o.zeros((m, d), np.float32)
        scratch = (o.zeros((m, experts + 1), np.float32), o.zeros(m, np.int32))
        o.moe_route(o.upload(h), o.upload(norm), 1e-6, o.upload(router), experts, k, True, xn, scratch, sel, wts,
                    ssq_in=None if ssq is None else o.upload(ssq))
        o.synchronize()
        outs.append((sel, wts, xn))
    (sel, wts, xn), (rsel, rwts, rxn) = outs
    assert np.array_equal(cp.asnumpy(sel), rsel)
    np.testing.assert_allclose(cp.asnumpy(wts)[:, :k + shared], rwts[:, :k + shared], rtol=2e-5)
    np.testing.assert_allclose(cp.asnumpy(xn), rxn, rtol=1e-6, atol=1e-6)
    if m > 1:
        return
    lins = {o: [] for o in (ops, ref)}
    for _ in range(experts):
        codes = rng.integers(-127, 128, size=(f, d)).astype(np.int8)
        sc = np.zeros((d // 32, pad_n(f)), np.float32)
        sc[:, :f] = rng.uniform(0.001, 0.02, size=(f, d // 32)).T
        for o in (ops, ref):
            lins[o].append(Lin(o.upload(pack_kmajor(codes, 8)), o.upload(sc), d, f, pad_n(f), 32, 8))
    yc = rng.standard_normal((k, d)).astype(np.float32)  # the slots' outputs, for the sum
    for clusters in (False, True):  # the K splits merged through the counters, then as one cluster a slot
        for o in (ops, ref):
            for lin in lins[o]:
                lin.ksplit = plan_routed(lin, k, ops.sm_count, clusters)
        assert lins[ops][0].ksplit > 1 and lins[ops][0].cluster == (clusters and d == 2048)  # 8 chunks: one cluster
        ys = []
        for o, chosen, w in ((ops, sel, ops.upload(rwts)), (ref, rsel, rwts)):  # the same weights: checked above
            if o is ops:
                o.reserve(lins[o][0].ksplit * k * pad_n(f), lins[o][0].tiles * k, 1, 1)
            y, y2, hh = o.zeros((k, f), np.float32), o.zeros((k, f), np.float32), o.upload(h)
            table, x = o.expert_table(lins[o]), o.upload(rxn)
            o.gemv(lins[o][0], x, PRO_PLAIN, None, 0.0, 0, y, EPI_STORE, None, experts=(table, chosen[0], k))
            # a routed GEMV after another on the same choices reads them before its PDL wait
            o.gemv(lins[o][0], x, PRO_PLAIN, None, 0.0, 0, y2, EPI_STORE, None, experts=(table, chosen[0], k),
                   sel_ready=True)
            o.moe_combine(o.upload(yc), k, w, hh)
            o.synchronize()
            ys.append((y, hh, y2) if o is ref else (cp.asnumpy(y), cp.asnumpy(hh), cp.asnumpy(y2)))
        (y, hh, y2), (ry, rhh, _) = ys
        assert np.array_equal(y2, y)
        np.testing.assert_allclose(y, ry, rtol=1e-4, atol=1e-5 * np.abs(ry).max())
        np.testing.assert_allclose(hh, rhh, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("experts", "k", "shared", "d", "width", "bits"), (
    (128, 8, False, 2048, 4096, 8), (128, 8, False, 2048, 4096, 4), (60, 4, True, 2048, 2048, 8),
    (8, 2, False, 4096, 4096, 8)))
@pytest.mark.parametrize("clusters", (False, True))
def test_a_router_folded_into_the_o_projection_matches_the_mirror_and_moe_route(  # type: ignore[no-untyped-def]
        experts, k, shared, d, width, bits, clusters, stream) -> None:
    """The o projection's GEMV with the router's blocks beside it (plan.RouteFold) at Qwen3-MoE's, Qwen2-MoE's
    and Mixtral's shapes, its K splits merged through the counters and as clusters, then moe_combine weighing
    its choice: h', the choice and the sum are the numpy mirror's, and the choice and the sum are those of
    moe_route on h' (the router unfolded); a second launch (the arrival count reset) gives the same bits."""
    from kestrel_core.contract import StripCache
    from kestrel_cuda.layout import pack_kmajor, pad_n
    from kestrel_cuda.ops_cupy import CupyOps
    from kestrel_cuda.ops_numpy import NumpyOps, _row_ssq
    from kestrel_cuda.plan import EPI_STORE, PRO_PLAIN, Lin, RouteFold, plan_split, route_fold_span, route_fold_weights

    ops, ref = CupyOps(stream), NumpyOps()
    rng = np.random.default_rng(experts + d + bits)
    lo, hi = (-127, 128) if bits == 8 else (-8, 8)
    codes = rng.integers(lo, hi, size=(d, width)).astype(np.int8)  # o: [D, K]
    scales = rng.uniform(0.002, 0.01, size=(d, width // 32)).astype(np.float32)
    h = rng.standard_normal((1, d)).astype(np.float32)
    a = rng.standard_normal((1, width)).astype(np.float32)
    ys = rng.standard_normal((k + 1, d)).astype(np.float32)  # the chosen experts' outputs, then the shared one's
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    router = (0.05 * rng.standard_normal((experts + shared, d))).astype(np.float32)
    fold = route_fold_weights(router, norm, StripCache(codes, scales, 32, bits))
    sc = np.zeros((width // 32, pad_n(d)), np.float32)
    sc[:, :d] = scales.T
    outs = {}
    for o in (ops, ref):
        lin = Lin(o.upload(pack_kmajor(codes, bits)), o.upload(sc), width, d, pad_n(d), 32, bits)
        lin.ksplit = plan_split(lin, ops.sm_count, None, clusters and ops.cluster)
        span = route_fold_span(d, width, lin.ksplit)
        assert span > 0, f"no fold span for {lin.ksplit} splits"
        if o is ops:
            o.reserve(lin.ksplit * pad_n(d), lin.tiles, 1, 1)
        runs = []
        for _ in range(2):
            part, count = o.zeros(lin.ksplit * (experts + shared), np.float32), o.zeros(1, np.int32)
            route = RouteFold(o.upload(fold), experts, k, True, span, part, count, o.zeros((1, k), np.int32),
                              o.zeros((1, k + 1), np.float32))
            y, ssq, ssq2 = o.zeros((1, d), np.float32), o.zeros(d // 32, np.float32), o.zeros(d // 32, np.float32)
            o.gemv(lin, o.upload(a), PRO_PLAIN, None, 1e-6, 0, y, EPI_STORE, o.upload(h), ssq_out=ssq, route=route)
            h1 = o.upload(np.asarray(y.get() if o is ops else y))
            y_all = o.upload(ys)
            o.moe_combine(y_all[:k], k, route.wts, h1, None, y_all[k:] if shared else None, ssq2,
                          fold=(route, ssq, 1e-6))
            o.synchronize()
            runs.append([np.asarray(v.get() if o is ops else v) for v in (y, ssq, route.sel, route.wts, count, h1,
                                                                         part[:experts + shared])])
        outs[o] = runs
    (y, ssq, sel, wts, count, h2, totals), again = outs[ops]
    ry, _, rsel, rwts, _, rh2, rtotals = outs[ref][0]
    assert all(np.array_equal(u, v) for u, v in zip(again, outs[ops][0])) and count[0] == 0
    np.testing.assert_allclose(y, ry, rtol=1e-5, atol=1e-5 * np.abs(ry).max())
    np.testing.assert_allclose(ssq, _row_ssq(y[0]), rtol=1e-5)
    assert np.array_equal(sel, rsel)
    np.testing.assert_allclose(totals, rtotals, rtol=1e-4, atol=1e-4 * np.abs(rtotals).max())
    np.testing.assert_allclose(wts[:, :k + shared], rwts[:, :k + shared], rtol=1e-4, atol=1e-4 * np.abs(rtotals).max())
    np.testing.assert_allclose(h2, rh2, rtol=1e-5, atol=1e-5 * np.abs(rh2).max())
    # the router unfolded: moe_route on h', its weights into the same sum
    usel, uwts, uh = ops.zeros((1, k), np.int32), ops.zeros((1, k + 1), np.float32), ops.upload(y)
    ops.moe_route(ops.upload(y), ops.upload(norm), 1e-6, ops.upload(router), experts, k, True,
                  ops.zeros((1, d), np.float32), (ops.zeros((1, experts + 1), np.float32), ops.zeros(1, np.int32)),
                  usel, uwts, ssq_in=ops.upload(ssq))
    y_all = ops.upload(ys)
    ops.moe_combine(y_all[:k], k, uwts, uh, None, y_all[k:] if shared else None)
    assert np.array_equal(usel.get(), sel)
    np.testing.assert_allclose(uh.get(), h2, rtol=1e-5, atol=1e-5 * np.abs(h2).max())


@pytest.mark.parametrize(("bits", "group"), ((8, 32), (4, 32), (8, 256), (4, 256)))
@pytest.mark.parametrize("rows", (64, 16))
def test_grouped_expert_gemm_matches_the_mirror(bits, group, rows, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """One launch of the grouped tensor-core GEMM over 100 rows' chosen experts (4 of 16 a row; expert 0 on 80
    rows: two blocks of 64 or five of 16, expert 15 on one row), the SiLU-gated prologue included, and blocks
    past the groups (count 0, as moe_group pads them), against the numpy mirror."""
    from kestrel_cuda.layout import pack_kmajor, pad_n
    from kestrel_cuda.ops_cupy import CupyOps
    from kestrel_cuda.ops_numpy import NumpyOps
    from kestrel_cuda.plan import PRO_SILU_MUL, Lin, expert_groups

    ops, ref = CupyOps(stream, gemm), NumpyOps()
    rng = np.random.default_rng(bits + group)
    e, k, m, kk, n = 16, 4, 100, 512, 200
    top = np.sort(np.stack([[0, *(1 + rng.choice(e - 2, k - 1, replace=False))] if r < 80 else
                            [*(1 + rng.choice(e - 3, k - 1, replace=False)), e - 1 if r == 80 else e - 2]
                            for r in range(m)]), axis=1)
    source, position, groups = expert_groups(top, rows)
    padded = np.concatenate([groups, np.zeros((3, 3), np.int32)])
    x = rng.standard_normal((m * k, 2 * kk)).astype(np.float32)[source]
    lo, hi = (-127, 127) if bits == 8 else (-8, 7)
    weights = []
    for _ in range(e):
        codes = rng.integers(lo, hi + 1, size=(n, kk)).astype(np.int8)
        sc = np.zeros((kk // group, pad_n(n)), np.float32)
        sc[:, :n] = rng.uniform(0.001, 0.02, size=(n, kk // group)).T
        weights.append((pack_kmajor(codes, bits), sc))
    out = []
    for o in (ops, ref):
        lins = [Lin(o.upload(c), o.upload(sc), kk, n, pad_n(n), group, bits) for c, sc in weights]
        y = o.zeros((m * k, n), np.float32)
        o.experts_gemm(lins[0], o.upload(x), PRO_SILU_MUL, kk, y, o.expert_table(lins), o.upload(padded),
                       len(padded), rows)
        o.synchronize()
        out.append(cp.asnumpy(y) if o is ops else y)
    counts = np.bincount(top.reshape(-1), minlength=e)
    assert len(groups) == (-(-counts // rows)).sum() and groups[:, 2].min() == 1 and counts[0] > rows
    np.testing.assert_allclose(out[0], out[1], rtol=1e-5, atol=1e-5 * np.abs(out[1]).max())


@pytest.mark.parametrize(("m", "k", "e", "rows"), ((1, 8, 128, 16), (32, 8, 128, 16), (32, 8, 128, 64),
                                                  (1024, 8, 128, 64), (300, 4, 16, 64), (300, 4, 16, 16),
                                                  (5, 2, 8, 16)))
def test_moe_group_sorts_the_pairs_as_the_host_does(m, k, e, rows, stream) -> None:  # type: ignore[no-untyped-def]
    """moe_group against plan.expert_groups: the same positions, sources and blocks of 16 or 64, then zeros up
    to the capacity; 1,024 rows of 8 (more pairs than one staged chunk), experts with more than a block."""
    from kestrel_cuda.ops_cupy import CupyOps
    from kestrel_cuda.plan import expert_groups, group_capacity

    ops = CupyOps(stream)
    rng = np.random.default_rng(m * k + e)
    top = np.sort(np.stack([rng.choice(e, k, replace=False) for _ in range(m)]), axis=1).astype(np.int32)
    source, position, groups = expert_groups(top, rows)
    cap = group_capacity(m * k, e, rows)
    got = [ops.upload(np.full(m * k, -1, np.int32)), ops.upload(np.full(m * k, -1, np.int32)),
           ops.upload(np.full((cap, 3), -1, np.int32))]
    ops.moe_group(ops.upload(top), e, *got, rows)
    ops.synchronize()
    src, pos, grp = (cp.asnumpy(a) for a in got)
    assert np.array_equal(src, source) and np.array_equal(pos, position)
    assert np.array_equal(grp[:len(groups)], groups) and not grp[len(groups):].any()
    assert m < 300 or groups[:, 2].max() == rows


def test_tagged_split_merge_is_exact_across_interleaved_launches(stream) -> None:  # type: ignore[no-untyped-def]
    """Two split GEMVs of different widths and split counts share the tagged merge area and advance its tile
    epochs in turn, eagerly and replayed from a graph: every launch gives the same bits as the first, and the
    same bits as the counter merge."""
    from kestrel_cuda.layout import pack_kmajor, pad_n
    from kestrel_cuda.ops_cupy import CupyOps
    from kestrel_cuda.plan import EPI_STORE, PRO_PLAIN, Lin, gemv_scratch

    ops = CupyOps(stream, cluster=False, merge="tagged")
    rng = np.random.default_rng(5)
    lins, xs, ys = [], [], []
    for n, k, ksplit in ((509, 2048, 7), (260, 4096, 16)):
        npad = pad_n(n)
        codes = rng.integers(-127, 128, size=(n, k)).astype(np.int8)
        scales = np.zeros((k // 32, npad), np.float32)
        scales[:, :n] = rng.uniform(0.001, 0.02, size=(k // 32, n))
        lins.append(Lin(ops.upload(pack_kmajor(codes, 8)), ops.upload(scales), k, n, npad, 32, 8, ksplit=ksplit))
        xs.append(ops.upload(rng.standard_normal((1, k)).astype(np.float32)))
        ys.append(ops.zeros((1, n), np.float32))
    part, counters, tiles = gemv_scratch(lins)
    ops.reserve(part, counters, 1, 1, tiles)

    def step() -> None:
        for lin, x, y in zip(lins, xs, ys):
            ops.gemv(lin, x, PRO_PLAIN, None, 0.0, 0, y, EPI_STORE, None)

    step()
    ops.synchronize()
    first = [y.get() for y in ys]
    graph = ops.capture(step)
    for i in range(12):
        with ops.stream:
            for y in ys:
                y.fill(0)
        step() if i % 2 else graph()
        ops.synchronize()
        for y, ref in zip(ys, first):
            assert np.array_equal(y.get(), ref), f"launch {i}"
    assert int(ops.epochs.get().max()) >= 13  # the tiles' epochs advanced once a launch
    ops.merge_mode = "counter"
    step()
    ops.synchronize()
    for y, ref in zip(ys, first):
        assert np.array_equal(y.get(), ref)


@pytest.mark.parametrize("quant", ("q8", "q4-g256"))
def test_chunked_gemv_with_several_chunks_per_block(quant, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """qgemv at M = 1 with few blocks: several chunks a block (down's K = 768: three 256-row chunks)."""
    model = synthetic_model(SMALL_CONFIGS["qwen3"], quant, seed=11)
    toks = random_tokens(model.config, 20)
    fwd = DeviceForward(stream=stream, gemm=gemm, target_blocks=2)
    _check(model, toks, 12, device_logits(fwd, model, toks, 12))
    assert any(lin.chunks > lin.ksplit for lin in fwd._st.layers[0].weights.gate_up + [fwd._st.layers[0].weights.down])


# qwen3 with 6 query heads per KV head (and head_dim 64); Gemma 3's head_dim of 256 (its 1B-12B)
ATTN_CONFIGS = {**SMALL_CONFIGS, "qwen3-gqa6": replace(SMALL_CONFIGS["qwen3"], num_heads=12, num_kv_heads=2,
                                                        head_dim=64, num_layers=1),
                "gemma3-hd256": replace(SMALL_CONFIGS["gemma3"], head_dim=256)}


@pytest.mark.parametrize("arch", list(ATTN_CONFIGS))
def test_attention_matches_the_cpu(arch, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """attn_prefill and attn_decode: prefill, graph decode, and a prefill continued at a nonzero start (rows
    see earlier positions)."""
    model = synthetic_model(ATTN_CONFIGS[arch], "q8", seed=12)
    toks = random_tokens(model.config, 60)
    fwd = DeviceForward(stream=stream, gemm=gemm)
    _check(model, toks, 37, device_logits(fwd, model, toks, 37))
    fwd.forward(model, 6, toks[:23], 0, False)
    cont = fwd.forward(model, 6, toks[23:], 23, True)  # second chunk of a prompt, 37 rows after 23 cached
    ref = cpu_logits(model, toks, len(toks))
    result = compare(cont, ref[23:], jitter_effect(model, toks, len(toks), ref))
    assert result.ok, str(result)


@pytest.mark.parametrize("pdl", ("0", "1"))
def test_attention_long_context_and_graph(pdl, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """Decode past 1,024 positions: each warp of attn_decode runs several rounds of positions."""
    model = synthetic_model(replace(SMALL_CONFIGS["qwen2"], num_layers=1), "q4", seed=13)
    n = CAP_CHUNK - 2
    toks = random_tokens(model.config, n + 5)
    graph = device_logits(DeviceForward(config=CudaConfig(pdl=pdl == "1"), stream=stream, gemm=gemm), model, toks, n)
    _check(model, toks, n, graph)
    eager = device_logits(DeviceForward(config=CudaConfig(pdl=pdl == "1", graph=False), stream=stream, gemm=gemm),
                          model, toks, n)
    assert np.array_equal(graph, eager)


@pytest.mark.parametrize("pdl", ("0", "1"))
def test_graph_replay_equals_eager_and_runs_are_deterministic(pdl, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """Bitwise: graph replay (with PDL: kernels overlapping their predecessors) == eager launches."""
    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q4", seed=5)
    toks = random_tokens(model.config, 30)

    def run(graph: bool) -> np.ndarray:
        fwd = DeviceForward(config=CudaConfig(pdl=pdl == "1", graph=graph), stream=stream, gemm=gemm)
        return device_logits(fwd, model, toks, 10)

    graph, eager, again = run(True), run(False), run(True)
    assert np.array_equal(graph, eager)
    assert np.array_equal(graph, again)


@pytest.mark.parametrize("pdl", ("0", "1"))
def test_next_sequence_replays_the_released_ones_graph(pdl, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """A longer first prompt leaves stale keys past the second's positions: bitwise the same as a fresh
    forward, with one capture for both."""
    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q4", seed=9)
    a, b = random_tokens(model.config, 40, seed=1), random_tokens(model.config, 24, seed=2)
    config = CudaConfig(pdl=pdl == "1")
    fwd = DeviceForward(config=config, stream=stream, gemm=gemm)
    device_logits(fwd, model, a, 30, seq_id=1)
    fwd.release(1)
    got = device_logits(fwd, model, b, 9, seq_id=2)
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["sequences_reused"] == 1
    assert np.array_equal(got, device_logits(DeviceForward(config=config, stream=stream, gemm=gemm), model, b, 9,
                                             seq_id=2))


@pytest.mark.parametrize("quant", ("q4", "q8-g256"))
def test_cluster_split_sums_equal_the_global_merge_bitwise(quant, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """Clusters (chosen where they fit, at most 8 splits) add each tile's K splits in shared memory in the same
    order as the global merges (counter and tagged): the same bits as without clusters when the plan is the
    same."""
    from kestrel_cuda.ops_cupy import CupyOps

    model = synthetic_model(replace(SMALL_CONFIGS["qwen3"], hidden_size=1024, intermediate_size=2048), quant,
                            seed=11)
    toks = random_tokens(model.config, 14)
    runs, plans = {}, []
    for mode in ("0", "1"):  # target 64 blocks: several splits per tile at this size
        fwd = DeviceForward(config=CudaConfig(cluster=mode == "1"), stream=stream, gemm=gemm, target_blocks=64,
                            fuse_attention=False)  # the split sums alone: attention in its own kernel
        runs[mode] = device_logits(fwd, model, toks, 6)
        lins = [lin for layer in fwd._st.layers for lin in (*layer.weights.qkv, layer.weights.o)]
        assert max(lin.ksplit for lin in lins) > 1
        assert any(lin.cluster for lin in lins) == (mode == "1")
        plans = plans if mode == "1" else [lin.ksplit for lin in lins]
    assert [lin.ksplit for lin in lins] == plans  # small splits: clusters keep the plan
    assert np.array_equal(runs["1"], runs["0"])
    tagged = CupyOps(stream, gemm, cluster=False, merge="tagged")  # the decode graph's splits merged tagged
    assert np.array_equal(device_logits(DeviceForward(ops=tagged, target_blocks=64), model, toks, 6), runs["0"])
    _check(model, toks, 6, runs["1"])


@pytest.mark.parametrize("arch", list(SMALL_CONFIGS))
def test_greedy_tokens_are_the_cpus_for_16_steps(arch, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    model = synthetic_model(SMALL_CONFIGS[arch], "q8", seed=6)
    prompt = random_tokens(model.config, 12)
    tokens, _ = stepwise_greedy(DeviceForward(stream=stream, gemm=gemm), model, prompt, 15)
    seq = np.concatenate([prompt, tokens[:-1]])
    ref = cpu_logits(model, seq, len(prompt))
    _, jitter_max = jitter_effect(model, seq, len(prompt), ref)
    assert greedy_agrees(tokens, model, prompt, tol=FACTOR * jitter_max) == []
    cpu_greedy = ref[len(prompt) - 1:].argmax(1).tolist()
    print(f"{arch}: device greedy == cpu argmax on {sum(a == b for a, b in zip(tokens, cpu_greedy))}/16 steps")


def test_long_prefill_in_chunks_and_kv_growth(stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """A prompt longer than one prefill chunk (512 + a remainder), all logits; then decode steps that
    cross the first KV-capacity chunk (graph re-captured on the grown cache)."""
    model = synthetic_model(replace(SMALL_CONFIGS["llama"], num_layers=1), "q8", seed=7)
    n = CAP_CHUNK - 2
    toks = random_tokens(model.config, n + 5)
    fwd = DeviceForward(stream=stream, gemm=gemm)
    got = device_logits(fwd, model, toks, n)
    assert n > PREFILL_CHUNK
    _check(model, toks, n, got)
    assert fwd.counters["graph_captures"] == 2


def test_residency_window_gives_the_same_logits() -> None:
    """Weights through the CUDA device's cache: keep=1 evicts and re-uploads every step, no graph."""
    from kestrel_cuda.binding import open_device

    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q4", seed=8)
    toks = random_tokens(model.config, 16)
    dev = open_device({})
    try:
        plain = DeviceForward(dev.weight, None, stream=dev.stream, gemm=dev.gemm, pin=dev.cache.pin,
                              unpin=dev.cache.unpin)
        ref = device_logits(plain, model, toks, 8)
        plain.close()
    finally:
        dev.close()
    dev = open_device({"window": "1"})
    try:
        windowed = DeviceForward(dev.weight, dev.layer_boundary, stream=dev.stream, gemm=dev.gemm)
        got = device_logits(windowed, model, toks, 8)
        evictions = dev.cache.stats()["evictions"]
    finally:
        dev.close()
    assert np.array_equal(got, ref)
    assert evictions > 0 and not windowed.use_graph


def test_engine_recomputes_a_declined_step_on_the_cpu(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """End to end: the engine offers each step to the device forward; step 3 is declined, the host decoder
    catches up and runs it, and the device is later offered the tokens it missed."""
    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q8", seed=9)
    prompt = random_tokens(model.config, 10).tolist()
    (tmp_path / "fwdcuda.py").write_text(DECLINING_BACKEND.format(decline={3}, make="DeviceForward", greedy=None))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "fwdcuda.py"))
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        tokens = list(engine.generate(prompt, max_tokens=12, stop_at_eos=False))
        stats = engine.stats["offload"]["kestrel_forward"]
        calls = list(engine.backend.plugin.CALLS)
    assert stats["accepted"] == 11 and stats["declined"] == 1
    assert calls[:5] == [0, 10, 11, 11, 13]  # call 3 (position 11) declined: the device catches up from 11
    seq = np.concatenate([prompt, tokens[:-1]])
    ref = cpu_logits(model, seq, len(prompt))
    _, jitter_max = jitter_effect(model, seq, len(prompt), ref)
    assert greedy_agrees(tokens, model, np.asarray(prompt), tol=FACTOR * jitter_max) == []


@pytest.mark.skipif(os.environ.get("KESTREL_SKIP_CUDA_BACKEND") == "1", reason="asked to skip")
def test_cuda_backend_runs_the_whole_step_forward() -> None:
    """Through the real cuda backend (cuda-kernels' hookimpl): the engine's steps go to DeviceForward."""
    model = synthetic_model(SMALL_CONFIGS["llama"], "q8", seed=10)
    prompt = random_tokens(model.config, 9).tolist()
    with kestrel_core.load(model, backend="cuda") as engine:
        tokens = list(engine.generate(prompt, max_tokens=8, stop_at_eos=False))
        fwd = engine.stats["offload"].get("kestrel_forward_batch", {})
        pipe = engine.stats["offload"].get("kestrel_decode_greedy", {})
        counters = engine.stats["backend_stats"]
    assert fwd.get("accepted", 0) == 1 and pipe.get("accepted", 0) == 1, (fwd, pipe)  # prefill, then pipelined
    assert counters["forward_decode_tokens"] >= 7, counters
    seq = np.concatenate([prompt, tokens[:-1]])
    ref = cpu_logits(model, seq, len(prompt))
    _, jitter_max = jitter_effect(model, seq, len(prompt), ref)
    assert greedy_agrees(tokens, model, np.asarray(prompt), tol=FACTOR * jitter_max) == []


# -- pipelined greedy decode and lm_finish --------------------------------------


@pytest.mark.parametrize("quant", ("q8", "q4"))
@pytest.mark.parametrize("pdl", ("0", "1"))
def test_pipelined_greedy_yields_the_step_by_step_argmax(quant, pdl, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """lm_finish's argmax, fed back on the device with two steps in flight, gives the tokens of the host's
    argmax over the downloaded logits, step by step; a consumer that stops early leaves a rewindable cache."""
    model = synthetic_model(SMALL_CONFIGS["qwen3"], quant, seed=21)
    prompt = random_tokens(model.config, 9)
    fwd = DeviceForward(config=CudaConfig(pdl=pdl == "1"), stream=stream, gemm=gemm)
    expect, rows = stepwise_greedy(fwd, model, prompt, 16)
    first = expect[0]
    fwd.forward(model, 1, prompt, 0, False)  # rewind to the prompt
    assert [first] + list(fwd.greedy(model, 1, first, len(prompt), 16)) == expect
    fwd.forward(model, 1, prompt, 0, False)
    stream_ = fwd.greedy(model, 1, first, len(prompt), 16)
    taken = [next(stream_) for _ in range(5)]
    stream_.close()
    assert taken == expect[1:6]
    assert np.array_equal(fwd.forward(model, 1, np.array(taken[-1:]), len(prompt) + 5, False), rows[5])


def test_lm_finish_is_numpys_argmax(stream) -> None:  # type: ignore[no-untyped-def]
    """Ties go to the first index, a NaN counts as largest, an all -inf row picks index 0; meta advances (not
    past the limit, the KV capacity) and the token reaches host memory."""
    from kestrel_cuda.ops_cupy import CupyOps
    from kestrel_cuda.plan import FINISH_COLS, TOKEN_RING

    ops = CupyOps(stream)
    n = 5000
    rng = np.random.default_rng(4)
    base = rng.standard_normal(n).astype(np.float32)
    tie = base.copy()
    tie[4321] = tie[17] = 1e4  # equal maxima far apart: the first wins
    nan = base.copy()
    nan[[2500, 3000]] = np.nan
    cases = [base, tie, nan, np.full(n, -np.inf, np.float32), np.zeros(n, np.float32)]
    nb = -(-n // FINISH_COLS)
    scratch = (ops.zeros(nb, np.float32), ops.zeros(nb, np.int32), ops.zeros(1, np.int32))
    tokens = ops.mapped_ints(TOKEN_RING)
    for pos, row in enumerate(cases, start=70):
        meta = ops.upload(np.array([pos, -1], np.int32))
        ops.greedy_token(ops.upload(row[None]), scratch, meta, 1000, tokens)
        ops.synchronize()
        with np.errstate(invalid="ignore"):
            tok = int(np.argmax(row))
        assert meta.get().tolist() == [pos + 1, tok] and int(tokens[pos % TOKEN_RING]) == tok
        assert int(scratch[2].get()[0]) == 0  # the counter is back to zero for the next launch
    meta = ops.upload(np.array([999, -1], np.int32))  # at the limit: the position stays
    ops.greedy_token(ops.upload(base[None]), scratch, meta, 1000, tokens)
    ops.synchronize()
    assert meta.get().tolist() == [999, int(np.argmax(base))]


@pytest.mark.parametrize(("m", "d"), [(1, 3840), (1, 4100), (3, 8200), (2, 96)])
def test_norm_add_rows_matches_the_mirror(m, d, stream) -> None:  # type: ignore[no-untyped-def]
    """Gemma's post-norm y += rmsnorm(x, w): one pass of loads a thread (3840), a second pass, partly filled
    (4100: a warp with 4 columns in it), rows of several passes, a row narrower than the block; at M = 1 the
    tile sums of y as well."""
    from kestrel_cuda.ops_cupy import CupyOps
    from kestrel_cuda.ops_numpy import NumpyOps
    from kestrel_cuda.plan import ssq_count

    rng = np.random.default_rng(d)
    x, y = (rng.standard_normal((m, d)).astype(np.float32) * 3 for _ in range(2))
    w = rng.standard_normal(d).astype(np.float32)
    ops = CupyOps(stream)
    dy, ssq = ops.upload(y), ops.zeros(ssq_count(d), np.float32)
    ops.norm_add(ops.upload(x), ops.upload(w), 1e-6, dy, ssq_out=ssq if m == 1 else None)
    ops.synchronize()
    want, want_ssq = y.copy(), np.zeros(ssq_count(d), np.float32)
    NumpyOps().norm_add(x, w, 1e-6, want, ssq_out=want_ssq if m == 1 else None)
    np.testing.assert_allclose(dy.get(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ssq.get(), want_ssq, rtol=1e-5)


@pytest.mark.parametrize("quant", ("q8", "q4", "q4-g256"))
@pytest.mark.parametrize("arch", ("qwen3", "qwen2-hd128"))
def test_fused_rope_epilogue_equals_the_qkv_rope_kernel_bitwise(arch, quant, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """head_dim 128: the q|k|v GEMV's epilogue (clusters at q4, the L2 merge at q8) runs rope_head on the
    head it merged, the same function as qkv_rope: bit-identical logits, with q/k norms or with a bias."""
    cfg = SMALL_CONFIGS["qwen3"] if arch == "qwen3" else replace(SMALL_CONFIGS["qwen2"], head_dim=128)
    model = synthetic_model(replace(cfg, hidden_size=1024), quant, seed=25)
    toks = random_tokens(model.config, 12)
    runs = {}
    for mode in ("1", "0"):  # attention in its own kernel both ways (the fold needs the fused epilogue)
        fwd = DeviceForward(stream=stream, gemm=gemm, fuse_rope=mode == "1", fuse_attention=False)
        runs[mode] = device_logits(fwd, model, toks, 6)
        assert fwd.stepper.fuse_rope == (mode == "1")
    assert np.array_equal(runs["1"], runs["0"])
    _check(model, toks, 6, runs["1"])


@pytest.mark.parametrize("quant", ("q8", "q4", "q4-g256"))
@pytest.mark.parametrize("window", [None, 12])
def test_attention_folded_into_qkv_matches_attn_decode_and_the_cpu(quant, window, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """head_dim 128, the q|k|v GEMV's K splits as clusters (hidden 1024): decode attention in its clusters
    (attend.cuh; a sliding window's last positions too) matches the CPU as attn_decode does (their outputs
    differ by float32 rounding, which the next GEMV's int8 input codes may turn into a code's step), with the
    same logits from graph replays and eager steps, and runs no attention kernel."""
    from kestrel_cuda.ops_cupy import CupyOps

    model = synthetic_model(replace(SMALL_CONFIGS["qwen3"], hidden_size=1024, sliding_window=window), quant, seed=32)
    toks = random_tokens(model.config, 40)
    runs = {}
    for fold in (True, False):
        fwd = DeviceForward(stream=stream, gemm=gemm, fuse_attention=fold)
        runs[fold] = device_logits(fwd, model, toks, 8)
        assert fwd.projections.layer(model, 0).qkv[0].cluster
    _check(model, toks, 8, runs[True])
    _check(model, toks, 8, runs[False])
    seen: list[str] = []

    def observe(name: str, launch) -> None:  # type: ignore[no-untyped-def]
        seen.append(name)
        launch()

    eager = DeviceForward(ops=CupyOps(stream, gemm, on_launch=observe), config=CudaConfig(graph=False))
    np.testing.assert_array_equal(device_logits(eager, model, toks, 8), runs[True])
    assert "attn_decode" not in seen and "attn_prefill" in seen


def test_pipelined_greedy_across_a_kv_growth(stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """The pipeline crossing the KV capacity (drain, grow, re-capture, position and token from the host) gives
    the step-by-step argmax tokens."""
    model = synthetic_model(SMALL_CONFIGS["qwen3"], "q4", seed=27)
    prompt = random_tokens(model.config, CAP_CHUNK - 3)
    expect, _ = stepwise_greedy(DeviceForward(stream=stream, gemm=gemm), model, prompt, 8)
    first = expect[0]
    fwd = DeviceForward(stream=stream, gemm=gemm)
    fwd.forward(model, 1, prompt, 0, False)
    tokens = fwd.greedy(model, 1, first, len(prompt), 1000)
    assert [first] + [next(tokens) for _ in range(8)] == expect
    assert fwd._seqs[1].capacity == 2 * CAP_CHUNK and fwd.counters["graph_captures"] == 2


def test_on_launch_sees_every_kernel_and_changes_nothing(stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """CupyOps' on_launch is called instead of each launch, tiled GEMM included, with the kernel's name; the
    launches it runs give the same logits as without it."""
    from kestrel_cuda.ops_cupy import CupyOps

    model = synthetic_model(SMALL_CONFIGS["qwen2"], "q8", seed=28)
    toks = random_tokens(model.config, 20)
    seen: list[str] = []

    def observe(name: str, launch) -> None:  # type: ignore[no-untyped-def]
        seen.append(name)
        launch()

    ops = CupyOps(stream, gemm, on_launch=observe)
    got = device_logits(DeviceForward(ops=ops, config=CudaConfig(graph=False)), model, toks, 16)
    ref = device_logits(DeviceForward(config=CudaConfig(graph=False), stream=stream, gemm=gemm), model, toks, 16)
    assert np.array_equal(got, ref)
    assert len(seen) == ops.launches
    assert {"embed_rows", "quantize_rows", "gemm_q8 (tiled)", "add_rows", "qgemv", "qkv_rope", "attn_prefill",
            "attn_decode", "lm_finish"} == set(seen)
