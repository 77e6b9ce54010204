"""Waiting in tests on a machine that may be busy (CI's two cores are shared): a test waits for the event it
needs, and a time limit only guards against a hang, never a bound the test checks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# how long a wait may last before the test calls it a hang: the first forced tool call of
# test_tool_calls_cohere.py (22 s beside three busy processes) overran 300 s with two cores shared by some fifteen
# busy processes
HANG_GUARD_S = 600.0


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Wait for ``condition``, failing only past HANG_GUARD_S (``what``: the condition, for the failure)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {HANG_GUARD_S:.0f} s"
        time.sleep(0.02)


class StillWaiting(AssertionError):
    """A call ``within`` gave up on."""


def within(seconds: float, call: Callable[[], object]) -> object:
    """``call()``'s result or exception, failing the test (StillWaiting, not hanging it) where it takes longer
    than ``seconds``."""
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(_outcome(call)), daemon=True)
    worker.start()
    worker.join(seconds)
    if not done:
        raise StillWaiting(f"still waiting after {seconds} s")
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]


def _outcome(call: Callable[[], object]) -> object:
    try:
        return call()
    except Exception as exc:  # handed to the test's thread
        return exc
