"""A GGUF vocabulary's special tokens as llama.cpp reads them (llama_vocab::impl::load): the ids it takes where the
file names none, and the gpt-oss tokens it makes user-defined."""

from __future__ import annotations

from pathlib import Path

import pytest

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
