"""The ``kestrel`` command's entry point: the CLI imported inside a Ctrl-C guard.

A Ctrl-C can land while Python runs code it cannot raise from: a ctypes callback (llvmlite's object cache,
called while numba loads or compiles a kernel) or a weakref callback of the import system. Python then prints
"Exception ignored ... KeyboardInterrupt" and drops it, and the command runs on as if never interrupted; the
process's unraisable hook hands such an interrupt back to the main thread instead, where the CLI ends with
"interrupted" (exit 130).
"""

from __future__ import annotations

import _thread
import sys
from typing import Any

REDELIVER_S = 0.01  # after the hook has returned: an interrupt raised inside it would be dropped again


def redeliver_interrupts() -> None:
    """Install the unraisable hook that raises a dropped KeyboardInterrupt again in the main thread, as the SIGINT
    it came from (whatever handler is installed then runs); any other unraisable error is reported as before.

    The main thread raises a pending interrupt at its next Python call, which inside the hook would be the hook
    itself: a timer thread hands it over once the hook has returned."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is None or not issubclass(unraisable.exc_type, KeyboardInterrupt):
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


def main() -> int:
    redeliver_interrupts()
    try:
        from kestrel_core.cli import main as cli_main
    except KeyboardInterrupt:  # while the CLI's modules load
        print("interrupted", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
