"""Decoder configuration: one dataclass for Llama, Qwen2 and Qwen3."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kestrel_core.errors import KestrelError

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


def normalize_rope_scaling(scaling: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """None for plain RoPE; the llama3 parameters (HF's key names) otherwise; other kinds are refused."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise KestrelError(f"{where}: rope scaling type {kind!r} is not supported (kestrel supports llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise KestrelError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}")
    try:
        out: dict[str, Any] = {"rope_type": "llama3"}
        out.update({k: float(scaling[k]) for k in keys[:3]})
        out["original_max_position_embeddings"] = int(scaling[keys[3]])
    except (TypeError, ValueError) as exc:
        raise KestrelError(f"{where}: llama3 rope scaling has a bad value ({exc})") from None
    return out
