"""Where a request's grammar and prompt are made: a grammar compiled once a request, whatever its choices, on the
grammars' own threads, and never where its client has gone before its turn; a grammar compiled once for every
request that sends it (the engine keeps it); a large conversation rendered on the large bodies' threads.

Not timed: the tests record the calls (their threads, their count) and hold the grammars' threads with work of
their own until the client has left.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from kestrel_core.model import grammar
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.grammar import Constraint
from kestrel_core.serve import app, offload
from kestrel_core.serve.offload import INLINE_BODY_BYTES
from kestrel_core.serve.server import KestrelServer

from ..waits import HANG_GUARD_S, wait_until
from .helpers import http, openai_client

NAME = "tiny"
HI = [{"role": "user", "content": "Hi"}]
ANSWER = {"type": "object", "additionalProperties": False, "required": ["a"], "properties": {"a": {"enum": ["x", "y"]}}}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


@pytest.fixture
def compiles(engine: Any, async_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Each grammar compiled for the model (its text, the thread that compiled it), as it is compiled, none kept
    from an earlier test."""
    async_engine.grammars.clear()
    made: list[tuple[str, str]] = []
    compile_one = engine.constraint

    def recorded(text: str) -> Constraint:
        made.append((text, threading.current_thread().name))
        return compile_one(text)

    monkeypatch.setattr(engine, "constraint", recorded)
    return made


def test_a_chat_grammar_is_compiled_once_for_all_its_choices(server: KestrelServer,
                                                              compiles: list[tuple[str, str]]) -> None:
    """n = 3 choices of one JSON Schema: one compile, on a grammars' thread; each choice keeps to the schema from
    its own place in it (choices sampled apart, each its whole JSON)."""
    body = {"model": NAME, "messages": HI, "n": 3, "max_tokens": 40, "temperature": 1.0, "seed": 7,
            "response_format": JSON_FORMAT}
    status, _, raw = http("POST", f"{server.url}/v1/chat/completions", body)
    assert status == 200, raw
    choices = json.loads(raw)["choices"]
    assert len(choices) == 3 and all(c["finish_reason"] == "stop" for c in choices), choices
    assert all(json.loads(c["message"]["content"])["a"] in ("x", "y") for c in choices), choices
    assert len(compiles) == 1 and compiles[0][1].startswith("kestrel-grammar"), compiles


def test_a_completions_grammar_is_compiled_once_for_its_prompts_and_choices(
        server: KestrelServer, compiles: list[tuple[str, str]]) -> None:
    """Two prompts of n = 2 under one guided_regex: four sequences, one compile."""
    body = {"model": NAME, "prompt": ["Hi", "Yes"], "n": 2, "max_tokens": 12, "temperature": 1.0, "seed": 3,
            "guided_regex": "(ab|cd)+x"}
    status, _, raw = http("POST", f"{server.url}/v1/completions", body)
    assert status == 200, raw
    choices = json.loads(raw)["choices"]
    assert len(choices) == 4 and len(compiles) == 1 and compiles[0][1].startswith("kestrel-grammar"), compiles


def test_a_schema_every_request_sends_is_compiled_once(server: KestrelServer, async_engine: AsyncEngine,
                                                     compiles: list[tuple[str, str]]) -> None:
    """The official client sends the same JSON Schema twice, then another: two compiles, and each answer keeps to
    its schema from its start (the kept grammar is never advanced: each request takes a copy)."""
    client = openai_client(server)
    other = {"type": "json_schema", "json_schema": {"name": "other", "schema": {
        "type": "object", "additionalProperties": False, "required": ["b"], "properties": {"b": {"enum": ["z"]}}}}}
    answers = [client.chat.completions.create(model=NAME, messages=HI, max_tokens=40,  # type: ignore[arg-type]
                                              temperature=1.0, seed=seed, response_format=fmt)
               for seed, fmt in [(1, JSON_FORMAT), (2, JSON_FORMAT), (3, other)]]
    said = [json.loads(a.choices[0].message.content or "") for a in answers]
    assert [a.choices[0].finish_reason for a in answers] == ["stop"] * 3, said
    assert said[0]["a"] in ("x", "y") and said[1]["a"] in ("x", "y") and said[2] == {"b": "z"}, said
    assert len(compiles) == 2 and compiles[0][0] != compiles[1][0] and len(async_engine.grammars) == 2, compiles


class HeldGrammarThreads:
    """Work of the test's own on every grammars' thread until ``release``; ``queued``: the futures of the work
    the server gave them meanwhile, as it gave it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.go, self.queued = threading.Event(), []
        started = threading.Semaphore(0)
        self.submit = submit = grammar._COMPILES.submit

        def hold() -> None:
            started.release()
            self.go.wait(2 * HANG_GUARD_S)

        self.holders = [submit(hold) for _ in range(grammar.GRAMMAR_THREADS)]
        for _ in self.holders:
            assert started.acquire(timeout=HANG_GUARD_S), "a grammars' thread did not take the test's work"

        def recorded(*args: Any, **kwargs: Any) -> Future[Any]:
            future = submit(*args, **kwargs)
            self.queued.append(future)
            return future

        monkeypatch.setattr(grammar._COMPILES, "submit", recorded)

    def release(self) -> None:
        self.go.set()
        for holder in self.holders:
            holder.result(HANG_GUARD_S)


@pytest.mark.parametrize(("path", "body", "making"), [
    ("/v1/chat/completions", {"messages": HI, "response_format": JSON_FORMAT}, "chat_grammar"),
    ("/v1/completions", {"prompt": "Hi", "guided_json": ANSWER}, "guided"),
], ids=["chat", "completions"])
def test_a_grammar_whose_client_has_gone_is_never_made(server: KestrelServer, monkeypatch: pytest.MonkeyPatch,
                                                       compiles: list[tuple[str, str]], path: str,
                                                       body: dict[str, Any], making: str) -> None:
    """Its request queued behind the grammars' threads (held), the client leaves: its grammar is neither made nor
    compiled once the threads are free, and nothing else waits on it."""
    made: list[str] = []
    make = getattr(app.Served, making)

    def recorded(self: Any, *args: Any) -> Any:
        made.append(threading.current_thread().name)
        return make(self, *args)

    monkeypatch.setattr(app.Served, making, recorded)
    held = HeldGrammarThreads(monkeypatch)
    try:
        data = json.dumps({"model": NAME, "max_tokens": 4, **body}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            wait_until(lambda: bool(held.queued), "the request's grammar waiting for a grammars' thread")
        wait_until(held.queued[0].cancelled, "the grammar of the client that left given up")
    finally:
        held.release()
    assert held.submit(lambda: "after").result(HANG_GUARD_S) == "after"  # the queue has moved past it
    assert made == [] and compiles == [] and len(held.queued) == 1


def test_a_free_text_request_does_not_wait_for_the_grammars_threads(server: KestrelServer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With every grammars' thread held, a chat request without a grammar is answered."""
    held = HeldGrammarThreads(monkeypatch)
    try:
        status, _, raw = http("POST", f"{server.url}/v1/chat/completions",
                              {"model": NAME, "messages": HI, "max_tokens": 2})
    finally:
        held.release()
    assert status == 200 and held.queued == [], raw


@pytest.fixture
def renders(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, float]]]:
    """Each chat prompt rendered: the thread it was rendered on and the GIL's switch interval meanwhile."""
    seen: list[tuple[str, float]] = []
    render: Callable[..., Any] = app.Served.chat_prompt

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((threading.current_thread().name, sys.getswitchinterval()))
        return render(self, *args, **kwargs)

    monkeypatch.setattr(app.Served, "chat_prompt", recorded)
    yield seen


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/chat/completions", {"max_tokens": 2}),
    ("/tokenize", {}),
    ("/v1/messages/count_tokens", {}),
])
def test_a_large_conversation_is_rendered_on_the_large_bodies_threads(server: KestrelServer, path: str,
                                                                       extra: dict[str, Any],
                                                                       renders: list[tuple[str, float]]) -> None:
    """Messages past INLINE_BODY_BYTES: rendered and tokenized on a large bodies' thread with the GIL's short
    switches (offload), the interval put back after; a small conversation on the loop's default executor at the
    interval as it was."""
    interval = sys.getswitchinterval()
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "Hi"} for i in range(601)]
    large = json.dumps({"model": NAME, "messages": many, **extra}).encode()
    assert len(large) > INLINE_BODY_BYTES
    status, _, raw = http("POST", f"{server.url}{path}", raw=large)
    assert status in (200, 400), raw  # a conversation past the tiny model's context: a 400 once rendered
    assert http("POST", f"{server.url}{path}", {"model": NAME, "messages": HI, **extra})[0] == 200
    assert len(renders) == 2, renders
    (large_on, large_interval), (small_on, small_interval) = renders
    assert large_on.startswith("kestrel-body") and large_interval == min(interval, offload.BODY_SWITCH_S), renders
    assert not small_on.startswith(("kestrel-body", "kestrel-test-server")), renders  # nor on the loop's thread
    assert small_interval == interval == sys.getswitchinterval(), renders
