"""The ``kestrel serve`` command line: bad options fail in one line before any model loads; lazy imports."""

from __future__ import annotations

import importlib.util
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import kestrel_core
from kestrel_core.cli import main
from kestrel_core.model.async_engine import AsyncEngine
from kestrel_core.model.speculate import DRAFT_MIN, DRAFT_P_MIN
from kestrel_core.serve import command

from ..waits import HANG_GUARD_S
from .helpers import http, running_server

# the shared CLI check words them as it does run's and bench's: "--flag: field must be ..."
TINY = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen3"
BAD_VALUES = [
    (["--port", "70000"], "--port: port must be an integer in [0, 65535], got 70000"),
    (["--port", "-1"], "--port: port must be an integer in [0, 65535], got -1"),
    (["--max-batch", "0"], "--max-batch: max_batch must be an integer in [1, 4096], got 0"),
    (["--max-waiting", "-1"], "--max-waiting: max_waiting must be an integer in [0, 65536], got -1"),
    (["--token-budget", "0"], "--token-budget: token_budget must be an integer in [1, 65536], got 0"),
    (["--kv-cache-mb", "0"], "--kv-cache-mb: kv_cache_mb must be in (0, "),
    (["--kv-cache-mb", "nan"], "--kv-cache-mb: kv_cache_mb must be in (0, "),
    (["--shutdown-grace", "-1"], "--shutdown-grace: shutdown_grace must be in [0, 86400], got -1.0"),
    (["--max-request-mb", "0"], "--max-request-mb: max_request_mb must be in [1e-06, "),
    (["--max-request-mb", "1e-7"], "--max-request-mb: max_request_mb must be in [1e-06, "),
    (["--host", ""], "--host: host must not be empty, got ''"),
    (["--served-model-name", " "], "--served-model-name: served_model_name must not be empty, got ' '"),
    (["--api-key", ""], "--api-key: api_key must not be empty, got ''"),
    # bounded as bench --concurrency is (a batch's logit rows), the queue and a step's tokens too
    (["--max-batch", "4097"], "--max-batch: max_batch must be an integer in [1, 4096], got 4097"),
    (["--max-waiting", "65537"], "--max-waiting: max_waiting must be an integer in [0, 65536], got 65537"),
    (["--token-budget", "1000000000"], "--token-budget: token_budget must be an integer in [1, 65536], got 1000000000"),
]



@pytest.fixture(autouse=True)
def never_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``main(["serve", ...])`` here that got as far as serving would serve until a signal: a bad value the
    command took fails the test at once instead (the tests that serve replace ``server.serve`` itself)."""
    def serving(*_: object) -> None:
        raise AssertionError("kestrel serve took its options and went on to serve")

    monkeypatch.setattr("kestrel_core.serve.server.warm_up", serving)

@pytest.mark.parametrize(("argv", "needle"), [
    *BAD_VALUES,
    (["--host", "no such host"], "cannot listen on no such host:0"),
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--backend", "nope"], "unknown backend 'nope'"),
    (["--preset", "tiny", "--model", "m.gguf"], "either --model or --preset"),
    (["--preset", "gpt5"], "unknown preset 'gpt5'"),
    (["--served-model-name", "a", "--served-model-name", "b"], "2 --served-model-name for 1 model(s)"),
    (["--model", str(TINY), "--model", str(TINY)], "two models are named 'tiny-qwen3'"),
    (["--model", str(TINY), "--max-model-len", "257"], "max_model_len must be an integer in [1, 256]"),
    (["--model", str(TINY), "--rope-scaling", "yarn"], "--rope-scaling: not JSON"),
    (["--model", str(TINY), "--model", str(TINY), "--lora", str(TINY)], "--lora merges into one model"),
    (["--model", str(TINY), "--lora", str(TINY)], "needs adapter_config.json and adapter_model.safetensors"),
    (["--model", str(TINY), "--model", str(TINY), "--draft-model", str(TINY), "--speculate", "2"],
     "--draft-model drafts for one model"),
    (["--model", str(TINY), "--draft-model", str(TINY.parent / "tiny-qwen3_5"), "--speculate", "2"],
     "its recurrent layers keep a state"),
    (["--model", str(TINY), "--draft-model", str(TINY)], "--draft-model guesses the --speculate N tokens"),
    (["--model", str(TINY), "--speculate", "2", "--draft-p-min", "0.5"], "give --draft-model too"),
    (["--model", str(TINY), "--draft-model", str(TINY), "--speculate", "2", "--draft-p-min", "1.5"],
     "--draft-p-min: draft_p_min must be in [0, 1], got 1.5"),
    (["--model", str(TINY), "--speculate", "2", "--draft-min", "1"], "give --draft-model too"),
    (["--model", str(TINY), "--draft-model", str(TINY), "--speculate", "2", "--draft-min", "-1"],
     "--draft-min: draft_min must be an integer >= 0, got -1"),
    (["--model", str(TINY), "--draft-model", str(TINY), "--speculate", "2", "--draft-min", "3"],
     "--draft-min 3 is more than --speculate 2"),
])
def test_bad_options_are_one_line_and_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", "0", *argv]) == 2  # port 0: a server on 8000 is no failure here
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_serve_words_a_bad_value_as_run_does(capsys: pytest.CaptureFixture[str]) -> None:
    """One check for every command: the same flag, the same value, the same line."""
    assert main(["run", "--seed", "-1", "hi"]) == 2
    run_err = capsys.readouterr().err.strip()
    assert main(["bench", "--runs", "0"]) == 2
    bench_err = capsys.readouterr().err.strip()
    assert main(["serve", "--max-batch", "0"]) == 2
    serve_err = capsys.readouterr().err.strip()
    assert run_err == "error: --seed: seed must be an integer in [0, 9223372036854775807], got -1"
    assert bench_err == "error: --runs: runs must be an integer in [1, 10000], got 0"
    assert serve_err == "error: --max-batch: max_batch must be an integer in [1, 4096], got 0"


@pytest.mark.parametrize(("argv", "needle"), BAD_VALUES[:4] + BAD_VALUES[8:9] + BAD_VALUES[-3:-2])
def test_the_command_exits_2_with_one_line(argv: list[str], needle: str) -> None:
    """The installed command's own process: nothing loads, nothing listens, one line on stderr."""
    done = subprocess.run([sys.executable, "-m", "kestrel_core.entry", "serve", *argv], capture_output=True,
                          text=True, timeout=HANG_GUARD_S)
    err = done.stderr.strip()
    assert done.returncode == 2, (done.returncode, err)
    assert needle in err and len(err.splitlines()) == 1 and done.stdout == ""


@pytest.mark.parametrize(("argv", "env", "needle"), [
    (["--api-key", "k\udcff"], None, "--api-key is not valid UTF-8 (character 1)"),
    ([], "k\udcff", "KESTREL_API_KEY is not valid UTF-8 (character 1)"),
    (["--api-key", " "], None, "--api-key: api_key must not be empty"),
    ([], "", "KESTREL_API_KEY is set but empty"),
    ([], " \t", "KESTREL_API_KEY is set but empty"),
])
def test_a_bad_key_is_one_line_before_the_model_loads(
        argv: list[str], env: str | None, needle: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The same bytes (lone surrogates, as Python decodes them from argv or the environment) from the option or
    the variable: the same refusal, and no model loaded first. A blank key (a deployment's unset variable
    substituted empty) fails closed rather than serving without one."""
    from kestrel_core.errors import KestrelError
    from kestrel_core.model import engine_load

    if env is not None:
        monkeypatch.setenv(command.API_KEY_ENV, env)
    loaded: list[object] = []

    def load(*args: object, **kwargs: object) -> None:
        loaded.append(args)
        raise KestrelError("the model loaded")

    monkeypatch.setattr(engine_load, "load", load)
    assert main(["serve", "--model", str(TINY), "--port", "0", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and not loaded


@pytest.mark.parametrize("origin", ["", "app.example", "https://app.example/page", " https://app.example",
                                    "https://"])
def test_an_origin_no_browser_sends_is_refused_before_the_model_loads(origin: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A page's origin is SCHEME://HOST[:PORT] (or '*'): one given without its scheme, with a path or blank would
    match no browser's Origin header, and that page would get 403s from a server that seems to allow it."""
    # a model that does not exist: only the origin's check can come first and say something else
    assert main(["serve", "--port", "0", "--model", "/nonexistent/model", "--allowed-origins", origin]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--allowed-origins: {origin!r} is not a web page's origin" in err and len(err.splitlines()) == 1, err


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
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("flags", "want"), [([], {"temperature": 0.6, "top_k": 20}), (["--no-model-sampling"], {})])
def test_the_served_engines_take_the_models_sampling_unless_told_not_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], want: dict) -> None:
    import json
    import shutil

    from kestrel_core.serve import server

    model = tmp_path / "tiny-qwen3"
    shutil.copytree(TINY, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    served: list[tuple[dict, str]] = []
    monkeypatch.setattr(server, "serve", lambda engines, **_: served.extend(
        (e.sampling_defaults, server._describe("m", e, None)) for e in engines))
    assert main(["serve", "--model", str(model), "--port", "0", *flags]) == 0
    ((sampling, startup_line),) = served
    assert sampling == want
    assert startup_line.endswith(", sampling by default as it recommends: temperature 0.6, top_k 20") == bool(want)


def test_speculate_on_a_recurrent_model_says_it_decodes_without_guesses(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """As ``kestrel run`` says it: a served model whose recurrent layers cannot take back a guess."""
    from kestrel_core.serve import server

    served: list[int] = []
    monkeypatch.setattr(server, "serve", lambda engines, **_: served.extend(e.speculate for e in engines))
    model = TINY.parent / "tiny-lfm2"
    assert main(["serve", "--model", str(model), "--port", "0", "--speculate", "3"]) == 0
    assert served == [3]
    assert "--speculate: this model decodes without guesses here (its recurrent layers" in capsys.readouterr().err


def test_a_draft_model_drafts_for_the_served_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """As its options set it, and the startup line names it and the tokens it guesses a step (none without it)."""
    from kestrel_core.serve import server

    served: list[tuple[int, str, float, int]] = []
    lines: list[str] = []

    def serve(engines, **_):  # type: ignore[no-untyped-def]
        lines.extend(server._describe("m", e, None) for e in engines)
        served.extend((e.speculate, e.draft_model.engine.source, e.draft_model.p_min, e.draft_model.n_min)
                      for e in engines if e.draft_model is not None)

    monkeypatch.setattr(server, "serve", serve)
    draft = TINY.parent / "tiny-llama"
    plain = ["serve", "--model", str(TINY), "--port", "0", "--speculate", "3"]
    command = [*plain, "--draft-model", str(draft)]
    assert main(command) == 0 and main([*command, "--draft-p-min", "0.4", "--draft-min", "2"]) == 0
    assert main(plain) == 0
    assert served == [(3, str(draft), DRAFT_P_MIN, DRAFT_MIN), (3, str(draft), 0.4, 2)]
    assert lines[:2] == [f"model m, backend cpu, draft model {draft} guessing up to 3 tokens a step"] * 2
    assert lines[2] == "model m, backend cpu"


@pytest.mark.parametrize(("flags", "want"), [([], "fcfs"), (["--scheduling-policy", "priority"], "priority")])
def test_the_scheduling_policy_reaches_the_server(monkeypatch: pytest.MonkeyPatch, flags: list[str], want: str) -> None:
    from kestrel_core.serve import server

    policies: list[str] = []
    monkeypatch.setattr(server, "serve", lambda engines, **options: policies.append(options["scheduling_policy"]))
    assert main(["serve", "--model", str(TINY), "--port", "0", *flags]) == 0
    assert policies == [want]


def test_the_api_key_help_names_every_path_the_key_guards(capsys: pytest.CaptureFixture[str]) -> None:
    """Each route a server with a key refuses without it is named in --help, itself or by a /prefix/*."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    api_key_help = help_text.rsplit("--api-key API_KEY", 1)[1].split(" --", 1)[0]
    named = set(re.findall(r"/[\w/*-]+", api_key_help))
    with kestrel_core.load(str(TINY), backend="cpu") as engine, \
            running_server(AsyncEngine(engine), "tiny", api_key="sekrit") as server:
        paths = {route.path for route in server.config.app.routes if "{" not in route.path}
        guarded = {p for p in paths if http("POST", f"{server.url}{p}", {})[0] == 401}
    assert {"/v1/chat/completions", "/tokenize"} <= guarded and "/health" not in guarded
    unnamed = [p for p in sorted(guarded)
               if p not in named and not any(n.endswith("/*") and p.startswith(n[:-1]) for n in named)]
    assert not unnamed, f"--api-key's help ({api_key_help!r}) leaves out {unnamed}"
