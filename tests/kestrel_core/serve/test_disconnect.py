"""A client that leaves before its whole (non-streamed) answer, on each API's route: the server learns it from the
connection's ``http.disconnect`` (``generation.unless_disconnected``), and the engine takes the abort at its next
step. Latency is counted in the engine's steps, each made to last ``PACE`` seconds at least, not in seconds."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.request import RequestOutput
from kestrel_core.serve.server import KestrelServer

NAME = "tiny"
PACE = 0.02  # seconds a step lasts at least: a 200-token answer runs for seconds, a second is 50 steps
MAX_STEPS = 5  # the step under way, the one that takes the abort, and room for a busy machine's event loop
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


@pytest.fixture(scope="module")
def async_engine(engine: Any) -> AsyncEngine:
    """tiny-qwen3 at ``PACE`` a step at least."""
    front = AsyncEngine(engine, max_batch=8)
    step = front.scheduler.step

    def paced() -> list[RequestOutput]:
        time.sleep(PACE)
        return step()

    front.scheduler.step = paced  # type: ignore[method-assign]
    return front


def _until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition`` (a guard against a hang, not a bound the test checks: 30 s)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come within 30 s"
        time.sleep(0.002)


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_client_that_leaves_a_whole_answer_is_aborted_at_the_next_step(server: KestrelServer,
                                                                         async_engine: AsyncEngine,
                                                                         route: str) -> None:
    path, body = ROUTES[route]
    data = json.dumps(body).encode()
    counters = async_engine.counters
    aborted = counters.finished.get("abort", 0)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        _until(lambda: async_engine.num_running == 1)
        started = counters.steps
        _until(lambda: counters.steps >= started + 3)  # decoding its answer
        steps = counters.steps
    _until(lambda: async_engine.active == 0)  # at the latest once its 200 tokens are done
    assert counters.finished.get("abort", 0) == aborted + 1, "the request ran to its end"
    assert counters.steps - steps <= MAX_STEPS
