"""The run / chat / bench commands, in process, on a tiny synthetic preset (quantize: test_quantize_command.py)."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from kestrel_core.cli import main
from kestrel_core.model import engine as engine_mod
from kestrel_core.model import presets
from kestrel_core.model.chat_template import compile_chat_template, render_chat
from kestrel_core.model.detokenize import TextStream
from kestrel_core.model.engine_load import load_preset
from kestrel_core.model.presets import ByteTokenizer
from kestrel_core.model.reasoning import MISTRAL_THINK, THINK


@pytest.fixture(autouse=True)
def tiny_preset(monkeypatch: pytest.MonkeyPatch, tiny_config) -> None:
    monkeypatch.setitem(presets.PRESETS, "tiny", tiny_config("qwen3", max_position=96))


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _direct_tokens(prompt_ids: list[int], n: int) -> list[int]:
    with load_preset("tiny", backend="cpu") as engine:
        return list(engine.generate(prompt_ids, max_tokens=n))


def test_run_json_reports_text_tokens_and_stats(capsys) -> None:
    code, out, err = _run(capsys, "run", "hello", "--preset", "tiny", "--no-chat", "--json", "-n", "6",
                          "--backend", "cpu")
    assert code == 0
    result = json.loads(out)
    assert result["prompt_tokens"] == 5
    assert result["tokens"] == _direct_tokens(list(b"hello"), 6)
    assert result["text"] == ByteTokenizer().decode(result["tokens"])
    stats = result["stats"]
    assert stats["backend"] == "cpu" and stats["prefill_tok_s"] > 0
    assert stats["offload"]["kestrel_gemm_q8"]["accepted"] > 0
    # the decode rate divides the tokens after the first (which the prefill gave), and says so
    assert stats["decode_tokens"] == stats["generated_tokens"] - 1 == 5
    assert stats["decode_tok_s"] == pytest.approx(5 / stats["decode_s"])
    lines = err.strip().splitlines()
    assert lines[0].startswith("backend: cpu") and lines[-1].startswith("prompt 5 tok | prefill")
    assert "(5 tok after the first)" in lines[-1]


@pytest.mark.parametrize(("max_tokens", "finish", "noted"), [(6, "length", False), (200, "length", True)])
def test_run_says_when_the_context_ended_the_answer(capsys, max_tokens: int, finish: str, noted: bool) -> None:
    """The context's end, not --max-tokens, stopped it: a note on stderr, and --json's finish_reason."""
    argv = ["run", "hello", "--preset", "tiny", "--no-chat", "-n", str(max_tokens), "--backend", "cpu",
            "--temperature", "0"]
    code, out, err = _run(capsys, *argv, "--json")
    result = json.loads(out)
    assert code == 0 and result["finish_reason"] == finish
    assert len(result["tokens"]) == (96 - 5 if noted else max_tokens)
    code, out, err = _run(capsys, *argv)
    assert code == 0 and ("end of the model's context of 96 tokens" in err) == noted


def test_run_streams_text_with_the_chat_template(capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("piped prompt"))  # no argument: the prompt comes from stdin
    code, out, err = _run(capsys, "run", "--preset", "tiny", "-n", "5", "--stats")
    assert code == 0
    tok = ByteTokenizer()
    ids = tok.encode_chat([{"role": "user", "content": "piped prompt"}])
    assert out == tok.decode(_direct_tokens(ids, 5)) + "\n"
    assert f"prompt {len(ids)} tok" in err and "offload hooks" in err


@pytest.mark.parametrize("argv, message", [
    (["run", "x" * 97, "--preset", "tiny", "--no-chat"], "the prompt has 97 tokens; the model's context is 96"),
    (["run", "hi", "--preset", "gpt5"], "unknown preset 'gpt5'"),
    (["run", "hi", "--preset", "tiny", "--backend", "nope"], "unknown backend 'nope'"),
    (["run", "hi", "--preset", "tiny", "--quant", "q3"], "unknown quant mode 'q3'"),
    (["run", "hi", "--preset", "tiny", "--model", "m.gguf"], "either --model or --preset"),
    (["run", "hi", "--model", "/nonexistent/model.gguf"], "does not exist"),
    (["run", "hi", "--preset", "tiny", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["bench", "--preset", "tiny", "--prompt-tokens", "90", "--decode-tokens", "9"], "exceed the model's context"),
    # the answer is the first token and the decode tokens: 87 + 1 + 9 is one past the tiny preset's 96
    (["bench", "--preset", "tiny", "--prompt-tokens", "87", "--decode-tokens", "9"], "exceed the model's context"),
    (["bench", "--preset", "tiny", "--prompt-tokens", "40", "--decode-tokens", "30", "--kv-cache-mb", "0.045"],
     "positions the KV cache holds"),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(capsys, argv: list[str], message: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code != 0 and out == ""
    error_lines = [line for line in err.splitlines() if not line.startswith("backend:")]
    assert len(error_lines) == 1 and error_lines[0].startswith("error:") and message in error_lines[0]


def test_bench_json_and_table(capsys) -> None:
    code, out, _ = _run(capsys, "bench", "--preset", "tiny", "--backend", "cpu", "--prompt-tokens", "16",
                        "--decode-tokens", "4", "--runs", "2", "--warmup", "0", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["prompt_tokens"] == 16 and result["decode_tokens"] == 4 and result["runs"] == 2
    assert len(result["prefill_tok_s_runs"]) == len(result["decode_tok_s_runs"]) == 2
    assert min(result["prefill_tok_s_runs"]) <= result["prefill_tok_s"] <= max(result["prefill_tok_s_runs"])
    assert result["decode_tok_s"] > 0 and result["backend"] == "cpu" and result["preload_s"] >= 0
    code, out, _ = _run(capsys, "bench", "--preset", "tiny", "--prompt-tokens", "8", "--decode-tokens", "2",
                        "--runs", "1")
    assert code == 0 and "prefill (8 tok)" in out and "decode (2 tok)" in out


STREAMING_BACKEND = '''
from kestrel_core import API_VERSION, BackendInfo, hookimpl
import kestrel_cpu
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_open  # noqa: F401

MOVED = [0, 0.0]


@hookimpl
def kestrel_backend_info():
    return BackendInfo("streaming", "1", API_VERSION, "gpu")


@hookimpl
def kestrel_gemm_q8(device, a_codes, a_scales, weight, wkey):  # every GEMM "uploads" its weight at 2 GB/s
    MOVED[0] += weight.nbytes
    MOVED[1] += weight.nbytes / 2e9
    return kestrel_cpu.kestrel_gemm_q8(device, a_codes, a_scales, weight, wkey)


@hookimpl
def kestrel_stats(device):
    return {"weight_upload_bytes": MOVED[0], "weight_upload_s": MOVED[1], "bus_h2d_pinned_gb_s": 4.0}
'''


def test_bench_reports_a_streaming_backends_weight_uploads(capsys, tmp_path, monkeypatch) -> None:
    (tmp_path / "streaming.py").write_text(STREAMING_BACKEND)
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "streaming.py"))
    monkeypatch.setenv("KESTREL_STREAMING_MIN_FLOPS", "0")
    args = ("bench", "--preset", "tiny", "--backend", "streaming", "--prompt-tokens", "8", "--decode-tokens", "3",
            "--runs", "2", "--warmup", "1")
    code, out, err = _run(capsys, *args, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["upload_gb_s"] == pytest.approx(2.0)
    assert 0 < result["upload_mb_per_token"] * 1e6 * 2 * 4 < result["backend_stats"]["weight_upload_bytes"]
    bound = result["upload_mb_per_token"] / 1e3 / 4.0  # seconds a token's uploads take on the 4 GB/s bus
    assert result["bus_gb_s"] == 4.0
    assert result["bus_ratio"] == pytest.approx(1 / result["decode_tok_s"] / bound)
    code, out, _ = _run(capsys, *args)
    assert code == 0 and "MB a token at 2.0 GB/s" in out and "bus (pinned copy)" in out and "4.0 GB/s" in out
    _, out, _ = _run(capsys, "bench", "--preset", "tiny", "--backend", "cpu", "--prompt-tokens", "8",
                     "--decode-tokens", "2", "--runs", "1")
    assert "weights uploaded" not in out


ODD_STATS_BACKEND = '''
import numpy as np
from kestrel_core import API_VERSION, BackendInfo, hookimpl
from kestrel_cpu import kestrel_close, kestrel_gemm_f32, kestrel_gemm_q8, kestrel_open  # noqa: F401


class Queue:
    def __str__(self):
        return "queue 0"


@hookimpl
def kestrel_backend_info():
    return BackendInfo("oddstats", "1", API_VERSION, "gpu")


@hookimpl
def kestrel_stats(device):
    return {"queue_busy_s": np.array([0.5, 0.25]), "ratio": float("nan"), "peak": np.float32("inf"),
            "depth": np.int64(3), "queue": Queue()}
'''


def _strict_json(text: str) -> object:
    """``text`` parsed as standard JSON: NaN and Infinity, which Python's json writes and reads, are refused."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("command", [("run", "hello", "--no-chat", "-n", "4"),
                                     ("bench", "--prompt-tokens", "8", "--decode-tokens", "2", "--runs", "1")])
def test_json_output_holds_a_backends_arrays_and_non_finite_counters(capsys, tmp_path, monkeypatch,
                                                                      command: tuple[str, ...]) -> None:
    """Counters of numpy arrays and scalars come out as JSON lists and numbers, a NaN or an infinity as null, any
    other object as its text: the output is standard JSON, after the whole generation as before it."""
    (tmp_path / "oddstats.py").write_text(ODD_STATS_BACKEND)
    monkeypatch.setenv("KESTREL_BACKEND_PATH", str(tmp_path / "oddstats.py"))
    code, out, err = _run(capsys, *command, "--preset", "tiny", "--backend", "oddstats", "--json")
    assert code == 0, err
    result = _strict_json(out)
    stats = result["stats"]["backend_stats"] if command[0] == "run" else result["backend_stats"]
    assert stats == {"queue_busy_s": [0.5, 0.25], "ratio": None, "peak": None, "depth": 3, "queue": "queue 0"}


def test_bench_at_several_concurrency_levels(capsys) -> None:
    code, out, _ = _run(capsys, "bench", "--preset", "tiny", "--backend", "cpu", "--prompt-tokens", "12",
                        "--decode-tokens", "5", "--concurrency", "1,3", "--json")
    assert code == 0
    levels = json.loads(out)["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["decode_tok_s"] > 0 and lv["output_tok_s"] > 0 and 0 < lv["ttft_p50_s"] <= lv["ttft_p99_s"]
    assert levels[0]["steps"] == 5 and levels[1]["steps"] == 5  # three streams share every step
    code, out, _ = _run(capsys, "bench", "--preset", "tiny", "--backend", "cpu", "--prompt-tokens", "12",
                        "--decode-tokens", "3", "--concurrency", "2")
    assert code == 0 and "TTFT p50" in out
    code, _, err = _run(capsys, "bench", "--preset", "tiny", "--concurrency", "0,x")
    assert code == 2 and "--concurrency" in err


def test_bench_says_when_its_kv_cache_is_too_small_for_the_load(capsys) -> None:
    args = ("bench", "--preset", "tiny", "--backend", "cpu", "--prompt-tokens", "40", "--decode-tokens", "8",
            "--concurrency", "4", "--json")
    code, out, err = _run(capsys, *args, "--kv-cache-mb", "0.075")
    assert code == 0 and "4 streams need 256: they will not all run at once (--kv-cache-mb" in err
    squeezed = json.loads(out)["levels"][0]["steps"]
    code, out, err = _run(capsys, *args)
    assert code == 0 and "run at once" not in err
    assert json.loads(out)["levels"][0]["steps"] < squeezed  # together, in fewer steps


def _recorded_prompts(monkeypatch) -> list[list[int]]:
    """The prompt ids of every generation from here on."""
    prompts: list[list[int]] = []
    original = engine_mod.Engine.stream

    def recording(self, prompt_ids, *args, **kwargs):
        prompts.append(list(prompt_ids))
        return original(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(engine_mod.Engine, "stream", recording)
    return prompts


def test_chat_keeps_the_conversation(capsys, monkeypatch) -> None:
    prompts = _recorded_prompts(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n\nthere\n/exit\nnever read\n"))
    code, out, _ = _run(capsys, "chat", "--preset", "tiny", "-n", "3")
    assert code == 0 and len(prompts) == 2
    replies = out.split("\n")[:2]
    tok = ByteTokenizer()
    first = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(prompts[0]) == first
    assert tok.decode(prompts[1]) == tok.apply_chat_template([
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": replies[0].strip()},
        {"role": "user", "content": "there"}])


def test_chat_takes_several_lines_between_triple_quotes(capsys, monkeypatch) -> None:
    prompts = _recorded_prompts(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.StringIO('"""one\n\ntwo"""\n"""\nthree\n"""\n'))
    code, _, _ = _run(capsys, "chat", "--preset", "tiny", "-n", "1")
    tok = ByteTokenizer()
    assert code == 0 and len(prompts) == 2
    assert tok.decode(prompts[0]) == tok.apply_chat_template([{"role": "user", "content": "one\n\ntwo"}])
    assert tok.decode(prompts[1]).endswith(tok.apply_chat_template([{"role": "user", "content": "three"}])
                                           .removeprefix(tok.apply_chat_template([])))


def test_a_prompt_on_stdin_is_the_prompt_without_its_last_newline(capsys, monkeypatch) -> None:
    """``echo QUESTION | kestrel run`` asks what ``kestrel run QUESTION`` asks."""
    answers = []
    for argv, stdin in ((["hi there"], ""), ([], "hi there\n")):
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        code, out, _ = _run(capsys, "run", "--preset", "tiny", "-n", "4", "--json", *argv)
        assert code == 0
        answers.append(json.loads(out))
    assert answers[0]["prompt_tokens"] == answers[1]["prompt_tokens"] and answers[0]["text"] == answers[1]["text"]


def test_chat_survives_a_turn_longer_than_the_context(capsys, monkeypatch) -> None:
    """The session goes on with the next message; read from a pipe, it ends as failed (exit 2). The error is one
    line, however narrow stderr is."""
    monkeypatch.setattr("sys.stdin", io.StringIO("y" * 120 + "\nhi\n"))
    code, out, err = _run(capsys, "chat", "--preset", "tiny", "-n", "2")
    assert code == 2 and out.count("\n") == 1  # the second message answered
    (line,) = [line for line in err.splitlines() if "context is 96" in line]
    assert line.startswith("error: the conversation has") and line.endswith("(/reset to start over)")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stdin", "exit_code"), [(io.StringIO, 2), (_Terminal, 0)])
def test_chat_survives_a_template_that_refuses_a_turn(stdin: type[io.StringIO], exit_code: int, capsys,
                                                      monkeypatch) -> None:
    """A template's raise_exception for one conversation (roles that must alternate, say) drops that message: the
    conversation so far is kept and answers the next one. Read from a pipe, the session ends as failed."""
    template = compile_chat_template(
        "{% if messages[-1]['content'] == 'bad' %}{{ raise_exception('roles must alternate') }}{% endif %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")

    def render(self, messages, add_generation_prompt=True, **kwargs):  # type: ignore[no-untyped-def]
        return render_chat(template, messages, add_generation_prompt)

    monkeypatch.setattr(ByteTokenizer, "apply_chat_template", render)
    prompts = _recorded_prompts(monkeypatch)
    monkeypatch.setattr("sys.stdin", stdin("hi\nbad\nthere\n"))
    code, out, err = _run(capsys, "chat", "--preset", "tiny", "-n", "2")
    assert code == exit_code and len(prompts) == 2
    (line,) = [line for line in err.splitlines() if "roles must alternate" in line]
    assert line == "error: chat template failed: roles must alternate (the message is dropped; /reset starts over)"
    reply = ByteTokenizer().decode(prompts[1]).removeprefix("<user>hi<assistant>").partition("<user>")[0]
    assert ByteTokenizer().decode(prompts[1]) == f"<user>hi<assistant>{reply}<user>there<assistant>"


def test_text_stream_holds_back_incomplete_characters() -> None:
    tok = ByteTokenizer()
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in tok.encode("a✓b")]
    assert pieces == ["a", "", "", "✓", "b"]
    stream = TextStream(tok)
    assert [stream.push(i) for i in tok.encode("✓")[:2]] == ["", ""]
    assert stream.flush() == "\ufffd"


TINY_LLAMA = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-llama"


def test_a_sampled_run_draws_its_seed_and_reports_it(capsys) -> None:
    """Without --seed two runs sample differently; the seed --json reports gives the same answer again."""
    def run(*flags: str) -> dict[str, object]:
        code, out, err = _run(capsys, "run", "hello there", "--model", str(TINY_LLAMA), "--no-chat", "--json", "-n",
                              "24", "--backend", "cpu", "-t", "1.5", *flags)
        assert code == 0, err
        return json.loads(out)

    first, second = run(), run()
    assert first["seed"] != second["seed"] and first["tokens"] != second["tokens"]
    assert run("--seed", str(second["seed"]))["tokens"] == second["tokens"]


def test_run_samples_as_the_model_recommends_unless_told_otherwise(capsys, tmp_path, monkeypatch) -> None:
    """generation_config.json's sampling fills what the flags leave out, through the artifact and the model
    cache too; --no-model-sampling (or -t 0) is greedy again."""
    model = tmp_path / "tiny-llama"
    shutil.copytree(TINY_LLAMA, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.8, "top_k": 7, "top_p": 1.0, "repetition_penalty": 1.4}))

    def tokens(path: Path, *flags: str) -> tuple[list[int], str]:
        code, out, err = _run(capsys, "run", "hello there", "--model", str(path), "--no-chat", "--json", "-n", "12",
                              "--backend", "cpu", "--seed", "5", *flags)
        assert code == 0, err
        return json.loads(out)["tokens"], err

    recommended, err = tokens(model)
    assert "sampling as the model recommends: temperature 0.8, top-k 7, repetition-penalty 1.4 " in err
    given, err = tokens(model, "-t", "0.8", "--top-k", "7", "--repetition-penalty", "1.4")
    assert given == recommended and "recommends" not in err  # every recommended value given: no note
    greedy, err = tokens(model, "--no-model-sampling")
    assert "recommends" not in err and greedy == tokens(TINY_LLAMA)[0] != recommended
    assert "--speculate: only greedy decoding" in tokens(model, "--speculate", "2")[1]
    assert "--speculate" not in tokens(model, "--speculate", "2", "--no-model-sampling")[1]
    constrained = tokens(model, "--speculate", "2", "--no-model-sampling", "--regex", "[a-z]+")[1]
    assert "--speculate: a constrained answer decodes without guesses" in constrained
    assert tokens(model, "-t", "0")[0] not in (greedy, recommended)  # greedy, with the model's repetition penalty
    artifact = tmp_path / "tiny.kst"
    assert _run(capsys, "quantize", str(model), "-o", str(artifact))[0] == 0
    assert tokens(artifact)[0] == recommended
    monkeypatch.setenv("KESTREL_MODEL_CACHE", "1")
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    assert tokens(model)[0] == tokens(model)[0] == recommended  # written to the cache, then read from it
    assert list((tmp_path / "home").rglob("*.kst"))


def test_pull_prints_the_model_path(capsys, monkeypatch, tmp_path) -> None:
    from kestrel_core.model import pull as pull_mod

    asked = []

    def pull_default_model(progress=True, rehash=False):
        asked.append(rehash)
        return tmp_path / "model.gguf"

    monkeypatch.setattr(pull_mod, "pull_default_model", pull_default_model)
    code, out, _ = _run(capsys, "pull")
    assert code == 0 and out.strip() == str(tmp_path / "model.gguf")
    assert asked == [True]  # kestrel pull hashes the file again, whatever its record of a check says
    code, _, err = _run(capsys, "pull", "--force")  # its sha256 is checked on every pull
    assert code == 2 and "--force downloads a Hub model again" in err


def test_pull_of_a_local_path_says_it_is_one(capsys, monkeypatch, tmp_path) -> None:
    """A relative path that also reads as owner/name is what -m loads, so it is said to be a local path (not
    "no such local path"), with the way to the Hub repository of that name; the Hub is not asked."""
    from kestrel_core.model import hub

    def no_hub(spec, force=False):
        raise AssertionError(f"the Hub was asked for {spec}")

    monkeypatch.setattr(hub, "fetch", no_hub)
    (tmp_path / "w" / "qwen 3").mkdir(parents=True)
    (tmp_path / "w" / "link-qwen").symlink_to(tmp_path / "w" / "qwen 3")
    monkeypatch.chdir(tmp_path)
    hub_way = " (that repository: kestrel pull hf.co/w/link-qwen)"
    for given, then in (("w/link-qwen", hub_way), ("./w/link-qwen", ""), (str(tmp_path / "w"), "")):
        code, out, err = _run(capsys, "pull", given)
        assert code == 2 and out == ""
        assert err.strip() == (f"error: {given} is a local path, which -m loads as it is; kestrel pull fetches a "
                               f"Hugging Face Hub name{then}"), err


@pytest.mark.parametrize("width", [40, 80, 160])
def test_list_never_cuts_the_name_that_model_takes(width: int, capsys, monkeypatch, tmp_path) -> None:
    """Piped (160 columns) or in a narrow terminal: each row is whole, the name as -m takes it."""
    from kestrel_core import cli
    from kestrel_core.model import hub

    name = "unsloth/Qwen3-Coder-30B-A3B-Instruct-1M-GGUF:UD-Q4_K_XL@refs/pr/12"
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path))  # no default model
    monkeypatch.setattr(hub, "cached_models", lambda cache_dir=None: [
        hub.CachedModel(name, "gguf", tmp_path / "model.gguf", 17_654_000_000, 1.7e9)])
    monkeypatch.setattr(cli.out, "width", width)
    code, out, _ = _run(capsys, "list")
    row = rf"│ {re.escape(name)} +│ gguf +│ 17,654 MB │ \d{{4}}-\d\d-\d\d \d\d:\d\d │"
    assert code == 0 and re.search(row, out), out


def test_json_survives_numpy_backend_counters(capsys, monkeypatch) -> None:
    monkeypatch.setattr(engine_mod.Offload, "backend_stats", lambda self: {"uploads": np.int64(3),
                                                                           "ratio": np.float32(0.5)})
    code, out, _ = _run(capsys, "run", "hi", "--preset", "tiny", "--no-chat", "--json", "-n", "2")
    assert code == 0 and json.loads(out)["stats"]["backend_stats"] == {"uploads": 3, "ratio": 0.5}


def test_all_decoding_rate_counts_only_while_every_stream_decodes() -> None:
    from kestrel_core.model.bench import all_decoding_rate

    # stream a decodes at t = 0..10, stream b starts late (t = 4) and ends late (t = 14): both decode in (4, 10]
    a = [float(t) for t in range(11)]
    b = [float(t) for t in range(4, 15)]
    assert all_decoding_rate([a, b]) == 12 / 6  # 6 tokens each after t = 4 up to t = 10
    chunks = [t % 3 + 1 for t in range(11)]  # a's stamps carry 1, 2, 3, 1... tokens: 3 1 2 3 1 2 in (4, 10]
    assert all_decoding_rate([a, b], [chunks, [1] * 11]) == (12 + 6) / 6  # tokens of each stamp
    assert all_decoding_rate([a, b], [[2] * 11, [1] * 11]) == (2 * 6 + 6) / 6
    with pytest.raises(ValueError):
        all_decoding_rate([a, b], [chunks[:-1], [1] * 11])  # a count for every stamp
    assert all_decoding_rate([a]) == 10 / 10
    assert all_decoding_rate([[0.0, 1.0], [5.0, 6.0]]) == 0.0  # never all at once
    assert all_decoding_rate([]) == 0.0


def test_run_shows_a_harmony_answer_and_its_reasoning_apart(capsys, monkeypatch) -> None:
    """gpt-oss answers in channels: run keeps the special tokens' text to read them, prints the final channel and
    shows the analysis channel (the reasoning) on stderr; --json gives both."""
    from kestrel_core.model.request import RequestOutput

    answer = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Paris."
    skipped = []

    def scripted(self, ids, params):  # type: ignore[no-untyped-def]
        skipped.append(params.skip_special_tokens)
        for k in range(0, len(answer), 4):
            yield RequestOutput("r", [1], answer[k:k + 4], None, k + 4 >= len(answer), None, len(ids), k // 4 + 1)

    monkeypatch.setattr(engine_mod.Engine, "stream", scripted)
    monkeypatch.setattr(engine_mod.Engine, "harmony", property(lambda self: True))
    code, out, err = _run(capsys, "run", "hi", "--preset", "tiny", "-n", "5", "--backend", "cpu")
    assert (code, out, skipped) == (0, "Paris.\n", [False]) and "Think." in err and "<|" not in out + err
    code, out, _ = _run(capsys, "run", "hi", "--preset", "tiny", "--json", "--backend", "cpu")
    assert (json.loads(out)["text"], json.loads(out)["reasoning"]) == ("Paris.", "Think.")
    code, out, _ = _run(capsys, "run", "hi", "--preset", "tiny", "--no-chat", "--backend", "cpu")
    assert out == answer + "\n" and skipped[-1] is True  # no chat template: the model's raw text


@pytest.mark.parametrize(("markers", "answer", "skips"), [
    (THINK, "<think>\nPondering.\n</think>\n\nParis.", True),
    (MISTRAL_THINK, "[THINK]Pondering.[/THINK]Paris.", False),  # control tokens: their text is kept to be read
])
def test_run_shows_a_think_block_apart_and_passes_think_to_the_template(capsys, monkeypatch, markers, answer,
                                                                        skips) -> None:
    """A template that teaches <think> (Qwen3) or Mistral's [THINK] (Magistral): the block is the reasoning on
    stderr, what follows the answer; --think false reaches the template as enable_thinking (Qwen3's switch), a
    level as reasoning_effort too."""
    from kestrel_core.model import commands
    from kestrel_core.model.request import RequestOutput

    contexts = []
    skipped = []

    def scripted(self, ids, params):  # type: ignore[no-untyped-def]
        skipped.append(params.skip_special_tokens)
        for k in range(0, len(answer), 3):
            yield RequestOutput("r", [1], answer[k:k + 3], None, k + 3 >= len(answer), None, len(ids), k // 3 + 1)

    real = ByteTokenizer.apply_chat_template

    def template(self, messages, add_generation_prompt=True, **kwargs):  # type: ignore[no-untyped-def]
        contexts.append(kwargs)
        return real(self, messages, add_generation_prompt, **kwargs)

    monkeypatch.setattr(engine_mod.Engine, "stream", scripted)
    monkeypatch.setattr(commands, "reasoning_markers", lambda template: markers)
    monkeypatch.setattr(ByteTokenizer, "apply_chat_template", template)
    code, out, err = _run(capsys, "run", "hi", "--preset", "tiny", "--backend", "cpu", "--think", "false")
    assert (code, out, contexts[-1]) == (0, "Paris.\n", {"enable_thinking": False}) and "Pondering." in err
    code, out, _ = _run(capsys, "run", "hi", "--preset", "tiny", "--backend", "cpu", "--json", "--think", "high")
    assert (json.loads(out)["text"], json.loads(out)["reasoning"]) == ("Paris.", "Pondering.")
    assert contexts[-1] == {"enable_thinking": True, "reasoning_effort": "high"} and skipped == [skips, skips]
    code, _, _ = _run(capsys, "run", "hi", "--preset", "tiny", "--backend", "cpu", "--think", "max")
    assert (code, contexts[-1]) == (0, {"enable_thinking": True, "reasoning_effort": "max"})  # Ollama's too


def test_think_on_a_model_without_reasoning_is_said_to_be_ignored(capsys) -> None:
    code, _, err = _run(capsys, "run", "--preset", "tiny", "-n", "1", "--think", "false", "hi")
    assert code == 0 and "--think: this model's chat template has no reasoning to switch" in err
    code, _, err = _run(capsys, "run", "--preset", "tiny", "-n", "1", "hi")
    assert code == 0 and "--think" not in err


def test_ctrl_c_inside_a_block_of_lines_drops_the_block(monkeypatch) -> None:
    """As Ollama does: the lines typed so far go, and the next prompt starts a new message."""
    from kestrel_core.model.commands import _chat_message

    typed = iter(['"""one', "two", KeyboardInterrupt, "hi"])

    def answer(prompt: str) -> str:
        line = next(typed)
        if line is KeyboardInterrupt:
            raise KeyboardInterrupt
        return line

    monkeypatch.setattr("builtins.input", answer)
    assert _chat_message(True) == "hi"
