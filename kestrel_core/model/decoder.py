"""The layer-by-layer host forward of the decoder (the model math every backend's forward must match).

One forward runs a batch: any number of sequences, each with new tokens at its own positions (a decode row,
or a chunk of a prompt). Every projection is one GEMM over all the batch's rows, offered through the
dispatcher with its wkey, so a backend that accepts GEMMs runs them and the host does the rest (norms,
RoPE, attention, SiLU) in float32 with the row-wise kernels of ``kernels``. A row's result does not depend on
the rest of the batch (see ``kernels``). The host keeps the keys and values in a paged ``KVPool``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from kestrel_core.contract import StripCache
from kestrel_core.dispatch import Offload
from kestrel_core.errors import KestrelError
from kestrel_core.model import kernels, paged_attention
from kestrel_core.model.config import ModelConfig
from kestrel_core.model.host_ops import GATED_ACTIVATIONS, NORMS, rmsnorm, sigmoid, swiglu_oai_mul
from kestrel_core.model.kv_pool import KVPool, SeqCache, bytes_per_position
from kestrel_core.model.rope import rope_tables, rotary_order
from kestrel_core.model.weights import PREFILL_CHUNK as PREFILL_CHUNK
from kestrel_core.model.weights import ExpertWeights, LayerWeights, Model
from kestrel_core.wkey import MLP_GROUPS, lm_head_wkey

CACHE_CHUNK = 256  # RoPE tables grow by this many positions at a time
MLA_NORM_EPS = np.float32(1e-6)  # the latent attention's q_a and kv_a RMSNorms: transformers' default, not the config's
# What the projections' inputs are: int8 per block (Q8_0, gemm_q8), float32 (gemm_f32), or "mixed": float32
# for the rows of a sequence's prompt and int8 for the tokens it generates (a row's mode follows from its
# position alone, so batching, chunking and recomputation still change no bit).
ACTIVATIONS = ("q8", "f32", "mixed")


class RopeTables:
    """cos/sin of absolute positions laid out for ``_rope``: [P, 2, hd/2] (HF's halves), extended on demand.

    ``sin`` carries rotate_half's sign ([-sin, sin]); the ``q_`` tables also carry the attention scale
    (``ModelConfig.attention_scale``) and each position's attention temperature (Ministral 3's), so the query needs
    no separate multiply. One per distinct RoPE of the model's layers (Gemma 3's sliding layers have their own
    base).
    """

    def __init__(self, config: ModelConfig, layer: int | None = None) -> None:
        self.config, self.layer = config, layer
        self.max_position = config.max_position
        self.scale = np.float32(config.attention_scale)
        half = config.attention_dims[1] // 2
        self.cos = self.sin = self.q_cos = self.q_sin = np.empty((0, 2, half), np.float32)

    def upto(self, n: int) -> None:
        if n <= len(self.cos):
            return
        size = min(max(n, len(self.cos) + CACHE_CHUNK), max(self.max_position, n))
        cos, sin = rope_tables(self.config, size, self.layer)  # [P, hd/2]
        self.cos = np.stack([cos, cos], axis=1)  # [P, 2, hd/2]
        self.sin = np.stack([-sin, sin], axis=1)
        scale = self.scale * attention_temperature(self.config, size)[:, None, None]  # [P, 1, 1]
        self.q_cos = self.cos * scale
        self.q_sin = self.sin * scale


def attention_temperature(config: ModelConfig, positions: int) -> np.ndarray:
    """float32 [P]: each position's query multiplier, 1 + scale * ln(1 + floor(p / length)) (Ministral 3's, as
    transformers' get_llama_4_attn_scale), or 1."""
    out = np.ones(positions, np.float32)
    if config.attn_temperature_scale:
        steps = np.arange(positions) // config.attn_temperature_length
        out[:] = 1 + config.attn_temperature_scale * np.log1p(steps)
    return out


@dataclass
class _Rows:
    """Where a step's rows [M] sit, as every layer's token mixer reads it."""

    precise: np.ndarray  # [M] bool: float32 activations (else int8 per block)
    row_seq: np.ndarray  # [M] each row's sequence in the batch
    tables: np.ndarray  # [S, max blocks] each sequence's KV blocks
    slots: np.ndarray  # [M] each row's KV pool slot (block * BLOCK_SIZE + offset)
    lengths: np.ndarray  # [M] keys each row sees (its position + 1)
    firsts: dict[int | None, np.ndarray]  # window -> [M] each row's first key
    tables_at: list[tuple[np.ndarray, ...]]  # per distinct RoPE: cos, sin, q_cos, q_sin [M, hd]
    state_slots: np.ndarray | None  # [M] each row's recurrent-state slot (models with recurrent layers)


class Decoder:
    """Runs batches of tokens through the model on the host, appending to their ``SeqCache``s."""

    def __init__(self, model: Model, offload: Offload, pool: KVPool | None = None,
                 activations: str = "q8") -> None:
        c = model.config
        if c.num_heads % c.num_kv_heads:
            raise KestrelError(f"num_heads={c.num_heads} is not a multiple of num_kv_heads={c.num_kv_heads}")
        if c.head_dim % 2:
            raise KestrelError(f"head_dim={c.head_dim} must be even for RoPE")
        if activations not in ACTIVATIONS:
            raise KestrelError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.model = model
        self.config = c
        self.offload = offload
        self.activations = activations
        self.pool = pool if pool is not None else KVPool.for_budget(c)
        self.ropes: list[RopeTables] = []  # one per distinct RoPE of the layers
        self.layer_rope: list[int] = []  # each layer's index into ropes
        seen: dict[str, int] = {}
        for i in range(c.num_layers):
            key = repr(c.rope_of(i))
            if key not in seen:
                seen[key] = len(self.ropes)
                self.ropes.append(RopeTables(c, i))
            self.layer_rope.append(seen[key])
        self.eps = np.float32(c.rms_norm_eps)
        self.norm = NORMS[c.norm_type]  # the decoder's own norms; a latent, linear or Mamba-2 one is an RMSNorm
        if c.is_mla:  # the cached key's dims in kestrel's order: its turned dims first (rope.rotary_order)
            self.latent_order = rotary_order(c.attention_dims[1], c.rotary, c.rope_interleaved)
        # a latent attention layer's key and value projections, float32 [H, dn, r] and [H, r, vd]: absorbed into the
        # query and the output, not multiplied into each cached position's key and value
        self.latent_up = [_latent_up(lw, c) if lw.is_mla else None for lw in model.layers]
        self.act = GATED_ACTIVATIONS[c.activation]
        if c.activation == "swiglu_oai":
            self.act = partial(swiglu_oai_mul, limit=np.float32(c.swiglu_limit), alpha=np.float32(c.swiglu_alpha))
        self.attn_softcap = np.float32(c.attn_softcap or 0)
        no_sinks = np.full(c.num_heads, -np.inf, np.float32)
        self.sinks = [no_sinks if lw.sinks is None else np.ascontiguousarray(lw.sinks, np.float32)
                      for lw in model.layers]
        # per layer, per projection group (LayerWeights.proj_groups): (each member's wkey, the fused weight's or
        # NO_CACHE)
        self.keys = [[(g.keys(i), g.fused_key(i)) for g, _ in lw.proj_groups()] for i, lw in enumerate(model.layers)]
        self.strips = [lw.groups() for lw in model.layers]  # the same groups' StripCaches, looked up once
        if c.mamba_groups:  # Mamba-2's norm is per group of channels, its weight over all of them
            self.unit_norm = np.ones(c.mamba_inner // c.mamba_groups, np.float32)
            self.no_conv_bias = np.zeros(c.mamba_conv_dim, np.float32)
        # layer -> its compiled form on the CPU backend (``Offload.host_dense_layer``) and that call's arrays, or None:
        # prepared on first use
        self.dense: dict[int, tuple[Any, tuple] | None] = {}
        self.experts: dict[int, Any] = {}  # layer -> its experts compiled on the CPU backend, or None (``_experts``)
        # per layer, per expert, per MLP_GROUPS entry: the same for each expert's weights
        self.expert_keys = [[[(g.keys(i, e), g.fused_key(i, e)) for g in MLP_GROUPS]  # the shared one: expert E
                             for e in range(len(lw.all_experts()))] for i, lw in enumerate(model.layers)]

    def new_cache(self) -> SeqCache:
        return self.pool.new_sequence()

    def forward(self, tokens: Sequence[int] | np.ndarray, cache: SeqCache, all_logits: bool = False,
                logits: bool = True) -> np.ndarray | None:
        """Append ``tokens`` [T] at positions cache.length.. of one sequence and return float32 logits.

        [T, vocab] if all_logits else [1, vocab] (the last token); None when ``logits`` is False (only the
        cache is filled, e.g. to catch up with tokens a device ran). Long inputs run in PREFILL_CHUNKs.
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not len(tokens):
            raise KestrelError("no tokens to run")
        outs = []
        for s in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[s:s + PREFILL_CHUNK]
            last = s + PREFILL_CHUNK >= len(tokens)
            rows = (len(chunk) if all_logits else int(last)) if logits else 0
            out = self.forward_batch([(cache, chunk, rows)])[0]
            if rows:
                outs.append(out)
        return np.concatenate(outs) if len(outs) > 1 else (outs[0] if outs else None)

    def forward_batch(self, batch: Sequence[tuple[SeqCache, np.ndarray, int]], hidden: bool = False
                      ) -> list[np.ndarray]:
        """One step over several sequences: each (cache, tokens [T_i], logit_rows) appends its tokens at
        cache.length.. and gets the float32 logits of its last ``logit_rows`` rows, [logit_rows, vocab]; with
        ``hidden``, their final hidden states after the final norm instead, [logit_rows, D] (embeddings)."""
        c = self.config
        seqs = [cache for cache, _, _ in batch]
        if len({id(s) for s in seqs}) != len(seqs):
            raise KestrelError("a sequence appears twice in one batch")
        tokens = [np.asarray(t, dtype=np.int64).reshape(-1) for _, t, _ in batch]
        for cache, toks, (_, _, rows) in zip(seqs, tokens, batch):
            if not len(toks):
                raise KestrelError("no tokens to run")
            if toks.min() < 0 or toks.max() >= c.vocab_size:
                raise KestrelError(f"token id out of range [0, {c.vocab_size})")
            if not 0 <= rows <= len(toks):
                raise KestrelError(f"logit rows {rows} outside [0, {len(toks)}]")
            end = cache.length + len(toks)
            if end > c.max_position:
                raise KestrelError(f"the sequence needs {end} positions; the model's context is {c.max_position}")
        for cache, toks in zip(seqs, tokens):
            if not self.pool.reserve(cache, cache.length + len(toks)):
                raise KestrelError(f"the KV cache is full ({self.pool.capacity} positions of "
                                   f"{bytes_per_position(c, self.pool.kv_type)} bytes; a larger budget holds more)")
        with np.errstate(over="ignore"):  # exp(-x) of SiLU overflows to inf for very negative x: the limit
            h, precise = self._layers(seqs, tokens)
        outs: list[np.ndarray] = []
        want = []
        row = 0
        for toks, (_, _, rows) in zip(tokens, batch):
            row += len(toks)
            want.extend(range(row - rows, row))
        if hidden:
            logits = self.norm(h[want], self.model.final_norm, self.eps)  # [R, D]
        else:
            logits = self._logits(h[want], precise[want]) if want else np.empty((0, c.vocab_size), np.float32)
        at = 0
        for _, _, rows in batch:
            outs.append(logits[at:at + rows])
            at += rows
        for cache, toks in zip(seqs, tokens):
            cache.length += len(toks)
        return outs

    def _logits(self, h: np.ndarray, precise: np.ndarray) -> np.ndarray:
        x = self.norm(h, self.model.final_norm, self.eps)  # [R, D]
        logits = self._linear(x, precise, (self.model.lm_head,), (lm_head_wkey(),), 0)[0]  # [R, vocab]
        if self.config.logits_scaling != 1.0:  # Granite, Cohere
            logits = logits / np.float32(self.config.logits_scaling)
        cap = self.config.final_softcap
        if cap:  # Gemma 2
            logits = np.tanh(logits / np.float32(cap)) * np.float32(cap)
        return logits

    def _linear(self, x: np.ndarray, precise: np.ndarray, weights: Sequence[StripCache], keys: Sequence[int],
                fused: int) -> list[np.ndarray]:
        """x float32 [M, K] times each weight -> [M, N_i]: rows where ``precise`` [M] is set through gemm_f32,
        the others quantized per block through gemm_q8 (one fused offer for several weights)."""
        off = self.offload
        n_precise = int(precise.sum())
        if n_precise == 0:
            if len(weights) == 1:
                return [off.linear(x, weights[0], keys[0])]
            return off.linear_fused(x, weights, keys, fused)
        if n_precise == len(x):
            return [off.gemm_f32(x, w, k) for w, k in zip(weights, keys)]
        outs = [np.empty((len(x), w.n), np.float32) for w in weights]
        for out, got in zip(outs, self._linear(x[precise], precise[precise], weights, keys, fused)):
            out[precise] = got
        rest = ~precise
        for out, got in zip(outs, self._linear(x[rest], precise[rest], weights, keys, fused)):
            out[rest] = got
        return outs

    def _layers(self, seqs: list[SeqCache], tokens: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """All layers over the batch's rows: the final hidden state [M, D] (M = all new tokens) and which rows
        ran with float32 activations [M]."""
        c, pool = self.config, self.pool
        bs = pool.block_size
        positions = np.concatenate([np.arange(s.length, s.length + len(t)) for s, t in zip(seqs, tokens)])
        m = len(positions)
        row_seq = np.repeat(np.arange(len(seqs), dtype=np.int64), [len(t) for t in tokens])  # [M]
        tables = np.zeros((len(seqs), max(len(s.blocks) for s in seqs)), np.int64)  # [S, max blocks]
        for i, s in enumerate(seqs):
            tables[i, :len(s.blocks)] = s.blocks
        lengths = positions + 1  # [M] keys each row sees (its own position included)
        firsts = {}  # window -> [M] each row's first key
        for w in {c.window_of(i) for i in range(c.num_layers)}:
            firsts[w] = np.maximum(lengths - w, 0) if w else np.zeros(m, np.int64)
        tables_at = []  # per distinct RoPE: cos, sin, q_cos, q_sin [M, hd] (the [2, hd/2] halves in a row)
        for rope in self.ropes:
            rope.upto(int(positions.max()) + 1)
            tables_at.append(tuple(t[positions].reshape(m, c.attention_dims[1])
                                   for t in (rope.cos, rope.sin, rope.q_cos, rope.q_sin)))
        if self.activations == "mixed":
            prompt_len = np.repeat(np.array([s.prompt_len for s in seqs], np.int64), [len(t) for t in tokens])
            precise = positions < prompt_len  # [M]
        else:
            precise = np.full(m, self.activations == "f32")
        rows = _Rows(precise, row_seq, tables, slots=tables[row_seq, positions // bs] * bs + positions % bs,
                     lengths=lengths, firsts=firsts, tables_at=tables_at,
                     state_slots=(np.array([pool.state_slot(s) for s in seqs], np.int64)[row_seq]
                                  if pool.states is not None else None))
        h = self.model.embedding.dequantize(np.concatenate(tokens))  # [M, D]
        if c.embed_scale != 1.0:
            h *= np.float32(c.embed_scale)
        quantized = not precise.any()
        for i, lw in enumerate(self.model.layers):
            self.offload.layer_boundary(i)
            dense = self._dense(i) if quantized else None
            if dense is None or not self._run_dense(i, *dense, h, rows):
                x = h.copy() if lw.attn_norm is None else self.norm(h, lw.attn_norm, self.eps)  # [M, D]
                mix = (self._linear_attention if lw.is_linear else self._short_conv if lw.is_conv
                       else self._mamba if lw.is_mamba else self._latent_attention if lw.is_mla else self._attention)
                h += self._residual(mix(i, lw, x, rows), lw.post_attn_norm)
            elif not lw.experts:
                continue  # the whole layer ran
            if not c.parallel_block:  # else (Cohere) the MLP reads the attention's input x too
                x = h.copy() if lw.mlp_norm is None else self.norm(h, lw.mlp_norm, self.eps)
            out = self._moe(i, lw, x, precise) if lw.experts else self._mlp(x, precise, self.strips[i][-2:],
                                                                             self.keys[i][-2:])
            h += self._residual(out, lw.post_mlp_norm)
        return h, precise

    def _dense(self, i: int) -> tuple[Any, tuple] | None:
        """Layer ``i`` compiled whole on the CPU backend, with its norms, biases and head norms as float32, where it is
        a plain attention layer (a norm before the attention, and before the MLP or the MLP beside the attention as
        Cohere's; q/k norms per head) with a SiLU or GELU MLP (what ``_attention`` and ``_mlp`` run for it, the same
        bits), or its attention alone where the MLP is a mixture of experts after it; else None, and the layer runs op
        by op."""
        if i not in self.dense:
            lw, c = self.model.layers[i], self.config
            arrays = (lw.attn_norm, lw.mlp_norm, lw.post_attn_norm, lw.post_mlp_norm, lw.q_bias, lw.k_bias, lw.v_bias,
                      lw.q_norm, lw.k_norm)
            plain = (lw.q is not None and (lw.gate is not None or bool(lw.experts)) and not lw.is_mla
                     and lw.attn_gate is None and lw.attn_norm is not None
                     and (lw.mlp_norm is not None or (c.parallel_block and not lw.experts))
                     and lw.o_bias is None and not c.qk_norm_full and c.activation in ("silu", "gelu_tanh")
                     and all(a is None or a.dtype == np.float32 for a in arrays))
            layer = self.offload.host_dense_layer([keys for keys, _ in self.keys[i]], self.strips[i]) if plain else None
            self.dense[i] = None if layer is None else (layer, tuple(
                None if a is None else np.ascontiguousarray(a) for a in arrays))
        return self.dense[i]

    def _run_dense(self, i: int, layer: Any, arrays: tuple, h: np.ndarray, rows: _Rows) -> bool:
        """Layer ``i`` on h [M, D] in place in one compiled call (``_dense``), its keys and values written to the
        pool; False, nothing done, where it cannot compile (every layer then runs op by op)."""
        c = self.config
        cos, sin, q_cos, q_sin = rows.tables_at[self.layer_rope[i]]
        heads = (c.num_heads, c.num_kv_heads, c.head_dim,
                 paged_attention.attend_heads(len(h), c.num_heads, c.num_kv_heads))
        ran = layer.run(h, arrays[:4], self.eps, c.residual_scale, c.activation == "gelu_tanh", c.norm_type == "layer",
                        c.parallel_block, arrays[4:7], arrays[7:], heads,
                        (*self.pool.layer_arrays(i), rows.slots, cos, sin, rows.tables, rows.row_seq,
                         rows.firsts[c.window_of(i)], rows.lengths, q_cos, q_sin, self.attn_softcap, self.sinks[i]))
        if not ran:
            self.dense = {j: None for j in range(c.num_layers)}
            return False
        self.offload.count_host_gemms(layer.gemms)
        return True

    def _attention(self, i: int, lw: LayerWeights, x: np.ndarray, rows: _Rows) -> np.ndarray:
        """Layer ``i``'s attention on x [M, D]: its keys and values written to the pool, [M, D] out."""
        c, m = self.config, len(x)
        hd, n_heads, n_kv = c.head_dim, c.num_heads, c.num_kv_heads
        (qkv_w, o_w), (qkv_keys, o_keys) = self.strips[i][:2], self.keys[i][:2]
        q, k, v, *gate = self._linear(x, rows.precise, qkv_w, *qkv_keys)
        if lw.q_bias is not None:
            q = q + lw.q_bias
            k = k + lw.k_bias
            v = v + lw.v_bias
        if c.qk_norm_full:  # OLMo 2: over each row's whole projection
            q, k = self.norm(q, lw.q_norm, self.eps), self.norm(k, lw.k_norm, self.eps)
        q = q.reshape(m, n_heads, hd)  # [M, H, hd]
        k = k.reshape(m, n_kv, hd)
        v = np.ascontiguousarray(v).reshape(m, n_kv, hd)
        if lw.q_norm is not None and not c.qk_norm_full:
            q, k = self._head_norm(q, lw.q_norm), self._head_norm(k, lw.k_norm)
        attn = self._attend(i, q, k, v, rows)  # [M, H*hd]
        if gate:  # Qwen3.5's gated attention
            attn *= sigmoid(gate[0])
        out = self._linear(attn, rows.precise, o_w, *o_keys)[0]  # [M, D]
        if lw.o_bias is not None:
            out += lw.o_bias
        return out

    def _head_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """Each head of x [M, heads, hd] normed over its dims: by one weight [hd] for every head, or (Cohere's
        qk_norm_heads) by each head's own, weight [heads * hd] (the same bits: the kernel's x * inv * 1, times w)."""
        if not self.config.qk_norm_heads:
            return self.norm(x, weight, self.eps)
        unit = np.ones(x.shape[-1], np.float32)
        return self.norm(x, unit, self.eps) * weight.reshape(x.shape[1:])

    def _attend(self, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, rows: _Rows) -> np.ndarray:
        """Layer ``i``'s keys k [M, KV, hd] and values v [M, KV, vd] written to the pool, RoPE turning them and the
        queries q [M, H, hd]; the attention's output [M, H*vd] (``ModelConfig.attention_dims``)."""
        c, pool = self.config, self.pool
        cos, sin, q_cos, q_sin = rows.tables_at[self.layer_rope[i]]
        attn = np.empty((len(q), c.num_heads * c.attention_dims[2]), np.float32)  # [M, H*vd]
        kt, vc, ks, vs = pool.layer_arrays(i)
        paged_attention.rope_write(np.ascontiguousarray(k), np.ascontiguousarray(v), kt, vc, ks, vs, rows.slots, cos,
                                   sin)
        paged_attention.attend(np.ascontiguousarray(q), kt, vc, ks, vs, rows.tables, rows.row_seq,
                               rows.firsts[c.window_of(i)], rows.lengths, q_cos, q_sin, self.attn_softcap,
                               self.sinks[i], paged_attention.attend_heads(q.shape[0], q.shape[1], kt.shape[1]), attn)
        return attn

    def _latent_attention(self, i: int, lw: LayerWeights, x: np.ndarray, rows: _Rows) -> np.ndarray:
        """Layer ``i``'s multi-head latent attention on x [M, D] (DeepSeek-V2/V3) as plain attention of one KV head over
        the cached latent c (RMSNormed, r dims) beside the RoPE key k_pe all heads share: head h's key q_nope .
        W_uk[h] c + q_pe . k_pe is the query's q_nope W_uk[h] (r dims) beside q_pe against [c, k_pe], and its value
        W_uv[h] c is W_uv[h] applied to the attention's sum of c; [M, D] out."""
        c, m = self.config, len(x)
        h, r, turned = c.num_heads, c.kv_lora_rank, c.rotary
        dn = c.head_dim - turned
        strips, keys = self.strips[i], self.keys[i]
        q, kva = self._linear(x, rows.precise, strips[0], *keys[0])  # [M, q_lora or H*hd], [M, r + rotary]
        if lw.q_a is not None:
            q = self._linear(rmsnorm(q, lw.q_a_norm, MLA_NORM_EPS), rows.precise, strips[1], *keys[1])[0]
        q = q.reshape(m, h, c.head_dim)  # [M, H, dn + rotary]: the checkpoint's order, the turned dims last
        w_uk, w_uv = self.latent_up[i]
        latent = rmsnorm(kva[:, :r], lw.kv_a_norm, MLA_NORM_EPS)  # [M, r]
        q_lat = np.empty((m, h, r), np.float32)
        kernels.heads_matmul(np.ascontiguousarray(q[:, :, :dn]), w_uk, q_lat)  # [M, H, r]: q_nope W_uk[h]
        query = np.concatenate([q[:, :, dn:], q_lat], axis=2)  # [M, H, rotary + r]
        key = np.concatenate([kva[:, r:], latent], axis=1)[:, None]  # [M, 1, rotary + r]
        order = self.latent_order
        lat = self._attend(i, query[:, :, order], key[:, :, order], latent[:, None], rows)  # [M, H*r]
        attn = np.empty((m, h, c.value_dim), np.float32)
        kernels.heads_matmul(lat.reshape(m, h, r), w_uv, attn)  # [M, H, vd]: W_uv[h] applied to each head's sum of c
        attn = attn.reshape(m, -1)  # [M, H*vd]
        o = 2 if lw.q_a is not None else 1  # O's group (wkey.MLA_GROUPS, MLA_DIRECT_GROUPS)
        return self._linear(np.ascontiguousarray(attn), rows.precise, strips[o], *keys[o])[0]

    def _linear_attention(self, i: int, lw: LayerWeights, x: np.ndarray, rows: _Rows) -> np.ndarray:
        """Layer ``i``'s Gated DeltaNet on x [M, D] (``kernels.gated_delta``, each sequence's recurrent state
        updated in place), its output normed per value head and gated by silu(z), projected: [M, D]."""
        c, states = self.config, self.pool.states
        assert states is not None
        (in_w, o_w), (in_keys, o_keys) = self.strips[i][:2], self.keys[i][:2]
        qkv, z, beta, alpha = self._linear(x, rows.precise, in_w, *in_keys)  # [M, C], [M, Hv*dv], [M, Hv] x2
        m, dv = len(x), c.linear_value_dim
        core = np.empty((m, c.linear_value_heads * dv), np.float32)  # [M, Hv*dv]
        kernels.gated_delta(np.ascontiguousarray(qkv), np.ascontiguousarray(beta), np.ascontiguousarray(alpha),
                            lw.conv, lw.lin_decay, lw.lin_dt_bias, states.conv[i], states.ssm[i], rows.state_slots,
                            c.linear_key_heads, c.linear_key_dim, dv, core)
        core = rmsnorm(core.reshape(-1, dv), lw.lin_norm, self.eps).reshape(m, -1)
        core *= np.ascontiguousarray(z) * sigmoid(z)
        return self._linear(core, rows.precise, o_w, *o_keys)[0]

    def _short_conv(self, i: int, lw: LayerWeights, x: np.ndarray, rows: _Rows) -> np.ndarray:
        """Layer ``i``'s gated short convolution on x [M, D] (LFM2): B, C, x' = in(x); out(C * conv(B * x'))
        (``kernels.short_conv``, each sequence's last inputs updated in place): [M, D]."""
        states = self.pool.states
        assert states is not None
        (in_w, o_w), (in_keys, o_keys) = self.strips[i][:2], self.keys[i][:2]
        bcx = self._linear(x, rows.precise, in_w, *in_keys)[0]  # [M, 3D]
        y = np.empty((len(x), self.config.hidden_size), np.float32)  # [M, D]
        kernels.short_conv(np.ascontiguousarray(bcx), lw.conv, states.conv[i], rows.state_slots, y)
        return self._linear(y, rows.precise, o_w, *o_keys)[0]

    def _mamba(self, i: int, lw: LayerWeights, x: np.ndarray, rows: _Rows) -> np.ndarray:
        """Layer ``i``'s Mamba-2 on x [M, D] (Granite 4.0-H): z, x|B|C, dt = in(x); y = the selective scan
        (``kernels.mamba2``, each sequence's state updated in place); y * silu(z) normed per group, projected."""
        c, states = self.config, self.pool.states
        assert states is not None
        (in_w, o_w), (in_keys, o_keys) = self.strips[i][:2], self.keys[i][:2]
        proj = self._linear(x, rows.precise, in_w, *in_keys)[0]  # [M, inner + C + heads]
        inner, m = c.mamba_inner, len(x)
        y = np.empty((m, inner), np.float32)  # [M, inner]
        bias = lw.conv_bias if lw.conv_bias is not None else self.no_conv_bias
        kernels.mamba2(np.ascontiguousarray(proj), lw.conv, bias, lw.ssm_a, lw.ssm_dt_bias, lw.ssm_d,
                       states.conv[i], states.ssm[i], rows.state_slots, c.mamba_groups, c.mamba_state, y)
        z = np.ascontiguousarray(proj[:, :inner])
        y *= z * sigmoid(z)
        group = inner // c.mamba_groups
        y = rmsnorm(y.reshape(-1, group), self.unit_norm, self.eps).reshape(m, inner) * lw.ssm_norm
        return self._linear(y, rows.precise, o_w, *o_keys)[0]

    def _residual(self, out: np.ndarray, post_norm: np.ndarray | None) -> np.ndarray:
        """What a block adds to the residual stream: its output, normed after (Gemma) or scaled (Granite)."""
        if post_norm is not None:
            out = self.norm(out, post_norm, self.eps)
        if self.config.residual_scale != 1.0:
            out *= np.float32(self.config.residual_scale)
        return out

    def _mlp(self, x: np.ndarray, precise: np.ndarray, groups: Sequence[tuple[StripCache, ...]],
             keys: Sequence[tuple[tuple[int, ...], int]], expert: ExpertWeights | None = None) -> np.ndarray:
        """down(act(gate(x)) * up(x)) [M, D] of x [M, D]: a dense layer's MLP or one expert's (with its biases,
        gpt-oss)."""
        (gate_up_w, down_w), (gate_up_keys, down_keys) = groups, keys
        gate, up = self._linear(x, precise, gate_up_w, *gate_up_keys)  # [M, F]
        gate, up = np.ascontiguousarray(gate), np.ascontiguousarray(up)
        if expert is not None and expert.gate_bias is not None:
            gate += expert.gate_bias
            up += expert.up_bias
        out = self._linear(self.act(gate, up), precise, down_w, *down_keys)[0]
        if expert is not None and expert.down_bias is not None:
            out += expert.down_bias
        return out

    def _experts(self, i: int) -> Any:
        """Layer ``i``'s experts compiled into one call on the CPU backend (``Offload.host_experts``), where they are
        SiLU or GELU MLPs without biases (what ``_mlp`` runs for each, the same bits); else None: op by op."""
        if i not in self.experts:
            lw, c = self.model.layers[i], self.config
            every = lw.all_experts()
            plain = c.activation in ("silu", "gelu_tanh") and all(
                e.gate_bias is None and e.up_bias is None and e.down_bias is None for e in every)
            self.experts[i] = self.offload.host_experts(
                [[keys for keys, _ in self.expert_keys[i][e]] for e in range(len(every))],
                [e.groups() for e in every], lw.shared_expert is not None) if plain else None
        return self.experts[i]

    def _moe(self, i: int, lw: LayerWeights, x: np.ndarray, precise: np.ndarray) -> np.ndarray:
        """The mixture of experts of layer ``i`` on x [M, D]: each row through its top-k experts (``route``),
        weighted and summed in expert order, then the shared expert, scaled by its sigmoid gate where it has one
        (Qwen2-MoE); a row's result does not depend on the other rows."""
        c = self.config
        x = np.ascontiguousarray(x)
        top, weights = route(x, lw, c)
        compiled = None if precise.any() else self._experts(i)
        if compiled is not None:
            gate = lw.shared_expert_gate
            scale = None if gate is None else shared_expert_scale(x, gate)[:, 0]
            out = compiled.run(x, top, weights, scale, c.activation == "gelu_tanh")
            if out is not None:
                used = len(np.unique(top)) + (lw.shared_expert is not None)
                self.offload.count_host_gemms(3 * used)  # gate, up and down of each expert that ran
                return out
            self.experts = {j: None for j in range(c.num_layers)}
        out = np.zeros_like(x)  # [M, D]
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            expert = lw.experts[e]
            y = self._mlp(x[rows], precise[rows], expert.groups(), self.expert_keys[i][e], expert)  # [m_e, D]
            out[rows] += y * weights[rows, slot][:, None]
        if lw.shared_expert is not None:
            y = self._mlp(x, precise, lw.shared_expert.groups(), self.expert_keys[i][c.num_experts])
            out += y if lw.shared_expert_gate is None else y * shared_expert_scale(x, lw.shared_expert_gate)
        return out


def _latent_up(lw: LayerWeights, c: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """A latent attention layer's kv_b [H*(dn + vd), r] as float32 factors for ``kernels.heads_matmul``: W_uk [H, dn,
    r] (the query's q_nope W_uk[h]) and W_uv transposed [H, r, vd] (the output's lat W_uv[h]^T)."""
    up = lw.kv_b.dequantize().reshape(c.num_heads, -1, c.kv_lora_rank)  # [H, dn + vd, r]
    dn = c.head_dim - c.rotary
    return np.ascontiguousarray(up[:, :dn]), np.ascontiguousarray(up[:, dn:].transpose(0, 2, 1))


def route(x: np.ndarray, lw: LayerWeights, c: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Each row of x [M, D]'s top-k experts [M, k] and their weights [M, k] by layer ``lw``'s router.

    The logits (plus gpt-oss's router bias) score each expert: softmax over all of them, or each one's sigmoid.
    The choice is by the scores plus the choice bias (DeepSeek-V3, GLM-4.5, ERNIE 4.5), among the experts of the
    router_topk_groups groups whose two best choice scores sum highest. The weights are the chosen scores,
    renormalised over the k if norm_topk_prob (for a softmax, the softmax of the k logits, as gpt-oss computes
    it), times routed_scaling. Ties: the lower expert."""
    logits = router_logits(x, lw)  # [M, E]
    if c.router_scoring == "sigmoid":
        scores = sigmoid(logits)
    else:
        scores = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores /= scores.sum(axis=1, keepdims=True)
    choice = scores if lw.router_choice_bias is None else scores + lw.router_choice_bias
    if c.router_groups > 1:
        grouped = choice.reshape(len(x), c.router_groups, -1)  # [M, G, E / G]
        group_scores = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)  # [M, G]
        kept = np.argsort(-group_scores, axis=1, kind="stable")[:, :c.router_topk_groups]
        mask = np.zeros(group_scores.shape, bool)
        np.put_along_axis(mask, kept, True, axis=1)
        choice = np.where(mask[:, :, None], grouped, -np.inf).reshape(choice.shape)
    top = np.argsort(-choice, axis=1, kind="stable")[:, :c.experts_per_token]
    weights = np.take_along_axis(scores, top, axis=1)
    if c.norm_topk_prob:
        weights /= weights.sum(axis=1, keepdims=True)
    if c.routed_scaling != 1.0:
        weights *= np.float32(c.routed_scaling)
    return top, weights


def router_logits(x: np.ndarray, lw: LayerWeights) -> np.ndarray:
    """Layer ``lw``'s router logits [M, E] of x [M, D], gpt-oss's router bias added."""
    logits = np.empty((len(x), len(lw.router)), np.float32)
    kernels.rows_dot(np.ascontiguousarray(x), lw.router, logits)
    if lw.router_bias is not None:
        logits += lw.router_bias
    return logits


def shared_expert_scale(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """Qwen2-MoE's sigmoid(x . gate) [M, 1] that scales the shared expert's output."""
    g = np.empty((len(x), 1), np.float32)
    kernels.rows_dot(np.ascontiguousarray(x), gate, g)
    return np.float32(1) / (np.float32(1) + np.exp(-g))
