"""The command's Ctrl-C guard, however the command is started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


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
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(seen) + err)


def test_a_ctrl_c_while_python_m_cli_loads_its_modules_is_interrupted(tmp_path: Path) -> None:
    """``python -m kestrel_core.cli``: a SIGINT while the CLI's own modules load (rich, numpy) is the command's
    "interrupted", exit 130, as it is for the ``kestrel`` script."""
    done = _interrupt_once_imported(["-m", "kestrel_core.cli", "list"], "rich", tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr.strip().splitlines()[-1] == "interrupted", done.stderr
