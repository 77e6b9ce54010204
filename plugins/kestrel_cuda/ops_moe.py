"""CupyOps' mixture-of-experts kernels (moe.cu; the routed GEMVs are ``CupyOps.gemv(experts=...)``), one launch
each on the ops' stream: the router, the grouping of a step's (row, expert) pairs, the grouped expert GEMMs
and the weighted sum of the experts' outputs into the residual stream."""

from __future__ import annotations

from typing import Any

import numpy as np

from kestrel_cuda.forward_launch import i32_arg as _i32
from kestrel_cuda.forward_launch import ld_arg as _ld
from kestrel_cuda.forward_launch import ptr_arg as _ptr
from kestrel_cuda.layout import Geometry
from kestrel_cuda.plan import EXPERT_TABLE_ROWS, NO_SWIGLU, ROUTE_ROWS, Lin, RouteFold, check_expert_table


class MoeOps:
    """Mixed into ``ops_cupy.CupyOps``: its ``launch``, ``upload``, kernels (``_fn``), tiled GEMM and scratch."""

    def expert_table(self, lins: list[Lin]) -> Any:
        """The routed experts' weights of one projection for ``gemv(experts=...)``: uint64 [EXPERT_TABLE_ROWS][2]
        (codes, scales) device pointers, rows past the E experts zero; every expert of one shape."""
        check_expert_table(lins)
        table = np.zeros((EXPERT_TABLE_ROWS, 2), np.uint64)
        table[:len(lins)] = [[lin.codes.data.ptr, lin.scales.data.ptr] for lin in lins]
        return self.upload(table)

    def moe_route(self, h: Any, norm: Any, eps: float, router: Any, experts: int, k: int, norm_topk: bool,
                  xn: Any, scratch: tuple[Any, Any], sel: Any, wts: Any, ssq_in: Any = None, bias: Any = None) -> None:
        """Each row of h [M, D]: xn = rmsnorm(h, norm), its k experts by the router [R, D] (R = ``experts``,
        + 1: a shared-expert gate; ``bias`` [experts] added to their logits) into sel [M, k] (increasing), their
        weights into wts [M, k + 1] (the gate's sigmoid last) (moe.cu moe_route; ``scratch``: logits [M, R] and
        counters [M])."""
        m, d = h.shape
        rows = router.shape[0]
        logits, counters = scratch
        self.launch(self._fn["moe_route"], (-(-rows // ROUTE_ROWS), m), (256,),
                    (_ptr(h), _ld(h), _i32(d), _ptr(norm), np.float32(eps), _ptr(ssq_in if m == 1 else None),
                     _ptr(router), _i32(experts), _i32(rows - experts), _i32(k), _i32(norm_topk), _ptr(xn), _ld(xn),
                     _ptr(logits), _ptr(counters), _ptr(sel), _ptr(wts), _ptr(bias)), 4 * d, name="moe_route")

    def moe_group(self, sel: Any, experts: int, source: Any, position: Any, groups: Any, rows: int) -> None:
        """The (row, slot) pairs of sel [M, k] sorted by expert as plan.expert_groups sorts them: ``position``
        [M k] where each lands, ``source`` [M k] the row each sorted position reads, ``groups`` [capacity, 3]
        the grouped GEMM's blocks of at most ``rows`` positions, zero past the pairs' own (moe.cu moe_group)."""
        m, k = sel.shape
        self.launch(self._fn["moe_group"], (1,), (256,),
                    (_ptr(sel), _i32(m * k), _i32(k), _i32(experts), _i32(rows), _i32(groups.shape[0]),
                     _ptr(source), _ptr(position), _ptr(groups)), name="moe_group")

    def moe_combine(self, y: Any, k: int, wts: Any, h: Any, index: Any = None, shared: Any = None,
                    ssq_out: Any = None, fold: tuple[RouteFold, Any, float] | None = None) -> None:
        """h[m] += sum_{j<k} y[index[m * k + j] or m * k + j] * wts[m, j] (+ shared[m] * wts[m, k]), from zero
        in that order (moe.cu moe_combine). ``fold`` (route, ssq, eps; M = 1): wts are a RouteFold's totals,
        weighed first with h's rms from its tile sums ``ssq``."""
        m, d = h.shape
        route, ssq, eps = fold if fold is not None else (None, None, 0.0)
        self.launch(self._fn["moe_combine"], (-(-d // 256), m), (256,),
                    (_ptr(y), _ld(y), _i32(k), _ptr(index), _ptr(shared), _ld(shared) if shared is not None else
                     _i32(0), _ptr(wts), _ld(wts), _ptr(h), _ld(h), _i32(d), _ptr(ssq_out if m == 1 else None),
                     _ptr(ssq), _ptr(route.part if route else None), _ptr(route.sel if route else None),
                     _i32(route.experts if route else 0), _i32(route.norm_topk if route else 0), np.float32(eps)),
                    name="moe_combine")

    def experts_gemm(self, lin: Lin, x: Any, pro: int, xoff: int, y: Any, table: Any, groups: Any,
                     blocks: int, rows: int, swiglu: tuple[float, float] = NO_SWIGLU) -> None:
        """y[:P, :lin.n] = each expert's projection of its rows of x [P, K] (prologue ``pro``, ``swiglu`` its
        clamped SwiGLU's as ``gemv``'s), the rows sorted by expert as ``groups`` int32 [blocks, 3] (expert, first
        row, rows) says; ``table``: ``expert_table`` of experts shaped like ``lin`` (gemm.DeviceGemm.grouped)."""
        if self.gemm is None:
            raise RuntimeError("a mixture of experts' step of several rows needs the tiled GEMM")
        p, k, g = x.shape[0], lin.k, lin.group_size
        codes, scales = self.gemm_input(p, k, g)
        self._quantize_rows(x, p, k, g, pro, None, 0.0, xoff, codes, scales, swiglu)
        geometry = Geometry(k, lin.npad, k // g, lin.bits)

        def run() -> None:
            self.launches += 1
            self.gemm.grouped(codes, scales, geometry, table, groups, blocks, y, lin.n, self.stream, rows)
        self._observed("gemm_q8 (grouped)", run)

    def expert_bias(self, y: Any, groups: Any, bias: Any) -> None:
        """y[q] += bias[e] for the rows q of each of ``groups`` (``experts_gemm``'s, [blocks, 3]): a grouped
        GEMM's outputs y [P, N] plus their experts' biases ``bias`` [E, N] (moe.cu moe_bias)."""
        n = y.shape[1]
        self.launch(self._fn["moe_bias"], (-(-n // 256), groups.shape[0]), (256,),
                    (_ptr(y), _ld(y), _i32(n), _ptr(groups), _ptr(bias)), name="moe_bias")
