"""One-line errors that name what the user gave: the text to embed that is too long, the bench that cannot run,
the path the OS refused."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kestrel_core.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
EMBED = FIXTURES / "tiny-qwen3-embed"  # a context of 256 tokens
LONG = " ".join(["word"] * 400)


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    return err[-1]


@pytest.mark.parametrize(("stdin", "argv", "place"), [
    (f"short\n{LONG}\nshort\n", [], "line 2 of stdin"),
    ("", ["short", "short", LONG], "argument 3"),
])
def test_a_text_too_long_to_embed_is_named_by_its_place(stdin: str, argv: list[str], place: str, capsys,
                                                       monkeypatch) -> None:
    """As an empty text is: which of the texts to shorten, not just that one is too long."""
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
    assert main(["embed", "--model", str(EMBED), "--backend", "cpu", *argv]) == 2
    error = _error(capsys)
    assert f"the text of {place} has " in error and "tokens; the model's context is 256" in error, error


@pytest.mark.parametrize("prompt_tokens", ["100", "40"])  # the prompt alone past the cache; with its answer
def test_a_bench_whose_one_stream_does_not_fit_is_one_error(prompt_tokens: str, capsys) -> None:
    """Not the warning that the streams will take turns, then the scheduler's refusal of the prompt (or streams
    cut short at the cache's end): one stream is what the cache cannot hold, and how much would."""
    assert main(["bench", "--model", str(FIXTURES / "tiny-qwen3"), "--backend", "cpu", "--kv-cache-mb", "0.1",
                 "--concurrency", "2", "--prompt-tokens", prompt_tokens, "--decode-tokens", "30"]) == 2
    err = capsys.readouterr().err
    assert "run at once" not in err, err
    assert err.strip().splitlines()[-1] == (f"error: {prompt_tokens} prompt + 30 decode tokens need more than the 64 "
                                            "positions the KV cache holds: not even one stream fits (--kv-cache-mb 1 "
                                            "gives it room)"), err


def test_a_kestrel_home_that_cannot_hold_its_directories_is_named(tmp_path: Path, monkeypatch, capsys) -> None:
    """What to fix is KESTREL_HOME (a file in its place), said in words; a file where one of its directories
    goes is named itself."""
    home = tmp_path / "notes"
    home.write_text("my notes")
    monkeypatch.setenv("KESTREL_HOME", str(home))
    for argv in (["run", "-n", "2", "hi"], ["pull"], ["cache"], ["cache", "--clear"], ["list"], ["list", "--json"]):
        assert main(argv) == 2, argv
        assert _error(capsys) == f"error: KESTREL_HOME {home}: not a directory", argv
    home = tmp_path / "home"
    (home / "models").parent.mkdir()
    (home / "models").write_text("my notes")
    monkeypatch.setenv("KESTREL_HOME", str(home))
    assert main(["run", "-n", "2", "hi"]) == 2
    assert _error(capsys) == f"error: cannot make the directory {home / 'models'}: file exists"
    assert main(["list"]) == 2
    assert _error(capsys) == f"error: cannot read the directory {home / 'models'}: not a directory"
    assert (home / "models").read_text() == "my notes"


def test_a_path_too_long_is_said_in_words(tmp_path: Path, capsys) -> None:
    """The OS's reason and the path, with what kestrel was doing: no "[Errno 36]" and quoted path."""
    long = tmp_path / ("x" * 300)
    cases = [
        (["quantize", str(FIXTURES / "tiny-qwen3"), "-o", f"{long}.kst"], f"cannot write {long}.kst"),
        (["quantize", str(long), "-o", str(tmp_path / "out.kst")], f"cannot read the model {long}"),
        (["run", "--model", str(long), "hi"], f"cannot read the model {long}"),
        (["run", "--model", str(FIXTURES / "tiny-qwen3"), "--lora", str(long), "hi"], f"LoRA adapter {long}"),
        (["pull", str(long)], str(long)),  # what no command names: the OS's words on the path alone
    ]
    for argv, where in cases:
        assert main(argv) == 2, argv
        assert _error(capsys) == f"error: {where}: file name too long", argv


@pytest.mark.parametrize(("model", "name", "argv"), [
    ("tiny-qwen3", "tokenizer.json", []),
    ("tiny-qwen3", "tokenizer_config.json", []),
    ("tiny-qwen3", "config.json", []),
    ("tiny-qwen3-embed", "modules.json", []),
    ("tiny-llama-lora", "adapter_config.json", ["--model", str(FIXTURES / "tiny-llama")]),
])
def test_a_model_file_that_cannot_be_read_is_said_in_words(model: str, name: str, argv: list[str], monkeypatch,
                                                           capsys) -> None:
    """An OS error on one of a model's files (a permission, an I/O error), where it is read."""
    path = FIXTURES / model / name
    read_text = Path.read_text

    def refuse(self: Path, *args, **kwargs) -> str:
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refuse)
    which = ["--lora", str(FIXTURES / model), *argv] if argv else ["--model", str(FIXTURES / model)]
    assert main(["embed" if model.endswith("embed") else "run", "--backend", "cpu", *which, "hi"]) == 2
    lora = f"LoRA adapter {FIXTURES / model}: " if argv else ""
    assert _error(capsys) == f"error: {lora}cannot read {path}: permission denied"
