"""Seed-OSS with an output bias on its attention (``attention_out_bias``: none of the released checkpoints has one,
transformers' SeedOssAttention and llama.cpp's converter take it): tiny-seed-oss's weights with a random
``o_proj.bias`` per layer, from its Hugging Face directory and from its GGUF twin (``attn_output.bias``, which
convert_hf_to_gguf.py writes for it), against the model's maths written out here in float64 numpy.

transformers is not installed where these tests run, so the reference is the numpy forward below: on tiny-seed-oss
itself it gives transformers' golden logits (within 5e-7 of each position's range), and with the biases it adds what
SeedOssAttention adds (o_proj is an nn.Linear with bias=attention_out_bias). llama.cpp's own seed_oss loader takes
no attn_output.bias (such a file has a tensor too many for it); kestrel adds it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

import kestrel_core

from .lora_adapters import checkpoint_tensors
from .parity import FIXTURES, TINY, Golden

SEED_OSS = FIXTURES / "tiny-seed-oss"
O_BIAS = "model.layers.{}.self_attn.o_proj.bias"


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rotate(x: np.ndarray, theta: float) -> np.ndarray:
    """RoPE on x [T, heads, hd] as transformers' rotate_half: dims i and i + hd/2 turned together."""
    t, hd = x.shape[0], x.shape[-1]
    angles = np.arange(t)[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :]  # [T, hd/2]
    cos, sin = (np.concatenate([f(angles)] * 2, -1)[:, None, :] for f in (np.cos, np.sin))
    half = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + half * sin


def reference_logits(weights: dict[str, np.ndarray], cfg: dict, ids: list[int]) -> np.ndarray:
    """SeedOssForCausalLM's logits [T, V] in float64: Llama's layers with q/k/v biases and, where the weights hold
    one, an output bias."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    heads, kv_heads, hd, eps = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                                cfg["rms_norm_eps"])
    h = w["model.embed_tokens.weight"][ids]
    t = len(ids)
    causal = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        q, k, v = (x @ w[p + f"self_attn.{n}_proj.weight"].T + w[p + f"self_attn.{n}_proj.bias"] for n in "qkv")
        q = _rotate(q.reshape(t, heads, hd), cfg["rope_theta"])
        k = np.repeat(_rotate(k.reshape(t, kv_heads, hd), cfg["rope_theta"]), heads // kv_heads, axis=1)
        v = np.repeat(v.reshape(t, kv_heads, hd), heads // kv_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(t, heads * hd)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T + w.get(O_BIAS.format(i), 0.0)
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    return (_rms(h, w["model.norm.weight"], eps) @ w["lm_head.weight"].T).astype(np.float32)


def _biases(cfg: dict) -> dict[str, np.ndarray]:
    """A random output bias a layer, as large as the attention's outputs (std 0.5: the residual stream's is ~1)."""
    rng = np.random.default_rng(7)
    return {O_BIAS.format(i): rng.normal(0, 0.5, cfg["hidden_size"]).astype(np.float32)
            for i in range(cfg["num_hidden_layers"])}


@pytest.fixture(scope="module")
def biased(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, np.ndarray], dict]:
    """(tiny-seed-oss with output biases as a Hugging Face directory, as a GGUF, the directory's weights, config)."""
    root = tmp_path_factory.mktemp("seed-oss-o-bias")
    cfg = {**json.loads((SEED_OSS / "config.json").read_text()), "attention_out_bias": True}
    weights = {**checkpoint_tensors(SEED_OSS), **_biases(cfg)}
    hf = root / "tiny-seed-oss-o-bias"
    shutil.copytree(SEED_OSS, hf, ignore=shutil.ignore_patterns("*.safetensors", "golden.npz"))
    (hf / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(hf / "model.safetensors"))
    return hf, _gguf_with_biases(root / "tiny-seed-oss-o-bias.gguf", weights, cfg), weights, cfg


def _gguf_with_biases(path: Path, weights: dict[str, np.ndarray], cfg: dict) -> Path:
    """tiny-seed-oss.gguf with each layer's o_proj.bias as blk.N.attn_output.bias, as convert_hf_to_gguf.py names it."""
    reader = gguf.GGUFReader(FIXTURES / "tiny-seed-oss.gguf")
    writer = gguf.GGUFWriter(path, arch="seed_oss")
    for field in reader.fields.values():
        if field.name != gguf.Keys.General.ARCHITECTURE and not field.name.startswith("GGUF."):
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    for i in range(cfg["num_hidden_layers"]):
        writer.add_tensor(f"blk.{i}.attn_output.bias", weights[O_BIAS.format(i)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_reference_gives_transformers_logits_on_tiny_seed_oss() -> None:
    golden = Golden(SEED_OSS / "golden.npz")
    cfg = json.loads((SEED_OSS / "config.json").read_text())
    fig = golden.figures(reference_logits(checkpoint_tensors(SEED_OSS), cfg, golden.ids))
    assert fig.top1 == 1.0 and fig.max_rel < 1e-5, fig


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_seed_oss_with_an_output_bias_agrees_with_its_maths(biased, tmp_path: Path, source: str) -> None:
    """Its logits within the parity limits of the reference with the biases, and out of them without (so the
    biases are read and added, by the layers run op by op: the compiled CPU layer takes none)."""
    hf, gguf_path, weights, cfg = biased
    ids = Golden(SEED_OSS / "golden.npz").ids
    with kestrel_core.load(str(hf if source == "hf" else gguf_path), backend="cpu", quant="q8") as engine:
        assert engine.config.o_bias
        got = engine.logits(ids)
    unbiased = {k: v for k, v in weights.items() if not k.endswith("o_proj.bias")}
    want, wrong = (_golden(tmp_path / f"{name}.npz", reference_logits(w, cfg, ids), ids)
                   for name, w in (("want", weights), ("wrong", unbiased)))
    assert want.figures(got).within(TINY), want.figures(got)
    assert not wrong.figures(got).within(TINY), wrong.figures(got)


def _golden(path: Path, logits: np.ndarray, ids: list[int]) -> Golden:
    np.savez(path, ids=np.array(ids), logits=logits)
    return Golden(path)
