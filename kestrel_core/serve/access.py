"""Per-request bookkeeping (one log line, the request metrics) and the API key check, as plain ASGI middleware.

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``: the wrapper sees the status when the response
starts and the end when its last byte is sent, so a stream is timed to its end, and it leaves ``receive``
alone, so a stream still notices a client that disconnects. The route stores its token counts in the
``RequestRecord`` this middleware puts in the scope.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kestrel_core.errors import KestrelError
from kestrel_core.model.validate import strict_text
from kestrel_core.serve.errors import APIError
from kestrel_core.serve.metrics import ServerMetrics

log = logging.getLogger("kestrel.serve")

GENERATION_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/api/chat",
                        "/api/generate", "/infill")
EMBEDDING_ENDPOINTS = ("/v1/embeddings", "/v1/score", "/v1/rerank", "/v2/rerank", "/api/embed", "/api/embeddings")
ENDPOINTS = (*GENERATION_ENDPOINTS, *EMBEDDING_ENDPOINTS, "/v1/models", "/v1/messages/count_tokens", "/api/tags",
             "/api/show", "/api/ps", "/api/version", "/health", "/metrics")
DEFAULT_MAX_REQUEST_BYTES = 32_000_000  # a full context of any model here is a few MB of text
CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer: logs and metrics only
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def loggable(text: object) -> str:
    """``text`` with its control characters and line separators written as escapes (``\\n``, ``\\x1b``): a
    request's path is decoded from the URL, so raw it could forge log lines or drive the reader's terminal."""
    return _CONTROL_CHARS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


@dataclass
class RequestRecord:
    """What one request did: its status, its tokens, and when its tokens came (for TTFT and ITL)."""

    metrics: ServerMetrics | None = None
    start: float = field(default_factory=time.perf_counter)
    status: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    body_cut: bool = False  # the client left before it had sent the whole body: nobody reads the answer

    def tokens(self, n: int) -> None:
        """``n`` new tokens arrived now (one engine output)."""
        if n <= 0:
            return
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            if self.metrics is not None:
                self.metrics.time_to_first_token.observe(now - self.start)
        elif self.metrics is not None and self.last_token_at is not None:
            self.metrics.inter_token_latency.observe(now - self.last_token_at)
        self.last_token_at = now
        self.completion_tokens += n


def record_of(request: Request) -> RequestRecord:
    """The request's record (a fresh one when the app runs without the middleware, e.g. in a unit test)."""
    record = request.scope.get("kestrel.record")
    if record is None:
        record = request.scope["kestrel.record"] = RequestRecord()
    return record


class AccessMiddleware:
    """Times each HTTP request, logs one line for it and counts it in the metrics."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(self.metrics)
        scope["kestrel.record"] = record

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:  # a bug, not bad input: one line (the traceback with -v), a 500 if we still can
            log.error("%s %s failed: %s: %s", scope.get("method"), loggable(scope.get("path")), type(exc).__name__,
                      loggable(exc), exc_info=log.isEnabledFor(logging.DEBUG))
            if record.status == 0:
                error = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
                await error.response(scope.get("path", ""))(scope, receive, send_wrapper)
        finally:
            self._finish(scope, record)

    def _finish(self, scope: Scope, record: RequestRecord) -> None:
        duration = time.perf_counter() - record.start
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS or path.startswith("/v1/models/") else "other"
        endpoint = "/v1/models" if endpoint.startswith("/v1/models/") else endpoint
        status = CLIENT_CLOSED if record.body_cut or not record.status else record.status
        self.metrics.observe_request(endpoint, status, duration, record.prompt_tokens, record.completion_tokens)
        if path in ("/health", "/metrics") and status < 400:
            level = logging.DEBUG  # probes and scrapes would drown the requests
        else:
            level = logging.INFO
        if log.isEnabledFor(level):
            tokens = (f" prompt={record.prompt_tokens} completion={record.completion_tokens}"
                      if path in GENERATION_ENDPOINTS else f" prompt={record.prompt_tokens}"
                      if path in EMBEDDING_ENDPOINTS else "")
            log.log(level, "%s %s %d%s %.3fs", scope.get("method", "?"), loggable(path), status, tokens, duration)


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``) on /v1/*, /v2/*, /api/*, /tokenize,
    /detokenize and /infill; /health and /metrics stay open for probes and scrapers."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()  # Anthropic's clients send it as x-api-key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = path.startswith(("/v1/", "/v2/", "/api/")) or path in ("/tokenize", "/detokenize", "/infill")
        if scope["type"] == "http" and guarded and not self._allowed(scope):
            error = APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error.response(path)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        headers = scope.get("headers", ())
        bearer: Any = next((v for k, v in headers if k == b"authorization"), b"")
        key: Any = next((v for k, v in headers if k == b"x-api-key"), b"")
        return secrets.compare_digest(bytes(bearer), self.expected) or secrets.compare_digest(bytes(key), self.key)


def checked_api_key(api_key: object) -> str | None:
    """``api_key`` as the key requests must send, stripped as a header's value is read, or None for none; a blank
    one fails closed (it would serve without a key), as one that is no text does."""
    if api_key is None:
        return None
    if not isinstance(api_key, str):
        raise KestrelError(f"api_key must be a str (None: no key), got {type(api_key).__name__}")
    if not api_key.strip():
        raise KestrelError("api_key is blank: give a key, or None to serve without one")
    return strict_text(api_key.strip(), "api_key")


def _hostname(authority: str) -> str:
    """The host of a Host header or an origin's authority ("[::1]:8000" -> "::1"), lowercased."""
    authority = authority.rpartition("@")[2].lower()
    if authority.startswith("["):
        return authority[1:].partition("]")[0]
    return authority.partition(":")[0] if authority.count(":") == 1 else authority


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#@\s]+/?", re.IGNORECASE)


def check_origins(origins: Sequence[str]) -> tuple[str, ...]:
    """--allowed-origins' values: '*', or a page's origin as a browser's Origin header names it, SCHEME://HOST[:PORT];
    a value no header can match (no scheme, a path, blanks) is refused rather than silently allowing nothing."""
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise KestrelError(f"--allowed-origins: {origin!r} is not a web page's origin: SCHEME://HOST[:PORT], as "
                               "a browser names the page (https://app.example), or '*'")
    return tuple(origins)


def is_loopback(host: str) -> bool:
    """A loopback name or address (127.0.0.1.evil.example is neither: a name anyone can point anywhere)."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BrowserGuardMiddleware(CORSMiddleware):
    """What a web page makes a browser send, refused: a page can POST to a local server without a preflight (a
    text/plain body), and with DNS rebinding (its own name resolved to 127.0.0.1) read the answers. On a loopback
    address (``loopback``) only loopback Host names are answered; an ``Origin`` header (browsers send it, API
    clients do not) must be a loopback page's or one of ``allowed_origins`` ("*": any), as Ollama has it.

    An allowed page's requests are answered as Starlette's CORS middleware answers them: its preflights here,
    before the API key is asked for (a browser sends none with a preflight), allowing any method and the headers
    it asks for, and its other requests with ``Access-Control-Allow-Origin`` naming it, so the page can read them."""

    def __init__(self, app: ASGIApp, loopback: bool, allowed_origins: tuple[str, ...] = ()) -> None:
        super().__init__(app, allow_methods=("*",), allow_headers=("*",))
        self.loopback = loopback
        self.allowed = {o.rstrip("/").lower() for o in allowed_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            problem = self._problem(dict(scope.get("headers", ())))
            if problem is not None:
                await APIError(403, problem, code="forbidden").response(scope.get("path", ""))(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def is_allowed_origin(self, origin: str) -> bool:
        """The page ``origin`` is one of the allowed ones, or the loopback's."""
        if "*" in self.allowed:
            return True
        text = origin.rstrip("/").lower()
        scheme, sep, authority = text.partition("://")
        return text in self.allowed or bool(sep) and scheme in ("http", "https") and is_loopback(_hostname(authority))

    def _problem(self, headers: dict[bytes, bytes]) -> str | None:
        host = headers.get(b"host")
        if self.loopback and host is not None and not is_loopback(_hostname(host.decode("latin-1"))):
            return (f"the Host {host.decode('latin-1')[:80]!r} is not this server's: it listens on a loopback "
                    "address (a web page's DNS rebinding?)")
        origin = headers.get(b"origin")
        if origin is None or self.is_allowed_origin(origin.decode("latin-1")):
            return None
        return (f"requests from the web page {origin.decode('latin-1').rstrip('/').lower()[:80]!r} are refused: "
                "a browser sent them (kestrel serve --allowed-origins lets a page's origin in)")


class BodyTooLarge(HTTPException):
    """A request body over the server's limit; an HTTPException, so FastAPI's body reader lets it through to the
    app's error handlers, which answer it in the API's shape."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is over this server's limit of {max_bytes / 1e6:g} MB "
                              "(kestrel serve --max-request-mb)")


class BodyLimitMiddleware:
    """A request body over ``max_bytes`` is a 413, raised before the body is read past the limit: the server
    holds a body whole (then parses and tokenizes it, several times its size), so one unbounded request could
    take its memory. A client that leaves before its body is all sent is marked on its record: it counts as
    gone (499), not as the 400 its cut body gets."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((bytes(v) for k, v in scope.get("headers", ()) if k == b"content-length"), b"")
        refused = declared.isdigit() and int(declared) > self.max_bytes  # at the first read, before any byte
        received, whole = 0, False

        async def counted() -> Message:
            nonlocal received, whole
            if refused:
                raise BodyTooLarge(self.max_bytes)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                whole = not message.get("more_body", False)
                if received > self.max_bytes:  # a chunked body, or one longer than it said
                    raise BodyTooLarge(self.max_bytes)
            elif message["type"] == "http.disconnect" and not whole and "kestrel.record" in scope:
                scope["kestrel.record"].body_cut = True  # counted as the client's leaving, not as a bad body
            return message

        await self.app(scope, counted, send)


class JsonBodyMiddleware:
    """Every route takes a JSON body: one sent as ``curl -d`` sends it (application/x-www-form-urlencoded,
    Ollama's documented examples), as text/plain or with no content type is read as JSON too, as Ollama
    reads it."""

    READ_AS_JSON = (b"", b"application/x-www-form-urlencoded", b"text/plain")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = list(scope.get("headers", ()))
            kind = next((bytes(v) for k, v in headers if k == b"content-type"), b"")
            if kind.split(b";")[0].strip().lower() in self.READ_AS_JSON:
                scope = {**scope, "headers": [(k, v) for k, v in headers if k != b"content-type"]
                         + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)

