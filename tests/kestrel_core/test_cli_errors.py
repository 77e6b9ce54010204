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
