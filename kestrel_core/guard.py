"""Plugin code run in kestrel's own process: what it raises becomes one line of text and never ends kestrel (only
a real ``KeyboardInterrupt`` passes), a SIGINT or SIGTERM handler it installs is put back (kestrel must stay
interruptible), and what it prints goes to stderr (``plugin_output``). The registry runs a backend's import,
``kestrel_backend_info``, ``kestrel_open`` and ``kestrel_close`` through ``plugin_call``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from kestrel_core.errors import safe_repr, safe_text
from kestrel_core.probe import WATCHED_SIGNALS

log = logging.getLogger("kestrel")


def short(exc: BaseException) -> str:
    """One line for an exception (a plugin's sys.exit says so), whatever its ``__str__`` does."""
    if isinstance(exc, SystemExit):
        return f"SystemExit (the plugin called sys.exit({safe_repr(exc.code)}))"
    name = type(exc).__name__ if isinstance(exc, Exception) else f"{type(exc).__name__} (a BaseException)"
    text = safe_text(exc)
    return f"{name}: {text}" if text else name


_redirects = 0  # plugin_output blocks open, in every thread
_stdout: Any = None  # sys.stdout before the first of them
_redirects_lock = threading.Lock()


@contextlib.contextmanager
def plugin_output() -> Iterator[None]:
    """Within the block, what is printed goes to stderr: stdout is a command's output (``--json``), which a
    backend's print at import, at open or in a hook must not break (the probe's child silences it). Engines of
    several models call their backends from threads of their own: stdout comes back when the last block ends,
    whatever order they end in (``contextlib.redirect_stdout`` would restore each one's own saved stream)."""
    global _redirects, _stdout
    with _redirects_lock:
        if _redirects == 0:
            _stdout, sys.stdout = sys.stdout, sys.stderr
        _redirects += 1
    try:
        yield
    finally:
        with _redirects_lock:
            _redirects -= 1
            if _redirects == 0:
                sys.stdout, _stdout = _stdout, None


def signal_handlers() -> dict[int, Any]:
    return {sig: signal.getsignal(sig) for sig in WATCHED_SIGNALS}


def restore_signals(before: dict[int, Any]) -> str:
    """Put back any watched handler plugin code replaced; the names of those it had replaced."""
    changed = []
    for sig, handler in before.items():
        now = signal.getsignal(sig)
        if now is not handler and now != handler:
            changed.append(signal.Signals(sig).name)
            try:
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            except (ValueError, OSError, TypeError):  # not the main thread: it stays refused all the same
                pass
    return ", ".join(changed)


def plugin_call(what: str, call: Callable[[], Any]) -> tuple[Any, BaseException | None, str]:
    """Run plugin code in process: (result, the exception it raised, the signals it took over).
    Everything is caught but a KeyboardInterrupt (the user's Ctrl-C)."""
    before = signal_handlers()
    result, error = None, None
    try:
        with plugin_output():
            result = call()
    except KeyboardInterrupt:
        restore_signals(before)
        raise
    except BaseException as exc:  # a plugin's sys.exit or own BaseException must not end kestrel
        error = exc
        log.debug("plugin code in %s raised", what, exc_info=exc)
    return result, error, restore_signals(before)


def took_signals(what: str, names: str) -> str:
    return f"{what} replaced the {names} handler (restored; kestrel must stay interruptible)"
