"""The command line's consoles and log handler."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .waits import HANG_GUARD_S

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "tiny-llama"


def test_a_warning_on_a_stderr_that_is_no_terminal_is_one_line(tmp_path: Path) -> None:
    """A pipe or a CI log gets each log record as one line, however long (rich's handler wraps at 80 columns)."""
    home = tmp_path / ("a-kestrel-home-that-is-a-file-with-a-name-long-enough-to-wrap" * 2)
    home.write_text("")
    env = {**os.environ, "KESTREL_HOME": str(home), "KESTREL_MODEL_CACHE": "1", "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-m", "kestrel_core.entry", "run", "hi", "-n", "2", "-m", str(TINY)],
                          capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "could not cache" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING") and str(home) in warnings[0], done.stderr
