"""The asyncio front: concurrent callers, early exits that abort, capacity, shutdown, callers that fall behind."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kestrel_core
from kestrel_core.errors import InvalidRequest, Overloaded, ShuttingDown
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.presets import synthetic_model
from kestrel_core.model.sampling import SamplingParams, TokenLogprob
from kestrel_core.model.scheduler import RequestOutput


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
            for _ in range(200):
                if front.active == 0 and front.num_running == 0:
                    break
                await asyncio.sleep(0.01)
            assert front.active == 0 and front.num_running == 0
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
        await front.shutdown(grace_s=5)
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


def test_a_caller_that_falls_behind_gets_what_queued_up_as_one_output(engine) -> None:
    prompt = _prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = list(engine.generate(prompt, params=params))

    async def main() -> list[RequestOutput]:
        front = AsyncEngine(engine)
        front.start()
        try:
            stream = front.generate(prompt, params)
            outs = [await anext(stream)]
            while front.active:  # the request finishes on the engine while nobody reads
                await asyncio.sleep(0.01)
            outs += [out async for out in stream]
            return outs
        finally:
            await front.shutdown(grace_s=1)

    first, rest = asyncio.run(main())
    assert first.new_token_ids == alone[:1] and not first.finished
    assert rest.new_token_ids == alone[1:] and rest.finished and rest.finish_reason == "length"
    assert rest.completion_tokens == 10
    assert first.new_text + rest.new_text == engine.tokenizer.decode(alone)


def _out(tokens: list[int], text: str, finished: bool = False, reason: str | None = None,
         logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
    return RequestOutput("r", tokens, text, logprobs, finished, reason, 3, len(tokens))


def test_merging_keeps_an_abort_or_an_error_after_the_tokens_before_it(engine) -> None:
    lp = [TokenLogprob(5, -0.5, [(5, -0.5)]), TokenLogprob(6, -1.0, [(6, -1.0)])]

    async def run(items: list[RequestOutput | BaseException]) -> list[RequestOutput | str]:
        front = AsyncEngine(engine)  # not started: the outputs are put on the request's queue here
        stream = front.generate([1, 2], SamplingParams(), request_id="r")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # submitted; waiting for its first output
        for item in items:
            front._clients["r"].queue.put_nowait(item)
        got: list[RequestOutput | str] = [await first]
        try:
            got += [out async for out in stream]
        except RuntimeError as exc:
            got.append(str(exc))
        return got

    merged, abort = asyncio.run(run([_out([5], "a", logprobs=lp[:1]), _out([6], "b", logprobs=lp[1:]),
                                     _out([], "", True, "abort")]))
    assert (merged.new_token_ids, merged.new_text, merged.logprobs, merged.finished) == ([5, 6], "ab", lp, False)
    assert merged.completion_tokens == 1 and abort.finish_reason == "abort"
    merged, error = asyncio.run(run([_out([5], "a"), _out([6], "b"), RuntimeError("the step failed")]))
    assert (merged.new_token_ids, merged.logprobs, error) == ([5, 6], None, "the step failed")
    done, = asyncio.run(run([_out([5], "a"), _out([6], "b", True, "stop")]))
    assert (done.new_token_ids, done.finished, done.finish_reason) == ([5, 6], True, "stop")
