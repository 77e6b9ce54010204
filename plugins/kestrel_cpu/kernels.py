"""Compiled int8 strip-cache kernels (numba + explicit LLVM vector IR).

Why explicit vector IR: numba turns SLP vectorisation off and LLVM fully unrolls a constant
32-wide block loop before the loop vectoriser sees it, so a plain ``for k in range(32)`` int8 dot product
compiles to scalar code (~1 GB/s). The intrinsics below spell one 32-value chunk as
``mul(sext a, sext w)`` folded even+odd, which the x86 backend lowers to ``vpmovsxbw + vpmaddwd`` on AVX2
(plain vector code on other targets). Each output keeps eight int32 lanes per K-block, summed at the
block's end.

Tiles: decode (M < 4) runs one output at a time on int8 activations (memory-bound: it streams the codes
once, prefetching ahead); prefill widens the activations to int16 once, so vpmaddwd reads them straight from
memory, and runs 8 activation rows x 1 weight row per tile for G = 32 (straight-line blocks: there the
per-block convert/scale/multiply-add dominates and bigger tiles spill) or 4 x 2 for G = 256.

The maths is the contract's, bit for bit (``reference_gemm_q8``): each K-block's integer sum is exact (int32
lanes, |sum| <= 127*127*256), and the float part follows the contract's order: ``(float(sum) * a_scale) *
w_scale`` per block, added in block order, no fused multiply-add. Every tile shape does exactly this per
output, so an output's bits do not depend on the tile, the thread split or the machine.

Where the CPU has VNNI, AVX-512's or AVX's (``VNNI``), ``gemm_q8``, ``gemm_q8_multi`` and ``gemm_f32`` run the
kernels of ``kestrel_cpu.packed`` instead, on each weight repacked once (the backend caches them under the
wkey): 4-5x the vpmaddwd kernels' rate at 8 rows and more with AVX-512 (benchmarks/cpu_gemm.py). On AVX2
alone they run for the int4 weights the caller packed.

This module lives in one file on purpose: numba's on-disk cache is invalidated by the timestamp of the file
that holds the jitted function, so the intrinsics it inlines must sit in the same file.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kestrel_core.codegen import F32 as _F32
from kestrel_core.codegen import I8 as _I8
from kestrel_core.codegen import I32 as _I32
from kestrel_core.codegen import data_ptr as _data_ptr
from kestrel_core.codegen import declared as _declared
from kestrel_core.codegen import named_copy as _named_copy
from kestrel_cpu import packed
from kestrel_cpu.packed import Packed

CHUNK = 32  # int8 values per vector step; every group size (32, 256) is a multiple
LANES = 8
VNNI = packed.HAS_VNNI  # the packed kernels run for every weight where True, else for int4 weights packed on AVX2
# (tests turn it off to run the vpmaddwd kernels)



def _hsum_int(builder: ir.IRBuilder, vec: ir.Value) -> ir.Value:
    """Integer lanes summed (exact: any order gives the same value)."""
    n = vec.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        vec = builder.add(lo, hi)
    return builder.extract_element(vec, ir.Constant(_I32, 0))


def _hsum_rows(builder: ir.IRBuilder, vecs: list[ir.Value]) -> ir.Value:
    """Eight int32 vectors of eight lanes -> one vector whose lane r is the sum of vecs[r] (exact)."""
    even = ir.Constant(ir.VectorType(_I32, LANES), list(range(0, 2 * LANES, 2)))
    odd = ir.Constant(ir.VectorType(_I32, LANES), list(range(1, 2 * LANES, 2)))
    while len(vecs) > 1:  # pairwise: each level halves the lanes per row and doubles the rows per vector
        vecs = [builder.add(builder.shuffle_vector(a, b, even), builder.shuffle_vector(a, b, odd))
                for a, b in zip(vecs[0::2], vecs[1::2])]
    return vecs[0]


def _prefetch(builder: ir.IRBuilder, ptr: ir.Value) -> None:
    """llvm.prefetch (read, keep in all cache levels): a hint, it never faults, even past an array's end."""
    i8p = ir.IntType(8).as_pointer()
    fn = _declared(builder, "llvm.prefetch.p0i8", ir.VoidType(), i8p, _I32, _I32, _I32)
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


@contextmanager
def _chunks(builder: ir.IRBuilder, nchunk: ir.Value, one_chunk: bool) -> Iterator[ir.Value]:
    """The chunk loop of a K-block, or straight-line code when a block is one chunk (G = 32): no loop, no
    zeroed accumulator, fewer registers held across it (for G = 32 the per-block work is the bottleneck)."""
    if one_chunk:
        yield ir.Constant(nchunk.type, 0)
    else:
        with cgutils.for_range(builder, nchunk) as loop:
            yield loop.index


def _make_tile_dot(rows: int, cols: int, prefetch_rows: int = 0, one_chunk: bool = False) -> Any:
    """An intrinsic for a ``rows`` x ``cols`` output tile: out[m0+r, j0+c] = sum_g blocksum * a_sc * w_sc.

    Arguments (offsets in elements of flat C-ordered arrays): a int8 or int16 (int8 values pre-widened, so
    vpmaddwd reads them straight from memory), a_off (row m0), a_stride; a_scales, as_off, as_stride;
    w int8, w_off (row n0), w_stride; w_scales, ws_off, ws_stride; ng; nchunk (= G/32); out, out_off (m0, j0),
    out_stride. Each weight chunk is widened once and used for every row of the tile.
    """

    @intrinsic
    def tile_dot(typingctx: Any, a: Any, a_off: Any, a_stride: Any, asc: Any, as_off: Any, as_stride: Any,
                 w: Any, w_off: Any, w_stride: Any, wsc: Any, ws_off: Any, ws_stride: Any, ng: Any, nchunk: Any,
                 out: Any, out_off: Any, out_stride: Any) -> Any:
        sig = types.void(a, a_off, a_stride, asc, as_off, as_stride, w, w_off, w_stride, wsc, ws_off, ws_stride,
                         ng, nchunk, out, out_off, out_stride)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list[ir.Value]) -> Any:
            (va_, a_off_, a_stride_, vas_, as_off_, as_stride_, vw_, w_off_, w_stride_, vws_, ws_off_,
             ws_stride_, ng_, nchunk_, vout_, out_off_, out_stride_) = args
            targs = signature.args
            idx = a_off_.type

            def at(base: ir.Value, stride: ir.Value, i: int) -> ir.Value:
                return builder.add(base, builder.mul(stride, ir.Constant(idx, i)))

            pa = [_data_ptr(context, builder, targs[0], va_, at(a_off_, a_stride_, r)) for r in range(rows)]
            pas = [_data_ptr(context, builder, targs[3], vas_, at(as_off_, as_stride_, r)) for r in range(rows)]
            pw = [_data_ptr(context, builder, targs[6], vw_, at(w_off_, w_stride_, c)) for c in range(cols)]
            pws = [_data_ptr(context, builder, targs[9], vws_, at(ws_off_, ws_stride_, c)) for c in range(cols)]

            a_elem = context.get_value_type(targs[0].dtype)
            va_ty = ir.VectorType(a_elem, CHUNK)
            vw_ty = ir.VectorType(_I8, CHUNK)
            v32i32 = ir.VectorType(_I32, CHUNK)
            v8i32 = ir.VectorType(_I32, LANES)
            even = ir.Constant(ir.VectorType(_I32, 16), list(range(0, CHUNK, 2)))
            odd = ir.Constant(ir.VectorType(_I32, 16), list(range(1, CHUNK, 2)))
            lo = ir.Constant(v8i32, list(range(0, 8)))
            hi = ir.Constant(v8i32, list(range(8, 16)))
            pairs = [(r, c) for r in range(rows) for c in range(cols)]
            by_rows = rows == LANES and cols == 1  # the block epilogue as vectors across the 8 rows
            v8f = ir.VectorType(_F32, LANES)
            facc = {rc: cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for rc in pairs}
            vacc = cgutils.alloca_once_value(builder, ir.Constant(v8f, [0.0] * LANES)) if by_rows else None
            iacc = {rc: cgutils.alloca_once(builder, v8i32) for rc in pairs}
            group = builder.mul(nchunk_, ir.Constant(idx, CHUNK))

            with cgutils.for_range(builder, ng_) as gloop:
                g = gloop.index
                base = builder.mul(g, group)
                for rc in pairs:
                    builder.store(ir.Constant(v8i32, [0] * LANES), iacc[rc])
                with _chunks(builder, nchunk_, one_chunk) as chunk:
                    off = builder.add(base, builder.mul(chunk, ir.Constant(idx, CHUNK)))
                    if prefetch_rows:  # decode streams the codes from DRAM: ask for rows a little ahead
                        ahead = builder.add(off, builder.mul(w_stride_, ir.Constant(idx, prefetch_rows)))
                        _prefetch(builder, builder.gep(pw[0], [ahead]))
                    wv = [builder.sext(builder.load(builder.bitcast(builder.gep(pw[c], [off]), vw_ty.as_pointer()),
                                                    align=1), v32i32) for c in range(cols)]
                    for r in range(rows):
                        av = builder.load(builder.bitcast(builder.gep(pa[r], [off]), va_ty.as_pointer()), align=1)
                        av = builder.sext(av, v32i32)
                        for c in range(cols):
                            # products fit in 16 bits: this even+odd fold is exactly vpmaddwd's semantics
                            p = builder.mul(av, wv[c])
                            s16 = builder.add(builder.shuffle_vector(p, p, even), builder.shuffle_vector(p, p, odd))
                            s8 = builder.add(builder.shuffle_vector(s16, s16, lo),
                                             builder.shuffle_vector(s16, s16, hi))
                            builder.store(builder.add(builder.load(iacc[r, c]), s8), iacc[r, c])
                # the contract's float order: 0 + term_0 + term_1 + ... in block order, term_g =
                # (float(sum_g) * a_scale) * w_scale, no fused multiply-add
                wsg = [builder.load(builder.gep(pws[c], [g])) for c in range(cols)]
                if by_rows:  # lane r holds row r: the same operations per row, 8 rows at a time
                    totals = builder.sitofp(_hsum_rows(builder, [builder.load(iacc[r, 0]) for r in range(rows)]), v8f)
                    asv = ir.Constant(v8f, ir.Undefined)
                    for r in range(rows):
                        asv = builder.insert_element(asv, builder.load(builder.gep(pas[r], [g])), ir.Constant(_I32, r))
                    wsv = builder.insert_element(ir.Constant(v8f, ir.Undefined), wsg[0], ir.Constant(_I32, 0))
                    wsv = builder.shuffle_vector(wsv, wsv, ir.Constant(v8i32, [0] * LANES))
                    term = builder.fmul(builder.fmul(totals, asv), wsv)
                    builder.store(builder.fadd(builder.load(vacc), term), vacc)
                for r in range(rows if not by_rows else 0):
                    asg = builder.load(builder.gep(pas[r], [g]))
                    for c in range(cols):
                        total = builder.sitofp(_hsum_int(builder, builder.load(iacc[r, c])), _F32)
                        term = builder.fmul(builder.fmul(total, asg), wsg[c])
                        builder.store(builder.fadd(builder.load(facc[r, c]), term), facc[r, c])

            pout = _data_ptr(context, builder, targs[14], vout_, out_off_)
            for r, c in pairs:
                dst = builder.gep(pout, [builder.add(builder.mul(out_stride_, ir.Constant(idx, r)),
                                                     ir.Constant(idx, c))])
                value = (builder.extract_element(builder.load(vacc), ir.Constant(_I32, r)) if by_rows
                         else builder.load(facc[r, c]))
                builder.store(value, dst)
            return context.get_dummy_value()

        return sig, codegen

    return tile_dot


_dot1x1 = _make_tile_dot(1, 1)
_dot1x1_stream = _make_tile_dot(1, 1, prefetch_rows=4)  # ~7% more GB/s on a 150 MB decode pass
# G = 32 (one chunk per block): straight-line builds; prefill uses 8x1 tiles there (no register spills,
# ~35% faster than 4x2, whose 16 accumulators spill once the per-block epilogue dominates).
_dot1x1_32 = _make_tile_dot(1, 1, one_chunk=True)
_dot1x1_stream32 = _make_tile_dot(1, 1, prefetch_rows=4, one_chunk=True)
_dot8x1_32 = _make_tile_dot(8, 1, one_chunk=True)
_dot1x2 = _make_tile_dot(1, 2)
_dot4x1 = _make_tile_dot(4, 1)
_dot4x2 = _make_tile_dot(4, 2)

BLOCK_BYTES = 16 << 10  # prefill: weight rows per work item, so their codes and a 4-row tile fit L1
TILE_MIN_M = 4  # below this, rows run one by one on int8 activations (decode: memory-bound anyway)


def _gemm_q8_body(a: np.ndarray, a16: np.ndarray, a_scales: np.ndarray, codes: tuple, w_scales: tuple,
                  out: np.ndarray) -> None:
    # a: [M, K] int8; a16: the same values as int16 (used when M >= TILE_MIN_M); a_scales: [M, ng];
    # codes[i]: [N_i, K] int8, w_scales[i]: [N_i, ng] (N_i = 0 pads the tuple); out: [M, sum N_i], weight i
    # filling the columns row_start[i]:row_start[i+1].
    m_rows, k = a.shape
    n_total = out.shape[1]
    ng = a_scales.shape[1]
    nchunk = k // ng // CHUNK
    nw = len(codes)
    row_start = np.zeros(nw + 1, np.int64)
    for i in range(nw):
        row_start[i + 1] = row_start[i] + codes[i].shape[0]
    if m_rows < TILE_MIN_M:
        for j in prange(n_total):
            i = 0
            while j >= row_start[i + 1]:
                i += 1
            n = j - row_start[i]
            c, s = codes[i], w_scales[i]
            for m in range(m_rows):
                if nchunk == 1:
                    _dot1x1_stream32(a, m * k, k, a_scales, m * ng, ng, c, n * k, k, s, n * ng, ng, ng, nchunk,
                                     out, m * n_total + j, n_total)
                else:
                    _dot1x1_stream(a, m * k, k, a_scales, m * ng, ng, c, n * k, k, s, n * ng, ng, ng, nchunk,
                                   out, m * n_total + j, n_total)
    else:
        # Work items are blocks of weight rows (~BLOCK_BYTES of codes, never straddling two weights); each
        # block runs every activation tile (8 rows for G = 32, else 4 rows x 2 weight rows) against all its
        # rows, so the activation tile (int16) and the block's codes both stay in L1 while they are reused.
        block_rows = max(2, BLOCK_BYTES // k // 2 * 2)
        blk_start = np.zeros(nw + 1, np.int64)
        for i in range(nw):
            blk_start[i + 1] = blk_start[i] + (row_start[i + 1] - row_start[i] + block_rows - 1) // block_rows
        m4 = m_rows - m_rows % 4
        m8 = m_rows - m_rows % 8
        for b in prange(blk_start[nw]):
            i = 0
            while b >= blk_start[i + 1]:
                i += 1
            n0 = block_rows * (b - blk_start[i])
            n_end = min(n0 + block_rows, row_start[i + 1] - row_start[i])
            n_pairs_end = n0 + (n_end - n0) // 2 * 2
            c, s = codes[i], w_scales[i]
            j0 = row_start[i]
            if nchunk == 1:
                for m in range(0, m8, 8):
                    for n in range(n0, n_end):
                        _dot8x1_32(a16, m * k, k, a_scales, m * ng, ng, c, n * k, k, s, n * ng, ng, ng, nchunk,
                                   out, m * n_total + j0 + n, n_total)
                for m in range(m8, m_rows):
                    for n in range(n0, n_end):
                        _dot1x1_32(a16, m * k, k, a_scales, m * ng, ng, c, n * k, k, s, n * ng, ng, ng, nchunk,
                                   out, m * n_total + j0 + n, n_total)
                continue
            for m in range(0, m4, 4):
                for n in range(n0, n_pairs_end, 2):
                    _dot4x2(a16, m * k, k, a_scales, m * ng, ng, c, n * k, k, s, n * ng, ng, ng, nchunk,
                            out, m * n_total + j0 + n, n_total)
                if n_pairs_end < n_end:
                    _dot4x1(a16, m * k, k, a_scales, m * ng, ng, c, n_pairs_end * k, k, s, n_pairs_end * ng, ng,
                            ng, nchunk, out, m * n_total + j0 + n_pairs_end, n_total)
            for m in range(m4, m_rows):
                for n in range(n0, n_pairs_end, 2):
                    _dot1x2(a16, m * k, k, a_scales, m * ng, ng, c, n * k, k, s, n * ng, ng, ng, nchunk,
                            out, m * n_total + j0 + n, n_total)
                if n_pairs_end < n_end:
                    _dot1x1(a16, m * k, k, a_scales, m * ng, ng, c, n_pairs_end * k, k, s, n_pairs_end * ng, ng,
                            ng, nchunk, out, m * n_total + j0 + n_pairs_end, n_total)


# Two builds of the same body: a parallel one, and a serial one for small products where waking the second
# thread costs more than it saves (a decode k/v projection is 110 KB). Weights always come as a 3-tuple
# (padded with an empty array), so each build compiles once for the single, Q/K/V and gate/up cases.
_gemm_q8_parallel = njit(parallel=True, cache=True, nogil=True)(_named_copy(_gemm_q8_body, "_parallel"))
_gemm_q8_serial = njit(cache=True, nogil=True)(_named_copy(_gemm_q8_body, "_serial"))

PARALLEL_MIN_MACS = 1 << 18
MAX_WEIGHTS = packed.MAX_WEIGHTS
_NO_CODES = np.zeros((0, CHUNK), np.int8)
_NO_SCALES = np.zeros((0, 1), np.float32)
_NO_A16 = np.zeros((0, CHUNK), np.int16)


def _gemm_f32_body(a: np.ndarray, codes: np.ndarray, w_scales: np.ndarray, out: np.ndarray) -> None:
    # a: [M, K] float32; codes: [N, K] int8; w_scales: [N, ng]; out: [M, N] float32
    m_rows, k = a.shape
    n_rows = codes.shape[0]
    ng = w_scales.shape[1]
    g_size = k // ng
    for n in prange(n_rows):
        wrow = codes[n]
        for m in range(m_rows):
            arow = a[m]
            acc = np.float32(0.0)
            for g in range(ng):
                ab = arow[g * g_size:(g + 1) * g_size]
                wb = wrow[g * g_size:(g + 1) * g_size]
                s = np.float32(0.0)
                for i in range(g_size):
                    s += ab[i] * np.float32(wb[i])
                acc += s * w_scales[n, g]
            out[m, n] = acc


# reassoc lets LLVM vectorise the float block sums; the reference's own sums are BLAS-ordered anyway.
_F32_MATH = {"reassoc", "contract", "nsz", "arcp"}
_gemm_f32_parallel = njit(parallel=True, cache=True, nogil=True, fastmath=_F32_MATH)(
    _named_copy(_gemm_f32_body, "_parallel"))
_gemm_f32_serial = njit(cache=True, nogil=True, fastmath=_F32_MATH)(_named_copy(_gemm_f32_body, "_serial"))


def _use_packed(vnni: bool | None, packs: list[Packed | None]) -> bool:
    """The packed kernels: where the CPU has VNNI, or for weights the caller packed (int4 on AVX2), unless it asks
    for the vpmaddwd ones."""
    return vnni is not False and (VNNI or (bool(packs) and all(p is not None for p in packs)))


def gemm_q8(a_codes: np.ndarray, a_scales: np.ndarray, codes: np.ndarray, w_scales: np.ndarray,
            pack: Packed | None = None, vnni: bool | None = None) -> np.ndarray:
    """float32 [M, N] = contract GEMM of int8 activations [M, K] (scales [M, K/G]) and codes [N, K].

    The caller checks shapes and dtypes; arrays must be C-contiguous. ``pack``: this very weight as
    ``Packed`` (with VNNI it is packed for this call where None; without, a packed int4 weight runs the packed
    kernels on AVX2); ``vnni=False``: the vpmaddwd kernels whatever the CPU.
    """
    if _use_packed(vnni, [pack]):
        return np.ascontiguousarray(_gemm_packed(a_codes, a_scales, [pack or Packed(codes, w_scales)])[0])
    m, k = a_codes.shape
    out = np.empty((m, codes.shape[0]), dtype=np.float32)
    _run(a_codes, a_scales, (codes, _NO_CODES, _NO_CODES), (w_scales, _NO_SCALES, _NO_SCALES), out)
    return out


def gemm_q8_multi(a_codes: np.ndarray, a_scales: np.ndarray, codes: list[np.ndarray],
                  w_scales: list[np.ndarray], packs: list[Packed] | None = None,
                  vnni: bool | None = None) -> list[np.ndarray]:
    """``gemm_q8`` against up to three weights sharing K and G, in one pass: a list of float32 [M, N_i].

    The outputs are column slices of one [M, sum N_i] array; every output element is computed with the same
    arithmetic whatever the tile or the split into weights, so results are bit-identical to separate calls.
    ``packs``: each weight as ``Packed``; ``vnni`` as for gemm_q8.
    """
    if not 1 <= len(codes) <= MAX_WEIGHTS:
        raise ValueError(f"gemm_q8_multi takes 1 to {MAX_WEIGHTS} weights, got {len(codes)}")
    if _use_packed(vnni, packs or []):
        return _gemm_packed(a_codes, a_scales, packs or [Packed(c, s) for c, s in zip(codes, w_scales)])
    pad = MAX_WEIGHTS - len(codes)
    ns = [c.shape[0] for c in codes]
    out = np.empty((a_codes.shape[0], sum(ns)), dtype=np.float32)
    _run(a_codes, a_scales, (*codes, *([_NO_CODES] * pad)), (*w_scales, *([_NO_SCALES] * pad)), out)
    outs, start = [], 0
    for n in ns:
        outs.append(out[:, start:start + n])
        start += n
    return outs


def _gemm_packed(a_codes: np.ndarray, a_scales: np.ndarray, packs: list[Packed]) -> list[np.ndarray]:
    m, k = a_codes.shape
    rows = sum(p.codes.shape[0] for p in packs) * packed.PACK_COLS
    return packed.gemm_q8(a_codes, a_scales, packs, m * rows * k >= PARALLEL_MIN_MACS)


def _run(a_codes: np.ndarray, a_scales: np.ndarray, codes: tuple, w_scales: tuple, out: np.ndarray) -> None:
    m, k = a_codes.shape
    macs = out.size * k
    if macs == 0:
        out.fill(0)
        return
    kernel = _gemm_q8_parallel if macs >= PARALLEL_MIN_MACS else _gemm_q8_serial
    a16 = a_codes.astype(np.int16) if m >= TILE_MIN_M else _NO_A16
    kernel(a_codes, a16, a_scales, codes, w_scales, out)


def gemm_f32(a: np.ndarray, codes: np.ndarray, w_scales: np.ndarray, pack: Packed | None = None,
             vnni: bool | None = None) -> np.ndarray:
    """float32 [M, N] = sum_g w_scale[n,g] * sum_{k in g} a[m,k] * codes[n,k]; a: float32 [M, K], C order.
    ``pack``, ``vnni``: as for gemm_q8."""
    m, k = a.shape
    n = codes.shape[0]
    if m == 0 or n == 0 or k == 0:
        return np.zeros((m, n), dtype=np.float32)
    if _use_packed(vnni, [pack]):
        return packed.gemm_f32(a, pack or Packed(codes, w_scales), m * n * k >= PARALLEL_MIN_MACS)
    out = np.zeros((m, n), dtype=np.float32)
    kernel = _gemm_f32_parallel if m * n * k >= PARALLEL_MIN_MACS else _gemm_f32_serial
    kernel(a, codes, w_scales, out)
    return out
