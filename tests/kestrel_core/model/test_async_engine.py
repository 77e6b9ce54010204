"""The asyncio front: concurrent callers, early exits that abort, capacity, shutdown."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import numpy as np
import pytest

import kestrel_core
from kestrel_core.errors import InvalidRequest, Overloaded, ShuttingDown
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.presets import synthetic_model
from kestrel_core.model.sampling import SamplingParams

from ..waits import HANG_GUARD_S, wait_until


@pytest.fixture
def engine(tiny_config):
    with kestrel_core.load(synthetic_model(tiny_config("llama", max_position=128), "q8", seed=31), "cpu") as e:
        yield e


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, int(rng.integers(3, 30))).tolist() for _ in range(n)]


async def _collect(front: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t async for out in front.generate(prompt, params) for t in out.new_token_ids]


def test_concurrent_requests_get_their_own_tokens(engine) -> None:
    prompts = _prompts(8)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = [list(engine.generate(p, params=params)) for p in prompts]

    async def main() -> list[list[int]]:
        front = AsyncEngine(engine, max_batch=8)
        front.start()
        try:
            return list(await asyncio.gather(*(_collect(front, p, params) for p in prompts)))
        finally:
            await front.shutdown(grace_s=1)

    assert asyncio.run(main()) == alone
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_leaving_early_aborts_and_frees_the_sequence(engine) -> None:
    async def main() -> None:
        front = AsyncEngine(engine)
        front.start()
        try:
            stream = front.generate(_prompts(1)[0], SamplingParams(max_tokens=100, ignore_eos=True))
            async for _ in stream:
                break
            await stream.aclose()
            await asyncio.to_thread(wait_until, lambda: front.active == 0 and front.num_running == 0,
                                    "the abort taken")
            assert front.counters.finished.get("abort", 0) == 1
        finally:
            await front.shutdown(grace_s=1)

    asyncio.run(main())
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_bad_requests_and_capacity_fail_before_any_output(engine) -> None:
    async def main() -> None:
        front = AsyncEngine(engine, max_batch=1, max_waiting=1)
        front.start()
        try:
            with pytest.raises(InvalidRequest) as info:
                await anext(front.generate([1, 2], SamplingParams(temperature=-1)))
            assert info.value.param == "temperature"
            long = SamplingParams(max_tokens=120, ignore_eos=True)
            first = front.generate([5, 6], long)
            await anext(first)
            second, _ = front.submit([7, 8], long)  # two in flight: one running, one waiting
            with pytest.raises(Overloaded, match="capacity"):
                await anext(front.generate([9], long))
            front.abort(second)
            await first.aclose()
        finally:
            await front.shutdown(grace_s=1)

    asyncio.run(main())


def test_shutdown_lets_running_requests_finish_and_refuses_new_ones(engine) -> None:
    async def main() -> None:
        front = AsyncEngine(engine)
        front.start()
        task = asyncio.create_task(_collect(front, [4, 5, 6], SamplingParams(max_tokens=6, ignore_eos=True)))
        await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        await front.shutdown(grace_s=HANG_GUARD_S)  # the running request finishes within it
        assert len(await task) == 6
        with pytest.raises(ShuttingDown, match="shutting down"):
            await anext(front.generate([1], SamplingParams()))

    asyncio.run(main())


def test_run_sync_runs_on_the_scheduler_thread_and_passes_errors_back(engine) -> None:
    import threading

    front = AsyncEngine(engine)
    try:
        assert front.run_sync(threading.get_ident) == front._thread.ident != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            front.run_sync(lambda: 1 / 0)
        assert front.run_sync(lambda: list(engine.generate([1, 2, 3], max_tokens=3, stop_at_eos=False))) \
            == list(engine.generate([1, 2, 3], max_tokens=3, stop_at_eos=False))
    finally:
        asyncio.run(front.shutdown(grace_s=1))


def test_an_embedding_takes_a_place_of_the_capacity(engine) -> None:
    """One place (max_batch 1, max_waiting 0): an embedding beside a running generation is Overloaded before it
    runs, and a generation beside an embedding job under way is too, as a generation beside a generation is."""
    async def main() -> None:
        front = AsyncEngine(engine, max_batch=1, max_waiting=0, token_budget=4)
        front.start()
        try:
            running = front.generate([5, 6], SamplingParams(max_tokens=120, ignore_eos=True))
            await anext(running)
            with pytest.raises(Overloaded, match="capacity"):
                await front.embed(_prompts(2))
            await running.aclose()
            await asyncio.to_thread(wait_until, lambda: not front.active, "its abort taken at the thread's next pass")
            embedding = asyncio.create_task(front.embed(_prompts(4, seed=2)))
            await asyncio.sleep(0)  # under way: it waits for the thread
            with pytest.raises(Overloaded, match="capacity"):
                await anext(front.generate([7, 8], SamplingParams(max_tokens=2)))
            assert np.array_equal(await embedding, engine.embed(_prompts(4, seed=2)))
        finally:
            await front.shutdown(grace_s=1)

    asyncio.run(main())
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_embeddings_run_between_steps_and_shutdown_waits_for_them(engine) -> None:
    """An embedding job of many steps shares the thread with a running request; shutdown lets it finish and then
    refuses new ones; a call after the thread stopped is ShuttingDown, not a wait for ever."""
    prompts = _prompts(6, seed=3)
    want = engine.embed(prompts)

    async def main() -> None:
        front = AsyncEngine(engine, token_budget=8)
        front.start()
        task = asyncio.create_task(_collect(front, [4, 5, 6], SamplingParams(max_tokens=40, ignore_eos=True)))
        embedding = asyncio.create_task(front.embed(prompts))
        await asyncio.sleep(0)  # both under way: each waits for the thread
        assert front.active == 2
        await front.shutdown(grace_s=HANG_GUARD_S)
        assert np.array_equal(await embedding, want) and len(await task) == 40
        with pytest.raises(ShuttingDown):
            await front.embed(prompts)
        with pytest.raises(ShuttingDown, match="stopped"):
            front._post(lambda: None).result(timeout=HANG_GUARD_S)  # the thread returned at its last pass

    asyncio.run(main())
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_an_embedding_holds_no_worker_thread_while_its_steps_wait_for_the_engine(engine) -> None:
    """The event loop's executor is the server's for rendering prompts: with its one worker busy, an embedding of
    many steps (and any other call onto the steps' thread) still runs, and is not queued behind it."""
    prompts = _prompts(6, seed=3)
    want = engine.embed(prompts)

    async def main() -> np.ndarray:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
        front = AsyncEngine(engine, token_budget=8)
        front.start()
        busy = threading.Event()
        worker = loop.run_in_executor(None, busy.wait)  # the only worker, busy until the embedding is in
        try:
            name = await asyncio.wait_for(front.call(lambda: threading.current_thread().name), HANG_GUARD_S)
            assert name == "kestrel-scheduler"
            return await asyncio.wait_for(front.embed(prompts), HANG_GUARD_S)
        finally:
            busy.set()
            await worker
            await front.shutdown(grace_s=5)

    assert np.array_equal(asyncio.run(main()), want)
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_an_embedding_given_up_frees_its_blocks(engine) -> None:
    async def main() -> None:
        front = AsyncEngine(engine, token_budget=4)
        front.start()
        task = asyncio.create_task(front.embed(_prompts(8, seed=5)))
        await asyncio.sleep(0)  # its first step is on the thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await front.shutdown(grace_s=5)

    asyncio.run(main())
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_a_request_starts_the_steps_thread_and_a_dict_of_params_is_refused(engine) -> None:
    """The README's ``AsyncEngine(engine)`` with no ``start()``: the first request starts the thread (it waited
    for ever); params that are not a SamplingParams fail before anything is queued."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    alone = list(engine.generate(_prompts(1)[0], params=params))

    async def main() -> list[int]:
        front = AsyncEngine(engine)
        try:
            with pytest.raises(InvalidRequest, match="params must be a SamplingParams"):
                await _collect(front, _prompts(1)[0], {"max_tokens": 4})  # type: ignore[arg-type]
            return await asyncio.wait_for(_collect(front, _prompts(1)[0], params), HANG_GUARD_S)
        finally:
            await front.shutdown(grace_s=1)

    assert asyncio.run(main()) == alone


def test_an_event_loop_that_closes_with_a_request_running_leaves_the_thread_serving(engine) -> None:
    """``asyncio.run`` returning while its request still runs: the outputs for the closed loop are dropped and
    the request aborted, and the next loop's request is answered (the thread died, and every later one hung)."""
    front = AsyncEngine(engine)
    params = SamplingParams(max_tokens=120, ignore_eos=True)

    async def leave_running() -> None:
        asyncio.get_running_loop().create_task(_collect(front, _prompts(1)[0], params))
        await asyncio.sleep(0.3)  # a few steps in, then the loop ends with the request running

    try:
        for _ in range(3):
            asyncio.run(leave_running())
        got = asyncio.run(asyncio.wait_for(_collect(front, _prompts(1, seed=2)[0], SamplingParams(max_tokens=4,
                                                                                              ignore_eos=True)),
                                           HANG_GUARD_S))
        assert len(got) == 4 and front._thread is not None and front._thread.is_alive()
    finally:
        asyncio.run(front.shutdown(grace_s=0))
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_closing_the_engine_stops_its_async_front(tiny_config) -> None:
    """Without ``shutdown()``: the thread, which holds the engine and its model, ends with ``Engine.close()``."""
    engine = kestrel_core.load(synthetic_model(tiny_config("llama", max_position=128), "q8", seed=31), "cpu")
    front = AsyncEngine(engine)
    got = asyncio.run(_collect(front, _prompts(1)[0], SamplingParams(max_tokens=3, ignore_eos=True)))
    thread = front._thread
    assert len(got) == 3 and thread is not None and thread.is_alive()
    engine.close()
    assert not thread.is_alive()


def test_a_request_whose_sampling_fails_ends_alone(engine, monkeypatch) -> None:
    """Its own parameters or constraint: its client gets the error, the requests batched with it their tokens."""
    from kestrel_core.model import sampling

    prompts = _prompts(4, seed=5)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = [list(engine.generate(p, params=params)) for p in prompts[:3]]
    doomed = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.5, seed=99)
    sample, calls = sampling.Sampler.__call__, []

    def failing(self, logits):
        if self.params.seed == 99:
            calls.append(1)
            if len(calls) == 3:  # mid-decode, the others' tokens of this step already taken
                raise IndexError("index 5 is out of bounds")
        return sample(self, logits)

    monkeypatch.setattr(sampling.Sampler, "__call__", failing)

    async def main() -> list:
        front = AsyncEngine(engine, max_batch=4)
        front.start()
        try:
            return list(await asyncio.gather(*(_collect(front, p, params) for p in prompts[:3]),
                                             _collect(front, prompts[3], doomed), return_exceptions=True))
        finally:
            await front.shutdown(grace_s=1)

    *others, failed = asyncio.run(main())
    assert others == alone
    assert isinstance(failed, kestrel_core.KestrelError) and "IndexError: index 5" in str(failed)
    assert engine.pool.free_blocks == engine.pool.num_blocks
    calls.clear()
    with pytest.raises(IndexError, match="index 5"):  # alone, through the Python API: raised as it is
        list(engine.generate(prompts[3], params=doomed))
    assert engine.pool.free_blocks == engine.pool.num_blocks


def _tight(tiny_config, blocks: int) -> kestrel_core.Engine:
    from kestrel_core.model.kv_pool import BLOCK_SIZE, bytes_per_position

    model = synthetic_model(tiny_config("llama", max_position=128), "q8", seed=31)
    mb = blocks * BLOCK_SIZE * bytes_per_position(model.config) / 2 ** 20
    engine = kestrel_core.load(model, "cpu", kv_cache_mb=mb)
    assert engine.pool.num_blocks == blocks
    return engine


def test_a_request_waiting_for_blocks_held_outside_the_steps_does_not_spin(tiny_config) -> None:
    """A sequence that a call holds has the blocks: the steps' thread makes one step that can start nothing and
    then waits for what comes in, counting no empty step; the request runs once the blocks are back, as it runs
    alone."""
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompt = _prompts(1, seed=4)[0]
    with _tight(tiny_config, 4) as engine:
        alone = list(engine.generate(prompt, params=params))

        async def main() -> tuple[int, int, list[int]]:
            front = AsyncEngine(engine, max_batch=4)
            # steps that could start nothing, the steps counted before the first, the waits begun after it
            idle_steps, counted_before, waits_after = [0], [0], [0]
            step = front.scheduler.step

            def counted() -> list:
                outputs = step()
                if not outputs and front.scheduler.stalled:
                    idle_steps[0] += 1
                    counted_before[0] = counted_before[0] or front.counters.steps
                return outputs

            class Watched(threading.Condition):
                def wait(self, timeout: float | None = None) -> bool:
                    if idle_steps[0]:
                        waits_after[0] += 1
                    return super().wait(timeout)

            front.scheduler.step = counted  # type: ignore[method-assign]
            front._wake = Watched(front._lock)
            front.start()
            try:
                scoring = engine._chunk_logits(list(range(3, 3 + engine.pool.capacity - 8)))
                await front.call(lambda: next(scoring))  # its blocks are held until it is closed
                assert engine.pool.free_blocks < engine.pool.blocks_for(len(prompt) + 5)
                task = asyncio.create_task(_collect(front, prompt, params))
                # the steps' thread waits after its idle step; spinning, it makes a second one
                await asyncio.to_thread(wait_until, lambda: waits_after[0] > 0 or idle_steps[0] > 1,
                                        "the steps' thread waiting or stepping again")
                counted_steps, idle = front.counters.steps - counted_before[0], idle_steps[0]
                await front.call(scoring.close)
                return counted_steps, idle, await task
            finally:
                await front.shutdown(grace_s=1)

        counted_steps, idle, tokens = asyncio.run(main())
        assert counted_steps == 0 and idle == 1 and tokens == alone
        assert engine.pool.free_blocks == engine.pool.num_blocks


def test_an_embedding_waiting_for_blocks_tries_again_when_they_come_back(tiny_config, monkeypatch) -> None:
    """A generation holds the blocks an embedding needs for a hundred steps: the embedding tries once, is woken
    when the generation's blocks come back and runs then; it does not try between (a try drains the device's
    pipelined step)."""
    with _tight(tiny_config, 4) as engine:
        text = list(range(3, 3 + 120))  # every block of the pool
        want = engine.embed([text])
        start_batch = engine.start_batch

        def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(0.003)  # a step as long as a real model's: the generation lasts a third of a second
            return start_batch(*args, **kwargs)

        monkeypatch.setattr(engine, "start_batch", slow)

        async def main() -> tuple[int, np.ndarray, list[int]]:
            front = AsyncEngine(engine, max_batch=4)
            tries = 0
            embed_step = front._embed_step

            def counted(job):  # type: ignore[no-untyped-def]
                nonlocal tries
                tries += 1
                return embed_step(job)

            front._embed_step = counted  # type: ignore[method-assign]
            front.start()
            try:
                outputs = front.generate([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
                first = await outputs.__anext__()
                job = asyncio.create_task(front.embed([text]))
                tokens = first.new_token_ids + [t async for out in outputs for t in out.new_token_ids]
                got = await asyncio.wait_for(job, HANG_GUARD_S)
                return tries, got, tokens
            finally:
                await front.shutdown(grace_s=5)

        tries, got, tokens = asyncio.run(main())
        np.testing.assert_array_equal(got, want)
        assert len(tokens) == 100 and tries <= 3, f"{tries} tries"
        assert engine.pool.free_blocks == engine.pool.num_blocks


def test_an_id_is_taken_again_only_once_its_abort_is_said(engine) -> None:
    """The scheduler reports an abort at its next step: until then the id is in use, so the new request with it
    cannot get the old one's end."""
    from kestrel_core.model.scheduler import Scheduler

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    sched = Scheduler(engine, max_batch=4)
    sched.add([5, 6, 7], params, "x")
    sched.step()
    sched.abort("x")
    with pytest.raises(InvalidRequest, match="already in use"):
        sched.add([5, 6, 7], params, "x")
    assert [(o.request_id, o.finish_reason) for o in sched.step()] == [("x", "abort")]
    sched.add([5, 6, 7], params, "x")
    tokens = []
    while sched.has_work:
        outs = sched.step()
        tokens += [t for o in outs for t in o.new_token_ids]
        assert all(o.finish_reason != "abort" for o in outs)
    assert tokens == list(engine.generate([5, 6, 7], params=params))


def test_an_embedding_waiting_for_blocks_is_not_starved_by_new_requests(tiny_config) -> None:
    """Clients that send their next request as each ends keep some blocks held at every step: the embedding
    that needs the whole pool gets it once the running requests end, as the requests that come meanwhile
    wait for it, and those run after it."""
    rng = np.random.default_rng(7)
    with _tight(tiny_config, 4) as engine:
        text = list(range(3, 3 + 120))  # every block of the pool
        want = engine.embed([text])

        async def main() -> tuple[int, np.ndarray | None, int]:
            front = AsyncEngine(engine, max_batch=4)
            front.start()
            done, stop = 0, False

            async def client(seed: int) -> None:
                nonlocal done
                prompt = _prompts(1, seed=seed)[0]
                while not stop:
                    params = SamplingParams(max_tokens=int(rng.integers(10, 40)), ignore_eos=True)
                    await _collect(front, prompt, params)
                    done += 1

            clients = [asyncio.create_task(client(seed)) for seed in range(4)]
            try:
                deadline = time.monotonic() + HANG_GUARD_S
                while done == 0:  # the clients have come round: each sends its next request as one ends
                    assert time.monotonic() < deadline, "no generation ended"
                    await asyncio.sleep(0.01)
                job = asyncio.create_task(front.embed([text]))
                start = done
                while not job.done() and done - start < 60:
                    await asyncio.sleep(0.01)
                meanwhile = done - start
                got = job.result() if job.done() else None
                stop = True
                job.cancel()
                await asyncio.gather(*clients)
                return meanwhile, got, done - start
            finally:
                await front.shutdown(grace_s=5)

        meanwhile, got, since = asyncio.run(main())
        assert got is not None, f"the embedding waited through {meanwhile} generations"
        np.testing.assert_array_equal(got, want)
        assert since > meanwhile  # the held-back requests ran after it
        assert engine.pool.free_blocks == engine.pool.num_blocks


def test_a_job_waiting_its_turn_hears_that_the_thread_stopped(engine) -> None:
    """A job behind the oldest one makes no call while it waits, so the wait itself says ShuttingDown once the
    steps' thread has stopped: a wait already over would give the event loop no turn, and the job would go round
    for ever with the server's loop."""
    async def main() -> None:
        front = AsyncEngine(engine)
        front.start()
        await front.shutdown(grace_s=0)
        with pytest.raises(ShuttingDown):
            await front._blocks_come_back(front._blocks_back)

    asyncio.run(main())


def test_an_embedding_the_shutdown_ends_gives_its_blocks_back(engine) -> None:
    """Ended part-way by a shutdown's grace running out: the input it held gives its blocks back, though the steps'
    thread that would close it has stopped."""
    async def main() -> None:
        front = AsyncEngine(engine, token_budget=8)
        front.start()
        job = asyncio.create_task(front.embed([list(range(3, 123))] * 6))
        while engine.pool.free_blocks == engine.pool.num_blocks:  # under way
            await asyncio.sleep(0.001)
        await front.shutdown(grace_s=0)
        with pytest.raises(ShuttingDown):
            await job

    asyncio.run(main())
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_an_embedding_beside_a_scoring_waits_for_its_blocks(tiny_config, monkeypatch) -> None:
    """A prompt being scored holds blocks between its chunks, which come back: an embedding the cache has no room
    for meanwhile waits for them, as beside a generation, rather than being refused."""
    monkeypatch.setattr("kestrel_core.model.engine.PREFILL_CHUNK", 4)  # a scoring of many chunks
    engine = _tight(tiny_config, 4)
    text = list(range(5, 45))
    want = engine.embed([text])

    async def main() -> None:
        front = AsyncEngine(engine, token_budget=16)
        front.start()
        try:
            scoring = asyncio.create_task(front.score(list(range(3, 103))))
            while engine.pool.free_blocks == engine.pool.num_blocks:  # its first chunk holds blocks
                await asyncio.sleep(0.001)
            assert np.array_equal(await front.embed([text]), want)
            assert len(await scoring) == 99
        finally:
            await front.shutdown(grace_s=1)

    asyncio.run(main())
    assert engine.pool.free_blocks == engine.pool.num_blocks


def test_a_stopped_engine_whose_thread_outlived_the_join_starts_no_other(engine, monkeypatch) -> None:
    """The stop's join times out (the steps' thread is held in a call): a call after it is refused with
    ShuttingDown, and no second steps' thread starts to drive the engine beside the first."""
    monkeypatch.setattr("kestrel_core.model.async_engine.STOP_JOIN_S", 0.05)
    started: list[threading.Thread] = []

    class Counted(threading.Thread):
        def start(self) -> None:
            if self.name == "kestrel-scheduler":
                started.append(self)
            super().start()

    monkeypatch.setattr(threading, "Thread", Counted)

    async def main() -> None:
        front = AsyncEngine(engine)
        entered, release = threading.Event(), threading.Event()
        held = asyncio.ensure_future(front.call(lambda: (entered.set(), release.wait(HANG_GUARD_S))))
        try:
            assert await asyncio.to_thread(entered.wait, HANG_GUARD_S)
            await front.shutdown(grace_s=0)
            assert started[0].is_alive()  # the join gave up
            with pytest.raises(ShuttingDown):
                await front.call(lambda: 1)
            with pytest.raises(ShuttingDown):
                await asyncio.to_thread(front.run_sync, lambda: 1)
        finally:
            release.set()
            await held
        assert await asyncio.to_thread(started[0].join, 30) is None and not started[0].is_alive()

    asyncio.run(main())
    assert len(started) == 1, started
