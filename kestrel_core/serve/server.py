"""Run the app under uvicorn, programmatically, with kestrel's own graceful shutdown.

uvicorn's own SIGTERM handling closes the listening socket first and, once done, re-raises the signal (the
process then dies of it, exit status -15). kestrel's ``KestrelServer`` instead drains: on the first SIGTERM
or SIGINT the engine stops accepting (new requests get 503, ``/health`` says 503 so a load balancer moves
away) while the socket stays open, running requests get up to ``shutdown_grace_s`` to finish and the rest
are aborted, then uvicorn closes its connections and ``serve`` returns (exit 0). A second signal aborts
the running requests at once (still a clean exit); a third drops the connections at once: one line says so and
``serve`` returns 130, an interrupted command's status. The requests uvicorn cancels then (or when its own
graceful timeout runs out) are not logged with their CancelledError's traceback unless the log is verbose, and
that timeout is a line of kestrel's shutdown, not uvicorn's error record.

The socket is bound before uvicorn starts, so a busy port is a one-line error and port 0 (any free port)
is known, and announced, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from kestrel_core.console import timed_log_handler
from kestrel_core.entry import INTERRUPTED_EXIT
from kestrel_core.errors import KestrelError, os_error
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.engine import Engine
from kestrel_core.model.hub import parse_hub_spec
from kestrel_core.model.request_queue import FCFS
from kestrel_core.model.rerank import is_reranker
from kestrel_core.model.scheduler import DEFAULT_MAX_BATCH, DEFAULT_MAX_WAITING
from kestrel_core.model.validate import check_int
from kestrel_core.serve.access import DEFAULT_MAX_REQUEST_BYTES, is_loopback
from kestrel_core.serve.app import create_app
from kestrel_core.serve.connection import DEFAULT_LIMITS, ConnectionLimits, protocol_with

log = logging.getLogger("kestrel.serve")

DEFAULT_SHUTDOWN_GRACE_S = 30.0
_MODEL_SUFFIXES = (".gguf", ".kst", ".safetensors")


def default_model_name(source: str) -> str:
    """A short public name from ``engine.source``: "SmolLM2-135M-Instruct (/cache/x.gguf)" ->
    "SmolLM2-135M-Instruct", "/models/Qwen3-0.6B" -> "Qwen3-0.6B", "q.q8.kst" -> "q.q8", and a Hub name as it
    was given, "Qwen/Qwen3-0.6B (/hf/cache/...)" -> "Qwen/Qwen3-0.6B" (as vLLM names it); each LoRA adapter merged
    into it named after it, "/models/Qwen3-0.6B + LoRA my-adapter" -> "Qwen3-0.6B-+-LoRA-my-adapter"."""
    model, *adapters = source.split(" + LoRA ")
    head = model.split(" (", 1)[0].strip().rstrip("/\\")
    if " (" in model and parse_hub_spec(head) is not None:
        name = head
    else:
        name = Path(head).name if head else ""
        for suffix in _MODEL_SUFFIXES:
            if name.lower().endswith(suffix):
                name = name[: -len(suffix)]
    return re.sub(r"\s+", "-", " + LoRA ".join([name, *adapters])) or "kestrel"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one); a one-line KestrelError if it cannot be."""
    if not isinstance(host, str):
        raise KestrelError(f"host must be a str, got {type(host).__name__}")
    check_int("port", port, 0, 65535)  # getaddrinfo would take 70000 for 4464
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise os_error(exc, "cannot listen on", f"{host}:{port}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise os_error(exc, "cannot listen on", f"{host}:{port}") from None
    sock.set_inheritable(True)
    return sock


def raise_open_file_limit(target: int = 65536) -> None:
    """Each connection holds a file descriptor: lift the soft limit (often 1,024) towards ``target`` within the
    hard one, as vLLM's server does, so a burst of clients meets ConnectionLimits before accept() runs out."""
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class KestrelServer(uvicorn.Server):
    """uvicorn's server with a drain-then-exit shutdown (``request_shutdown``, or SIGTERM/SIGINT in the main
    thread); it serves on ``sock``."""

    def __init__(self, config: uvicorn.Config, async_engines: list[AsyncEngine], sock: socket.socket,
                 shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
        super().__init__(config)
        self.async_engines = async_engines  # one a model
        self.sock = sock
        self.shutdown_grace_s = shutdown_grace_s
        self.url = url_of(sock)
        self.port: int = sock.getsockname()[1]
        self.on_started: Callable[[KestrelServer], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Future[None] | None = None
        self._signals = 0
        self._ready = threading.Event()

    def run_forever(self) -> int:
        """Serve until shut down (blocking); the process's exit status: 0 once drained, 130 where a third signal
        forced the exit."""
        uvicorn_log = logging.getLogger("uvicorn.error")
        quiet = _QuietCancellations(self.config.timeout_graceful_shutdown)
        uvicorn_log.addFilter(quiet)
        try:
            self.run(sockets=[self.sock])
        finally:
            uvicorn_log.removeFilter(quiet)
        return INTERRUPTED_EXIT if self.force_exit else 0

    def wait_started(self, timeout: float) -> bool:
        """For a server running in another thread: True once it accepts requests."""
        return self._ready.wait(timeout)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            self._ready.set()
            if self.on_started is not None:
                self.on_started(self)

    # -- shutdown ------------------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        """Drain, then exit (thread-safe); a second call aborts the running requests, a third drops the
        connections."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self.should_exit = True
            return
        loop.call_soon_threadsafe(self._shutdown_now)

    @property
    def active(self) -> int:
        """Requests in flight, over every model."""
        return sum(ae.active for ae in self.async_engines)

    def _shutdown_now(self) -> None:
        self._signals += 1
        if self._signals == 1:
            if self.active:
                log.info("kestrel serve: shutting down: %d request(s) in flight get up to %.0f s to finish "
                         "(signal again to abort them)", self.active, self.shutdown_grace_s)
            else:
                log.info("kestrel serve: shutting down")
            self._drain = asyncio.ensure_future(self._drain_then_exit(self.shutdown_grace_s))
        elif self._signals == 2:  # abort what runs: the streams end with an error event, the answers with 503
            log.info("kestrel serve: aborting %d request(s)", self.active)
            if self._drain is not None:
                self._drain.cancel()
            self._drain = asyncio.ensure_future(self._drain_then_exit(0.0))
        else:  # still not gone: uvicorn drops its connections and cancels their requests
            log.info("kestrel serve: forced exit: dropping %d connection(s)", len(self.server_state.connections))
            self.force_exit = True
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets=sockets)
        if self.force_exit:  # uvicorn skips the app's lifespan end then: its task, cancelled as the loop closes,
            await self.lifespan.shutdown()  # would be logged with a traceback; the engines' stop is quick

    async def _drain_then_exit(self, grace_s: float) -> None:
        await asyncio.gather(*(ae.shutdown(grace_s) for ae in self.async_engines))
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT drain instead of uvicorn's close-and-re-raise (the main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29 calls this instead of capture_signals
        return

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.request_shutdown()


UVICORN_GRACEFUL_TIMEOUT = "timeout graceful shutdown exceeded"  # the end of uvicorn's record of it


class _QuietCancellations(logging.Filter):
    """Drops uvicorn's record of a request it cancelled (its CancelledError's traceback, "Exception in ASGI
    application"): a forced exit or uvicorn's graceful timeout cancels the requests on purpose, which is no error
    to show the user; the verbose log (``-v``) keeps them. uvicorn's error record of its graceful timeout ("Cancel
    N running task(s), ...") becomes a line of kestrel's shutdown, in its words."""

    def __init__(self, graceful_timeout_s: float | None) -> None:
        super().__init__()
        self.graceful_timeout_s = graceful_timeout_s or 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.endswith(UVICORN_GRACEFUL_TIMEOUT):
            count = record.args[0] if isinstance(record.args, tuple) and record.args else "the"
            log.info("kestrel serve: cancelling %s request(s) still open %g s after the models stopped", count,
                     self.graceful_timeout_s)
            return False
        error = record.exc_info[1] if record.exc_info else None
        return error is None or not _cancelled(error) or log.isEnabledFor(logging.DEBUG)


def _cancelled(error: BaseException) -> bool:
    """A cancellation, or a group of them (a task group's; the ``exceptiongroup`` backport's before Python 3.11)."""
    group = getattr(error, "exceptions", None)
    if isinstance(group, tuple) and group:
        return all(isinstance(e, BaseException) and _cancelled(e) for e in group)
    return isinstance(error, asyncio.CancelledError)


def warm_up(async_engine: AsyncEngine) -> None:
    """Two tokens through the engine before the port opens: the first step of a fresh process loads the
    compiled kernels (seconds on a CPU), which would otherwise land on the first client's request. On the
    scheduler's thread, where every step of the server runs (see ``AsyncEngine.run_sync``)."""
    engine = async_engine.engine
    ids = [i % engine.config.vocab_size for i in range(8)]
    if engine.config.pooling is not None:  # an embedding model: it only embeds
        async_engine.run_sync(lambda: engine.embed([ids]))
    else:
        async_engine.run_sync(lambda: list(engine.generate(ids, max_tokens=2, stop_at_eos=False)))


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Every object alive on entry (the models, their tokenizers, the app, the modules) moved to the collector's
    permanent generation, which no collection walks, until the exit. A full collection stops every thread for as
    long as it takes to walk what it reaches: ~180,000 objects once the default model is loaded and warmed up and
    its app built, 53-62 ms on the CPU VM, and a request body of millions of objects sets off one after another
    (docs/performance.md). Objects alive at startup mostly live as long as the server (a cycle of them that dies
    sooner waits for the exit); those made later are collected as ever. The heap is unfrozen on the way out unless
    the caller had frozen one: an embedding program's collector is left as it was."""
    gc.collect()  # garbage frozen now would stay until the exit
    ours = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        yield
    finally:
        if ours:
            gc.unfreeze()


@contextlib.contextmanager
def default_logging() -> Iterator[None]:
    """What uvicorn does for its own loggers, where nothing would show the server's records (a program that
    configured no logging: neither the ``kestrel`` loggers nor the root logger have a handler): the command's
    stderr handler on ``kestrel.serve``, at INFO where it has no level of its own, while the server runs, so
    that its startup line and request lines are printed. A program's own logging is left to show them as it
    configured it, and the command's (``_setup_logging``) is a handler already."""
    logger = logging.getLogger("kestrel.serve")
    if logger.hasHandlers():
        yield
        return
    handler, level = timed_log_handler(), logger.level
    logger.addHandler(handler)
    if level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def build_server(engines: Mapping[str, AsyncEngine], *, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
                 sock: socket.socket | None = None, pooling: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, allowed_origins: Sequence[str] = (),
                 connection_limits: ConnectionLimits = DEFAULT_LIMITS, **uvicorn_options: Any) -> KestrelServer:
    """The app over ``engines`` (public name -> AsyncEngine, the first the default) in a KestrelServer bound to
    host:port (or serving ``sock``, already bound), not yet running; ``allowed_origins``: web pages whose browser
    requests it answers besides the loopback's (access.BrowserGuardMiddleware); ``connection_limits``: how long
    and how much a client may hold a connection without progress (connection.ConnectionLimits)."""
    sock = sock if sock is not None else bind_socket(host, port)
    bound = sock.getsockname()[0]
    app = create_app(engines, api_key=api_key, pooling=pooling, max_request_bytes=max_request_bytes,
                     loopback=is_loopback(str(bound)), allowed_origins=tuple(allowed_origins))
    options: dict[str, Any] = {"log_config": None, "log_level": "warning", "access_log": False,
                               "lifespan": "on", "timeout_graceful_shutdown": 5.0,
                               "http": protocol_with(connection_limits)}
    options.update(uvicorn_options)
    config = uvicorn.Config(app, **options)
    return KestrelServer(config, list(engines.values()), sock, shutdown_grace_s)


def serve(engines: Any, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, *,
          max_batch: int = DEFAULT_MAX_BATCH, max_waiting: int = DEFAULT_MAX_WAITING,
          token_budget: int | None = None, model_names: Sequence[str | None] = (),
          shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S, sock: socket.socket | None = None,
          pooling: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          allowed_origins: Sequence[str] = (), scheduling_policy: str = FCFS) -> int:
    """Serve an engine, or a list of them (the first answers requests that name no model), over HTTP until
    SIGTERM/SIGINT; returns the process's exit status: 0 once drained, 130 where a third signal forced the exit
    (``KestrelServer.run_forever``). ``model_names``: their public names (default:
    from each model's source); ``sock``: a socket bound already (``bind_socket``), e.g. to fail on a busy port
    before loading a model; ``pooling``: the embeddings' (None: each model's); ``max_request_bytes``: the largest
    request body taken (a larger one is a 413); ``allowed_origins``: build_server's; ``scheduling_policy``: the
    schedulers', fcfs or priority (kestrel_core.model.request_queue). Its lines go to stderr where the program
    configured no logging (``default_logging``)."""
    engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
    for engine in engines:
        if not isinstance(engine, Engine):
            raise KestrelError(f"serve takes an Engine (kestrel_core.load) or a list of them, got "
                               f"{type(engine).__name__}")
    named: dict[str, AsyncEngine] = {}
    for i, engine in enumerate(engines):
        given = model_names[i] if i < len(model_names) else None
        name = given or default_model_name(str(getattr(engine, "source", "")))
        if name in named:
            raise KestrelError(f"two models are named {name!r}: give each its own --served-model-name")
        named[name] = AsyncEngine(engine, max_batch=max_batch, token_budget=token_budget, max_waiting=max_waiting,
                                  policy=scheduling_policy)
    with default_logging():
        for ae in named.values():
            warm_up(ae)
        raise_open_file_limit()
        server = build_server(named, host=host, port=port, api_key=api_key, shutdown_grace_s=shutdown_grace_s,
                              sock=sock, pooling=pooling, max_request_bytes=max_request_bytes,
                              allowed_origins=allowed_origins)

        def announce(s: KestrelServer) -> None:
            auth = ", API key required" if api_key else ""
            described = ", ".join(_describe(name, ae.engine, pooling) for name, ae in named.items())
            log.info("kestrel serve: %s/v1 (%s; max batch %d, %s scheduling%s)", s.url, described, max_batch,
                     scheduling_policy, auth)

        server.on_started = announce
        try:
            with frozen_heap():  # every model is loaded (serve loads none later) and its kernels warmed up
                status = server.run_forever()
        finally:  # a no-op after a drain; after a forced exit it aborts what is left and stops the thread
            async def stop() -> None:
                await asyncio.gather(*(ae.shutdown(0.0) for ae in named.values()))
            asyncio.run(stop())
        log.info("kestrel serve: stopped")
        return status


def _describe(name: str, engine: Any, pooling: str | None) -> str:
    """One model in the startup line: its name, what it does, its backend, the draft model that guesses its
    tokens, the sampling it recommends."""
    pooled = engine.config.pooling
    kind = (", a reranker (/v1/rerank, /v1/score)" if is_reranker(engine.config) else
            f", embeddings only ({pooling or pooled} pooling)" if pooled else "")
    draft = getattr(engine, "draft_model", None)
    drafts = (f", draft model {draft.engine.source} guessing up to {engine.speculate} tokens a step"
              if draft is not None and getattr(engine, "speculate", 0) else "")
    sampling = ", ".join(f"{k} {v:g}" for k, v in engine.sampling_defaults.items())
    recommends = f", sampling by default as it recommends: {sampling}" if sampling and not pooled else ""
    return f"model {name}{kind}, backend {getattr(engine, 'backend_name', '?')}{drafts}{recommends}"
