"""What the compiled kernels' LLVM IR shares: element types, declared intrinsics, index arguments, array pointers,
broadcasts, float16 loads, the CPU features numba compiles for, separately cached builds.

numba's on-disk cache keys a jitted function by its own file's timestamp, not by the files its intrinsics
call into: after a change here, touch kestrel_cpu's kernels.py and packed.py and kestrel_core's
model/paged_attention.py (or clear ``__pycache__``) so that their cached builds are compiled again.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FunctionType
from typing import Any

from llvmlite import ir

I8, I16, I32, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def compiled_features() -> set[str]:
    """The CPU features numba compiles for: ``NUMBA_CPU_FEATURES`` where set (numba's advice for a cache shared
    between machines, with ``NUMBA_CPU_NAME=generic``), else this CPU's as LLVM sees them."""
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return {f.strip() for f in config.CPU_FEATURES.split(",") if f.strip()}
    import llvmlite.binding as llvm

    return set(llvm.get_host_cpu_features().flatten().split(","))


def native_half(features: set[str] | None = None) -> bool:
    """Whether the compiled code converts float16 in hardware: x86 with F16C, or any other target (Arm's FCVT
    is in its base floating point). x86 without it (NUMBA_CPU_NAME=generic) would call a runtime function
    numba's JIT cannot resolve, so ``half_to_float`` takes the integer route there."""
    import llvmlite.binding as llvm

    if features is None:
        features = compiled_features()
    x86 = llvm.get_process_triple().split("-")[0] in {"x86_64", "i386", "i686"}
    return "+f16c" in features or not x86


def declared(builder: ir.IRBuilder, name: str, ret: ir.Type, *args: ir.Type) -> ir.Function:
    """The function ``name`` (an LLVM intrinsic) in the module being built, declared on first use."""
    return builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(ret, args), name)


def index_args(context: Any, builder: ir.IRBuilder, args: list[ir.Value], types_: tuple) -> list[ir.Value]:
    """An intrinsic's arguments with every integer one as numba's intp, so that offsets of any integer type mix."""
    from numba import types

    return [context.cast(builder, a, t, types.intp) if isinstance(t, types.Integer) else a
            for a, t in zip(args, types_)]


def data_ptr(context: Any, builder: ir.IRBuilder, aryty: Any, ary: ir.Value, offset: ir.Value) -> ir.Value:
    """A pointer to element ``offset`` of a numba array argument (flat, C order)."""
    return builder.gep(context.make_array(aryty)(context, builder, ary).data, [offset])


def splat(builder: ir.IRBuilder, value: ir.Value, vec_ty: ir.VectorType) -> ir.Value:
    """``value`` in every lane of a ``vec_ty``."""
    one = builder.insert_element(ir.Constant(vec_ty, ir.Undefined), value, ir.Constant(I32, 0))
    mask = ir.Constant(ir.VectorType(I32, vec_ty.count), [0] * vec_ty.count)
    return builder.shuffle_vector(one, ir.Constant(vec_ty, ir.Undefined), mask)


def half_to_float(builder: ir.IRBuilder, bits: ir.Value, native: bool) -> ir.Value:
    """A vector of IEEE binary16 bit patterns <n x i16> as the floats they hold, <n x float>, exactly: ``fpext``
    where ``native`` (``native_half``), else in integer steps (rebias a normal's exponent, scale a subnormal's
    integer significand by 2^-24, widen infinities and NaNs), the same values."""
    n = bits.type.count
    vf, vi = ir.VectorType(F32, n), ir.VectorType(I32, n)
    if native:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), n)), vf)

    def const(value: int) -> ir.Value:
        return ir.Constant(vi, [value] * n)

    x = builder.zext(bits, vi)
    mag = builder.and_(x, const(0x7FFF))
    sign = builder.shl(builder.and_(x, const(0x8000)), const(16))
    normal = builder.add(builder.shl(mag, const(13)), const(112 << 23))
    special = builder.or_(builder.shl(mag, const(13)), const(0x7F800000))  # exponent 31: infinity or NaN
    sub = builder.bitcast(builder.fmul(builder.uitofp(mag, vf), ir.Constant(vf, [2.0 ** -24] * n)), vi)
    out = builder.select(builder.icmp_unsigned("<", mag, const(0x400)), sub,
                         builder.select(builder.icmp_unsigned(">=", mag, const(0x7C00)), special, normal))
    return builder.bitcast(builder.or_(out, sign), vf)


def named_copy(fn: Callable[..., Any], suffix: str, **globals_: Any) -> Callable[..., Any]:
    """``fn`` under its own name, with ``globals_`` in place of its module's (a build's own kernels). numba's
    on-disk cache is keyed by qualified name and source line, not by compile options or the globals' values, so
    two builds of one function under one name would load each other's code."""
    copy = FunctionType(fn.__code__, {**fn.__globals__, **globals_} if globals_ else fn.__globals__,
                        fn.__name__ + suffix, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = fn.__qualname__ + suffix
    return copy
