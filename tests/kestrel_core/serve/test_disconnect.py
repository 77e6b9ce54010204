"""A client that leaves before its whole (non-streamed) answer, on each API's route: the server learns it from the
connection's ``http.disconnect`` (``generation.unless_disconnected``), and the engine takes the abort at its next
step. The engine's steps wait, the answer part-way, until the server has asked for the abort: what is counted is
the tokens made after it asked (none), not seconds nor steps that a busy machine's event loop lets pass."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import pytest

from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.request import RequestOutput
from kestrel_core.serve.server import KestrelServer

from ..waits import wait_until
from .helpers import wait_idle

NAME = "tiny"
HI = [{"role": "user", "content": "Hi"}]
# a greedy answer of 200 tokens on every route (tiny-qwen3 says no end of text to "Hi" within them)
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": ("/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 200, "temperature": 0}),
    "chat": ("/v1/chat/completions", {"model": NAME, "messages": HI, "max_tokens": 200, "temperature": 0}),
    "ollama": ("/api/chat", {"model": NAME, "messages": HI, "stream": False,
                             "options": {"num_predict": 200, "temperature": 0}}),
    "anthropic": ("/v1/messages", {"model": NAME, "messages": HI, "max_tokens": 200, "temperature": 0}),
    "responses": ("/v1/responses", {"model": NAME, "input": "Hi", "max_output_tokens": 200, "temperature": 0}),
}


class Held(AsyncEngine):
    """tiny-qwen3, whose steps, once ``hold_rows`` tokens have been made (None: never), wait for ``go``
    (``holding`` set meanwhile); ``asked``: the tokens made when each abort was asked for (the server asks again
    for one the generator's end asked for)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, max_batch=8)
        self.hold_rows: int | None = None
        self.holding, self.go = threading.Event(), threading.Event()
        self.asked: list[int] = []
        step = self.scheduler.step

        def held() -> list[RequestOutput]:
            if self.hold_rows is not None and self.counters.step_rows >= self.hold_rows:
                self.holding.set()
                self.go.wait()  # the test lets it go, whatever happens
            return step()

        self.scheduler.step = held  # type: ignore[method-assign]

    def abort(self, request_id: str) -> None:
        self.asked.append(self.counters.step_rows)
        super().abort(request_id)


@pytest.fixture(scope="module")
def async_engine(engine: Any) -> Held:
    return Held(engine)


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_client_that_leaves_a_whole_answer_is_aborted_at_the_next_step(server: KestrelServer, async_engine: Held,
                                                                         route: str) -> None:
    path, body = ROUTES[route]
    data = json.dumps(body).encode()
    counters = async_engine.counters
    aborted = counters.finished.get("abort", 0)
    async_engine.asked.clear()
    async_engine.holding.clear()
    async_engine.go.clear()
    async_engine.hold_rows = counters.step_rows + 3  # decoding its answer
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            wait_until(async_engine.holding.is_set, "the answer's third token")
        wait_until(lambda: bool(async_engine.asked), "the server asking for the abort")  # the steps wait meanwhile
    finally:
        async_engine.hold_rows = None
        async_engine.go.set()
    wait_idle(async_engine)
    assert counters.finished.get("abort", 0) == aborted + 1, "the request ran to its end"
    assert async_engine.asked[0] == counters.step_rows, "tokens made after the abort was first asked for"
