"""An echoed completions prompt scored (``echo`` with ``logprobs``) is a request like any other: a client that
leaves stops it, a drain refuses a new one and waits for one in flight, capacity counts it. Through a real server
on tiny-qwen3; a scoring is held part-way by ``HeldScoring`` until the test lets it go on."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.sampling import TokenLogprob
from kestrel_core.serve.server import KestrelServer

from .helpers import openai_client

NAME = "tiny"
PROMPT = "The capital of France is Paris, and"


class HeldScoring:
    """``Engine.prompt_logprob_chunks`` whose first scoring holds its sequence after its first chunk, answering
    empty chunks on each call, until ``go_on`` is set; later scorings are the engine's own."""

    def __init__(self, engine: Any) -> None:
        self.own = engine.prompt_logprob_chunks
        self.started = threading.Event()  # the held scoring has run its first chunk
        self.closed = threading.Event()  # it was closed (ended or stopped), its sequence given back
        self.go_on = threading.Event()
        self.scorings = 0

    def __call__(self, ids: list[int], top: int = 0) -> Iterator[list[TokenLogprob]]:
        self.scorings += 1
        return self._held(ids, top) if self.scorings == 1 else self.own(ids, top)

    def _held(self, ids: list[int], top: int) -> Iterator[list[TokenLogprob]]:
        own = self.own(ids, top)
        try:
            yield next(own)
            self.started.set()
            while not self.go_on.is_set():
                time.sleep(0.001)  # a chunk's worth of work, without the model
                yield []
            yield from own
        finally:
            own.close()
            self.closed.set()


@pytest.fixture
def held(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldScoring]:
    scoring = HeldScoring(engine)
    monkeypatch.setattr(engine, "prompt_logprob_chunks", scoring)
    try:
        yield scoring
    finally:
        scoring.go_on.set()  # a scoring that was not stopped ends


def _all_idle(ae: AsyncEngine, engine: Any) -> bool:
    for _ in range(200):
        if not (ae.active or ae.num_running or ae.num_waiting) and engine.pool.free_blocks == engine.pool.num_blocks:
            return True
        time.sleep(0.02)
    return False


def test_a_client_that_leaves_during_scoring_stops_it(server: KestrelServer, async_engine: AsyncEngine,
                                                      engine: Any, held: HeldScoring) -> None:
    """The scoring stops (its chunks closed, its sequence back) once the connection closes, as a generation does;
    held, it would go on until the test ends."""
    body = f'{{"model": "{NAME}", "prompt": "{PROMPT}", "echo": true, "logprobs": 1, "max_tokens": 0}}'.encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert held.started.wait(10)
    assert held.closed.wait(10), "the scoring went on after its client left"
    assert _all_idle(async_engine, engine)
    answer = openai_client(server).completions.create(model=NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    scored = engine.prompt_logprobs(engine.tokenizer.encode(PROMPT), 1)
    assert answer.choices[0].logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in scored], abs=1e-6)
