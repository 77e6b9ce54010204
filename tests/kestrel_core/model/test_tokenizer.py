"""Tokenizer: GGUF-vocabulary builds agree with tokenizer.json, round trips, and sandboxed chat templates."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer as TokenizersLibrary

from kestrel_core.errors import KestrelError
from kestrel_core.model.gguf_reader import GGUFCheckpoint
from kestrel_core.model.gguf_vocab import PRE
from kestrel_core.model.tokenizer import LONG_DECODE_IDS, Tokenizer

from ..waits import HANG_GUARD_S, wait_until

GOLDEN = Path(__file__).parent / "data" / "smollm2_tokenizer_golden.json"
TEXTS = [
    "Hello, world!", "What is the capital of France?", "In 2024, 3.14159 rose 12.5% to $1,234.56",
    "  two leading, three trailing   ", "tabs\tand\nnewlines\r\n\n", "café naïve Straße Ελληνικά русский",
    "日本語のテキスト 한국어 🤖🚀✨ e\u0301 (combining)", "<|im_start|>user\nhi<|im_end|>\n", "She'll've we'd I'M",
    "unseen: zxqv ÿþ \u200b\u00a0 \x00", "",
]


def gguf_fields(fmt, tk, pre: str, **extra) -> dict:
    tokens, merges, types = fmt.bpe_vocab(tk)
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types,
              "tokenizer.ggml.bos_token_id": tokens.index("<|im_start|>"),
              "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>")}
    fields.update(extra)
    return fields


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "qwen2"])
def test_gguf_vocab_build_encodes_like_the_tokenizer_json(fmt, pre: str) -> None:
    reference = fmt.train_bpe(pre)  # what a model's tokenizer.json would say
    ours = Tokenizer.from_gguf_vocab(gguf_fields(fmt, reference, pre))
    for text in TEXTS + fmt.CORPUS:
        want = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == want, text
        assert ours.decode(want) == reference.decode(want, skip_special_tokens=False)
        assert ours.decode(ours.encode(text)) == (text if pre != "qwen2" else _nfc(text))
    # <|endoftext|> ends a generation too: llama.cpp finds it by its text
    assert ours.eos_token_ids == (2, 0) and ours.eos_token == "<|im_end|>" and ours.bos_token == "<|im_start|>"
    # special tokens stay whole; skip_special_tokens drops them
    ids = ours.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids, skip_special_tokens=True) == "hi"


def _nfc(text: str) -> str:
    import unicodedata

    return unicodedata.normalize("NFC", text)


@pytest.mark.parametrize("pre", ["smollm", "command-r"])
def test_digits_are_split_one_by_one_for_smollm(fmt, pre: str) -> None:
    """SmolLM2's and Cohere's vocabularies (llama.cpp's "smollm" and "command-r": digits alone, then GPT-2's
    regex)."""
    tk = Tokenizer.from_gguf_vocab(gguf_fields(fmt, fmt.train_bpe("smollm"), pre))
    ids = tk.encode("year 2024 and 31415")
    digits = [tk.token(i) for i in ids if any(ch.isdigit() for ch in tk.token(i))]
    assert digits == list("202431415")


def test_gguf_file_round_trip_and_json_round_trip(tmp_path: Path, fmt, synth_source) -> None:
    reference = fmt.train_bpe("gpt2")
    src = synth_source("llama", vocab_size=reference.get_vocab_size())
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    path = fmt.write_gguf(tmp_path / "m.gguf", src, tokenizer=reference, pre="gpt2", chat_template=template)
    ours = Tokenizer.from_gguf_vocab(GGUFCheckpoint(path).tokenizer_fields())
    again = Tokenizer.from_json_str(ours.to_json_str(), chat_template=ours.chat_template, eos_token_ids=[2])
    for text in TEXTS:
        want = reference.encode(text).ids
        assert ours.encode(text) == want == again.encode(text), text
    assert ours.chat_template == template
    msgs = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(msgs) == ours.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n"


def test_add_bos_token_from_gguf(fmt) -> None:
    tk = Tokenizer.from_gguf_vocab(gguf_fields(fmt, fmt.train_bpe("gpt2"), "gpt2",
                                               **{"tokenizer.ggml.add_bos_token": True}))
    assert tk.encode("hi")[0] == 1 and tk.encode("hi", add_special_tokens=False)[0] != 1


@pytest.mark.parametrize("model", ["tiny-qwen3-embed", "gguf-with-bos"])
def test_max_length_cuts_as_the_tokenizers_library_truncates(fmt, model: str) -> None:
    """A text over ``max_length`` keeps its first tokens and the special tokens the tokenizer adds (an appended
    <|endoftext|>, a BOS), as the library's own truncation gives them."""
    if model == "gguf-with-bos":
        ours = Tokenizer.from_gguf_vocab(gguf_fields(fmt, fmt.train_bpe("gpt2"), "gpt2",
                                                     **{"tokenizer.ggml.add_bos_token": True}))
    else:
        ours = Tokenizer.from_hf_dir(str(Path(__file__).resolve().parents[2] / "fixtures" / "models" / model))
    reference = TokenizersLibrary.from_str(ours.to_json_str())
    reference.enable_truncation(12)
    text = "The capital of France is Paris; the capital of Italy is Rome. " * 3
    assert len(ours.encode(text)) > 12
    for special in (True, False):
        want = reference.encode(text, add_special_tokens=special).ids
        assert ours.encode(text, special, max_length=12) == want and len(want) == 12
    assert ours.encode("Paris", max_length=12) == ours.encode("Paris")  # a short text as it is


@pytest.mark.parametrize(("pre", "bos"), [("llama-bpe", True), ("llama3", True), ("lfm2", True), ("gpt2", False),
                                          ("qwen35", False)])
def test_without_add_bos_token_the_bos_is_llama_cpps_default(fmt, pre: str, bos: bool) -> None:
    """llama.cpp adds the BOS for Llama 3's pre-tokenizers where the file does not say (early Llama 3 GGUFs)."""
    tk = Tokenizer.from_gguf_vocab(gguf_fields(fmt, fmt.train_bpe("gpt2"), pre))
    assert (tk.encode("hi")[0] == 1) == bos


@pytest.mark.parametrize("pre", sorted(PRE))
def test_every_pre_tokenizer_splits_and_round_trips(fmt, pre: str) -> None:
    """Each regex compiles in the tokenizers library and loses nothing (NFC aside)."""
    tk = Tokenizer.from_gguf_vocab(gguf_fields(fmt, fmt.train_bpe("gpt2"), pre))
    for text in TEXTS:
        assert tk.decode(tk.encode(text, add_special_tokens=False)) == (_nfc(text) if PRE[pre].nfc else text)


# a byte-level vocabulary whose merges cross the places llama.cpp's "default" pre-tokenizer splits and GPT-2's does not
CROSSING_MERGES = ["Ġ ,", "' t", "d o", "do n", "Ġ $", "Ġ 1", "1 2", "12 3", "4 5"]


@pytest.mark.parametrize(("text", "default", "gpt2"), [
    ("a ,b", ["a", "Ġ", ",", "b"], ["a", "Ġ,", "b"]),
    ("don't", ["don", "'", "t"], ["don", "'t"]),
    ("p: $5!", ["p", ":", "Ġ", "$", "5", "!"], ["p", ":", "Ġ$", "5", "!"]),
    ("a 12345", ["a", "Ġ", "123", "45"], ["a", "Ġ1", "2", "3", "45"])])
def test_the_default_pre_tokenizer_is_llama_cpps(text: str, default: list[str], gpt2: list[str]) -> None:
    """tokenizer.ggml.pre "default", or none, splits as llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT (runs of
    punctuation and $+<=>^~| first, then GPT-2's regex, numbers, ASCII digits in threes), "gpt-2" as GPT-2's regex:
    llama.cpp's llama_tokenize (llama-cpp-python 0.3.36) of a GGUF of this vocabulary."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in CROSSING_MERGES]
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.merges": CROSSING_MERGES}
    for pre, want in (("default", default), (None, default), ("gpt-2", gpt2)):
        tok = Tokenizer.from_gguf_vocab({**fields, "tokenizer.ggml.pre": pre} if pre else fields)
        ids = tok.encode(text, add_special_tokens=False)
        assert [tok.token(i) for i in ids] == want, pre
        assert tok.decode(ids) == text


def test_unsupported_vocabularies_are_named(fmt) -> None:
    fields = gguf_fields(fmt, fmt.train_bpe("gpt2"), "gpt2")
    with pytest.raises(KestrelError, match="tokenizer model 't5' is not supported"):
        Tokenizer.from_gguf_vocab({**fields, "tokenizer.ggml.model": "t5"})
    with pytest.raises(KestrelError, match="tokenizer.ggml.scores must be one number per token"):
        Tokenizer.from_gguf_vocab({**fields, "tokenizer.ggml.model": "llama"})
    with pytest.raises(KestrelError, match="pre-tokenizer 'mystery' is not supported"):
        Tokenizer.from_gguf_vocab({**fields, "tokenizer.ggml.pre": "mystery"})
    with pytest.raises(KestrelError, match="lacks tokens or merges"):
        Tokenizer.from_gguf_vocab({**fields, "tokenizer.ggml.merges": []})
    with pytest.raises(KestrelError, match="invalid tokenizer.json"):
        Tokenizer.from_json_str("{broken")


def write_tokenizer_dir(root: Path, fmt, config: dict | None = None, jinja: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text(fmt.train_bpe("gpt2").to_str())
    if config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (root / "chat_template.jinja").write_text(jinja)
    return root


def test_a_processors_chat_template_is_taken_where_the_tokenizer_has_none(tmp_path: Path, fmt) -> None:
    """A vision checkpoint may keep its template in its processor's chat_template.json (Aya Vision): taken where
    neither tokenizer_config.json nor chat_template.jinja holds one, never over theirs."""
    root = write_tokenizer_dir(tmp_path / "a", fmt, {})
    (root / "chat_template.json").write_text(json.dumps({"chat_template": "P{{ messages|length }}"}))
    assert Tokenizer.from_hf_dir(root).apply_chat_template([{"role": "user", "content": "x"}] * 2) == "P2"
    root = write_tokenizer_dir(tmp_path / "b", fmt, {"chat_template": "T"})
    (root / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    assert Tokenizer.from_hf_dir(root).chat_template == "T"
    root = write_tokenizer_dir(tmp_path / "c", fmt, {})
    (root / "chat_template.json").write_text(json.dumps({"chat_template": 7}))
    with pytest.raises(KestrelError, match="chat_template.json: expected an object whose chat_template is a string"):
        Tokenizer.from_hf_dir(root)


@pytest.mark.parametrize("config", [[1, 2], "a string", 7])
def test_a_tokenizer_config_that_is_not_an_object_is_named(tmp_path: Path, fmt, config) -> None:
    root = write_tokenizer_dir(tmp_path, fmt)
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(KestrelError, match="tokenizer_config.json: expected a JSON object"):
        Tokenizer.from_hf_dir(root)


def test_from_hf_dir_template_forms_and_special_tokens(tmp_path: Path, fmt) -> None:
    t1 = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    cfg = {"chat_template": t1, "bos_token": {"content": "<|im_start|>", "special": True},
           "eos_token": "<|endoftext|>"}
    tk = Tokenizer.from_hf_dir(write_tokenizer_dir(tmp_path / "a", fmt, cfg), bos_token_id=1, eos_token_ids=[2])
    assert tk.eos_token_ids == (2, 0)  # config's eos first, then tokenizer_config's eos token
    assert tk.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x<|endoftext|>"
    cfg = {"chat_template": [{"name": "tool_use", "template": "T{{ tools|length }}"}, {"name": "default",
                                                                                       "template": "D"}]}
    named = Tokenizer.from_hf_dir(write_tokenizer_dir(tmp_path / "b", fmt, cfg))
    assert (named.chat_template, named.tool_template) == ("D", "T{{ tools|length }}")
    hi = [{"role": "user", "content": "x"}]  # with tools the tool_use template renders, as transformers picks it
    assert named.apply_chat_template(hi) == named.apply_chat_template(hi, tools=[]) == "D"
    assert named.apply_chat_template(hi, tools=[{"type": "function"}]) == "T1"
    tk = Tokenizer.from_hf_dir(write_tokenizer_dir(tmp_path / "c", fmt, {}, jinja="J{{ messages|length }}"))
    assert tk.apply_chat_template([{"role": "user", "content": "x"}] * 3) == "J3"
    both = write_tokenizer_dir(tmp_path / "e", fmt, {"chat_template": "CONFIG"}, jinja="FILE")
    assert Tokenizer.from_hf_dir(both).chat_template == "FILE"  # the file wins, as in transformers
    with pytest.raises(KestrelError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    tk = Tokenizer.from_hf_dir(write_tokenizer_dir(tmp_path / "d", fmt))
    with pytest.raises(KestrelError, match="no chat template"):
        tk.apply_chat_template([{"role": "user", "content": "x"}])


def _tok(fmt, template: str) -> Tokenizer:
    return Tokenizer.from_gguf_vocab(gguf_fields(fmt, fmt.train_bpe("gpt2"), "gpt2",
                                                 **{"tokenizer.chat_template": template}))


def test_chat_template_helpers_and_generation_prompt(fmt) -> None:
    template = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                "{{ raise_exception('bad role ' + m.role) }}{% endif %}"
                "[{{ m.role }}]{{ m.content | tojson }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}{{ strftime_now('%Y')[:0] }}")
    tk = _tok(fmt, template)
    msgs = [{"role": "user", "content": "héllo \"q\""}, {"role": "assistant", "content": "ok"}]
    assert tk.apply_chat_template(msgs) == '[user]"héllo \\"q\\""\n[assistant]"ok"\n[assistant]'
    assert tk.apply_chat_template(msgs, add_generation_prompt=False) == '[user]"héllo \\"q\\""\n[assistant]"ok"\n'
    with pytest.raises(KestrelError) as exc:
        tk.apply_chat_template([{"role": "tool", "content": "x"}])
    assert str(exc.value) == "chat template failed: bad role tool"


COMMAND_R7B = Path(__file__).resolve().parents[2] / "fixtures" / "templates" / (
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja")


def test_thinking_off_closes_coheres_reasoning_block_as_llama_cpp_does(fmt) -> None:
    """Cohere's templates read no enable_thinking: with it false, a prompt that ends opening the answer's turn gets
    an empty reasoning block and one that ends opening the block gets it closed, as llama.cpp's command_r7b
    handler writes them; with it true or unset, and for a template of another reasoning block, the prompt is the
    template's."""
    hi = [{"role": "user", "content": "hi"}]
    r7b = _tok(fmt, COMMAND_R7B.read_text())
    prompt = r7b.apply_chat_template(hi)
    assert prompt.endswith("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    assert r7b.apply_chat_template(hi, enable_thinking=False) == prompt + "<|START_THINKING|><|END_THINKING|>"
    assert r7b.apply_chat_template(hi, enable_thinking=True) == prompt
    opened = _tok(fmt, "{{ messages[0].content }}<|END_THINKING|><|CHATBOT_TOKEN|><|START_THINKING|>")
    assert opened.apply_chat_template(hi, enable_thinking=False).endswith("<|START_THINKING|><|END_THINKING|>")
    answering = _tok(fmt, "{{ messages[0].content }}<|END_THINKING|><|CHATBOT_TOKEN|><|START_RESPONSE|>")
    assert answering.apply_chat_template(hi, enable_thinking=False).endswith("<|START_RESPONSE|>")
    qwen = _tok(fmt, "{{ messages[0].content }}</think><|CHATBOT_TOKEN|>")  # a template with its own switch
    assert qwen.apply_chat_template(hi, enable_thinking=False).endswith("</think><|CHATBOT_TOKEN|>")


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
    "{% set x = messages.append({'role': 'user', 'content': 'injected'}) %}{{ messages|length }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "{% for m in messages %}{{ m.update({'content': 'x'}) }}{% endfor %}",
])
def test_sandbox_escapes_fail_with_one_line(fmt, template: str) -> None:
    tk = _tok(fmt, template)
    with pytest.raises(KestrelError) as exc:
        tk.apply_chat_template([{"role": "user", "content": "hi"}])
    msg = str(exc.value)
    assert msg.startswith("chat template refused by the sandbox") and "\n" not in msg and "pwned" not in msg


def test_template_syntax_error_is_one_line(fmt) -> None:
    tk = _tok(fmt, "{% for m in messages %}{{ m.content }")
    with pytest.raises(KestrelError) as exc:
        tk.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(exc.value).startswith("invalid chat template:") and "\n" not in str(exc.value)


@pytest.mark.default_model
def test_default_model_tokenizer_matches_transformers() -> None:
    """kestrel's GGUF-built tokenizer against transformers' (data/smollm2_tokenizer_golden.json)."""
    from kestrel_core.model.pull import default_model_path

    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    tk = Tokenizer.from_gguf_vocab(GGUFCheckpoint(default_model_path()).tokenizer_fields())
    for entry in golden["texts"]:
        assert tk.encode(entry["text"], add_special_tokens=False) == entry["ids"], entry["text"]
        assert tk.decode(entry["ids"]) == entry["text"]
    for chat in golden["chats"]:
        assert tk.apply_chat_template(chat["messages"]) == chat["prompt"]
    # llama.cpp's ends of generation: <|im_end|>, <reponame> (its repository token) and <|endoftext|>
    assert tk.eos_token_ids == (2, 4, 0) and tk.vocab_size == 49152
    # SmolLM2 splits every digit (llama.cpp's "smollm" pre-tokenizer; transformers does not know it)
    ids = tk.encode("In 2024, 3.14159")
    assert [tk.token(i) for i in ids if tk.token(i).strip("Ġ").isdigit()] == list("2024314159")


SPM_GOLDEN = Path(__file__).parent / "data" / "spm_tokenizer_golden.json"
SPM_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tokenizers"


LLAMA_CPP = SPM_FIXTURES / "llama.cpp"
# llama.cpp's llama_tokenize(special=True) (llama-cpp-python 0.3.36) of chat prompts: the prefix space after
# every special token, Phi-3's special tokens taking the newline after them
LLAMA_CPP_CHATS = {
    "llama-spm": [("<s>[INST] hi [/INST]", [1, 518, 25580, 29962, 7251, 518, 29914, 25580, 29962])],
    "phi-3": [("<s><|user|>\nHello<|end|>\n<|assistant|>\n", [1, 32010, 15043, 32007, 32001])],
}


def _llama_cpp_vocab(name: str) -> Tokenizer:
    """The tokenizer of llama.cpp's vocabulary-only GGUF ``ggml-vocab-<name>.gguf``."""
    from gguf import GGUFReader

    from kestrel_core.model.gguf_reader import GGUFCheckpoint  # noqa: F401 (the GGUF reader's field decoding)

    reader = GGUFReader(LLAMA_CPP / f"ggml-vocab-{name}.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.") or k == "general.name"}
    return Tokenizer.from_gguf_vocab(fields, architecture=reader.fields["general.architecture"].contents())


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_llama_and_phi3_gguf_vocabularies_tokenize_as_their_models_tokenizers(name: str) -> None:
    """Llama 2's (and Mistral's) and Phi-3's SentencePiece vocabularies as llama.cpp ships them: every test text of
    llama.cpp's (leading spaces, runs of spaces, unicode) gives the ids the model's own Hugging Face tokenizer gives
    (its .out file), and chat prompts llama.cpp's ids."""
    path = LLAMA_CPP / f"ggml-vocab-{name}.gguf"
    tok = _llama_cpp_vocab(name)
    texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = [[int(i) for i in line.split()] for line in path.with_name(path.name + ".out").read_text().splitlines()]
    assert len(ids) > 40
    for text, want in zip(texts, ids):
        assert tok.encode(text, add_special_tokens=False) == want, text
    for text, want in LLAMA_CPP_CHATS[name]:
        assert tok.encode(text, add_special_tokens=False) == want, text


def test_unknown_type_tokens_are_special_tokens_as_in_llama_cpp() -> None:
    """<unk> (token type UNKNOWN) is one of llama.cpp's special tokens, as CONTROL ones are: matched whole where
    special tokens are parsed (llama_tokenize(special=True), llama-cpp-python 0.3.36), read as text where they are
    not (special=False), and left out of a text decoded without special tokens."""
    tok = _llama_cpp_vocab("llama-spm")
    assert tok.encode("a<unk>b", add_special_tokens=False) == [263, 0, 289]
    assert tok.encode_text("a<unk>b") == [263, 29966, 2960, 29958, 29890]
    assert tok.decode([263, 0, 289], skip_special_tokens=True) == "a b"
    assert tok.decode([263, 0, 289]) == "a<unk> b"


@pytest.mark.parametrize(("text", "want"), [
    ("</s>\nHello", [2, 15043]), ("</s> Hello", [2, 15043]), ("a </s>  \n b", [263, 29871, 2, 289]),
    ("<|end|>\nHello", [32007, 15043]), ("[PAD32011]  x", [32011, 921]),
    ("<unk> x", [0, 29871, 921]), ("<s> x", [1, 29871, 921]), ("<|endoftext|> x", [32000, 29871, 921])])
def test_phi3_tokens_matched_whole_take_the_whitespace_after_them(text: str, want: list[int]) -> None:
    """Phi-3's "</s>" (a user-defined token), its control tokens and its unknown-type [PAD...] ones take the
    whitespace after them, <unk>, <s> and <|endoftext|> do not: llama.cpp's llama_tokenize(special=True) ids
    (llama-cpp-python 0.3.36)."""
    assert _llama_cpp_vocab("phi-3").encode(text, add_special_tokens=False) == want


@pytest.mark.parametrize("arch", ["phi3", "gemma3"])
def test_sentencepiece_gguf_vocabularies_tokenize_as_transformers_does(arch: str) -> None:
    """A SentencePiece BPE vocabulary (llama.cpp's "llama" model: pieces and scores, no merges), as Phi-3 and Gemma
    files hold it: kestrel's tokens are transformers' own, text by text, and decode back as transformers decodes
    them (golden data: make_tokenizer_golden.py --sentencepiece). Llama's is checked against llama.cpp's vectors
    above: transformers' GGUF reader folds its prefix space into a leading one, where the model's tokenizer and
    llama.cpp do not."""
    from gguf import GGUFReader

    from kestrel_core.model.gguf_reader import GGUFCheckpoint  # noqa: F401 (the GGUF reader's field decoding)

    reader = GGUFReader(SPM_FIXTURES / f"spm-{arch}.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tok = Tokenizer.from_gguf_vocab(fields, architecture=arch)
    golden = json.loads(SPM_GOLDEN.read_text(encoding="utf-8"))[arch]
    for case in golden:
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["decoded"], case["text"]
    assert tok.encode("hi")[0] == 1  # the BOS llama.cpp adds to a SentencePiece vocabulary by default


def test_the_sentencepiece_variants_differ_where_their_models_do() -> None:
    """Llama's and Phi-3's add a prefix space (a leading space kept as a piece of its own), Gemma's none; so a test
    that fed every file to one builder would fail."""
    from gguf import GGUFReader

    ids = {}
    for arch in ("llama", "phi3", "gemma3"):
        reader = GGUFReader(SPM_FIXTURES / f"spm-{arch}.gguf")
        fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
        tok = Tokenizer.from_gguf_vocab(fields, architecture=arch)
        ids[arch] = tuple(tuple(tok.encode(t, add_special_tokens=False)) for t in ("  leading", "leading"))
    assert ids["phi3"] == ids["llama"] and ids["gemma3"][1] != ids["llama"][1], ids


def _ticks_during(work: Any) -> tuple[Any, int]:
    """``work()``'s result, and how many times a thread beside it ran while ``work`` was under way. The
    interpreter's switch interval is set longer than the test, so a thread that holds the interpreter lock keeps
    it until it lets go of it itself: the count is 0 unless ``work`` lets go of the lock."""
    ticks = [0]
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.0001)  # lets go of the lock, and wants it back at once

    interval = sys.getswitchinterval()
    ticker = threading.Thread(target=tick, daemon=True)
    sys.setswitchinterval(HANG_GUARD_S)
    try:
        ticker.start()
        wait_until(lambda: ticks[0] > 0, "the ticking thread's first tick")
        before = ticks[0]
        result = work()
        during = ticks[0] - before
    finally:
        stop.set()
        ticker.join(HANG_GUARD_S)
        sys.setswitchinterval(interval)
    return result, during


def test_encoding_lets_other_threads_run() -> None:
    """A server tokenizes a long prompt in a worker thread while its event loop answers other requests: the
    tokenizer must let go of the interpreter lock meanwhile (a thread beside it runs during the encoding;
    holding it would stop that thread for the whole encoding)."""
    tok = Tokenizer.from_hf_dir(str(Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen3"))
    text = "hello world " * 200_000
    ids, ticks = _ticks_during(lambda: tok.encode(text))
    assert ids == tok.backend.encode(text).ids  # the same ids as the library's one-text call gives
    assert ticks > 0


def test_decoding_lets_other_threads_run() -> None:
    """``/detokenize`` decodes a client's ids in a worker thread: as encoding, a long decoding lets go of the
    interpreter lock, and reads as the library's one-sequence call does; a short one too."""
    tok = Tokenizer.from_hf_dir(str(Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen3"))
    ids = tok.encode("hello world, ça va? " * 200_000, add_special_tokens=False)
    text, ticks = _ticks_during(lambda: tok.decode(ids))
    assert text == tok.backend.decode(ids)
    assert ticks > 0
    for some in (ids[:LONG_DECODE_IDS - 1], ids[:LONG_DECODE_IDS], ids[1:LONG_DECODE_IDS + 1]):
        assert tok.decode(some) == tok.backend.decode(some)
        assert tok.decode(some, skip_special_tokens=True) == tok.backend.decode(some, skip_special_tokens=True)


def test_a_tokenizer_that_panics_on_a_text_is_a_one_line_error(tmp_path: Path) -> None:
    """An untrusted tokenizer.json whose split regex gives up on a text (the Rust library panics) fails the text
    with a KestrelError, not an exception outside Exception that would escape the CLI's and server's handlers."""
    src = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-llama"
    spec = json.loads((src / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated", "invert": False},
        spec["pre_tokenizer"]]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    assert tok.encode("ab")
    with pytest.raises(KestrelError, match="tokenizer failed to encode the text: .*retry-limit"):
        tok.encode("a" * 28 + "!")


def test_sentencepiece_merges_are_every_split_into_two_pieces() -> None:
    """The merges a SentencePiece vocabulary implies, against their definition (every split of a piece into two
    pieces of the vocabulary, best score first), on pieces of every length up to one far longer than the rest:
    the splits tried are those whose parts are no longer than the longest shorter piece."""
    from kestrel_core.model.gguf_vocab import sentencepiece_merges

    rng = np.random.default_rng(0)
    tokens = list(dict.fromkeys(["a", "b", "c"] + ["".join(rng.choice(list("abc"), n)) for n in
                                                    rng.integers(2, 9, 300)] + ["ab" * 40, "abc" * 4000]))
    scores = [float(s) for s in rng.normal(size=len(tokens))]
    ids = {t: i for i, t in enumerate(tokens)}
    want = sorted(((s, p[:i], p[i:]) for p, s in zip(tokens, scores) for i in range(1, len(p))
                   if p[:i] in ids and p[i:] in ids), key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    assert sentencepiece_merges(tokens, scores) == [(left, right) for _, left, right in want]


def test_a_gguf_tool_use_template_renders_requests_with_tools(fmt) -> None:
    tk = Tokenizer.from_gguf_vocab(gguf_fields(fmt, fmt.train_bpe("gpt2"), "gpt2", **{
        "tokenizer.chat_template": "D", "tokenizer.chat_template.tool_use": "T{{ tools|length }}"}))
    hi = [{"role": "user", "content": "x"}]
    assert (tk.apply_chat_template(hi), tk.apply_chat_template(hi, tools=[{"type": "function"}] * 2)) == ("D", "T2")
    with pytest.raises(KestrelError, match="tool_use must be text"):
        Tokenizer.from_gguf_vocab(gguf_fields(fmt, fmt.train_bpe("gpt2"), "gpt2",
                                              **{"tokenizer.chat_template.tool_use": 7}))


def test_what_is_no_text_no_token_ids_or_no_messages_is_a_one_line_error() -> None:
    """The tokenizers library refuses bytes, None, a str with a lone surrogate (no Unicode text), a negative or
    non-integer id with a TypeError or an OverflowError that names no argument, and a chat template fails on a
    message that is no object with an AttributeError; each is a KestrelError saying what is wrong, and what they
    take still works (numpy ids, an id past the vocabulary decoding to nothing)."""
    tok = Tokenizer.from_hf_dir(str(Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen3"))
    for text, says in ((b"abc", "must be a str, got bytes"), (None, "must be a str, got NoneType"),
                       ("a\ud800b", r"not valid UTF-8 \(character 1\)")):
        for encode in (tok.encode, tok.encode_text, lambda t: tok.encode(t, max_length=4)):
            with pytest.raises(KestrelError, match=says):
                encode(text)
    with pytest.raises(KestrelError, match="not valid UTF-8"):
        tok.encode_chat([{"role": "user", "content": "a\ud800b"}])
    for bad in ("3", -1, 2.5):
        with pytest.raises(KestrelError, match="max_length must be an integer"):
            tok.encode("hello world", max_length=bad)
    for ids, says in (([-1], "token id -1 is negative"), ("abc", "got str"), ([1.5], "got list"),
                      (None, "got NoneType"), ((i for i in [1]), "got generator")):
        with pytest.raises(KestrelError, match=says):
            tok.decode(ids)
    for one in (lambda: tok.token(-1), lambda: tok.token_text(-1), lambda: tok.token("a")):
        with pytest.raises(KestrelError, match="is negative|must be an integer, got str"):
            one()
    for messages, says in (("hi", "got str"), ([None], "message 0 is a NoneType"),
                           ([{"role": "user", "content": "hi"}, "hi"], "message 1 is a str")):
        for render in (tok.apply_chat_template, tok.encode_chat):
            with pytest.raises(KestrelError, match=f'messages must be a list of {{"role": ..., "content": ...}} '
                                                   f'objects.*{says}'):
                render(messages)
    ids = tok.encode("hello world")
    assert tok.decode(np.array(ids)) == tok.decode(ids) == tok.backend.decode(ids)
    assert tok.token(ids[0]) == tok.backend.id_to_token(ids[0]) and tok.token(10 ** 9) is None
    assert tok.decode([10 ** 9]) == ""
