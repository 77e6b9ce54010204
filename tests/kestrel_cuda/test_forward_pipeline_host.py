"""The pipelined greedy decode (a lone greedy request's steps run one ahead on the device) under the scheduler and
the AsyncEngine, on the CPU with the numpy mirrors: it starts only once the prompt is all in, and other work run
between two steps (``AsyncEngine.call``) leaves it first; and an abort taken while a step runs ahead is counted
once. test_forward_speculate_host.py has the cases with guesses."""

from __future__ import annotations

import asyncio

import numpy as np

import kestrel_core
from kestrel_core.model.async_engine import AsyncEngine, _Client
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler

from .test_forward_speculate_host import bind, run, tiny_model


def test_a_prompt_whose_last_chunk_is_one_token_starts_the_pipeline_after_it(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Chunks of 8 leave the 17-token prompt's last token alone in a step of its own: the pipelined decode starts
    after that step (from the first generated token), not before it (from a token there is not yet)."""
    model = tiny_model()
    bind(tmp_path, monkeypatch)
    prompt = np.random.default_rng(1).integers(3, model.config.vocab_size, 17).tolist()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        sched = Scheduler(engine, max_batch=1, token_budget=8)
        request = sched.add(prompt, params)
        got = [t for _ in range(3) for o in sched.step() for t in o.new_token_ids]  # the prompt's three chunks
        assert len(got) == 1 and request._device_tokens is None
        while sched.has_work:
            got += [t for o in sched.step() for t in o.new_token_ids]
        fwd = engine.backend.plugin.FWD[0]
    assert len(got) == 6 and request.finish_reason == "length" and fwd.counters["graph_replays"] >= 4


def test_work_between_two_steps_leaves_the_pipeline_first(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A call between two steps of a lone request's pipelined decode (a warm-up, a benchmark) runs
    another sequence on the device: the pipeline is left before it, so the request's answer is the one it gives
    alone, and the call finds no step running."""
    bind(tmp_path, monkeypatch)
    got, alone, running, pipelines = work_between_two_steps("fwdcuda")
    assert running == [False] and pipelines >= 2 and got == alone


def work_between_two_steps(backend: str) -> tuple[list[int], list[int], list[bool], int]:
    """(the answer with another sequence's forward run between two of its steps, the answer alone, whether the
    call found a step running, the pipelined decodes the backend ran) of a lone greedy request on ``backend``."""
    model = tiny_model()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, model.config.vocab_size, 12).tolist() for _ in range(8)]
    other = rng.integers(3, model.config.vocab_size, 9).tolist()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with kestrel_core.load(model, backend=backend) as engine:
        answers, _ = run(engine, prompts, 0, params)
        # the prompt whose answer repeats itself least after the call: a token taken from the wrong step shows
        prompt, alone = max(zip(prompts, answers), key=lambda pa: len(set(pa[1][6:])))
        run(engine, [other], 0, SamplingParams(max_tokens=40, ignore_eos=True))  # the device's last answer
        front = AsyncEngine(engine)
        running: list[bool] = []

        async def main() -> list[int]:
            front.start()
            got: list[int] = []
            async for out in front.generate(prompt, params):
                got.extend(out.new_token_ids)
                if not running and len(got) >= 6:
                    running.append(await front.call(lambda: (engine.prompt_logprobs(other, 1),
                                                             front.scheduler.step_running)[1]))
            await front.shutdown(grace_s=5)
            return got

        got = asyncio.run(main())
        pipelines = engine.stats["offload"]["kestrel_decode_greedy"]["accepted"]
    return got, alone, running, pipelines


def test_an_abort_taken_while_a_step_runs_is_counted_once(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Sampled requests' steps run one ahead of their reports; an abort that arrives meanwhile is taken before the
    next step is scheduled, and the step in flight then reports the aborted request once more: the server's
    counters count that request's end once, and its client gets nothing after it left."""
    model = tiny_model()
    bind(tmp_path, monkeypatch)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.vocab_size, 10).tolist() for _ in range(2)]
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        front = AsyncEngine(engine)
        sched = front.scheduler
        sched.on_start = front._admit  # as the engine's thread runs it, driven here step by step
        delivered: list[str] = []
        front._deliver = lambda outs, deliver=front._deliver: (delivered.extend(o.request_id for o in outs),
                                                               deliver(outs))[1]
        loop = asyncio.new_event_loop()
        for i, prompt in enumerate(prompts):
            front._clients[f"r{i}"] = _Client(loop, asyncio.Queue())
            front._take("add", (f"r{i}", prompt, SamplingParams(max_tokens=20, temperature=0.9, seed=i), None, 0))
        for _ in range(4):
            front._deliver_step(sched.step)
        assert sched.step_running
        front._inbox.append(("abort", "r0"))  # AsyncEngine.abort while the step runs
        before = len(delivered)
        front._deliver_step(sched.step)
        while sched.has_work:
            front._deliver_step(sched.step)
        loop.close()
        sched.close()
    assert "r0" in delivered[before:]  # the step in flight reported it after the abort was taken
    assert front.counters.finished == {"abort": 1, "length": 1}
