"""The mixture-of-experts kernels on the GPU against their numpy mirrors: moe_route and the chosen experts' GEMVs,
the router folded into the o projection, the grouped expert GEMM, and moe_group against plan.expert_groups.


Skipped where CuPy or a CUDA device is missing (CI); run on the H200 machine.
"""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from .forward_check import cuda_device_count  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


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
