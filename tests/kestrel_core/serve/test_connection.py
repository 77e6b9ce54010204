"""Connections that make no progress are closed (ConnectionLimits), against a real server on 127.0.0.1; where a
pause must stay shorter than a limit, test_connection_clock.py moves the clock instead."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest

from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.request import RequestOutput
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.serve.connection import ConnectionLimits
from kestrel_core.serve.server import KestrelServer, raise_open_file_limit

from ..waits import HANG_GUARD_S, wait_until
from .helpers import openai_client, running_server

NAME = "tiny-qwen3"
LIMITS = ConnectionLimits(head_timeout_s=0.5, max_head_bytes=4096, body_idle_s=0.5, write_stall_s=0.5)


class Paced(AsyncEngine):
    """Answers ``pieces`` outputs of ``piece_chars`` characters each, ``delay_s`` apart; ``ended`` records
    whether the last answer ran to its end or was given up (its client gone)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine, max_batch=4)
        self.pieces, self.piece_chars, self.delay_s = 3, 3, 0.0
        self.ended: list[str] = []

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, places: Any = None,
                       priority: int = 0, constraint: Any = None) -> AsyncIterator[RequestOutput]:
        try:
            for k in range(self.pieces):
                await asyncio.sleep(self.delay_s)
                last = k == self.pieces - 1
                yield RequestOutput(request_id or "r", [1], "x" * self.piece_chars, None, last,
                                    "stop" if last else None, len(prompt_ids), k + 1)
            self.ended.append("finished")
        except GeneratorExit:
            self.ended.append("given up")
            raise


@pytest.fixture(scope="module")
def async_engine(engine: Any) -> Paced:
    return Paced(engine)


@pytest.fixture(scope="module")
def server(async_engine: Paced) -> Iterator[KestrelServer]:
    with running_server(async_engine, NAME, connection_limits=LIMITS) as s:
        yield s


@pytest.fixture
def paced(async_engine: Paced) -> Iterator[Paced]:
    yield async_engine
    async_engine.pieces, async_engine.piece_chars, async_engine.delay_s = 3, 3, 0.0
    async_engine.ended.clear()


def _connect(server: KestrelServer, **options: int) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    for name, value in options.items():
        sock.setsockopt(socket.SOL_SOCKET, getattr(socket, name), value)
    sock.settimeout(HANG_GUARD_S)
    sock.connect((host, int(port)))
    return sock


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (reading past whatever it sent first) within HANG_GUARD_S: a guard, the
    server closes no such connection on its own but for the limit under test (uvicorn's keep-alive timeout starts
    after an answer)."""
    sock.settimeout(HANG_GUARD_S)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def _head(extra: bytes = b"") -> bytes:
    return b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra + b"\r\n"


def test_a_connection_that_sends_nothing_is_closed(server: KestrelServer) -> None:
    with _connect(server) as sock:
        assert _closed(sock)


def _status_of(sock: socket.socket) -> bytes:
    answer = b""
    while b"\r\n" not in answer:
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer.split(b"\r\n", 1)[0]


@pytest.mark.parametrize("over", [0, 1])
def test_a_head_is_taken_up_to_its_limit(server: KestrelServer, over: int) -> None:
    filler = LIMITS.max_head_bytes - len(_head(b"X-Fill: \r\n")) + over
    with _connect(server) as sock:
        sock.sendall(_head(b"X-Fill: " + b"a" * filler + b"\r\n"))
        status = _status_of(sock)
    assert status == (b"HTTP/1.1 200 OK" if over == 0 else b"HTTP/1.1 431 Request Header Fields Too Large")


def test_an_endless_header_is_refused_at_the_limit_not_read_to_its_end(server: KestrelServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Endless: ")
        with pytest.raises(OSError):  # refused and closed while the client is still sending
            for _ in range(200):
                sock.sendall(b"a" * 65536)
        assert _status_of(sock) == b"HTTP/1.1 431 Request Header Fields Too Large"
    with _connect(server) as sock:  # the server goes on
        sock.sendall(_head())
        assert _status_of(sock) == b"HTTP/1.1 200 OK"


def test_a_body_that_stops_coming_closes_its_connection(server: KestrelServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5000\r\n\r\n" + b'{"model": "x", "messages": [')
        assert _closed(sock)


def test_an_answer_slower_than_every_limit_is_not_cut(server: KestrelServer, paced: Paced) -> None:
    paced.pieces, paced.delay_s = 4, 0.4  # 1.6 s, over head_timeout_s, body_idle_s and write_stall_s
    client = openai_client(server)
    answer = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == "xxx" * 4 and paced.ended == ["finished"]
    streamed = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "xxx" * 4


def test_an_unread_stream_is_cut(server: KestrelServer, paced: Paced, caplog: pytest.LogCaptureFixture) -> None:
    """Cut once write_stall_s passes with its buffers full, nothing read meanwhile (the server says so): what was
    sent is there, the rest and [DONE] never come."""
    caplog.set_level(logging.INFO, logger="kestrel.serve")
    paced.pieces, paced.piece_chars = 400, 32_768  # 13 MB: more than the socket buffers hold
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    with _connect(server, SO_RCVBUF=4096) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        port = sock.getsockname()[1]
        wait_until(lambda: any(f":{port}: its answer unread for" in r.getMessage() for r in caplog.records),
                   "the connection cut")
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 20):
                received += chunk
    assert received.startswith(b"HTTP/1.1 200 OK")
    assert len(received) < paced.pieces * paced.piece_chars and b"data: [DONE]" not in received


def test_the_open_file_limit_is_raised_within_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        raise_open_file_limit(4096)
        wanted = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (wanted, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

