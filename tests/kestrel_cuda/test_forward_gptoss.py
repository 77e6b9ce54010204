"""gpt-oss's pieces on the GPU against their numpy mirrors (ops_numpy, checked against the CPU decoder by
test_forward_models_host): each head's sink logit in the attention kernels (attn_decode, attn_prefill, attn_rows),
the router's bias in moe_route, the experts' biases and the clamped SwiGLU in the routed GEMVs (qgemv's
FOLD_EXPERTS instances) and in quantize_rows' OAI instances, moe_bias after the grouped GEMMs; and tiny-gpt-oss's
whole-step forward against the CPU decoder. The small config's gpt_oss runs through test_forward.py's parametrized
tests, its batched steps (and tiny-gpt-oss's) through test_forward_batch.py's.

Skipped where CuPy or a CUDA device is missing (CI); run on the H200 machine.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from kestrel_core.model.host_ops import swiglu_oai_mul  # noqa: E402
from kestrel_core.model.loader import load_model  # noqa: E402
from kestrel_cuda.forward import DeviceForward  # noqa: E402
from kestrel_cuda.ops_cupy import CupyOps  # noqa: E402
from kestrel_cuda.ops_numpy import NumpyOps  # noqa: E402
from kestrel_cuda.plan import KV_DTYPE, attn_part_size  # noqa: E402

from .forward_check import FIXTURES, cuda_device_count, device_logits, paged_rows, random_tokens, stepwise_greedy  # noqa: E402
from .test_forward import _check  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]

LIMIT, ALPHA = 1.5, 1.702  # a clamp the unit-variance activations below cross


@pytest.fixture(scope="module")
def stream():  # type: ignore[no-untyped-def]
    return cp.cuda.Stream(non_blocking=True)


@pytest.fixture(scope="module")
def gemm(stream):  # type: ignore[no-untyped-def]
    from kestrel_cuda.gemm import DeviceGemm
    from kestrel_cuda.kernels import compile_kernels

    g = DeviceGemm(cp, compile_kernels(cp), cp.cuda.Device().attributes["MultiProcessorCount"])
    g.workspace(stream)
    return g


def _sinks(heads: int, rng: np.random.Generator) -> np.ndarray:
    """Sink logits from far below the scores (no effect) to far above them (most of each softmax's mass)."""
    return np.array([-30.0, 0.0, 4.0, 12.0] * (heads // 4), np.float32) + rng.uniform(-0.5, 0.5, heads).astype(
        np.float32)


@pytest.mark.parametrize("hd", [16, 64, 128, 256])
@pytest.mark.parametrize(("m", "window"), [(1, 0), (1, 12), (20, 0), (20, 8)])
def test_attn_decode_and_attn_prefill_take_the_sinks_as_the_mirror(hd, m, window, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """One sequence's rows (a decode row: attn_decode; 20 rows: attn_prefill) at positions 60.., with and without
    a sliding window: the mirror's softmax with each head's sink within float32 rounding, far from the one
    without."""
    rng = np.random.default_rng([hd, m, window])
    heads, kv, cap = 8, 2, 128
    kc = rng.standard_normal((kv, cap, hd)).astype(KV_DTYPE)
    vc = rng.standard_normal((kv, cap, hd)).astype(KV_DTYPE)
    q = (3 * rng.standard_normal((m, heads * hd))).astype(np.float32)
    scale = float(np.float32(hd ** -0.5))
    meta = np.array([60], np.int32)
    sinks = _sinks(heads, rng)
    want, loose = np.zeros_like(q), np.zeros_like(q)
    NumpyOps().attention(q, kc, vc, heads, hd, scale, meta, want, window=window, sinks=sinks)
    NumpyOps().attention(q, kc, vc, heads, hd, scale, meta, loose, window=window)
    ops = CupyOps(stream, gemm)
    ops.reserve(0, 0, attn_part_size(heads, hd), heads)  # attn_decode's split records and counters
    out = cp.full(q.shape, np.nan, np.float32)
    ops.attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), heads, hd, scale, cp.asarray(meta), out,
                  window=window, sinks=cp.asarray(sinks))
    ops.synchronize()
    np.testing.assert_allclose(out.get(), want, rtol=1e-4, atol=1e-5)
    assert np.abs(loose - want).max() > 0.05  # the sinks matter here


@pytest.mark.parametrize("hd", [16, 64, 128, 256])
@pytest.mark.parametrize(("window", "splits"), [(0, 1), (0, 3), (40, 1), (40, 5)])
def test_attn_rows_takes_the_sinks_as_the_mirror(hd, window, splits, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """A batch's rows over the paged pool (scattered pages, rows ending inside and at the end of a page), in one
    block a row and KV head or split over positions (the sink counted once, in split 0; a split may see no
    position): the mirror's softmax with each head's sink within the tensor-core path's rounding."""
    rng = np.random.default_rng([hd, window, splits])
    heads = 8
    q, kc, vc, rows, tables, scale = paged_rows(rng, hd, heads)
    sinks = _sinks(heads, rng)
    want, loose = np.zeros_like(q), np.zeros_like(q)
    NumpyOps().attention(q, kc, vc, heads, hd, scale, None, want, rows, tables, window=window, sinks=sinks)
    NumpyOps().attention(q, kc, vc, heads, hd, scale, None, loose, rows, tables, window=window)
    ops = CupyOps(stream, gemm)
    plan = ops.attn_rows_plan
    ops.attn_rows_plan = lambda *a: (*plan(*a)[:3], splits)  # type: ignore[method-assign]  # any split is right
    out = cp.full(q.shape, np.nan, np.float32)
    ops.attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), heads, hd, scale, None, out, cp.asarray(rows),
                  cp.asarray(tables), window=window, sinks=cp.asarray(sinks))
    ops.synchronize()
    np.testing.assert_allclose(out.get(), want, rtol=1e-4, atol=1e-5)
    assert np.abs(loose - want).max() > 0.05


@pytest.mark.parametrize("m", [1, 6])
def test_moe_route_adds_the_router_bias(m, stream) -> None:  # type: ignore[no-untyped-def]
    """moe_route with a router bias larger than the logits (M = 1 from the residual's tile sums, and a step of
    several rows) against the mirror: the same experts, weights within float32 summation order; without the bias
    the choice differs."""
    from kestrel_cuda.ops_numpy import _row_ssq

    ops, ref = CupyOps(stream), NumpyOps()
    rng = np.random.default_rng(m)
    experts, k, d = 32, 4, 2880
    h = rng.standard_normal((m, d)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    router = (rng.standard_normal((experts, d)) / np.sqrt(d)).astype(np.float32)
    bias = (3 * rng.standard_normal(experts)).astype(np.float32)
    ssq = _row_ssq(h[0]) if m == 1 else None
    outs = []
    for o, b in ((ops, bias), (ref, bias), (ref, None)):
        sel, wts, xn = o.zeros((m, k), np.int32), o.zeros((m, k + 1), np.float32), o.zeros((m, d), np.float32)
        scratch = (o.zeros((m, experts + 1), np.float32), o.zeros(m, np.int32))
        o.moe_route(o.upload(h), o.upload(norm), 1e-5, o.upload(router), experts, k, True, xn, scratch, sel, wts,
                    ssq_in=None if ssq is None else o.upload(ssq), bias=None if b is None else o.upload(b))
        o.synchronize()
        outs.append((cp.asnumpy(sel), cp.asnumpy(wts)) if o is ops else (sel, wts))
    (sel, wts), (rsel, rwts), (plain, _) = outs
    assert np.array_equal(sel, rsel) and not np.array_equal(plain, rsel)
    np.testing.assert_allclose(wts[:, :k], rwts[:, :k], rtol=2e-5)


@pytest.mark.parametrize(("bits", "group"), ((8, 32), (4, 32), (8, 256), (4, 256)))
@pytest.mark.parametrize("clusters", (False, True))
def test_routed_gemvs_add_their_experts_biases_and_the_clamped_swiglu(bits, group, clusters, stream) -> None:  # type: ignore[no-untyped-def]
    """A decode step's routed gate|up (its experts' bias rows added) and down (the clamped SwiGLU of gate|up as
    its prologue, then its experts' bias rows) on qgemv's FOLD_EXPERTS instances, K split through the counters
    and as clusters, against the mirror: gate|up within float32 summation order, down within one activation code
    a group (expf's last bits are not numpy's); without the biases, or with plain SiLU, far from it."""
    from kestrel_cuda.layout import pack_kmajor, pad_n
    from kestrel_cuda.plan import EPI_STORE, PRO_PLAIN, PRO_SILU_MUL, PRO_SWIGLU_OAI, Lin, plan_routed

    ops, ref = CupyOps(stream), NumpyOps()
    rng = np.random.default_rng([bits, group, clusters])
    experts, k, d, f = 8, 4, 1024, 512
    lo, hi = (-127, 128) if bits == 8 else (-8, 8)

    def weights(n: int, kk: int) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for _ in range(experts):
            codes = rng.integers(lo, hi, size=(n, kk)).astype(np.int8)
            sc = np.zeros((kk // group, pad_n(n)), np.float32)
            sc[:, :n] = (rng.uniform(0.5, 1.5, size=(n, kk // group)) / (np.abs(codes).mean() * np.sqrt(kk))).T
            out.append((pack_kmajor(codes, bits), sc))
        return out

    gate_up, down = weights(2 * f, d), weights(d, f)
    gu_bias = rng.standard_normal((experts, 2 * f)).astype(np.float32)
    down_bias = rng.standard_normal((experts, d)).astype(np.float32)
    x = rng.standard_normal((1, d)).astype(np.float32)
    chosen = np.sort(rng.choice(experts, k, replace=False)).astype(np.int32)
    runs = {}
    for o in (ops, ref):
        lins = [[Lin(o.upload(c), o.upload(sc), kk, n, pad_n(n), group, bits) for c, sc in w]
                for w, kk, n in ((gate_up, d, 2 * f), (down, f, d))]
        for lin in lins[0] + lins[1]:
            lin.ksplit = plan_routed(lin, k, ops.sm_count, clusters and ops.cluster)
        if o is ops:
            o.reserve(max(lin.ksplit * k * lin.npad for lin in (lins[0][0], lins[1][0])),
                      max(lin.tiles * k for lin in (lins[0][0], lins[1][0])), 1, 1)
        tables, sel = [o.expert_table(ls) for ls in lins], o.upload(chosen)
        out = []
        for pro, gb, db in ((PRO_SWIGLU_OAI, gu_bias, down_bias), (PRO_SWIGLU_OAI, None, None),
                            (PRO_SILU_MUL, gu_bias, down_bias)):
            gu, y = o.zeros((k, 2 * f), np.float32), o.zeros((k, d), np.float32)
            o.gemv(lins[0][0], o.upload(x), PRO_PLAIN, None, 0.0, 0, gu, EPI_STORE,
                   None if gb is None else o.upload(gb), experts=(tables[0], sel, k))
            o.gemv(lins[1][0], gu, pro, None, 0.0, f, y, EPI_STORE, None if db is None else o.upload(db),
                   experts=(tables[1], sel, k), sel_ready=True, swiglu=(LIMIT, ALPHA))
            o.synchronize()
            out.append((cp.asnumpy(gu), cp.asnumpy(y)) if o is ops else (gu.copy(), y.copy()))
        runs[o] = out
    for (gu, y), (rgu, ry) in zip(runs[ops], runs[ref]):
        np.testing.assert_allclose(gu, rgu, rtol=1e-4, atol=1e-5 * np.abs(rgu).max())
        np.testing.assert_allclose(y, ry, rtol=1e-3, atol=2e-3 * np.abs(ry).max())
    (rgu, ry), (_, no_bias), (_, silu) = runs[ref]
    assert np.abs(rgu[:, :f]).max() > LIMIT and np.abs(rgu[:, f:]).max() > LIMIT  # the clamp bites
    assert np.abs(no_bias - ry).max() > 0.1 * np.abs(ry).max() and np.abs(silu - ry).max() > 0.1 * np.abs(ry).max()


@pytest.mark.parametrize("g", [32, 256])
def test_quantize_rows_clamped_swiglu(g, stream) -> None:  # type: ignore[no-untyped-def]
    """quantize_rows' OAI instance, prologue 5 (a grouped down GEMM's input): gpt-oss's clamped SwiGLU of gate and
    up, as host_ops computes it, within one code (the device's expf is not numpy's), gate and up crossing the
    clamp."""
    from kestrel_core.contract import quantize_activations
    from kestrel_cuda.plan import PRO_SWIGLU_OAI

    ops = CupyOps(stream)
    rng = np.random.default_rng(g)
    m, k = 5, 2880 // g * g
    x = (3 * rng.standard_normal((m, 2 * k))).astype(np.float32)
    codes, scales = cp.full((m, k), 99, cp.int8), cp.full((m, k // g), np.nan, cp.float32)
    ops._quantize_rows(ops.upload(x), m, k, g, PRO_SWIGLU_OAI, None, 0.0, k, codes, scales, (LIMIT, ALPHA))
    ops.synchronize()
    act = swiglu_oai_mul(x[:, :k].copy(), x[:, k:], np.float32(LIMIT), np.float32(ALPHA))
    want_codes, want_scales = quantize_activations(act.astype(np.float64), g)
    np.testing.assert_allclose(scales.get(), want_scales, rtol=1e-6)
    diff = np.abs(codes.get().astype(np.int16) - want_codes)
    assert diff.max() <= 1 and np.count_nonzero(diff) <= codes.size // 1000


def test_moe_bias_adds_each_groups_experts_row(stream) -> None:  # type: ignore[no-untyped-def]
    """moe_bias over a grouped GEMM's output (a column slice of a wider buffer, groups of several rows, blocks
    past the groups with count 0): the mirror's sums bit for bit, the rows no group names untouched."""
    ops, ref = CupyOps(stream), NumpyOps()
    rng = np.random.default_rng(7)
    groups = np.array([[3, 0, 5], [0, 5, 16], [3, 21, 2], [7, 23, 1], [0, 0, 0], [0, 0, 0]], np.int32)
    y = rng.standard_normal((30, 700)).astype(np.float32)
    bias = rng.standard_normal((8, 300)).astype(np.float32)
    want = y.copy()
    ref.expert_bias(want[:, 100:400], groups, bias)
    got = ops.upload(y)
    ops.expert_bias(got[:, 100:400], ops.upload(groups), ops.upload(bias))
    ops.synchronize()
    assert np.array_equal(got.get(), want) and not np.array_equal(want, y) and np.array_equal(want[24:], y[24:])


def test_gpt_oss_checkpoint_matches_the_cpu(stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """tiny-gpt-oss: a 13-token prefill past its window of 8 (the grouped expert GEMMs, attn_prefill's sinks) and
    captured decode steps to 24 (the routed GEMVs, attn_decode's sinks) within the band; the pipelined greedy
    decode gives the step-by-step tokens."""
    model = load_model(str(FIXTURES / "tiny-gpt-oss"), "q8", cache="off").model
    toks = random_tokens(model.config, 24)
    fwd = DeviceForward(stream=stream, gemm=gemm)
    _check(model, toks, 13, device_logits(fwd, model, toks, 13))
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["graph_replays"] == 11
    prompt = random_tokens(model.config, 7)
    expect, _ = stepwise_greedy(DeviceForward(stream=stream, gemm=gemm), model, prompt, 8)
    fwd.forward(model, 1, prompt, 0, False)
    assert [expect[0]] + list(fwd.greedy(model, 1, expect[0], len(prompt), 8)) == expect
