"""An asyncio front for the scheduler: requests from any coroutine, one thread running the batched steps.

The engine's steps are blocking numpy/numba work, so they run on a thread of their own; coroutines submit
requests and read each request's outputs from an asyncio queue. Leaving the ``generate`` iterator early (a
client that disconnected, a cancelled task) aborts the request, which frees its sequence at the next step.

Embeddings (``embed``) run there too, a step of an ``EmbedJob`` between two generation steps. Other engine
work of the process (a warm-up, a benchmark) goes through ``run_sync``/``call`` onto the same thread: numba's
OpenMP pool belongs to the thread that starts a parallel kernel, and kernels started from a second thread
run beside an idle pool of the first (measured on 2 cores: 47 tok/s decode instead of 110).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kestrel_core.errors import KestrelError, Overloaded, ShuttingDown
from kestrel_core.model.driver import check_engine
from kestrel_core.model.embed import EmbedJob
from kestrel_core.model.grammar import CompiledGrammars, Constraint
from kestrel_core.model.request import RequestOutput, check_added
from kestrel_core.model.request_queue import FCFS
from kestrel_core.model.sampling import SamplingParams, TokenLogprob
from kestrel_core.model.scheduler import DEFAULT_MAX_BATCH, DEFAULT_MAX_WAITING, Scheduler
from kestrel_core.model.scoring import Scoring
from kestrel_core.model.validate import check_int

log = logging.getLogger("kestrel")
T = TypeVar("T")
STOP_JOIN_S = 10.0  # how long a stop waits for the steps' thread to end its step


@dataclass
class Places:
    """Places of the capacity that one request took at once (``AsyncEngine.places``), kept from its admission to
    its end: each of its parts (its prompts' scorings, its choices) takes one as it starts and gives it back as
    it ends, so nothing that comes between two parts can take it."""

    left: int  # those no part holds now
    open: bool = True  # the request has not ended: a part's place comes back to it


@dataclass
class _Client:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    places: Places | None = None  # the request's places its place came from


@dataclass
class EngineCounters:
    """What the serving loop has done so far (the server's metrics read these)."""

    steps: int = 0
    step_rows: int = 0  # tokens run over all steps
    finished: dict[str, int] = field(default_factory=dict)  # finish reason (or "abort") -> requests
    failed_steps: int = 0


class AsyncEngine:
    """Continuous batching over an ``Engine`` for concurrent callers (the server, or any asyncio code); ``policy``:
    the scheduler's, fcfs or priority (kestrel_core.model.request_queue)."""

    def __init__(self, engine: Any, *, max_batch: int = DEFAULT_MAX_BATCH, token_budget: int | None = None,
                 max_waiting: int = DEFAULT_MAX_WAITING, policy: str = FCFS) -> None:
        check_engine(engine, "AsyncEngine")  # a closed one: its thread would run calls (``call``) on closed backends
        self.engine = engine
        self.scheduler = Scheduler(engine, max_batch=max_batch, token_budget=token_budget, max_waiting=max_waiting,
                                   policy=policy)
        self.counters = EngineCounters()
        # looked up at each compile, not bound here: tests count the engine's compiles
        self.grammars = CompiledGrammars(lambda grammar: self.engine.constraint(grammar))
        self._lock = threading.Lock()  # guards the inbox, the clients and the accepting flag
        self._wake = threading.Condition(self._lock)
        # ("add", (id, ids, params, constraint, priority)), ("abort", id), ("call", (fn, future))
        self._inbox: list[tuple[str, Any]] = []
        self._clients: dict[str, _Client] = {}
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._exited = False  # the thread returned: a call now would wait for ever
        self._embed_jobs: list[EmbedJob] = []  # those under way, oldest first
        self._held = 0  # places of the capacity requests took for their parts (``places``) and no part holds
        self._embed_short = False  # a job lacked blocks: the oldest runs alone until it is done
        self._deferred: list[Any] = []  # requests that came while a job lacked blocks: added once it is done
        # jobs waiting for KV blocks wake when some come back: the times they have, the waiting jobs' futures and
        # the pool's free blocks at the steps' thread's last look
        self._blocks_back = 0
        self._block_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._free_seen = 0
        self._next_id = 0
        on_close = getattr(engine, "on_close", None)
        if on_close is not None:  # closing the engine stops this thread, which holds it (and the model)
            on_close(self._stop)

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the steps' thread (a server does; else the first request or call), never once the engine has
        stopped: its thread may still be in a step (a stop waits STOP_JOIN_S for it), and no other may drive the
        engine beside it."""
        with self._lock:
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name="kestrel-scheduler", daemon=True)
                self._thread.start()

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop accepting; let running requests finish for up to ``grace_s``, abort the rest, stop the loop."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.get_running_loop().run_in_executor(None, self._stop)

    def _stop(self) -> None:
        """Abort what is left and stop the thread (waiting for its step to end, unless called from it)."""
        with self._lock:
            self._accepting = False
            for request_id in list(self._clients):
                self._inbox.append(("abort", request_id))
            self._stopping = True
            self._wake.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_JOIN_S)

    @property
    def capacity(self) -> int:
        """Requests in flight at most: the running batch and the queue behind it."""
        return self.scheduler.max_batch + self.scheduler.max_waiting

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def active(self) -> int:
        """Requests submitted and not finished, embedding requests, prompts being scored and the places requests
        hold for their next parts included."""
        with self._lock:
            return self._in_flight()

    def _in_flight(self) -> int:  # under the lock
        return len(self._clients) + len(self._embed_jobs) + self._held

    @property
    def num_waiting(self) -> int:
        return (self.scheduler.num_waiting + sum(1 for kind, _ in list(self._inbox) if kind == "add")
                + len(self._deferred))

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    # -- requests ------------------------------------------------------------------------------------

    def check(self, prompt_ids: Sequence[int], params: SamplingParams, priority: int = 0) -> list[int]:
        """The prompt's token ids as a list; InvalidRequest for a request that can never run, or a priority the
        policy does not take, before anything is built for it."""
        return self.scheduler.check(prompt_ids, params, priority)

    async def compile(self, grammar: str) -> Constraint:
        """A place of its own at the start of ``grammar`` (SamplingParams.grammar) for this model, compiled on the
        grammars' threads unless ``grammars`` keeps it (compiling a client's grammar may take a while, and the steps'
        thread does not wait for it). InvalidRequest for one that does not compile."""
        return await self.grammars.constraint(grammar)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | Scoring,
                       request_id: str | None = None, places: Places | None = None,
                       priority: int = 0, constraint: Constraint | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as its tokens come (a ``Scoring``'s: its prompt's logprobs, ``score``);
        InvalidRequest or Overloaded before the first one; ``places``: its request's (``places``), one of which it
        takes instead of a free one; ``priority``: under the priority policy, lower first; ``constraint``: its
        grammar's, compiled already (``compile``) and this request's alone, else compiled first."""
        ids = self.check(prompt_ids, params, priority)  # a bad request fails before its grammar is compiled
        if constraint is None and isinstance(params, SamplingParams) and isinstance(params.grammar, str):
            constraint = await self.compile(params.grammar)
        request_id, client = self._enqueue(ids, params, request_id, constraint, places, priority)
        finished = False
        try:
            while True:
                item = await client.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
               constraint: Constraint | None = None, priority: int = 0) -> tuple[str, _Client]:
        """Queue a request for the steps' thread: its id and the client its outputs go to."""
        # reads only the engine's config, pool size and policy: safe here
        ids = self.scheduler.check(prompt_ids, params, priority)
        return self._enqueue(ids, params, request_id, constraint, priority=priority)

    def _enqueue(self, ids: list[int], params: SamplingParams | Scoring, request_id: str | None,
                 constraint: Constraint | None, places: Places | None = None,
                 priority: int = 0) -> tuple[str, _Client]:
        """``submit`` for ids the scheduler has checked: a place of the capacity, or one of ``places``."""
        check_added(request_id, constraint)  # before it is a client's
        loop = asyncio.get_running_loop()
        with self._lock:
            if request_id is None:
                self._next_id += 1
                request_id = f"req-{self._next_id}"
            if request_id in self._clients:
                raise KestrelError(f"request id {request_id!r} is already in use")
            if places is None:
                self._check_room()
            elif self._stopping:  # a request admitted before a drain goes on within its grace, not after it
                raise ShuttingDown("the server is shutting down")
            elif places.left < 1 or not places.open:
                raise KestrelError("the request's places are all taken")
            else:
                places.left -= 1
                self._held -= 1
            client = _Client(loop, asyncio.Queue(), places)
            self._clients[request_id] = client
            self._inbox.append(("add", (request_id, ids, params, constraint, priority)))
            self._wake.notify()
        self.start()  # the steps' thread, on first use (a server starts it itself)
        return request_id, client

    def _check_room(self, places: int = 1) -> None:
        """ShuttingDown once the server stops accepting, Overloaded where the requests in flight (generations,
        scorings, embedding jobs and places held) leave fewer than ``places`` of the capacity; under the lock."""
        if not self._accepting:
            raise ShuttingDown("the server is shutting down")
        in_flight = self._in_flight()
        if in_flight + places > self.capacity:
            raise Overloaded(f"the server is at capacity ({in_flight} requests in flight); retry later")

    @contextlib.contextmanager
    def places(self, n: int) -> Iterator[Places]:
        """``n`` places of the capacity for one request of several parts (``generate``'s and ``score``'s
        ``places``), taken now or not at all (refused as ``generate`` refuses one request); those no part holds
        come back when the block ends, the others as their parts end."""
        check_int("places", n, 1)  # fewer than one would give the capacity more room than it has
        with self._lock:
            self._check_room(n)
            self._held += n
        places = Places(n)
        try:
            yield places
        finally:
            with self._lock:
                self._held -= places.left
                places.left, places.open = 0, False

    async def score(self, prompt_ids: Sequence[int], top: int = 0, places: Places | None = None,
                    priority: int = 0) -> list[TokenLogprob]:
        """The prompt's tokens after the first, each scored by the logits before it with the ``top`` likeliest
        alternatives (``Engine.prompt_logprobs``), as a request of the scheduler's (kestrel_core.model.scoring):
        refused, queued at its ``priority``, waiting for KV blocks and counted in ``active`` as a generation is, its
        chunks within the steps' token budget; ShuttingDown where the shutdown ends it. Its sequence goes back
        however it ends (the caller cancelled included)."""
        scoring = Scoring(top)
        ids = self.check(prompt_ids, scoring, priority)
        request_id, client = self._enqueue(ids, scoring, None, None, places, priority)
        scored: list[TokenLogprob] = []
        finished = False
        try:
            while not finished:
                item = await client.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.finish_reason == "abort":
                    raise ShuttingDown("the server shut down before the prompt was scored")
                scored += item.prompt_logprobs or []
            return scored
        finally:
            if not finished:
                self.abort(request_id)

    async def embed(self, inputs: Sequence[Sequence[int]], *, pooling: str | None = None,
                    dimensions: int | None = None) -> np.ndarray:
        """``Engine.embed``, a step at a time between the generation steps: InvalidRequest before any runs.
        A job the KV cache has no room for now waits for the blocks the running generation and the other jobs
        hold. Once one has waited, the oldest job runs alone until it is done: the others give their blocks back
        (each holds one input part-way at most, run again later) and wait, so no two jobs wait on each other's
        blocks, and generation requests that come meanwhile are held back, so that the running ones' blocks come
        back rather than go to newcomers. A waiting job tries again when blocks come back (a step or a call frees
        some) or the job before it is done. Overloaded where the requests in flight fill the capacity, or where
        nothing holds blocks that would come back."""
        job = EmbedJob(self.engine, inputs, pooling=pooling, dimensions=dimensions, budget=self.scheduler.token_budget)
        with self._lock:
            self._check_room()  # a request as a generation is
            self._embed_jobs.append(job)
        try:
            while not job.done:
                since = self._blocks_back  # before trying: blocks that come back meanwhile wake it at once
                if self._embed_short and self._embed_jobs[0] is not job:
                    if job.holding:
                        await self.call(job.pause)
                    await self._blocks_come_back(since)
                elif not await self.call(lambda: self._embed_step(job)):
                    self._embed_short = True
                    if self._embed_jobs[0] is job:  # another gives its blocks back first (above), then waits
                        await self._blocks_come_back(since)  # the running requests and jobs free blocks as they end
            return job.result()
        finally:
            with self._lock:
                first = self._embed_jobs[0] is job
                if first:  # the jobs behind it go on together while the blocks last
                    self._embed_short = False
                    self._inbox[:0] = [("add", payload) for payload in self._deferred]  # before later ones
                    self._deferred.clear()
                    self._wake.notify()
                self._embed_jobs.remove(job)
            if first:
                self._blocks_came_back()
            if not job.done:  # given up (an error, a client gone): its blocks go back after the step under way
                closing = self._post(job.close, closing=True)
                if closing.done() and isinstance(closing.exception(), ShuttingDown):
                    job.close()  # the steps' thread has stopped: nothing else drives the engine

    def _blocks_come_back(self, since: int) -> asyncio.Future[None]:
        """A future done once KV blocks have come back after the ``since``-th time (at once where they have), or
        ShuttingDown once the steps' thread has stopped (a job waiting its turn makes no call that would say so,
        and a done future gives the event loop no turn: it would go round for ever)."""
        loop = asyncio.get_running_loop()
        back: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._exited:
                back.set_exception(ShuttingDown("the engine's thread has stopped"))
            elif self._blocks_back != since:
                back.set_result(None)
            else:
                self._block_waiters.append((loop, back))
        return back

    def _blocks_came_back(self) -> None:
        """Wake the jobs waiting for KV blocks (from any thread)."""
        with self._lock:
            self._blocks_back += 1
            waiters, self._block_waiters = self._block_waiters, []
        for loop, back in waiters:
            _send(loop, _settle, back)

    def _look_at_free_blocks(self) -> None:
        """On the steps' thread, after its calls or a step: where the pool has more free blocks than at its last
        look, the jobs waiting for blocks try again."""
        free = self.scheduler.pool.free_blocks
        if free > self._free_seen:
            self._blocks_came_back()
        self._free_seen = free

    def _embed_step(self, job: EmbedJob) -> bool:
        """A step of ``job`` (on the engine's thread); False where the KV cache has no room for it now but the
        running requests (generations and prompts being scored) or another job hold blocks, which come back."""
        try:
            job.step()
            self.counters.steps += 1  # a batched step of the model, as a generation step is
        except Overloaded:
            with self._lock:
                others = [other for other in self._embed_jobs if other is not job]
            if self.scheduler.num_running or any(other.holding for other in others):
                return False
            raise
        return True

    def run_sync(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the scheduler's thread, between two steps (from any thread but an event loop's);
        ShuttingDown once the engine stops."""
        self.start()
        return self._post(fn).result()

    def _post(self, fn: Callable[[], T], *, closing: bool = False) -> concurrent.futures.Future[T]:
        """``fn`` for the steps' thread; ShuttingDown (the future's) once the engine stops, unless ``closing`` (work
        under way giving its blocks back), which the thread still runs where it has not returned yet."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._exited or self._stopping and not closing:
                done.set_exception(ShuttingDown("the engine has stopped"))
                return done
            self._inbox.append(("call", (fn, done)))
            self._wake.notify()
        return done

    async def call(self, fn: Callable[[], T]) -> T:
        """``run_sync`` for coroutines: the steps' thread wakes the caller's event loop with the result, so no worker
        thread of the loop's executor (which the server's prompt rendering shares) waits for it. ``fn`` runs even
        where the caller is cancelled meanwhile (a close that frees blocks must not be skipped)."""
        self.start()
        return await asyncio.wrap_future(self._post(fn))

    def abort(self, request_id: str) -> None:
        """Cancel a request (its sequence is freed at the next step); nothing if it already finished."""
        with self._lock:
            if request_id in self._clients:
                self._inbox.append(("abort", request_id))
                self._wake.notify()

    # -- the scheduler thread ------------------------------------------------------------------------

    def _run(self) -> None:
        sched = self.scheduler
        sched.on_start = self._admit  # requests that arrive while a step runs join the next one
        stalled = False  # the last step could start nothing: only what comes in (a call, an abort) frees blocks
        while True:
            with self._lock:
                while not self._inbox and (stalled or not sched.has_work) and not self._stopping:
                    self._wake.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            self._run_inbox(inbox)
            self._look_at_free_blocks()
            if stopping and not sched.has_work:
                with self._lock:
                    self._exited = not self._inbox  # a call that came meanwhile still runs
                if self._exited:
                    self._blocks_came_back()  # a job waiting for blocks tries again, and hears of the stop
                    return
                continue
            stalled = self._deliver_step(sched.step)
            self._look_at_free_blocks()

    def _run_inbox(self, inbox: list[tuple[str, Any]]) -> None:
        """What came in, in order: requests, aborts and calls."""
        sched = self.scheduler
        for kind, payload in inbox:
            if kind == "call":
                if sched.step_running:  # the engine is free once it is in (failed or not)
                    self._deliver_step(sched.drain)
                _run_call(*payload)
            else:
                self._take(kind, payload)

    def _admit(self) -> None:
        """Before a step is scheduled: the requests and aborts that arrived meanwhile (calls wait)."""
        with self._lock:
            taken = [item for item in self._inbox if item[0] != "call"]
            self._inbox = [item for item in self._inbox if item[0] == "call"]
        for kind, payload in taken:
            self._take(kind, payload)

    def _take(self, kind: str, payload: Any) -> None:
        sched = self.scheduler
        if kind == "add":
            request_id, ids, params, constraint, priority = payload
            with self._lock:
                if request_id not in self._clients:  # aborted while it was held back
                    return
                if self._embed_short:  # an embedding waits for blocks: the running requests give them back
                    self._deferred.append(payload)
                    return
            try:
                sched.add(ids, params, request_id, constraint, priority)
            except KestrelError as exc:
                self._deliver_error(request_id, exc)
        else:
            if payload in sched.requests:
                self.counters.finished["abort"] = self.counters.finished.get("abort", 0) + 1
            sched.abort(payload)
            self._drop(payload)

    def _deliver_step(self, step: Callable[[], list[RequestOutput]]) -> bool:
        """Run ``step`` (the scheduler's step or drain) and hand its outputs over; whether it was idle: no output,
        only waiting requests that could not start (their blocks are held outside the scheduler), not counted."""
        sched = self.scheduler
        try:
            outputs = step()
        except Exception as exc:  # a failed step ends its requests; the loop serves the next ones
            self.counters.failed_steps += 1
            log.error("kestrel: a batched step failed: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
            for request_id in self._orphans():
                self._deliver_error(request_id, KestrelError(f"the step failed: {exc}"))
            return False
        if not outputs and sched.stalled:
            return True
        self.counters.steps += 1
        self._deliver(outputs)
        return False

    def _orphans(self) -> list[str]:
        """Clients whose request the scheduler no longer holds (ended by a failed step)."""
        with self._lock:
            pending = {payload[0] for kind, payload in self._inbox if kind == "add"} | {p[0] for p in self._deferred}
            return [r for r in self._clients if r not in self.scheduler.requests and r not in pending]

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their clients: one wake-up of each event loop for the whole step, not one per
        request (each wake-up is a write to the loop's self-pipe and a turn of the loop)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestOutput]]] = {}
        for out in outputs:
            if out.error is not None:  # it failed alone: its client gets the error
                self.counters.finished["abort"] = self.counters.finished.get("abort", 0) + 1
                self._deliver_error(out.request_id, out.error if isinstance(out.error, KestrelError)
                                    else KestrelError(f"the request failed: {type(out.error).__name__}: {out.error}"))
        outputs = [out for out in outputs if out.error is None]
        with self._lock:
            for out in outputs:
                self.counters.step_rows += len(out.new_token_ids)
                client = self._clients.get(out.request_id)
                if out.finished and self._end_client(out.request_id) is not None:  # (an abort: when taken)
                    reason = out.finish_reason or "stop"
                    self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
                if client is not None:
                    by_loop.setdefault(client.loop, []).append((client.queue, out))
        for loop, items in by_loop.items():
            if not _send(loop, _put_all, items):  # its event loop closed with them running: nobody reads them
                for _, out in items:
                    if not out.finished:
                        self._take("abort", out.request_id)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            client = self._end_client(request_id)
        if client is not None:
            _send(client.loop, client.queue.put_nowait, exc)

    def _end_client(self, request_id: str) -> _Client | None:
        """A request's end (under the lock): its client, whose place goes back to its request's ``places`` while
        that request has not ended."""
        client = self._clients.pop(request_id, None)
        places = client.places if client is not None else None
        if places is not None and places.open:
            places.left += 1
            self._held += 1
        return client

    def _drop(self, request_id: str) -> None:
        with self._lock:
            client = self._end_client(request_id)
        if client is not None:  # the caller left: nobody reads this queue, but a shutdown abort is said
            _send(client.loop, client.queue.put_nowait, RequestOutput(request_id, [], "", None, True, "abort", 0, 0))


def _run_call(fn: Callable[[], T], done: concurrent.futures.Future[T]) -> None:
    """``fn()``, its result or its error handed to ``done``; where the caller cancelled ``done`` first, ``fn`` runs
    all the same and nobody is told."""
    told = done.set_running_or_notify_cancel()
    try:
        result = fn()
    except BaseException as exc:  # handed to the caller, whatever it is
        if told:
            done.set_exception(exc)
    else:
        if told:
            done.set_result(result)


def _send(loop: asyncio.AbstractEventLoop, fn: Callable[[Any], None], arg: Any) -> bool:
    """``fn(arg)`` on ``loop``; False where the loop has closed (``asyncio.run`` returned with requests of it
    still running), which must not end the scheduler's thread."""
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:
        return False
    return True


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():  # a job whose client left cancelled it
        future.set_result(None)


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
