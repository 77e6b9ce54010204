"""The command line's two consoles (stdout, stderr), which every command prints through, and the strict JSON its
``--json`` outputs print."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
from typing import Any

import numpy as np
from rich.console import Console
from rich.measure import Measurement
from rich.segment import Segments
from rich.table import Table

from kestrel_core.errors import safe_text


class _Console(Console):
    """rich's Console, whose reader leaving is Python's BrokenPipeError, which ``_main`` ends as SIGPIPE would end
    the process (rich's own ``on_broken_pipe`` exits 1, and covers stdout with /dev/null whichever stream broke)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more is written where no one reads
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def plain(value: Any) -> Any:
    """``value`` as standard JSON holds it: numpy scalars and arrays as numbers and lists, a NaN or an infinity as
    null (JSON has neither), any other object (a backend's counters may be anything) as its text."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else safe_text(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return plain(value.tolist())
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int)):
        return value
    return safe_text(value)


def dumps(obj: Any, indent: int | None = None) -> str:
    """``obj`` as standard JSON (``plain``): what a command's ``--json`` prints."""
    return json.dumps(plain(obj), indent=indent, allow_nan=False)


# no markup: what they print holds backends' and models' own text, whose brackets are not Rich's; styles go as Text
out = _Console(highlight=False, markup=False, width=None if sys.stdout is not None and sys.stdout.isatty() else 160)
err = _Console(stderr=True, highlight=False, markup=False)
UNBOUNDED_WIDTH = 1 << 16


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A log handler that writes to ``sys.stderr`` as it is when a record comes (not the stream it was first)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def timed_log_handler() -> logging.Handler:
    """The server's log handler: one plain line a record on stderr, its time (HH:MM:SS) first."""
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    return handler


def log_handler() -> logging.Handler:
    """The command line's log handler: rich's on a terminal, elsewhere (a pipe, a file, a CI log) one plain line a
    record, which rich would wrap at 80 columns."""
    from rich.logging import RichHandler

    if err.is_terminal:
        return RichHandler(console=err, show_time=False, show_path=False)
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)-8s %(message)s"))
    return handler


def print_uncut(table: Table) -> None:
    """``table`` on stdout at its own width where the console is narrower: the terminal wraps its lines, and no
    cell is cut short (a model's name is what ``-m`` takes)."""
    width = max(out.width, Measurement.get(out, out.options.update_width(UNBOUNDED_WIDTH), table).maximum)
    out.print(Segments(out.render(table, out.options.update_width(width))), crop=False)
