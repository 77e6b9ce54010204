"""What the whole-step forward keeps on the device for one model: small tensors, projections, workspace.

``Projections`` turns a model's strips into device projections (``plan.Lin``) with their M=1 plans, through
the weight cache (``weight_source``) or, without one, by packing and uploading them itself. ``build_state``
makes a model's ``State`` (every projection fetched up front unless a residency window fetches them per
layer and step) and reserves the split-K scratch its plans need; ``unsupported_reason`` says why a model has
none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kestrel_core.contract import StripCache
from kestrel_core.errors import KestrelError
from kestrel_core.model.rope import rope_tables
from kestrel_core.model.weights import Model
from kestrel_core.wkey import lm_head_wkey
from kestrel_cuda.layout import StripGroup, fusable, layer_groups, pack_kmajor, pad_n
from kestrel_cuda.plan import (
    FINISH_COLS,
    GROUPED_ROWS_FEW,
    MAX_HEAD_DIM,
    PASS_ROWS,
    POSTNORM_MAX_D,
    ROUTE_MAX_EXPERTS,
    ROUTE_MAX_HIDDEN,
    TILE_N,
    TOKEN_RING,
    Lin,
    attn_part_size,
    gemv_scratch,
    group_capacity,
    plan_routed,
    plan_split,
    route_fold_weights,
    ssq_count,
)

DEVICE_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "qwen3_moe", "mixtral",
                        "qwen2_moe", "gpt_oss", "smollm3", "seed_oss", "glm4", "ernie4_5", "granite")


def unsupported_reason(model: Model) -> str | None:
    """Why the device forward cannot run ``model`` (None: it can): the decoders it knows are Llama, Qwen2,
    Qwen3, Mistral, Phi-3, SmolLM3 (its NoPE layers' RoPE tables turn nothing), Seed-OSS (Qwen2's biases), GLM-4
    (its interleaved RoPE pairs as stored, Gemma's four norms), ERNIE 4.5 (the same pairs), Gemma 3 (post-norms,
    GeGLU, scaled embeddings and queries, a RoPE per layer kind, sliding windows), Gemma 2 (Gemma 3's layers
    without q/k norms, with soft caps on the attention scores and the logits), Granite (scaled embeddings and
    queries, a residual multiplier, a logits divisor) and the mixtures of experts Qwen3-MoE, Mixtral, Qwen2-MoE
    and gpt-oss (attention sinks, biases on q/k/v, o, the router and the experts, its clamped SwiGLU in the
    routed experts, sliding and full layers, YaRN) (up to ROUTE_MAX_EXPERTS experts, routed on the device); the
    others (OLMo 2, EXAONE 4, the latent attention of DeepSeek-V2/V3, MiniMax-M2's whole-projection q/k norms and
    sigmoid router, dots.llm1's sigmoid router, Cohere's LayerNorms and parallel blocks) run through the GEMM
    hooks."""
    c = model.config
    if c.arch not in DEVICE_ARCHITECTURES:
        return f"architecture {c.arch!r}"
    if c.activation not in ("silu", "gelu_tanh", "swiglu_oai"):
        return f"activation {c.activation!r}"
    if c.activation == "swiglu_oai" and (not c.is_moe or c.dense_layers or c.shared_expert_intermediate_size):
        return "the clamped SwiGLU outside routed experts (its prologue is the routed GEMVs' and grouped GEMMs')"
    if not c.pre_norms or c.qk_norm_full:
        return "norms only after each block, or q/k norms over the whole projection"
    if c.norm_type != "rms" or c.parallel_block or c.qk_norm_heads:
        return "LayerNorms, parallel attention and MLP blocks, or a q/k norm weight a head (Cohere's)"
    if c.is_mla:
        return "multi-head latent attention (DeepSeek-V2/V3's)"
    if c.state_layers or c.attn_output_gate:
        return "recurrent layers (linear attention, short convolutions, Mamba-2) or gated attention"
    if c.o_bias and c.post_norms:
        return "an output projection bias with post-norms"
    if c.dense_layers or c.router_scoring != "softmax" or c.router_choice_bias or c.routed_scaling != 1.0:
        return "dense layers among the experts, or a sigmoid, biased or scaled router"
    if c.attn_temperature_scale:
        return "an attention temperature (Ministral 3's)"
    if c.residual_scale != 1.0 and (c.post_norms or c.is_moe):
        return "a residual multiplier with post-norms or experts"
    if c.head_dim % 4 or c.head_dim > MAX_HEAD_DIM:
        return f"head_dim {c.head_dim} (needs a multiple of 4 <= {MAX_HEAD_DIM})"
    if c.num_kv_heads <= 0 or c.num_heads % c.num_kv_heads:
        return f"{c.num_heads} heads over {c.num_kv_heads} KV heads"
    if model.embedding.k != c.hidden_size:
        return "embedding width differs from hidden_size"
    if c.is_moe and (c.num_experts > ROUTE_MAX_EXPERTS or c.hidden_size > ROUTE_MAX_HIDDEN or c.hidden_size % 4):
        return (f"{c.num_experts} experts of width {c.hidden_size} (the router takes up to {ROUTE_MAX_EXPERTS} of"
                f" a width up to {ROUTE_MAX_HIDDEN}, a multiple of 4)")
    return None


WeightSource = Callable[[int, Sequence[StripCache]], Any]


@dataclass
class ExpertLins:
    gate_up: list[Lin]
    down: Lin


@dataclass
class ExpertTables:
    """A layer's routed experts as one table per projection (``ops.expert_table``): what the chosen-expert
    GEMVs of a decode step read their weights from; with gpt-oss's expert biases, each projection's biases of every
    expert, float32 [E, n] (the routed GEMVs add an expert's row, ``ops.expert_bias`` a grouped GEMM's)."""

    gate_up: list[Any]  # one per member of an expert's gate|up group
    down: Any
    gate_up_bias: list[Any] | None = None  # one per member, [E, the member's n]
    down_bias: Any = None  # [E, D]


@dataclass
class LayerLins:
    qkv: list[Lin]
    o: Lin
    gate_up: list[Lin]  # a dense layer's MLP (empty in a mixture of experts)
    down: Lin | None
    experts: list[ExpertLins] = field(default_factory=list)  # the routed experts, then the shared one
    tables: ExpertTables | None = None

    def all_lins(self) -> list[Lin]:
        """Every projection of the layer, each expert's included."""
        return [*self.qkv, self.o, *self.gate_up, *([self.down] if self.down else []),
                *(lin for ex in self.experts for lin in (*ex.gate_up, ex.down))]


@dataclass
class Layer:
    attn_norm: Any
    mlp_norm: Any
    q_norm: Any
    k_norm: Any
    qkv_bias: Any
    cos: Any  # this layer's RoPE tables [positions, hd/2] (one pair per distinct RoPE of the model)
    sin: Any
    post_attn_norm: Any = None  # Gemma: RMSNorm of the attention's and the MLP's outputs before the residual add
    post_mlp_norm: Any = None
    router: Any = None  # mixture of experts: float32 [E, D], then Qwen2-MoE's shared-expert gate [1, D]
    route_fold: Any = None  # ... its plan.RouteFold weights [R, D + K] (route_fold_weights), where it folds
    weights: LayerLins | None = None  # None when fetched per step (residency window)
    sinks: Any = None  # gpt-oss: float32 [H], each head's sink logit
    o_bias: Any = None  # gpt-oss: float32 [D], added with the o projection's output
    router_bias: Any = None  # gpt-oss: float32 [E], added to the router's logits


@dataclass
class State:
    """Everything on the device for one model: small tensors, weights, workspace."""

    model: Model  # strips for per-step fetches (window) and the identity check
    config: Any
    max_context: int
    emb_codes: Any
    emb_scales: Any
    emb_group: int
    final_norm: Any
    layers: list[Layer]
    lm_head: Lin | None
    meta: Any  # int32 [1 + PASS_ROWS]: position, then token ids
    h: Any
    out: Any  # [PASS_ROWS, D]: the o and down projections' outputs where a post-norm follows (Gemma)
    post: tuple[Any, Any] | None  # Gemma, M = 1: the post-norms' second residual row [1, D] and sums [4 * 64]
    ssq: Any  # float32 [ceil(D / 32)]: h's sums of squares per 32 columns, M = 1 (forward.cuh)
    qkv: Any
    q: Any
    attn: Any
    attend: tuple[Any, Any]  # plan.AttendFold's kv_now uint64 [2 KV hd] and epochs uint32 [H + 2 KV]
    gu: Any
    moe: tuple[Any, Any, Any, Any] | None  # mixture of experts, T = PASS_ROWS: the normed rows xn [T, D]; by
    # (row, slot) sorted by expert: the rows xs [T k, D], gate|up outputs [T k, 2 F_e] and outputs ys [T (k + 1), D]
    # (the shared expert's after the routed ones; a decode step's slots are rows 0..k)
    route: tuple[Any, Any, Any, Any] | None  # moe_route's logits [T, R] and counters [T], sel [T, k], wts [T, k+1]
    # (a decode step's RouteFold: its split sums in the logits, its count in counters[0])
    group: tuple[Any, Any, Any] | None  # moe_group's source [T k], position [T k], groups [capacity, 3] (int32)
    finish: tuple[Any, Any, Any]  # lm_finish's per-block (value, index) and its arrival counter
    argmax: tuple[Any, Any, Any, Any, Any]  # argmax_rows' per-row blocks' (value, index, non-finite), counters, ids
    tokens: np.ndarray  # int32 [TOKEN_RING] pinned host memory: lm_finish's greedy token by position
    logits: Any
    logits_all: Any = None
    ssq_mid: Any = None  # M = 1, a mixture of experts: h''s tile sums, the residual after an o projection with a
    # RouteFold (its weights need them after the next residual add has replaced ssq's)
    pinned: list[int] = field(default_factory=list)

    @property
    def ids(self) -> Any:
        return self.meta[1:]


class Projections:
    """Device projections of a model's strips, each planned for the M=1 GEMV (``plan.plan_split``).

    ``weight_source(wkey, strips)``: the weight cache's get-or-upload (None: pack and upload through ``ops``);
    ``sm_count``, ``clusters``, ``target_blocks``: the planner's inputs."""

    def __init__(self, ops: Any, weight_source: WeightSource | None, sm_count: int, clusters: bool,
                 target_blocks: int | None) -> None:
        self.ops = ops
        self.weight_source = weight_source
        self.sm_count = sm_count
        self.clusters = clusters
        self.target_blocks = target_blocks

    def plan(self, lin: Lin) -> int:
        """K splits of ``lin``'s M=1 GEMV (sets ``lin.cluster``)."""
        return plan_split(lin, self.sm_count, self.target_blocks, self.clusters)

    def layer(self, model: Model, i: int) -> LayerLins:
        lins = [self.fetch(group) for group in layer_groups(i, model.layers[i])]
        if not model.layers[i].experts:
            qkv, o, gu, down = lins
            return LayerLins(qkv=qkv, o=o[0], gate_up=gu, down=down[0])
        experts = [ExpertLins(gate_up=lins[j], down=lins[j + 1][0]) for j in range(2, len(lins), 2)]
        routed = experts[:model.config.num_experts]
        slots = model.config.experts_per_token
        for lin in (lin for ex in routed for lin in (*ex.gate_up, ex.down)):
            lin.ksplit = plan_routed(lin, slots, self.sm_count, self.clusters)
        tables = ExpertTables([self.ops.expert_table([ex.gate_up[j] for ex in routed])
                               for j in range(len(routed[0].gate_up))],
                              self.ops.expert_table([ex.down for ex in routed]))
        weights = model.layers[i].experts
        if weights[0].gate_bias is not None:  # gate|up's biases as its members split the columns
            gate_up = np.stack([np.concatenate([ex.gate_bias, ex.up_bias]) for ex in weights]).astype(np.float32)
            tables.gate_up_bias = [self.ops.upload(np.ascontiguousarray(gate_up[:, lin.col:lin.col + lin.n]))
                                   for lin in routed[0].gate_up]
            tables.down_bias = self.ops.upload(np.stack([ex.down_bias for ex in weights]).astype(np.float32))
        return LayerLins(qkv=lins[0], o=lins[1][0], gate_up=[], down=None, experts=experts, tables=tables)

    def lm_head(self, model: Model) -> Lin:
        return self.fetch(StripGroup([model.lm_head], [lm_head_wkey()], 0))[0]

    def fetch(self, group: StripGroup) -> list[Lin]:
        """Device projections for ``group`` (fused into one when allowed), with their output columns."""
        strips, keys, fused_key = group
        cols = np.cumsum([0] + [s.n for s in strips[:-1]]).tolist()
        if self.weight_source is None:
            same = len({(s.k, s.group_size, s.bits) for s in strips}) == 1
            if same:
                codes = strips[0].codes if len(strips) == 1 else np.concatenate([s.codes for s in strips])
                scales = strips[0].scales if len(strips) == 1 else np.concatenate([s.scales for s in strips])
                return [self._own(codes, scales, strips[0], fused_key if len(strips) > 1 else keys[0])]
            return [self._own(s.codes, s.scales, s, key, col) for s, key, col in zip(strips, keys, cols)]
        if len(strips) > 1 and fusable(strips):
            dw = self.weight_source(fused_key, strips)
            if dw is not None:
                return [self._adopt(dw, sum(s.n for s in strips), 0, fused_key)]
        return [self._adopt(self.weight_source(key, [s]), s.n, col, key) for s, key, col in zip(strips, keys, cols)]

    def scratch(self, model: Model) -> tuple[int, int, int]:
        """``plan.gemv_scratch`` of every projection the model may run, fused or not, from shapes alone."""
        lins = []
        c = model.config
        groups = layer_groups(0, model.layers[0])
        routed = set(range(2, 2 + 2 * c.num_experts)) if model.layers[0].experts else set()
        for j, (strips, keys, fused_key) in enumerate(groups + [StripGroup([model.lm_head], [lm_head_wkey()], 0)]):
            n, k = sum(s.n for s in strips), strips[0].k
            members = [Lin(None, None, k, n, pad_n(n), strips[0].group_size, strips[0].bits,  # own bits: own plan
                           wkey=fused_key or keys[0])]
            members += [Lin(None, None, s.k, s.n, pad_n(s.n), s.group_size, s.bits, wkey=key)  # unfused members
                        for s, key in zip(strips, keys)]  # may have more tiles
            for lin in members:
                lin.ksplit = (plan_routed(lin, c.experts_per_token, self.sm_count, self.clusters) if j in routed
                              else self.plan(lin))
            lins += members
        return gemv_scratch(lins)

    def _own(self, codes: np.ndarray, scales: np.ndarray, like: StripCache, key: int, col: int = 0) -> Lin:
        n, k = codes.shape
        npad = pad_n(n)
        sc = np.zeros((k // like.group_size, npad), np.float32)
        sc[:, :n] = scales.T
        packed = pack_kmajor(codes, like.bits)
        lin = Lin(self.ops.upload(packed), self.ops.upload(sc), k, n, npad, like.group_size, like.bits, col,
                  wkey=key)
        lin.ksplit = self.plan(lin)
        return lin

    def _adopt(self, dw: Any, n: int, col: int, key: int) -> Lin:
        if dw is None:
            raise KestrelError(f"the weight cache returned no weight for wkey {key:#x}")
        lin = Lin.from_device_weight(dw, n, col, key)
        lin.ksplit = self.plan(lin)
        lin.device_weight = dw  # type: ignore[attr-defined]  # the tiled GEMM takes the cache's object
        return lin


def build_state(model: Model, ops: Any, projections: Projections, max_context: int, resident: bool) -> State:
    """``model``'s device state for contexts up to ``max_context``; ``resident``: fetch every projection now
    (else each layer's per step, through a residency window)."""
    c = model.config
    up, zeros = ops.upload, ops.zeros
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    nq, nkv = c.num_heads * hd, c.num_kv_heads * hd
    max_context = min(c.max_position, max_context)
    tables: dict[str, tuple[Any, Any]] = {}  # a RoPE's tables, uploaded once for every layer that has it
    layers = []
    for i, lw in enumerate(model.layers):
        key = repr(c.rope_of(i))
        if key not in tables:
            cos, sin = rope_tables(c, max_context, i)
            tables[key] = (up(cos), up(sin))
        bias = None
        if lw.q_bias is not None:
            bias = up(np.concatenate([lw.q_bias, lw.k_bias, lw.v_bias]).astype(np.float32))
        optional = [None if w is None else up(np.asarray(w, np.float32))
                    for w in (lw.q_norm, lw.k_norm, lw.post_attn_norm, lw.post_mlp_norm, lw.sinks, lw.o_bias,
                              lw.router_bias)]
        router = fold = None
        if lw.router is not None:
            gate = [] if lw.shared_expert_gate is None else [lw.shared_expert_gate.reshape(1, -1)]
            rows = np.concatenate([lw.router, *gate]).astype(np.float32)
            router = up(rows)
            # the fold chooses by its sums over h and o's input, before rms(h') is known: a router bias, added
            # after the division by it, changes their order, and o's bias is no term of those sums
            if lw.post_attn_norm is None and lw.o.group_size == 32 and lw.router_bias is None and lw.o_bias is None:
                fold = up(route_fold_weights(rows, lw.mlp_norm, lw.o))
        layers.append(Layer(up(lw.attn_norm), up(lw.mlp_norm), optional[0], optional[1], bias, *tables[key],
                            optional[2], optional[3], router=router, route_fold=fold, sinks=optional[4],
                            o_bias=optional[5], router_bias=optional[6]))
    emb = model.embedding
    t = PASS_ROWS
    st = State(model=model, config=c, max_context=max_context, emb_codes=up(emb.codes),
               emb_scales=up(emb.scales), emb_group=emb.group_size, final_norm=up(model.final_norm),
               layers=layers, lm_head=None,
               meta=zeros(1 + t, np.int32), h=zeros((t, d), np.float32),
               out=zeros((t, d), np.float32) if c.post_norms else None,
               post=(zeros((1, d), np.float32), zeros(4 * -(-d // TILE_N), np.float32))
               if c.post_norms and not c.is_moe and d <= POSTNORM_MAX_D else None,
               ssq=zeros(ssq_count(d), np.float32),
               qkv=zeros((t, nq + 2 * nkv), np.float32), q=zeros((t, nq), np.float32),
               attn=zeros((t, nq), np.float32),
               attend=(zeros(2 * nkv, np.uint64), zeros(c.num_heads + 2 * c.num_kv_heads, np.uint32)),
               gu=zeros((t, 2 * (c.shared_expert_intermediate_size if c.is_moe else f)), np.float32),
               moe=(zeros((t, d), np.float32), zeros((t * c.experts_per_token, d), np.float32),
                    zeros((t * c.experts_per_token, 2 * c.expert_intermediate_size), np.float32),
                    zeros((t * (c.experts_per_token + 1), d), np.float32)) if c.is_moe else None,
               route=(zeros((t, c.num_experts + 1), np.float32), zeros(t, np.int32),
                      zeros((t, c.experts_per_token), np.int32), zeros((t, c.experts_per_token + 1), np.float32))
               if c.is_moe else None,
               group=(zeros(t * c.experts_per_token, np.int32), zeros(t * c.experts_per_token, np.int32),
                      zeros((group_capacity(t * c.experts_per_token, c.num_experts, GROUPED_ROWS_FEW), 3),
                            np.int32))
               if c.is_moe else None,
               finish=(zeros(-(-c.vocab_size // FINISH_COLS), np.float32),
                       zeros(-(-c.vocab_size // FINISH_COLS), np.int32), zeros(1, np.int32)),
               argmax=(zeros((t, -(-c.vocab_size // FINISH_COLS)), np.float32),
                       zeros((t, -(-c.vocab_size // FINISH_COLS)), np.int32),
                       zeros((t, -(-c.vocab_size // FINISH_COLS)), np.int32), zeros(t, np.int32), zeros(t, np.int32)),
               tokens=ops.mapped_ints(TOKEN_RING), logits=zeros((1, c.vocab_size), np.float32),
               ssq_mid=zeros(ssq_count(d), np.float32) if c.is_moe else None)
    reserve = getattr(ops, "reserve", None)  # split-K and attention scratch (the numpy mirror needs none)
    if reserve is not None:
        part, counters, merge_tiles = projections.scratch(model)
        reserve(part, counters, attn_part_size(c.num_heads, c.head_dim), c.num_heads, merge_tiles)
    if resident:
        for i in range(c.num_layers):
            layers[i].weights = projections.layer(model, i)
        st.lm_head = projections.lm_head(model)
    ops.synchronize_device()  # weights a cache uploaded on another stream are complete
    return st


def pin_weights(st: State, pin: Callable[[int], None]) -> None:
    """Before a graph captures weight addresses: pin them in the cache (once per model state)."""
    if st.pinned:
        return
    keys = [lin.wkey for layer in st.layers if layer.weights for lin in layer.weights.all_lins()]
    if st.lm_head is not None:
        keys.append(st.lm_head.wkey)
    for key in keys:
        pin(key)
        st.pinned.append(key)
