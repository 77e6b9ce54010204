"""Prompt scoring through the asyncio front (``AsyncEngine.score``, completions' echo with logprobs): its chunks
share the steps' token budget with the decoding streams, it waits for KV blocks as a generation does, and a
request of several parts keeps its places of the capacity between them (``AsyncEngine.places``)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import kestrel_core
from kestrel_core.errors import KestrelError, Overloaded
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.kv_pool import BLOCK_SIZE, bytes_per_position
from kestrel_core.model.presets import synthetic_model
from kestrel_core.model.sampling import SamplingParams

from ..waits import HANG_GUARD_S

SCORED = list(range(3, 103))  # 100 tokens: four KV blocks


@pytest.fixture
def model(tiny_config):
    return synthetic_model(tiny_config("llama", max_position=128), "q8", seed=31)


class HeldSteps:
    """``engine.start_batch`` recorded (each call's entries' token counts) and, once ``armed``, held in the first
    call after that until ``release`` is set: the steps' thread waits there while the test queues work."""

    def __init__(self, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[int]] = []
        self.armed, self.entered, self.release = threading.Event(), threading.Event(), threading.Event()
        start_batch = engine.start_batch

        def held(work, *args, **kwargs):  # type: ignore[no-untyped-def]
            if self.armed.is_set() and not self.release.is_set():
                self.entered.set()
                self.release.wait(HANG_GUARD_S)
            self.calls.append([1 if tokens is None else len(tokens) for _, tokens, _ in work])
            return start_batch(work, *args, **kwargs)

        monkeypatch.setattr(engine, "start_batch", held)

    async def hold(self) -> None:
        """Hold the steps' thread in its next step."""
        self.armed.set()
        assert await asyncio.to_thread(self.entered.wait, HANG_GUARD_S)


async def _queued(front: AsyncEngine, active: int) -> None:
    """Until ``active`` requests are in flight (a request is queued before its coroutine first waits)."""
    while front.active < active:
        await asyncio.sleep(0)


async def _scored_beside_a_stream(front: AsyncEngine, steps: HeldSteps, params: SamplingParams,
                                  top: int) -> tuple[list[Any], list[int]]:
    """SCORED's logprobs (``top`` alternatives) asked for while a stream of [5, 6, 7] decodes, its steps held until
    the scoring has queued; (the scores, the stream's tokens)."""
    front.start()
    try:
        decoding = front.generate([5, 6, 7], params)
        tokens = list((await decoding.__anext__()).new_token_ids)
        await steps.hold()  # the generation runs on, its blocks held
        scoring = asyncio.create_task(front.score(SCORED, top))
        await _queued(front, 2)
        steps.release.set()
        tokens += [t async for out in decoding for t in out.new_token_ids]
        return await scoring, tokens
    finally:
        await front.shutdown(grace_s=5)


def test_a_scoring_takes_its_chunks_from_the_steps_token_budget(model, monkeypatch) -> None:
    """Beside a decoding stream, with --token-budget 16: no engine step runs more than 16 tokens, and each step
    that runs a chunk of the prompt being scored runs the stream's decode row too, as a prompt's prefill does."""
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    with kestrel_core.load(model, "cpu") as engine:
        want = engine.prompt_logprobs(SCORED, 2)
        alone = list(engine.generate([5, 6, 7], params=params))
        steps = HeldSteps(engine, monkeypatch)
        got, tokens = asyncio.run(_scored_beside_a_stream(AsyncEngine(engine, max_batch=4, token_budget=16), steps,
                                                          params, 2))
        assert engine.pool.free_blocks == engine.pool.num_blocks
    assert max(sum(call) for call in steps.calls) <= 16, steps.calls
    scoring_steps = [call for call in steps.calls[1:] if max(call) > 1]
    assert scoring_steps and all(1 in call for call in scoring_steps), steps.calls
    assert got == want and tokens == alone


def _tight(model: Any, blocks: int) -> kestrel_core.Engine:
    mb = blocks * BLOCK_SIZE * bytes_per_position(model.config) / 2**20
    engine = kestrel_core.load(model, "cpu", kv_cache_mb=mb)
    assert engine.pool.num_blocks == blocks
    return engine


def test_a_scoring_waits_for_the_blocks_running_requests_give_back(model, monkeypatch) -> None:
    """The running generation holds blocks the scoring needs (four of four): the scoring waits for them, as a
    generation would, rather than being refused, and then gives the prompt's logprobs as the engine does alone."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with _tight(model, 4) as engine:
        want = engine.prompt_logprobs(SCORED, 1)
        alone = list(engine.generate([5, 6, 7], params=params))
        steps = HeldSteps(engine, monkeypatch)
        got, tokens = asyncio.run(_scored_beside_a_stream(AsyncEngine(engine, max_batch=4), steps, params, 1))
        assert engine.pool.free_blocks == engine.pool.num_blocks
    assert got == want and tokens == alone


def test_a_requests_places_are_kept_between_its_parts_and_freed_as_it_ends(model) -> None:
    """Capacity 2: a request takes both at once; its scoring and then its generation use them while another
    request is refused; those no part holds come back when it ends, a part still running frees its own as it
    ends."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with kestrel_core.load(model, "cpu") as engine:

        async def main() -> None:
            front = AsyncEngine(engine, max_batch=1, max_waiting=1)
            front.start()
            try:
                with pytest.raises(Overloaded, match="at capacity"), front.places(3):
                    pass
                for n in (0, -2, "2", 1.5):  # -2 would have made room for two requests past the capacity
                    with pytest.raises(KestrelError, match="places must be an integer"), front.places(n):
                        pass
                assert front.active == 0
                with front.places(2) as places:
                    with pytest.raises(Overloaded, match="at capacity"):
                        await front.score([5, 6, 7])
                    assert len(await front.score([5, 6, 7], places=places)) == 2
                    assert places.left == 2 and front.active == 2  # the scoring's place came back to it
                    outputs = front.generate([5, 6, 7], params, places=places)
                    first = await outputs.__anext__()
                    assert places.left == 1 and front.active == 2
                assert front.active == 1  # the unused place is free, the running part keeps its own
                tokens = first.new_token_ids + [t async for out in outputs for t in out.new_token_ids]
                assert len(tokens) == 4 and front.active == 0
            finally:
                await front.shutdown(grace_s=5)

        asyncio.run(main())
        assert engine.pool.free_blocks == engine.pool.num_blocks
