"""The host paged attention's vector kernels as numba intrinsics (kestrel_core.model.paged_attention): LLVM IR
that holds its sums in registers and takes exp on whole vectors, each step the fixed float32 operation of the
plain functions it stands for, so compiled and plain runs agree."""

from __future__ import annotations

from typing import Any

import numpy as np

from kestrel_core.model.kernels import EXP_FLOOR, EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_POLY

LANES = 16  # positions (keys) or dims (values) a vector holds
SCORE_SUMS = 8  # sums a vector kernel holds in registers: heads x position vectors (``score_vectors``)
KV_GROUP = 32  # dims an int8 key's or value's scale covers (Q8_0's block)


def score_vectors(heads: int) -> int:
    """Position vectors of the vector kernel that scores ``heads`` query heads (1 to 4) at once, each key vector
    widened once for all of them: their sums within SCORE_SUMS (2 at least)."""
    return max(2, SCORE_SUMS // heads)


def _mul_add(builder: Any, a: Any, b: Any, c: Any) -> Any:
    """a * b + c on <LANES x float>, one fused multiply-add where the target has one (``llvm.fmuladd``)."""
    from kestrel_core.codegen import declared

    return builder.call(declared(builder, f"llvm.fmuladd.v{LANES}f32", a.type, a.type, a.type, a.type), [a, b, c])


def make_key_scores(heads: int, native: bool) -> Any:
    """paged_attention's ``_key_scores`` of ``heads`` heads over ``score_vectors(heads)`` vectors from
    offs[o_first] as an intrinsic: the sums in registers, each key vector widened from float16
    (``codegen.half_to_float``) or int8 once."""
    vectors = score_vectors(heads)
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from kestrel_core.codegen import F32, I8, I16, data_ptr, half_to_float, index_args, splat

    vh, vb, vf = ir.VectorType(I16, LANES), ir.VectorType(I8, LANES), ir.VectorType(F32, LANES)

    @intrinsic
    def key_scores_ir(typingctx: Any, q: Any, q_off: Any, hd: Any, kt: Any, ks: Any, offs: Any, soffs: Any,
                      o_first: Any, stride: Any, scores: Any, s_off: Any, s_head: Any) -> Any:
        sig = types.void(q, q_off, hd, kt, ks, offs, soffs, o_first, stride, scores, s_off, s_head)
        quantized = kt.dtype == types.int8

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list[ir.Value]) -> Any:
            ty = signature.args
            q_, q_off_, hd_, kt_, ks_, offs_, soffs_, o_first_, stride_, scores_, s_off_, s_head_ = index_args(
                context, builder, args, ty)
            idx = q_off_.type

            def const(value: int) -> ir.Value:
                return ir.Constant(idx, value)

            def starts(arg: int, ary: ir.Value, at: ir.Value) -> list[ir.Value]:  # each vector's first element
                return [data_ptr(context, builder, ty[arg], ary, builder.load(data_ptr(
                    context, builder, ty[at], offs_ if at == 5 else soffs_, builder.add(o_first_, const(t)))))
                    for t in range(vectors)]

            def zero() -> ir.Value:
                return cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * LANES))

            pq = [data_ptr(context, builder, ty[0], q_, builder.add(q_off_, builder.mul(hd_, const(h))))
                  for h in range(heads)]
            keys = starts(3, kt_, 5)
            acc = [[zero() for _ in range(vectors)] for _ in range(heads)]

            def dims(first: ir.Value, count: ir.Value) -> None:  # acc += q[j] * k[j] for j in first .. + count
                with cgutils.for_range(builder, count) as loop:
                    j = builder.add(first, loop.index)
                    qj = [splat(builder, builder.load(builder.gep(pq[h], [j])), vf) for h in range(heads)]
                    at = builder.mul(j, stride_)
                    for t in range(vectors):
                        ptr = builder.gep(keys[t], [at])
                        if quantized:
                            key = builder.sitofp(builder.load(builder.bitcast(ptr, vb.as_pointer()), align=1), vf)
                        else:
                            key = half_to_float(builder, builder.load(builder.bitcast(ptr, vh.as_pointer()),
                                                                      align=2), native)
                        for h in range(heads):
                            builder.store(_mul_add(builder, qj[h], key, builder.load(acc[h][t])), acc[h][t])

            if quantized:
                scales = starts(4, ks_, 6)
                total = [[zero() for _ in range(vectors)] for _ in range(heads)]
                with cgutils.for_range(builder, builder.udiv(hd_, const(KV_GROUP))) as groups:
                    for h in range(heads):
                        for t in range(vectors):
                            builder.store(ir.Constant(vf, [0.0] * LANES), acc[h][t])
                    dims(builder.mul(groups.index, const(KV_GROUP)), const(KV_GROUP))
                    for t in range(vectors):
                        ptr = builder.gep(scales[t], [builder.mul(groups.index, stride_)])
                        scale = builder.load(builder.bitcast(ptr, vf.as_pointer()), align=4)
                        for h in range(heads):
                            builder.store(_mul_add(builder, builder.load(acc[h][t]), scale,
                                                   builder.load(total[h][t])), total[h][t])
                acc = total
            else:
                dims(const(0), hd_)
            for h in range(heads):
                for t in range(vectors):
                    at = builder.add(builder.add(s_off_, builder.mul(s_head_, const(h))), const(t * LANES))
                    dst = data_ptr(context, builder, ty[9], scores_, at)
                    builder.store(builder.load(acc[h][t]), builder.bitcast(dst, vf.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return key_scores_ir


def make_value_sums(vectors: int, native: bool) -> Any:
    """``_value_sums`` for ``vectors`` vectors of dims as an intrinsic: the sums in registers."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from kestrel_core.codegen import F32, I8, I16, data_ptr, half_to_float, index_args, splat

    vh, vb, vf = ir.VectorType(I16, LANES), ir.VectorType(I8, LANES), ir.VectorType(F32, LANES)

    @intrinsic
    def value_sums_ir(typingctx: Any, p: Any, p_off: Any, count: Any, vc: Any, vs: Any, v_off: Any, v_stride: Any,
                      vs_off: Any, vs_stride: Any, d0: Any, acc: Any, acc_off: Any) -> Any:
        sig = types.void(p, p_off, count, vc, vs, v_off, v_stride, vs_off, vs_stride, d0, acc, acc_off)
        quantized = vc.dtype == types.int8

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list[ir.Value]) -> Any:
            ty = signature.args
            p_, p_off_, count_, vc_, vs_, v_off_, v_stride_, vs_off_, vs_stride_, d0_, acc_, acc_off_ = index_args(
                context, builder, args, ty)
            idx = p_off_.type
            pp = data_ptr(context, builder, ty[0], p_, p_off_)
            pv = data_ptr(context, builder, ty[3], vc_, v_off_)
            ps_ = data_ptr(context, builder, ty[4], vs_, vs_off_)
            pa = [builder.bitcast(data_ptr(context, builder, ty[10], acc_,
                                           builder.add(acc_off_, ir.Constant(idx, c * LANES))), vf.as_pointer())
                  for c in range(vectors)]
            group = [builder.udiv(builder.add(d0_, ir.Constant(idx, c * LANES)), ir.Constant(idx, KV_GROUP))
                     for c in range(vectors)]  # each vector's scale within a position's
            sums = [cgutils.alloca_once(builder, vf) for _ in range(vectors)]
            for c in range(vectors):
                builder.store(builder.load(pa[c], align=4), sums[c])
            with cgutils.for_range(builder, count_) as loop:
                p_s = builder.load(builder.gep(pp, [loop.index]))
                ps = splat(builder, p_s, vf)
                row = builder.gep(pv, [builder.mul(loop.index, v_stride_)])
                row_scales = builder.gep(ps_, [builder.mul(loop.index, vs_stride_)])
                for c in range(vectors):
                    at = builder.gep(row, [ir.Constant(idx, c * LANES)])
                    if quantized:
                        value = builder.sitofp(builder.load(builder.bitcast(at, vb.as_pointer()), align=1), vf)
                        w = splat(builder, builder.fmul(p_s, builder.load(builder.gep(row_scales, [group[c]]))), vf)
                    else:
                        value = half_to_float(builder, builder.load(builder.bitcast(at, vh.as_pointer()), align=2),
                                              native)
                        w = ps
                    builder.store(_mul_add(builder, w, value, builder.load(sums[c])), sums[c])
            for c in range(vectors):
                builder.store(builder.load(sums[c]), pa[c], align=4)
            return context.get_dummy_value()

        return sig, codegen

    return value_sums_ir


def _vector_exp(builder: Any, x: Any) -> Any:
    """``_exp`` on a <LANES x float>, the same float32 steps."""
    from llvmlite import ir

    from kestrel_core.codegen import I32, declared

    vf, vi = x.type, ir.VectorType(I32, LANES)

    def const(value: float) -> Any:
        return ir.Constant(vf, [float(np.float32(value))] * LANES)

    rint = declared(builder, f"llvm.rint.v{LANES}f32", vf, vf)
    kept = builder.fcmp_ordered(">=", x, const(EXP_FLOOR))
    xc = builder.select(kept, x, const(0.0))
    n = builder.call(rint, [builder.fmul(xc, const(EXP_LOG2E))])
    r = builder.fsub(builder.fsub(xc, builder.fmul(n, const(EXP_LN2_HI))), builder.fmul(n, const(EXP_LN2_LO)))
    y = const(EXP_POLY[0])
    for c in EXP_POLY[1:]:
        y = builder.fadd(builder.fmul(y, r), const(c))
    y = builder.fadd(builder.fadd(builder.fmul(y, builder.fmul(r, r)), r), const(1.0))
    scaled = builder.add(builder.bitcast(y, vi), builder.shl(builder.fptosi(n, vi), ir.Constant(vi, [23] * LANES)))
    nan = builder.fcmp_unordered("uno", x, x)
    return builder.select(kept, builder.bitcast(scaled, vf), builder.select(nan, x, const(0.0)))


def make_softmax() -> Any:
    """``_softmax`` as an intrinsic: the max, the exps and the lanes' sums on vectors."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from kestrel_core.codegen import F32, I32, data_ptr, index_args, splat

    vf, vi = ir.VectorType(F32, LANES), ir.VectorType(I32, LANES)

    @intrinsic
    def softmax_ir(typingctx: Any, p: Any, lo: Any, count: Any, sink: Any) -> Any:
        sig = types.float32(p, lo, count, types.float32)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list[ir.Value]) -> Any:
            ty = signature.args
            p_, lo_, count_ = index_args(context, builder, args[:3], ty[:3])
            sink_ = context.cast(builder, args[3], ty[3], types.float32)
            idx = lo_.type
            start = data_ptr(context, builder, ty[0], p_, lo_)
            vectors = builder.udiv(builder.add(count_, ir.Constant(idx, LANES - 1)), ir.Constant(idx, LANES))
            lane = ir.Constant(vi, list(range(LANES)))
            left = builder.trunc(count_, I32)
            minus_inf, zero = ir.Constant(vf, [float("-inf")] * LANES), ir.Constant(vf, [0.0] * LANES)

            def vector_at(i: ir.Value) -> tuple[ir.Value, ir.Value]:  # its pointer, and which lanes are in range
                at = builder.bitcast(builder.gep(start, [builder.mul(i, ir.Constant(idx, LANES))]), vf.as_pointer())
                first = splat(builder, builder.trunc(builder.mul(i, ir.Constant(idx, LANES)), I32), vi)
                return at, builder.icmp_signed("<", builder.add(first, lane), splat(builder, left, vi))

            top_v = cgutils.alloca_once_value(builder, minus_inf)
            with cgutils.for_range(builder, vectors) as loop:
                at, live = vector_at(loop.index)
                x = builder.select(live, builder.load(at, align=4), minus_inf)
                top = builder.load(top_v)
                builder.store(builder.select(builder.fcmp_ordered(">", x, top), x, top), top_v)
            top = builder.extract_element(builder.load(top_v), ir.Constant(I32, 0))
            for k in range(1, LANES):
                x = builder.extract_element(builder.load(top_v), ir.Constant(I32, k))
                top = builder.select(builder.fcmp_ordered(">", x, top), x, top)
            top = builder.select(builder.fcmp_ordered(">", sink_, top), sink_, top)
            top_s = splat(builder, top, vf)
            sums = cgutils.alloca_once_value(builder, zero)
            with cgutils.for_range(builder, vectors) as loop:
                at, live = vector_at(loop.index)
                e = _vector_exp(builder, builder.fsub(builder.load(at, align=4), top_s))
                builder.store(e, at, align=4)
                builder.store(builder.fadd(builder.load(sums), builder.select(live, e, zero)), sums)
            lanes, width = builder.load(sums), LANES
            while width > 1:
                width //= 2
                low = builder.shuffle_vector(lanes, lanes, ir.Constant(vi, list(range(width)) + [0] * (LANES - width)))
                high = builder.shuffle_vector(lanes, lanes, ir.Constant(vi, list(range(width, 2 * width)) +
                                                                        [0] * (LANES - width)))
                lanes = builder.fadd(low, high)
            sink_e = _vector_exp(builder, builder.fsub(splat(builder, sink_, vf), top_s))
            return builder.fadd(builder.extract_element(lanes, ir.Constant(I32, 0)),
                                builder.extract_element(sink_e, ir.Constant(I32, 0)))

        return sig, codegen

    return softmax_ir
