"""Temp files and directories a writer is filling beside its destination (a cache entry, an artifact, a pulled
model): removed when the process is told to end while they are live, and swept once stale.

SIGTERM and SIGHUP (a closed terminal) kill a Python process without running ``finally``; while a temp is live,
a handler installed on the main thread removes every live temp, then lets the signal kill the process as
before. A writer killed outright (SIGKILL, a power cut) leaves its temp, which the next writer of that
directory removes once it has not been modified for ``TEMP_MAX_AGE_S``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TEMP_MAX_AGE_S = 3600.0  # a temp untouched this long belongs to a writer that died
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_live: dict[str, None] = {}  # the temps being written now, in any thread
_lock = threading.Lock()


def _remove(path: str) -> None:
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _on_ending_signal(signum: int, frame: Any) -> None:
    for path in list(_live):
        _remove(path)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def watch_signals() -> None:
    """Install the ending signals' handler where their disposition is the default; a no-op off the main thread,
    where no handler can be installed (a writer thread's starter calls this first) and where someone else's
    handler is in place (if it raises, the writer's own cleanup runs; kestrel serve cancels its writes)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in ENDING_SIGNALS:
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _on_ending_signal)


@contextlib.contextmanager
def removed_on_signal(path: str | os.PathLike[str]) -> Iterator[None]:
    """While the block writes the temp ``path`` (a file or a directory): removed on an ending signal."""
    key = os.fspath(path)
    with _lock:
        _live[key] = None
    watch_signals()
    try:
        yield
    finally:
        with _lock:
            _live.pop(key, None)


def remove_stale(directory: Path, pattern: re.Pattern[str], max_age_s: float = TEMP_MAX_AGE_S) -> None:
    """Remove the temps in ``directory`` whose names ``pattern`` matches whole and that were not modified for
    ``max_age_s`` (a directory: neither it nor what it holds); a live writer touches its temp as it goes."""
    now = time.time()
    try:
        entries = list(directory.iterdir())
    except OSError:  # no such directory, or not readable: nothing of ours to remove
        return
    for p in entries:
        if not pattern.fullmatch(p.name) or os.fspath(p) in _live:
            continue
        try:
            st = p.lstat()
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > max_age_s:
                p.unlink()
            elif stat.S_ISDIR(st.st_mode) and now - max([st.st_mtime, *(c.lstat().st_mtime for c in p.iterdir())]) \
                    > max_age_s:
                shutil.rmtree(p)
        except OSError:
            pass  # raced with another cleaner, or not ours to remove
