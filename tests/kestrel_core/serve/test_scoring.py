"""An echoed completions prompt scored (``echo`` with ``logprobs``) is a request like any other: a client that
leaves stops it, a drain refuses a new one and waits for one in flight, capacity counts it. Through a real server
on tiny-qwen3; a scoring is held by ``HeldScoring`` until the test lets it go on."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.scheduler import Scheduler
from kestrel_core.model.scoring import Scoring
from kestrel_core.serve.server import KestrelServer

from ..waits import HANG_GUARD_S, wait_until
from .helpers import openai_client, running_server

NAME = "tiny"
PROMPT = "The capital of France is Paris, and"


class HeldScoring:
    """The scheduler's first scoring held once admitted (its sequence and blocks taken), none of its prompt run,
    until ``go_on`` is set: the steps go on without it meanwhile; later scorings run as they come."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = threading.Event()  # the held scoring was admitted
        self.closed = threading.Event()  # it ended (scored or stopped), its sequence given back
        self.go_on = threading.Event()
        self.scorings = 0
        self.request: Any = None
        add, schedule, finish = Scheduler.add, Scheduler._schedule, Scheduler._finish

        def counted(sched: Scheduler, prompt_ids: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
            request = add(sched, prompt_ids, params, *args, **kwargs)
            if isinstance(params, Scoring):
                self.scorings += 1
                self.request = request if self.scorings == 1 else self.request
            return request

        def held(sched: Scheduler, ahead: Any = None) -> Any:
            work = schedule(sched, ahead)
            if self.go_on.is_set() or self.request is None or self.request.seq is None:
                return work
            self.started.set()
            time.sleep(0.001)  # a step's worth of work, without the model
            return [w for w in work if w[0] is not self.request]

        def ended(sched: Scheduler, request: Any, reason: str) -> None:
            finish(sched, request, reason)
            if request is self.request:
                self.closed.set()

        monkeypatch.setattr(Scheduler, "add", counted)
        monkeypatch.setattr(Scheduler, "_schedule", held)
        monkeypatch.setattr(Scheduler, "_finish", ended)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldScoring]:
    scoring = HeldScoring(monkeypatch)
    try:
        yield scoring
    finally:
        scoring.go_on.set()  # a scoring that was not stopped ends


def _all_idle(ae: AsyncEngine, engine: Any) -> bool:
    return not (ae.active or ae.num_running or ae.num_waiting) and engine.pool.free_blocks == engine.pool.num_blocks


def test_a_client_that_leaves_during_scoring_stops_it(server: KestrelServer, async_engine: AsyncEngine,
                                                      engine: Any, held: HeldScoring) -> None:
    """The scoring stops (its chunks closed, its sequence back) once the connection closes, as a generation does;
    held, it would go on until the test ends."""
    alone = _echo_scores(engine, held)
    body = f'{{"model": "{NAME}", "prompt": "{PROMPT}", "echo": true, "logprobs": 1, "max_tokens": 0}}'.encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD_S) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert held.started.wait(HANG_GUARD_S)
    assert held.closed.wait(HANG_GUARD_S), "the scoring went on after its client left"
    wait_until(lambda: _all_idle(async_engine, engine), "idle, every block free")
    assert _echo(openai_client(server)).choices[0].logprobs.token_logprobs == alone  # the server goes on


def _echo(client: openai.OpenAI) -> Any:
    return client.completions.create(model=NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)


def test_a_drain_refuses_a_new_scoring_and_waits_for_one_in_flight(engine: Any, held: HeldScoring) -> None:
    """As for a generation: a scoring that comes during the drain is a 503 before any of it runs, one in flight
    counts as a request (the log says so) and finishes within the grace."""
    alone = _echo_scores(engine, held)
    ae = AsyncEngine(engine)
    said: list[str] = []
    # a handler of the server's logger itself: `kestrel serve` stops that logger's records reaching the root's
    logger, handler = logging.getLogger("kestrel.serve"), _Said(said)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with running_server(ae, NAME, shutdown_grace_s=HANG_GUARD_S) as server, ThreadPoolExecutor(1) as pool:
            client = openai_client(server)
            in_flight = pool.submit(_echo, client)
            assert held.started.wait(HANG_GUARD_S)
            assert ae.active == 1
            server.request_shutdown()
            wait_until(lambda: not ae.accepting, "the drain begun")
            with pytest.raises(openai.InternalServerError) as refused:
                _echo(client)
            assert refused.value.status_code == 503 and held.scorings == 1  # refused before its scoring began
            held.go_on.set()
            answer = in_flight.result(HANG_GUARD_S)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert answer.choices[0].logprobs.token_logprobs == alone
    assert any("1 request(s) in flight" in line for line in said), said


class _Said(logging.Handler):
    def __init__(self, said: list[str]) -> None:
        super().__init__(logging.INFO)
        self.said = said

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def test_a_scoring_the_engines_stop_ends_is_a_503(engine: Any, held: HeldScoring) -> None:
    """A shutdown's, as every route answers: not a 429, which the client would retry against an exiting server."""
    ae = AsyncEngine(engine)
    with running_server(ae, NAME, shutdown_grace_s=0) as server, ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(_echo, openai_client(server))
        assert held.started.wait(HANG_GUARD_S)
        server.request_shutdown()
        with pytest.raises(openai.InternalServerError) as ended:
            in_flight.result(HANG_GUARD_S)
    assert ended.value.status_code == 503 and ended.value.code == "server_shutting_down"
    assert held.closed.is_set() and engine.pool.free_blocks == engine.pool.num_blocks


def test_a_scoring_takes_a_place_of_the_capacity(engine: Any, held: HeldScoring) -> None:
    """One place (--max-batch 1 --max-waiting 0): while a scoring holds it, another scoring and a generation are
    429s before they run, as a generation beside a generation is."""
    alone = _echo_scores(engine, held)
    ae = AsyncEngine(engine, max_batch=1, max_waiting=0)
    with running_server(ae, NAME) as server, ThreadPoolExecutor(1) as pool:
        client = openai_client(server)
        in_flight = pool.submit(_echo, client)
        assert held.started.wait(HANG_GUARD_S)
        with pytest.raises(openai.RateLimitError, match="capacity"):
            _echo(client)
        assert held.scorings == 1
        with pytest.raises(openai.RateLimitError, match="capacity"):
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
        held.go_on.set()
        assert in_flight.result(HANG_GUARD_S).choices[0].logprobs.token_logprobs == alone
        assert len(_echo(client).choices[0].logprobs.token_logprobs) > 1  # the place is back


def _echo_scores(engine: Any, held: HeldScoring) -> list[float | None]:
    """The echoed prompt's token logprobs, as the engine scores it alone (the first token has none); before the
    test's server scores anything."""
    ids = list(engine.tokenizer.encode(PROMPT))
    return [None] + [e.logprob for e in engine.prompt_logprobs(ids, 1)]


def test_an_echo_that_generates_keeps_its_place_from_scoring_to_generation(engine: Any,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """One place (--max-batch 1 --max-waiting 0): an echo with logprobs that also generates is scored, and a
    generation that comes before its own starts is the 429, not the echo that was admitted first."""
    ae = AsyncEngine(engine, max_batch=1, max_waiting=0)
    scored, go = threading.Event(), threading.Event()
    generate = ae.generate

    async def after_the_scoring(*args: Any, **kwargs: Any) -> Any:  # the echo's generation waits for the test
        if not scored.is_set():
            scored.set()
            await asyncio.to_thread(go.wait, 30)
        async for out in generate(*args, **kwargs):
            yield out

    monkeypatch.setattr(ae, "generate", after_the_scoring)
    entered, release = threading.Event(), threading.Event()
    start_batch = engine.start_batch

    def held(*args: Any, **kwargs: Any) -> Any:  # a generation that got the place keeps it until released
        if scored.is_set() and not release.is_set():
            entered.set()
            release.wait(HANG_GUARD_S)
        return start_batch(*args, **kwargs)

    monkeypatch.setattr(engine, "start_batch", held)
    with running_server(ae, NAME) as server, ThreadPoolExecutor(2) as pool:
        client = openai_client(server)
        echo = pool.submit(client.completions.create, model=NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3)
        try:
            assert scored.wait(HANG_GUARD_S)
            other = pool.submit(client.completions.create, model=NAME, prompt=PROMPT, max_tokens=3)
            while not (other.done() or entered.is_set()):
                time.sleep(0.01)
        finally:
            release.set()
            go.set()
        answer = echo.result(HANG_GUARD_S).choices[0]
        with pytest.raises(openai.RateLimitError, match="capacity"):
            other.result(HANG_GUARD_S)
    prompt_tokens = len(engine.tokenizer.encode(PROMPT))
    assert answer.text.startswith(PROMPT) and len(answer.logprobs.token_logprobs) == prompt_tokens + 3


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_of_several_sequences_takes_its_places_at_once_or_none(engine: Any, monkeypatch: pytest.MonkeyPatch,
                                                                         stream: bool) -> None:
    """Capacity 2 with one place held: a request of n=2 is the 429 before any of its sequences starts (none is
    admitted and then aborted), and with both places free it runs whole."""
    ae = AsyncEngine(engine, max_batch=1, max_waiting=1)
    started: list[str] = []
    enqueue = ae._enqueue

    def counted(*args: Any, **kwargs: Any) -> Any:
        queued = enqueue(*args, **kwargs)
        started.append(queued[0])
        return queued

    monkeypatch.setattr(ae, "_enqueue", counted)
    with running_server(ae, NAME) as server:
        client = openai_client(server)
        with ae.places(1):
            with pytest.raises(openai.RateLimitError, match="capacity"):
                answer = client.completions.create(model=NAME, prompt=PROMPT, n=2, max_tokens=3, stream=stream)
                if stream:
                    list(answer)
        assert started == [] and ae.active == 0
        answer = client.completions.create(model=NAME, prompt=PROMPT, n=2, max_tokens=3, stream=stream)
        choices = {c.index for c in (list(answer) if stream else [answer]) for c in c.choices}
        assert choices == {0, 1} and len(started) == 2
