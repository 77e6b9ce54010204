"""Progress bars for slow steps (quantizing, writing or verifying an artifact): rich, on stderr.

A bar appears only when stderr is a terminal and only once its step has run for a second, so quick loads
and captured output (tests, pipes, logs) stay clean. A step reports through a plain callback,
``report(done, total)``, so the code doing the work never imports rich.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

Report = Callable[[int, int], None]  # (done, total)
SHOW_AFTER_S = 1.0


class LazyBar:
    """A one-task rich progress bar that starts only once ``delay`` seconds have passed since it was made."""

    def __init__(self, description: str, *, unit: str = "bytes", console: Console | None = None,
                 delay: float = SHOW_AFTER_S) -> None:
        """``unit``: "bytes" (sizes and speed) or anything else (a percentage)."""
        self.description = description
        self.unit = unit
        self.console = console or Console(stderr=True)
        self.enabled = self.console.is_terminal
        self.delay = delay
        self.t0 = time.perf_counter()
        self.progress: Progress | None = None
        self.task: TaskID | None = None

    def _start(self, total: int) -> None:
        amount = (DownloadColumn(), TransferSpeedColumn()) if self.unit == "bytes" else (TaskProgressColumn(),)
        self.progress = Progress(TextColumn("{task.description}", markup=False), BarColumn(), *amount,
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False)
        self.progress.start()
        self.task = self.progress.add_task(self.description, total=total)

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.progress is None:
            if time.perf_counter() - self.t0 < self.delay or done >= total:
                return
            self._start(total)
        assert self.progress is not None and self.task is not None
        self.progress.update(self.task, completed=done, total=total)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


@contextmanager
def progress_bar(description: str, *, unit: str = "bytes", console: Console | None = None) -> Iterator[Report]:
    """``with progress_bar("writing x.kst") as report: ... report(done, total)``; see the module docstring."""
    bar = LazyBar(description, unit=unit, console=console)
    try:
        yield bar
    finally:
        bar.close()
