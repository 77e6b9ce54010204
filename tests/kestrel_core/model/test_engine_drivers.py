"""Who may drive an engine: not anyone once it is closed, and one thread at a time (kestrel_core.model.driver)."""

from __future__ import annotations

import asyncio
import threading

import pytest

import kestrel_core
from kestrel_core.errors import KestrelError
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.embed import EmbedJob
from kestrel_core.model.kv_pool import BLOCK_SIZE, bytes_per_position
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler

from ..waits import HANG_GUARD_S

PROMPT = [104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]  # "hello world"
IN_USE = "the engine is in use by another thread"


def test_a_scheduler_whose_engine_closed_ends_its_requests_with_a_kestrel_error(model) -> None:
    """Its next step ran on the closed backends (a TypeError from a hook that is gone); it ends every request
    under way ("abort", its blocks freed), as a stream's next step does, and says the engine is closed."""
    engine = kestrel_core.load(model, backend="cpu")
    scheduler = Scheduler(engine)
    running = scheduler.add(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
    scheduler.step()
    waiting = scheduler.add(PROMPT[:5], SamplingParams(max_tokens=4))
    job = EmbedJob(engine, [PROMPT])
    engine.close()
    with pytest.raises(KestrelError, match=r"the engine was closed while 2 request\(s\) ran; they are aborted"):
        scheduler.step()
    assert (running.finish_reason, waiting.finish_reason) == ("abort", "abort") and not scheduler.has_work
    assert engine.pool.free_blocks == engine.pool.num_blocks
    for use in (scheduler.step, lambda: scheduler.add(PROMPT, SamplingParams(max_tokens=2)), job.step,
                lambda: AsyncEngine(engine)):
        with pytest.raises(KestrelError, match="^the engine is closed$"):
            use()
    assert scheduler.drain() == []
    scheduler.close()


def test_an_async_engine_over_a_closed_engine_is_refused(model) -> None:
    """An AsyncEngine made after close() started a thread that ran ``call``s on the closed backends."""
    engine = kestrel_core.load(model, backend="cpu")
    engine.close()
    with pytest.raises(KestrelError, match="the engine is closed"):
        front = AsyncEngine(engine)
        asyncio.run(front.call(lambda: engine.pool.new_sequence()))


def test_a_second_thread_driving_the_engine_is_refused(model) -> None:
    """Two threads, each with its own scheduler over one engine: while the first takes the pool's last block
    (checked free, not yet taken), the second's step took it from under it, and the first then failed deep in the
    pool (KeyError: 'dictionary is empty'). The second is refused, naming the first; once the first
    is done, the second drives the engine."""
    one_block = bytes_per_position(model.config) * BLOCK_SIZE / 2 ** 20
    with kestrel_core.load(model, backend="cpu", kv_cache_mb=one_block) as engine:
        assert engine.pool.num_blocks == 1
        inside, go_on = threading.Event(), threading.Event()
        take = engine.pool._take

        def paused_take() -> int:
            if threading.current_thread().name == "first":
                inside.set()
                go_on.wait(HANG_GUARD_S)
            return take()

        engine.pool._take = paused_take  # type: ignore[method-assign]
        first, second = Scheduler(engine), Scheduler(engine)
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        first.add(PROMPT, params)
        second.add(PROMPT, params)
        outcome: list[object] = []

        def drive() -> None:
            try:
                tokens = []
                while first.has_work:
                    tokens += [t for out in first.step() for t in out.new_token_ids]
                outcome.append(tokens)
            except Exception as exc:  # noqa: BLE001 (the test reports it)
                outcome.append(exc)

        thread = threading.Thread(target=drive, name="first")
        thread.start()
        try:
            assert inside.wait(HANG_GUARD_S)
            with pytest.raises(KestrelError, match=rf"{IN_USE} \(first\): one thread drives an engine at a time; "
                                                   r"threads share one through an AsyncEngine"):
                second.step()
        finally:
            go_on.set()
            thread.join(HANG_GUARD_S)
        tokens = []
        while second.has_work:
            tokens += [t for out in second.step() for t in out.new_token_ids]
        assert outcome == [tokens] and len(tokens) == 3
        assert engine.pool.free_blocks == 1


def test_a_step_not_yet_taken_holds_the_engine_for_its_thread(model) -> None:
    """A started step (which a device may still run) keeps other threads out until its result is taken: a
    sequence made meanwhile on another thread (an AsyncEngine's beside a caller's) is refused, one made after gets
    the next id."""
    with kestrel_core.load(model, backend="cpu") as engine:
        seq = engine.new_sequence(len(PROMPT))
        step = engine.start_batch([(seq, PROMPT, 1)])
        made: list[object] = []

        def other() -> None:
            try:
                made.append(engine.new_sequence())
            except KestrelError as exc:
                made.append(exc)

        for _ in range(2):
            thread = threading.Thread(target=other, name="other")
            thread.start()
            thread.join(HANG_GUARD_S)
            if len(made) == 1:
                assert step.result()[0].shape == (1, model.config.vocab_size)
        refused, later = made
        assert isinstance(refused, KestrelError) and f"{IN_USE} (MainThread)" in str(refused)
        assert later.seq_id == seq.seq_id + 1  # type: ignore[attr-defined]
        engine.release(seq)
        engine.release(later)  # type: ignore[arg-type]


def test_what_a_scheduler_is_given_is_checked_when_it_is_given(model) -> None:
    """Something other than an engine (an AttributeError inside), a request id that is not text (outputs named
    5), a constraint that is not a grammar's (its first step failed inside the sampler): each a KestrelError that
    names it, before anything runs."""
    for engine in (None, "engine"):
        for make in (Scheduler, AsyncEngine):
            with pytest.raises(KestrelError, match=f"{make.__name__} takes an Engine .*, got (NoneType|str)"):
                make(engine)
    with kestrel_core.load(model, backend="cpu") as engine:
        scheduler, front = Scheduler(engine), AsyncEngine(engine)
        params = SamplingParams(max_tokens=2)
        for kwargs, says in (({"request_id": 5}, "request_id must be a str, got int"),
                             ({"request_id": b"x"}, "request_id must be a str, got bytes"),
                             ({"constraint": "x"}, r"constraint must be a Constraint \(engine.constraint")):
            with pytest.raises(KestrelError, match=says):
                scheduler.add(PROMPT, params, **kwargs)

            async def submit(kwargs: dict[str, object] = kwargs) -> None:
                front.submit(PROMPT, params, **kwargs)  # type: ignore[arg-type]

            with pytest.raises(KestrelError, match=says):
                asyncio.run(submit())
        assert not scheduler.has_work and front.active == 0
