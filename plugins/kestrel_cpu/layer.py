"""A dense decoder layer in one compiled call: the CPU backend's forward without the host's per-op Python.

A Llama-style layer (RMSNorm; Q|K|V with optional biases and per-head q/k norms; RoPE, the KV write and paged
attention; O; RMSNorm; gate|up, SiLU or tanh GELU, down; both residual adds, with Gemma's norms after attention and
the MLP and Granite's residual scale where the model has them), or Cohere's (LayerNorms without a bias, q/k norms with
a weight a head, the MLP beside the attention on the same normed input) on int8 activations over packed weights
(``packed``), run as ``Decoder._attention`` and ``Decoder._mlp`` run it op by op: the same compiled kernels
(kestrel_core's ``kernels``, ``paged_attention`` and activation quantizer, this package's packed GEMMs) in the
same order on the same float32 values, so a row's bits are the same either way (the tests compare them). Op by
op, the SmolLM2 decode step spent ~4 of its ~10 ms between the kernels: the dispatcher, the hooks and numpy's
per-call work, slowed by caches the weights had just flushed.

numba caches a function's machine code with the kernels it calls, but checks only its own file's time: the
build's name carries a digest of the sources it compiles in, so a change to any of them makes a new build.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit
from numba.core.errors import NumbaError

import kestrel_core.codegen
import kestrel_core.contract
import kestrel_core.model.kernels
import kestrel_core.model.paged_attention
from kestrel_core.codegen import named_copy
from kestrel_core.contract import StripCache, compiled_q8_rows
from kestrel_core.model.kernels import gated_mul, layernorm_rows, rmsnorm_rows
from kestrel_core.model.paged_attention import attend, rope_write
from kestrel_cpu import packed

log = logging.getLogger("kestrel")
_EMPTY = np.zeros(0, np.float32)


def sources_digest() -> str:
    """A digest of the sources the compiled layer and experts build in: part of their builds' names."""
    h = hashlib.sha256()
    for module in (kestrel_core.codegen, kestrel_core.contract, kestrel_core.model.kernels,
                   kestrel_core.model.paged_attention, packed, sys.modules[__name__]):
        h.update(Path(module.__file__ or "").read_bytes())
    return h.hexdigest()[:12]


# Each build's own globals (``_build``, ``mlp_build``), here the int8 ones: a layer's GEMMs, each the parallel build
# of packed.gemm_q8's body for its weights' bits (decode's smallest real GEMMs, SmolLM2's 576 x 576, are above
# kernels.PARALLEL_MIN_MACS, where a product leaves one thread; a serial build would only add its compilation).
_GEMM_QKV = _GEMM_O = _GEMM_GATE_UP = _GEMM_DOWN = packed.Q8_BUILDS[8, True]
_W = packed.PACK_COLS
_Q8_ROWS = compiled_q8_rows()


@njit(inline="always")
def quantize(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    # x: [M, K] float32 -> int8 codes [M, K] and scales [M, K/group] (contract.quantize_activations)
    m, k = x.shape
    codes = np.empty((m, k), np.int8)
    scales = np.empty((m, k // group), np.float32)
    _Q8_ROWS(x, group, codes, scales)
    return codes, scales


@njit(inline="always")
def _width(wps: tuple) -> int:
    # the output columns of a packed GEMM over the weights ``wps`` (their padded column groups)
    n = 0
    for w in wps:
        n += w.shape[0] * _W
    return n


def gated_mlp(x: np.ndarray, gu_w: tuple, gu_s: tuple, down_w: tuple, down_s: tuple, up_at: int, f: int,
              groups: tuple, gelu: bool) -> np.ndarray:
    # x: [M, K] -> down(act(gate x) * up x), [M, the down GEMM's columns]: gate|up's packed GEMM puts gate at column
    # 0 and up at up_at, each F wide; groups: (gate|up's, down's) block sizes; gelu: tanh GELU, else SiLU.
    # _GEMM_GATE_UP and _GEMM_DOWN are each build's own (``mlp_build``).
    m = x.shape[0]
    codes, scales = quantize(x, groups[0])
    gu = np.empty((m, _width(gu_w)), np.float32)
    _GEMM_GATE_UP(gu_w, gu_s, codes, scales, gu)
    gate = np.empty((m, f), np.float32)
    up = np.empty((m, f), np.float32)
    for r in range(m):
        for j in range(f):
            gate[r, j] = gu[r, j]
            up[r, j] = gu[r, up_at + j]
    gated_mul(gate, up, gelu)
    codes, scales = quantize(gate, groups[1])
    down = np.empty((m, _width(down_w)), np.float32)
    _GEMM_DOWN(down_w, down_s, codes, scales, down)
    return down


def mlp_build(gate_up_bits: int, down_bits: int) -> Any:
    """``gated_mlp`` on the GEMM builds of its weights' bits, to inline into a compiled layer or experts pass."""
    return njit(inline="always")(named_copy(gated_mlp, f"_int{gate_up_bits}{down_bits}_w{packed.PACK_COLS}",
                                            _GEMM_GATE_UP=packed.Q8_BUILDS[gate_up_bits, True],
                                            _GEMM_DOWN=packed.Q8_BUILDS[down_bits, True]))


def run_build(builds: dict[Any, Any], key: Any, what: str, *args: Any) -> bool:
    """``builds[key](*args)``; False, with nothing done, where that build failed: numba's errors are raised compiling,
    before the call touches its arrays (reported once, and the build marked failed)."""
    run = builds[key]
    if run is None:
        return False
    try:
        run(*args)
    except NumbaError as exc:
        builds[key] = None
        log.warning("kestrel_cpu: the compiled %s failed to compile (%s: %s); it runs op by op", what,
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    return True


_gated_mlp = njit(inline="always")(gated_mlp)  # the int8 one; each build its own (``mlp_build``)


@njit(inline="always")
def _norm(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray, layer: bool) -> None:
    # the decoder's norm of its norm_type (host_ops.NORMS), each row of x [R, D] into out: a LayerNorm, else an RMSNorm
    if layer:
        layernorm_rows(x, weight, eps, out)
    else:
        rmsnorm_rows(x, weight, eps, out)


@njit(inline="always")
def _head_norm(x: np.ndarray, weight: np.ndarray, heads: int, hd: int, eps: np.float32, layer: bool) -> np.ndarray:
    # x [M, heads * hd], each head normed over its hd dims, as Decoder._head_norm: by one weight [hd] for every head,
    # or (Cohere's) normed by ones and then times each head's own weight [heads * hd]
    m = x.shape[0]
    out = np.empty((m * heads, hd), np.float32)
    if weight.size == hd:
        _norm(x.reshape(m * heads, hd), weight, eps, out, layer)
        return out.reshape(m, heads * hd)
    _norm(x.reshape(m * heads, hd), np.ones(hd, np.float32), eps, out, layer)
    y = out.reshape(m, heads * hd)
    for r in range(m):
        for j in range(heads * hd):
            y[r, j] *= weight[j]
    return y


@njit(inline="always")
def _add_residual(h: np.ndarray, out: np.ndarray, post_norm: np.ndarray, eps: np.float32, scale: np.float32,
                  layer: bool) -> None:
    # h [M, D] += out's first D columns, normed first where post_norm is not empty (Gemma), then scaled (Granite; a
    # factor of 1 changes no bit)
    m, d = h.shape
    y = np.empty((m, d), np.float32)
    for r in range(m):
        for j in range(d):
            y[r, j] = out[r, j]
    if post_norm.size:
        normed = np.empty((m, d), np.float32)
        _norm(y, post_norm, eps, normed, layer)
        y = normed
    for r in range(m):
        for j in range(d):
            h[r, j] += y[r, j] * scale


def _dense_layer(h: np.ndarray, norms: tuple, eps: np.float32, residual_scale: np.float32, mlp: bool, gelu: bool,
                 layer: bool, parallel: bool, wps: tuple, wsps: tuple, groups: tuple, cols: tuple, biases: tuple,
                 head_norms: tuple, heads: tuple, kt: np.ndarray, vc: np.ndarray, ks: np.ndarray, vs: np.ndarray,
                 slots: np.ndarray, cos: np.ndarray, sin: np.ndarray, tables: np.ndarray, row_seq: np.ndarray,
                 firsts: np.ndarray, lengths: np.ndarray, q_cos: np.ndarray, q_sin: np.ndarray, softcap: np.float32,
                 sinks: np.ndarray) -> None:
    # h: [M, D] the residual stream, updated in place; norms: (attention, MLP, after attention, after the MLP) [D]
    # (the last two may be empty); mlp: the MLP too, else the attention alone (a mixture-of-experts layer's); gelu:
    # the MLP's tanh GELU, else SiLU; layer: LayerNorms, else RMSNorms; parallel: the MLP on the attention's input
    # (Cohere's; its MLP norm is empty); wps/wsps: the four GEMMs' packed codes and scales (Q|K|V, O, gate|up, down),
    # each a MAX_WEIGHTS tuple; groups: their block sizes;
    # cols: where q, k, v and up start in their GEMM's output (gate at 0), and q, k, v, F wide; biases: q, k, v [N] or
    # empty; head_norms: q, k [hd] or [heads * hd] (a weight a head) or empty; heads: (H, KV, hd, the query heads an
    # attend item takes); the rest: Decoder._attend's.
    m, d = h.shape
    n_heads, n_kv, hd, item_heads = heads
    q_at, k_at, v_at, up_at, nq, nk, nv, f = cols
    x = np.empty((m, d), np.float32)
    _norm(h, norms[0], eps, x, layer)
    codes, scales = quantize(x, groups[0])
    qkv = np.empty((m, _width(wps[0])), np.float32)
    _GEMM_QKV(wps[0], wsps[0], codes, scales, qkv)
    q = np.empty((m, nq), np.float32)
    k = np.empty((m, nk), np.float32)
    v = np.empty((m, nv), np.float32)
    for r in range(m):
        for j in range(nq):
            q[r, j] = qkv[r, q_at + j] + biases[0][j] if biases[0].size else qkv[r, q_at + j]
        for j in range(nk):
            k[r, j] = qkv[r, k_at + j] + biases[1][j] if biases[1].size else qkv[r, k_at + j]
        for j in range(nv):
            v[r, j] = qkv[r, v_at + j] + biases[2][j] if biases[2].size else qkv[r, v_at + j]
    if head_norms[0].size:
        q = _head_norm(q, head_norms[0], n_heads, hd, eps, layer)
        k = _head_norm(k, head_norms[1], n_kv, hd, eps, layer)
    vd = nv // n_kv
    rope_write(k.reshape(m, n_kv, hd), v.reshape(m, n_kv, vd), kt, vc, ks, vs, slots, cos, sin)
    attn = np.empty((m, n_heads * vd), np.float32)
    attend(q.reshape(m, n_heads, hd), kt, vc, ks, vs, tables, row_seq, firsts, lengths, q_cos, q_sin, softcap, sinks,
           item_heads, attn)
    codes, scales = quantize(attn, groups[1])
    o = np.empty((m, _width(wps[1])), np.float32)
    _GEMM_O(wps[1], wsps[1], codes, scales, o)
    _add_residual(h, o, norms[2], eps, residual_scale, layer)
    if not mlp:
        return
    if not parallel:
        _norm(h, norms[1], eps, x, layer)
    down = _gated_mlp(x, wps[2], wsps[2], wps[3], wsps[3], up_at, f, (groups[2], groups[3]), gelu)
    _add_residual(h, down, norms[3], eps, residual_scale, layer)


_BUILDS: dict[tuple[int, ...], Any] = {}  # None: the build failed


def _build(bits: tuple[int, ...]) -> Any:
    """The layer for its four GEMMs' weight bits (Q|K|V, O, gate|up, down), compiled on first use."""
    if bits not in _BUILDS:
        name = f"_{''.join(map(str, bits))}_w{packed.PACK_COLS}_{sources_digest()}"
        layer = named_copy(_dense_layer, name, _GEMM_QKV=packed.Q8_BUILDS[bits[0], True],
                           _GEMM_O=packed.Q8_BUILDS[bits[1], True], _gated_mlp=mlp_build(bits[2], bits[3]))
        _BUILDS[bits] = njit(cache=True, nogil=True)(layer)
    return _BUILDS[bits]


def _present(arrays: tuple[np.ndarray | None, ...]) -> tuple[np.ndarray, ...]:
    """Optional float32 vectors as the compiled layer takes them: an absent one empty."""
    return tuple(_EMPTY if a is None else a for a in arrays)


@dataclass(frozen=True)
class DenseLayer:
    """One layer's weights as ``run`` takes them: packed (``CpuDevice.packed_for``), in its GEMMs' tuples."""

    wps: tuple
    wsps: tuple
    groups: tuple[int, int, int, int]
    bits: tuple[int, int, int, int]
    cols: tuple[int, ...]
    mlp: bool  # the layer's MLP too (else its attention alone, a mixture-of-experts layer's)

    @property
    def gemms(self) -> int:
        """The weights it multiplies (q, k, v, o; gate, up, down), as the dispatcher counts GEMMs."""
        return 7 if self.mlp else 4

    def run(self, h: np.ndarray, norms: tuple[np.ndarray | None, ...], eps: np.float32, residual_scale: float,
            gelu: bool, layer_norm: bool, parallel: bool, biases: tuple[np.ndarray | None, ...],
            head_norms: tuple[np.ndarray | None, ...], heads: tuple[int, int, int, int], attention: tuple) -> bool:
        """The layer on h [M, D] in place, its keys and values written to the pool. ``norms``: before attention,
        before the MLP, after each (or None), LayerNorms where ``layer_norm`` (else RMSNorms); ``parallel``: the MLP
        reads the attention's normed input (Cohere's, no norm before the MLP); ``head_norms``: q's and k's, a weight
        [hd] for every head or one [heads * hd] a head (or None); ``attention``: kt, vc, ks, vs, slots, cos, sin,
        tables, row_seq, firsts, lengths, q_cos, q_sin, softcap, sinks, as ``paged_attention.attend`` and
        ``rope_write`` take them. False, with nothing done, where this machine's numba cannot compile it."""
        _build(self.bits)
        return run_build(_BUILDS, self.bits, "layer", h, _present(norms), eps, np.float32(residual_scale), self.mlp,
                         gelu, layer_norm, parallel, self.wps, self.wsps, self.groups, self.cols, _present(biases),
                         _present(head_norms), heads, *attention)


def dense_layer(packs: list[list[Any]], strips: tuple[tuple[StripCache, ...], ...]) -> DenseLayer | None:
    """``packs`` (each GEMM's weights packed) and their ``strips`` (Q|K|V, O, and gate|up, down unless the layer's
    MLP is a mixture of experts) as a ``DenseLayer``; None where a GEMM's weights differ in bits or block size (op by
    op they run as separate GEMMs)."""
    mlp = [len(s) for s in strips] == [3, 1, 2, 1]
    if not mlp and [len(s) for s in strips] != [3, 1]:
        return None
    bits, groups = [], []
    for group, ws in zip(packs, strips):
        if any(p is None for p in group) or len({(p.bits, w.group_size, w.k) for p, w in zip(group, ws)}) != 1:
            return None
        bits.append(group[0].bits)
        groups.append(ws[0].group_size)
    pad = [packed.NO_PACKED] * packed.MAX_WEIGHTS
    if not mlp:  # the MLP's GEMMs are never called: the O GEMM's build in their place
        packs, bits, groups = [*packs, [], []], bits + bits[1:] * 2, groups + groups[1:] * 2
    wps = tuple(tuple(p.codes for p in (group + pad)[:packed.MAX_WEIGHTS]) for group in packs)
    wsps = tuple(tuple(p.scales for p in (group + pad)[:packed.MAX_WEIGHTS]) for group in packs)
    w = packed.PACK_COLS
    (q, k, v), _ = packs[:2]
    cols = (0, q.codes.shape[0] * w, (q.codes.shape[0] + k.codes.shape[0]) * w,
            packs[2][0].codes.shape[0] * w if mlp else 0, q.n, k.n, v.n, packs[2][0].n if mlp else 0)
    return DenseLayer(wps, wsps, tuple(groups), tuple(bits), cols, mlp)
