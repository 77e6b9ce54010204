"""Quant modes: bits and block width per tensor, the G=256 -> 32 fallback, 8-bit embedding/lm_head, tying."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kestrel_core.contract import quantize_weight
from kestrel_core.errors import KestrelError
from kestrel_core.model.quantize import QUANT_MODES, parse_quant, quantize_model


def test_parse_quant_valid_and_invalid() -> None:
    assert {m: (parse_quant(m).bits, parse_quant(m).group_size) for m in QUANT_MODES} == {
        "q8": (8, 32), "q4": (4, 32), "q8-g256": (8, 256), "q4-g256": (4, 256)}
    assert parse_quant(" Q4 ").name == "q4"
    with pytest.raises(KestrelError) as exc:
        parse_quant("q3")
    msg = str(exc.value)
    assert "'q3'" in msg and all(m in msg for m in QUANT_MODES) and "\n" not in msg


@pytest.mark.parametrize("mode", list(QUANT_MODES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_quantize_model_matches_the_contract_quantizer(synth_source, mode: str, arch: str) -> None:
    src = synth_source(arch)
    model = quantize_model(src, mode)
    bits, g = QUANT_MODES[mode]
    c = src.config
    assert len(model.layers) == c.num_layers
    for i, layer in enumerate(model.layers):
        for p in ("q", "k", "v", "o", "gate", "up", "down"):
            w = src.get(f"layers.{i}.{p}")
            sc = getattr(layer, p)
            # hidden 64 is not a multiple of 256: those tensors fall back to G=32; down has K=256
            want_g = g if w.shape[1] % g == 0 else 32
            assert (sc.bits, sc.group_size) == (bits, want_g)
            ref = quantize_weight(w, bits, want_g)
            np.testing.assert_array_equal(sc.codes, ref.codes)
            np.testing.assert_array_equal(sc.scales, ref.scales)
        np.testing.assert_array_equal(layer.attn_norm, src.get(f"layers.{i}.attn_norm"))
        assert (layer.q_bias is not None) == (arch == "qwen2")
        assert (layer.q_norm is not None) == (arch == "qwen3")
    if mode.endswith("g256"):
        assert model.layers[0].down.group_size == 256
    assert model.embedding.bits == 8 and model.lm_head.bits == 8
    np.testing.assert_array_equal(model.embedding.codes, quantize_weight(src.get("embedding"), 8, 32).codes)
    if c.tie_word_embeddings:
        assert model.lm_head is model.embedding
    else:
        assert model.lm_head is not model.embedding
        np.testing.assert_array_equal(model.lm_head.codes, quantize_weight(src.get("lm_head"), 8, 32).codes)


def test_untied_model_without_lm_head_is_an_error(synth_source) -> None:
    src = synth_source("llama")
    del src.tensors["lm_head"]
    with pytest.raises(KestrelError, match="no lm_head"):
        quantize_model(src, "q8")


def test_bad_tensors_are_one_line_errors(synth_source) -> None:
    src = synth_source("llama")
    src.tensors["layers.1.k"] = src.tensors["layers.1.k"][:, :48]
    with pytest.raises(KestrelError, match=r"layers\.1\.k has shape \[32, 48\], expected \[32, 64\]"):
        quantize_model(src, "q8")
    src = synth_source("llama")
    src.tensors["layers.0.up"][3, 5] = np.nan
    with pytest.raises(KestrelError, match="NaN"):
        quantize_model(src, "q4")
    src = synth_source("llama")
    src.tensors["embedding"][7, 2] = -np.inf
    with pytest.raises(KestrelError, match=r"^embedding: the weights contain NaN or infinity \(first in row 7\)"):
        quantize_model(src, "q8-g256")
    src = synth_source("llama", hidden_size=40, num_heads=4, head_dim=10)
    with pytest.raises(KestrelError, match="K=40 is not a multiple of 32"):
        quantize_model(src, "q8")


def test_unknown_mode_fails_before_reading_tensors(synth_source) -> None:
    src = synth_source("llama")
    src.tensors.clear()
    with pytest.raises(KestrelError, match="unknown quant mode"):
        quantize_model(src, "int3")


def test_codes_equal_gguf_py_on_rounding_edge_cases() -> None:
    """A value just below .5 after scaling: floor(x + 0.5) in float32 rounds it up, ggml's roundf does not."""
    import gguf

    w = np.zeros((2, 32), np.float32)
    w[:, 0] = 127.0  # scale 1.0, so the codes are the values rounded
    w[0, 1:6] = [0.49999997, -0.49999997, 1.4999999, 2.5, -3.5]
    w[1, 1:] = np.random.default_rng(0).uniform(-127, 127, 31).astype(np.float32)
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)  # [2, 34]: f16 scale then 32 int8 codes
    want = q[:, 2:].copy().view(np.int8)
    np.testing.assert_array_equal(quantize_weight(w, 8, 32).codes, want)


class Poisoned:
    """A TensorSource whose tensor ``name`` holds ``value`` at its element (or row) 3."""

    def __init__(self, source, name: str, value: float) -> None:  # type: ignore[no-untyped-def]
        self.source, self.name, self.value = source, name, value
        self.config, self.description = source.config, source.description

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def get(self, name: str) -> np.ndarray:
        t = self.source.get(name)
        if name == self.name:
            t = np.array(t, dtype=np.float32)
            t[3] = self.value
        return t


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_float_tensors_with_nan_or_infinity_are_refused(tmp_path, fmt, synth_source, value: float) -> None:
    """Norms, biases and float matrices (a router) stay float32, past the quantizer's NaN check: a GGUF, a Hugging
    Face directory (float32 and bfloat16) and a mixture of experts' router are each one line naming the tensor."""
    from kestrel_core.model.gguf_reader import GGUFCheckpoint
    from kestrel_core.model.loader import load_model

    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-mixtral.gguf"
    src = synth_source("qwen2")
    src.tensors["final_norm"][3] = value
    gguf_path = fmt.write_gguf(tmp_path / "m.gguf", src, tokenizer=fmt.train_bpe())
    src = synth_source("qwen2")
    src.tensors["layers.1.k_bias"][3] = value
    f32_dir, bf16_dir = fmt.write_hf_dir(tmp_path / "f32", src), fmt.write_hf_dir(tmp_path / "bf16", src, "bf16")
    cases = [(lambda: load_model(gguf_path, "q8", cache="off"), "final_norm", "element 3"),
             (lambda: load_model(f32_dir, "q8", cache="off"), "layers.1.k_bias", "element 3"),
             (lambda: load_model(bf16_dir, "q8", cache="off"), "layers.1.k_bias", "element 3"),
             (lambda: quantize_model(Poisoned(GGUFCheckpoint(fixture), "layers.1.router", value)), "layers.1.router",
              "row 3")]
    for load, name, at in cases:
        with pytest.raises(KestrelError) as info:
            load()
        message = str(info.value)
        assert f"{name} contains NaN or infinity (first in {at}" in message and "\n" not in message, message
