"""The ``kestrel`` command's entry point: the CLI imported and run inside a Ctrl-C guard.

A Ctrl-C can land while Python runs code it cannot raise from: a ctypes callback (llvmlite's object cache,
called while numba loads or compiles a kernel) or a weakref callback of the import system. Python then prints
"Exception ignored ... KeyboardInterrupt" and drops it, and the command runs on as if never interrupted; the
process's unraisable hook hands such an interrupt back to the main thread instead, where the CLI ends with
"interrupted" (exit 130). Native code may also drop the exception without reporting it anywhere
(``PyObject_HasAttr`` and ``PyErr_Clear`` in extension modules do), so the SIGINT handler notes every
interrupt, and a command that returns after one still ends as "interrupted". Once interrupted, the errors of
objects torn down halfway by the interrupt (llvmlite's ``ObjectRef.__del__``) are not printed, and an error
the CLI's modules raise while they load is the interrupt's too.
"""

from __future__ import annotations

import _thread
import atexit
import signal
import sys
from typing import Any

REDELIVER_S = 0.01  # after the hook has returned: an interrupt raised inside it would be dropped again
INTERRUPTED_EXIT = 130

_interrupts = 0  # SIGINTs the handler saw


def _on_sigint(signum: int, frame: Any) -> None:
    global _interrupts
    _interrupts += 1
    raise KeyboardInterrupt


def interrupt_handled() -> None:
    """A command caught the interrupts so far and went on (``kestrel chat`` stopping an answer): they do not
    make its end an interrupted one."""
    global _interrupts
    _interrupts = 0


def interrupted() -> bool:
    """Whether a SIGINT came since the command started (or since it last handled one)."""
    return _interrupts > 0


def note_interrupts() -> None:
    """Count SIGINTs while raising KeyboardInterrupt as Python's own handler does (when that one is installed;
    a handler someone else installed stays)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def redeliver_interrupts() -> None:
    """Install the unraisable hook that raises a dropped KeyboardInterrupt again in the main thread, as the SIGINT
    it came from (whatever handler is installed then runs); any other unraisable error is reported as before,
    unless the process has been interrupted (then it is logged at debug level only).

    The main thread raises a pending interrupt at its next Python call, which inside the hook would be the hook
    itself: a timer thread hands it over once the hook has returned."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is None or not issubclass(unraisable.exc_type, KeyboardInterrupt):
            if _interrupts:
                import logging

                logging.getLogger("kestrel").debug("after the interrupt: %s in %r", unraisable.exc_type,
                                                   unraisable.object)
                return
            previous(unraisable)
            return
        import threading

        timer = threading.Timer(REDELIVER_S, _thread.interrupt_main)
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:  # the interpreter is shutting down: nothing is left to interrupt
            pass

    sys.unraisablehook = hook


def open_closed_streams() -> None:
    """A standard stream closed at launch (``kestrel list >&-``, ``kestrel run <&-``) is None in Python: the
    command reads it as empty and writes to it as to /dev/null, instead of failing on the None."""
    import os

    for name, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, mode, encoding="utf-8"))  # noqa: SIM115 (the process's stream)


def ignore_interrupts_at_exit() -> None:
    """Past the last exit handler, Python stops handling signals and tears its modules down (a quarter of a
    second after ``kestrel quantize``), where a SIGINT would kill the process (-2) after the command has ended
    and said how: registered before any other kestrel handler, this runs last and lets the command's own exit
    status stand."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def forget_caught_interrupts() -> None:
    """CPython notes a KeyboardInterrupt that leaves a string ``exec`` (namedtuple and dataclass creation run one,
    so a Ctrl-C while modules load often does) as unhandled, even one caught later, and under ``python -m`` then
    ends the process by SIGINT (-2) instead of with the command's exit status; every string ``exec`` clears that
    note as it starts."""
    exec("", {})


def main() -> int:
    try:
        open_closed_streams()
        note_interrupts()
        redeliver_interrupts()
        atexit.register(ignore_interrupts_at_exit)
        from kestrel_core.cli import main as cli_main

        code = cli_main()
    except KeyboardInterrupt:  # while the guard is set up or the CLI's modules load
        code = INTERRUPTED_EXIT
        print("interrupted", file=sys.stderr)
    except Exception:  # an interrupt inside an extension's import becomes an ImportError (numpy's PyCapsule_Import)
        if not _interrupts:
            raise
        code = INTERRUPTED_EXIT
        print("interrupted", file=sys.stderr)
    forget_caught_interrupts()
    if _interrupts and code != INTERRUPTED_EXIT:  # the interrupt was dropped on its way to the CLI
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    return code


if __name__ == "__main__":
    sys.exit(main())
