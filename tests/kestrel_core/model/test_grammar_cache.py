"""The compiled grammars an engine keeps (grammar.CompiledGrammars), over a compile the tests count: a grammar is
compiled once however many requests want it, at once or one after another; a failed compile is not kept; the
least recently used goes past the bound; a compile whose every request left before its turn never runs.

Not timed: the compile is held on an event where a test needs requests to meet it under way.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from kestrel_core.errors import InvalidRequest
from kestrel_core.model import grammar
from kestrel_core.model.grammar import CompiledGrammars

from ..waits import HANG_GUARD_S, wait_until


class Place:
    """A compiled grammar's stand-in: its text, and the original it was copied from."""

    def __init__(self, text: str, original: Place | None = None) -> None:
        self.text, self.original = text, original

    def copy(self) -> Place:
        return Place(self.text, self)


class Compiler:
    """A compile that records each grammar it is given; ``fails``: the grammars it refuses (once each);
    ``held``: where set, each compile waits for ``go``."""

    def __init__(self, fails: tuple[str, ...] = (), held: bool = False) -> None:
        self.compiled: list[str] = []
        self.fails = set(fails)
        self.go = threading.Event()
        if not held:
            self.go.set()

    def __call__(self, text: str) -> Place:
        self.compiled.append(text)
        assert self.go.wait(HANG_GUARD_S)
        if text in self.fails:
            self.fails.discard(text)
            raise InvalidRequest(f"invalid grammar: {text}", param="grammar")
        return Place(text)


def test_a_grammar_is_compiled_once_and_each_use_takes_a_copy_of_the_original() -> None:
    compiler = Compiler()
    cache = CompiledGrammars(compiler)

    async def main() -> list[Place]:
        return [await cache.constraint("g"), await cache.constraint("g")]

    first, second = asyncio.run(main())
    assert compiler.compiled == ["g"]
    assert first is not second and first.original is second.original is not None  # one original, never given out


def test_requests_for_a_grammar_being_compiled_share_that_compile() -> None:
    compiler = Compiler(held=True)
    cache = CompiledGrammars(compiler)

    async def main() -> list[Place]:
        tasks = [asyncio.ensure_future(cache.constraint("g")) for _ in range(3)]
        await asyncio.sleep(0)  # each has asked for it: the compile is under way
        await asyncio.to_thread(wait_until, lambda: bool(compiler.compiled), "the compile started")
        compiler.go.set()
        return list(await asyncio.gather(*tasks))

    places = asyncio.run(main())
    assert compiler.compiled == ["g"] and len({id(p) for p in places}) == 3
    assert len({id(p.original) for p in places}) == 1


def test_a_failed_compile_fails_its_requests_and_is_not_kept() -> None:
    compiler = Compiler(fails=("bad",), held=True)
    cache = CompiledGrammars(compiler)

    async def main() -> tuple[list[Any], Place]:
        tasks = [asyncio.ensure_future(cache.constraint("bad")) for _ in range(2)]
        await asyncio.sleep(0)
        compiler.go.set()
        failed = await asyncio.gather(*tasks, return_exceptions=True)
        return failed, await cache.constraint("bad")  # compiled again, and this time it compiles

    failed, place = asyncio.run(main())
    assert all(isinstance(f, InvalidRequest) for f in failed), failed
    assert compiler.compiled == ["bad", "bad"] and place.text == "bad" and len(cache) == 1


def test_the_least_recently_used_grammar_goes_past_the_bound() -> None:
    compiler = Compiler()
    cache = CompiledGrammars(compiler, entries=2)

    async def main() -> None:
        for text in ["a", "b", "a", "c", "a", "b"]:  # c pushes b out, not a (used after b)
            await cache.constraint(text)

    asyncio.run(main())
    assert compiler.compiled == ["a", "b", "c", "b"] and len(cache) == 2


@pytest.fixture
def held_threads() -> Iterator[threading.Event]:
    """Every grammars' thread busy with the test's own work until the event is set."""
    go, started = threading.Event(), threading.Semaphore(0)

    def hold() -> None:
        started.release()
        go.wait(HANG_GUARD_S)

    holders: list[Future[None]] = [grammar._COMPILES.submit(hold) for _ in range(grammar.GRAMMAR_THREADS)]
    for _ in holders:
        assert started.acquire(timeout=HANG_GUARD_S)
    try:
        yield go
    finally:
        go.set()
        for holder in holders:
            holder.result(HANG_GUARD_S)


def test_a_compile_whose_requests_all_left_before_its_turn_never_runs(held_threads: threading.Event) -> None:
    """Two requests wait for the same queued compile: one leaving keeps it for the other; both leaving drop it,
    and the next request compiles it afresh."""
    compiler = Compiler()
    cache = CompiledGrammars(compiler)

    async def main() -> Place:
        first, second = (asyncio.ensure_future(cache.constraint("g")) for _ in range(2))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert len(cache) == 1  # the other still waits for it
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        assert len(cache) == 0
        held_threads.set()
        return await cache.constraint("g")

    place = asyncio.run(main())
    assert compiler.compiled == ["g"] and place.text == "g"
