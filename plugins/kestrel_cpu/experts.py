"""A mixture-of-experts layer's experts in one compiled call: the CPU backend's MoE MLP without per-expert Python.

Given each row's chosen experts and weights (``decoder.route``, on the host), every chosen expert runs over its rows
in ascending expert order, as ``Decoder._moe`` runs them op by op: the rows gathered, quantized per block, the
packed gate|up GEMM, SiLU or tanh GELU, quantized, the packed down GEMM, and each row's output times its weight
added in; then the shared expert over every row, times its scale. The same kernels in the same order, so the same
bits (tests/kestrel_cpu/test_experts.py). Op by op, a qwen3-30b-a3b-shaped layer spent ~0.9 ms a decode step
outside its GEMM kernels, 16 GEMM calls and their Python a token and layer.

The experts' packed weights are passed as numba typed lists, built once a layer: a tuple of 128 experts' arrays
would be unboxed on every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit
from numba.typed import List

from kestrel_core.codegen import named_copy
from kestrel_core.contract import StripCache
from kestrel_cpu import packed
from kestrel_cpu.layer import mlp_build, run_build, sources_digest

# Each build's own global (``_build``), here the int8 one: the experts' gate|up and down MLP (``layer.mlp_build``).
_gated_mlp = mlp_build(8, 8)


def _experts(x: np.ndarray, top: np.ndarray, weights: np.ndarray, shared_scale: np.ndarray, gu_w: Any, gu_s: Any,
             down_w: Any, down_s: Any, shape: np.ndarray, groups: tuple, gelu: bool, shared: bool,
             out: np.ndarray) -> None:
    # x: [M, D]; top, weights: [M, k] each row's experts and their weights; shared_scale: [M] the shared expert's
    # factor (ones where it has no gate); gu_w/gu_s, down_w/down_s: each expert's packed codes and scales (the
    # shared one last), MAX_WEIGHTS tuples; shape: [E(+1), 2] (up's first column, F); out: [M, D] zeros, the sum.
    m, d = x.shape
    k = top.shape[1]
    n_routed = len(gu_w) - 1 if shared else len(gu_w)
    rows = np.empty(m, np.int64)
    slots = np.empty(m, np.int64)
    for e in range(n_routed):
        n = 0
        for r in range(m):
            for s in range(k):
                if top[r, s] == e:
                    rows[n], slots[n] = r, s
                    n += 1
        if n == 0:
            continue
        xe = np.empty((n, d), np.float32)
        for i in range(n):
            for j in range(d):
                xe[i, j] = x[rows[i], j]
        y = _gated_mlp(xe, gu_w[e], gu_s[e], down_w[e], down_s[e], shape[e, 0], shape[e, 1], groups, gelu)
        for i in range(n):
            w = weights[rows[i], slots[i]]
            for j in range(d):
                out[rows[i], j] += y[i, j] * w
    if shared:
        y = _gated_mlp(x, gu_w[n_routed], gu_s[n_routed], down_w[n_routed], down_s[n_routed], shape[n_routed, 0],
                       shape[n_routed, 1], groups, gelu)
        for r in range(m):
            for j in range(d):
                out[r, j] += y[r, j] * shared_scale[r]


_BUILDS: dict[tuple[int, int], Any] = {}  # None: the build failed


def _build(bits: tuple[int, int]) -> Any:
    """The experts' pass for their gate|up and down bits, compiled on first use."""
    if bits not in _BUILDS:
        name = f"_{bits[0]}{bits[1]}_w{packed.PACK_COLS}_{sources_digest()}"
        _BUILDS[bits] = njit(cache=True, nogil=True)(named_copy(_experts, name, _gated_mlp=mlp_build(*bits)))
    return _BUILDS[bits]


@dataclass(frozen=True)
class ExpertsPass:
    """A layer's experts packed as ``run`` takes them (``CpuDevice.packed_for``); the shared expert last."""

    gu_w: Any
    gu_s: Any
    down_w: Any
    down_s: Any
    shape: np.ndarray
    groups: tuple[int, int]
    bits: tuple[int, int]
    shared: bool

    def run(self, x: np.ndarray, top: np.ndarray, weights: np.ndarray, shared_scale: np.ndarray | None,
            gelu: bool) -> np.ndarray | None:
        """The experts' weighted sum [M, D] for rows x [M, D] routed to ``top`` [M, k] with ``weights``, plus the
        shared expert's times ``shared_scale`` [M] (None: 1); None, with nothing done, where this machine's numba
        cannot compile it."""
        _build(self.bits)
        out = np.zeros(x.shape, np.float32)
        scale = np.ones(len(x), np.float32) if shared_scale is None else shared_scale
        ran = run_build(_BUILDS, self.bits, "experts", x, np.ascontiguousarray(top, np.int64),
                        np.ascontiguousarray(weights, np.float32), scale, self.gu_w, self.gu_s, self.down_w,
                        self.down_s, self.shape, self.groups, gelu, self.shared, out)
        return out if ran else None


def experts_pass(packs: list[list[list[Any]]], strips: list[tuple[tuple[StripCache, ...], ...]],
                 shared: bool) -> ExpertsPass | None:
    """Each expert's ``packs`` ((gate, up), (down,): packed) and ``strips`` as an ``ExpertsPass``; None where a
    weight has no packed form, or their bits or block sizes differ (op by op each runs as it is)."""
    if any(p is None for ex in packs for group in ex for p in group):
        return None
    gu_keys = {(g.bits, u.bits, gs.group_size, us.group_size, gs.k, us.k)
               for ((g, u), _), ((gs, us), _) in zip(packs, strips)}
    down_keys = {(d.bits, ds.group_size) for (_, (d,)), (_, (ds,)) in zip(packs, strips)}
    if len(gu_keys) != 1 or len(down_keys) != 1:
        return None
    (gate_bits, up_bits, gate_g, up_g, _, _), = gu_keys
    ((down_bits, down_g),) = down_keys
    if gate_bits != up_bits or gate_g != up_g:
        return None
    pad = [packed.NO_PACKED] * packed.MAX_WEIGHTS
    gu_w, gu_s, down_w, down_s = List(), List(), List(), List()
    for (gate_up, down) in packs:
        gu_w.append(tuple(p.codes for p in (gate_up + pad)[:packed.MAX_WEIGHTS]))
        gu_s.append(tuple(p.scales for p in (gate_up + pad)[:packed.MAX_WEIGHTS]))
        down_w.append(tuple(p.codes for p in (down + pad)[:packed.MAX_WEIGHTS]))
        down_s.append(tuple(p.scales for p in (down + pad)[:packed.MAX_WEIGHTS]))
    shape = np.array([[gate.codes.shape[0] * packed.PACK_COLS, gate.n] for (gate, _), _ in packs], np.int64)
    return ExpertsPass(gu_w, gu_s, down_w, down_s, shape, (gate_g, down_g), (gate_bits, down_bits), shared)
