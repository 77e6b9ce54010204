"""Single kernels of the device forward on the GPU against exact references or their numpy mirrors: the M = 1
GEMV at every K split (counter, tagged and cluster merges), the tagged merge across interleaved launches and graph
replays, and Gemma's post-norm add.


Skipped where CuPy or a CUDA device is missing (CI); run on the H200 machine.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

from .forward_check import cuda_device_count  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


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
