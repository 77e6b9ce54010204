"""TextStream's stop strings: the text ends before the first one, and says which one it was."""

from __future__ import annotations

from kestrel_core.model.detokenize import TextStream


class Letters:
    """Token i is the letter chr(ord('a') + i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_min_tokens_keeps_stop_strings_within_the_text_of_its_tokens() -> None:
    """vLLM's rule: a stop string counts where it ends past the first min_tokens tokens' text."""
    stream = TextStream(Letters(), stop=("b", "de"), min_tokens=3)  # "b" (2nd token) is too early; "de" is not
    text = "".join(stream.push(t) for t in range(6))  # abcdef
    assert (text + stream.flush(), stream.stopped_by) == ("abc", "de")
    at_the_boundary = TextStream(Letters(), stop=("c",), min_tokens=3)  # the 3rd token's own text: no stop
    assert "".join(at_the_boundary.push(t) for t in range(5)) + at_the_boundary.flush() == "abcde"
    straddling = TextStream(Letters(), stop=("bcd",), min_tokens=3)  # it ends in the 4th token's: a stop
    assert "".join(straddling.push(t) for t in range(5)) + straddling.flush() == "a"
    first = TextStream(Letters(), stop=("a",), min_tokens=1)  # min_tokens 1: never an empty answer
    assert "".join(first.push(t) for t in (0, 1, 0)) + first.flush() == "ab"


def test_the_first_stop_string_in_the_text_ends_it_and_is_named() -> None:
    stream = TextStream(Letters(), stop=("cd", "bc", "zz"))
    text = "".join(stream.push(t) for t in range(6))  # abcdef: "bc" comes before "cd"
    assert (text + stream.flush(), stream.stopped, stream.stopped_by) == ("a", True, "bc")
    plain = TextStream(Letters(), stop=("zz",))
    assert "".join(plain.push(t) for t in range(3)) + plain.flush() == "abc" and plain.stopped_by is None


def test_special_tokens_keep_their_text_only_when_asked() -> None:
    """Harmony's channel markers are special tokens: skip_special_tokens False keeps their text in the stream."""
    from pathlib import Path

    from kestrel_core.model.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen3")
    ids = tok.encode("<|im_start|>assistant hello", add_special_tokens=False)
    for skip, want in ((True, "assistant hello"), (False, "<|im_start|>assistant hello")):
        stream = TextStream(tok, skip_special_tokens=skip)
        assert "".join(stream.push(t) for t in ids) + stream.flush() == want


def test_a_sentencepiece_answer_keeps_the_space_of_its_first_token() -> None:
    """Llama 2's decoder strips the first space of what it decodes: "▁Paris" alone is "Paris". After the
    tokenizer's left context the answer and its tokens' strings keep it, as llama.cpp's pieces and the prompt +
    answer text have it."""
    from pathlib import Path

    from gguf import GGUFReader

    from kestrel_core.model.gguf_reader import GGUFCheckpoint  # noqa: F401 (the GGUF reader's field decoding)
    from kestrel_core.model.tokenizer import Tokenizer

    path = Path(__file__).resolve().parents[2] / "fixtures" / "tokenizers" / "llama.cpp" / "ggml-vocab-llama-spm.gguf"
    reader = GGUFReader(path)
    tok = Tokenizer.from_gguf_vocab({k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")},
                                    architecture="llama")
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    answer = tok.encode("The capital of France is Paris, a city.", add_special_tokens=False)[len(prompt):]
    stream = TextStream(tok)
    text = "".join(stream.push(t) for t in answer) + stream.flush()
    assert text == " Paris, a city." == tok.decode(prompt + answer)[len(tok.decode(prompt)):]
    assert tok.token_text(answer[0]) == " Paris" and tok.decode([answer[0]]) == "Paris"
