"""ConnectionLimits on a clock the test moves (connection.LimitedHttpProtocol driven by hand, uvicorn's own
request handling inside it): a limit is checked at the moment the clock passes it, so a pause shorter than a limit
is shorter however busy the machine (over a real socket, a busy machine can stretch any pause past any limit)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from kestrel_core.serve.connection import ConnectionLimits, LimitedHttpProtocol, protocol_with

# powers of two: the clock's sums are exact
LIMITS = ConnectionLimits(head_timeout_s=1.0, max_head_bytes=4096, body_idle_s=1.0, write_stall_s=1.0)
KEEP_ALIVE_S = 4.0  # uvicorn's timeout_keep_alive: the idle time allowed between two requests


@dataclass
class Timer:
    when: float
    callback: Callable[[], object]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class Task:
    def add_done_callback(self, callback: Callable[[Any], object]) -> None:
        pass


class Clock:
    """The parts of an event loop the protocol uses: ``time`` and ``call_later`` on a clock that moves only by
    ``advance`` (which runs each timer at its time, in order), and ``create_task``, whose coroutines (the app
    answering a request) run to their end when ``run_tasks`` says."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[Timer] = []
        self.tasks: list[Coroutine[Any, Any, Any]] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Timer:
        timer = Timer(self.now + delay, functools.partial(callback, *args))
        self.timers.append(timer)
        return timer

    def create_task(self, coro: Coroutine[Any, Any, Any], **_: Any) -> Task:
        self.tasks.append(coro)
        return Task()

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while due := [t for t in self.timers if not t.cancelled and t.when <= end]:
            timer = min(due, key=lambda t: t.when)
            self.timers.remove(timer)
            self.now = timer.when
            timer.callback()
        self.now = end

    def run_tasks(self) -> None:
        while self.tasks:
            try:
                self.tasks.pop(0).send(None)
            except StopIteration:
                continue
            raise AssertionError("the app waited for something the test does not give")

    def drop_tasks(self) -> None:
        """The coroutines not run (answers to requests whose connection was closed), closed unrun."""
        while self.tasks:
            self.tasks.pop().close()


class Transport:
    """The server's end of a connection: what was written to it, and whether it was closed."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def bytes_read(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An app that answers how many bytes the request's body had."""
    size, more = 0, True
    while more:
        message = await receive()
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    body = b"%d" % size
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def connection() -> tuple[Clock, Transport, LimitedHttpProtocol]:
    """A connection just opened, at time 0."""
    clock, transport = Clock(), Transport()
    config = uvicorn.Config(bytes_read, http=protocol_with(LIMITS), log_config=None, lifespan="off",
                            timeout_keep_alive=KEEP_ALIVE_S)
    protocol = protocol_with(LIMITS)(config=config, server_state=ServerState(), app_state={},
                                     _loop=clock)  # type: ignore[arg-type]
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return clock, transport, protocol


def test_a_head_sent_a_line_at_a_time_is_closed_at_its_deadline() -> None:
    """The deadline is the whole head's, not a pause between its lines: a line every quarter of the limit, and
    the connection is closed as the clock reaches the limit, not before."""
    clock, transport, protocol = connection()
    protocol.data_received(b"GET /health HTTP/1.1\r\n")
    for _ in range(3):
        clock.advance(LIMITS.head_timeout_s / 4)
        protocol.data_received(b"X-Slow: 1\r\n")
    assert not transport.closed
    clock.advance(LIMITS.head_timeout_s / 4)
    assert transport.closed and clock.now == LIMITS.head_timeout_s and transport.written == b""


def test_a_body_that_keeps_coming_is_read_to_its_end() -> None:
    """Eight pieces, each three quarters of body_idle_s after the one before (six times the limit in all):
    answered; a body that then stops for body_idle_s is closed at that moment."""
    clock, transport, protocol = connection()
    protocol.data_received(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 8\r\n\r\n")
    for _ in range(8):
        clock.advance(LIMITS.body_idle_s * 3 / 4)
        assert not transport.closed
        protocol.data_received(b"x")
    clock.run_tasks()
    assert transport.written.startswith(b"HTTP/1.1 200 OK") and transport.written.endswith(b"\r\n\r\n8")
    assert not transport.closed

    protocol.data_received(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 8\r\n\r\nxxx")
    clock.advance(LIMITS.body_idle_s * 3 / 4)
    assert not transport.closed
    clock.advance(LIMITS.body_idle_s / 4)
    assert transport.closed
    clock.drop_tasks()


def test_a_kept_alive_connection_serves_its_next_request_after_a_pause() -> None:
    """Between two requests the head's deadline does not run: a pause of twice head_timeout_s, then the next
    request is answered on the same connection; uvicorn's keep-alive limit closes it after a longer pause."""
    clock, transport, protocol = connection()
    protocol.data_received(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    clock.run_tasks()
    assert transport.written.count(b"HTTP/1.1 200 OK") == 1
    clock.advance(2 * LIMITS.head_timeout_s)
    assert not transport.closed
    protocol.data_received(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    clock.run_tasks()
    assert transport.written.count(b"HTTP/1.1 200 OK") == 2 and not transport.closed
    clock.advance(KEEP_ALIVE_S)
    assert transport.closed
