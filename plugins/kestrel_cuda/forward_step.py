"""One pass of the decoder over a step's rows on the device, kernel by kernel: what ``DeviceForward`` runs
eagerly or captures in a graph. The layers' math is kestrel_core.model.decoder's; a mixture of experts' MLP is
forward_moe.py's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kestrel_cuda import paged
from kestrel_cuda.forward_moe import moe_mlp, o_routed
from kestrel_cuda.forward_state import Projections, State
from kestrel_cuda.plan import (
    EPI_ADD,
    EPI_STORE,
    NO_SWIGLU,
    PRO_PLAIN,
    PRO_POSTNORM,
    PRO_RMSNORM,
    TILE_N,
    AttendFold,
    Lin,
    PostNorm,
    QkvRope,
    gate_prologue,
    head_scale,
)


@dataclass
class Stepper:
    """The launches of a step over ``ops`` (DeviceForward's switches: see its module docstring)."""

    ops: Any
    projections: Projections
    layer_boundary: Callable[[int], None] | None
    fuse_rope: bool
    fuse_attention: bool

    def run(self, st: State, seq_kv: Any, m: int, rows: int, pool: paged.Paged | None = None) -> None:
        """Every kernel of one pass over rows [0, m) at positions meta[0]..; logits of the last ``rows``, with the
        KV cache ``seq_kv`` (float16 [L, 2, KV, cap, hd]). With ``pool``: rows of several sequences in the paged
        pool (paged.py), logits of ``rows`` rows."""
        ops, c = self.ops, st.config
        eps = float(c.rms_norm_eps)
        hd, heads, kv_heads, f = c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size
        scale = head_scale(hd) if c.query_scale is None else float(np.float32(c.query_scale))
        act, swiglu = gate_prologue(c)
        softcap = float(c.attn_softcap or 0)  # Gemma 2's scores, tanh-capped before the softmax (0: none)
        # Granite's residual multiplier scales the o and down projections' sums in the residual add's epilogue,
        # not their weights' scales at load: the weight cache shares those with the GEMM hooks, whose host
        # decoder multiplies the outputs itself. The norm fold's GEMM adds into h without it, so it is off then.
        rs = float(c.residual_scale)
        h = st.h[:m]
        ssq = st.ssq if m == 1 else None  # h's tile sums: left by its writers, read by the norms
        # Gemma's post-norms at M = 1 fold into the GEMVs around them (plan.PostNorm), the residual stream moving
        # between the rows of ``fold``: ``pending`` is one the next normed GEMV applies
        gather = pool is not None and pool.index is not None
        fold = (st.h[:1], st.post[0]) if st.post is not None and m == 1 and not gather else None
        pending: PostNorm | None = None
        h = fold[0] if fold is not None else h
        h_rows = (h, st.h[1:2]) if m == 1 and fold is None and c.is_moe else None  # forward_moe.o_routed's
        normed = False  # h's rows quantized for the next normed GEMM by the residual add before it (the norm fold)
        ops.embed(st.emb_codes, st.emb_scales, st.emb_group, st.ids, h, ssq, c.embed_scale)
        for i, layer in enumerate(st.layers):
            if self.layer_boundary is not None:
                self.layer_boundary(i)
            w = layer.weights or self.projections.layer(st.model, i)
            kv = pool.kv if pool is not None else seq_kv
            kc, vc = kv[i, 0], kv[i, 1]
            at = {} if pool is None else {"rows": pool.rows, "tables": pool.tables}
            rope = None  # qkv_rope's work in the q|k|v GEMV's epilogue: one head per column tile
            if m == 1 and pool is None and self.fuse_rope and hd == TILE_N and len(w.qkv) == 1:
                # and decode attention, in its clusters; not with soft caps or sinks, which its instances (64
                # registers a thread) have no room for: ptxas spilled 4-16 bytes in two of them with a cap in the loop
                attend = None
                if (self.fuse_attention and not softcap and layer.sinks is None
                        and ops.attend_folds(w.qkv[0], kc.shape[1])):
                    attend = AttendFold(st.attn[:1], scale, c.window_of(i) or 0, *st.attend)
                rope = QkvRope(heads, kv_heads, layer.q_norm, layer.k_norm, eps, layer.cos, layer.sin, st.meta,
                               st.q[:1], kc, vc, attend)
            for lin in w.qkv:
                bias = None if layer.qkv_bias is None else layer.qkv_bias[lin.col:lin.col + lin.n]
                self._normed(lin, h, layer.attn_norm, eps, st.qkv[:m, lin.col:lin.col + lin.n], bias, ssq, pending,
                             rope, normed)
            if pending is not None:  # applied: the residual is now the row it stored
                h, pending = pending.h_next, None
            if rope is None:
                ops.qkv_rope(st.qkv[:m], heads, kv_heads, hd, layer.q_norm, layer.k_norm, eps, layer.cos, layer.sin,
                             st.meta, st.q[:m], kc, vc, **at)
            quantized = False
            if rope is None or rope.attend is None:
                quantized = ops.attention(st.q[:m], kc, vc, heads, hd, scale, st.meta, st.attn[:m], **at,
                                          window=c.window_of(i) or 0, quantize_for=w.o if fold is None else None,
                                          softcap=softcap, sinks=layer.sinks)
            normed = (not w.experts and layer.post_attn_norm is None and rs == 1.0 and layer.o_bias is None
                      and ops.norm_fold(m, w.o, w.gate_up))
            route, h = o_routed(ops, st, layer, w.o, h, h_rows, eps) if h_rows is not None else (None, h)
            if route is None:
                pending = self._residual(w.o, st.attn[:m], PRO_PLAIN, 0, layer.post_attn_norm, st, h, m, eps, ssq,
                                         fold, quantized, layer.mlp_norm if normed else None, rs, layer.o_bias)
            if w.experts:
                moe_mlp(self.ops, st, i, w, h, eps, ssq, route)
                continue
            for lin in w.gate_up:
                self._normed(lin, h, layer.mlp_norm, eps, st.gu[:m, lin.col:lin.col + lin.n], None, ssq, pending,
                             prenormed=normed)
            if pending is not None:
                h, pending = pending.h_next, None
            after = st.layers[i + 1] if i + 1 < len(st.layers) else None
            normed = (after is not None and after.weights is not None and layer.post_mlp_norm is None and rs == 1.0
                      and ops.norm_fold(m, w.down, after.weights.qkv))
            pending = self._residual(w.down, st.gu[:m], act, f, layer.post_mlp_norm, st, h, m, eps, ssq, fold,
                                     fold_norm=after.attn_norm if normed else None, add_scale=rs, swiglu=swiglu)
        if rows:
            lm = st.lm_head or self.projections.lm_head(st.model)
            out = st.logits_all[:rows] if rows > 1 else st.logits
            src = h[m - rows:m]
            if gather:
                ops.gather_rows(h, pool.index[:rows], pool.hsel[:rows])
                src = pool.hsel[:rows]
            self._normed(lm, src, st.final_norm, eps, out, None, ssq, pending)
            if c.logits_scaling != 1.0 or c.final_softcap:  # Granite's divisor, Gemma 2's cap: before any argmax
                ops.finish_logits(out, float(c.logits_scaling), float(c.final_softcap or 0))
            if m == 1 and pool is None:  # the next step's token and position, on the device (pipelined greedy)
                ops.greedy_token(st.logits, st.finish, st.meta, int(seq_kv.shape[3]), st.tokens)

    def _normed(self, lin: Lin, h: Any, norm: Any, eps: float, y: Any, bias: Any, ssq: Any,
                pending: PostNorm | None, rope: QkvRope | None = None, prenormed: bool = False) -> None:
        """y = lin(rmsnorm(h, norm)) (+ bias), with a pending post-norm applied to h first; ``prenormed``: the
        residual add before it quantized h's rows for it (the norm fold)."""
        if pending is None:
            self.ops.gemv(lin, h, PRO_RMSNORM, norm, eps, 0, y, EPI_STORE, bias, ssq_in=ssq, rope=rope,
                          prenormed=prenormed)
        else:
            self.ops.gemv(lin, h, PRO_POSTNORM, norm, eps, 0, y, EPI_STORE, bias, rope=rope, post=pending)

    def _residual(self, lin: Lin, x: Any, pro: int, xoff: int, post_norm: Any, st: State, h: Any, m: int,
                  eps: float, ssq: Any, fold: tuple[Any, Any] | None, quantized: bool = False,
                  fold_norm: Any = None, add_scale: float = 1.0, bias: Any = None,
                  swiglu: tuple[float, float] = NO_SWIGLU) -> PostNorm | None:
        """h += (lin(prologue(x)) + bias) * add_scale, or h += rmsnorm(lin(prologue(x)), post_norm) (Gemma's
        post-norms, no bias, add_scale 1: forward_state.unsupported_reason): with
        ``fold`` (the two residual rows, h one of them) left to the next normed GEMV, which stores the sum in the
        other row, and returned. ``quantized``: x's codes are written already; ``fold_norm``: the next norm's
        weights, h's new rows quantized for the normed GEMMs after it (ops.gemv)."""
        if post_norm is None:
            self.ops.gemv(lin, x, pro, None, eps, xoff, h, EPI_ADD, bias, ssq_out=ssq, quantized=quantized,
                          fold_norm=fold_norm, add_scale=add_scale, swiglu=swiglu)
            return None
        if add_scale != 1.0 or bias is not None:
            raise ValueError("a residual multiplier or a bias with post-norms: forward_state.unsupported_reason "
                             "declines them")
        if fold is not None:
            other = fold[1] if h is fold[0] else fold[0]
            post = PostNorm(post_norm, h, st.out[:1], st.post[1], other)
            self.ops.gemv(lin, x, pro, None, eps, xoff, st.out[:1], EPI_STORE, None, post=post, swiglu=swiglu)
            return post
        self.ops.gemv(lin, x, pro, None, eps, xoff, st.out[:m], EPI_STORE, None, quantized=quantized, swiglu=swiglu)
        self.ops.norm_add(st.out[:m], post_norm, eps, h, ssq_out=ssq)
        return None
