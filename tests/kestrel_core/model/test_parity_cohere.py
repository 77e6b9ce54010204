"""Cohere's decoders (Command R, Command R7B) against transformers: each of their rules is needed for the tiny
fixtures to agree (the agreement itself: parity.py's CASES; figures in docs/parity.md)."""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import kestrel_core
from kestrel_core.model.gguf_reader import GGUFCheckpoint
from kestrel_core.model.hf import HFCheckpoint
from kestrel_core.model.loader import load_model

from .parity import CASES, FIXTURES, TINY, Golden, _glm4_halves


def _sequential(loaded) -> dict:  # type: ignore[no-untyped-def]
    """The MLP after the attention, reading the residual normed by the layer's one norm (Llama's order)."""
    for layer in loaded.model.layers:
        layer.mlp_norm = layer.attn_norm
    return {"parallel_block": False}


def _shared_head_norms(loaded) -> dict:  # type: ignore[no-untyped-def]
    """Every head's q/k norm by the first head's weight, as a model with one weight for all heads."""
    hd = loaded.model.config.head_dim
    for layer in loaded.model.layers:
        layer.q_norm, layer.k_norm = layer.q_norm[:hd].copy(), layer.k_norm[:hd].copy()
    return {"qk_norm_heads": False}


# (fixture, what is wrong) -> what the loaded model's layers and config get
COHERE_WRONG = {
    ("tiny-cohere", "RMSNorm for its LayerNorms"): lambda loaded: {"norm_type": "rms"},
    ("tiny-cohere", "the MLP after the attention, not beside it"): _sequential,
    ("tiny-cohere", "one q/k norm weight for every head"): _shared_head_norms,
    ("tiny-cohere", "the logits divided by logit_scale"):
        lambda loaded: {"logits_scaling": 1 / loaded.model.config.logits_scaling},
    ("tiny-cohere2", "the logits not scaled"): lambda loaded: {"logits_scaling": 1.0},
    ("tiny-cohere2", "its global layer turned by RoPE"): lambda loaded: {"nope_layers": ()},
    ("tiny-cohere2", "no sliding window"): lambda loaded: {"layer_types": (), "sliding_window": None},
    ("tiny-cohere2.gguf", "RMSNorm for its LayerNorms"): lambda loaded: {"norm_type": "rms"},
}


@pytest.mark.parametrize(("name", "wrong"), list(COHERE_WRONG), ids=[f"{n}-{w}" for n, w in COHERE_WRONG])
def test_cohere_done_wrong_leaves_the_limits(name: str, wrong: str) -> None:
    loaded = load_model(str(FIXTURES / name), quant="q8", cache="off")
    config = replace(loaded.model.config, **COHERE_WRONG[(name, wrong)](loaded))
    golden = Golden(FIXTURES / name.removesuffix(".gguf") / "golden.npz")
    with kestrel_core.load(replace(loaded, model=replace(loaded.model, config=config)), backend="cpu",
                           activations="q8") as engine:
        fig = golden.figures(engine.logits(golden.ids))
    assert not fig.within(TINY), fig


@pytest.mark.parametrize("name", ["tiny-cohere", "tiny-cohere2"])
def test_cohere_with_rope_in_halves_leaves_the_limits(monkeypatch, name: str) -> None:  # type: ignore[no-untyped-def]
    """Cohere turns interleaved pairs (rotate_half over the even and odd dims), as GLM-4 and ERNIE 4.5."""
    from .parity import measure

    _glm4_halves(monkeypatch)
    fig = measure(next(c for c in CASES if c.name == name), "q8")
    assert not fig.within(TINY), fig


@pytest.mark.parametrize("name", ["tiny-cohere", "tiny-cohere2"])
def test_a_cohere_gguf_reads_as_its_checkpoint(name: str) -> None:
    """llama.cpp's command-r and cohere2 metadata give the checkpoint's config: the LayerNorms' eps, the logit scale,
    the per-head q/k norms, the window, which layers slide and which turn."""
    hf = HFCheckpoint(FIXTURES / name).config
    gguf = GGUFCheckpoint(FIXTURES / f"{name}.gguf").config
    same = ("arch", "norm_type", "parallel_block", "rope_interleaved", "qk_norm", "qk_norm_heads", "layer_types",
            "sliding_window", "nope_layers", "head_dim", "tie_word_embeddings", "max_position")
    assert {f: getattr(gguf, f) for f in same} == {f: getattr(hf, f) for f in same}
    assert gguf.rms_norm_eps == hf.rms_norm_eps == 1e-5
    assert gguf.logits_scaling == pytest.approx(hf.logits_scaling, rel=1e-6)


def _aya_vision(src: Path, out: Path, prefix: str) -> Path:
    """``src``'s checkpoint as an AyaVisionForConditionalGeneration writes one: its config the text_config (without
    the architectures a hub text_config leaves out), its tensors under ``prefix`` (``model.language_model.`` from
    transformers 4.52 on, ``language_model.model.`` before), beside a vision tower and a projector."""
    text = {k: v for k, v in json.loads((src / "config.json").read_text()).items() if k != "architectures"}
    outer = {"architectures": ["AyaVisionForConditionalGeneration"], "model_type": "aya_vision",
             "text_config": text, "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8},
             "image_token_index": 3, "downsample_factor": 2}
    out.mkdir()
    (out / "config.json").write_text(json.dumps(outer))
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    raw = (src / "model.safetensors").read_bytes()  # renamed in the header, the data as they are
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    renamed = {k if k == "__metadata__" else prefix + k.removeprefix("model."): v for k, v in header.items()}
    tower = prefix.replace("language_model", "vision_tower") + "vision_model.embeddings.patch_embedding.weight"
    renamed[tower] = {"dtype": "F16", "shape": [8, 4], "data_offsets": [len(data), len(data) + 64]}
    renamed[prefix.replace("language_model", "multi_modal_projector") + "linear_1.bias"] = {
        "dtype": "F16", "shape": [4], "data_offsets": [len(data) + 64, len(data) + 72]}
    blob = json.dumps(renamed).encode()
    blob += b" " * (-len(blob) % 8)
    (out / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data + bytes(72))
    return out


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
@pytest.mark.parametrize("name", ["tiny-cohere", "tiny-cohere2"])
def test_an_aya_vision_checkpoint_runs_its_language_model(tmp_path: Path, name: str, prefix: str) -> None:
    """Aya Vision (8B: Command R7B's language model, 32B: Aya Expanse's): the text_config and the language model's
    tensors of the checkpoint, its vision tower and projector not read, give the language model's very logits,
    within the limits of transformers' golden logits."""
    wrapped = _aya_vision(FIXTURES / name, tmp_path / "aya", prefix)
    golden = Golden(FIXTURES / name / "golden.npz")
    with kestrel_core.load(str(wrapped), backend="cpu", quant="q8") as engine:
        assert engine.config.arch == ("cohere" if name == "tiny-cohere" else "cohere2")
        logits = engine.logits(golden.ids)
    with kestrel_core.load(str(FIXTURES / name), backend="cpu", quant="q8") as engine:
        np.testing.assert_array_equal(logits, engine.logits(golden.ids))
    assert golden.figures(logits).within(TINY)
