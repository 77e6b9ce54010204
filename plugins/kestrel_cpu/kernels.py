"""Compiled int8 strip-cache kernels (numba + explicit LLVM vector IR).

Why explicit vector IR: numba turns SLP vectorisation off (numba#8705) and LLVM fully unrolls a constant
32-wide block loop before the loop vectoriser sees it, so a plain ``for k in range(32)`` int8 dot product
compiles to scalar code (~1 GB/s). The intrinsics below spell one 32-byte chunk as
``mul(sext <32 x i8>, sext <32 x i8>)`` folded even+odd, which the x86 backend lowers to
``vpmovsxbw + vpmaddwd`` on AVX2 (and to plain vector code on other targets), and keep eight float lanes per
output so a K-block costs no horizontal reduction.

The maths is the contract's: each K-block's integer sum is exact (int32 lanes, |sum| <= 127*127*256); the
float part differs from ``reference_gemm_q8`` only in rounding order: each of the 8 lanes of a block sum
is scaled by ``a_scale*w_scale`` (rounded once) and the per-row float sum runs lane-wise, then across lanes.

This module lives in one file on purpose: numba's on-disk cache is invalidated by the timestamp of the file
that holds the jitted function, so the intrinsics it inlines must sit in the same file.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

CHUNK = 32  # int8 values per vector step; every group size (32, 256) is a multiple
LANES = 8

_I8, _I32, _F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()


def _data_ptr(context: Any, builder: ir.IRBuilder, aryty: Any, ary: ir.Value, offset: ir.Value) -> ir.Value:
    return builder.gep(context.make_array(aryty)(context, builder, ary).data, [offset])


def _reduce_fadd(builder: ir.IRBuilder, vec: ir.Value) -> ir.Value:
    name = f"llvm.vector.reduce.fadd.v{vec.type.count}f32"
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(_F32, [_F32, vec.type]), name)
    return builder.call(fn, [ir.Constant(_F32, 0.0), vec], fastmath=("reassoc",))


def _splat(builder: ir.IRBuilder, value: ir.Value, n: int) -> ir.Value:
    vty = ir.VectorType(value.type, n)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _make_rows_dot(rows: int) -> Any:
    """An intrinsic computing ``rows`` outputs out[m0+r, n] = sum_g blocksum(a[m0+r], w[n], g) * as * ws.

    Arguments (all offsets in elements of the flat C-ordered arrays):
    a int8, a_off (row m0, col 0), a_stride (=K); a_scales f32, as_off, as_stride (=ng);
    w int8, w_off (row n, col 0); w_scales f32, ws_off; ng; nchunk (=G/32); out f32, out_off, out_stride.
    """

    @intrinsic
    def rows_dot(typingctx: Any, a: Any, a_off: Any, a_stride: Any, asc: Any, as_off: Any, as_stride: Any,
                 w: Any, w_off: Any, wsc: Any, ws_off: Any, ng: Any, nchunk: Any, out: Any, out_off: Any,
                 out_stride: Any) -> Any:
        sig = types.void(a, a_off, a_stride, asc, as_off, as_stride, w, w_off, wsc, ws_off, ng, nchunk, out,
                         out_off, out_stride)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list[ir.Value]) -> Any:
            (va_, a_off_, a_stride_, vas_, as_off_, as_stride_, vw_, w_off_, vws_, ws_off_, ng_, nchunk_,
             vout_, out_off_, out_stride_) = args
            targs = signature.args
            idx = a_off_.type
            pa = [_data_ptr(context, builder, targs[0], va_,
                            builder.add(a_off_, builder.mul(a_stride_, ir.Constant(idx, r))))
                  for r in range(rows)]
            pas = [_data_ptr(context, builder, targs[3], vas_,
                             builder.add(as_off_, builder.mul(as_stride_, ir.Constant(idx, r))))
                   for r in range(rows)]
            pw = _data_ptr(context, builder, targs[6], vw_, w_off_)
            pws = _data_ptr(context, builder, targs[8], vws_, ws_off_)

            v32i8 = ir.VectorType(_I8, CHUNK)
            v32i32 = ir.VectorType(_I32, CHUNK)
            v8i32 = ir.VectorType(_I32, LANES)
            v8f = ir.VectorType(_F32, LANES)
            even = ir.Constant(ir.VectorType(_I32, 16), list(range(0, CHUNK, 2)))
            odd = ir.Constant(ir.VectorType(_I32, 16), list(range(1, CHUNK, 2)))
            lo = ir.Constant(v8i32, list(range(0, 8)))
            hi = ir.Constant(v8i32, list(range(8, 16)))
            facc = [cgutils.alloca_once_value(builder, ir.Constant(v8f, [0.0] * LANES)) for _ in range(rows)]
            iacc = [cgutils.alloca_once(builder, v8i32) for _ in range(rows)]
            group = builder.mul(nchunk_, ir.Constant(idx, CHUNK))

            with cgutils.for_range(builder, ng_) as gloop:
                g = gloop.index
                base = builder.mul(g, group)
                for r in range(rows):
                    builder.store(ir.Constant(v8i32, [0] * LANES), iacc[r])
                with cgutils.for_range(builder, nchunk_) as cloop:
                    off = builder.add(base, builder.mul(cloop.index, ir.Constant(idx, CHUNK)))
                    wv = builder.load(builder.bitcast(builder.gep(pw, [off]), v32i8.as_pointer()), align=1)
                    wv = builder.sext(wv, v32i32)
                    for r in range(rows):
                        av = builder.load(builder.bitcast(builder.gep(pa[r], [off]), v32i8.as_pointer()),
                                          align=1)
                        # products fit in 16 bits: this even+odd fold is exactly vpmaddwd's semantics
                        p = builder.mul(builder.sext(av, v32i32), wv)
                        s16 = builder.add(builder.shuffle_vector(p, p, even), builder.shuffle_vector(p, p, odd))
                        s8 = builder.add(builder.shuffle_vector(s16, s16, lo),
                                         builder.shuffle_vector(s16, s16, hi))
                        builder.store(builder.add(builder.load(iacc[r]), s8), iacc[r])
                ws = builder.load(builder.gep(pws, [g]))
                for r in range(rows):
                    scale = builder.fmul(builder.load(builder.gep(pas[r], [g])), ws)
                    lanes = builder.sitofp(builder.load(iacc[r]), v8f)
                    builder.store(builder.fadd(builder.load(facc[r]),
                                               builder.fmul(lanes, _splat(builder, scale, LANES))), facc[r])

            pout = _data_ptr(context, builder, targs[12], vout_, out_off_)
            for r in range(rows):
                dst = builder.gep(pout, [builder.mul(out_stride_, ir.Constant(idx, r))])
                builder.store(_reduce_fadd(builder, builder.load(facc[r])), dst)
            return context.get_dummy_value()

        return sig, codegen

    return rows_dot


_rows_dot1 = _make_rows_dot(1)
_rows_dot4 = _make_rows_dot(4)


def _gemm_q8_body(a: np.ndarray, a_scales: np.ndarray, codes: np.ndarray, w_scales: np.ndarray,
                  out: np.ndarray) -> None:
    # a: [M, K] int8; a_scales: [M, ng]; codes: [N, K] int8; w_scales: [N, ng]; out: [M, N] float32
    m_rows, k = a.shape
    n_rows = codes.shape[0]
    ng = w_scales.shape[1]
    nchunk = k // ng // CHUNK
    m4 = m_rows - m_rows % 4
    for n in prange(n_rows):
        for m in range(0, m4, 4):  # four activation rows share each loaded weight chunk
            _rows_dot4(a, m * k, k, a_scales, m * ng, ng, codes, n * k, w_scales, n * ng, ng, nchunk,
                       out, m * n_rows + n, n_rows)
        for m in range(m4, m_rows):
            _rows_dot1(a, m * k, k, a_scales, m * ng, ng, codes, n * k, w_scales, n * ng, ng, nchunk,
                       out, m * n_rows + n, n_rows)


def _gemm_q8_multi_body(a: np.ndarray, a_scales: np.ndarray, codes: tuple, w_scales: tuple,
                        row_start: np.ndarray, out: np.ndarray) -> None:
    # Several weights sharing K and G in one parallel pass: weight i fills out[:, row_start[i]:row_start[i+1]]
    m_rows, k = a.shape
    n_total = out.shape[1]
    ng = a_scales.shape[1]
    nchunk = k // ng // CHUNK
    m4 = m_rows - m_rows % 4
    for j in prange(n_total):
        i = 0
        while j >= row_start[i + 1]:
            i += 1
        n = j - row_start[i]
        c = codes[i]
        s = w_scales[i]
        for m in range(0, m4, 4):
            _rows_dot4(a, m * k, k, a_scales, m * ng, ng, c, n * k, s, n * ng, ng, nchunk, out, m * n_total + j,
                       n_total)
        for m in range(m4, m_rows):
            _rows_dot1(a, m * k, k, a_scales, m * ng, ng, c, n * k, s, n * ng, ng, nchunk, out, m * n_total + j,
                       n_total)


# Two builds of the same body: a parallel one, and a serial one for small products where waking the second
# thread costs more than it saves (a decode k/v projection is 110 KB).
_gemm_q8_parallel = njit(parallel=True, cache=True, nogil=True)(_gemm_q8_body)
_gemm_q8_serial = njit(cache=True, nogil=True)(_gemm_q8_body)

_gemm_q8_multi_parallel = njit(parallel=True, cache=True, nogil=True)(_gemm_q8_multi_body)
_gemm_q8_multi_serial = njit(cache=True, nogil=True)(_gemm_q8_multi_body)

PARALLEL_MIN_MACS = 1 << 18


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
_gemm_f32_parallel = njit(parallel=True, cache=True, nogil=True, fastmath=_F32_MATH)(_gemm_f32_body)
_gemm_f32_serial = njit(cache=True, nogil=True, fastmath=_F32_MATH)(_gemm_f32_body)


def gemm_q8(a_codes: np.ndarray, a_scales: np.ndarray, codes: np.ndarray, w_scales: np.ndarray) -> np.ndarray:
    """float32 [M, N] = contract GEMM of int8 activations [M, K] (scales [M, K/G]) and codes [N, K].

    The caller checks shapes and dtypes; arrays must be C-contiguous.
    """
    m, k = a_codes.shape
    n = codes.shape[0]
    out = np.empty((m, n), dtype=np.float32)
    if m == 0 or n == 0 or k == 0:
        out.fill(0)
        return out
    kernel = _gemm_q8_parallel if m * n * k >= PARALLEL_MIN_MACS else _gemm_q8_serial
    kernel(a_codes, a_scales, codes, w_scales, out)
    return out


def gemm_q8_multi(a_codes: np.ndarray, a_scales: np.ndarray, codes: list[np.ndarray],
                  w_scales: list[np.ndarray]) -> list[np.ndarray]:
    """``gemm_q8`` against several weights sharing K and G, in one pass: a list of float32 [M, N_i].

    The outputs are column slices of one [M, sum N_i] array; each output element is computed exactly as
    ``gemm_q8`` computes it (same per-row arithmetic), so results are bit-identical to separate calls.
    """
    m, k = a_codes.shape
    ns = [c.shape[0] for c in codes]
    row_start = np.zeros(len(ns) + 1, dtype=np.int64)
    np.cumsum(ns, out=row_start[1:])
    total = int(row_start[-1])
    out = np.empty((m, total), dtype=np.float32)
    if m == 0 or total == 0 or k == 0:
        out.fill(0)
    else:
        kernel = _gemm_q8_multi_parallel if m * total * k >= PARALLEL_MIN_MACS else _gemm_q8_multi_serial
        kernel(a_codes, a_scales, tuple(codes), tuple(w_scales), row_start, out)
    return [out[:, row_start[i]:row_start[i + 1]] for i in range(len(ns))]


def gemm_f32(a: np.ndarray, codes: np.ndarray, w_scales: np.ndarray) -> np.ndarray:
    """float32 [M, N] = sum_g w_scale[n,g] * sum_{k in g} a[m,k] * codes[n,k]; a: float32 [M, K], C order."""
    m, k = a.shape
    n = codes.shape[0]
    out = np.zeros((m, n), dtype=np.float32)
    if m == 0 or n == 0 or k == 0:
        return out
    kernel = _gemm_f32_parallel if m * n * k >= PARALLEL_MIN_MACS else _gemm_f32_serial
    kernel(a, codes, w_scales, out)
    return out
