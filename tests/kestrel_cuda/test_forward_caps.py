"""Gemma 2's soft caps and Granite's multipliers on the GPU: the attention kernels' capped scores (attn_decode,
attn_prefill, attn_rows) and finish_logits against their numpy mirrors, and the checkpoints' whole-step forward
(a prefill past Gemma 2's window, captured decode steps, the pipelined greedy decode) against the CPU decoder.
The small configs' gemma2 and granite (caps and multipliers that each move every logit: test_forward_models_host)
run through test_forward.py's parametrized tests, and their batched steps through test_forward_batch.py's.

Skipped where CuPy or a CUDA device is missing (CI); run on the H200 machine.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from kestrel_core.model.loader import load_model  # noqa: E402
from kestrel_core.model.presets import synthetic_model  # noqa: E402
from kestrel_cuda.forward import DeviceForward  # noqa: E402
from kestrel_cuda.ops_cupy import CupyOps  # noqa: E402
from kestrel_cuda.ops_numpy import NumpyOps  # noqa: E402
from kestrel_cuda.plan import FINISH_COLS, KV_DTYPE, TOKEN_RING, attn_part_size  # noqa: E402

from .forward_check import (  # noqa: E402
    FIXTURES,
    SMALL_CONFIGS,
    _check,
    cuda_device_count,
    device_logits,
    paged_rows,
    random_tokens,
    stepwise_greedy,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


CAP = 1.0  # small against the scores below (their spread is several units): it changes every one


@pytest.mark.parametrize("hd", [16, 128, 256])
@pytest.mark.parametrize(("m", "window"), [(1, 0), (1, 12), (20, 0), (20, 8)])
def test_attn_decode_and_attn_prefill_cap_the_scores_as_the_mirror(hd, m, window, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """One sequence's rows (a decode row: attn_decode; 20 rows: attn_prefill) at positions 60.., with and without
    a sliding window: the mirror's capped softmax within float32 rounding (tanhf's last bits apart), far from the
    uncapped one."""
    rng = np.random.default_rng([hd, m, window])
    heads, kv, cap = 4, 2, 128
    kc = rng.standard_normal((kv, cap, hd)).astype(KV_DTYPE)
    vc = rng.standard_normal((kv, cap, hd)).astype(KV_DTYPE)
    q = (3 * rng.standard_normal((m, heads * hd))).astype(np.float32)
    scale = float(np.float32(hd ** -0.5))
    meta = np.array([60], np.int32)
    want, loose = np.zeros_like(q), np.zeros_like(q)
    NumpyOps().attention(q, kc, vc, heads, hd, scale, meta, want, window=window, softcap=CAP)
    NumpyOps().attention(q, kc, vc, heads, hd, scale, meta, loose, window=window)
    ops = CupyOps(stream, gemm)
    ops.reserve(0, 0, attn_part_size(heads, hd), heads)  # attn_decode's split records and counters
    out = cp.full(q.shape, np.nan, np.float32)
    ops.attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), heads, hd, scale, cp.asarray(meta), out,
                  window=window, softcap=CAP)
    ops.synchronize()
    np.testing.assert_allclose(out.get(), want, rtol=1e-4, atol=1e-5)
    assert np.abs(loose - want).max() > 0.05  # the cap matters here


@pytest.mark.parametrize("hd", [16, 64, 128, 256])
@pytest.mark.parametrize("window", [0, 40])
def test_attn_rows_caps_the_scores_as_the_mirror(hd, window, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """A batch's rows over the paged pool (scattered pages, rows ending inside and at the end of a page, one of
    them split over positions): only the positions a row sees are capped (a masked one stays out of the
    softmax), the mirror's output within the tensor-core path's rounding."""
    rng = np.random.default_rng([hd, window])
    heads = 8
    q, kc, vc, rows, tables, scale = paged_rows(rng, hd, heads)
    want, loose = np.zeros_like(q), np.zeros_like(q)
    NumpyOps().attention(q, kc, vc, heads, hd, scale, None, want, rows, tables, window=window, softcap=CAP)
    NumpyOps().attention(q, kc, vc, heads, hd, scale, None, loose, rows, tables, window=window)
    ops = CupyOps(stream, gemm)
    out = cp.full(q.shape, np.nan, np.float32)
    ops.attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), heads, hd, scale, None, out, cp.asarray(rows),
                  cp.asarray(tables), window=window, softcap=CAP)
    ops.synchronize()
    np.testing.assert_allclose(out.get(), want, rtol=1e-4, atol=1e-5)
    assert np.abs(loose - want).max() > 0.05


@pytest.mark.parametrize(("div", "cap"), [(8.0, 0.0), (1.0, 30.0), (1.5, 8.0)])
def test_finish_logits_then_lm_finish_see_the_finished_logits(div, cap, stream) -> None:  # type: ignore[no-untyped-def]
    """finish_logits over rows of logits (a row stride past N) is numpy's x / div, then tanh(x / cap) * cap,
    within tanhf's last bits; lm_finish after it takes the argmax of what it wrote: where the cap saturates two
    logits to the same float, the first of them, not the larger one before the cap."""
    ops = CupyOps(stream)
    n, rows = 5000, 3
    rng = np.random.default_rng(int(div * 10 + cap))
    x = (20 * rng.standard_normal((rows, n + 8))).astype(np.float32)
    x[0, 100], x[0, 4000] = 900.0, 1000.0  # both saturate under a cap
    want = x[:, :n] / np.float32(div) if div != 1.0 else x[:, :n].copy()
    if cap:
        want = np.tanh(want / np.float32(cap)) * np.float32(cap)
    logits = cp.asarray(x)
    ops.finish_logits(logits[:, :n], div, cap)
    ops.synchronize()
    got = logits.get()
    np.testing.assert_allclose(got[:, :n], want, rtol=1e-6, atol=1e-6 * max(cap, 1.0))
    assert np.array_equal(got[:, n:], x[:, n:])  # past N: untouched
    nb = -(-n // FINISH_COLS)
    scratch = (ops.zeros(nb, np.float32), ops.zeros(nb, np.int32), ops.zeros(1, np.int32))
    meta, tokens = ops.upload(np.array([5, -1], np.int32)), ops.mapped_ints(TOKEN_RING)
    ops.greedy_token(cp.ascontiguousarray(logits[:1, :n]), scratch, meta, 100, tokens)
    ops.synchronize()
    assert int(meta.get()[1]) == int(np.argmax(got[0, :n])) == (100 if cap else 4000)


@pytest.mark.parametrize("fixture", ["tiny-gemma2", "tiny-gemma2.gguf", "tiny-granite", "tiny-granite.gguf"])
def test_gemma2_and_granite_checkpoints_match_the_cpu(fixture, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """A 13-token prefill (past tiny-gemma2's window of 8) and captured decode steps to 24 within the band; the
    pipelined greedy decode (lm_finish after finish_logits, on the device) gives the step-by-step tokens."""
    model = load_model(str(FIXTURES / fixture), "q8", cache="off").model
    toks = random_tokens(model.config, 24)
    fwd = DeviceForward(stream=stream, gemm=gemm)
    _check(model, toks, 13, device_logits(fwd, model, toks, 13))
    assert fwd.counters["graph_captures"] == 1 and fwd.counters["graph_replays"] == 11
    prompt = random_tokens(model.config, 7)
    expect, _ = stepwise_greedy(DeviceForward(stream=stream, gemm=gemm), model, prompt, 8)
    fwd.forward(model, 1, prompt, 0, False)
    assert [expect[0]] + list(fwd.greedy(model, 1, expect[0], len(prompt), 8)) == expect


@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_gemma2_where_attention_would_fold_into_qkv_matches_the_cpu(quant, stream, gemm) -> None:  # type: ignore[no-untyped-def]
    """Hidden 1024 and head_dim 128: the q|k|v GEMV's K splits run as clusters, where decode attention would run
    in them; Gemma 2's capped scores keep attn_decode (the fold has no cap), and the logits the CPU's."""
    model = synthetic_model(replace(SMALL_CONFIGS["gemma2"], hidden_size=1024), quant, seed=32)
    toks = random_tokens(model.config, 30)
    fwd = DeviceForward(stream=stream, gemm=gemm)
    _check(model, toks, 12, device_logits(fwd, model, toks, 12))
    if fwd.ops.cluster:
        assert fwd.ops.attend_folds(fwd.projections.layer(model, 0).qkv[0], 1024)
