"""Prompt scoring (the scheduler's ``Scoring`` requests) under the CUDA backend's batched steps, on the CPU with
the numpy mirrors: a prompt's chunks, every row's logits wanted, beside decoding streams, greedy ones (whose steps
are otherwise fed, each started before the one before it is in) included. test_forward_scoring.py runs the same
on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

import kestrel_core
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler
from kestrel_core.model.scoring import Scoring

from .test_forward_speculate_host import bind, tiny_model


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_scoring_beside_decoding_streams(tmp_path, monkeypatch, temperature: float) -> None:  # type: ignore[no-untyped-def]
    bind(tmp_path, monkeypatch)
    scored, want, tokens = scoring_beside_streams("fwdcuda", temperature)
    assert [s.token_id for s in scored] == [s.token_id for s in want]
    np.testing.assert_allclose([s.logprob for s in scored], [s.logprob for s in want], atol=1e-4)
    assert all(len(t) == 60 for t in tokens)


def scoring_beside_streams(backend: str, temperature: float) -> tuple[list, list, list[list[int]]]:
    """(the scores of a 200-token prompt scored while three streams decode, in chunks of what a budget of 64 leaves
    them; the prompt's scores alone; each stream's tokens) on ``backend``."""
    model = tiny_model()
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, model.config.vocab_size, 200).tolist()
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=4, ignore_eos=True)
    with kestrel_core.load(model, backend=backend) as engine:
        want = engine.prompt_logprobs(prompt, 2)
        sched = Scheduler(engine, max_batch=4, token_budget=64)
        streams = [sched.add(rng.integers(3, model.config.vocab_size, 9).tolist(), params) for _ in range(3)]
        tokens: dict[str, list[int]] = {s.request_id: [] for s in streams}
        for out in sched.step():
            tokens[out.request_id] += out.new_token_ids
        scoring = sched.add(prompt, Scoring(2))
        scored = []
        while sched.has_work:
            for out in sched.step():
                if out.request_id == scoring.request_id:
                    scored += out.prompt_logprobs or []
                else:
                    tokens[out.request_id] += out.new_token_ids
        assert scoring.finish_reason == "length"
        assert engine.pool.free_blocks == engine.pool.num_blocks
    return scored, want, list(tokens.values())
