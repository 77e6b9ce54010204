"""LoRA adapters merged at load: transformers + PEFT's logits on tiny-llama, from its HF directory and its GGUF
twin; the merge's cache slot; adapters kestrel cannot merge, refused by name."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kestrel_core
from kestrel_core.cli import main
from kestrel_core.errors import KestrelError
from kestrel_core.model.loader import load_model

from .lora_adapters import gguf_adapter, peft_pairs
from .parity import FIXTURES, TINY, Golden

ADAPTER = FIXTURES / "tiny-llama-lora"


@pytest.mark.parametrize("base", ["tiny-llama", "tiny-llama.gguf"])
@pytest.mark.parametrize("quant", ["q8", "q8-g256"])
def test_a_merged_adapter_gives_peft_logits(base: str, quant: str) -> None:
    """Measured at q8: top-1 0.95, max 0.019, median 0.0085 of the range, both bases; the base alone, 0.175 / 0.81 /
    0.31. (q4: 0.775 / 0.13 / 0.071, the merged weights being off the Q4_0 grid the tiny models are built on.)"""
    golden = Golden(ADAPTER / "golden.npz")
    with kestrel_core.load(str(FIXTURES / base), backend="cpu", quant=quant, lora=str(ADAPTER)) as engine:
        assert golden.figures(engine.logits(golden.ids)).within(TINY)
        assert engine.source.endswith("+ LoRA tiny-llama-lora")
    with kestrel_core.load(str(FIXTURES / base), backend="cpu", quant=quant) as engine:
        assert not golden.figures(engine.logits(golden.ids)).within(TINY)


def test_a_scale_of_zero_is_the_base_model_bit_for_bit() -> None:
    ids = Golden(ADAPTER / "golden.npz").ids
    with kestrel_core.load(str(FIXTURES / "tiny-llama"), backend="cpu", lora=str(ADAPTER), lora_scale=0.0) as e:
        merged = e.logits(ids)
    with kestrel_core.load(str(FIXTURES / "tiny-llama"), backend="cpu") as engine:
        np.testing.assert_array_equal(merged, engine.logits(ids))


def test_the_merge_has_a_cache_slot_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KESTREL_MODEL_CACHE", "1")
    base = FIXTURES / "tiny-llama.gguf"
    plain = load_model(str(base), "q8")
    merged = load_model(str(base), "q8", lora=str(ADAPTER))
    from kestrel_core.model.loader import finish_cache_writes

    finish_cache_writes()
    entries = sorted(p.name for p in (tmp_path / "home" / "cache").glob("*.kst"))
    assert len(entries) == 2 and sum("+lora-tiny-llama-lora" in e for e in entries) == 1, entries
    def no_quantizing(*args: object) -> None:
        raise AssertionError("quantized again instead of read from the cache")

    monkeypatch.setattr("kestrel_core.model.loader._quantize", no_quantizing)
    again = load_model(str(base), "q8", lora=str(ADAPTER))
    for name, w in again.model.weights():
        assert np.array_equal(w.codes, dict(merged.model.weights())[name].codes)
    assert not np.array_equal(plain.model.layers[0].q.codes, merged.model.layers[0].q.codes)


def _adapter(tmp_path: Path, config: dict | None = None, tensors=None) -> Path:  # type: ignore[no-untyped-def]
    d = tmp_path / "adapter"
    shutil.copytree(ADAPTER, d)
    if config is not None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors is not None:
        save_file(tensors(load_file(str(d / "adapter_model.safetensors"))), str(d / "adapter_model.safetensors"))
    return d


def _renamed(t: dict, old: str, new: str) -> dict:
    return {k.replace(old, new): v for k, v in t.items()}


@pytest.mark.parametrize(("make", "says"), [
    (lambda p: p / "nowhere", "no such directory or file"),
    (lambda p: _adapter(p, {"use_dora": True}), "use_dora (DoRA) is not supported"),
    (lambda p: _adapter(p, {"bias": "all"}), "bias 'all' (trained biases) is not supported"),
    (lambda p: _adapter(p, {"r": 0}), "r must be an integer >= 1"),
    (lambda p: _adapter(p, tensors=lambda t: _renamed(t, "layers.1.", "layers.7.")), "has no layers.7."),
    (lambda p: _adapter(p, tensors=lambda t: _renamed(t, "self_attn.q_proj", "self_attn.qkv_proj")),
     "qkv_proj's lora_B has 64 rows, not the 128 of the model's layers.0.q, layers.0.k, layers.0.v"),
    (lambda p: _adapter(p, tensors=lambda t: _renamed(t, "self_attn.v_proj", "mlp.experts.0.up_proj")),
     "mlp.experts.0.up_proj is not a projection kestrel merges into"),
    (lambda p: _adapter(p, tensors=lambda t: {k: v for k, v in t.items() if "lora_B" not in k or "v_proj" not in k}),
     "has lora_A without its pair"),
    (lambda p: _adapter(p, tensors=lambda t: {k: (v[:, :-32] if "lora_A" in k and "q_proj" in k else v)
                                              for k, v in t.items()}), "another base model's adapter"),
    # PEFT rewrites the base as it loads these, or applies them to some positions only: never merged as plain LoRA
    (lambda p: _adapter(p, {"init_lora_weights": "pissa_niter_4"}), "init_lora_weights 'pissa_niter_4'"),
    (lambda p: _adapter(p, {"init_lora_weights": "olora"}), "init_lora_weights 'olora'"),
    (lambda p: _adapter(p, {"alora_invocation_tokens": [5, 6]}), "alora_invocation_tokens (aLoRA"),
    (lambda p: _adapter(p, {"layer_replication": [[0, 1], [0, 1]]}), "layer_replication (layers repeated)"),
    (lambda p: _adapter(p, {"layers_to_transform": 0}), "layers_to_transform (a subset of layers by index)"),
    (lambda p: _adapter(p, {"layers_to_transform": [0]}), "layers_to_transform (a subset of layers by index)"),
    (lambda p: _adapter(p, {"r": 64}), "lora_A has rank"),  # the tensors' rank is not the config's
    (lambda p: _adapter(p) / "adapter_model.safetensors", "a PEFT adapter is its directory"),
])
def test_an_adapter_kestrel_cannot_merge_is_one_line(tmp_path: Path, make, says: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KestrelError, match=re.escape(says)) as info:
        load_model(str(FIXTURES / "tiny-llama"), "q8", cache="off", lora=str(make(tmp_path)))
    assert "\n" not in str(info.value)


def test_an_artifact_or_a_preset_takes_no_adapter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kestrel_core.model.loader import write_artifact

    kst = write_artifact(load_model(str(FIXTURES / "tiny-llama"), "q8", cache="off"), tmp_path / "m.kst")
    with pytest.raises(KestrelError, match="an artifact's are quantized already"):
        load_model(str(kst), lora=str(ADAPTER))
    assert main(["run", "hi", "--preset", "smollm2-135m", "--lora", str(ADAPTER)]) == 2
    assert "a preset has none" in capsys.readouterr().err


def test_the_default_model_with_an_adapter_is_named_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's default name shows the adapter, as it does for a local path, not the base's name alone."""
    from kestrel_core.model import loader
    from kestrel_core.serve.server import default_model_name

    monkeypatch.setenv("KESTREL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loader, "pull_default_model", lambda progress=True: FIXTURES / "tiny-llama.gguf")
    loaded = load_model(None, lora=str(ADAPTER))
    assert default_model_name(loaded.source) == "SmolLM2-135M-Instruct-+-LoRA-tiny-llama-lora"
    assert default_model_name(load_model(None).source) == "SmolLM2-135M-Instruct"


def test_run_with_an_adapter_answers_as_the_merged_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "-m", str(FIXTURES / "tiny-llama"), "--no-chat", "--json", "-n", "4", "--backend", "cpu", "hello"]
    assert main([*argv, "--lora", str(ADAPTER)]) == 0
    merged = json.loads(capsys.readouterr().out)["tokens"]
    with kestrel_core.load(str(FIXTURES / "tiny-llama"), backend="cpu", lora=str(ADAPTER)) as engine:
        assert merged == list(engine.generate(engine.tokenizer.encode("hello"), max_tokens=4))


LLAMA_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}


def _gguf_adapter(tmp_path: Path, permute: bool = True, alora: bool = False) -> Path:
    """tiny-llama-lora as llama.cpp's convert_lora_to_gguf.py writes it: general.type adapter, adapter.lora.alpha,
    blk.N.<tensor>.weight.lora_a / lora_b, B's Q and K rows permuted as llama's weights are."""
    cfg = json.loads((ADAPTER / "adapter_config.json").read_text())
    base = json.loads((FIXTURES / "tiny-llama" / "config.json").read_text())
    heads = (base["num_attention_heads"], base["num_key_value_heads"]) if permute else None
    return gguf_adapter(tmp_path / "adapter.gguf", peft_pairs(ADAPTER), "llama", cfg["lora_alpha"], LLAMA_GGUF_NAMES,
                        heads, alora_tokens=[5, 6] if alora else None)


@pytest.mark.parametrize("base", ["tiny-llama", "tiny-llama.gguf"])
def test_llama_cpps_gguf_adapter_merges_as_the_peft_one(tmp_path: Path, base: str) -> None:
    """The same adapter in llama.cpp's GGUF form gives the PEFT directory's logits bit for bit; read without
    undoing the converter's Q/K permutation of B, it would not."""
    ids = Golden(ADAPTER / "golden.npz").ids
    with kestrel_core.load(str(FIXTURES / base), backend="cpu", lora=str(ADAPTER)) as engine:
        want = engine.logits(ids)
    with kestrel_core.load(str(FIXTURES / base), backend="cpu", lora=str(_gguf_adapter(tmp_path))) as engine:
        np.testing.assert_array_equal(engine.logits(ids), want)
    (tmp_path / "plain").mkdir()
    unpermuted = _gguf_adapter(tmp_path / "plain", permute=False)
    with kestrel_core.load(str(FIXTURES / base), backend="cpu", lora=str(unpermuted)) as engine:
        assert not np.allclose(engine.logits(ids), want, atol=1e-3)


def test_a_gguf_alora_adapter_is_refused(tmp_path: Path) -> None:
    """llama.cpp applies it from its invocation tokens on: merged into every position, it would be wrong."""
    with pytest.raises(KestrelError, match="aLoRA adapter"):
        load_model(str(FIXTURES / "tiny-llama"), "q8", cache="off", lora=str(_gguf_adapter(tmp_path, alora=True)))


def test_a_gguf_that_is_not_a_lora_adapter_is_refused() -> None:
    with pytest.raises(KestrelError, match="not a LoRA adapter"):
        load_model(str(FIXTURES / "tiny-llama"), "q8", cache="off", lora=str(FIXTURES / "tiny-llama.gguf"))


@pytest.mark.parametrize("base", ["tiny-glm4-moe-lite", "tiny-glm4-moe-lite.gguf"])
def test_an_adapter_of_a_latent_attention_gives_peft_logits(base: str) -> None:
    """An adapter on GLM-4.7-Flash's q_a, q_b, kv_a, kv_b and o (kv_b, which the host absorbs, merged like the
    others): transformers + PEFT's logits within the mixture-of-experts limits (measured at q8, both bases: top-1
    0.975, max 0.077, median 0.0086 of the range); the base alone leaves them (0.075 / 0.58 / 0.39)."""
    from .parity import MOE

    adapter = FIXTURES / "tiny-glm4-moe-lite-lora"
    golden = Golden(adapter / "golden.npz")
    with kestrel_core.load(str(FIXTURES / base), backend="cpu", quant="q8", lora=str(adapter)) as engine:
        assert golden.figures(engine.logits(golden.ids)).within(MOE)
    with kestrel_core.load(str(FIXTURES / base), backend="cpu", quant="q8") as engine:
        assert not golden.figures(engine.logits(golden.ids)).within(MOE)


def test_a_lora_scale_without_an_adapter_is_refused(capsys) -> None:  # type: ignore[no-untyped-def]
    from kestrel_core.cli import main

    assert main(["run", "--lora-scale", "3", "-n", "1", "hi"]) == 2
    assert "--lora-scale scales a --lora adapter, and none is given" in capsys.readouterr().err


def test_an_adapter_without_lora_alpha_scales_as_peft_and_a_bf16_one_loads(tmp_path: Path) -> None:
    """LoraConfig's lora_alpha defaults to 8 (not r); BF16 adapters, common on the Hub, are widened exactly."""
    plain = json.loads((ADAPTER / "adapter_config.json").read_text())
    r = plain["r"]
    t = load_file(str(ADAPTER / "adapter_model.safetensors"))
    bits = {k: (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16) for k, v in t.items()}  # exact in bf16
    widened = {k: (b.astype(np.uint32) << 16).view(np.float32) for k, b in bits.items()}
    d = _adapter(tmp_path, tensors=lambda _: widened)
    cfg = json.loads((d / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    from kestrel_core.model.lora import read_adapter

    assert read_adapter(d).scale == pytest.approx(8 / r)
    bf16 = tmp_path / "bf16"
    shutil.copytree(d, bf16)
    _write_bf16(bf16 / "adapter_model.safetensors", bits)
    got, want = read_adapter(bf16), read_adapter(d)
    assert got.scale == want.scale and all(np.array_equal(got.pairs[n][i], want.pairs[n][i])
                                           for n in want.pairs for i in (0, 1))


def _write_bf16(path: Path, bits: dict[str, np.ndarray]) -> None:
    """A safetensors file of BF16 tensors (numpy has no bfloat16: the header written by hand)."""
    import struct

    header, offset, data = {}, 0, b""
    for name, b in bits.items():
        header[name] = {"dtype": "BF16", "shape": list(b.shape), "data_offsets": [offset, offset + b.nbytes]}
        data += b.astype("<u2").tobytes()
        offset += b.nbytes
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
