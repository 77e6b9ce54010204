"""What the compiled kernels' LLVM IR shares: element types, array pointers, separately cached builds.

numba's on-disk cache keys a jitted function by its own file's timestamp, not by the files its intrinsics
call into: after a change here, touch kernels.py and packed.py (or clear ``__pycache__``) so that their
cached builds are compiled again.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FunctionType
from typing import Any

from llvmlite import ir

I8, I32, F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()


def data_ptr(context: Any, builder: ir.IRBuilder, aryty: Any, ary: ir.Value, offset: ir.Value) -> ir.Value:
    """A pointer to element ``offset`` of a numba array argument (flat, C order)."""
    return builder.gep(context.make_array(aryty)(context, builder, ary).data, [offset])


def named_copy(fn: Callable[..., Any], suffix: str, **globals_: Any) -> Callable[..., Any]:
    """``fn`` under its own name, with ``globals_`` in place of its module's (a build's own kernels). numba's
    on-disk cache is keyed by qualified name and source line, not by compile options or the globals' values, so
    two builds of one function under one name would load each other's code."""
    copy = FunctionType(fn.__code__, {**fn.__globals__, **globals_} if globals_ else fn.__globals__,
                        fn.__name__ + suffix, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = fn.__qualname__ + suffix
    return copy
