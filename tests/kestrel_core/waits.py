"""Waiting in tests on a machine that may be busy (CI's two cores are shared): a test waits for the event it
needs, and a time limit only guards against a hang, never a bound the test checks."""

from __future__ import annotations

import time
from collections.abc import Callable

HANG_GUARD_S = 300.0  # how long a wait may last before the test calls it a hang


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Wait for ``condition``, failing only past HANG_GUARD_S (``what``: the condition, for the failure)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {HANG_GUARD_S:.0f} s"
        time.sleep(0.02)
