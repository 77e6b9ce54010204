"""The command line's two consoles (stdout, stderr), which every command prints through."""

from __future__ import annotations

import errno
import os
import sys

from rich.console import Console
from rich.measure import Measurement
from rich.segment import Segments
from rich.table import Table


class _Console(Console):
    """rich's Console, whose reader leaving is Python's BrokenPipeError, which ``_main`` ends as SIGPIPE would end
    the process (rich's own ``on_broken_pipe`` exits 1, and covers stdout with /dev/null whichever stream broke)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more is written where no one reads
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


# no markup: what they print holds backends' and models' own text, whose brackets are not Rich's; styles go as Text
out = _Console(highlight=False, markup=False, width=None if sys.stdout is not None and sys.stdout.isatty() else 160)
err = _Console(stderr=True, highlight=False, markup=False)
UNBOUNDED_WIDTH = 1 << 16


def print_uncut(table: Table) -> None:
    """``table`` on stdout at its own width where the console is narrower: the terminal wraps its lines, and no
    cell is cut short (a model's name is what ``-m`` takes)."""
    width = max(out.width, Measurement.get(out, out.options.update_width(UNBOUNDED_WIDTH), table).maximum)
    out.print(Segments(out.render(table, out.options.update_width(width))), crop=False)
