"""The device forward's mixture-of-experts MLP, routed on the device (moe.cu).

``moe_route`` normalises the rows and chooses each one's experts and weights. A decode step (one row) then runs
the chosen experts' GEMVs, one launch per projection over a table of the layer's experts, and ``moe_combine``
adds them up: no host round trip, so the step is captured in a graph like a dense model's. A step of several
rows (a prefill chunk, a batch) reads the choices back and runs each chosen expert once on all of its rows
(the tiled GEMM), then the shared expert on every row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kestrel_cuda.forward_state import ExpertLins, LayerLins, State
from kestrel_cuda.plan import EPI_STORE, PRO_PLAIN, PRO_SILU_MUL


def moe_mlp(ops: Any, st: State, i: int, w: LayerLins, m: int, eps: float, ssq: Any) -> None:
    """h[:m] += the mixture of experts of layer i on rmsnorm(h) (the CPU decoder's ``_moe``): each row's chosen
    experts weighted and added in expert order, then the shared expert scaled by its gate. ``ssq``: h's tile
    sums (M = 1), read by the router's norm and left by the sum."""
    c, layer = st.config, st.layers[i]
    k = c.experts_per_token
    xn, out, rows_in, rows_out = st.moe
    logits, counters, sel, wts = st.route
    ops.moe_route(st.h[:m], layer.mlp_norm, eps, layer.router, c.num_experts, k, c.norm_topk_prob, xn[:m],
                  (logits, counters), sel[:m], wts[:m], ssq_in=ssq)
    shared = w.experts[c.num_experts] if len(w.experts) > c.num_experts else None
    if m == 1:
        for j, lin in enumerate(w.experts[0].gate_up):
            ops.gemv(lin, xn[:1], PRO_PLAIN, None, eps, 0, st.gu[:k, lin.col:lin.col + lin.n], EPI_STORE, None,
                     experts=(w.tables.gate_up[j], sel[0], k))
        down = w.experts[0].down
        ops.gemv(down, st.gu[:k], PRO_SILU_MUL, None, eps, down.k, rows_out[:k], EPI_STORE, None,
                 experts=(w.tables.down, sel[0], k))
        if shared is not None:  # slot k
            _expert(ops, st, shared, xn[:1], rows_out[k:k + 1], eps)
        ops.moe_combine(rows_out[:k + (shared is not None)], k + (shared is not None), wts[:1], st.h[:1], ssq)
        return
    top, weights = ops.download(sel, m), ops.download(wts, m)  # [m, k], [m, k + 1]
    ops.copy(out[:m], 0)
    jobs = [(w.experts[e], *np.nonzero(top == e)) for e in np.unique(top)]
    jobs = [(expert, rows, weights[rows, slot]) for expert, rows, slot in jobs]
    if shared is not None:
        jobs.append((shared, np.arange(m), weights[:, k]))
    # every job's rows and scales in one upload each; job j's are the slices [at[j], at[j + 1])
    at = np.cumsum([0] + [len(rows) for _, rows, _ in jobs])
    all_rows = ops.upload(np.concatenate([rows for _, rows, _ in jobs]).astype(np.int32))
    all_scales = ops.upload(np.concatenate([scale for _, _, scale in jobs]).astype(np.float32))
    for j, (expert, rows, _) in enumerate(jobs):
        n = len(rows)
        index, scales = all_rows[at[j]:at[j + 1]], all_scales[at[j]:at[j + 1]]
        ops.gather_rows(xn, index, rows_in[:n])
        _expert(ops, st, expert, rows_in[:n], rows_out[:n], eps)
        ops.scatter_add_rows(rows_out[:n], index, scales, out)
    ops.add_rows(out[:m], st.h[:m])


def _expert(ops: Any, st: State, expert: ExpertLins, x: Any, y: Any, eps: float) -> None:
    """y = one expert's SiLU-gated MLP on the normed rows x."""
    n = x.shape[0]
    for lin in expert.gate_up:
        ops.gemv(lin, x, PRO_PLAIN, None, eps, 0, st.gu[:n, lin.col:lin.col + lin.n], EPI_STORE, None)
    ops.gemv(expert.down, st.gu[:n], PRO_SILU_MUL, None, eps, expert.down.k, y, EPI_STORE, None)
