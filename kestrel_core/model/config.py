"""Decoder configuration: one dataclass for Llama, Qwen2, Qwen3, Mistral, Phi-3, SmolLM3, Granite, OLMo 2, EXAONE 4,
Seed-OSS, GLM-4, ERNIE 4.5, Gemma 2 and 3, Cohere's (Command R, Command R7B), the mixtures of experts (Qwen2-MoE,
Qwen3-MoE, Mixtral, gpt-oss) and the hybrids of full attention with linear attention (Qwen3.5 dense and MoE,
Qwen3-Next), short convolutions (LFM2) or Mamba-2 (Granite 4.0-H), and multi-head latent attention (DeepSeek-V2/V3,
GLM-4.7-Flash)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kestrel_core.errors import InvalidRequest, KestrelError
from kestrel_core.model.sampling import SamplingParams
from kestrel_core.model.validate import (
    MAX_DIM,
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_POSITION,
    MAX_VOCAB,
    ValidationError,
    check_bool,
    check_float,
    check_int,
    is_int,
)

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe",
                 "mixtral", "gpt_oss", "smollm3", "granite", "olmo2", "olmo3", "exaone4", "seed_oss", "glm4",
                 "ernie4_5", "qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "granitemoehybrid", "glm4_moe",
                 "ernie4_5_moe", "lfm2_moe", "ministral3", "deepseek_v2", "deepseek_v3", "glm4_moe_lite",
                 "minimax_m2", "dots1", "cohere", "cohere2")
POOLINGS = ("last", "mean", "cls")  # how an embedding pools the final hidden states: last, mean or first token
KV_TYPES = ("f16", "q8")  # what the host's KV cache holds a key or value dim as (``kv_pool.KVPool``)
# of the gate: SwiGLU, GeGLU with the tanh GELU (Gemma), or gpt-oss's clamped SwiGLU: gate g clamped to at most
# swiglu_limit, up u to +-swiglu_limit, then (u + 1) * g * sigmoid(swiglu_alpha * g)
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
# of the decoder's norms (before and after its blocks, on q and k, the final one): RMSNorm, or Cohere's LayerNorm
# without a bias, (x - mean) / sqrt(variance + eps) * weight
NORM_TYPES = ("rms", "layer")
# how a router scores the experts: a softmax over every logit, or each logit's sigmoid (DeepSeek-V3, GLM-4.5)
ROUTER_SCORINGS = ("softmax", "sigmoid")
# a layer's token mixer: attention over every earlier position, over a sliding window, linear attention (Gated
# DeltaNet), a gated short convolution (LFM2) or Mamba-2 (Granite 4.0-H); the last three keep a state per sequence
# instead of keys and values
LAYER_TYPES = ("full", "sliding", "linear", "conv", "mamba")
STATE_TYPES = ("linear", "conv", "mamba")
MAX_ROPE_FACTOR = 1024.0  # a RoPE scaling's factor, at most (and at least its reciprocal); real ones: 4 to 64
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
    rms_norm_eps: float = 1e-6  # the eps of every norm of norm_type (a LayerNorm's too)
    norm_type: str = "rms"  # one of NORM_TYPES
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # linear, llama3, yarn or longrope (normalize_rope_scaling)
    max_position: int = 4096  # the context: positions a sequence may take
    # RoPE turns only the first rotary_dim of each head's dims (Phi-4-mini); None: all of them. Such a model's
    # q and k rows are stored reordered within each head (rope.rotary_first), so the turned pairs are (i, i + hd/2)
    rotary_dim: int | None = None
    rope_interleaved: bool = False  # GLM-4: RoPE turns the pairs (2i, 2i + 1); its q/k rows are reordered too
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    qk_norm_full: bool = False  # OLMo 2: the q/k norms span the whole projection (H*hd, KV*hd), not each head
    # Cohere: the q/k norms are each head's, with a weight of its own: q_norm [H*hd], k_norm [KV*hd]
    qk_norm_heads: bool = False
    pre_norms: bool = True  # False (OLMo 2): no RMSNorm before the attention and the MLP, only post_norms after
    # Cohere: the attention and the MLP read the one norm before the attention and both add to the residual,
    # h + attn(norm(h)) + mlp(norm(h)); there is no norm before the MLP
    parallel_block: bool = False
    o_bias: bool = False  # gpt-oss: the attention's output projection has a bias
    attn_sinks: bool = False  # gpt-oss: each head's softmax has one more logit, a learned sink that takes no value
    sliding_window: int | None = None  # a windowed position attends to the last sliding_window (itself too)
    # per layer "full", "sliding" (Gemma 3) or "linear" (Qwen3.5); empty: every layer is windowed when
    # sliding_window is set
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: the RoPE base of sliding layers (unscaled); None: rope_theta
    nope_layers: tuple[int, ...] = ()  # SmolLM3: the layers whose attention has no RoPE at all
    query_scale: float | None = None  # the attention's query scale; None: 1/sqrt(head_dim)
    # Ministral 3's (Llama 4's) attention temperature: the query at position p times 1 + attn_temperature_scale *
    # ln(1 + floor(p / attn_temperature_length)), 1 before that length; 0: none
    attn_temperature_scale: float = 0.0
    attn_temperature_length: int = 0
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size); Granite: its embedding_multiplier
    residual_scale: float = 1.0  # Granite: each attention's and MLP's output times this before the residual add
    logits_scaling: float = 1.0  # Granite: the logits divided by this; Cohere: 1 / its logit_scale
    activation: str = "silu"  # one of ACTIVATIONS
    post_norms: bool = False  # Gemma: RMSNorm on the attention's and the MLP's outputs before the residual add
    attn_softcap: float | None = None  # Gemma 2: attention scores become tanh(s / c) * c
    final_softcap: float | None = None  # Gemma 2: the logits the same
    num_experts: int = 0  # mixture of experts (Qwen3-MoE, Mixtral): every layer's MLP is E experts and a router
    # the layers of a mixture of experts whose MLP is dense, intermediate_size wide (GLM-4.5's first layers,
    # Qwen2-MoE's mlp_only_layers)
    dense_layers: tuple[int, ...] = ()
    experts_per_token: int = 0  # top-k
    expert_intermediate_size: int = 0  # each expert's F
    norm_topk_prob: bool = False  # the top-k router probabilities renormalised to sum 1
    router_scoring: str = "softmax"  # one of ROUTER_SCORINGS
    # the router's choice (not its weights) adds a bias per expert to the scores (DeepSeek-V3, GLM-4.5: sigmoids;
    # ERNIE 4.5: softmax probabilities); a sigmoid router's keeps to the router_topk_groups best of router_groups
    # equal groups of experts, a group scored by the sum of its two best (DeepSeek-V3's)
    router_choice_bias: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling: float = 1.0  # the routed experts' weights times this (GLM-4.5's routed_scaling_factor)
    moe_bias: bool = False  # gpt-oss: the router and each expert's projections have biases
    swiglu_limit: float = 7.0  # activation swiglu_oai's clamp
    swiglu_alpha: float = 1.702  # activation swiglu_oai's sigmoid slope
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an expert every token runs, gated by a sigmoid; 0: none
    attn_output_gate: bool = False  # Qwen3.5: the attention's output times sigmoid(x . W_gate) before o
    # the "linear" layers' Gated DeltaNet (Qwen3.5): query/key heads and their dims, value heads (a multiple of the
    # key heads; value head h reads key head h // (value heads / key heads)) and their dims, and the width of the
    # causal depthwise convolution over q|k|v; 0 without linear layers
    linear_key_heads: int = 0
    linear_key_dim: int = 0
    linear_value_heads: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    # the "conv" layers' gated short convolution (LFM2): B, C, x = in(x); out(C * conv(B * x)), conv depthwise over
    # this many positions; 0 without conv layers
    short_conv_kernel: int = 0
    # the "mamba" layers' Mamba-2 (Granite 4.0-H): heads of head_dim channels (inner = heads * head_dim), B and C
    # shared by groups of heads, each head's state [head_dim, mamba_state], a causal depthwise convolution over
    # x|B|C this wide (with a bias where mamba_conv_bias); 0 without mamba layers
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    mamba_conv_kernel: int = 0
    mamba_conv_bias: bool = False
    shared_expert_gated: bool = True  # False (Granite 4.0-H): the shared expert's output is added as it is
    # multi-head latent attention (DeepSeek-V2/V3): each head's key and value come up from a latent of
    # kv_lora_rank (RMSNormed) beside one RoPE key all heads share; head_dim is the query's and key's (the part
    # without RoPE, then rotary_dim that turns), v_head_dim the value's; the KV cache holds the latent and the RoPE
    # key (attention_dims). q_lora_rank: the query's low rank (0: one projection). 0 without it
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    v_head_dim: int = 0  # 0: head_dim
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pooling: str | None = None  # an embedding model's pooling (one of POOLINGS): it gives vectors, not text
    normalize_embeddings: bool = True  # an embedding scaled to unit length
    # a reranker's prompt, {query} and {document} in it (kestrel_core.model.rerank): its pooling is the last token's
    # hidden state, unscaled, which its two classifier rows score
    rerank_template: str | None = None
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

    def has_experts(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def is_linear(self, layer: int) -> bool:
        """Whether ``layer`` mixes tokens by linear attention (a recurrent state), not by attention over a KV cache."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear"

    def is_conv(self, layer: int) -> bool:
        """Whether ``layer`` mixes tokens by a gated short convolution (LFM2)."""
        return bool(self.layer_types) and self.layer_types[layer] == "conv"

    def is_mamba(self, layer: int) -> bool:
        """Whether ``layer`` mixes tokens by Mamba-2 (Granite 4.0-H)."""
        return bool(self.layer_types) and self.layer_types[layer] == "mamba"

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def value_dim(self) -> int:
        """The dims of each head's value (and attention output)."""
        return self.v_head_dim or self.head_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_linear(i))

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers with a recurrent state per sequence (linear attention, short convolutions, Mamba-2)."""
        return tuple(i for i in range(self.num_layers) if self.layer_types and self.layer_types[i] in STATE_TYPES)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache."""
        return tuple(i for i in range(self.num_layers) if not (self.layer_types and self.layer_types[i] in STATE_TYPES))

    @property
    def mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """The channels of a mamba layer's convolution: x, B and C, [inner + 2 * groups * state]."""
        return self.mamba_inner + 2 * self.mamba_groups * self.mamba_state

    @property
    def linear_conv_dim(self) -> int:
        """The channels of a linear layer's convolution: its q, k and v, [2 * key heads * key dim + value heads *
        value dim]."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention; None: it attends to every earlier position."""
        if self.layer_types and self.layer_types[layer] == "full":
            return None
        return self.sliding_window

    def rope_of(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(RoPE base, scaling) of ``layer``: Gemma 3's sliding layers have their own, unscaled base; SmolLM3's
        NoPE layers turn nothing (NO_ROPE)."""
        if layer in self.nope_layers:
            return self.rope_theta, NO_ROPE
        if self.rope_local_theta is not None and self.window_of(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def rotary(self) -> int:
        """The dims of each head RoPE turns."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def qk_reordered(self) -> bool:
        """Whether the q and k rows are stored reordered within each head (rope.rotary_first); a latent attention
        orders its query and key itself (decoder._latent_attention)."""
        return not self.is_mla and (self.rotary < self.head_dim or self.rope_interleaved)

    @property
    def attention_dims(self) -> tuple[int, int, int]:
        """(KV heads, key dims, value dims) of the keys and values attention reads, as the KV cache holds them a
        position and layer: a latent attention's one latent (kv_lora_rank) beside its RoPE key, read by every head,
        its query absorbing each head's key projection and its output each head's value projection."""
        if self.is_mla:
            return 1, self.kv_lora_rank + self.rotary, self.kv_lora_rank
        return self.num_kv_heads, self.head_dim, self.value_dim

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
        for name in ("layer_types", "nope_layers", "dense_layers"):  # JSON has no tuples
            if isinstance(d.get(name), list):
                d[name] = tuple(d[name])
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
    _check_width(c, "num_heads", "head_dim")
    check_float("rms_norm_eps", c.rms_norm_eps, 0.0, 1.0, lo_open=True)
    check_float("rope_theta", c.rope_theta, 0.0, lo_open=True)
    if c.rotary_dim is not None:
        check_int("rotary_dim", c.rotary_dim, 2, c.head_dim)
        if c.rotary_dim % 2:
            raise ValidationError(f"rotary_dim must be even (RoPE rotates pairs), got {c.rotary_dim}")
    if c.rope_scaling is not None:
        check_rope_scaling(c.rope_scaling, c.rotary // 2)
    check_int("max_position", c.max_position, 1, MAX_POSITION)
    check_float("attn_temperature_scale", c.attn_temperature_scale, 0.0)
    if c.attn_temperature_scale:
        check_int("attn_temperature_length", c.attn_temperature_length, 1, MAX_POSITION)
    if c.sliding_window is not None:
        check_int("sliding_window", c.sliding_window, 1, MAX_POSITION)
    if not isinstance(c.layer_types, tuple) or not all(t in LAYER_TYPES for t in c.layer_types):
        raise ValidationError(f"layer_types must be a list of {' / '.join(LAYER_TYPES)}, got {c.layer_types!r}")
    if c.layer_types and len(c.layer_types) != c.num_layers:
        raise ValidationError(f"layer_types names {len(c.layer_types)} layers; the model has {c.num_layers}")
    if "sliding" in c.layer_types and c.sliding_window is None:
        raise ValidationError("layer_types has sliding layers but sliding_window is not set")
    _check_linear(c)
    _check_mla(c)
    if c.rope_local_theta is not None:
        check_float("rope_local_theta", c.rope_local_theta, 0.0, lo_open=True)
    if not isinstance(c.nope_layers, tuple) or not all(is_int(i) and 0 <= i < c.num_layers for i in c.nope_layers):
        raise ValidationError(f"nope_layers must be layer indices in [0, {c.num_layers}), got {c.nope_layers!r}")
    if c.query_scale is not None:
        check_float("query_scale", c.query_scale, 0.0, lo_open=True)
    check_float("embed_scale", c.embed_scale, 0.0, lo_open=True)
    check_float("residual_scale", c.residual_scale, 0.0, lo_open=True)
    check_float("logits_scaling", c.logits_scaling, 0.0, lo_open=True)
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
    _check_router(c)
    if c.moe_bias and not c.num_experts:
        raise ValidationError("moe_bias needs num_experts > 0")
    check_float("swiglu_limit", c.swiglu_limit, 0.0, lo_open=True)
    check_float("swiglu_alpha", c.swiglu_alpha, 0.0, lo_open=True)
    if c.pooling is not None and c.pooling not in POOLINGS:
        raise ValidationError(f"pooling must be one of {', '.join(POOLINGS)} or null, got {c.pooling!r}")
    if c.rerank_template is not None and not (isinstance(c.rerank_template, str) and c.pooling == "last"
                                              and not c.normalize_embeddings):
        raise ValidationError("rerank_template must be text, with pooling last and normalize_embeddings false")
    if c.qk_norm_full and not c.qk_norm:
        raise ValidationError("qk_norm_full needs qk_norm")
    if c.qk_norm_heads and (not c.qk_norm or c.qk_norm_full):
        raise ValidationError("qk_norm_heads needs qk_norm, and not qk_norm_full")
    if c.norm_type not in NORM_TYPES:
        raise ValidationError(f"norm_type must be one of {', '.join(NORM_TYPES)}, got {c.norm_type!r}")
    if c.parallel_block and (not c.pre_norms or c.post_norms):
        raise ValidationError("parallel_block needs pre_norms and no post_norms (one norm before both blocks)")
    if not c.pre_norms and not c.post_norms:
        raise ValidationError("a model without pre_norms needs post_norms")
    for name in ("tie_word_embeddings", "rope_interleaved", "qkv_bias", "qk_norm", "qk_norm_full", "qk_norm_heads",
                 "pre_norms", "parallel_block", "o_bias", "attn_sinks", "attn_output_gate", "mamba_conv_bias",
                 "shared_expert_gated", "post_norms", "norm_topk_prob", "moe_bias", "normalize_embeddings"):
        check_bool(name, getattr(c, name))
    if c.bos_token_id is not None:
        check_int("bos_token_id", c.bos_token_id, 0)
    if not isinstance(c.eos_token_ids, tuple) or not all(is_int(t) and t >= 0 for t in c.eos_token_ids):
        raise ValidationError(f"eos_token_ids must be token ids >= 0, got {c.eos_token_ids!r}")
    if c.sampling is not None:
        check_sampling(c.sampling)


def _check_router(c: ModelConfig) -> None:
    """The dense layers and the router's fields: a choice bias only with experts, groups only with a sigmoid router,
    dividing the experts into groups of two or more, enough of them kept for the top-k."""
    if not isinstance(c.dense_layers, tuple) or not all(is_int(i) and 0 <= i < c.num_layers for i in c.dense_layers):
        raise ValidationError(f"dense_layers must be layer indices in [0, {c.num_layers}), got {c.dense_layers!r}")
    if c.dense_layers and not c.num_experts:
        raise ValidationError("dense_layers needs num_experts > 0")
    if c.router_scoring not in ROUTER_SCORINGS:
        raise ValidationError(f"router_scoring must be one of {', '.join(ROUTER_SCORINGS)}, got {c.router_scoring!r}")
    check_bool("router_choice_bias", c.router_choice_bias)
    check_int("router_groups", c.router_groups, 1, MAX_EXPERTS)
    check_int("router_topk_groups", c.router_topk_groups, 1, c.router_groups)
    check_float("routed_scaling", c.routed_scaling, 0.0, lo_open=True)
    if c.router_choice_bias and not c.num_experts:
        raise ValidationError("router_choice_bias needs num_experts > 0")
    if c.router_groups > 1 and (c.router_scoring != "sigmoid" or not c.num_experts):
        raise ValidationError("router_groups needs a sigmoid router (router_scoring) and num_experts > 0")
    if c.router_groups > 1:
        per_group = c.num_experts // c.router_groups
        if c.num_experts % c.router_groups or per_group < 2:
            raise ValidationError(f"router_groups {c.router_groups} must divide the {c.num_experts} experts into "
                                  "groups of two or more")
        if c.router_topk_groups * per_group < c.experts_per_token:
            raise ValidationError(f"router_topk_groups {c.router_topk_groups} keeps fewer experts than "
                                  f"experts_per_token {c.experts_per_token}")


def _check_mla(c: ModelConfig) -> None:
    """Multi-head latent attention: a latent, RoPE on part of each head (the shared key's), a key and value a head."""
    check_int("kv_lora_rank", c.kv_lora_rank, 0, MAX_DIM)
    check_int("q_lora_rank", c.q_lora_rank, 0, MAX_DIM)
    check_int("v_head_dim", c.v_head_dim, 0, MAX_DIM)
    if not c.kv_lora_rank:
        if c.q_lora_rank or c.v_head_dim:
            raise ValidationError("q_lora_rank and v_head_dim need kv_lora_rank (multi-head latent attention)")
        return
    if c.kv_lora_rank % 2:
        raise ValidationError(f"kv_lora_rank must be even (RoPE pairs the cached key's dims), got {c.kv_lora_rank}")
    if c.rotary_dim is None or c.rotary_dim >= c.head_dim:
        raise ValidationError("multi-head latent attention turns part of each head: rotary_dim must be below head_dim")
    if c.num_kv_heads != c.num_heads:
        raise ValidationError(f"multi-head latent attention has a key and value a head: num_kv_heads "
                              f"({c.num_kv_heads}) must be num_heads ({c.num_heads})")
    if c.layer_types and set(c.layer_types) != {"full"}:
        raise ValidationError("multi-head latent attention layers are all full attention")


MAMBA_FIELDS = ("mamba_heads", "mamba_head_dim", "mamba_groups", "mamba_state", "mamba_conv_kernel")
LINEAR_FIELDS = ("linear_key_heads", "linear_key_dim", "linear_value_heads", "linear_value_dim", "linear_conv_kernel")


def _check_linear(c: ModelConfig) -> None:
    """The Gated DeltaNet fields: set (value heads a multiple of key heads) exactly when a layer is "linear"; the
    short convolution's width exactly when one is "conv"."""
    if "conv" in c.layer_types:
        check_int("short_conv_kernel", c.short_conv_kernel, 1, MAX_DIM)
    elif c.short_conv_kernel != 0:
        raise ValidationError("short_conv_kernel needs conv layers (layer_types)")
    if "mamba" in c.layer_types:
        for name in MAMBA_FIELDS:
            check_int(name, getattr(c, name), 1, MAX_HEADS if name.endswith(("heads", "groups")) else MAX_DIM)
        if c.mamba_heads % c.mamba_groups:
            raise ValidationError(f"mamba_heads ({c.mamba_heads}) must be a multiple of mamba_groups "
                                  f"({c.mamba_groups})")
    elif any(getattr(c, name) != 0 for name in MAMBA_FIELDS):
        raise ValidationError("the mamba_* fields need mamba layers (layer_types)")
    if "linear" not in c.layer_types:
        for name in LINEAR_FIELDS:
            if getattr(c, name) != 0:
                raise ValidationError(f"{name} needs linear layers (layer_types)")
        return
    for name in LINEAR_FIELDS:
        check_int(name, getattr(c, name), 1, MAX_HEADS if name.endswith("heads") else MAX_DIM)
    if c.linear_value_heads % c.linear_key_heads:
        raise ValidationError(f"linear_value_heads ({c.linear_value_heads}) must be a multiple of linear_key_heads "
                              f"({c.linear_key_heads})")
    for heads, dim in (("linear_key_heads", "linear_key_dim"), ("linear_value_heads", "linear_value_dim")):
        _check_width(c, heads, dim)


def _check_width(c: ModelConfig, heads: str, dim: str) -> None:
    """A projection's width, heads times their dims, is a dimension too: at most MAX_DIM (the row maps of fused
    tensors are made from it before any tensor is read)."""
    width = getattr(c, heads) * getattr(c, dim)
    if width > MAX_DIM:
        raise ValidationError(f"{heads} x {dim} ({getattr(c, heads)} x {getattr(c, dim)}) must be at most {MAX_DIM}")


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


ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope")
NO_ROPE = {"rope_type": "none"}  # rope_of's scaling of a layer without RoPE (every angle 0)


def check_rope_scaling(s: Any, pairs: int) -> None:
    """A normalized rope_scaling (normalize_rope_scaling's output) of a RoPE turning ``pairs`` pairs a head: its
    kind is one of ROPE_SCALINGS and each of that kind's parameters is there, finite and in range."""
    if not isinstance(s, dict) or s.get("rope_type") not in ROPE_SCALINGS:
        raise ValidationError(f"rope_scaling must be null or an object whose rope_type is one of "
                              f"{', '.join(ROPE_SCALINGS)}, got {s!r}")
    kind = s["rope_type"]
    if kind == "linear":
        check_float("rope_scaling.factor", s.get("factor"), 1 / MAX_ROPE_FACTOR, MAX_ROPE_FACTOR)
        return
    check_int("rope_scaling.original_max_position_embeddings", s.get("original_max_position_embeddings"), 1,
              MAX_POSITION)
    if kind == "llama3":
        check_float("rope_scaling.factor", s.get("factor"), 1.0, MAX_ROPE_FACTOR)
        low = check_float("rope_scaling.low_freq_factor", s.get("low_freq_factor"), 0.0, lo_open=True)
        high = check_float("rope_scaling.high_freq_factor", s.get("high_freq_factor"), 0.0, lo_open=True)
        if not high > low:
            raise ValidationError(f"rope_scaling.high_freq_factor ({high:g}) must be greater than low_freq_factor "
                                  f"({low:g})")
        return
    check_float("rope_scaling.attention_factor", s.get("attention_factor"), 0.0, lo_open=True)
    if kind == "yarn":
        check_float("rope_scaling.factor", s.get("factor"), 1 / MAX_ROPE_FACTOR, MAX_ROPE_FACTOR)
        check_float("rope_scaling.beta_fast", s.get("beta_fast"), 0.0, lo_open=True)
        check_float("rope_scaling.beta_slow", s.get("beta_slow"), 0.0, lo_open=True)
        check_bool("rope_scaling.truncate", s.get("truncate"))
        return
    for name in ("short_factor", "long_factor"):
        factors = s.get(name)
        if not isinstance(factors, list) or len(factors) != pairs:
            raise ValidationError(f"rope_scaling.{name} must be a list of {pairs} factors (one per pair RoPE "
                                  f"turns), got {factors!r}")
        for i, f in enumerate(factors):
            check_float(f"rope_scaling.{name}[{i}]", f, 0.0, lo_open=True)


def normalize_rope_scaling(scaling: dict[str, Any] | None, where: str, max_position: int | None = None,
                           original_max_position: int | None = None) -> dict[str, Any] | None:
    """None for plain RoPE; otherwise the parameters of a linear, llama3, yarn or longrope (alias su) scaling as
    transformers resolves them (HF's key names), with yarn's and longrope's attention factor computed; other kinds
    are refused by name. ``max_position``: the model's max_position_embeddings (what a missing factor or
    original_max_position_embeddings default to); ``original_max_position``: a config's top-level
    original_max_position_embeddings, which wins over the scaling's own (Phi-3), as in transformers."""
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise KestrelError(f"{where}: rope scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    kind = "longrope" if kind == "su" else kind
    if kind not in ROPE_SCALINGS:
        raise KestrelError(f"{where}: rope scaling type {kind!r} is not supported (kestrel supports "
                           f"{', '.join(ROPE_SCALINGS)})")
    try:
        return _resolve_rope_scaling(kind, scaling, max_position, original_max_position)
    except ValidationError as exc:
        raise KestrelError(f"{where}: {kind} {exc}") from None


def _resolve_rope_scaling(kind: str, s: dict[str, Any], max_position: int | None,
                          original: int | None) -> dict[str, Any]:
    if kind == "linear":
        return {"rope_type": "linear", "factor": check_float("rope_scaling.factor", s.get("factor"),
                                                             1 / MAX_ROPE_FACTOR, MAX_ROPE_FACTOR)}
    if original is None:
        original = s.get("original_max_position_embeddings", max_position)
    if original is None:
        raise ValidationError("rope scaling lacks original_max_position_embeddings")
    original = check_int("rope_scaling.original_max_position_embeddings", original, 1, MAX_POSITION)
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        missing = [k for k in keys if k not in s]
        if missing:
            raise ValidationError(f"rope scaling lacks {', '.join(missing)}")
        out: dict[str, Any] = {"rope_type": "llama3", **{k: s[k] for k in keys},
                               "original_max_position_embeddings": original}
        check_rope_scaling(out, 0)
        return {**out, **{k: float(out[k]) for k in keys}}
    factor = s.get("factor")
    if factor is None:  # transformers: the ratio of the context to the pretraining one
        if max_position is None:
            raise ValidationError("rope scaling lacks factor")
        factor = max_position / original
    factor = check_float("rope_scaling.factor", factor, 1 / MAX_ROPE_FACTOR, MAX_ROPE_FACTOR)
    attention = s.get("attention_factor")
    if kind == "yarn":
        if attention is None:
            mscale, all_dim = s.get("mscale"), s.get("mscale_all_dim")
            attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) if mscale and all_dim
                         else yarn_mscale(factor, 1.0))
        out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
               "attention_factor": attention, "beta_fast": s.get("beta_fast") or 32.0,
               "beta_slow": s.get("beta_slow") or 1.0, "truncate": s.get("truncate", True)}
        check_rope_scaling(out, 0)
        return {**out, **{k: float(out[k]) for k in ("attention_factor", "beta_fast", "beta_slow")}}
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 and original > 1 else 1.0
    out = {"rope_type": "longrope", "short_factor": s.get("short_factor"), "long_factor": s.get("long_factor"),
           "original_max_position_embeddings": original, "attention_factor": attention}
    for name in ("short_factor", "long_factor"):
        if not isinstance(out[name], list):
            raise ValidationError(f"rope scaling lacks {name} (a list of factors)")
        out[name] = [check_float(f"rope_scaling.{name}", f, 0.0, lo_open=True) for f in out[name]]
    out["attention_factor"] = check_float("rope_scaling.attention_factor", attention, 0.0, lo_open=True)
    return out


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature (its paper's eq. 21), as transformers' yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
