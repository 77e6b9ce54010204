"""Fixtures of the formats tests (artifact, HF, GGUF, tokenizer, loader): seeded synthetic checkpoints."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kestrel_core.errors import KestrelError
from kestrel_core.model.config import ModelConfig


def synth_config(arch: str = "llama", **overrides: object) -> ModelConfig:
    """Hidden 64, 2 layers, GQA 4/2; qwen2 has q/k/v biases, qwen3 q/k norms and head_dim != D/H."""
    base: dict[str, object] = dict(arch=arch, vocab_size=96, hidden_size=64, intermediate_size=256, num_layers=2,
                                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                                   rope_theta=10000.0, max_position=128, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_ids=(2,))
    if arch == "qwen2":
        base.update(qkv_bias=True)
    if arch == "qwen3":
        base.update(qk_norm=True, head_dim=32, tie_word_embeddings=True)
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


class DictSource:
    """A TensorSource over a dict of float32 arrays named the kestrel way (HF orientation)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, np.ndarray]) -> None:
        self.config = config
        self.tensors = tensors
        self.description = "synthetic"

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise KestrelError(f"synthetic: no {name}")
        return self.tensors[name]


def synth_tensors(c: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    qn, kvn = c.num_heads * hd, c.num_kv_heads * hd

    def mat(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def vec(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"embedding": mat(c.vocab_size, d), "final_norm": vec(d)}
    if not c.tie_word_embeddings:
        t["lm_head"] = mat(c.vocab_size, d)
    shapes = {"q": (qn, d), "k": (kvn, d), "v": (kvn, d), "o": (d, qn), "gate": (f, d), "up": (f, d),
              "down": (d, f)}
    for i in range(c.num_layers):
        for p, (n, k) in shapes.items():
            t[f"layers.{i}.{p}"] = mat(n, k)
        t[f"layers.{i}.attn_norm"] = vec(d)
        t[f"layers.{i}.mlp_norm"] = vec(d)
        if c.qkv_bias:
            t[f"layers.{i}.q_bias"] = vec(qn) - 1
            t[f"layers.{i}.k_bias"] = vec(kvn) - 1
            t[f"layers.{i}.v_bias"] = vec(kvn) - 1
        if c.qk_norm:
            t[f"layers.{i}.q_norm"] = vec(hd)
            t[f"layers.{i}.k_norm"] = vec(hd)
    return t


@pytest.fixture
def synth_source() -> Callable[..., DictSource]:
    """``synth_source(arch="llama", seed=0, **config_overrides)`` -> a DictSource of random weights."""

    def make(arch: str = "llama", seed: int = 0, **overrides: object) -> DictSource:
        config = synth_config(arch, **overrides)
        return DictSource(config, synth_tensors(config, seed))

    return make
