"""The device forward's mixture-of-experts MLP: the experts on the device, routed on the host.

Routing on the host with the CPU decoder's own code (``decoder.route``) keeps a routing near a tie the CPU's;
it also makes these steps eager (no captured graph, no pipelined greedy decode).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kestrel_core.model.decoder import rmsnorm, route, shared_expert_scale
from kestrel_cuda.forward_state import LayerLins, State
from kestrel_cuda.plan import EPI_STORE, PRO_PLAIN, PRO_SILU_MUL


def moe_mlp(ops: Any, st: State, i: int, layer: Any, w: LayerLins, m: int, eps: float) -> None:
    """h += the mixture of experts of layer i on rmsnorm(h) (the CPU decoder's ``_moe``). The host norms
    the rows and routes them with the CPU decoder's own code (a routing near a tie then goes the CPU's
    way); each chosen expert runs on its rows on the device, weighted and added in expert order, then
    the shared expert scaled by its gate."""
    c = st.config
    xn_dev, out_dev, rows_in, rows_out = st.moe
    xn = rmsnorm(ops.download(st.h, m), st.model.layers[i].mlp_norm, eps)  # [m, D], the host's bits
    top, weights = route(xn, layer.router, c.experts_per_token, c.norm_topk_prob)
    ops.write_rows(xn_dev, xn)
    ops.write_rows(out_dev, np.zeros_like(xn))
    runs = [(int(e), *np.nonzero(top == e)) for e in np.unique(top)]
    jobs = [(w.experts[e], rows, weights[rows, slot]) for e, rows, slot in runs]
    if layer.shared_gate is not None:
        jobs.append((w.experts[c.num_experts], np.arange(m), shared_expert_scale(xn, layer.shared_gate)[:, 0]))
    # every job's rows and scales in one upload each; job j's are the slices [at[j], at[j + 1])
    at = np.cumsum([0] + [len(rows) for _, rows, _ in jobs])
    all_rows = ops.upload(np.concatenate([rows for _, rows, _ in jobs]).astype(np.int32))
    all_scales = ops.upload(np.concatenate([scale for _, _, scale in jobs]).astype(np.float32))
    for j, (expert, rows, _) in enumerate(jobs):
        n = len(rows)
        index, scales = all_rows[at[j]:at[j + 1]], all_scales[at[j]:at[j + 1]]
        ops.gather_rows(xn_dev, index, rows_in[:n])
        for lin in expert.gate_up:
            ops.gemv(lin, rows_in[:n], PRO_PLAIN, None, eps, 0, st.gu[:n, lin.col:lin.col + lin.n], EPI_STORE,
                     None)
        ops.gemv(expert.down, st.gu[:n], PRO_SILU_MUL, None, eps, expert.down.k, rows_out[:n], EPI_STORE, None)
        ops.scatter_add_rows(rows_out[:n], index, scales, out_dev)
    ops.add_rows(out_dev[:m], st.h[:m])
