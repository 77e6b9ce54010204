"""A GGUF vocabulary's ends of generation and token types as llama.cpp reads them (llama_vocab::impl::load): the ids
the file names for eos, eot and eom, the fill-in-the-middle padding, repository and file-separator tokens, and the
end-of-turn tokens it finds by their text, made control tokens where the file types them otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest

import kestrel_core
from kestrel_core.model.gguf_reader import GGUFCheckpoint
from kestrel_core.model.gguf_vocab import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    end_of_generation,
)
from kestrel_core.model.loader import load_model
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.tokenizer import Tokenizer

LLAMA_CPP = Path(__file__).resolve().parents[2] / "fixtures" / "tokenizers" / "llama.cpp"


def write_vocab(tmp_path: Path, model: str, tokens: list[str], types: list[int], **keys: Any) -> dict[str, Any]:
    """The tokenizer fields of a vocabulary-only GGUF written by gguf-py: tokenizer.ggml.model ``model``, ``tokens``
    of llama.cpp's token ``types``, and each of ``keys`` as tokenizer.ggml.<key> (text, a flag, an id or an array:
    ``pre="gpt2"``, ``add_bos_token=False``, ``bos_token_id=1``, ``merges=[...]``, ``scores=[...]``)."""
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    for name, value in keys.items():
        key = f"tokenizer.ggml.{name}"
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def vocab(tmp_path: Path, fmt: Any, types: dict[str, int], **ids: str) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizer, tokenizer fields) of a vocabulary-only GGUF: the trained byte-level BPE's tokens (<|endoftext|> 0,
    <|im_start|> 1 and <|im_end|> 2 control tokens), then those of ``types`` it lacks, each token of ``types`` of
    that llama.cpp type; ``ids``: the tokens keys name (``eos="<|end_of_text|>"`` writes
    tokenizer.ggml.eos_token_id, ``fim_pad=...`` tokenizer.ggml.fim_pad_token_id)."""
    tokens, merges, kinds = fmt.bpe_vocab(fmt.train_bpe("gpt2"))
    for text, kind in types.items():
        if text not in tokens:
            tokens.append(text)
            kinds.append(kind)
        kinds[tokens.index(text)] = kind
    fields = write_vocab(
        tmp_path,
        "gpt2",
        tokens,
        kinds,
        pre="gpt2",
        merges=merges,
        **{f"{name}_token_id": tokens.index(text) for name, text in ids.items()},
    )
    return Tokenizer.from_gguf_vocab(fields), fields


def ids_of(tok: Tokenizer, *texts: str) -> set[int]:
    return {tok.backend.token_to_id(t) for t in texts}


def test_end_of_turn_tokens_are_found_by_text_and_eom_by_its_key(tmp_path: Path, fmt) -> None:
    """A Llama 3 GGUF whose eos is <|end_of_text|> stops at <|eot_id|> and <|eom_id|> too, whatever their type;
    tokenizer.ggml.eom_token_id names one more; a control token of another text (<|python_tag|>) ends nothing."""
    tok, fields = vocab(
        tmp_path,
        fmt,
        {
            "<|end_of_text|>": TOKEN_CONTROL,
            "<|eot_id|>": TOKEN_NORMAL,
            "<|eom_id|>": TOKEN_USER_DEFINED,
            "<|my_eom|>": TOKEN_CONTROL,
            "<|python_tag|>": TOKEN_CONTROL,
        },
        eos="<|end_of_text|>",
        eom="<|my_eom|>",
    )
    want = ids_of(tok, "<|end_of_text|>", "<|my_eom|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|im_end|>")
    assert tok.eos_token_ids[0] == tok.backend.token_to_id("<|end_of_text|>") and set(tok.eos_token_ids) == want
    assert end_of_generation(fields) == tok.eos_token_ids  # the model config's, through the GGUF reader


@pytest.mark.parametrize("kind", [TOKEN_NORMAL, TOKEN_USER_DEFINED])
def test_an_end_of_turn_the_file_does_not_mark_control_is_one_control_token(tmp_path: Path, fmt, kind: int) -> None:
    """A Qwen GGUF whose eos is <|endoftext|> and whose <|im_end|> is typed normal or user-defined: the prompt's
    <|im_end|> is the one token, read as text where special tokens are not parsed and left out of a text decoded
    without special tokens, as llama.cpp has a control token."""
    tok, _ = vocab(tmp_path, fmt, {"<|im_end|>": kind}, eos="<|endoftext|>")
    end = tok.backend.token_to_id("<|im_end|>")
    assert end in tok.eos_token_ids
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
    assert ids.count(end) == 1 and ids[0] == 1
    assert end not in tok.encode_text("hi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\n"


@pytest.mark.parametrize(
    ("texts", "end_ends"),
    [
        (("<|return|>", "<|call|>"), False),
        (("<|calls|>", "<|flush|>"), False),  # gpt-oss's harmony, Solar Open's
        (("<|return|>",), True),
        (("<|call|>",), True),
    ],
)
def test_harmony_end_ends_a_message_not_the_answer(tmp_path: Path, fmt, texts: tuple[str, ...], end_ends: bool) -> None:
    """Where <|end|> comes with <|return|> and <|call|> (or <|calls|> and <|flush|>), llama.cpp leaves it out of the
    ends of generation and makes it a user-defined token, kept in the text; otherwise it ends the answer."""
    tok, _ = vocab(tmp_path, fmt, {**dict.fromkeys(texts, TOKEN_CONTROL), "<|end|>": TOKEN_CONTROL}, eos=texts[0])
    end = tok.backend.token_to_id("<|end|>")
    assert ids_of(tok, *texts) <= set(tok.eos_token_ids)
    assert (end in tok.eos_token_ids) is end_ends
    assert tok.decode([end], skip_special_tokens=True) == ("" if end_ends else "<|end|>")
    assert tok.encode("a<|end|>", add_special_tokens=False)[-1] == end


@pytest.mark.parametrize("tool_response", [True, False])
def test_gemma4_s_is_plain_text(tmp_path: Path, fmt, tool_response: bool) -> None:
    """Beside <|tool_response>, "</s>" is llama.cpp's normal token and no end; without it, an end-of-generation
    control token (PaddleOCR's)."""
    types = {"<eos>": TOKEN_CONTROL, "</s>": TOKEN_CONTROL, "<turn|>": TOKEN_NORMAL}
    tok, _ = vocab(
        tmp_path, fmt, {**types, **({"<|tool_response>": TOKEN_CONTROL} if tool_response else {})}, eos="<eos>"
    )
    s = tok.backend.token_to_id("</s>")
    assert ids_of(tok, "<eos>", "<turn|>") <= set(tok.eos_token_ids)
    assert (s in tok.eos_token_ids) is not tool_response
    assert (tok.encode("</s>", add_special_tokens=False) == [s]) is not tool_response


def test_fill_in_the_middle_padding_repository_and_file_separator_end_a_generation(tmp_path: Path, fmt) -> None:
    """Found by text (made control tokens; of two padding texts the first in the vocabulary), or named by key (then
    the padding text is no end and keeps its type); the prefix token is made a control token but ends nothing."""
    types = {
        "<|fim_prefix|>": TOKEN_NORMAL,
        "<|fim_pad|>": TOKEN_NORMAL,
        "<|repo_name|>": TOKEN_CONTROL,
        "<|file_sep|>": TOKEN_USER_DEFINED,
        "<PAD>": TOKEN_CONTROL,
    }
    tok, _ = vocab(tmp_path, fmt, types, eos="<|im_end|>")
    ends = ids_of(tok, "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
    assert ends <= set(tok.eos_token_ids) and not ids_of(tok, "<|fim_prefix|>", "<PAD>") & set(tok.eos_token_ids)
    assert tok.encode("<|fim_prefix|>", add_special_tokens=False) == [tok.backend.token_to_id("<|fim_prefix|>")]
    assert tok.decode(tok.encode("<|file_sep|>x", add_special_tokens=False), skip_special_tokens=True) == "x"
    tok, _ = vocab(tmp_path, fmt, types, eos="<|im_end|>", fim_pad="<PAD>")
    assert tok.backend.token_to_id("<PAD>") in tok.eos_token_ids
    assert tok.backend.token_to_id("<|fim_pad|>") not in tok.eos_token_ids
    assert len(tok.encode("<|fim_pad|>", add_special_tokens=False)) > 1


def test_phi3s_ends_of_generation_are_llama_cpps() -> None:
    """llama.cpp's Phi-3 vocabulary: eos <|endoftext|>, and by text <|end|> (control) and "</s>" (user-defined, made
    a control token: read as text where special tokens are not parsed)."""
    reader = gguf.GGUFReader(LLAMA_CPP / "ggml-vocab-phi-3.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.") or k == "general.name"}
    tok = Tokenizer.from_gguf_vocab(fields, architecture="llama")
    assert tok.eos_token_ids == end_of_generation(fields) == (32000, 2, 32007)
    assert 2 not in tok.encode_text("a</s>") and tok.encode("a</s>", add_special_tokens=False)[-1] == 2


def _model_gguf(tmp_path: Path, fmt, synth_source) -> tuple[Path, int]:
    """A tiny model GGUF whose eos is <|endoftext|> and whose <|im_end|> (id 2) is typed normal."""
    tk = fmt.train_bpe("gpt2")
    path = fmt.write_gguf(
        tmp_path / "m.gguf",
        synth_source("qwen2", vocab_size=tk.get_vocab_size()),
        tokenizer=tk,
        eos="<|endoftext|>",
        token_types={"<|im_end|>": TOKEN_NORMAL},
    )
    return path, tk.token_to_id("<|im_end|>")


def test_a_generation_stops_at_an_end_of_turn_found_by_text(tmp_path: Path, fmt, synth_source) -> None:
    path, end = _model_gguf(tmp_path, fmt, synth_source)
    assert end in GGUFCheckpoint(path).config.eos_token_ids
    with kestrel_core.load(str(path), backend="cpu") as engine:
        prompt = engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        outs = list(engine.stream(prompt, SamplingParams(max_tokens=6, logit_bias=((end, 100.0),))))
    assert [t for o in outs for t in o.new_token_ids] == [end] and outs[-1].finish_reason == "stop"


def test_a_cached_gguf_keeps_its_ends_of_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt, synth_source
) -> None:
    """The model cache's artifact (its config's eos ids, its tokenizer's control tokens) ends where the file does."""
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KESTREL_MODEL_CACHE", "1")
    path, end = _model_gguf(tmp_path, fmt, synth_source)
    for _ in range(2):  # written, then read back
        loaded = load_model(path, "q8")
        assert end in loaded.model.config.eos_token_ids and end in loaded.tokenizer.eos_token_ids
        assert loaded.tokenizer.encode("hi<|im_end|>", add_special_tokens=False)[-1] == end
    assert len(list((tmp_path / "home" / "cache").glob("*.kst"))) == 1
