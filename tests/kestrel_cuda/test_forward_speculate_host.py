"""Speculative decoding (``--speculate``) where the device forward runs the steps, on the CPU with the numpy
mirrors: the device computes the positions of guesses the model did not confirm again (API 1.6), a lone request
leaves the pipelined greedy decode while its context offers guesses, batched ones are not fed then, and every
request gives the tokens it gives without guesses (and a request that decoded alone goes on right after others
ran beside it). test_forward_speculate.py runs the same on the GPU."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

import kestrel_core
from kestrel_core.model.loader import load_model
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler
from kestrel_core.model.speculate import PromptLookup

from .test_forward_batch_host import BATCH_BACKEND

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"

MAKE = "lambda: DeviceForward(ops=__import__('kestrel_cuda.ops_numpy').ops_numpy.NumpyOps())"


def bind(tmp_path, monkeypatch, api: str = "API_VERSION") -> None:  # type: ignore[no-untyped-def]
    """The backend ``fwdcuda`` over the numpy mirrors with its pipelined greedy decode, declaring ``api``."""
    path = tmp_path / "fwdcuda.py"
    source = BATCH_BACKEND.format(decline=set(), make=MAKE, greedy=-1)
    info = 'BackendInfo("fwdcuda", "1", API_VERSION, "gpu")'
    assert info in source
    path.write_text(source.replace(info, f'BackendInfo("fwdcuda", "1", {api}, "gpu")'))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(path))


def tiny_model(name: str = "tiny-qwen3"):  # type: ignore[no-untyped-def]
    return load_model(str(FIXTURES / name), "q8", cache="off").model


def looping_prompts(model, n: int, seed: int = 0) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Prompts that repeat their start; the tiny random models then decode greedily into loops, which the
    guesses follow."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    base = rng.integers(3, vocab, 12).tolist()
    return [base + rng.integers(3, vocab, int(rng.integers(2, 10))).tolist() + base[:6] for _ in range(n)]


class AnswerDrafts(PromptLookup):
    """Drafts from the known answer, never paused: its next tokens, or each one id over with ``vocab`` (never
    right); with ``stretch``, only in every other stretch of that many tokens."""

    def __init__(self, prompt_len: int, answer: list[int], vocab: int = 0, stretch: int = 0) -> None:
        super().__init__()
        self.prompt_len, self.answer, self.vocab, self.stretch = prompt_len, answer, vocab, stretch

    def draft(self, k: int) -> list[int]:
        at = len(self.tokens) - self.prompt_len
        if self.stretch and at // self.stretch % 2:
            return []
        nxt = self.answer[at:at + k]
        return [(t + 1) % self.vocab for t in nxt] if self.vocab else nxt


def run(engine, prompts: list[list[int]], speculate: int, params: SamplingParams,  # type: ignore[no-untyped-def]
        lookup=None) -> tuple[list[list[int]], Scheduler]:
    """Each prompt's tokens and the scheduler; ``lookup(prompt)``: the drafts' source instead of prompt lookup."""
    engine.speculate = speculate
    sched = Scheduler(engine)
    requests = [sched.add(p, params) for p in prompts]
    for r, p in zip(requests, prompts):
        if lookup is not None:
            r.lookup = lookup(p)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while sched.has_work:
        for out in sched.step():
            got[out.request_id] += out.new_token_ids
    return [got[r.request_id] for r in requests], sched


def test_a_lone_request_guesses_on_the_device_and_says_what_it_says_without(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """One greedy request: the same tokens with guesses as without, in fewer steps; the drafts' checks run as
    the pool's captured steps, the device takes back the positions of wrong guesses (the pipelined decode
    stopped after the step it ran ahead, whose token is taken: nothing else), and declines nothing. Guesses
    that are all wrong change nothing either: each one's position is computed again."""
    model = tiny_model()
    bind(tmp_path, monkeypatch)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        assert engine.rewinds and engine.device_rewinds and not engine.steps_on_host
        prompts = looping_prompts(model, 3)
        rewound = wrong = 0
        for prompt in prompts:
            (plain,), before = run(engine, [prompt], 0, params)
            fwd = engine.backend.plugin.FWD[0]
            replays, positions = fwd.counters["graph_replays"], fwd.counters["rewound_positions"]
            checks = fwd.counters["batch_graph_replays"]
            (fast,), after = run(engine, [prompt], 4, params)
            assert fast == plain
            assert after.accepted > 0 and after.steps < before.steps and fwd.counters["batch_graph_replays"] > checks
            rewound += fwd.counters["rewound_positions"] - positions
            wrong += after.drafted - after.accepted
        assert rewound <= wrong  # (a check that ends the answer rewinds nothing)
        assert before.steps == 40 and replays > 0  # without guesses: the pipelined greedy decode, a token a step
        positions = fwd.counters["rewound_positions"]
        (missed,), sched = run(engine, [prompt], 4, params,
                               lambda p: AnswerDrafts(len(p), plain, model.config.vocab_size))
        assert missed == plain and sched.accepted == 0
        assert 0 < fwd.counters["rewound_positions"] - positions <= sched.drafted
        assert fwd.counters["declined"] == 0
        assert engine.pool.free_blocks == engine.pool.num_blocks


def test_batched_requests_guess_and_are_fed_only_without_guesses(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Greedy requests together (the pool's batched steps): with guesses, each request's tokens are the ones it
    gets without; a step that carried guesses is never followed by a fed one."""
    model = tiny_model()
    bind(tmp_path, monkeypatch)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    fed_after_draft: list[bool] = []
    original = Scheduler._start

    def start(self, before=None):  # type: ignore[no-untyped-def]
        started = original(self, before)
        if before is not None and started is not None:
            fed_after_draft.append(any(r.draft for r, _, _ in before[0]))
        return started

    monkeypatch.setattr(Scheduler, "_start", start)
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        prompts = looping_prompts(model, 4, seed=1)
        plain, before = run(engine, prompts, 0, params)
        fwd = engine.backend.plugin.FWD[0]
        fed = fwd.counters["fed_rows"]
        fast, after = run(engine, prompts, 4, params)
        assert fast == plain
        assert after.accepted > 0 and after.steps < before.steps
        assert fed > 0 and fwd.counters["declined"] == 0
        assert fed_after_draft and not any(fed_after_draft)
        assert engine.pool.free_blocks == engine.pool.num_blocks and not fwd._pool.held


def test_a_backend_before_api_1_6_is_not_asked_to_rewind(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A whole-step backend declaring API 1.5 keeps its steps, unguessed: speculation stays off for it."""
    model = tiny_model()
    bind(tmp_path, monkeypatch, api="(1, 5)")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        assert not engine.rewinds and engine.device_prefixes
        prompt = looping_prompts(model, 1)[0]
        (plain,), _ = run(engine, [prompt], 0, params)
        (fast,), sched = run(engine, [prompt], 4, params)
    assert fast == plain and sched.drafted == 0



def test_the_pipelined_decode_stops_after_the_step_it_runs_ahead() -> None:
    """``send(False)`` to the pipelined greedy decode gives the token of the step in flight and launches none
    after it: the tokens are an uninterrupted run's first ones, and no step ran that nobody took."""
    from kestrel_cuda.forward import DeviceForward
    from kestrel_cuda.ops_numpy import NumpyOps

    model = tiny_model()
    prompt = np.array(looping_prompts(model, 1)[0])
    runs = []
    for stop in (False, True):
        fwd = DeviceForward(ops=NumpyOps())
        first = int(np.argmax(fwd.forward(model, 1, prompt, 0, False)[-1]))
        tokens = fwd.greedy(model, 1, first, len(prompt), 10)
        got = [next(tokens) for _ in range(3)]
        if stop:
            got.append(tokens.send(False))
            assert next(tokens, None) is None
            assert fwd.counters["decode_tokens"] == 4 and fwd._seqs[1].length == len(prompt) + 4
        else:
            got += list(tokens)
        runs.append(got)
    assert runs[1] == runs[0][:4]


def test_the_async_engine_guesses_on_the_device(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Concurrent requests through the AsyncEngine with guesses: each gets its answer without guesses, one whose
    caller leaves midway is aborted, a ``call`` between steps finds the engine free, and at the end every block
    and device sequence is released."""
    import asyncio

    from kestrel_core.model.async_engine import AsyncEngine

    model = tiny_model()
    bind(tmp_path, monkeypatch)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = looping_prompts(model, 4, seed=3)
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        want, _ = run(engine, prompts, 0, params)
        engine.speculate = 4
        front = AsyncEngine(engine)
        free: list[bool] = []

        async def consume(prompt: list[int], leave_after: int | None) -> list[int]:
            got: list[int] = []
            stream = front.generate(prompt, params)
            async for out in stream:
                got.extend(out.new_token_ids)
                if not free and len(got) >= 5:  # (the streams may all ask before the first answer)
                    free.append(not await front.call(lambda: front.scheduler.step_running))
                if leave_after is not None and len(got) >= leave_after:
                    await stream.aclose()
                    break
            return got

        async def main() -> list[list[int]]:
            front.start()
            got = await asyncio.gather(*(consume(p, 6 if i == 2 else None) for i, p in enumerate(prompts)))
            await front.shutdown(grace_s=5)
            return list(got)

        got = asyncio.run(main())
        fwd = engine.backend.plugin.FWD[0]
        assert [g for i, g in enumerate(got) if i != 2] == [w for i, w in enumerate(want) if i != 2]
        assert got[2] == want[2][:len(got[2])] and 6 <= len(got[2]) < 30
        assert free and all(free) and front.scheduler.accepted > 0
        assert engine.pool.free_blocks == engine.pool.num_blocks and not fwd._pool.held and not fwd._seqs


def test_a_request_decoding_alone_goes_on_right_after_another_ran_beside_it(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A request decodes alone (the pipelined greedy decode), another arrives and runs to its end beside it
    (batched steps), then the first decodes alone again: its answer is the one it gives alone throughout (its
    pipelined decode is left when the batch starts, not resumed over a cache the batch has moved on from)."""
    model = tiny_model()
    bind(tmp_path, monkeypatch)
    first = np.random.default_rng(7).integers(3, model.config.vocab_size, 20).tolist()
    other = looping_prompts(model, 1, seed=5)[0]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        (alone,), _ = run(engine, [first], 0, params)
        sched = Scheduler(engine)
        a = sched.add(first, params)
        got: list[int] = []
        for _ in range(6):
            got += [t for o in sched.step() for t in o.new_token_ids]
        b = sched.add(other, SamplingParams(max_tokens=5, ignore_eos=True))
        while sched.has_work:
            got += [t for o in sched.step() if o.request_id == a.request_id for t in o.new_token_ids]
        fwd = engine.backend.plugin.FWD[0]
    assert b.finished and fwd.counters["batch_steps"] > 0 and fwd.counters["graph_replays"] > 6
    assert got == alone


def test_switching_between_guesses_and_the_pipeline_moves_only_new_positions(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A long prompt's request that guesses now and then moves between its own cache (the pipelined decode, taken
    up again each time the guesses stop) and the pool (the checks) many times, each time copying only the
    positions the other side wrote since (a block at most more), not the whole context; its answer is the one
    without guesses."""
    model = tiny_model()
    bind(tmp_path, monkeypatch)
    prompt = np.random.default_rng(11).integers(3, model.config.vocab_size, 150).tolist()
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    with kestrel_core.load(model, backend="fwdcuda") as engine:
        (plain,), _ = run(engine, [prompt], 0, params)
        fwd = engine.backend.plugin.FWD[0]
        moves, copied = fwd.counters["pool_moves"], fwd.counters["pool_move_positions"]
        offered = engine.stats["offload"]["kestrel_decode_greedy"]["accepted"]
        (got,), sched = run(engine, [prompt], 4, params, lambda p: AnswerDrafts(len(p), plain, stretch=8))
        moves = fwd.counters["pool_moves"] - moves
        copied = fwd.counters["pool_move_positions"] - copied
        offered = engine.stats["offload"]["kestrel_decode_greedy"]["accepted"] - offered
    assert got == plain and sched.accepted > 0
    assert offered >= 3  # the pipelined decode taken up again in each stretch without guesses
    assert moves >= 4 and copied <= moves * (32 + 8 + 5)  # a block, a stretch and a check's rows at most


def test_a_request_that_outgrows_the_pool_ends_once_with_all_its_text(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A lone request that fills the whole KV pool (128 positions) ends at its length there, with guesses as
    without: one finished output, after every token, and the whole text (the stop string's held-back start
    flushed at the end, not before the last tokens)."""
    model = tiny_model()
    bind(tmp_path, monkeypatch)
    prompt = np.random.default_rng(3).integers(3, model.config.vocab_size, 20).tolist()
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    with kestrel_core.load(model, backend="fwdcuda") as roomy:
        (answer,), _ = run(roomy, [prompt], 0, params)
    with kestrel_core.load(model, backend="fwdcuda", kv_cache_mb=0.1875) as engine:
        held = "".join(chr(ord("a") + t % 26) for t in answer)[-1]
        stop = held + "?"  # never met; its start is held back at the end of the answer so far
        engine.tokenizer = Letters()
        outputs: dict[int, list[tuple[list[int], str, bool, str | None]]] = {}
        for speculate in (0, 3):
            engine.speculate = speculate
            sched = Scheduler(engine)
            request = sched.add(prompt, replace(params, stop=(stop,)))
            request.lookup = AnswerDrafts(len(prompt), answer)
            got = outputs[speculate] = []
            while sched.has_work:
                got += [(o.new_token_ids, o.new_text, o.finished, o.finish_reason) for o in sched.step()]
    for got in outputs.values():
        tokens = [t for ids, _, _, _ in got for t in ids]
        assert 100 < len(tokens) < 128 and tokens == answer[:len(tokens)]
        assert [(done, reason) for _, _, done, reason in got if done] == [(True, "length")] and got[-1][2]
        assert "".join(text for _, text, _, _ in got) == Letters().decode(tokens)
    assert outputs[3] != outputs[0]  # the guesses ran: the tokens came in other steps


class Letters:
    """Token t as the letter a + t mod 26."""

    eos_token_ids = ()

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)
