"""Int8 and float32 GEMMs for CPUs with VNNI (AVX-512 VNNI, or AVX-VNNI), and for int4 weights on AVX2, on weights
repacked once (``Packed``).

The layout: W output columns x 4 consecutive k in one vector of 4W bytes (W = 16, a zmm, with AVX-512 VNNI;
W = 8, a ymm, with AVX-VNNI alone: Intel's client cores since Alder Lake), codes biased to unsigned (code +
128), zero codes in the padding to W columns; scales [column group, block, column]. An int4 weight packs two
such k-quads into one vector, the first in the low nibbles and the next in the high ones (code + 8), so its
decode GEMV streams half the bytes. ``vpdpbusd`` multiplies a vector by four activation bytes broadcast to all
W lanes, so each lane accumulates one output's block sum with no horizontal reduction, and the block epilogue
runs on W outputs at once. Without VNNI, AVX2 does the same for int4 weights (W = 8) in two steps,
``vpmaddubsw`` then ``vpmaddwd`` (``_dot``; exact for nibbles, it would saturate on int8 codes). The bias
comes back out exactly as 128 (int4: 8) x the block's activation sum, and the float part follows the
contract's order, so the int8 results equal ``reference_gemm_q8`` bit for bit. The float32 GEMM takes each k's
W codes out of the same vector as floats, one fused multiply-add per activation row; it is held to the
contract's bound.

Tiles are PACK_ROWS activation rows (their integer and float accumulators stay in registers: 8 rows in 32
zmm, 4 in AVX2's 16 ymm) or 1; every row runs the same sequence of operations in either, so a row's bits do
not depend on its batch. W is fixed when this module is imported (``VNNI_WIDTH``, 0 where the CPU has
neither; ``KESTREL_CPU_VNNI=256`` takes the ymm kernels on an AVX-512 CPU, which runs them too), and the
jitted functions carry it in their names, so numba's disk cache keeps each width's builds apart. The kernels
compile only when called, so importing this module on a CPU without VNNI is harmless. The intrinsics and the
functions that inline them share this file: numba's disk cache follows the jitted function's file.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kestrel_core.codegen import F32 as _F32
from kestrel_core.codegen import I8 as _I8
from kestrel_core.codegen import I32 as _I32
from kestrel_core.codegen import compiled_features, declared, named_copy
from kestrel_core.codegen import data_ptr as _data_ptr
from kestrel_core.codegen import splat as _splat
from kestrel_core.env import env_choice

MAX_WEIGHTS = 3  # one pass over up to three weights sharing K and G (Q|K|V, gate|up)
WIDTH_ENV = "KESTREL_CPU_VNNI"  # 256: the ymm kernels where the CPU also has the zmm ones
WIDTHS = ("512", "256")  # bits of the vpdpbusd vectors; 512, the default, where the CPU has them


def host_vnni_width(features: set[str] | None = None) -> int:
    """Output columns a ``vpdpbusd`` vector holds in the code numba compiles (``compiled_features``): 16 with
    AVX-512 (F, BW) VNNI, 8 with AVX-VNNI (or AVX-512 VNNI on 256-bit vectors), else 0. An intrinsic the
    target lacks would abort the process in LLVM's instruction selection, not raise."""
    if features is None:
        features = compiled_features()
    wide = {"+avx512f", "+avx512bw", "+avx512vnni"} <= features
    narrow = "+avx2" in features and ("+avxvnni" in features or {"+avx512vnni", "+avx512vl"} <= features)
    if wide and env_choice(WIDTH_ENV, WIDTHS, default="512") == "512":
        return 16
    return 8 if narrow else 0


def host_pack_width(features: set[str] | None = None) -> int:
    """Output columns a packed vector holds for int4 weights: the VNNI width, else 8 on AVX2 (with FMA, which the
    float32 tile needs), where ``vpmaddubsw`` then ``vpmaddwd`` sum a lane's four nibble products exactly (on
    int8 codes the first would saturate), else 0."""
    if features is None:
        features = compiled_features()
    return host_vnni_width(features) or (8 if {"+avx2", "+fma"} <= features else 0)


VNNI_WIDTH = host_vnni_width()
HAS_VNNI = VNNI_WIDTH > 0
PACKED_BITS = (8, 4) if HAS_VNNI else (4,) if host_pack_width() else ()  # weights the packed kernels take
PACK_COLS = VNNI_WIDTH or (8 if PACKED_BITS else 16)  # output columns per packed vector (one int32 lane each)
PACK_K = 4  # consecutive k per lane (vpdpbusd's dot product width)
BIAS = {8: 128, 4: 8}  # what a packed code adds to its signed value
PACK_ROWS = 8 if PACK_COLS == 16 else 4  # activation rows per tile: their accumulators stay in registers
_VI = ir.VectorType(_I32, PACK_COLS)
_VF = ir.VectorType(_F32, PACK_COLS)
_DOT = f"llvm.x86.avx512.vpdpbusd.{32 * PACK_COLS}"  # LLVM emits the VEX form for AVX-VNNI
_FMA = f"llvm.fma.v{PACK_COLS}f32"


def _row_ptrs(context: Any, builder: ir.IRBuilder, aryty: Any, ary: ir.Value, base: ir.Value, stride: ir.Value,
              rows: int) -> list[ir.Value]:
    """Pointers to rows base, base + stride, ... of a flat array argument, one per tile row."""
    return [_data_ptr(context, builder, aryty, ary, builder.add(base, builder.mul(stride, ir.Constant(base.type, r))))
            for r in range(rows)]


def _block_scales(builder: ir.IRBuilder, pws: ir.Value, g: ir.Value, idx: ir.IntType) -> ir.Value:
    """The W columns' scales of block ``g``: <W x float>."""
    at = builder.gep(pws, [builder.mul(g, ir.Constant(idx, PACK_COLS))])
    return builder.load(builder.bitcast(at, _VF.as_pointer()), align=4)


def _store_rows(context: Any, builder: ir.IRBuilder, aryty: Any, out: ir.Value, out_off: ir.Value,
                out_stride: ir.Value, facc: list[ir.Value]) -> None:
    """Each row's W accumulated outputs to out[out_off + r * out_stride ...]."""
    idx = out_off.type
    pout = _data_ptr(context, builder, aryty, out, out_off)
    for r, acc in enumerate(facc):
        dst = builder.gep(pout, [builder.mul(out_stride, ir.Constant(idx, r))])
        builder.store(builder.load(acc), builder.bitcast(dst, _VF.as_pointer()), align=4)


def _nibbles(builder: ir.IRBuilder, wv: ir.Value) -> tuple[ir.Value, ir.Value]:
    """An int4 vector's two k-quads, each byte's low nibble and its high one, as vectors of bytes in [0, 15]."""
    mask = ir.Constant(wv.type, [0x0F0F0F0F] * wv.type.count)
    return builder.and_(wv, mask), builder.and_(builder.lshr(wv, ir.Constant(wv.type, [4] * wv.type.count)), mask)


def _dot(builder: ir.IRBuilder, acc: ir.Value, w: ir.Value, a: ir.Value) -> ir.Value:
    """acc + each int32 lane's four products of w's unsigned bytes and a's signed ones: ``vpdpbusd`` with VNNI;
    else (AVX2, int4 weights only) ``vpmaddubsw``'s int16 pair sums, exact for nibbles (2 x 15 x 128), summed in
    pairs by ``vpmaddwd``."""
    if HAS_VNNI:
        return builder.call(declared(builder, _DOT, _VI, _VI, _VI, _VI), [acc, w, a])
    v8, v16 = ir.VectorType(_I8, 4 * PACK_COLS), ir.VectorType(ir.IntType(16), 2 * PACK_COLS)
    pairs = builder.call(declared(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, v8, v8),
                         [builder.bitcast(w, v8), builder.bitcast(a, v8)])
    quads = builder.call(declared(builder, "llvm.x86.avx2.pmadd.wd", _VI, v16, v16),
                         [pairs, ir.Constant(v16, [1] * 2 * PACK_COLS)])
    return builder.add(acc, quads)


def _make_packed_tile(rows: int, bits: int) -> Any:
    """An intrinsic for ``rows`` activation rows x W packed columns of a ``bits`` weight: out[m0+r, Wj + c] for
    c < W.

    Arguments (offsets in elements of flat C-ordered arrays): wp uint8 packed codes, wp_off (column group j);
    wsp float32 packed scales, wsp_off; a int8, a_off (row m0), a_stride; a_scales and a_sums (int32 block
    sums of the activations), as_off, as_stride; ng; gq (packed vectors per block: G/4, int4 G/8); out,
    out_off, out_stride.
    """
    quads = 8 // bits  # k-quads a vector holds

    @intrinsic
    def packed_tile(typingctx: Any, wp: Any, wp_off: Any, wsp: Any, wsp_off: Any, a: Any, a_off: Any,
                    a_stride: Any, asc: Any, asum: Any, as_off: Any, as_stride: Any, ng: Any, gq: Any, out: Any,
                    out_off: Any, out_stride: Any) -> Any:
        sig = types.void(wp, wp_off, wsp, wsp_off, a, a_off, a_stride, asc, asum, as_off, as_stride, ng, gq, out,
                         out_off, out_stride)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list[ir.Value]) -> Any:
            (wp_, wp_off_, wsp_, wsp_off_, a_, a_off_, a_stride_, asc_, asum_, as_off_, as_stride_, ng_, gq_,
             out_, out_off_, out_stride_) = args
            targs = signature.args
            idx = wp_off_.type
            pw = _data_ptr(context, builder, targs[0], wp_, wp_off_)
            pws = _data_ptr(context, builder, targs[2], wsp_, wsp_off_)
            pa = _row_ptrs(context, builder, targs[4], a_, a_off_, a_stride_, rows)
            pas = _row_ptrs(context, builder, targs[7], asc_, as_off_, as_stride_, rows)
            psum = _row_ptrs(context, builder, targs[8], asum_, as_off_, as_stride_, rows)
            facc = [cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * PACK_COLS)) for _ in range(rows)]
            iacc = [cgutils.alloca_once(builder, _VI) for _ in range(rows)]
            vec_bytes = ir.Constant(idx, PACK_COLS * PACK_K)
            with cgutils.for_range(builder, ng_) as gloop:
                g = gloop.index
                for r in range(rows):
                    builder.store(ir.Constant(_VI, [0] * PACK_COLS), iacc[r])
                with cgutils.for_range(builder, gq_) as qloop:
                    vec = builder.add(builder.mul(g, gq_), qloop.index)
                    wv = builder.load(builder.bitcast(builder.gep(pw, [builder.mul(vec, vec_bytes)]),
                                                      _VI.as_pointer()), align=1)
                    for q, wq in enumerate((wv,) if bits == 8 else _nibbles(builder, wv)):
                        a_at = builder.add(builder.mul(vec, ir.Constant(idx, quads * PACK_K)),
                                           ir.Constant(idx, q * PACK_K))
                        for r in range(rows):  # four activation bytes, the same in every lane
                            a4 = builder.load(builder.bitcast(builder.gep(pa[r], [a_at]), _I32.as_pointer()), align=1)
                            acc = _dot(builder, builder.load(iacc[r]), wq, _splat(builder, a4, _VI))
                            builder.store(acc, iacc[r])
                # exact block sums: the bias on every code comes back out as bias x sum(a); then the contract's
                # float order, (float(sum_g) * a_scale) * w_scale added in block order, no FMA
                wsv = _block_scales(builder, pws, g, idx)
                for r in range(rows):
                    bias = builder.mul(builder.load(builder.gep(psum[r], [g])), ir.Constant(_I32, BIAS[bits]))
                    total = builder.sitofp(builder.sub(builder.load(iacc[r]), _splat(builder, bias, _VI)), _VF)
                    a_sc = _splat(builder, builder.load(builder.gep(pas[r], [g])), _VF)
                    term = builder.fmul(builder.fmul(total, a_sc), wsv)
                    builder.store(builder.fadd(builder.load(facc[r]), term), facc[r])
            _store_rows(context, builder, targs[13], out_, out_off_, out_stride_, facc)
            return context.get_dummy_value()

        return sig, codegen

    return packed_tile


def _make_packed_f32_tile(rows: int, bits: int) -> Any:
    """An intrinsic like the int8 packed tile for float32 activations: out[m0+r, Wj + c] = sum_g w_scale *
    (sum_{k in g} a[k] * code[k]), the codes of each k taken out of the packed vector as W floats and
    multiplied into W lanes with a fused multiply-add, k in increasing order whatever ``bits`` (the float32
    path has no fixed order: it is held to the contract's bound, not to the reference's bits; every row runs
    the same sequence whatever the tile).

    Arguments: wp, wp_off, wsp, wsp_off as the int8 tile's; a float32, a_off, a_stride; ng; gq; out, out_off,
    out_stride.
    """
    quads = 8 // bits

    @intrinsic
    def packed_f32_tile(typingctx: Any, wp: Any, wp_off: Any, wsp: Any, wsp_off: Any, a: Any, a_off: Any,
                        a_stride: Any, ng: Any, gq: Any, out: Any, out_off: Any, out_stride: Any) -> Any:
        sig = types.void(wp, wp_off, wsp, wsp_off, a, a_off, a_stride, ng, gq, out, out_off, out_stride)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list[ir.Value]) -> Any:
            wp_, wp_off_, wsp_, wsp_off_, a_, a_off_, a_stride_, ng_, gq_, out_, out_off_, out_stride_ = args
            targs = signature.args
            idx = wp_off_.type
            fma = declared(builder, _FMA, _VF, _VF, _VF, _VF)
            v64 = ir.VectorType(_I8, PACK_COLS * PACK_K)
            vec_bytes = ir.Constant(idx, PACK_COLS * PACK_K)
            pw = _data_ptr(context, builder, targs[0], wp_, wp_off_)
            pws = _data_ptr(context, builder, targs[2], wsp_, wsp_off_)
            pa = _row_ptrs(context, builder, targs[4], a_, a_off_, a_stride_, rows)
            facc = [cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * PACK_COLS)) for _ in range(rows)]
            bacc = [cgutils.alloca_once(builder, _VF) for _ in range(rows)]
            bias = ir.Constant(_VF, [float(BIAS[bits])] * PACK_COLS)
            with cgutils.for_range(builder, ng_) as gloop:
                g = gloop.index
                for r in range(rows):
                    builder.store(ir.Constant(_VF, [0.0] * PACK_COLS), bacc[r])
                with cgutils.for_range(builder, gq_) as qloop:
                    vec = builder.add(builder.mul(g, gq_), qloop.index)
                    wv = builder.load(builder.bitcast(builder.gep(pw, [builder.mul(vec, vec_bytes)]),
                                                      _VI.as_pointer()), align=1)
                    for q, wq in enumerate((wv,) if bits == 8 else _nibbles(builder, wv)):
                        wb = builder.bitcast(wq, v64)
                        for kk in range(PACK_K):
                            cols = builder.shuffle_vector(wb, ir.Constant(v64, ir.Undefined), ir.Constant(
                                ir.VectorType(_I32, PACK_COLS), [PACK_K * c + kk for c in range(PACK_COLS)]))
                            wk = builder.fsub(builder.uitofp(cols, _VF), bias)  # the codes, exactly
                            at = builder.add(builder.mul(vec, ir.Constant(idx, quads * PACK_K)),
                                             ir.Constant(idx, q * PACK_K + kk))
                            for r in range(rows):
                                av = _splat(builder, builder.load(builder.gep(pa[r], [at])), _VF)
                                builder.store(builder.call(fma, [av, wk, builder.load(bacc[r])]), bacc[r])
                wsv = _block_scales(builder, pws, g, idx)
                for r in range(rows):
                    builder.store(builder.call(fma, [builder.load(bacc[r]), wsv, builder.load(facc[r])]), facc[r])
            _store_rows(context, builder, targs[9], out_, out_off_, out_stride_, facc)
            return context.get_dummy_value()

        return sig, codegen

    return packed_f32_tile


# Each bits' tiles (PACK_ROWS rows, and one) and k-quads a packed vector; the bodies below name the int8 ones,
# and each bits' build of a body gets its own (``_builds``), so a model's int8 weights compile no int4 code.
_TILES = {bits: (_make_packed_tile(PACK_ROWS, bits), _make_packed_tile(1, bits), 8 // bits) for bits in (8, 4)}
_F32_TILES = {bits: (_make_packed_f32_tile(PACK_ROWS, bits), _make_packed_f32_tile(1, bits), 8 // bits)
              for bits in (8, 4)}
_tile_rows, _tile_one, _QUADS = _TILES[8]
_f32_rows, _f32_one, _ = _F32_TILES[8]


def _gemm_packed_body(wps: tuple, wsps: tuple, a: np.ndarray, a_scales: np.ndarray, out: np.ndarray) -> None:
    # wps[i]: [NG_i, K/4 * 4W] uint8 packed codes (int4: K/8 * 4W); wsps[i]: [NG_i, ng * W] packed scales
    # (NG_i = 0 pads the tuple); a: [M, K] int8; a_scales: [M, ng]; out: [M, sum NG_i * W], weight i in its
    # groups' columns. A column group's packed codes stay in cache for all its row tiles.
    m_rows, k = a.shape
    ng = a_scales.shape[1]
    g_size = k // ng
    gq = g_size // (PACK_K * _QUADS)  # packed vectors a block
    a_sums = np.empty((m_rows, ng), np.int32)  # the bias's correction: each activation block's sum
    for m in range(m_rows):
        for g in range(ng):
            total = np.int32(0)
            for i in range(g * g_size, (g + 1) * g_size):
                total += np.int32(a[m, i])
            a_sums[m, g] = total
    nw = len(wps)
    start = np.zeros(nw + 1, np.int64)  # each weight's first column group
    for i in range(nw):
        start[i + 1] = start[i] + wps[i].shape[0]
    m8 = m_rows - m_rows % PACK_ROWS
    n_out = out.shape[1]
    for j in prange(start[nw]):
        i = 0
        while j >= start[i + 1]:
            i += 1
        wp, wsp, jj = wps[i], wsps[i], j - start[i]
        for m in range(0, m8, PACK_ROWS):
            _tile_rows(wp, jj * wp.shape[1], wsp, jj * wsp.shape[1], a, m * k, k, a_scales, a_sums, m * ng, ng, ng,
                       gq, out, m * n_out + j * PACK_COLS, n_out)
        for m in range(m8, m_rows):
            _tile_one(wp, jj * wp.shape[1], wsp, jj * wsp.shape[1], a, m * k, k, a_scales, a_sums, m * ng, ng, ng,
                      gq, out, m * n_out + j * PACK_COLS, n_out)


def _gemm_packed_f32_body(wp: np.ndarray, wsp: np.ndarray, a: np.ndarray, out: np.ndarray) -> None:
    # wp, wsp: one packed weight; a: [M, K] float32; out: [M, NG * W]
    m_rows, k = a.shape
    ng = wsp.shape[1] // PACK_COLS
    gq = k // ng // (PACK_K * _QUADS)
    m8 = m_rows - m_rows % PACK_ROWS
    n_out = out.shape[1]
    for j in prange(wp.shape[0]):
        for m in range(0, m8, PACK_ROWS):
            _f32_rows(wp, j * wp.shape[1], wsp, j * wsp.shape[1], a, m * k, k, ng, gq, out,
                      m * n_out + j * PACK_COLS, n_out)
        for m in range(m8, m_rows):
            _f32_one(wp, j * wp.shape[1], wsp, j * wsp.shape[1], a, m * k, k, ng, gq, out,
                     m * n_out + j * PACK_COLS, n_out)


def _pack_body(words: np.ndarray, scales: np.ndarray, bits: int, out: np.ndarray, out_scales: np.ndarray) -> None:
    # words: a weight's codes [N, K] as uint32 [N, K/4] (four k a word); scales: [N, ng]; out: uint32 [NG, K/4, W]
    # (int4: [NG, K/8, W]), words of column c of group g at [g, :, c]; out_scales: [NG, ng, W]. Adding the bias
    # byte by byte: int8, code + 128 flips the top bit; int4 (codes in [-8, 7]), code + 8 is its low nibble
    # with the nibble's top bit flipped.
    n = words.shape[0]
    ng = scales.shape[1]
    n_vec = out.shape[1]
    pad = np.uint32(0x80808080) if bits == 8 else np.uint32(0x88888888)  # zero codes, biased
    for g in prange(out.shape[0]):
        for c in range(PACK_COLS):
            row = g * PACK_COLS + c
            for b in range(ng):
                out_scales[g, b, c] = scales[row, b] if row < n else np.float32(0)
        for v in range(n_vec):
            for c in range(PACK_COLS):
                row = g * PACK_COLS + c
                if row >= n:
                    out[g, v, c] = pad
                elif bits == 8:
                    out[g, v, c] = words[row, v] ^ np.uint32(0x80808080)
                else:  # the k-octet's first quad in the low nibbles, its second in the high ones
                    lo = (words[row, 2 * v] & np.uint32(0x0F0F0F0F)) ^ np.uint32(0x08080808)
                    hi = (words[row, 2 * v + 1] & np.uint32(0x0F0F0F0F)) ^ np.uint32(0x08080808)
                    out[g, v, c] = lo | (hi << np.uint32(4))


# A parallel build, and a serial one for small weights: packing one must not start the OpenMP threads in a
# process that forks after it (the plugin probe's server warms the kernels on a tiny weight; a forked child of
# a process using GNU OpenMP is terminated at its first parallel region).
_pack_parallel = njit(parallel=True, cache=True, nogil=True)(named_copy(_pack_body, f"_parallel_w{PACK_COLS}"))
_pack_serial = njit(cache=True, nogil=True)(named_copy(_pack_body, f"_serial_w{PACK_COLS}"))
PACK_PARALLEL_MIN_BYTES = 1 << 20


class Packed:
    """One weight in the VNNI layout, W = PACK_COLS: ``codes`` uint8 [N/W, K/4 * 4W] (column group, k-quad,
    column, k; code + 128; N padded to W with zero codes), or for ``bits`` 4 [N/W, K/8 * 4W] (column group,
    k-octet, column, k: the octet's first quad in the low nibbles, code + 8); ``scales`` float32 [N/W, ng * W]
    (column group, block, column); ``n`` its rows."""

    __slots__ = ("codes", "scales", "n", "bits", "nbytes")

    def __init__(self, codes: np.ndarray, scales: np.ndarray, bits: int = 8) -> None:
        n, k = codes.shape
        ng = scales.shape[1]
        groups = -(-n // PACK_COLS)
        self.n, self.bits = n, bits
        words = np.ascontiguousarray(codes).view(np.uint32)  # [N, K/4]
        out = np.empty((groups, k // (PACK_K * 8 // bits), PACK_COLS), np.uint32)
        out_scales = np.empty((groups, ng, PACK_COLS), np.float32)
        if out.size:  # the empty weight that pads a pass needs no kernel (nor its compilation on import)
            pack = _pack_parallel if codes.nbytes >= PACK_PARALLEL_MIN_BYTES else _pack_serial
            pack(words, np.ascontiguousarray(scales), bits, out, out_scales)
        self.codes = out.view(np.uint8).reshape(groups, out.shape[1] * PACK_COLS * 4)
        self.scales = out_scales.reshape(groups, ng * PACK_COLS)
        self.nbytes = self.codes.nbytes + self.scales.nbytes


NO_PACKED = Packed(np.zeros((0, 32), np.int8), np.zeros((0, 1), np.float32))


def _builds(body: Any, tiles: dict[int, tuple[Any, Any, int]], rows: str, one: str) -> dict[tuple[int, bool], Any]:
    """(bits, parallel) -> a jitted build of ``body`` on that bits' tiles; the serial ones are for small products,
    where waking the second thread costs more than it saves."""
    return {(bits, parallel): njit(parallel=parallel, cache=True, nogil=True)(named_copy(
        body, f"_{'parallel' if parallel else 'serial'}_int{bits}_w{PACK_COLS}",
        **{rows: tiles[bits][0], one: tiles[bits][1], "_QUADS": tiles[bits][2]}))
        for bits in tiles for parallel in (True, False)}


Q8_BUILDS = _builds(_gemm_packed_body, _TILES, "_tile_rows", "_tile_one")
F32_BUILDS = _builds(_gemm_packed_f32_body, _F32_TILES, "_f32_rows", "_f32_one")


def gemm_q8(a_codes: np.ndarray, a_scales: np.ndarray, packs: list[Packed], parallel: bool) -> list[np.ndarray]:
    """The contract's int8 GEMM of activations [M, K] (scales [M, K/G]) against each packed weight: float32
    [M, N_i] each, column slices of one array (one pass where the weights share their bits)."""
    bits = packs[0].bits
    if bits not in PACKED_BITS:  # int8 weights need VNNI: vpmaddubsw would saturate on them
        raise ValueError(f"this CPU's packed kernels take {PACKED_BITS}-bit weights, not {bits}-bit")
    if any(p.bits != bits for p in packs):
        return [out for p in packs for out in gemm_q8(a_codes, a_scales, [p], parallel)]
    m, _ = a_codes.shape
    pad = [NO_PACKED] * (MAX_WEIGHTS - len(packs))
    out = np.empty((m, sum(p.codes.shape[0] for p in packs) * PACK_COLS), dtype=np.float32)
    if out.size:
        Q8_BUILDS[bits, parallel](tuple(p.codes for p in packs + pad), tuple(p.scales for p in packs + pad), a_codes,
                            a_scales, out)
    outs, start = [], 0
    for p in packs:
        outs.append(out[:, start:start + p.n])
        start += p.codes.shape[0] * PACK_COLS
    return outs


def gemm_f32(a: np.ndarray, pack: Packed, parallel: bool) -> np.ndarray:
    """float32 [M, N] of float32 activations [M, K] against a packed weight."""
    out = np.empty((a.shape[0], pack.codes.shape[0] * PACK_COLS), dtype=np.float32)
    F32_BUILDS[pack.bits, parallel](pack.codes, pack.scales, a, out)
    return np.ascontiguousarray(out[:, :pack.n])
