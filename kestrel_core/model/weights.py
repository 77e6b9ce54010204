"""The in-memory model every backend sees: strip-caches for projections, float32 for the rest.

This is the model view the whole-step hooks (``kestrel_preload``, ``kestrel_forward``,
``kestrel_forward_batch``, ``kestrel_decode_greedy``) receive (as ``read_only_model``'s twin), and what a backend
may rely on: ``Model``'s fields, ``LayerWeights``' fields and ``groups()``, ``ExpertWeights``, ``engine_weights``,
``PREFILL_CHUNK`` and ``kestrel_core.model.rope.rope_tables`` (docs/plugins.md lists them). The model math is
``kestrel_core.model.decoder``'s. ``model_specs`` names every tensor of a config: the quantizer, the artifact
and the synthetic presets all build a ``Model`` from it through ``assemble``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kestrel_core.contract import StripCache, read_only_strip, read_only_view
from kestrel_core.model.config import ModelConfig
from kestrel_core.wkey import (
    ATTENTION_GROUPS,
    CONV_GROUPS,
    GATED_ATTENTION_GROUPS,
    LINEAR_GROUPS,
    MAMBA_GROUPS,
    MLA_DIRECT_GROUPS,
    MLA_GROUPS,
    MLP_GROUPS,
    Proj,
    ProjGroup,
    lm_head_wkey,
    wkey,
)

PREFILL_CHUNK = 512  # tokens of one sequence the host decoder runs at once: MLP activations [T, F] stay bounded
PROJ_FIELDS = {Proj.Q: "q", Proj.K: "k", Proj.V: "v", Proj.O: "o", Proj.GATE: "gate", Proj.UP: "up",
               Proj.DOWN: "down", Proj.ATTN_GATE: "attn_gate", Proj.LIN_QKV: "lin_qkv", Proj.LIN_Z: "lin_z",
               Proj.LIN_BETA: "lin_beta", Proj.LIN_ALPHA: "lin_alpha",
               Proj.CONV_IN: "conv_in", Proj.MAMBA_IN: "mamba_in", Proj.Q_A: "q_a", Proj.KV_A: "kv_a",
               Proj.Q_B: "q_b", Proj.KV_B: "kv_b"}  # the LayerWeights field of each projection
MLP_FIELDS = ("gate", "up", "down")
EXPERT_BIASES = ("gate_bias", "up_bias", "down_bias")  # gpt-oss's, beside MLP_FIELDS


def _fields(groups: tuple[ProjGroup, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(PROJ_FIELDS[p] for p in group.members) for group in groups)


_MLP_GROUP_FIELDS = _fields(MLP_GROUPS)


def brief_repr(weights: Any) -> str:
    """A weights dataclass's repr, its fields that are set with each array as its shape and each sequence as its
    length: the elements would run to megabytes for a model (a notebook shows what it is given)."""
    parts = []
    for f in dataclasses.fields(weights):
        value = getattr(weights, f.name)
        if value is None or isinstance(value, tuple) and not value:
            continue
        if isinstance(value, np.ndarray):
            text = f"array({list(value.shape)}, {value.dtype})"
        elif isinstance(value, (list, tuple)):
            text = f"[{len(value)} {type(value[0]).__name__}]"
        else:
            text = repr(value)
        parts.append(f"{f.name}={text}")
    return f"{type(weights).__name__}({', '.join(parts)})"


@dataclass(repr=False)
class ExpertWeights:
    """One expert of a mixture-of-experts layer: a SwiGLU MLP of width Fe."""

    gate: StripCache  # [Fe, D]
    up: StripCache  # [Fe, D]
    down: StripCache  # [D, Fe]
    gate_bias: np.ndarray | None = None  # gpt-oss: [Fe]
    up_bias: np.ndarray | None = None  # [Fe]
    down_bias: np.ndarray | None = None  # [D]

    def groups(self) -> tuple[tuple[StripCache, ...], ...]:
        """(gate, up), (down,): as ``MLP_GROUPS``."""
        return tuple(tuple(getattr(self, name) for name in fields) for fields in _MLP_GROUP_FIELDS)

    __repr__ = brief_repr


@dataclass(repr=False)
class LayerWeights:
    q: StripCache | None = None  # [H*hd, D]; None in a layer without attention (linear, conv, mamba)
    k: StripCache | None = None  # [KV*hd, D]
    v: StripCache | None = None  # [KV*hd, D]
    o: StripCache | None = None  # [D, H*hd]; a layer without attention: its token mixer's output projection
    attn_norm: np.ndarray | None = None  # [D]; None without pre_norms (OLMo 2)
    mlp_norm: np.ndarray | None = None  # [D]; None without pre_norms, or in a parallel block (Cohere's)
    o_bias: np.ndarray | None = None  # gpt-oss: [D]
    sinks: np.ndarray | None = None  # gpt-oss: [H], each head's sink logit
    gate: StripCache | None = None  # [F, D]; None in a mixture-of-experts layer
    up: StripCache | None = None  # [F, D]
    down: StripCache | None = None  # [D, F]
    q_bias: np.ndarray | None = None  # Qwen2: [H*hd]
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # Qwen3, Gemma 3: [hd]; OLMo 2, Cohere: [H*hd] (k_norm [KV*hd])
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None  # Gemma 3: [D], on the attention's output
    post_mlp_norm: np.ndarray | None = None  # Gemma 3: [D], on the MLP's output
    attn_gate: StripCache | None = None  # Qwen3.5's gated attention: [H*hd, D]
    # a linear-attention layer (Gated DeltaNet, Qwen3.5), value heads in HF's order (grouped by key head)
    lin_qkv: StripCache | None = None  # [C, D], C = 2*Hk*dk + Hv*dv: q, k, v before the convolution
    lin_z: StripCache | None = None  # [Hv*dv, D]: the output gate
    lin_beta: StripCache | None = None  # [Hv, D]: sigmoid of it is the delta rule's step
    lin_alpha: StripCache | None = None  # [Hv, D]: the decay's input
    conv: np.ndarray | None = None  # float32 [C, kernel]: the causal depthwise convolution, oldest tap first
    lin_decay: np.ndarray | None = None  # [Hv]: -exp(A_log); the log-decay is lin_decay * softplus(alpha + dt_bias)
    lin_dt_bias: np.ndarray | None = None  # [Hv]
    lin_norm: np.ndarray | None = None  # [dv]: the gated RMSNorm's weight (a plain factor)
    # a short-convolution layer (LFM2): out(C * conv(B * x)) with conv [D, kernel] above, o its output projection
    conv_in: StripCache | None = None  # [3D, D]: B, C, x
    # a Mamba-2 layer (Granite 4.0-H): conv above [C, kernel] over x|B|C (C = inner + 2 * groups * state), o its
    # output projection [D, inner]
    mamba_in: StripCache | None = None  # [inner + C + heads, D]: z, x|B|C, dt
    conv_bias: np.ndarray | None = None  # [C], where mamba_conv_bias
    ssm_a: np.ndarray | None = None  # [heads]: -exp(A_log); a step keeps exp(dt * ssm_a) of the state
    ssm_dt_bias: np.ndarray | None = None  # [heads]: dt = softplus(dt_in + ssm_dt_bias)
    ssm_d: np.ndarray | None = None  # [heads]: the skip, D * x
    ssm_norm: np.ndarray | None = None  # [inner]: the gated RMSNorm over each group's channels
    # multi-head latent attention (DeepSeek-V2/V3), in the checkpoint's order: q (q_proj) or q_a and q_b (per head
    # its dn = head_dim - rotary_dim dims without RoPE, then the turned ones), the latent kv_a, kv_b (dequantized by
    # the host, not a GEMM: decoder._latent_attention), o; r = kv_lora_rank
    q_a: StripCache | None = None  # [q_lora_rank, D]
    q_a_norm: np.ndarray | None = None  # [q_lora_rank]
    q_b: StripCache | None = None  # [H*hd, q_lora_rank]
    kv_a: StripCache | None = None  # [r + rotary_dim, D]: the latent, then the shared RoPE key (HF's order)
    kv_a_norm: np.ndarray | None = None  # [r]
    kv_b: StripCache | None = None  # [H*(dn + v_head_dim), r]: per head, its key's dn dims, then its value
    router: np.ndarray | None = None  # mixture of experts: float32 [E, D]
    router_bias: np.ndarray | None = None  # gpt-oss: [E], added to the logits
    router_choice_bias: np.ndarray | None = None  # [E], added to the router's scores where it chooses experts
    experts: tuple[ExpertWeights, ...] = ()
    shared_expert: ExpertWeights | None = None  # Qwen2-MoE: run by every token (its wkeys: expert E)
    shared_expert_gate: np.ndarray | None = None  # float32 [1, D]: sigmoid(x . gate) scales its output

    @property
    def is_linear(self) -> bool:
        return self.lin_qkv is not None

    @property
    def is_conv(self) -> bool:
        return self.conv_in is not None

    @property
    def is_mamba(self) -> bool:
        return self.mamba_in is not None

    @property
    def is_mla(self) -> bool:
        return self.kv_a is not None

    def all_experts(self) -> tuple[ExpertWeights, ...]:
        """The routed experts, then the shared one: expert index e of every wkey."""
        return self.experts + ((self.shared_expert,) if self.shared_expert is not None else ())

    def proj(self, p: Proj) -> StripCache:
        w = getattr(self, PROJ_FIELDS[p])
        if w is None:
            raise KeyError(f"{PROJ_FIELDS[p]}: this layer has no such projection (a mixture-of-experts layer has "
                           "its MLP's per expert)")
        return w

    def proj_groups(self) -> tuple[tuple[ProjGroup, tuple[StripCache, ...]], ...]:
        """(group, its strips) of each projection group in execution order: the token mixer's
        (``ATTENTION_GROUPS``, ``GATED_ATTENTION_GROUPS``, ``LINEAR_GROUPS``, ``CONV_GROUPS``, ``MAMBA_GROUPS``,
        ``MLA_GROUPS`` or ``MLA_DIRECT_GROUPS``),
        then the MLP's (``MLP_GROUPS``; none in a mixture-of-experts layer, whose experts have
        ``ExpertWeights.groups()``)."""
        mixer = (LINEAR_GROUPS if self.is_linear else CONV_GROUPS if self.is_conv else MAMBA_GROUPS if self.is_mamba
                 else (MLA_GROUPS if self.q_a is not None else MLA_DIRECT_GROUPS) if self.is_mla
                 else GATED_ATTENTION_GROUPS if self.attn_gate is not None else ATTENTION_GROUPS)
        groups = mixer if self.experts else mixer + MLP_GROUPS
        return tuple((g, tuple(getattr(self, name) for name in fields)) for g, fields in zip(groups, _fields(groups)))

    def groups(self) -> tuple[tuple[StripCache, ...], ...]:
        """The strips of each of ``proj_groups()``: (q, k, v), (o,), (gate, up), (down,) in a Llama layer."""
        return tuple(strips for _, strips in self.proj_groups())

    __repr__ = brief_repr


@dataclass(repr=False)
class Model:
    config: ModelConfig
    embedding: StripCache  # [V, D]; rows dequantized at lookup
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [D]
    lm_head: StripCache  # [V, D]; the embedding itself when tied
    classifier: np.ndarray | None = None  # [2, D] float32: a reranker's yes and no rows (config.rerank_template)

    def weights(self) -> list[tuple[int, StripCache]]:
        """Every (wkey, StripCache) the GEMMs use, in execution order (a layer's experts after its attention)."""
        out = []
        for i, layer in enumerate(self.layers):
            out += [(wkey(i, p), w) for g, strips in layer.proj_groups() for p, w in zip(g.members, strips)]
            for e, ex in enumerate(layer.all_experts()):
                out += [(wkey(i, p, e), w) for g, strips in zip(MLP_GROUPS, ex.groups())
                        for p, w in zip(g.members, strips)]
        return out + [(lm_head_wkey(), self.lm_head)]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for _, w in self.weights())

    __repr__ = brief_repr


def engine_weights(model: Model) -> list[tuple[int, tuple[StripCache, ...]]]:
    """Every weight the decoder multiplies, grouped as it offers them on int8 activations: (wkey, strips) of
    each layer's groups (Q|K|V and gate|up under their fused wkey to ``kestrel_gemm_fused_q8``, O and down
    under their own to ``kestrel_gemm_q8``: ``ProjGroup.key``), each expert's gate|up and down under the
    expert's wkeys (the shared expert's as expert E), then lm_head. Each weight is the read-only object the GEMM
    hooks are handed (``contract.read_only_strip``)."""
    out = []
    for i, lw in enumerate(model.layers):
        out += [(group.key(i), strips) for group, strips in lw.proj_groups()]
        for e, ex in enumerate(lw.all_experts()):
            out += [(group.key(i, e), strips) for group, strips in zip(MLP_GROUPS, ex.groups())]
    out.append((lm_head_wkey(), (model.lm_head,)))
    return [(key, tuple(read_only_strip(w) for w in strips)) for key, strips in out]


def read_only_model(model: Model) -> Model:
    """``model`` as the whole-step hooks and ``kestrel_preload`` are handed it: a ``Model`` of its own (its layers,
    its fields) over read-only views of the same arrays, its weights ``read_only_strip``'s twins, so that a backend
    can change neither the weights nor the norms the host computes from. No element is copied."""
    tensors = {name: read_only_strip(t) if isinstance(t, StripCache) else read_only_view(t)
               for name, t in model_tensors(model).items()}
    return assemble(model.config, tensors)


# -- the tensors of a config ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    name: str  # the kestrel (and artifact) name: embedding, layers.3.q, layers.3.experts.5.gate, ...
    kind: str  # "proj": a strip-cache at the mode's bits; "table": one at 8 bits; "vector" / "matrix": float32
    shape: tuple[int, ...]  # [N, K] of a weight, [n] of a vector


def layer_name(i: int, field: str) -> str:
    """The kestrel name of one layer tensor, e.g. ``layers.3.q`` (also the artifact's tensor name)."""
    return f"layers.{i}.{field}"


def expert_field(e: int, field: str) -> str:
    """A layer field of expert ``e``: ``experts.5.gate``."""
    return f"experts.{e}.{field}"


def layer_specs(c: ModelConfig, i: int) -> list[TensorSpec]:
    """The tensors of layer ``i``, in the order the quantizer reads them."""
    d, hd = c.hidden_size, c.head_dim
    qn, kvn = c.num_heads * hd, c.num_kv_heads * hd
    recurrent = i in c.state_layers  # no attention: none of its tensors
    if c.is_linear(i):
        out = _linear_mixer_specs(c)
    elif c.is_conv(i):
        out = [("conv_in", "proj", (3 * d, d)), ("o", "proj", (d, d)), ("conv", "matrix", (d, c.short_conv_kernel))]
    elif c.is_mamba(i):
        out = _mamba_specs(c)
    elif c.is_mla:
        out = _mla_specs(c)
    else:
        out = [("q", "proj", (qn, d)), ("k", "proj", (kvn, d)), ("v", "proj", (kvn, d))]
        if c.attn_output_gate:
            out.append(("attn_gate", "proj", (qn, d)))
        out.append(("o", "proj", (d, qn)))
    if c.has_experts(i):
        fe = c.expert_intermediate_size
        out.append(("router", "matrix", (c.num_experts, d)))
        if c.moe_bias:
            out.append(("router_bias", "vector", (c.num_experts,)))
        if c.router_choice_bias:
            out.append(("router_choice_bias", "vector", (c.num_experts,)))
        for e in range(c.num_experts):
            out += [(expert_field(e, "gate"), "proj", (fe, d)), (expert_field(e, "up"), "proj", (fe, d)),
                    (expert_field(e, "down"), "proj", (d, fe))]
            if c.moe_bias:
                out += [(expert_field(e, "gate_bias"), "vector", (fe,)), (expert_field(e, "up_bias"), "vector", (fe,)),
                        (expert_field(e, "down_bias"), "vector", (d,))]
        fs = c.shared_expert_intermediate_size
        if fs:
            out += [("shared_expert.gate", "proj", (fs, d)), ("shared_expert.up", "proj", (fs, d)),
                    ("shared_expert.down", "proj", (d, fs))]
            if c.shared_expert_gated:
                out.append(("shared_expert_gate", "matrix", (1, d)))
    else:
        f = c.intermediate_size
        out += [("gate", "proj", (f, d)), ("up", "proj", (f, d)), ("down", "proj", (d, f))]
    if c.qkv_bias and not recurrent:
        out += [("q_bias", "vector", (qn,)), ("k_bias", "vector", (kvn,)), ("v_bias", "vector", (kvn,))]
    if c.o_bias and not recurrent:
        out.append(("o_bias", "vector", (d,)))
    if c.attn_sinks and not recurrent:
        out.append(("sinks", "vector", (c.num_heads,)))
    if c.qk_norm and not recurrent:
        whole = c.qk_norm_full or c.qk_norm_heads  # a weight for every head's dims
        out += [("q_norm", "vector", (qn if whole else hd,)), ("k_norm", "vector", (kvn if whole else hd,))]
    if c.pre_norms:
        out.append(("attn_norm", "vector", (d,)))
    if c.pre_norms and not c.parallel_block:
        out.append(("mlp_norm", "vector", (d,)))
    if c.post_norms:
        out += [("post_attn_norm", "vector", (d,)), ("post_mlp_norm", "vector", (d,))]
    return [TensorSpec(layer_name(i, name), kind, shape) for name, kind, shape in out]


def _linear_mixer_specs(c: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """A linear-attention layer's token mixer (Gated DeltaNet): its projections, convolution, decay and norm."""
    d, hv, vd = c.hidden_size, c.linear_value_heads, c.linear_value_heads * c.linear_value_dim
    conv = c.linear_conv_dim
    return [("lin_qkv", "proj", (conv, d)), ("lin_z", "proj", (vd, d)), ("lin_beta", "proj", (hv, d)),
            ("lin_alpha", "proj", (hv, d)), ("o", "proj", (d, vd)),
            ("conv", "matrix", (conv, c.linear_conv_kernel)), ("lin_decay", "vector", (hv,)),
            ("lin_dt_bias", "vector", (hv,)),
            ("lin_norm", "vector", (c.linear_value_dim,))]


def _mla_specs(c: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """A multi-head latent attention layer's projections and latent norms (``LayerWeights``' q_a ... kv_b)."""
    d, h, r, qr = c.hidden_size, c.num_heads, c.kv_lora_rank, c.q_lora_rank
    dn = c.head_dim - c.rotary
    query = ([("q_a", "proj", (qr, d)), ("q_a_norm", "vector", (qr,)), ("q_b", "proj", (h * c.head_dim, qr))] if qr
             else [("q", "proj", (h * c.head_dim, d))])
    return [*query, ("kv_a", "proj", (r + c.rotary, d)), ("kv_a_norm", "vector", (r,)),
            ("kv_b", "proj", (h * (dn + c.value_dim), r)), ("o", "proj", (d, h * c.value_dim))]


def _mamba_specs(c: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """A Mamba-2 layer's token mixer: its projections, convolution, decay, time-step bias, skip and norm."""
    d, h, conv = c.hidden_size, c.mamba_heads, c.mamba_conv_dim
    out = [("mamba_in", "proj", (c.mamba_inner + conv + h, d)), ("o", "proj", (d, c.mamba_inner)),
           ("conv", "matrix", (conv, c.mamba_conv_kernel))]
    if c.mamba_conv_bias:
        out.append(("conv_bias", "vector", (conv,)))
    return out + [("ssm_a", "vector", (h,)), ("ssm_dt_bias", "vector", (h,)), ("ssm_d", "vector", (h,)),
                  ("ssm_norm", "vector", (c.mamba_inner,))]


def model_specs(c: ModelConfig) -> list[TensorSpec]:
    """Every tensor of a model of config ``c``: embedding, the layers, final_norm, lm_head (unless tied), a
    reranker's classifier."""
    table = (c.vocab_size, c.hidden_size)
    out = [TensorSpec("embedding", "table", table)]
    for i in range(c.num_layers):
        out += layer_specs(c, i)
    out.append(TensorSpec("final_norm", "vector", (c.hidden_size,)))
    if not c.tie_word_embeddings:
        out.append(TensorSpec("lm_head", "table", table))
    if c.rerank_template is not None:
        out.append(TensorSpec("classifier", "matrix", (2, c.hidden_size)))
    return out


def assemble(c: ModelConfig, tensors: Mapping[str, Any]) -> Model:
    """The Model of config ``c`` from its tensors by name (every one of ``model_specs(c)``)."""
    layers = []
    for i in range(c.num_layers):
        prefix = layer_name(i, "")
        fields = {s.name[len(prefix):]: tensors[s.name] for s in layer_specs(c, i)}
        routed = c.num_experts if c.has_experts(i) else 0
        experts = tuple(ExpertWeights(*(fields.pop(expert_field(e, f)) for f in MLP_FIELDS),
                                      *(fields.pop(expert_field(e, b), None) for b in EXPERT_BIASES))
                        for e in range(routed))
        shared = (ExpertWeights(*(fields.pop(f"shared_expert.{f}") for f in MLP_FIELDS))
                  if routed and c.shared_expert_intermediate_size else None)
        layers.append(LayerWeights(**fields, experts=experts, shared_expert=shared))
    embedding = tensors["embedding"]
    lm_head = embedding if c.tie_word_embeddings else tensors["lm_head"]  # tied: the same object, cached once
    return Model(config=c, embedding=embedding, layers=layers, final_norm=tensors["final_norm"], lm_head=lm_head,
                 classifier=tensors["classifier"] if c.rerank_template is not None else None)


def model_tensors(model: Model) -> dict[str, StripCache | np.ndarray]:
    """Every tensor of ``model`` under its name (``model_specs``); a tied lm_head is left out."""
    out: dict[str, StripCache | np.ndarray] = {}
    for s in model_specs(model.config):
        if s.name in ("embedding", "final_norm", "lm_head", "classifier"):
            out[s.name] = getattr(model, s.name)
            continue
        _, i, field = s.name.split(".", 2)
        layer = model.layers[int(i)]
        if field.startswith("experts."):
            _, e, name = field.split(".")
            out[s.name] = getattr(layer.experts[int(e)], name)
        elif field.startswith("shared_expert."):
            out[s.name] = getattr(layer.shared_expert, field.split(".")[1])
        else:
            out[s.name] = getattr(layer, field)
    return out


def parameter_count(model: Model) -> int:
    """The model's parameters: the elements of every tensor it holds (``model_tensors``: the embedding, each
    projection, expert and norm; a tied lm_head once), as a checkpoint's tensors count them."""
    return sum(math.prod(t.shape) for t in model_tensors(model).values())
