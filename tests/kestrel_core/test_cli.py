"""The CLI around the Python API: defaults that follow the model, one-line errors."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kestrel_core.cli import main

from .waits import HANG_GUARD_S

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "tiny-qwen3"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kst") / "tiny.q4.kst"
    assert main(["quantize", str(TINY), "-o", str(path), "--quant", "q4"]) == 0
    return path


def test_an_artifact_keeps_its_quant_without_a_warning(artifact: Path, capsys, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        assert main(["run", "--model", str(artifact), "--backend", "cpu", "-n", "2", "--no-chat", "hi"]) == 0
    assert "ignored" not in caplog.text
    capsys.readouterr()
    assert main(["bench", "--model", str(artifact), "--backend", "cpu", "--prompt-tokens", "8",
                 "--decode-tokens", "2", "--runs", "1", "--warmup", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quant"] == "q4"


def test_an_explicit_other_quant_on_an_artifact_is_reported(artifact: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        assert main(["run", "--model", str(artifact), "--backend", "cpu", "-n", "1", "--quant", "q8", "x"]) == 0
    assert "--quant q8 ignored" in caplog.text


@pytest.mark.parametrize(("argv", "needle"), [
    (["run", "--model", "/nonexistent/model", "hi"], "does not exist"),
    (["run", "--model", str(TINY), "--quant", "q5", "hi"], "unknown quant mode 'q5'"),
    (["run", "--model", str(TINY), "--backend", "nope", "hi"], "unknown backend 'nope'"),
    (["selftest", "--backend", "nope"], "unknown backend 'nope'"),
    (["run", "--model", str(TINY), "--json-schema", "{bad", "hi"], "--json-schema: not JSON"),
    (["run", "--model", str(TINY), "--json-schema", "[1]", "hi"], "--json-schema: a JSON Schema is a JSON object"),
    (["run", "--model", str(TINY), "--json-schema", "@/nonexistent/schema.json", "hi"], "cannot read"),
    (["run", "--model", str(TINY), "--grammar", "start: missing", "hi"], "--grammar: invalid grammar"),
    (["run", "--model", str(TINY), "--regex", "(open", "hi"], "--regex: invalid grammar"),
    (["run", "--model", str(TINY), "x\udcff"], "the prompt is not valid UTF-8"),  # argv's invalid UTF-8, decoded
    (["run", "--model", str(TINY), ""], "the prompt given is empty"),  # ``kestrel run "$PROMPT"``, PROMPT unset
    (["run", "--model", str(TINY), "--regex", "x\udcff", "hi"], "--regex is not valid UTF-8"),
    (["embed", "--model", str(TINY), "x\udcff"], "a text to embed is not valid UTF-8"),
    (["run", "--model", str(TINY), "-n", "0", "hi"], "max_tokens must be an integer >= 1"),
    (["bench", "--model", str(TINY), "--decode-tokens", "0"], "decode_tokens must be an integer >= 1"),
    (["run", "--model", str(TINY), "--quant", "", "hi"], "--quant: quant must not be empty"),
    (["run", "--model", "", "hi"], "--model: model must not be empty"),
    (["run", "--preset", "", "hi"], "--preset: preset must not be empty, got ''"),
    (["bench", "--preset", " "], "--preset: preset must not be empty, got ' '"),
    (["run", "--model", str(TINY), "--lora", "", "hi"], "--lora: lora must not be empty, got ''"),
    (["embed", "--model", str(TINY), "--lora", "", "x"], "--lora: lora must not be empty, got ''"),
    (["bench", "--model", str(TINY), "--concurrency", ""], "--concurrency: concurrency must not be empty, got ''"),
    (["bench", "--model", str(TINY), "--concurrency", "8,100000"],
     "--concurrency: each level must be an integer in [1, 4096], got 100000"),
    (["bench", "--model", str(TINY), "--concurrency", "0"],
     "--concurrency: each level must be an integer in [1, 4096], got 0"),
    (["run", "--model", str(TINY), "--rope-scaling", '{"rope_type": "yarn", "factor": 1e308}', "hi"],
     "rope_scaling.factor must be <= 1024"),
    (["run", "--model", str(TINY), "--rope-scaling", '{"rope_type": "linear", "factor": 1e-300}', "hi"],
     "rope_scaling.factor must be >= 0.000976562"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], needle: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(("argv", "needle"), [
    (["run", "--think", "nosuch", "hi"], "kestrel run: error: argument --think: expected true, false or one of"),
    (["run", "-n", "ten", "hi"], "kestrel run: error: argument --max-tokens/-n: invalid int value: 'ten'"),
    (["serve", "--pooling", "nosuch"], "kestrel serve: error: argument --pooling: invalid choice: 'nosuch'"),
    (["chat", "--suffix", "x"], "kestrel: error: unrecognized arguments: --suffix x"),
    (["nosuch"], "kestrel: error: argument command: invalid choice: 'nosuch'"),
])
def test_a_usage_error_is_one_line_and_exit_2(argv: list[str], needle: str, capsys) -> None:
    """argparse's own errors too: the usage it would print first is what --help shows."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and needle in err and len(err.splitlines()) == 1, err
    assert err.endswith("--help lists the options)")


@pytest.mark.parametrize("argv", [["-v", "run", "--model", "/nonexistent/model", "hi"],
                                  ["run", "-v", "--model", "/nonexistent/model", "hi"]])  # before or after the command
def test_verbose_shows_the_traceback(capsys, argv: list[str]) -> None:
    assert main(argv) == 2
    assert "Traceback" in capsys.readouterr().err


def test_each_commands_help_names_only_its_own_options() -> None:
    """An option a help text names is one its command takes, unless it names the command it belongs to ("run
    --json")."""
    import argparse

    from kestrel_core.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    named_elsewhere = [(name, action.dest, option) for name, command in commands.items() for action in command._actions
                       for other, option in re.findall(r"(?<![\w-])(?:(\w+) )?(--[a-z][a-z-]*)", action.help or "")
                       if other not in commands and option not in command._option_string_actions]
    assert named_elsewhere == []


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("kestrel ")


def test_a_backends_own_text_is_printed_as_it_is(tmp_path: Path, monkeypatch, capsys) -> None:
    """Brackets in a device's description, a counter's name or a hook's exception are text, not Rich markup
    (a closing tag like [/dev/rknpu] stopped the command)."""
    (tmp_path / "bracketed.py").write_text('''
from kestrel_core import API_VERSION, BackendInfo, hookimpl
import kestrel_cpu
from kestrel_cpu import kestrel_close  # noqa: F401

class Device:
    description = "RK3588 NPU [/dev/rknpu] [bold]"

@hookimpl
def kestrel_backend_info():
    return BackendInfo("bracketed", "1", API_VERSION, "npu")

@hookimpl
def kestrel_open(options):
    return Device()

@hookimpl
def kestrel_stats(device):
    return {"queue[/dev/rknpu0]": 1}

@hookimpl
def kestrel_gemm_q8(device, a_codes, a_scales, weight, wkey):  # declines odd widths
    return None if weight.n % 2 else kestrel_cpu.kestrel_gemm_q8(device, a_codes, a_scales, weight, wkey)

@hookimpl
def kestrel_gemm_f32(device, a, weight, wkey):
    raise RuntimeError("fault at [/x] [red]")
''')
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "bracketed.py"))
    assert main(["run", "--model", str(TINY), "-n", "2", "--no-chat", "--stats", "hi"]) == 0
    err = capsys.readouterr().err
    assert "RK3588 NPU [/dev/rknpu] [bold]" in err and "queue[/dev/rknpu0]" in err
    assert main(["selftest", "--backend", "bracketed"]) == 1
    out = capsys.readouterr().out
    assert "fault at [/x] [red]" in out and "declined (the CPU's result)" in out
    assert re.search(r"\d+ passed \(\d+ declined\), \d+ failed", out)


CHATTY = '''
from kestrel_core import API_VERSION, BackendInfo, hookimpl
import kestrel_cpu

print("chatty: import")


@hookimpl
def kestrel_backend_info():
    return BackendInfo("chatty", "1", API_VERSION, "gpu")


@hookimpl
def kestrel_open(options):
    print("chatty: open")
    return kestrel_cpu.kestrel_open(options)


@hookimpl
def kestrel_close(device):
    print("chatty: close")


@hookimpl
def kestrel_gemm_q8(device, a_codes, a_scales, weight, wkey):
    print("chatty: gemm_q8")
    return kestrel_cpu.kestrel_gemm_q8(device, a_codes, a_scales, weight, wkey)


@hookimpl
def kestrel_gemm_f32(device, a, weight, wkey):
    print("chatty: gemm_f32")
    return kestrel_cpu.kestrel_gemm_f32(device, a, weight, wkey)


@hookimpl
def kestrel_stats(device):
    print("chatty: stats")
    return {}
'''


@pytest.mark.parametrize("argv", [["backends", "--json"], ["selftest", "--backend", "chatty", "--seeds", "1", "--json"],
                                  ["run", "--model", str(TINY), "--backend", "chatty", "-n", "2", "--no-chat", "--json",
                                   "hi"]])
def test_what_a_backend_prints_goes_to_stderr(tmp_path: Path, monkeypatch, capsys, argv: list[str]) -> None:
    """A backend that prints at import, open and in its hooks leaves a command's stdout (its --json) as it is:
    what it prints is on stderr."""
    (tmp_path / "chatty.py").write_text(CHATTY)
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "chatty.py"))
    assert main(argv) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    assert "chatty: import" in captured.err and "chatty: open" in captured.err


@pytest.mark.parametrize("argv", [["backends"], ["backends", "--json"],
                                  ["selftest", "--backend", "chatty", "--seeds", "1"],
                                  ["selftest", "--backend", "chatty", "--seeds", "1", "--json"]])
def test_every_device_a_command_opens_is_closed(tmp_path: Path, monkeypatch, capsys, argv: list[str]) -> None:
    """``kestrel_close`` for each ``kestrel_open`` of the command's own process (what the backend prints of them is
    on stderr), whichever form its output takes."""
    (tmp_path / "chatty.py").write_text(CHATTY)
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "chatty.py"))
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("chatty: open") == err.count("chatty: close") == 1


def test_stats_show_the_backends_own_counters(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "counting.py").write_text('''
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_gemm_q8, kestrel_open  # noqa: F401

@hookimpl
def kestrel_backend_info():
    return BackendInfo("counting", "1", API_VERSION, "gpu")

@hookimpl
def kestrel_stats(device):
    return {"simulated_time_s": 0.125, "widgets": 3}
''')
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "counting.py"))
    assert main(["run", "--model", str(TINY), "--backend", "counting", "-n", "2", "--no-chat", "--stats", "hi"]) == 0
    err = capsys.readouterr().err
    assert "offload hooks" in err and "simulated_time_s" in err and "0.125" in err and "widgets" in err


@pytest.mark.parametrize("delay", [0.05, 0.12, 0.25, 0.5, 1.5])
def test_ctrl_c_at_any_moment_of_startup_is_one_line(delay: float) -> None:
    """SIGINT while the command's modules load or run: "interrupted", exit 130, never a traceback."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "kestrel_core.entry", "run", "hi", "--preset", "smollm2-135m",
                             "-n", "200", "--backend", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    # a hang guard only: an interrupt native code drops lets the command generate its 200 tokens before it exits
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    if "Traceback" in err and not re.search(r'kestrel_core/entry\.py", line \d+, in main', err):
        # before the entry point's main() ran (site and its .pth files, runpy, the package's import): CPython's
        # traceback, whatever kestrel does
        pytest.skip("the SIGINT landed before kestrel's entry point ran")
    assert "Traceback" not in err, err
    # -2: CPython ends the process by the signal when it arrives before the interpreter installs its handler
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err)
    if proc.returncode == 130:
        assert err.strip().splitlines()[-1].endswith("interrupted"), err


SWALLOWED_INTERRUPT = """
import os, signal, sys, time
import kestrel_core.cli as cli

def swallowing_main():
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    except KeyboardInterrupt:
        pass  # as native code that clears the error (PyObject_HasAttr, PyErr_Clear) does
    print("ran on")
    return 0

cli.main = swallowing_main
from kestrel_core import entry
sys.exit(entry.main())
"""


def test_a_ctrl_c_native_code_swallows_still_ends_as_interrupted() -> None:
    """An interrupt cleared before it reached the CLI: the command runs to its end, then exits 130."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SWALLOWED_INTERRUPT], capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert done.stdout.strip() == "ran on", done.stdout + done.stderr
    assert done.returncode == 130 and done.stderr.strip() == "interrupted", done.stderr


@pytest.mark.parametrize("error", [RuntimeError("no compiled object yet"), OSError("cache write failed")])
def test_an_error_an_interrupt_left_behind_is_interrupted(error: Exception, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A SIGINT dropped inside a callback (numba's compile) and the error it left (its cache save failing): the
    command ends as "interrupted", exit 130, not as an error line."""
    from kestrel_core import cli, entry

    def interrupted_run(args: Any) -> int:
        monkeypatch.setattr(entry, "_interrupts", 1)
        raise error

    monkeypatch.setattr(cli, "cmd_run", interrupted_run)
    assert cli.main(["run", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_running_out_of_memory_is_one_line_saying_so(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A model larger than the machine's memory: numpy's MemoryError, said as what it is, exit 2."""
    from kestrel_core import cli

    def too_big(args: Any) -> int:
        raise MemoryError("Unable to allocate 65.7 GiB for an array with shape (80, 8192, 28672)")

    monkeypatch.setattr(cli, "cmd_run", too_big)
    assert cli.main(["run", "hi"]) == 2
    assert capsys.readouterr().err.strip() == ("error: not enough memory: Unable to allocate 65.7 GiB for an array "
                                               "with shape (80, 8192, 28672)")


DROPPED_INTERRUPT = """
import ctypes, sys, time
from kestrel_core import entry
if sys.argv[1] == "hook":
    entry.redeliver_interrupts()

@ctypes.CFUNCTYPE(None)
def callback():  # as llvmlite's object-cache callback does when a SIGINT lands in it
    raise KeyboardInterrupt

try:
    callback()
    for _ in range(int(sys.argv[2])):  # hundredths of a second to wait for the interrupt
        time.sleep(0.01)
    print("ran on")
except KeyboardInterrupt:
    print("interrupted")
"""


@pytest.mark.parametrize(("hook", "outcome"), [("hook", "interrupted"), ("none", "ran on")])
def test_a_ctrl_c_python_drops_reaches_the_main_thread(hook: str, outcome: str) -> None:
    """A KeyboardInterrupt raised in a ctypes callback is only printed by Python ("Exception ignored"); with the
    entry point's hook it is raised again in the main thread, silently. Without the hook the command runs on."""
    import subprocess
    import sys

    # with the hook, the wait only guards against a hang; without it, nothing would ever come
    waits = int(HANG_GUARD_S / 2 * 100) if hook == "hook" else 100
    done = subprocess.run([sys.executable, "-c", DROPPED_INTERRUPT, hook, str(waits)], capture_output=True,
                          text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0 and done.stdout.strip() == outcome, done.stdout + done.stderr
    assert ("Exception ignored" in done.stderr) == (hook == "none"), done.stderr


@pytest.mark.parametrize(("option", "value", "pattern"), [
    ("--regex", "(yes|no)[.!]", r"(yes|no)[.!]"),
    ("--grammar", 'start: "It is " COLOR "."\nCOLOR: "red" | "blue"', r"It is (red|blue)\."),
    ("--json-schema", "@schema.json", r'\{"ok": (true|false), "color": "(red|blue)"\}'),
])
def test_run_answers_keep_to_a_grammar(option: str, value: str, pattern: str, tmp_path: Path, monkeypatch,
                                       capsys) -> None:
    """A random model's answers, sampled, still keep to the grammar (and stop where it is complete)."""
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "color"],
              "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    monkeypatch.chdir(tmp_path)
    for seed in range(3):
        assert main(["run", "--model", str(TINY), "--backend", "cpu", "-n", "40", "-t", "1.0", "--seed", str(seed),
                     "--json", option, value, "hi"]) == 0
        text = json.loads(capsys.readouterr().out)["text"]
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize(("option", "text"), [
    ("--json-schema", '{"type": "string"}'),
    ("--grammar", 'start: "yes"'),
    ("--rope-scaling", '{"rope_type": "linear", "factor": 2.0}'),
])
def test_an_option_file_is_read_as_stdin_is(option: str, text: str, tmp_path: Path, monkeypatch, capsys) -> None:
    """@FILE: at most stdin's limit (one byte past it is one line, as on stdin) and strictly UTF-8."""
    from kestrel_core.model import validate

    monkeypatch.setattr(validate, "MAX_STDIN_BYTES", 1 << 10)
    at_limit, past_limit, latin1 = tmp_path / "at", tmp_path / "past", tmp_path / "latin1"
    at_limit.write_text(text + " " * ((1 << 10) - len(text)))
    past_limit.write_text(text + " " * ((1 << 10) + 1 - len(text)))
    latin1.write_bytes(text.encode() + b"\n\xe9")
    assert main(["run", "--model", str(TINY), "-n", "1", option, f"@{at_limit}", "hi"]) == 0
    capsys.readouterr()
    for path, needle in ((past_limit, f"{option}: {past_limit} holds more than"),
                         (latin1, f"{option}: {latin1} is not valid UTF-8 (byte {len(text) + 1}")):
        assert main(["run", "--model", str(TINY), "-n", "1", option, f"@{path}", "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err


def test_run_keeps_no_prefix_for_later_requests(capsys) -> None:
    """One prompt: nothing would read the blocks the prefix cache keeps (a device's pool is not made for them)."""
    assert main(["run", "--model", str(TINY), "--backend", "cpu", "-n", "2", "--json", "hi"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["prefix_cache"] is False and stats["prefix_cached_blocks"] == 0


EMBED = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "tiny-qwen3-embed"


def test_embed_prints_a_json_vector_a_line(capsys, monkeypatch) -> None:
    import io

    import numpy as np

    import kestrel_core

    with kestrel_core.load(str(EMBED), backend="cpu") as engine:
        want = engine.embed([engine.tokenizer.encode(t) for t in ("Paris", "Rome")], dimensions=8)
    assert main(["embed", "--model", str(EMBED), "--dimensions", "8", "Paris", "Rome"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert np.array_equal(np.array([json.loads(line) for line in lines], np.float32), want)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"Paris\r\nRome\n")))
    assert main(["embed", "--model", str(EMBED), "--dimensions", "8"]) == 0
    assert capsys.readouterr().out.splitlines() == lines  # one text a line of stdin


def test_embed_gives_a_vector_a_line_of_stdin_whatever_the_line_holds(capsys, monkeypatch) -> None:
    """Only a newline ends a line: U+2028, U+0085, a form feed or an ASCII separator is part of its text, and the
    Nth vector is the Nth line's, as the same texts given as arguments embed them."""
    import io

    texts = ["first line", "second\u2028still second", "third\x0cstill third", "fourth\x85x", "fifth\x1eend",
             "sixth\x1c\x1dend", "  "]
    assert main(["embed", "--model", str(EMBED), "--dimensions", "8", *texts]) == 0
    want = capsys.readouterr().out.splitlines()
    assert len(want) == len(texts)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("\n".join(texts).encode() + b"\n")))
    assert main(["embed", "--model", str(EMBED), "--dimensions", "8"]) == 0
    assert capsys.readouterr().out.splitlines() == want


@pytest.mark.parametrize(("stdin", "argv", "needle"), [
    (b"Paris\n\nRome\n", [], "line 2 of stdin is empty"),
    (b"Paris\nRome\n\n", [], "line 3 of stdin is empty"),
    (b"\n", [], "line 1 of stdin is empty"),
    (b"", ["Paris", ""], "argument 2 is empty"),
])
def test_an_empty_text_to_embed_is_named_by_its_place(stdin: bytes, argv: list[str], needle: str, capsys,
                                                        monkeypatch) -> None:
    """A blank line would shift every vector after it if skipped: refused by its number, as /v1/embeddings
    refuses an empty input, before the model loads."""
    import io

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert main(["embed", "--model", "/nonexistent/model", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(("argv", "needle"), [
    (["embed", "--model", str(EMBED), "--dimensions", "0", "x"], "--dimensions: dimensions must be an integer >= 1"),
    (["embed", "--model", str(EMBED), "--dimensions", "65", "x"], "dimensions must be in [1, 64]"),
    (["run", "--model", str(EMBED), "hi"], "this is an embedding model (last pooling)"),
    (["run", "--model", str(EMBED), "--max-model-len", "0", "hi"], "--max-model-len: max_model_len must be an integer"),
    (["embed", "--model", str(EMBED), "--max-model-len", "1000000", "x"], "max_model_len must be an integer in [1, "),
    (["embed", "--model", str(EMBED), "--rope-scaling", "{yarn", "x"], "--rope-scaling: not JSON"),
    (["embed", "--model", str(EMBED), "--rope-scaling", "[4]", "x"], "--rope-scaling: a JSON object"),
    (["embed", "--model", str(EMBED), "--rope-scaling", '{"type": "ntk"}', "x"], "rope scaling type 'ntk'"),
])
def test_embed_bad_input_is_one_line_and_exit_2(argv: list[str], needle: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1] and "Traceback" not in "\n".join(err)


def test_embed_takes_no_generation_options(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["embed", "--model", str(EMBED), "--speculate", "2", "x"])
    assert stop.value.code == 2 and "unrecognized arguments: --speculate" in capsys.readouterr().err


def test_quantize_never_writes_over_its_input_or_what_is_not_a_file(artifact: Path, tmp_path: Path, capsys) -> None:
    """Even with --force: not the model being quantized (a .kst into itself), nor a FIFO or device the rename
    would replace; nothing is touched."""
    import os

    copy = tmp_path / "copy.kst"
    copy.write_bytes(artifact.read_bytes())
    assert main(["quantize", str(copy), "-o", str(copy), "--force"]) == 2
    assert "is the model being quantized" in capsys.readouterr().err
    assert copy.read_bytes() == artifact.read_bytes()
    fifo = tmp_path / "fifo.kst"
    os.mkfifo(fifo)
    assert main(["quantize", str(TINY), "-o", str(fifo), "--force"]) == 2
    assert "not a regular file" in capsys.readouterr().err and fifo.is_fifo()
    assert main(["quantize", str(TINY), "-o", ""]) == 2
    assert "output must not be empty" in capsys.readouterr().err
    dangling = tmp_path / "link.kst"
    dangling.symlink_to(tmp_path / "nowhere")
    assert main(["quantize", str(TINY), "-o", str(dangling)]) == 2  # a link is the user's too
    assert "already exists" in capsys.readouterr().err and dangling.is_symlink()


def test_quantize_removes_only_its_own_stale_temp_files(tmp_path: Path) -> None:
    """A killed writer's temp file (mkstemp's name, an hour old) goes; a user's file that merely looks alike
    stays."""
    import os
    import time

    ours, theirs = tmp_path / ".out.kst.ab12cd34.tmp", tmp_path / ".out.kst.notes.tmp"
    for path in (ours, theirs):
        path.write_text("x")
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    assert main(["quantize", str(TINY), "-o", str(tmp_path / "out.kst")]) == 0
    assert not ours.exists() and theirs.read_text() == "x"


def _cli(args: list[str], **kwargs) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    return subprocess.run([sys.executable, "-m", "kestrel_core.cli", *args], capture_output=kwargs.pop(
        "capture_output", True), text=True, timeout=HANG_GUARD_S, **kwargs)


def test_a_standard_stream_closed_at_launch_is_empty_or_nowhere() -> None:
    """``kestrel list >&-`` runs (its output goes nowhere); ``kestrel run <&-`` has no prompt: one line, exit 2."""
    listed = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "list"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, timeout=HANG_GUARD_S, preexec_fn=lambda: os.close(1))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr and "Error" not in listed.stderr
    run = subprocess.run([sys.executable, "-m", "kestrel_core.cli", "run", "--model", str(TINY), "--backend",
                          "cpu"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=HANG_GUARD_S,
                         preexec_fn=lambda: os.close(0))
    assert run.returncode == 2 and run.stderr.strip().endswith("no prompt given (pass it as an argument or on stdin)")


def test_a_reader_that_leaves_ends_the_command_quietly() -> None:
    """``kestrel run ... | head -c 1``: the write that finds the pipe closed ends the command as SIGPIPE would
    (128 + 13), without an error line."""
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_core.cli", "run", "--model", str(TINY), "--backend",
                             "cpu", "--no-chat", "-n", "400", "--regex", "x{300}", "hi"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(1)
    proc.stdout.close()
    assert proc.wait(timeout=HANG_GUARD_S) == 141
    assert "error" not in proc.stderr.read()


@pytest.mark.parametrize(("argv", "stream"), [
    (["backends"], "stdout"), (["list"], "stdout"), (["cache"], "stdout"), (["selftest", "--seeds", "1"], "stdout"),
    (["run", "--model", str(TINY), "--backend", "cpu", "-n", "1", "hi"], "stderr"),
])
def test_a_reader_gone_before_a_table_or_a_line_of_rich_ends_as_sigpipe(argv: list[str], stream: str,
                                                                       tmp_path: Path) -> None:
    """What the commands print through rich (tables, stderr's lines) ends as ``run``'s text does when its reader
    has gone (``kestrel backends | true``): 128 + 13, no error line."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, stream: write_end}
    try:
        done = subprocess.run([sys.executable, "-m", "kestrel_core.entry", *argv], stdin=subprocess.DEVNULL,
                              timeout=HANG_GUARD_S, text=True, **streams,
                              env={**os.environ, "KESTREL_HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")})
    finally:
        os.close(write_end)
    assert done.returncode == 141 and not done.stdout and not done.stderr, (done.returncode, done.stderr)


def test_stdin_past_its_limit_is_one_line(monkeypatch) -> None:
    import io

    from kestrel_core.errors import KestrelError
    from kestrel_core.model import validate

    monkeypatch.setattr(validate, "MAX_STDIN_BYTES", 1 << 10)
    stream = io.TextIOWrapper(io.BytesIO(b"x" * 2048), encoding="utf-8")
    with pytest.raises(KestrelError, match="stdin holds more than"):
        validate.read_text_stdin(stream)
    with pytest.raises(KestrelError, match="a line of more than"):
        validate.read_line_stdin(io.StringIO("y" * 2048))
    assert validate.read_text_stdin(io.TextIOWrapper(io.BytesIO(b"ok\r\n"), encoding="utf-8")) == "ok\n"
