"""Temp files and directories a writer is filling beside its destination (a cache entry, an artifact, a pulled
model), and the lock files a process holds while it builds one: removed when the process is told to end while
they are live, and swept once their writer is gone.

SIGTERM and SIGHUP (a closed terminal) kill a Python process without running ``finally``; while a temp is live,
a handler installed on the main thread removes every live temp, then lets the signal kill the process as
before. A writer killed outright (SIGKILL, the OOM killer, a power cut) leaves its temp. A held temp file
(``held_temp_file``: an artifact's) carries its writer's flock while it is written, which the kernel releases
however the writer ends, so the next sweep of that directory removes it at once; any other temp once it has
not been modified for ``TEMP_MAX_AGE_S``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kestrel_core import locks

TEMP_MAX_AGE_S = 3600.0  # a temp untouched this long belongs to a writer that died
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
HELD_SUFFIX = ".writing"  # a held temp file's name ends so: its lock tells whether its writer lives

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


@contextlib.contextmanager
def held_temp_file(directory: Path, prefix: str) -> Iterator[tuple[int, str]]:
    """A new temp file ``<prefix><8 random characters>.writing`` in ``directory`` (mkstemp's): its descriptor,
    open for writing, and its path. Its lock is held while the block writes it (and for whatever the block does
    with it: a rename into place), and it is removed on an ending signal. The block writes through that
    descriptor and leaves it open: where flock is emulated by POSIX locks (NFS), closing any descriptor of the
    file would let the lock go."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=HELD_SUFFIX, dir=directory)
        try:
            if locks.try_lock(fd) is False:  # a sweep found it unlocked this instant, and removes it
                fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        if locks.names(fd, tmp):
            break
        os.close(fd)
    try:
        with removed_on_signal(tmp):
            yield fd, tmp
    finally:
        os.close(fd)


class LockFile:
    """The exclusive lock of a lock file, made where missing and removed again by ``release`` (or, while it is
    held, on an ending signal)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self, on_wait: Callable[[], None]) -> bool:
        """Hold the lock, waiting (after calling ``on_wait``) while another process holds it; False where the
        lock file cannot be made or locked (a read-only directory, no flock): the caller goes on unlocked."""
        waited = False
        while True:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            except OSError:
                return False
            try:
                taken = locks.try_lock(fd)
                if taken is None:
                    os.close(fd)
                    return False
                if not taken:
                    if not waited:
                        on_wait()
                        waited = True
                    fcntl.flock(fd, fcntl.LOCK_EX)  # released at once where its holder dies
            except BaseException:
                os.close(fd)
                raise
            if locks.names(fd, self.path):
                self.fd = fd
                with _lock:
                    _live[os.fspath(self.path)] = None
                watch_signals()
                return True
            os.close(fd)  # its holder removed it on release: a new holder makes it anew

    def release(self) -> None:
        """Remove the lock file, then let go of its lock (a waiter on the removed file finds the path names another
        file, and locks that); a no-op where it is not held."""
        if self.fd is None:
            return
        try:
            if locks.names(self.fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass  # a lock file left behind costs nothing: the next holder removes it
        finally:
            with _lock:
                _live.pop(os.fspath(self.path), None)
            os.close(self.fd)
            self.fd = None


@dataclass(frozen=True)
class Temp:
    """A temp in a writer's directory: its bytes (a directory's: its files'), and whether its writer is gone."""

    path: Path
    size: int
    dead: bool


def find_temps(directory: Path, pattern: re.Pattern[str], max_age_s: float = TEMP_MAX_AGE_S) -> list[Temp]:
    """The temps in ``directory`` whose names ``pattern`` matches whole; a writer is gone where a held temp file's
    lock is free (where the file system has no flock: as for any other temp), or where neither another temp nor
    what it holds was modified for ``max_age_s``. An empty list where the directory is missing or unreadable."""
    now = time.time()
    try:
        entries = list(directory.iterdir())
    except OSError:  # no such directory, or not readable: nothing of ours
        return []
    found = []
    for p in entries:
        if not pattern.fullmatch(p.name):
            continue
        try:
            st = p.lstat()
            parts = [st] if not stat.S_ISDIR(st.st_mode) else [st, *(c.lstat() for c in p.iterdir())]
        except OSError:
            continue  # raced with another cleaner
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            continue
        size = sum(x.st_size for x in parts if stat.S_ISREG(x.st_mode))
        if os.fspath(p) in _live:  # this process writes it (and must not probe its lock: see held_temp_file)
            found.append(Temp(p, size, False))
            continue
        holder = locks.held(p) if p.name.endswith(HELD_SUFFIX) and stat.S_ISREG(st.st_mode) else None
        stale = now - max(x.st_mtime for x in parts) > max_age_s
        found.append(Temp(p, size, not holder if holder is not None else stale))
    return found


def remove_stale(directory: Path, pattern: re.Pattern[str], max_age_s: float = TEMP_MAX_AGE_S) -> list[Temp]:
    """Remove the temps of ``find_temps`` whose writer is gone (a held temp file under its lock, so that none is
    taken from a writer); the ones removed."""
    removed = []
    for t in find_temps(directory, pattern, max_age_s):
        if not t.dead:
            continue
        try:
            if t.path.name.endswith(HELD_SUFFIX) and t.path.is_file() and not t.path.is_symlink():
                gone = locks.remove_unheld(t.path)
                if gone is None:  # no flock here: found dead by its age
                    t.path.unlink()
                elif not gone:
                    continue
            elif t.path.is_dir() and not t.path.is_symlink():
                shutil.rmtree(t.path)
            else:
                t.path.unlink()
        except OSError:
            continue  # raced with another cleaner, or not ours to remove
        removed.append(t)
    return removed
