"""uvicorn's httptools protocol with limits on what a connection may hold without making progress.

Under httptools uvicorn bounds neither a request head's size nor how long a connection may sit before its first
request, trickle its body or leave its answer unread; each of those held a socket, and an endless header value
held the event loop while the parser re-joined it. ``ConnectionLimits`` sets:

- ``head_timeout_s``: the request line and headers arrive within this of the connection opening or of the
  request's first byte (idle time between the requests of a kept-alive connection is uvicorn's
  ``timeout_keep_alive``);
- ``max_head_bytes``: a longer head is answered 431 and the connection closes (h11 caps heads at 16 KB, nginx at
  32 KB; 64 KiB leaves room for large bearer tokens and cookies);
- ``body_idle_s``: a request body that gets no byte for this long closes the connection (the route sees a
  disconnect);
- ``write_stall_s``: an answer the client has not read from for this long (the socket's buffers full) aborts the
  connection, so an abandoned stream does not hold its request and its socket forever.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("kestrel.serve")


@dataclass(frozen=True)
class ConnectionLimits:
    """How long and how much a client may hold a connection without progress (the module's docstring)."""

    head_timeout_s: float = 20.0
    max_head_bytes: int = 64 * 1024
    body_idle_s: float = 60.0
    write_stall_s: float = 60.0


DEFAULT_LIMITS = ConnectionLimits()


def _plain_response(status: bytes, message: str) -> bytes:
    body = message.encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class LimitedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that enforces ``limits`` (``protocol_with``: a subclass with other limits)."""

    limits: ClassVar[ConnectionLimits] = DEFAULT_LIMITS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True  # the next bytes are a request's head (False from its headers to its end)
        self._head_bytes = 0
        self._last_read = 0.0
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read(self.limits.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._read_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._read_timer = self._write_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._last_read = self.loop.time()
        if self._reading_head and self._read_timer is None:  # a kept-alive connection's next request begins
            self._arm_read(self.limits.head_timeout_s)
        # The head is fed at most the bytes it has left, so an oversized one is refused before the parser joins it.
        # Bytes past a head's end in the same piece are not counted against a pipelined next head.
        while data and self._reading_head:
            room = self.limits.max_head_bytes - self._head_bytes
            if room <= 0:
                self._close(_plain_response(b"431 Request Header Fields Too Large",
                                            f"request head over {self.limits.max_head_bytes} bytes"),
                            "a request head over the limit")
                return
            piece, data = data[:room], data[room:]
            self._head_bytes += len(piece)
            super().data_received(piece)
            if self.transport.is_closing():
                return
        if data:
            super().data_received(data)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._arm_read(self.limits.body_idle_s)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading_head, self._head_bytes = True, 0
        self._cancel_read()
        super().on_message_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_stall_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _arm_read(self, delay: float) -> None:
        self._cancel_read()
        self._read_timer = self.loop.call_later(delay, self._read_deadline)

    def _cancel_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_deadline(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self._reading_head:
            if self.cycle is not None and not self.cycle.response_complete:
                self._arm_read(self.limits.head_timeout_s)  # a pipelined head waits for the answer before it
                return
            self._close(None, f"no complete request head within {self.limits.head_timeout_s:g} s")
            return
        idle = self.loop.time() - self._last_read
        if idle < self.limits.body_idle_s or self.flow.read_paused:  # paused: the route is behind, not the client
            self._arm_read(max(self.limits.body_idle_s - idle, 0.05))
            return
        self._close(None, f"no byte of the request body for {self.limits.body_idle_s:g} s")

    def _write_stalled(self) -> None:
        self._write_timer = None
        if not self.transport.is_closing():
            log.info("closed a connection from %s: its answer unread for %g s", self._peer(), self.limits.write_stall_s)
            self.transport.abort()  # close() would wait for the unread bytes to drain

    def _close(self, response: bytes | None, reason: str | None = None) -> None:
        if reason is not None:
            log.info("closed a connection from %s: %s", self._peer(), reason)
        if response is not None:
            self.transport.write(response)
        self.transport.close()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"


def protocol_with(limits: ConnectionLimits) -> type[LimitedHttpProtocol]:
    """The protocol class for uvicorn's ``http`` option that enforces ``limits``."""
    if limits == LimitedHttpProtocol.limits:
        return LimitedHttpProtocol
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"limits": limits})
