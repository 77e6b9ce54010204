"""A GGUF vocabulary's special tokens as llama.cpp reads them (llama_vocab::impl::load): the ids it takes where the
file names none, the files it refuses for a bos or eos it is told to add and has not, the gpt-oss tokens it makes
user-defined, and the unused tokens it prints as nothing (llama_vocab::impl::token_to_piece)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from kestrel_core.errors import KestrelError
from kestrel_core.model.detokenize import TextStream
from kestrel_core.model.gguf_reader import GGUFCheckpoint
from kestrel_core.model.gguf_vocab import TOKEN_CONTROL, TOKEN_NORMAL, end_of_generation
from kestrel_core.model.grammar import Constraint, grammar_vocab
from kestrel_core.model.harmony import json_grammar, parse
from kestrel_core.model.tokenizer import Tokenizer

from .test_gguf_eog import vocab, write_vocab

# a SentencePiece vocabulary: "hi" is "▁hi" (7) after the prefix space; llama.cpp's defaults are unk 0, bos 1, eos 2
SPM_TOKENS = ["<unk>", "<s>", "<end>", "\u2581", "h", "i", "\u2581h", "\u2581hi"]
SPM_TYPES = [2, 3, 3, 1, 1, 1, 1, 1]
SPM_SCORES = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0]
# a byte-level one: "hi" is one token (2); token 11 is "," (llama.cpp's default bos and eos for these, not taken)
BPE_TOKENS = ["h", "i", "hi", "a", "b", "c", "d", "e", "f", "g", "j", ",", "k"]


@pytest.mark.parametrize("keys", [{}, {"bos_token_id": 99, "eos_token_id": 99}])
def test_a_sentencepiece_vocabulary_without_ids_takes_llama_cpps_defaults(tmp_path: Path, keys: dict) -> None:
    """No bos or eos id (or one outside the vocabulary): bos 1, added before each text as SentencePiece's
    add_bos defaults on, and eos 2, which ends a generation."""
    fields = write_vocab(tmp_path, "llama", SPM_TOKENS, SPM_TYPES, scores=SPM_SCORES, **keys)
    tok = Tokenizer.from_gguf_vocab(fields)
    assert tok.encode("hi") == [1, 7]
    assert (tok.bos_token, tok.eos_token) == ("<s>", "<end>")
    assert tuple(tok.eos_token_ids) == (2,) == end_of_generation(fields)


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt2"])
def test_a_byte_level_vocabulary_without_ids_has_no_default_bos_or_eos(tmp_path: Path, pre: str) -> None:
    """llama.cpp's 11 is a comma here: taken as the eos, it would end every answer at its first comma."""
    fields = write_vocab(tmp_path, "gpt2", BPE_TOKENS, [TOKEN_NORMAL] * len(BPE_TOKENS), pre=pre, merges=["h i"])
    tok = Tokenizer.from_gguf_vocab(fields)
    assert tok.encode("hi") == [2]
    assert tok.bos_token is None and tok.eos_token is None
    assert end_of_generation(fields) == ()


# (tokenizer.ggml.model, pre, token count, keys) -> whether llama.cpp refuses the file: a bos (eos) to add and none
# to add, neither named by tokenizer.ggml.bos_token_id (eos_token_id) among the tokens nor llama.cpp's default for
# the model (SentencePiece: bos 1, eos 2; byte-level: 11 for both, none for bos after glm4's pre-tokenizer)
ADDED_WITHOUT_ID = {
    "SentencePiece, bos added by default, default 1 present": ("llama", None, 8, {}, False),
    "SentencePiece, bos added by default, default 1 absent": ("llama", None, 1, {}, True),
    "SentencePiece, bos not added, default 1 absent": ("llama", None, 1, {"add_bos_token": False}, False),
    "SentencePiece, eos added, default 2 present": ("llama", None, 3, {"add_eos_token": True}, False),
    "SentencePiece, eos added, default 2 absent": ("llama", None, 2, {"add_eos_token": True}, True),
    "SentencePiece, eos added, its id outside, default 2 absent": (
        "llama", None, 2, {"add_eos_token": True, "eos_token_id": 7}, True),
    "byte-level, bos added, default 11 present": ("gpt2", "gpt2", 13, {"add_bos_token": True}, False),
    "byte-level, bos added, default 11 absent": ("gpt2", "gpt2", 11, {"add_bos_token": True}, True),
    "byte-level, bos added, its id present": ("gpt2", "gpt2", 11, {"add_bos_token": True, "bos_token_id": 3}, False),
    "byte-level, eos added, default 11 absent": ("gpt2", "gpt2", 11, {"add_eos_token": True}, True),
    "llama-bpe, bos added by default, default 11 absent": ("gpt2", "llama-bpe", 11, {}, True),
    "llama-bpe, bos not added, default 11 absent": ("gpt2", "llama-bpe", 11, {"add_bos_token": False}, False),
    "glm4, bos added, no default": ("gpt2", "glm4", 13, {"add_bos_token": True}, True),
    "glm4, bos added, its id present": ("gpt2", "glm4", 13, {"add_bos_token": True, "bos_token_id": 3}, False),
    "glm4, eos added, default 11 present": ("gpt2", "glm4", 13, {"add_eos_token": True}, False),
}


@pytest.mark.parametrize("case", ADDED_WITHOUT_ID)
def test_a_bos_or_eos_to_add_without_one_is_refused_as_llama_cpp_refuses_it(tmp_path: Path, case: str) -> None:
    """llama.cpp's check_add_special_token: "add_bos_token is true, but bos_token_id is not set" (eos likewise)."""
    model, pre, count, keys, refused = ADDED_WITHOUT_ID[case]
    if model == "llama":
        fields = write_vocab(tmp_path, model, SPM_TOKENS[:count], SPM_TYPES[:count], scores=SPM_SCORES[:count], **keys)
    else:
        fields = write_vocab(tmp_path, model, BPE_TOKENS[:count], [TOKEN_NORMAL] * count, pre=pre, merges=["h i"],
                             **keys)
    if not refused:
        Tokenizer.from_gguf_vocab(fields)
        return
    name = "eos" if keys.get("add_eos_token") else "bos"
    with pytest.raises(KestrelError) as exc:
        Tokenizer.from_gguf_vocab(fields, where="m.gguf")
    assert str(exc.value).startswith(f"m.gguf: tokenizer.ggml.add_{name}_token is true, but "
                                     f"tokenizer.ggml.{name}_token_id names none of its {count} tokens")
    assert "\n" not in str(exc.value)


def test_a_model_whose_bos_to_add_is_missing_does_not_load(tmp_path: Path, fmt, synth_source) -> None:
    import kestrel_core

    def no_bos(w) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("glm4")
        w.add_token_list(BPE_TOKENS)
        w.add_token_merges(["h i"])
        w.add_add_bos_token(True)

    path = fmt.write_gguf(tmp_path / "m.gguf", synth_source("qwen2", vocab_size=len(BPE_TOKENS)), metadata=no_bos)
    with pytest.raises(KestrelError, match="add_bos_token is true, but tokenizer.ggml.bos_token_id names none"):
        kestrel_core.load(str(path), backend="cpu")


UNUSED = int(gguf.TokenType.UNUSED)
# the types llama.cpp's token_to_piece prints nothing for in a byte-level vocabulary (UNDEFINED, UNUSED, BYTE and
# any past BYTE), and in a SentencePiece one (BYTE pieces are its byte fallback there); gguf-py names no UNDEFINED
UNDEFINED = 0
BYTE_LEVEL_SILENT = [UNDEFINED, UNUSED, int(gguf.TokenType.BYTE), 7]
SENTENCEPIECE_SILENT = [UNDEFINED, UNUSED, 7]


def _streamed(tok: Tokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    stream = TextStream(tok, skip_special_tokens=skip_special_tokens)
    return "".join(stream.push(i) for i in ids) + stream.flush()


@pytest.mark.parametrize("token_type", BYTE_LEVEL_SILENT)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_an_unused_token_prints_nothing_in_a_byte_level_vocabulary(tmp_path: Path, fmt, skip_special_tokens: bool,
                                                                   token_type: int) -> None:
    """llama.cpp's token_to_piece gives an unused token (a padded vocabulary's "[PAD151700]") no text, special tokens
    asked for or not, nor one of the other types it does not print; a normal token that holds its text keeps it."""
    tok, _ = vocab(tmp_path, fmt, {"[PAD9]": token_type, "x[PAD9]": TOKEN_NORMAL})
    pad, holder = tok.backend.token_to_id("[PAD9]"), tok.backend.token_to_id("x[PAD9]")
    hello, again = tok.encode("Hello world", add_special_tokens=False), tok.encode(" again", add_special_tokens=False)
    ids = [pad, *hello, pad, pad, *again, holder, pad]
    want = tok.decode([*hello, *again, holder])
    assert want == "Hello world againx[PAD9]"
    assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == want
    assert _streamed(tok, ids, skip_special_tokens) == want
    assert tok.token_text(pad) == ""
    # the decoder that empties it is one llguidance still reads as byte-level (from llguidance 1.7.5)
    assert grammar_vocab(tok.to_json_str(), tok.vocab_size, [0]).vocab_size == tok.vocab_size


@pytest.mark.parametrize("token_type", SENTENCEPIECE_SILENT)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_an_unused_token_prints_nothing_in_a_sentencepiece_vocabulary(tmp_path: Path, skip_special_tokens: bool,
                                                                      token_type: int) -> None:
    fields = write_vocab(tmp_path, "llama", [*SPM_TOKENS, "<unused0>"], [*SPM_TYPES, token_type],
                         scores=[*SPM_SCORES, 0.0])
    tok = Tokenizer.from_gguf_vocab(fields)
    ids = [7, 8, 7, 8]  # "▁hi", "<unused0>", "▁hi", "<unused0>"
    assert tok.decode([7, 7]) == "hi hi"
    assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == "hi hi"
    assert _streamed(tok, ids, skip_special_tokens) == " hi hi"  # generated text: its first space kept
    assert tok.token_text(8) == ""


def test_a_sentencepiece_model_without_a_bos_id_has_the_default_in_its_config(
    tmp_path: Path, fmt, synth_source
) -> None:
    def spm(w) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(SPM_TOKENS)
        w.add_token_types(SPM_TYPES)
        w.add_token_scores(SPM_SCORES)

    src = synth_source("qwen2", vocab_size=len(SPM_TOKENS))
    path = fmt.write_gguf(tmp_path / "m.gguf", src, metadata=spm)
    assert GGUFCheckpoint(path).config.bos_token_id == 1


HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>")
GPT_OSS = (*HARMONY, "<|end|>", "<|return|>", "<|call|>")  # its control tokens


def test_gpt_oss_channel_tokens_are_user_defined(tmp_path: Path, fmt) -> None:
    """llama.cpp makes <|start|>, <|channel|>, <|message|> and <|constrain|> user-defined whatever the file's type:
    matched whole where special tokens are not parsed, and kept in a text decoded without special tokens, so a
    harmony answer reads the same either way; <|return|> stays a control token."""
    tok, _ = vocab(tmp_path, fmt, dict.fromkeys(GPT_OSS, TOKEN_CONTROL), eos="<|return|>")
    start, channel, message, constrain = (tok.backend.token_to_id(t) for t in HARMONY)
    assert tok.encode_text("<|channel|>final<|message|>")[0] == channel
    assert tok.encode_text("<|start|><|constrain|>") == [start, constrain]
    answer = tok.encode("<|channel|>final<|message|>Paris.<|return|>", add_special_tokens=False)
    assert answer[0] == channel and message in answer
    assert tok.decode(answer, skip_special_tokens=True) == "<|channel|>final<|message|>Paris."
    assert parse(tok.decode(answer, skip_special_tokens=True)).content == "Paris."


def test_a_harmony_grammar_takes_the_user_defined_channel_tokens(tmp_path: Path, fmt) -> None:
    """llguidance names every added token, user-defined ones too: a JSON answer's grammar takes <|channel|> and
    <|message|> as the one token each, not their text spelled in pieces."""
    tok, _ = vocab(tmp_path, fmt, dict.fromkeys(GPT_OSS, TOKEN_CONTROL), eos="<|return|>")
    channel, message, end = (tok.backend.token_to_id(t) for t in ("<|channel|>", "<|message|>", "<|return|>"))
    constraint = Constraint(grammar_vocab(tok.to_json_str(), tok.vocab_size, [end]), json_grammar({"type": "object"}))
    assert not constraint.allowed()[tok.encode_text("<")[0]]
    for token in [
        channel,
        *tok.encode("final", add_special_tokens=False),
        message,
        *tok.encode("{}", add_special_tokens=False),
    ]:
        assert constraint.allowed()[token]
        constraint.accept(token)
    assert constraint.allowed()[end]
