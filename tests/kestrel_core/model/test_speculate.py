"""Speculative decoding by prompt lookup: the drafts, and answers token for token the same as without it.

The tiny random models decode greedily into loops (a token, or a few, over and over), so their drafts are often
right: the tests check both that guesses are kept and that nothing the model would not have said comes out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kestrel_core
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler
from kestrel_core.model.speculate import PromptLookup

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "models"


def test_the_draft_follows_the_longest_suffix_seen_before() -> None:
    lookup = PromptLookup()
    lookup.extend([1, 2, 3, 9, 2, 3, 7, 8, 4, 5])
    assert lookup.draft(3) == []  # 5 never appeared before
    lookup.extend([2, 3])
    assert lookup.draft(2) == [7, 8]  # "2 3" was last followed by 7 (the 3-gram "5 2 3" is new)
    lookup.extend([9])
    assert lookup.draft(4) == [2, 3, 7, 8]  # "3 9" is longer than "9" and was followed by "2 3 7 8"
    lookup.extend([1])
    assert lookup.draft(2) == []  # only "1" matches: one token is too weak a match


def test_drafts_pause_after_misses_for_longer_each_time() -> None:
    lookup = PromptLookup()
    lookup.extend([1, 2, 3, 1, 2])
    assert lookup.draft(2) == [3, 1]
    for pause in (2, 4, 8, 16, 32, 32):  # doubling up to MAX_PAUSE
        lookup.checked(0)
        start = len(lookup.tokens)
        while lookup.draft(2) == []:
            lookup.extend([1, 2])  # "1 2" keeps matching: only the pause stops the drafts
        assert len(lookup.tokens) - start == pause
    lookup.checked(1)  # a confirmed guess ends the misses: the next one pauses for 2 again
    lookup.checked(0)
    assert lookup.paused and lookup.draft(2) == []
    lookup.extend([1, 2])
    assert not lookup.paused and lookup.draft(2) == [1, 2]


def _run(engine: kestrel_core.Engine, speculate: int, requests: list[tuple[list[int], SamplingParams]],
         max_batch: int = 8) -> tuple[list[tuple[list[int], str, str | None]], Scheduler]:
    engine.speculate = speculate
    scheduler = Scheduler(engine, max_batch=max_batch)
    added = [scheduler.add(ids, params) for ids, params in requests]
    tokens: dict[str, list[int]] = {r.request_id: [] for r in added}
    text: dict[str, str] = {r.request_id: "" for r in added}
    while any(not r.finished for r in added):
        for out in scheduler.step():
            tokens[out.request_id] += out.new_token_ids
            text[out.request_id] += out.new_text
    engine.speculate = 0
    return [(tokens[r.request_id], text[r.request_id], r.finish_reason) for r in added], scheduler


def _prompts(engine: kestrel_core.Engine, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    vocab = engine.config.vocab_size
    base = rng.integers(3, vocab, 12).tolist()
    return [base + rng.integers(3, vocab, int(rng.integers(2, 10))).tolist() + base[:6] for _ in range(n)]


@pytest.mark.parametrize("fixture", ["tiny-qwen3", "tiny-llama", "tiny-gemma3", "tiny-qwen3-moe"])
def test_a_batch_decodes_the_same_tokens_in_fewer_steps(fixture: str) -> None:
    with kestrel_core.load(str(FIXTURES / fixture), backend="cpu") as engine:
        prompts = _prompts(engine, 5)
        greedy = [(ids, SamplingParams(max_tokens=40, ignore_eos=True)) for ids in prompts]
        plain, before = _run(engine, 0, greedy)
        fast, after = _run(engine, 4, greedy)
        assert fast == plain
        assert after.accepted > 0 and after.steps <= before.steps  # the batch runs as long as its slowest
        mixed = [*greedy, (prompts[0], SamplingParams(max_tokens=40, temperature=0.9, seed=3))]  # sampled: no drafts
        assert _run(engine, 4, mixed)[0] == _run(engine, 0, mixed)[0]
        assert engine.pool.free_blocks == engine.pool.num_blocks


def test_stops_and_limits_inside_a_draft_end_the_answer_where_they_would_have() -> None:
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3"), backend="cpu") as engine:
        ids = _prompts(engine, 1, seed=2)[0]  # its answer loops on one token, then says another at 19
        greedy, _ = _run(engine, 0, [(ids, SamplingParams(max_tokens=40, ignore_eos=True))])
        answer = greedy[0][0]
        token = next(t for i, t in enumerate(answer) if i >= 5 and t not in answer[:i])  # new after the loop
        cut = engine.tokenizer.decode([token])
        for params in (SamplingParams(max_tokens=13, ignore_eos=True),
                       SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(token,)),
                       SamplingParams(max_tokens=40, ignore_eos=True, stop=(cut,))):
            plain, before = _run(engine, 0, [(ids, params)])
            fast, scheduler = _run(engine, 6, [(ids, params)])
            assert fast == plain, params
            assert scheduler.accepted > 0 and scheduler.steps < before.steps
        assert len(fast[0][0]) <= 40


def test_guesses_take_only_the_budget_that_rows_and_prompts_left() -> None:
    """A step's token budget goes to every running request's row and to prompts first: a request whose guesses
    are always right does not hold back another's token nor a new request's prompt."""
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3"), backend="cpu") as engine:
        looping, other, new = _prompts(engine, 3, seed=2)
        engine.speculate = 4
        scheduler = Scheduler(engine, max_batch=3, token_budget=4)
        first = scheduler.add(looping, SamplingParams(max_tokens=200, ignore_eos=True))
        second = scheduler.add(other, SamplingParams(max_tokens=200, ignore_eos=True))
        while len(second.output_ids) < 10:
            scheduler.step()
        third = scheduler.add(new[:2], SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(20):
            before = len(first.output_ids), len(second.output_ids), len(third.output_ids)
            scheduler.step()
            assert len(second.output_ids) > before[1] and len(third.output_ids) > before[2]
            assert len(first.output_ids) > before[0]
        assert scheduler.accepted > 0
        engine.speculate = 0
        scheduler.close()


def test_each_token_of_a_step_says_where_its_text_starts() -> None:
    """A step that keeps guesses reports several tokens: each one's text starts where the tokenizer's text of the
    tokens before it ends (what tells a reasoning block's tokens from its answer's, serve/responses.py)."""
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3"), backend="cpu") as engine:
        engine.speculate = 4
        scheduler = Scheduler(engine, max_batch=8)
        request = scheduler.add(_prompts(engine, 1)[0], SamplingParams(max_tokens=40, ignore_eos=True))
        tokens: list[int] = []
        starts: list[int] = []
        text, several = "", 0
        while not request.finished:
            for out in scheduler.step():
                assert out.text_offsets is not None and len(out.text_offsets) == len(out.new_token_ids)
                starts += [len(text) + offset for offset in out.text_offsets]
                tokens += out.new_token_ids
                text += out.new_text
                several += len(out.new_token_ids) > 1
        engine.speculate = 0
        assert several and starts == [len(engine.tokenizer.decode(tokens[:k])) for k in range(len(tokens))]


def test_logprobs_sampling_and_device_steps_are_not_speculated() -> None:
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3"), backend="cpu") as engine:
        ids = _prompts(engine, 1)[0]
        for params in (SamplingParams(max_tokens=20, logprobs=True), SamplingParams(max_tokens=20, temperature=1.0,
                                                                                    seed=1)):
            _, scheduler = _run(engine, 4, [(ids, params)])
            assert scheduler.drafted == 0, params


def test_preemption_under_a_small_cache_keeps_the_answers() -> None:
    """A KV pool too small for every sequence at once: sequences are preempted and recomputed, drafts are
    only taken where blocks are free, and the answers stay the plain ones."""
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3"), backend="cpu", kv_cache_mb=0.15) as engine:
        requests = [(ids, SamplingParams(max_tokens=30, ignore_eos=True)) for ids in _prompts(engine, 6, seed=2)]
        plain, before = _run(engine, 0, requests, max_batch=6)
        fast, after = _run(engine, 4, requests, max_batch=6)
        assert fast == plain and after.preemptions > 0 and after.accepted > 0
        assert engine.pool.free_blocks == engine.pool.num_blocks


def test_concurrent_async_requests_get_the_plain_answers() -> None:
    import asyncio

    from kestrel_core.model.async_engine import AsyncEngine

    async def answers(front: AsyncEngine, prompts: list[list[int]]) -> list[list[int]]:
        async def one(ids: list[int]) -> list[int]:
            params = SamplingParams(max_tokens=30, ignore_eos=True)
            return [t async for out in front.generate(ids, params) for t in out.new_token_ids]
        front.start()
        try:
            return list(await asyncio.gather(*(one(ids) for ids in prompts)))
        finally:
            await front.shutdown(grace_s=5)

    with kestrel_core.load(str(FIXTURES / "tiny-llama"), backend="cpu") as engine:
        prompts = _prompts(engine, 4, seed=5)
        plain = asyncio.run(answers(AsyncEngine(engine), prompts))
        engine.speculate = 4
        front = AsyncEngine(engine)
        assert asyncio.run(answers(front, prompts)) == plain and front.scheduler.accepted > 0


def test_decode_speed_counts_every_token_a_step_keeps(monkeypatch) -> None:
    """``stats``' decode tok/s is tokens over time: a step that kept guesses counts each of its tokens."""
    import kestrel_core.model.engine as engine_mod
    from kestrel_core.model.scheduler import Scheduler as Sched

    clock = [0.0]
    step = Sched.step

    def timed_step(self):  # type: ignore[no-untyped-def]
        clock[0] += 1.0  # a second a step
        return step(self)

    monkeypatch.setattr(Sched, "step", timed_step)
    monkeypatch.setattr(engine_mod.time, "perf_counter", lambda: clock[0])
    with kestrel_core.load(str(FIXTURES / "tiny-qwen3"), backend="cpu") as engine:
        ids = _prompts(engine, 1)[0]
        engine.speculate = 4
        assert len(list(engine.generate(ids, max_tokens=40, stop_at_eos=False))) == 40
        last = engine.last
    assert last.decode_tokens == 39 and last.decode_s < 39  # fewer steps than tokens
    assert last.decode_tok_s == pytest.approx(39 / last.decode_s)


def test_the_cli_option_gives_the_same_answer(capsys) -> None:
    import json

    from kestrel_core.cli import main

    outs, lines = [], []
    for extra in ([], ["--speculate", "4"]):
        assert main(["run", "--model", str(FIXTURES / "tiny-qwen3"), "--max-tokens", "24", "--json", "--stats",
                     *extra, "Repeat: the sea, the sea, the sea"]) == 0
        out, err = capsys.readouterr()
        answer = json.loads(out)
        outs.append(answer["tokens"])
        lines.append(err)
    assert outs[0] == outs[1] and len(outs[0]) == 24
    assert "guesses kept" not in lines[0]  # --stats says how many guesses the model confirmed, where there were
    kept, drafted = answer["stats"]["accepted"], answer["stats"]["drafted"]
    assert 0 < kept <= drafted and f"guesses kept {kept}/{drafted}" in lines[1]
    assert main(["run", "--model", str(FIXTURES / "tiny-qwen3"), "--speculate", "65", "x"]) == 2
