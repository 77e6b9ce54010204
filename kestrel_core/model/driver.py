"""Who may drive an engine: an open one, by one thread at a time.

An engine's steps, its KV pool (the free list, the blocks' counts, the prefix cache) and its backends' device state
take no lock: two threads that each drive an engine through a ``Scheduler`` of their own would take a block twice
or fail deep inside the pool. ``Driver`` refuses the second one instead, with a KestrelError that names the thread
driving it: threads share an engine through an ``AsyncEngine``, whose thread runs every step. A lock would not make
two drivers work: it would have to span whole steps, and a step the device runs between two of a scheduler's calls
(``Step.running``), so the threads would take turns, each of them slower (numba's kernels started from a second
thread run beside an idle pool of the first's: 47 tok/s decode instead of 110, on 2 cores), and a thread that
stopped calling would block the other for ever.

The engine is driven while a call into it runs (a scheduler's step, an embedding's step, ``Engine.logits``, a
sequence made or released), and while a step started by ``Engine.start_batch`` has not been taken. The same thread
may drive it through several schedulers at once (``Engine.generate`` makes one for each stream).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

from kestrel_core.errors import KestrelError

P = ParamSpec("P")
T = TypeVar("T")


class Driver:
    """Which thread drives an engine now (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._depth = 0  # that thread's calls under way and steps not taken

    def enter(self) -> None:
        """The calling thread drives the engine (once more); a KestrelError where another thread does."""
        me = threading.current_thread()
        with self._lock:
            if self._thread is not None and self._thread is not me:
                raise KestrelError(f"the engine is in use by another thread ({self._thread.name}): one thread "
                                   "drives an engine at a time; threads share one through an AsyncEngine "
                                   "(kestrel.AsyncEngine(engine))")
            self._thread = me
            self._depth += 1

    def leave(self) -> None:
        with self._lock:
            self._depth = max(self._depth - 1, 0)
            if not self._depth:
                self._thread = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()


def check_engine(engine: object, what: str) -> None:
    """A KestrelError unless ``engine`` is an open Engine (``what`` takes it: a Scheduler, an AsyncEngine)."""
    from kestrel_core.model.engine import Engine  # which drives itself through this module

    if not isinstance(engine, Engine):
        raise KestrelError(f"{what} takes an Engine (kestrel_core.load), got {type(engine).__name__}")
    engine.check_open()


class Hold:
    """The engine held by a thread between its calls, for ``owner`` (what the device runs: a step, a lone greedy
    decode ahead), given back by ``set(owner, False)`` or when ``owner`` is collected."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self._given: weakref.finalize | None = None

    def set(self, owner: object, held: bool) -> None:
        if held and self._given is None:
            self.driver.enter()
            self._given = weakref.finalize(owner, self.driver.leave)
        elif not held and self._given is not None:
            self._given()
            self._given = None


def driving(method: Callable[Concatenate[Any, P], T]) -> Callable[Concatenate[Any, P], T]:
    """A method that drives its object's engine (the object's ``driver``) while it runs."""

    @functools.wraps(method)
    def driven(self: Any, *args: P.args, **kwargs: P.kwargs) -> T:
        with self.driver():
            return method(self, *args, **kwargs)

    return driven
