"""Several LoRA adapters stacked, as llama.cpp's repeated --lora: W + s1 * B1 @ A1 + s2 * B2 @ A2, each adapter its
own scale; from the API and from the command line, and cached in a slot keyed on every adapter and scale."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kestrel_core
from kestrel_core.cli import main
from kestrel_core.model.loader import finish_cache_writes, load_model

from .lora_adapters import gguf_adapter, hand_merged, peft_adapter, peft_pairs
from .parity import FIXTURES
from .test_lora import ADAPTER, LLAMA_GGUF_NAMES

BASE = FIXTURES / "tiny-llama"
IDS = list(range(5, 37))


@pytest.fixture
def second(tmp_path: Path) -> tuple[Path, dict]:  # type: ignore[type-arg]
    """A second adapter of tiny-llama, on q (which tiny-llama-lora adapts too), k and up, in llama.cpp's GGUF form
    (its B rows of Q and K permuted as the converter writes them); rank 4, alpha 8: s = 2."""
    pairs = peft_adapter(tmp_path / "peft", BASE, ["self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj"], seed=1)
    cfg = json.loads((BASE / "config.json").read_text())
    heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"])
    return gguf_adapter(tmp_path / "second.gguf", pairs, "llama", 8, LLAMA_GGUF_NAMES, heads), pairs


def test_two_adapters_stack_as_the_hand_merge_each_at_its_own_scale(tmp_path: Path, second) -> None:  # type: ignore[no-untyped-def]
    path, pairs = second
    cfg = json.loads((ADAPTER / "adapter_config.json").read_text())
    own = cfg["lora_alpha"] / cfg["r"]
    merged = hand_merged(tmp_path / "merged", BASE, [(peft_pairs(ADAPTER), own * 0.5), (pairs, 2.0 * -1.5)])
    with kestrel_core.load(str(merged), backend="cpu") as engine:
        want = engine.logits(IDS)
    with kestrel_core.load(str(BASE), backend="cpu", lora=[str(ADAPTER), path], lora_scale=[0.5, -1.5]) as engine:
        np.testing.assert_array_equal(engine.logits(IDS), want)
        assert engine.source.endswith(" + LoRA tiny-llama-lora + LoRA second.gguf")
    with kestrel_core.load(str(BASE), backend="cpu", lora=[str(ADAPTER), path], lora_scale=0.5) as engine:
        assert not np.array_equal(engine.logits(IDS), want)  # one scale is every adapter's


def test_a_repeated_lora_option_stacks_the_adapters(second, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    path = str(second[0])
    argv = ["run", "-m", str(BASE), "--no-chat", "--json", "-n", "6", "--backend", "cpu", "hello"]
    assert main([*argv, "--lora", str(ADAPTER), "--lora", path, "--lora-scale", "0.5", "--lora-scale", "2"]) == 0
    stacked = json.loads(capsys.readouterr().out)["tokens"]
    with kestrel_core.load(str(BASE), backend="cpu", lora=[str(ADAPTER), path], lora_scale=[0.5, 2.0]) as engine:
        assert stacked == list(engine.generate(engine.tokenizer.encode("hello"), max_tokens=6))
    assert main([*argv, "--lora", str(ADAPTER), "--lora", path, "--lora-scale", "1", "--lora-scale", "2",
                 "--lora-scale", "3"]) == 2
    assert ("2 LoRA adapters (--lora) and 3 scales (--lora-scale): give one scale for all of them, or one for each, "
            "in order") in capsys.readouterr().err


def test_a_stack_is_cached_under_every_adapter_and_scale(tmp_path: Path, second,  # type: ignore[no-untyped-def]
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stack is read back from its own entry as it was merged; one adapter's scale changed is another key."""
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KESTREL_MODEL_CACHE", "1")
    base, other = FIXTURES / "tiny-llama.gguf", str(second[0])
    from kestrel_core.model import loader

    quantize = loader._quantize
    stacks = [([str(ADAPTER), other], 1.0), ([str(ADAPTER), other], [1.0, 0.25]), ([other, str(ADAPTER)], 1.0),
              ([str(ADAPTER)], 1.0)]
    for lora, scale in stacks:
        monkeypatch.setattr(loader, "_quantize", quantize)
        want = dict(load_model(str(base), "q8", cache="off", lora=lora, lora_scale=scale).model.weights())
        merged = load_model(str(base), "q8", lora=lora, lora_scale=scale)
        finish_cache_writes()
        monkeypatch.setattr(loader, "_quantize", _refused)
        again = load_model(str(base), "q8", lora=lora, lora_scale=scale)
        for got in (merged, again):
            assert all(np.array_equal(w.codes, want[name].codes) for name, w in got.model.weights())
    # one slot a stack, the adapters in order (the scale changed replaced its slot's older entry)
    slots = sorted(p.name.split("+lora-")[1].split(".")[0] for p in (tmp_path / "home" / "cache").glob("*.kst"))
    assert slots == ["second_gguf_tiny-llama-lora", "tiny-llama-lora", "tiny-llama-lora_second_gguf"]


def _refused(*args: object) -> None:
    raise AssertionError("quantized again instead of read from the cache")
