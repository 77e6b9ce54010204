"""Fill in the middle: the format found from the vocabulary, the prompt's tokens, the CLI's ``--suffix``.

The tokenizers are the tiny fixtures' byte-level BPE with a format's special tokens added, over a random model
with room for them in its vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers.processors import TemplateProcessing

import kestrel_core
from kestrel_core.cli import main
from kestrel_core.errors import InvalidRequest
from kestrel_core.model.fim import FORMATS, fim_format, fim_prompt, fim_prompt_ids
from kestrel_core.model.loader import LoadedModel, write_artifact
from kestrel_core.model.presets import synthetic_model
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.tokenizer import Tokenizer

from .conftest import make_tiny_config

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen3"
QWEN = [*FORMATS[0], "<|fim_pad|>", "<|file_sep|>"]


def fim_tokenizer(specials: list[str]) -> Tokenizer:
    """tiny-qwen3's tokenizer (512 tokens) with ``specials`` added as ids 512, 513..."""
    tok = Tokenizer.from_hf_dir(TINY)
    tok.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def test_each_format_is_found_with_its_stops() -> None:
    assert fim_format(Tokenizer.from_hf_dir(TINY)) is None
    for tokens in FORMATS:
        fmt = fim_format(fim_tokenizer(list(tokens)))
        assert fmt is not None and (fmt.prefix, fmt.suffix, fmt.middle) == tokens
    tok = fim_tokenizer(QWEN)
    fmt = fim_format(tok)
    assert fmt is not None
    # <|endoftext|> is the fixture's own token 0; the padding and file separator are the added ones
    assert set(fmt.stop_token_ids) == {tok.backend.token_to_id(t) for t in ("<|fim_pad|>", "<|file_sep|>",
                                                                            "<|endoftext|>")}


def test_a_text_the_tokenizer_splits_is_no_format() -> None:
    """Vocabulary entries that text never turns into (no added token matches them whole) are no format."""
    data = json.loads(Tokenizer.from_hf_dir(TINY).to_json_str())
    for i, token in enumerate(FORMATS[0]):
        data["model"]["vocab"][token] = 512 + i
    tok = Tokenizer.from_json_str(json.dumps(data))
    assert tok.backend.token_to_id(FORMATS[0][0]) == 512 and len(tok.encode(FORMATS[0][0], False)) > 1
    assert fim_format(tok) is None


def test_the_prompt_is_the_tokens_of_each_part_joined() -> None:
    tok = fim_tokenizer(QWEN)
    pre, suf, mid = (tok.backend.token_to_id(t) for t in FORMATS[0])
    prefix, suffix = "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"
    ids, stops = fim_prompt_ids(tok, prefix, suffix)
    assert ids == [pre, *tok.encode(prefix, False), suf, *tok.encode(suffix, False), mid]
    assert tok.backend.token_to_id("<|fim_pad|>") in stops
    with pytest.raises(InvalidRequest, match="no fill-in-the-middle tokens") as info:
        fim_prompt_ids(Tokenizer.from_hf_dir(TINY), prefix, suffix)
    assert info.value.param == "suffix"


def test_special_token_text_in_the_code_stays_text() -> None:
    """A prefix that names the format's own tokens (a tokenizer's source) holds no control token: only the
    three the format puts around the parts, and the parts decode back to the code."""
    tok = fim_tokenizer(QWEN)
    pre, suf, mid = (tok.backend.token_to_id(t) for t in FORMATS[0])
    prefix = 'END = "<|endoftext|>"\nFIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")\n'
    suffix = "\nPAD = '<|fim_pad|>'\n"
    assert pre in tok.encode(prefix, False)  # what the whole-text encoding made of it
    ids, _ = fim_prompt_ids(tok, prefix, suffix)
    specials = {tok.backend.token_to_id(t) for t in QWEN} | {0}  # 0: the fixture's <|endoftext|>
    assert [i for i in ids if i in specials] == [pre, suf, mid]
    assert ids[0] == pre and ids[-1] == mid
    assert tok.decode(ids[1:ids.index(suf)]) == prefix and tok.decode(ids[ids.index(suf) + 1:-1]) == suffix


def test_the_tokenizers_bos_comes_first_and_the_models_end_is_no_added_stop() -> None:
    tok = fim_tokenizer(QWEN)
    tok.backend.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    pre = tok.backend.token_to_id(FORMATS[0][0])
    ids, stops = fim_prompt_ids(tok, "a", "b")
    assert ids[:2] == [0, pre] and ids.count(0) == 1 and 0 in stops
    _, stops = fim_prompt_ids(tok, "a", "b", ending={0})
    assert 0 not in stops and tok.backend.token_to_id("<|fim_pad|>") in stops


def test_the_repository_files_come_first_in_llama_cpps_layout() -> None:
    """llama.cpp's /infill layout: the repository's name, each file after the file separator and its name, the
    code's own file named last; then the tokenizer's BOS and the code. Names and texts are text."""
    tok = fim_tokenizer([*QWEN, "<|repo_name|>"])
    tok.backend.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    pre, suf, mid, _, sep, repo = (tok.backend.token_to_id(t) for t in [*QWEN, "<|repo_name|>"])
    files = [("a.py", "x = 1\n"), ("<|file_sep|>.py", "y = '<|fim_middle|>'\n")]
    prompt = fim_prompt(tok, "def f():", "\n", files=files)
    text = tok.encode_text
    assert prompt.ids() == [repo, *text("myproject\n"), sep, *text("a.py\n"), *text("x = 1\n"),
                            sep, *text("<|file_sep|>.py\n"), *text("y = '<|fim_middle|>'\n"),
                            sep, *text("filename\n"), 0, pre, *text("def f():"), suf, *text("\n"), mid]
    assert fim_prompt(tok, "a", "b", files=[]).files == [repo, *text("myproject\n"), sep, *text("filename\n")]
    assert fim_prompt(tok, "a", "b").files == []  # completions' suffix: the code alone


def test_without_a_file_separator_the_files_are_snippets() -> None:
    tok = fim_tokenizer(list(FORMATS[0]))
    prompt = fim_prompt(tok, "a", "b", files=[("a.py", "x = 1"), ("b.py", "y = 2")])
    snippet = tok.encode_text("\n\n--- snippet ---\n\n")
    assert prompt.files == [*snippet, *tok.encode_text("x = 1"), *snippet, *tok.encode_text("y = 2")]


def fim_engine(specials: list[str] = QWEN, max_position: int = 256) -> kestrel_core.Engine:
    """A random qwen3 model of 520 tokens with ``specials`` (the Qwen format's tokens) from 512 on."""
    model = synthetic_model(make_tiny_config("qwen3", vocab_size=520, max_position=max_position), "q8", seed=5)
    return kestrel_core.load(LoadedModel(model, fim_tokenizer(specials), "fim-test", "q8"), backend="cpu")


def test_run_suffix_fills_the_middle(tmp_path: Path, capsys) -> None:
    with fim_engine() as engine:
        kst = write_artifact(LoadedModel(engine.model, engine.tokenizer, "fim-test", "q8"), tmp_path / "fim.kst",
                             progress=lambda done, total: None)
        ids, stops = fim_prompt_ids(engine.tokenizer, "a = ", "\nb = a")
        want = [t for out in engine.stream(ids, SamplingParams(max_tokens=6, stop_token_ids=stops))
                for t in out.new_token_ids]
    assert main(["run", "--model", str(kst), "--suffix", "\nb = a", "--max-tokens", "6", "--json", "a = "]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["prompt_tokens"], out["tokens"]) == (len(ids), want)


def test_run_suffix_on_a_model_without_the_tokens_is_one_line(capsys) -> None:
    assert main(["run", "--model", str(TINY), "--suffix", "b", "a"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --suffix: this model's vocabulary has no fill-in-the-middle tokens")
