"""Prompt scoring in the scheduler (``Scoring`` requests): the engine's prompt logprobs, whatever the chunks, the
batch, a preemption or the prefix cache; chunks within the token budget and PREFILL_CHUNK; refused as a
generation is."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kestrel_core
from kestrel_core.errors import InvalidRequest, Overloaded
from kestrel_core.model.kv_pool import BLOCK_SIZE, bytes_per_position
from kestrel_core.model.presets import synthetic_model
from kestrel_core.model.sampling import SamplingParams, TokenLogprob
from kestrel_core.model.scheduler import Scheduler
from kestrel_core.model.scoring import Scoring
from kestrel_core.model.weights import PREFILL_CHUNK

PROMPT = list(range(3, 63))  # 60 tokens: two KV blocks




def _run(scheduler: Scheduler) -> tuple[dict[str, list[TokenLogprob]], dict[str, list[int]]]:
    """Every request's scores and tokens, the scheduler run until it has no work."""
    scores: dict[str, list[TokenLogprob]] = {}
    tokens: dict[str, list[int]] = {}
    while scheduler.has_work:
        for out in scheduler.step():
            scores.setdefault(out.request_id, []).extend(out.prompt_logprobs or [])
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return scores, tokens


def _steps(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[int, int]]]:
    """Each engine step's entries: (tokens, logit rows)."""
    steps: list[list[tuple[int, int]]] = []
    start_batch = engine.start_batch

    def recorded(work, *args, **kwargs):  # type: ignore[no-untyped-def]
        steps.append([(1 if tokens is None else len(tokens), rows) for _, tokens, rows in work])
        return start_batch(work, *args, **kwargs)

    monkeypatch.setattr(engine, "start_batch", recorded)
    return steps


def test_a_scoring_beside_decoding_streams_gives_the_engines_scores(engine, monkeypatch) -> None:
    """Two streams decode while the prompt is scored in chunks of what the budget of 8 leaves them: each step
    runs their rows and at most 8 tokens, the scores are the engine's alone and the streams' tokens their own."""
    want = engine.prompt_logprobs(PROMPT, 2)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    alone = list(engine.generate([5, 6, 7], params=params))
    steps = _steps(engine, monkeypatch)
    scheduler = Scheduler(engine, max_batch=3, token_budget=8)
    streams = [scheduler.add([5, 6, 7], params) for _ in range(2)]
    firsts = {out.request_id: out.new_token_ids for out in scheduler.step()}  # decoding from here on
    scoring = scheduler.add(PROMPT, Scoring(2))
    scores, tokens = _run(scheduler)
    tokens = {rid: firsts.get(rid, []) + got for rid, got in tokens.items()}
    assert scores[scoring.request_id] == want and tokens[scoring.request_id] == []
    assert all(tokens[s.request_id] == alone for s in streams)
    assert max(sum(n for n, _ in step) for step in steps) <= 8
    scored = [step for step in steps if any(n > 1 for n, _ in step)][1:]  # the streams' prompts ran first
    assert len(scored) == 10 and all(step[:2] == [(1, 1), (1, 1)] for step in scored), steps  # 60 tokens, 6 a step
    assert scoring.finished and scoring.finish_reason == "length"
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_a_preempted_scoring_reports_each_token_once(model) -> None:
    """Six blocks: the streams that grow preempt the scoring (admitted last) part-way; recomputed, it goes on
    from the token it had scored to, and its scores are the engine's alone."""
    mb = 6 * BLOCK_SIZE * bytes_per_position(model.config) / 2**20
    with kestrel_core.load(model, "cpu", kv_cache_mb=mb) as engine:
        want = engine.prompt_logprobs(PROMPT, 2)
        scheduler = Scheduler(engine, max_batch=3, token_budget=3)  # one token of the prompt a step
        for _ in range(2):
            scheduler.add([5, 6, 7, 8], SamplingParams(max_tokens=90, temperature=0.8, seed=5, ignore_eos=True))
        scoring = scheduler.add(PROMPT, Scoring(2))
        scores, _ = _run(scheduler)
        assert scoring.preemptions > 0
        assert scores[scoring.request_id] == want
        assert engine.pool.free_blocks == engine.pool.num_blocks


def test_a_scoring_computes_every_position_and_leaves_its_blocks_to_the_prefix_cache(engine) -> None:
    """After a generation of the same prompt, a scoring attaches none of its cached blocks (it would not score
    those positions); a generation after the scoring attaches the scoring's."""
    want = engine.prompt_logprobs(PROMPT, 1)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    scheduler = Scheduler(engine, max_batch=2)
    scheduler.add(PROMPT, params)
    _run(scheduler)
    hits = engine.pool.prefix_hit_tokens
    scoring = scheduler.add(PROMPT[:40] + [7] * 20, Scoring(1))  # its first block is cached
    scores, _ = _run(scheduler)
    assert scores[scoring.request_id] == engine.prompt_logprobs(PROMPT[:40] + [7] * 20, 1)
    assert engine.pool.prefix_hit_tokens == hits
    scoring = scheduler.add(PROMPT, Scoring(1))
    scheduler.add(PROMPT, params)  # waits for the scoring's prompt, then attaches its blocks
    scores, _ = _run(scheduler)
    assert scores[scoring.request_id] == want
    assert engine.pool.prefix_hit_tokens > hits


def test_a_scoring_chunk_holds_at_most_a_prefill_chunk(tiny_config, monkeypatch) -> None:
    """A budget of 2,048 tokens: a scoring's chunks are still PREFILL_CHUNK at most (their logits come to the host,
    [chunk, vocab] each)."""
    model = synthetic_model(tiny_config("qwen3", max_position=2 * PREFILL_CHUNK + 16), "q8", seed=21)
    ids = np.random.default_rng(4).integers(3, 300, 2 * PREFILL_CHUNK + 10).tolist()
    with kestrel_core.load(model, backend="cpu") as engine:
        want = engine.prompt_logprobs(ids)
        steps = _steps(engine, monkeypatch)
        scheduler = Scheduler(engine, max_batch=4, token_budget=2048)
        scoring = scheduler.add(ids, Scoring())
        scores, _ = _run(scheduler)
    assert steps == [[(PREFILL_CHUNK, PREFILL_CHUNK)]] * 2 + [[(10, 10)]]
    assert scores[scoring.request_id] == want


def test_an_aborted_scoring_gives_its_blocks_back(engine) -> None:
    scheduler = Scheduler(engine, max_batch=2, token_budget=16)
    scoring = scheduler.add(PROMPT, Scoring())
    scheduler.step()
    assert engine.pool.free_blocks < engine.pool.num_blocks
    scheduler.abort(scoring.request_id)
    outs = scheduler.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(scoring.request_id, "abort")]
    assert not scheduler.has_work and engine.pool.free_blocks == engine.pool.num_blocks


def test_scorings_are_refused_as_generations_are(model) -> None:
    """A bad ``top`` or prompt, a prompt past the whole KV cache: InvalidRequest; a full queue: Overloaded."""
    mb = 2 * BLOCK_SIZE * bytes_per_position(model.config) / 2**20
    with kestrel_core.load(model, "cpu", kv_cache_mb=mb) as engine:
        scheduler = Scheduler(engine, max_batch=1, max_waiting=1, token_budget=8)
        with pytest.raises(InvalidRequest, match=r"top must be an integer in \[0, 20\]"):
            scheduler.add(PROMPT, Scoring(21))
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            scheduler.add([10**6], Scoring())
        with pytest.raises(InvalidRequest, match="the KV cache holds 64"):
            scheduler.add(list(range(3, 103)), Scoring())
        scheduler.add(PROMPT, Scoring())
        scheduler.step()  # running
        scheduler.add(PROMPT, Scoring())  # waiting
        with pytest.raises(Overloaded, match="at capacity"):
            scheduler.add(PROMPT, Scoring())
        scheduler.close()
