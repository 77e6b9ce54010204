"""Decoder configuration: one dataclass for Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2 and 3 and the mixtures of
experts (Qwen2-MoE, Qwen3-MoE, Mixtral)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kestrel_core.errors import InvalidRequest, KestrelError
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.validate import ValidationError, check_bool, check_float, check_int, is_int

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe",
                 "mixtral")
POOLINGS = ("last", "mean", "cls")  # how an embedding pools the final hidden states: last, mean or first token
ACTIVATIONS = ("silu", "gelu_tanh")  # of the gate: SwiGLU, or GeGLU with the tanh GELU (Gemma)
LAYER_TYPES = ("full", "sliding")
MAX_EXPERTS = 1 << 12
# Upper bounds far above any real model, so a config cannot ask for absurd allocations (2^40 layers...)
MAX_DIM = 1 << 20  # hidden, intermediate, head_dim
MAX_VOCAB = 1 << 24
MAX_LAYERS = 4096
MAX_HEADS = 1 << 14
MAX_POSITION = 1 << 26
# what a model may recommend for sampling (generation_config.json, GGUF general.sampling.*): SamplingParams' names
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


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
    sliding_window: int | None = None  # a windowed position attends to the last sliding_window (itself too)
    # per layer "full" or "sliding" (Gemma 3); empty: every layer is windowed when sliding_window is set
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: the RoPE base of sliding layers (unscaled); None: rope_theta
    query_scale: float | None = None  # the attention's query scale; None: 1/sqrt(head_dim)
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size)
    activation: str = "silu"  # one of ACTIVATIONS
    post_norms: bool = False  # Gemma: RMSNorm on the attention's and the MLP's outputs before the residual add
    attn_softcap: float | None = None  # Gemma 2: attention scores become tanh(s / c) * c
    final_softcap: float | None = None  # Gemma 2: the logits the same
    num_experts: int = 0  # mixture of experts (Qwen3-MoE, Mixtral): every layer's MLP is E experts and a router
    experts_per_token: int = 0  # top-k
    expert_intermediate_size: int = 0  # each expert's F
    norm_topk_prob: bool = False  # the top-k router probabilities renormalised to sum 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an expert every token runs, gated by a sigmoid; 0: none
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pooling: str | None = None  # an embedding model's pooling (one of POOLINGS): it gives vectors, not text
    normalize_embeddings: bool = True  # an embedding scaled to unit length
    # the sampling its authors recommend (some of SAMPLING_FIELDS): what a request leaves unset takes these
    sampling: dict[str, float] | None = None

    def __post_init__(self) -> None:
        """Every field by type and range, whoever built the config (HF, GGUF, .kst, presets): a bad value is one
        ValidationError naming the field (the loaders prefix their file), never a wrong or crashing model."""
        validate_config(self)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention; None: it attends to every earlier position."""
        if self.layer_types and self.layer_types[layer] == "full":
            return None
        return self.sliding_window

    def rope_of(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(RoPE base, scaling) of ``layer``: Gemma 3's sliding layers have their own, unscaled base."""
        if self.rope_local_theta is not None and self.window_of(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def rows_of(self, projection: str) -> int:
        """Output rows of projection q, k, v, gate or up (how a fused checkpoint tensor splits)."""
        heads = {"q": self.num_heads, "k": self.num_kv_heads, "v": self.num_kv_heads}
        return heads[projection] * self.head_dim if projection in heads else self.intermediate_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        eos = d.get("eos_token_ids") or ()
        if not isinstance(eos, (list, tuple)):
            raise ValidationError(f"eos_token_ids must be a list of token ids, got {eos!r}")
        d["eos_token_ids"] = tuple(eos)
        if isinstance(d.get("layer_types"), list):  # JSON has no tuples
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)


def validate_config(c: ModelConfig) -> None:
    """The checks of ModelConfig.__post_init__ (see there); raises ValidationError naming the first bad field."""
    if not isinstance(c.arch, str) or c.arch not in ARCHITECTURES:
        raise ValidationError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {c.arch!r}")
    check_int("vocab_size", c.vocab_size, 1, MAX_VOCAB)
    check_int("hidden_size", c.hidden_size, 1, MAX_DIM)
    check_int("intermediate_size", c.intermediate_size, 1, MAX_DIM)
    check_int("num_layers", c.num_layers, 1, MAX_LAYERS)
    check_int("num_heads", c.num_heads, 1, MAX_HEADS)
    check_int("num_kv_heads", c.num_kv_heads, 1, MAX_HEADS)
    check_int("head_dim", c.head_dim, 2, MAX_DIM)
    if c.head_dim % 2:
        raise ValidationError(f"head_dim must be even (RoPE rotates pairs), got {c.head_dim}")
    if c.num_heads % c.num_kv_heads:
        raise ValidationError(f"num_heads ({c.num_heads}) must be a multiple of num_kv_heads ({c.num_kv_heads})")
    check_float("rms_norm_eps", c.rms_norm_eps, 0.0, 1.0, lo_open=True)
    check_float("rope_theta", c.rope_theta, 0.0, lo_open=True)
    if c.rope_scaling is not None:
        if not isinstance(c.rope_scaling, dict):
            raise ValidationError(f"rope_scaling must be an object or null, got {c.rope_scaling!r}")
        if c.rope_scaling.get("rope_type") == "llama3":
            check_llama3_scaling(c.rope_scaling)
        elif c.rope_scaling.get("rope_type") == "linear":
            check_float("rope_scaling.factor", c.rope_scaling.get("factor"), 0.0, lo_open=True)
    check_int("max_position", c.max_position, 1, MAX_POSITION)
    if c.sliding_window is not None:
        check_int("sliding_window", c.sliding_window, 1, MAX_POSITION)
    if not isinstance(c.layer_types, tuple) or not all(t in LAYER_TYPES for t in c.layer_types):
        raise ValidationError(f"layer_types must be a list of {' / '.join(LAYER_TYPES)}, got {c.layer_types!r}")
    if c.layer_types and len(c.layer_types) != c.num_layers:
        raise ValidationError(f"layer_types names {len(c.layer_types)} layers; the model has {c.num_layers}")
    if "sliding" in c.layer_types and c.sliding_window is None:
        raise ValidationError("layer_types has sliding layers but sliding_window is not set")
    if c.rope_local_theta is not None:
        check_float("rope_local_theta", c.rope_local_theta, 0.0, lo_open=True)
    if c.query_scale is not None:
        check_float("query_scale", c.query_scale, 0.0, lo_open=True)
    check_float("embed_scale", c.embed_scale, 0.0, lo_open=True)
    for name in ("attn_softcap", "final_softcap"):
        if getattr(c, name) is not None:
            check_float(name, getattr(c, name), 0.0, lo_open=True)
    if c.activation not in ACTIVATIONS:
        raise ValidationError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {c.activation!r}")
    check_int("num_experts", c.num_experts, 0, MAX_EXPERTS)
    if c.num_experts:
        check_int("experts_per_token", c.experts_per_token, 1, c.num_experts)
        check_int("expert_intermediate_size", c.expert_intermediate_size, 1, MAX_DIM)
    elif c.experts_per_token or c.expert_intermediate_size or c.shared_expert_intermediate_size:
        raise ValidationError("experts_per_token, expert_intermediate_size and shared_expert_intermediate_size "
                              "need num_experts > 0")
    check_int("shared_expert_intermediate_size", c.shared_expert_intermediate_size, 0, MAX_DIM)
    if c.pooling is not None and c.pooling not in POOLINGS:
        raise ValidationError(f"pooling must be one of {', '.join(POOLINGS)} or null, got {c.pooling!r}")
    for name in ("tie_word_embeddings", "qkv_bias", "qk_norm", "post_norms", "norm_topk_prob", "normalize_embeddings"):
        check_bool(name, getattr(c, name))
    if c.bos_token_id is not None:
        check_int("bos_token_id", c.bos_token_id, 0)
    if not isinstance(c.eos_token_ids, tuple) or not all(is_int(t) and t >= 0 for t in c.eos_token_ids):
        raise ValidationError(f"eos_token_ids must be token ids >= 0, got {c.eos_token_ids!r}")
    if c.sampling is not None:
        check_sampling(c.sampling)


def recommended_sampling(values: dict[str, Any]) -> dict[str, Any] | None:
    """A model's recommended sampling from what its file sets of SAMPLING_FIELDS (None: nothing): a top_k <= 0
    (off) is 0; a value out of SamplingParams' range is a ValidationError naming it."""
    out = dict(values)
    if is_int(out.get("top_k")) and out["top_k"] < 0:
        out["top_k"] = 0
    check_sampling(out)
    return out or None


def check_sampling(sampling: Any) -> None:
    """A model's recommended sampling: some of SAMPLING_FIELDS, each in the range SamplingParams allows."""
    if not isinstance(sampling, dict) or not set(sampling) <= set(SAMPLING_FIELDS):
        raise ValidationError(f"sampling must be an object of {', '.join(SAMPLING_FIELDS)}, got {sampling!r}")
    try:
        SamplingParams(**sampling).check()
    except InvalidRequest as exc:
        raise ValidationError(f"sampling.{exc}") from None


def check_llama3_scaling(s: dict[str, Any]) -> None:
    """llama3 RoPE scaling parameters: factor >= 1, 0 < low_freq_factor < high_freq_factor (the formula divides by
    high - low), original_max_position_embeddings >= 1; all finite."""
    check_float("rope_scaling.factor", s.get("factor"), 1.0)
    low = check_float("rope_scaling.low_freq_factor", s.get("low_freq_factor"), 0.0, lo_open=True)
    high = check_float("rope_scaling.high_freq_factor", s.get("high_freq_factor"), 0.0, lo_open=True)
    if not high > low:
        raise ValidationError(f"rope_scaling.high_freq_factor ({high:g}) must be greater than low_freq_factor "
                              f"({low:g})")
    check_int("rope_scaling.original_max_position_embeddings", s.get("original_max_position_embeddings"), 1,
              MAX_POSITION)


def normalize_rope_scaling(scaling: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """None for plain RoPE; the llama3 or linear parameters (HF's key names) otherwise; other kinds are refused."""
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise KestrelError(f"{where}: rope scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        try:
            factor = check_float("rope_scaling.factor", scaling.get("factor"), 0.0, lo_open=True)
        except ValidationError as exc:
            raise KestrelError(f"{where}: linear {exc}") from None
        return {"rope_type": "linear", "factor": factor}
    if kind != "llama3":
        raise KestrelError(f"{where}: rope scaling type {kind!r} is not supported (kestrel supports llama3 "
                           "and linear)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise KestrelError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}")
    out: dict[str, Any] = {"rope_type": "llama3", **{k: scaling[k] for k in keys}}
    try:
        check_llama3_scaling(out)
    except ValidationError as exc:
        raise KestrelError(f"{where}: llama3 {exc}") from None
    out.update({k: float(out[k]) for k in keys[:3]})
    out["original_max_position_embeddings"] = int(out[keys[3]])
    return out
