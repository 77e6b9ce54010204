"""Decoder configuration: one dataclass for Llama, Qwen2 and Qwen3."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # Qwen3: independent of D / num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # llama3-style: factor, low/high_freq_factor, original_max...
    max_position: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)
