"""The ``kestrel serve`` command line: bad options fail in one line before any model loads; lazy imports."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys

import pytest

from kestrel_core.cli import main
from kestrel_core.serve import command


@pytest.mark.parametrize(("argv", "needle"), [
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--max-waiting", "-1"], "--max-waiting must be >= 0"),
    (["--token-budget", "0"], "--token-budget must be >= 1"),
    (["--kv-cache-mb", "0"], "--kv-cache-mb must be > 0"),
    (["--shutdown-grace", "-1"], "--shutdown-grace must be >= 0"),
    (["--served-model-name", " "], "--served-model-name must not be empty"),
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--backend", "nope"], "unknown backend 'nope'"),
    (["--preset", "tiny", "--model", "m.gguf"], "either --model or --preset"),
    (["--preset", "gpt5"], "unknown preset 'gpt5'"),
])
def test_bad_options_are_one_line_and_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_busy_port_fails_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a model that does not exist: only the port check can come first and say something else
        assert main(["serve", "--port", str(port), "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"cannot listen on 127.0.0.1:{port}" in err and len(err.splitlines()) == 1


def test_missing_serve_extra_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(command.importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert 'pip install "kestrel[serve]"' in err and "uvicorn" in err and len(err.splitlines()) == 1


def test_the_cli_imports_no_web_framework() -> None:
    code = ("import sys, kestrel_core.cli as c; c.build_parser().parse_args(['serve']); "
            "bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
