"""The command's Ctrl-C guard, however the command is started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .waits import HANG_GUARD_S


def _interrupt_once_imported(argv: list[str], module: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Start ``python -X importtime`` with ``argv`` and send SIGINT as soon as ``module`` has been imported:
    the interpreter reports each import on stderr as it ends, which says where the command is without a sleep."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KESTREL_HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")},
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == module:
            proc.send_signal(signal.SIGINT)
            break
    else:
        raise AssertionError(f"{module} was never imported: {''.join(seen)}")
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(seen) + err)


def test_a_ctrl_c_while_python_m_cli_loads_its_modules_is_interrupted(tmp_path: Path) -> None:
    """``python -m kestrel_core.cli``: a SIGINT while the CLI's own modules load (rich, numpy) is the command's
    "interrupted", exit 130, as it is for the ``kestrel`` script."""
    done = _interrupt_once_imported(["-m", "kestrel_core.cli", "list"], "rich", tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr.strip().splitlines()[-1] == "interrupted", done.stderr


INTERRUPTED_IN_A_STRING_EXEC = """
import sys
import kestrel_core.cli as cli
from kestrel_core import entry


def interrupted_command():
    try:  # namedtuple and dataclass creation run a string exec; a Ctrl-C while modules load lands in one
        exec("import os, signal, time\\nos.kill(os.getpid(), signal.SIGINT)\\ntime.sleep(5)", {})
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


cli.main = interrupted_command
sys.exit(entry.main())
"""

INTERRUPTED_AFTER_THE_END = """
import os, signal, sys
import kestrel_core.cli as cli
from kestrel_core import entry


class InterruptedAtTeardown:
    def __del__(self, kill=os.kill, pid=os.getpid(), sigint=signal.SIGINT):
        kill(pid, sigint)  # the Ctrl-C comes while Python tears its modules down, past its own signal handling


def finished_command():
    print("done")
    return 0


teardown = InterruptedAtTeardown()
cli.main = finished_command
sys.exit(entry.main())
"""


def _python_m(source: str, tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "started_command.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "started_command", *argv], cwd=tmp_path, capture_output=True, text=True,
        timeout=HANG_GUARD_S,
    )


def test_an_interrupt_caught_from_a_string_exec_still_exits_130(tmp_path: Path) -> None:
    """Under ``python -m``, CPython ends the process by SIGINT (-2) after a KeyboardInterrupt left a string exec,
    even one the command caught: the entry point clears that note, so the command's 130 stands."""
    done = _python_m(INTERRUPTED_IN_A_STRING_EXEC, tmp_path)
    assert done.returncode == 130 and done.stderr.strip() == "interrupted", (done.returncode, done.stderr)


def test_a_ctrl_c_after_the_command_ended_keeps_its_exit_status(tmp_path: Path) -> None:
    """A SIGINT while the interpreter tears down, past its exit handlers (``kestrel quantize`` spends a quarter of
    a second there after writing its file): the command has ended and said so, and exits with its own status
    instead of being killed by the signal (-2)."""
    done = _python_m(INTERRUPTED_AFTER_THE_END, tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "done\n", "")


INTERRUPTED_WHILE_THE_GUARD_IS_SET_UP = """
import os, signal, sys, time
import kestrel_core.cli as cli
from kestrel_core import entry

step = getattr(entry, sys.argv[1])


def interrupted_step():
    step()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)


setattr(entry, sys.argv[1], interrupted_step)
cli.main = lambda: print("ran") or 0
sys.exit(entry.main())
"""


@pytest.mark.parametrize("step", ["open_closed_streams", "note_interrupts", "redeliver_interrupts"])
def test_a_ctrl_c_while_the_guard_is_set_up_is_interrupted(step: str, tmp_path: Path) -> None:
    """A SIGINT right after any step of the entry point's own setup: "interrupted", exit 130, and the command does
    not run."""
    done = _python_m(INTERRUPTED_WHILE_THE_GUARD_IS_SET_UP, tmp_path, step)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "interrupted\n")


FAILED_IMPORT_OF_THE_CLI = """
import builtins, os, signal, sys, time
from kestrel_core import entry

real_import = builtins.__import__


def import_(name, *args, **kwargs):
    if name == "kestrel_core.cli":
        cause = None
        try:
            if sys.argv[1:] == ["interrupted"]:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
        except KeyboardInterrupt as exc:  # as numpy's C extension reports a SIGINT in its import of datetime
            cause = exc
        raise ImportError('PyCapsule_Import could not import module "datetime"') from cause
    return real_import(name, *args, **kwargs)


builtins.__import__ = import_
sys.exit(entry.main())
"""


def test_an_import_error_an_interrupt_left_is_interrupted(tmp_path: Path) -> None:
    """A SIGINT that an extension module's import turns into an ImportError while the CLI's modules load:
    "interrupted", exit 130, not the ImportError's traceback."""
    done = _python_m(FAILED_IMPORT_OF_THE_CLI, tmp_path, "interrupted")
    assert (done.returncode, done.stderr) == (130, "interrupted\n")


def test_an_import_error_without_an_interrupt_is_reported(tmp_path: Path) -> None:
    """An ImportError no interrupt caused is the bug it is: its traceback, not "interrupted"."""
    done = _python_m(FAILED_IMPORT_OF_THE_CLI, tmp_path)
    assert done.returncode == 1 and "ImportError: PyCapsule_Import" in done.stderr, (done.returncode, done.stderr)
