"""The device forward's mixture-of-experts MLP, routed on the device (moe.cu, route.cuh).

A decode step (one row) routes beside its o projection (``o_routed``: plan.RouteFold), whose GEMV then
stores h' in the other residual row; the chosen experts' GEMVs, one launch per projection over a table of the
layer's experts, normalise h' themselves, and ``moe_combine`` adds them up. A step of several rows (a prefill
chunk, a batch) runs ``moe_route`` (the rows normalised, each one's experts chosen), sorts its (row, expert)
pairs by expert with ``moe_group`` and runs each projection of every chosen expert as one grouped GEMM over
them (blocks of 16 or 64 positions, ``plan.grouped_rows``), its grid sized for the most groups the rows can
need; the shared expert runs on every row. No step waits on the host, so each is captured in a graph like a
dense model's.
"""

from __future__ import annotations

from typing import Any

from kestrel_cuda.forward_state import ExpertLins, Layer, LayerLins, State
from kestrel_cuda.plan import (
    EPI_STORE,
    PRO_PLAIN,
    PRO_RMSNORM,
    Lin,
    RouteFold,
    gate_prologue,
    group_capacity,
    grouped_rows,
    route_fold_span,
)


def o_routed(ops: Any, st: State, layer: Layer, o: Lin, h: Any, rows: tuple[Any, Any],
             eps: float) -> tuple[RouteFold | None, Any]:
    """A decode step's o projection with its layer's router beside it: h' = h + o(attn) into the residual row of
    ``rows`` that is not h, returned with the fold (plan.RouteFold); (None, h) and nothing launched where the
    layer has no fold or its o plan gives it no span."""
    span = route_fold_span(o.n, o.k, o.ksplit) if layer.route_fold is not None else 0
    if not span:
        return None, h
    c = st.config
    logits, counters, sel, wts = st.route
    route = RouteFold(layer.route_fold, c.num_experts, c.experts_per_token, c.norm_topk_prob, span,
                      logits.reshape(-1), counters[:1], sel[:1], wts[:1])
    h_next = rows[1] if h is rows[0] else rows[0]
    ops.gemv(o, st.attn[:1], PRO_PLAIN, None, eps, 0, h_next, EPI_STORE, h, ssq_out=st.ssq_mid, route=route)
    return route, h_next


def moe_mlp(ops: Any, st: State, i: int, w: LayerLins, h: Any, eps: float, ssq: Any,
            route: RouteFold | None) -> None:
    """h += the mixture of experts of layer i on rmsnorm(h) (the CPU decoder's ``_moe``): each row's chosen
    experts (with their biases, gpt-oss's) weighted and added in expert order, then the shared expert scaled by
    its gate. ``ssq``: h's tile sums (M = 1), read by the norms and left by the sum; ``route``: the o projection
    chose (``o_routed``), h's tile sums are then ``st.ssq_mid``."""
    c, layer, t = st.config, st.layers[i], w.tables
    m, k = h.shape[0], c.experts_per_token
    act, swiglu = gate_prologue(c)
    xn, xs, gus, ys = st.moe
    logits, counters, sel, wts = st.route
    fold = None
    if route is not None:  # the experts normalise h themselves, from its tile sums; moe_combine weighs the choice
        x, pro, pw, ssq_x = h, PRO_RMSNORM, layer.mlp_norm, st.ssq_mid
        fold = (route, st.ssq_mid, eps)
    else:
        ops.moe_route(h, layer.mlp_norm, eps, layer.router, c.num_experts, k, c.norm_topk_prob, xn[:m],
                      (logits, counters), sel[:m], wts[:m], ssq_in=ssq, bias=layer.router_bias)
        x, pro, pw, ssq_x = xn[:m], PRO_PLAIN, None, None
    shared = w.experts[c.num_experts] if len(w.experts) > c.num_experts else None
    gate_up, down = w.experts[0].gate_up, w.experts[0].down  # every routed expert's shape and plan
    p = m * k  # (row, slot) pairs
    gu_bias = t.gate_up_bias or [None] * len(gate_up)
    if m == 1:
        for j, lin in enumerate(gate_up):  # after the first, each follows a routed GEMV on the same choices
            ops.gemv(lin, x, pro, pw, eps, 0, gus[:k, lin.col:lin.col + lin.n], EPI_STORE, gu_bias[j],
                     ssq_in=ssq_x, experts=(t.gate_up[j], sel[0], k), sel_ready=j > 0)
        ops.gemv(down, gus[:k], act, None, eps, down.k, ys[:k], EPI_STORE, t.down_bias,
                 experts=(t.down, sel[0], k), sel_ready=True, swiglu=swiglu)
        index = None
    else:
        source, position, groups = st.group
        rows = grouped_rows(p, c.num_experts)
        blocks = group_capacity(p, c.num_experts, rows)
        ops.moe_group(sel[:m], c.num_experts, source[:p], position[:p], groups[:blocks], rows)
        index = position[:p]
        ops.gather_rows(x, source[:p], xs[:p])
        for j, lin in enumerate(gate_up):
            out = gus[:p, lin.col:lin.col + lin.n]
            ops.experts_gemm(lin, xs[:p], PRO_PLAIN, 0, out, t.gate_up[j], groups[:blocks], blocks, rows)
            if gu_bias[j] is not None:
                ops.expert_bias(out, groups[:blocks], gu_bias[j])
        ops.experts_gemm(down, gus[:p], act, down.k, ys[:p], t.down, groups[:blocks], blocks, rows, swiglu=swiglu)
        if t.down_bias is not None:
            ops.expert_bias(ys[:p], groups[:blocks], t.down_bias)
    if shared is not None:
        _expert(ops, st, shared, x, pro, pw, ssq_x, ys[p:p + m], eps, act, swiglu)
    ops.moe_combine(ys[:p], k, wts[:m], h, index, ys[p:p + m] if shared is not None else None, ssq, fold)


def _expert(ops: Any, st: State, expert: ExpertLins, x: Any, pro: int, pw: Any, ssq: Any, y: Any,
            eps: float, act: int, swiglu: tuple[float, float]) -> None:
    """y = one expert's gated MLP on the rows x (through prologue ``pro``), gate|up combined by prologue ``act``."""
    n = x.shape[0]
    for lin in expert.gate_up:
        ops.gemv(lin, x, pro, pw, eps, 0, st.gu[:n, lin.col:lin.col + lin.n], EPI_STORE, None, ssq_in=ssq)
    ops.gemv(expert.down, st.gu[:n], act, None, eps, expert.down.k, y, EPI_STORE, None, swiglu=swiglu)
