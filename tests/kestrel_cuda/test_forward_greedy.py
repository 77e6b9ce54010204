"""The pipelined greedy decode on the GPU: lm_finish's argmax is numpy's, and DeviceForward.greedy (its tokens fed
back on the device, two steps in flight) gives the step-by-step argmax tokens, across a KV growth too.


Skipped where CuPy or a CUDA device is missing (CI); run on the H200 machine.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

from kestrel_core.model.presets import synthetic_model  # noqa: E402
from kestrel_cuda.config import CudaConfig  # noqa: E402
from kestrel_cuda.forward import CAP_CHUNK, DeviceForward  # noqa: E402

from .forward_check import SMALL_CONFIGS, cuda_device_count, random_tokens, stepwise_greedy  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")]


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
