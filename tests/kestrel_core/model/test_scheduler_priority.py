"""The scheduling policies: fcfs admits in arrival order and preempts the most recently admitted request; priority
admits by (priority, arrival), preempts the worst running request when one must grow, and lets a waiting request of
better priority preempt it for room. A preempted request gives the tokens it gives alone."""

from __future__ import annotations

import numpy as np
import pytest

import kestrel_core
from kestrel_core.errors import InvalidRequest, KestrelError
from kestrel_core.model.request import Request
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.scheduler import Scheduler
from kestrel_core.model.scoring import Scoring

from ..test_selftest import FORWARD_BATCH_BACKEND

SHORT = SamplingParams(max_tokens=4)




@pytest.fixture
def tight(model):
    """8 KV blocks of 32 positions (1 KiB a position)."""
    with kestrel_core.load(model, backend="cpu", kv_cache_mb=0.125) as engine:
        assert engine.pool.num_blocks == 8
        yield engine


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


def _run(scheduler: Scheduler, tokens: dict[str, list[int]], firsts: list[str] | None = None) -> None:
    """Steps until the scheduler has no work: each request's tokens, and the order of their first tokens."""
    while scheduler.has_work:
        for out in scheduler.step():
            if firsts is not None and out.new_token_ids and not tokens.get(out.request_id):
                firsts.append(out.request_id)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)


@pytest.mark.parametrize(
    ("policy", "priorities", "order"),
    [
        ("priority", [3, 1, 0, 1, 2], [2, 1, 3, 4, 0]),  # lower first; the two 1s in arrival order
        ("priority", [0, 0, 0], [0, 1, 2]),
        ("fcfs", [0, 0, 0, 0], [0, 1, 2, 3]),
    ],
)
def test_requests_are_admitted_by_priority_then_arrival(
    engine, policy: str, priorities: list[int], order: list[int]
) -> None:
    scheduler = Scheduler(engine, max_batch=1, policy=policy)  # one at a time: first tokens in admission order
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    requests = [scheduler.add([5 + i, 6, 7], params, priority=p) for i, p in enumerate(priorities)]
    firsts: list[str] = []
    _run(scheduler, {}, firsts)
    assert firsts == [requests[i].request_id for i in order]


def test_a_scoring_waits_in_its_place_by_priority(engine) -> None:
    scheduler = Scheduler(engine, max_batch=1, policy="priority")
    late = scheduler.add([5, 6, 7], SamplingParams(max_tokens=2), priority=2)
    scored = scheduler.add([8, 9, 10], Scoring(0), priority=1)
    firsts: list[str] = []
    while scheduler.has_work:
        firsts += [out.request_id for out in scheduler.step() if out.request_id not in firsts]
    assert firsts == [scored.request_id, late.request_id]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("priority", [True, 1.0, "1", None])
def test_a_priority_that_is_not_an_integer_is_refused(engine, policy: str, priority: object) -> None:
    with pytest.raises(InvalidRequest, match="priority must be an integer") as info:
        Scheduler(engine, policy=policy).add([1, 2], SHORT, priority=priority)  # type: ignore[arg-type]
    assert info.value.param == "priority"


def test_fcfs_refuses_a_priority_as_vllm_does(engine) -> None:
    scheduler = Scheduler(engine)
    with pytest.raises(InvalidRequest, match="Got priority -2 but Priority scheduling is not enabled") as info:
        scheduler.add([1, 2], SHORT, priority=-2)
    assert info.value.param == "priority" and not scheduler.has_work
    with pytest.raises(InvalidRequest, match="not enabled"):
        scheduler.add([1, 2], Scoring(0), priority=1)
    scheduler.add([1, 2], SHORT, priority=0)
    scheduler.close()
    with pytest.raises(KestrelError, match="fcfs, priority"):
        Scheduler(engine, policy="lifo")


@pytest.mark.parametrize(
    ("policy", "first_priority", "preempted"),
    [
        ("priority", 5, "first"),  # the worst, admitted first
        ("fcfs", 0, "second"),  # the most recently admitted: the one that must grow
    ],
)
def test_a_request_that_must_grow_preempts_the_worst(
    engine, tight, policy: str, first_priority: int, preempted: str
) -> None:
    """Two requests that together outgrow the KV cache, the second the first to want a block the cache has not: the
    one preempted is the worst by priority (under fcfs, the later one), recomputed with the tokens it gives alone
    (greedy)."""
    vocab = engine.config.vocab_size
    prompts = {"first": _prompt(60, 1, vocab), "second": _prompt(90, 2, vocab)}
    params = {
        "first": SamplingParams(max_tokens=90, ignore_eos=True),
        "second": SamplingParams(max_tokens=60, ignore_eos=True),
    }
    alone = {name: list(engine.generate(p, params=params[name])) for name, p in prompts.items()}
    scheduler = Scheduler(tight, max_batch=2, policy=policy)
    requests = {"first": scheduler.add(prompts["first"], params["first"], priority=first_priority)}
    tokens: dict[str, list[int]] = {}
    for _ in range(4):
        for out in scheduler.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    requests["second"] = scheduler.add(prompts["second"], params["second"])
    _run(scheduler, tokens)
    assert scheduler.preemptions > 0
    assert [name for name, r in requests.items() if r.preemptions] == [preempted]
    assert {name: tokens[r.request_id] for name, r in requests.items()} == alone
    assert tight.pool.free_blocks == tight.pool.num_blocks


@pytest.mark.parametrize(
    ("policy", "priorities", "preempts"),
    [
        ("priority", (5, 0), True),
        ("priority", (0, 0), False),  # of equal priority: it waits
        ("priority", (0, 5), False),
        ("fcfs", (0, 0), False),
    ],
)
def test_a_waiting_request_of_better_priority_preempts_for_room(
    engine, tight, policy: str, priorities: tuple[int, int], preempts: bool
) -> None:
    """A long request runs; another comes whose prompt the KV cache has no room for beside it. Of better priority,
    it preempts the running one and starts at once; otherwise it waits for it to finish. Both give the tokens they
    give alone."""
    vocab = engine.config.vocab_size
    long, late = _prompt(100, 3, vocab), _prompt(120, 4, vocab)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    alone = [list(engine.generate(p, params=params)) for p in (long, late)]
    scheduler = Scheduler(tight, max_batch=2, policy=policy)
    running = scheduler.add(long, params, priority=priorities[0])
    tokens: dict[str, list[int]] = {}
    while not tokens.get(running.request_id):
        for out in scheduler.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    waiting: Request = scheduler.add(late, params, priority=priorities[1])
    for out in scheduler.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert (waiting.request_id in tokens) is preempts  # its prompt ran in that very step
    assert running.preemptions == int(preempts) and waiting.preemptions == 0
    _run(scheduler, tokens)
    assert [tokens[running.request_id], tokens[waiting.request_id]] == alone
    assert tight.pool.free_blocks == tight.pool.num_blocks


def test_a_better_request_preempts_for_room_where_steps_start_ahead(model, tmp_path, monkeypatch) -> None:
    """On a backend that starts each step before the one running is in, its greedy rows fed on the device
    (``Engine.feeds``: the CUDA backend's whole steps), a waiting request of better priority preempts the running one
    for room as it does where steps run one at a time, rather than waiting for it to finish; both give the tokens
    they give alone."""
    (tmp_path / "fed.py").write_text(FORWARD_BATCH_BACKEND.format(mode="fed", name="fed"))
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "fed.py"))
    with kestrel_core.load(model, backend="fed", activations="q8", kv_cache_mb=0.125) as engine:
        assert engine.feeds and engine.pool.num_blocks == 8
        vocab = engine.config.vocab_size
        long, late = _prompt(100, 3, vocab), _prompt(120, 4, vocab)
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        alone = [list(engine.generate(p, params=params)) for p in (long, late)]
        scheduler = Scheduler(engine, max_batch=2, policy="priority")
        running = scheduler.add(long, params, priority=5)
        tokens: dict[str, list[int]] = {}
        while len(tokens.get(running.request_id, ())) < 2:
            for out in scheduler.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        waiting = scheduler.add(late, params, priority=0)
        for _ in range(2):  # the step on the device, then the one that preempts
            for out in scheduler.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert running.preemptions == 1 and tokens.get(waiting.request_id)
        _run(scheduler, tokens)
        assert [tokens[running.request_id], tokens[waiting.request_id]] == alone
        assert engine.pool.free_blocks == engine.pool.num_blocks
