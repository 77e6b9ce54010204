"""Batched steps over the paged pool on the GPU: test_forward_batch_host.py's scenarios through CupyOps (the
kernels of rope.cu and attention.cu with page tables, the GEMVs and the tiled GEMM at M rows), and the real
CUDA backend serving concurrent requests. Skipped where CuPy or a CUDA device is missing (CI)."""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from kestrel_cuda.forward import DeviceForward  # noqa: E402

from .forward_check import FACTOR, SMALL_CONFIGS, cpu_logits, cuda_device_count, greedy_agrees, jitter_effect  # noqa: E402,E501
from .test_forward_batch_host import (  # noqa: E402, F401  (collected here with this module's make_fwd)
    Pages,
    _model,
    _prompts,
    host,
    serve_all,
    test_a_mixed_batch_gets_ids_where_they_do_and_logits_where_they_are_needed,
    test_a_mixed_batch_over_two_passes,
    test_a_sequence_moves_between_its_own_cache_and_the_pool,
    test_argmax_only_steps_return_the_greedy_tokens_of_the_same_logits,
    test_declines_what_the_pool_cannot_run,
    test_eager_and_captured_batches_agree_bitwise,
    test_every_batched_row_is_the_cpu_decoders_within_the_band,
    test_fed_rows_on_both_sides_of_a_pass_boundary,
    test_mixed_batch_of_decode_rows_and_prompt_chunks,
    test_padding_rows_of_a_bucket_touch_no_sequence,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


@pytest.fixture
def make_fwd(stream, gemm):  # type: ignore[no-untyped-def]
    """DeviceForward(**kwargs) on the GPU, rows above 8 through the tiled GEMM."""
    return lambda **kw: DeviceForward(stream=stream, gemm=gemm, **kw)


@pytest.mark.parametrize("quant", ["q8", "q4", "tiny-qwen2-moe"])
def test_the_cuda_backend_serves_concurrent_requests_in_batches(quant: str) -> None:
    """Four greedy requests through the scheduler on the real backend: its batched hook takes the steps, and
    every request's tokens are the CPU's choice at each step (or tie with it within the nudge's range); a
    mixture of experts (routed and shared experts) too."""
    from pathlib import Path

    import kestrel_core
    from kestrel_core.model.loader import load_model
    from kestrel_core.model.presets import synthetic_model
    from kestrel_core.model.sampling import SamplingParams

    if quant.startswith("tiny-"):
        model = load_model(str(Path(__file__).resolve().parents[1] / "fixtures" / "models" / quant), "q8",
                           cache="off").model
    else:
        model = synthetic_model(SMALL_CONFIGS["qwen3"], quant, seed=9)
    prompts = [p.tolist() for p in _prompts(model, (4, 70, 11, 33), seed=6)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with kestrel_core.load(model, backend="cuda") as engine:
        got = serve_all(engine, prompts, params)
        offload = engine.stats["offload"]
    assert offload["kestrel_forward_batch"]["accepted"] >= 8
    for p, tokens in zip(prompts, got):
        seq = np.array(p + tokens)
        ref = cpu_logits(model, seq, len(seq))
        tol = FACTOR * jitter_effect(model, seq, len(seq), ref)[1]
        assert greedy_agrees(tokens, model, np.array(p), tol) == [], (p, tokens)


@pytest.mark.parametrize("heads,kv_heads,hd,copies,scale_q", [
    (32, 8, 128, 1, 1.0), (32, 8, 128, 22, 1.0), (24, 2, 64, 1, 1.0), (48, 2, 64, 1, 1.0), (4, 4, 32, 1, 1.0),
    (8, 4, 256, 1, 1.0), (16, 8, 256, 8, 1.0), (8, 2, 96, 1, 1.0), (8, 2, 36, 1, 1.0), (4, 2, 16, 1, 1.0),
    (32, 8, 128, 1, 2e5)])
def test_attn_rows_is_the_mirrors_attention(heads: int, kv_heads: int, hd: int, copies: int, scale_q: float,
                                            stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """attn_rows over a paged pool of float16 keys and values (pages scattered, lengths ending inside and at the
    end of a page, one row a page long; groups of 1 to 24 query heads, 12 and 24 over two and three blocks;
    head_dims that fill their instance and ones padded into it, 36 with 8-byte copies; split over positions,
    with empty splits, and with enough rows for none; queries past float16's range) against the numpy mirror's
    softmax, within float32 rounding: the float16 tensor-core products carry the query and the probabilities as
    two terms each. Asked to quantize for the o projection (G = 32) where a head holds whole groups, it writes
    the codes and scales the contract makes of its output, bit for bit, where the tiled GEMM reads them."""
    from kestrel_core.contract import quantize_activations
    from kestrel_cuda.ops_cupy import CupyOps
    from kestrel_cuda.ops_numpy import NumpyOps
    from kestrel_cuda.plan import KV_BLOCK, KV_DTYPE, Lin

    rng = np.random.default_rng([heads, kv_heads, hd])
    blocks, width = 40, 8
    positions = [0, 31, 32, 100, 255, 17] * copies  # each row sees keys 0..position
    ops = CupyOps(stream, gemm)
    splits = ops.attn_rows_plan(len(positions), heads, kv_heads, hd)[3]
    assert (splits == 1) == (copies > 1)
    tables = np.stack([rng.permutation(blocks)[:width] for _ in positions]).astype(np.int32)
    tables = np.concatenate([tables, np.zeros((1, width), np.int32)])  # the padding rows' table
    rows = np.array([[p, i] for i, p in enumerate(positions)], np.int32)
    kc = rng.standard_normal((kv_heads, (blocks + 1) * KV_BLOCK, hd)).astype(KV_DTYPE)
    vc = rng.standard_normal(kc.shape).astype(KV_DTYPE)
    q = (rng.standard_normal((len(positions), heads * hd)) * scale_q).astype(np.float32)
    scale = float(np.float32(hd ** -0.5))
    want = np.zeros_like(q)
    NumpyOps().attention(q, kc, vc, heads, hd, scale, np.zeros(1, np.int32), want, rows, tables)
    o_proj = Lin(None, None, heads * hd, 64, 128, 32, 8)
    codes, scales = ops.gemm_input(len(positions), o_proj.k, 32)
    with stream:
        out = cp.full(q.shape, np.nan, np.float32)
        codes.fill(99)
        quantized = ops.attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), heads, hd, scale,
                                  cp.zeros(1, np.int32), out, cp.asarray(rows), cp.asarray(tables),
                                  quantize_for=o_proj)
        got = cp.asnumpy(out)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert quantized == (hd % 32 == 0)
    if quantized:  # float64 input: the contract's defining path (test_cuda_kernels.test_quantize_bit_identical)
        want_codes, want_scales = quantize_activations(got.astype(np.float64), 32)
        np.testing.assert_array_equal(cp.asnumpy(codes), want_codes)
        np.testing.assert_array_equal(cp.asnumpy(scales), want_scales)
    else:
        assert bool((codes == 99).all())


def test_a_captured_step_outlives_the_scratch_a_larger_step_outgrows(stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """A captured step of 4 rows through the tiled GEMM holds its scratch's addresses; an eager step of 64 rows
    then needs more scratch. Replayed after it, the graph still gives the eager result and writes nothing that
    arrays allocated since then hold (an outgrown scratch freed to CuPy's pool would be handed to them)."""
    from kestrel_cuda.layout import pack_kmajor, pad_n
    from kestrel_cuda.ops_cupy import CupyOps
    from kestrel_cuda.plan import EPI_STORE, PRO_PLAIN, Lin

    ops = CupyOps(stream, gemm)
    rng = np.random.default_rng(3)
    k, n = 512, 256
    codes = rng.integers(-127, 128, size=(n, k)).astype(np.int8)
    sc = np.zeros((k // 32, pad_n(n)), np.float32)
    sc[:, :n] = rng.uniform(0.001, 0.02, size=(n, k // 32)).T
    lin = Lin(ops.upload(pack_kmajor(codes, 8)), ops.upload(sc), k, n, pad_n(n), 32, 8)
    x4, x64 = (ops.upload(rng.standard_normal((m, k)).astype(np.float32)) for m in (4, 64))
    y4, y64 = ops.zeros((4, n), np.float32), ops.zeros((64, n), np.float32)
    ops.gemv(lin, x4, PRO_PLAIN, None, 0.0, 0, y4, EPI_STORE, None)  # eagerly first: the scratch for 4 rows
    ops.synchronize()
    expect = cp.asnumpy(y4)
    replay = ops.capture(lambda: ops.gemv(lin, x4, PRO_PLAIN, None, 0.0, 0, y4, EPI_STORE, None))
    ops.gemv(lin, x64, PRO_PLAIN, None, 0.0, 0, y64, EPI_STORE, None)  # grows the scratch
    ops.synchronize()
    with stream:  # arrays of the 4-row scratch's sizes on its stream, where the pool would put them if it were free
        held = [cp.full(4 * k, 7, np.int8), cp.full(4 * (k // 32), 7.0, np.float32)]
        y4.fill(0)
    replay()
    ops.synchronize()
    assert np.array_equal(cp.asnumpy(y4), expect)
    assert all(bool((h == 7).all()) for h in held)


def test_captured_steps_outlive_the_attention_scratch_a_larger_batch_outgrows(make_fwd, stream) -> None:  # type: ignore[no-untyped-def]
    """A sequence's decode graph and a 2-row batch's graph hold the attention scratch's addresses; a batch of 8
    then grows that scratch. Replayed after it, with arrays of the old scratch's sizes allocated meanwhile (where
    CuPy's pool would put a freed scratch), both give what a forward that never ran the batch gives."""
    model = _model("llama")
    rng = np.random.default_rng(1)
    prompt, tail = rng.integers(0, model.config.vocab_size, 20), rng.integers(0, model.config.vocab_size, 8)
    pair, others = _prompts(model, (9, 10), seed=2), _prompts(model, range(11, 19), seed=3)

    def run(grow: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        fwd, pages = make_fwd(), Pages()
        lone = [host(fwd.forward(model, 100, prompt, 0, False))]
        lone += [host(fwd.forward(model, 100, np.array([t]), 20 + i, False)) for i, t in enumerate(tail[:2])]
        batch = [host(fwd.forward_batch(model, [pages.entry(i, p, 0, 1) for i, p in enumerate(pair)]))]
        batch += [host(fwd.forward_batch(model, [pages.entry(i, [7], len(p) + j, 1) for i, p in enumerate(pair)]))
                  for j in range(2)]
        held = []
        if grow:
            old = [(a.size, a.dtype) for a in (fwd.ops.attn_part, fwd.ops.attn_counters)]
            fwd.forward_batch(model, [pages.entry(10 + i, p, 0, 1) for i, p in enumerate(others)])
            fwd.forward_batch(model, [pages.entry(10 + i, [5], len(p), 1) for i, p in enumerate(others)])
            assert fwd.ops.attn_part.size > old[0][0]
            with stream:
                held = [cp.full(size, 3, dtype) for size, dtype in old for _ in range(4)]
        lone += [host(fwd.forward(model, 100, np.array([t]), 22 + i, False)) for i, t in enumerate(tail[2:])]
        batch += [host(fwd.forward_batch(model, [pages.entry(i, [7], len(p) + j, 1) for i, p in enumerate(pair)]))
                  for j in range(2, 5)]
        stream.synchronize()
        assert all(bool((h == 3).all()) for h in held)
        return lone, batch

    (lone, batch), (want_lone, want_batch) = run(True), run(False)
    for got, want in zip(lone + batch, want_lone + want_batch):
        np.testing.assert_array_equal(got, want)


def test_the_norm_fold_in_steps_of_the_tensor_copy_gemm(stream) -> None:  # type: ignore[no-untyped-def]
    """Passes of 17..64 rows with clusters on (sm_90: every GEMM the tensor-copy block): the residual adds
    quantize their rows for the normed GEMMs after them (the norm fold, every layer's o and all but the last
    one's down), and every row is still the CPU decoder's within the band."""
    from kestrel_cuda.gemm import DeviceGemm
    from kestrel_cuda.kernels import compile_kernels

    from .test_forward_batch_host import Pages, _assert_like_cpu, _model

    gemm = DeviceGemm(cp, compile_kernels(cp), cp.cuda.Device().attributes["MultiProcessorCount"], clusters=True)
    if not gemm.tensor_copies:
        pytest.skip("tensor copies need sm_90 with clusters")
    gemm.workspace(stream)
    fwd = DeviceForward(stream=stream, gemm=gemm)
    folds, gemv = [], fwd.ops.gemv

    def counted(*args, **kw):  # type: ignore[no-untyped-def]
        folds.append(kw.get("fold_norm") is not None)
        return gemv(*args, **kw)

    fwd.ops.gemv = counted
    model = _model("qwen3")
    prompts = _prompts(model, (9, 14, 30))
    pages = Pages()
    rows = [[o] for o in fwd.forward_batch(model, [pages.entry(i, p, 0, 1) for i, p in enumerate(prompts[:2])])]
    layers = model.config.num_layers
    assert sum(folds) == 2 * layers - 1  # 23 rows
    del folds[:]
    outs = fwd.forward_batch(model, [pages.entry(2, prompts[2], 0, 1)] + [  # 30 + 2 rows
        pages.entry(i, np.array([int(np.argmax(r[-1]))]), len(prompts[i]), 1) for i, r in enumerate(rows)])
    assert sum(folds) == 2 * layers - 1
    for i in range(2):
        rows[i].append(outs[1 + i])
        seq = np.concatenate([prompts[i], [int(np.argmax(rows[i][0][-1]))]])
        _assert_like_cpu(model, seq, np.concatenate(rows[i]))
    _assert_like_cpu(model, prompts[2], outs[0])
