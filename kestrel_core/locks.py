"""Advisory file locks (``flock``) that tell a live process's files from those of a process that died.

The kernel releases a process's flocks when it ends, however it ends (SIGKILL, the OOM killer), so a file whose
lock can be taken belongs to no live process. A file is removed only by whoever holds its lock, and a lock taken
on a path counts only where the path still names the locked file afterwards: a file is never removed from under
its holder, and no two processes hold the lock of one path. Where the file system has no flock (ENOLCK,
EOPNOTSUPP) nothing can be told, and each caller goes on as it would without locks.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a lock needs no write access


def names(fd: int, path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except OSError:
        return False


def try_lock(fd: int) -> bool | None:
    """Take ``fd``'s exclusive lock without waiting: True where taken, False where another holds it, None where
    the file system has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def held(path: Path) -> bool | None:
    """Whether a live process holds the lock of ``path``; None where that cannot be told (gone, unreadable, no
    flock)."""
    try:
        fd = os.open(path, _OPEN)
    except OSError:
        return None
    try:
        taken = try_lock(fd)
        return None if taken is None else not taken
    finally:
        os.close(fd)  # releases the lock this took


def remove_unheld(path: Path) -> bool | None:
    """Remove ``path`` unless a live process holds its lock, holding the lock while it is removed: True where
    removed, False where held (or gone meanwhile), None where that cannot be told (unreadable, no flock). OSError
    where it cannot be removed."""
    try:
        fd = os.open(path, _OPEN)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        taken = try_lock(fd)
        if not taken:
            return taken
        if not names(fd, path):  # removed, and maybe made again, since it was opened
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)
