"""The strip-cache contract: the one weight format every backend consumes.

A strip-cache tensor holds int8 codes ``[N][K]`` (int8 mode: values in [-127, 127]; int4 mode: values in
[-8, 7], one per byte) and one float32 scale per output row per K-block of ``G`` columns, ``[N][K/G]``.
The quantizers reproduce gguf-py's Q8_0 / Q4_0 codes bit for bit (Q4_0 with its +8 offset removed); the
scales are theirs before the float16 rounding. The reference GEMMs below define what every backend must
compute.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import InitVar, dataclass
from typing import Any

import numpy as np

from kestrel_core.errors import ContractError

GROUP_SIZES = (32, 256)
BITS = (4, 8)
CODE_RANGE = {8: (-127, 127), 4: (-8, 7)}


@dataclass(frozen=True, eq=False)
class StripCache:
    """One quantized weight: ``codes`` int8 [N, K], ``scales`` float32 [N, K/G].

    Construction checks everything but the code range in O(1) and then scans the codes once for their range.
    ``check_range=False`` skips that scan, for a caller that has just checked the range itself (the artifact
    reader does it chunk by chunk in its checksum pass, so a memory-mapped file is read once).
    """

    codes: np.ndarray
    scales: np.ndarray
    group_size: int
    bits: int
    check_range: InitVar[bool] = True

    def __post_init__(self, check_range: bool = True) -> None:
        codes, scales, g, bits = self.codes, self.scales, self.group_size, self.bits
        if g not in GROUP_SIZES:
            raise ContractError(f"group size must be one of {GROUP_SIZES}, got {g}")
        if bits not in BITS:
            raise ContractError(f"bits must be one of {BITS}, got {bits}")
        if not isinstance(codes, np.ndarray) or codes.dtype != np.int8 or codes.ndim != 2:
            raise ContractError(f"codes must be a 2-D int8 array, got {_describe(codes)}")
        if not codes.flags.c_contiguous:
            raise ContractError("codes must be C-contiguous [N][K]")
        n, k = codes.shape
        if k % g:
            raise ContractError(f"K={k} is not a multiple of the group size G={g}")
        if not isinstance(scales, np.ndarray) or scales.dtype != np.float32 or scales.shape != (n, k // g):
            raise ContractError(f"scales must be float32 [{n}, {k // g}], got {_describe(scales)}")
        if not scales.flags.c_contiguous:
            raise ContractError("scales must be C-contiguous [N][K/G]")
        if check_range:
            check_code_range(codes, bits)

    def __repr__(self) -> str:  # its codes' elements would run to megabytes for one weight
        n, k = self.shape
        return f"StripCache([{n}, {k}], bits={self.bits}, group_size={self.group_size})"

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    @property
    def n(self) -> int:
        return self.codes.shape[0]

    @property
    def k(self) -> int:
        return self.codes.shape[1]

    @property
    def ngroups(self) -> int:
        return self.codes.shape[1] // self.group_size

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def dequantize(self, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """Float32 weights (optionally only some rows): codes times their block scale."""
        codes = self.codes if rows is None else self.codes[rows]
        scales = self.scales if rows is None else self.scales[rows]
        # w: [R, K/G, G] * [R, K/G, 1]
        w = codes.reshape(codes.shape[0], -1, self.group_size).astype(np.float32) * scales[:, :, None]
        return w.reshape(codes.shape[0], -1)


def read_only_view(array: np.ndarray) -> np.ndarray:
    """``array`` as a view that cannot be written through, nor made writable: its buffer is a read-only
    memoryview of ``array``'s memory (numpy refuses ``flags.writeable = True`` on an array over a read-only
    buffer, which it allows on a plain view of a writable array). No element is copied."""
    return np.asarray(memoryview(array).toreadonly())


_READ_ONLY_STRIPS: weakref.WeakKeyDictionary[StripCache, StripCache] = weakref.WeakKeyDictionary()
_READ_ONLY_TWINS: weakref.WeakSet[StripCache] = weakref.WeakSet()


def read_only_strip(weight: StripCache) -> StripCache:
    """``weight`` over read-only views of its codes and scales: what backends are handed (the GEMM hooks,
    ``engine_weights``, the whole-step hooks' model), one object a weight so that a backend may know it again
    (a twin given back is its own twin); the model's own arrays stay as they are, which the CPU kernels are
    compiled for."""
    if weight in _READ_ONLY_TWINS:
        return weight
    twin = _READ_ONLY_STRIPS.get(weight)
    if twin is None:
        twin = _READ_ONLY_STRIPS[weight] = StripCache(read_only_view(weight.codes), read_only_view(weight.scales),
                                                      weight.group_size, weight.bits, check_range=False)
        _READ_ONLY_TWINS.add(twin)
    return twin


def check_code_range(codes: np.ndarray, bits: int) -> None:
    """ContractError unless every code lies in the range of ``bits``; one pass (int8 codes cannot exceed 127,
    so 8-bit codes need only their minimum)."""
    if not codes.size:
        return
    lo, hi = CODE_RANGE[bits]
    if int(codes.min()) < lo or (hi < 127 and int(codes.max()) > hi):
        raise ContractError(f"int{bits} codes must lie in [{lo}, {hi}]")


def _describe(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} array of shape {list(a.shape)}"
    return type(a).__name__


@dataclass(frozen=True, eq=False)
class BFloat16Bits:
    """bfloat16 weights as their raw uint16 bit patterns ``[N, K]``.

    numpy has no bfloat16 dtype; carrying the bits lets the quantizer widen one row at a time instead of
    making a float32 copy of the whole tensor (twice the size of the checkpoint's bytes).
    """

    raw: np.ndarray

    def __post_init__(self) -> None:
        if not isinstance(self.raw, np.ndarray) or self.raw.dtype != np.uint16:
            raise ContractError(f"bfloat16 bits must be a uint16 array, got {_describe(self.raw)}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.raw.shape

    @property
    def ndim(self) -> int:
        return self.raw.ndim

    def to_float32(self) -> np.ndarray:
        """The exact float32 values: bfloat16 is the high half of an IEEE float32."""
        return (self.raw.astype(np.uint32) << 16).view(np.float32)


WeightInput = np.ndarray | BFloat16Bits


def _as_float32(x: WeightInput) -> np.ndarray:
    if isinstance(x, BFloat16Bits):
        return x.to_float32()
    return np.asarray(x).astype(np.float32)  # float16 and ml_dtypes' bfloat16 widen exactly


def _blocks(x: WeightInput, group_size: int) -> np.ndarray:
    x = _as_float32(x)
    if x.ndim != 2:
        raise ContractError(f"expected a 2-D array, got shape {list(x.shape)}")
    if x.shape[1] % group_size:
        raise ContractError(f"K={x.shape[1]} is not a multiple of the group size G={group_size}")
    return x.reshape(x.shape[0], -1, group_size)


def round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf (ggml's rounding), not numpy's round-half-to-even.

    Not floor(|x| + 0.5): in float32 0.49999997 + 0.5 rounds up to 1.0. The fraction a - floor(a) is exact,
    so this is exact for every float32 (gguf-py's np_roundf does the same).
    """
    a = np.abs(x)
    f = np.floor(a)
    return np.sign(x) * (f + np.floor(2 * (a - f)))


def _reciprocal(d: np.ndarray) -> np.ndarray:
    """1/d, or 0 where d is 0 or so small (|d| < 2**-128) that 1/d overflows: such a block's codes are all 0.

    ggml and gguf-py leave the second case to a cast of infinity or NaN to int8, which C does not define.
    """
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.float32(1) / d
    return np.where(np.isinf(inv), np.float32(0), inv)


def _quantize_q8(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # blocks: [R, ng, G] float32
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    codes = round_half_away(blocks * _reciprocal(d)).astype(np.int8)
    return codes, d[..., 0].astype(np.float32)


def _quantize_q4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # blocks: [R, ng, G] float32; the signed value of largest magnitude maps to -8
    imax = np.abs(blocks).argmax(axis=-1)[..., None]
    d = np.take_along_axis(blocks, imax, axis=-1) / np.float32(-8)
    q = np.trunc(blocks * _reciprocal(d) + np.float32(8.5)).clip(0, 15).astype(np.int16) - 8
    return q.astype(np.int8), d[..., 0].astype(np.float32)


def _check_args(w: object, bits: int, group_size: int) -> tuple[int, int]:
    """(N, K) of a quantizable weight, or a ContractError saying what is wrong."""
    if bits not in BITS:
        raise ContractError(f"bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ContractError(f"group size must be one of {GROUP_SIZES}, got {group_size}")
    shape = tuple(w.shape) if isinstance(w, (np.ndarray, BFloat16Bits)) else np.shape(w)
    if len(shape) != 2:
        raise ContractError(f"expected a 2-D array, got shape {list(shape)}")
    if shape[1] % group_size:
        raise ContractError(f"K={shape[1]} is not a multiple of the group size G={group_size}")
    return int(shape[0]), int(shape[1])


def _nonfinite(row: int) -> ContractError:
    return ContractError(f"the weights contain NaN or infinity (first in row {row})")


def quantize_weight_reference(w: WeightInput, bits: int = 8, group_size: int = 32) -> StripCache:
    """The numpy definition of the weight quantizers (and the fallback where numba is unusable).

    w: float32 / float16 / bfloat16 ``[N, K]``; NaN and infinity are refused, as they have no code.
    """
    n, _ = _check_args(w, bits, group_size)
    blocks = _blocks(w, group_size)  # [N, K/G, G] float32
    finite = np.isfinite(blocks).reshape(n, -1).all(axis=1)  # [N]
    if not finite.all():
        raise _nonfinite(int(np.flatnonzero(~finite)[0]))
    codes, scales = (_quantize_q8 if bits == 8 else _quantize_q4)(blocks)
    return StripCache(np.ascontiguousarray(codes.reshape(n, -1)), np.ascontiguousarray(scales), group_size, bits)


def quantize_weight(w: WeightInput, bits: int = 8, group_size: int = 32) -> StripCache:
    """Quantize float weights [N, K] into a strip-cache (Q8_0 semantics for 8 bits, Q4_0 for 4).

    Compiled and spread over the cores where numba works; bit for bit quantize_weight_reference either way.
    """
    n, k = _check_args(w, bits, group_size)
    kernels = _compiled_weight_kernels()
    if kernels is not None:
        x, table = _kernel_input(w)
        codes = np.empty((n, k), np.int8)
        scales = np.empty((n, k // group_size), np.float32)
        try:
            bad = _run_weight_kernel(kernels, x, table, bits, group_size, codes, scales)
        except Exception as exc:  # a numba that cannot compile or run this: the reference gives the same
            _disable_compiled("weights", exc)
        else:
            if bad >= 0:
                raise _nonfinite(bad)
            return StripCache(codes, scales, group_size, bits)
    return quantize_weight_reference(w, bits, group_size)


# -- the compiled weight quantizer ------------------------------------------------------------------------

def _reciprocal_scalar(d: np.float32) -> np.float32:
    """_reciprocal of one float32, for numba."""
    if d == 0:
        return np.float32(0)
    inv = np.float32(1) / d
    return inv if abs(inv) != np.inf else np.float32(0)


def _quantize_row(x: np.ndarray, bits: int, group_size: int, codes: np.ndarray, scales: np.ndarray) -> bool:
    """One row for numba: x float32 [K] -> codes int8 [K], scales float32 [K/G]; False on NaN or infinity.

    The float32 operations of _quantize_q8 / _quantize_q4, in their order, so the results are the same bits.
    """
    for g in range(x.shape[0] // group_size):
        base = g * group_size
        amax = np.float32(-1)
        xm = np.float32(0)  # the first value of largest magnitude, with its sign (numpy's argmax)
        nonfinite = np.float32(0)
        for j in range(base, base + group_size):
            v = x[j]
            nonfinite += v - v  # 0 for a finite v; NaN, which sticks, for NaN and +-inf
            a = abs(v)
            if a > amax:
                amax = a
                xm = v
        if nonfinite != 0:
            return False
        if bits == 8:
            d = amax / np.float32(127)
            inv = _row_reciprocal(d)
            for j in range(base, base + group_size):
                v = x[j] * inv
                a = abs(v)
                f = np.floor(a)
                r = f + np.floor(np.float32(2) * (a - f))  # round_half_away, exact
                codes[j] = np.int8(r if v >= 0 else -r)
        else:
            d = xm / np.float32(-8)
            inv = _row_reciprocal(d)
            for j in range(base, base + group_size):
                q = np.int32(x[j] * inv + np.float32(8.5))  # truncation: the value is >= 0.49999
                codes[j] = np.int8(min(max(q, 0), 15) - 8)
        scales[g] = d
    return True


def _rows_f32(x: np.ndarray, bits: int, group_size: int, codes: np.ndarray, scales: np.ndarray,
              start: int, stop: int) -> int:
    """Rows [start, stop) of a float32 x [N, K]; the first row holding NaN or infinity, else -1."""
    for i in range(start, stop):
        if not _row_kernel(x[i], bits, group_size, codes[i], scales[i]):
            return i
    return -1


def _rows_u16(raw: np.ndarray, table: np.ndarray, bits: int, group_size: int, codes: np.ndarray,
              scales: np.ndarray, start: int, stop: int) -> int:
    """Rows [start, stop) of 16-bit floats raw uint16 [N, K], widened through table float32 [65536] one row
    at a time (exact, and no float32 copy of the tensor); the first row with NaN or infinity, else -1."""
    buf = np.empty(raw.shape[1], np.float32)  # [K]
    for i in range(start, stop):
        for j in range(raw.shape[1]):
            buf[j] = table[raw[i, j]]
        if not _row_kernel(buf, bits, group_size, codes[i], scales[i]):
            return i
    return -1


# The compiled helpers once built (the kernels resolve these globals when numba compiles them).
_row_kernel: Any = _quantize_row
_row_reciprocal: Any = _reciprocal_scalar


def _widen_tables() -> dict[str, np.ndarray]:
    """uint16 bit pattern -> float32, for float16 and bfloat16 (numpy's own exact conversions)."""
    if "tables" not in _COMPILED:
        bits16 = np.arange(1 << 16, dtype=np.uint32)
        _COMPILED["tables"] = {
            "float16": bits16.astype(np.uint16).view(np.float16).astype(np.float32),
            "bfloat16": (bits16 << 16).view(np.float32),
        }
    return _COMPILED["tables"]


def _kernel_input(w: WeightInput) -> tuple[np.ndarray, np.ndarray | None]:
    """(C-contiguous float32 [N, K], None) or (uint16 bits [N, K], their widening table)."""
    if isinstance(w, BFloat16Bits):
        return np.ascontiguousarray(w.raw), _widen_tables()["bfloat16"]
    w = np.asarray(w)
    if w.dtype == np.float16 or (w.dtype.name == "bfloat16" and w.dtype.itemsize == 2):
        return np.ascontiguousarray(w).view(np.uint16), _widen_tables()[w.dtype.name]
    return np.ascontiguousarray(w, dtype=np.float32), None


# One thread per this many weights (at most one per core): on less, starting a thread costs more than it saves.
_MIN_PARALLEL_WEIGHTS = 1 << 19


def _threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _run_weight_kernel(kernels: tuple[Any, Any], x: np.ndarray, table: np.ndarray | None, bits: int,
                       group_size: int, codes: np.ndarray, scales: np.ndarray) -> int:
    """Row chunks on threads (the kernels release the GIL); the first bad row, else -1."""
    f32, u16 = kernels
    n, k = x.shape

    def run(start: int, stop: int) -> int:
        if table is None:
            return int(f32(x, bits, group_size, codes, scales, start, stop))
        return int(u16(x, table, bits, group_size, codes, scales, start, stop))

    bad = [r for r in run_row_chunks(run, n, k) if r >= 0]
    return min(bad) if bad else -1


def run_row_chunks(run: Callable[[int, int], Any], n: int, k: int) -> list[Any]:
    """``run(start, stop)`` over chunks of rows 0..n-1 (of k elements), one thread per core where the work is
    large enough (``run`` must release the GIL: a numba ``nogil`` kernel); each chunk's result, in order. The
    first call, on no rows, compiles the kernel's signature once, not in several threads at once."""
    run(0, 0)
    workers = max(1, min(_threads(), n, (n * k) // _MIN_PARALLEL_WEIGHTS))
    bounds = [n * t // workers for t in range(workers + 1)]
    if workers == 1:
        return [run(0, n)]
    results: list[Any] = [None] * workers
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            results[t] = run(bounds[t], bounds[t + 1])
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(1, workers)]
    for th in threads:
        th.start()
    work(0)
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results


def _compiled_weight_kernels() -> tuple[Any, Any] | None:
    """The numba builds of _rows_f32 and _rows_u16 (cached on disk), or None where numba is unusable."""
    global _row_kernel, _row_reciprocal
    if "weights" not in _COMPILED:
        try:
            from numba import njit

            _row_reciprocal = njit(cache=True, nogil=True)(_reciprocal_scalar)
            _row_kernel = njit(cache=True, nogil=True)(_quantize_row)
            _COMPILED["weights"] = (njit(cache=True, nogil=True)(_rows_f32), njit(cache=True, nogil=True)(_rows_u16))
        except Exception as exc:
            _disable_compiled("weights", exc)
    return _COMPILED["weights"]


_HALF_DOWN = np.nextafter(np.float32(0.5), np.float32(0))  # 0.49999997


def quantize_activations(a: np.ndarray, group_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Per-block int8 activations (Q8_0 semantics): codes int8 [M, K], scales float32 [M, K/G]."""
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 2 and a.shape[1] % group_size == 0):
        codes, scales = _quantize_q8(_blocks(a, group_size))
        return np.ascontiguousarray(codes.reshape(a.shape[0], -1)), np.ascontiguousarray(scales)
    # The engine's hot path (every projection of every token): the same codes and scales as _quantize_q8,
    # compiled (one pass, ~1 us for a decode row) where numba is available, else in fewer numpy passes.
    # trunc(v + copysign(0.49999997, v)) equals round_half_away(v) for every float32 with |v| <= 256
    # (checked exhaustively); with 0.5, v = 0.49999997 would round up to 1 like floor(|v| + 0.5).
    m = a.shape[0]
    compiled = compiled_q8_rows()
    if compiled is not None:
        codes = np.empty(a.shape, np.int8)
        scales = np.empty((m, a.shape[1] // group_size), np.float32)
        try:
            compiled(np.ascontiguousarray(a), group_size, codes, scales)
            return codes, scales
        except Exception as exc:  # a numba that cannot compile this: the numpy path below is the same
            _disable_compiled("q8_rows", exc)
    blocks = a.reshape(m, -1, group_size)  # [M, K/G, G]
    d = np.maximum.reduce(np.abs(blocks), axis=-1) / np.float32(127)  # [M, K/G]
    v = blocks * _reciprocal(d)[..., None]
    v += np.copysign(_HALF_DOWN, v)
    return v.astype(np.int8).reshape(m, -1), d


def _q8_rows(a: np.ndarray, group_size: int, codes: np.ndarray, scales: np.ndarray) -> None:
    """quantize_activations' loop for numba: float32 throughout, the same operations as the numpy path."""
    m, k = a.shape
    half = _HALF_DOWN
    for i in range(m):
        for g in range(k // group_size):
            base = g * group_size
            amax = np.float32(0)
            for j in range(base, base + group_size):
                v = abs(a[i, j])
                if v > amax or v != v:  # NaN propagates, as in np.maximum
                    amax = v
            d = amax / np.float32(127)
            inv = np.float32(1) / d if d != 0 else np.float32(0)
            if abs(inv) == np.inf:  # _reciprocal's rule: a block too small to scale has codes 0
                inv = np.float32(0)
            scales[i, g] = d
            for j in range(base, base + group_size):
                v = a[i, j] * inv
                codes[i, j] = np.int8(v + half if v >= 0 else v - half)


_COMPILED: dict[str, Any] = {}


def compiled_q8_rows() -> Any:
    """The numba build of _q8_rows (cached on disk), or None where numba is missing or failed."""
    if "q8_rows" not in _COMPILED:
        try:
            from numba import njit

            _COMPILED["q8_rows"] = njit(cache=True, nogil=True)(_q8_rows)
        except Exception as exc:
            _disable_compiled("q8_rows", exc)
    return _COMPILED["q8_rows"]


def _disable_compiled(name: str, exc: BaseException) -> None:
    logging.getLogger("kestrel").debug("compiled quantizer %s unavailable: %s", name, exc)
    _COMPILED[name] = None


def gemm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def reference_gemm_q8(a_codes: np.ndarray, a_scales: np.ndarray, w: StripCache) -> np.ndarray:
    """out[m,n] = sum_g (sum_{k in g} Aq[m,k] Wq[n,k]) * a_scale[m,g] * w_scale[n,g], exact block sums.

    a_codes: int8 [M, K]; a_scales: float32 [M, K/G]; returns float32 [M, N].
    """
    g = w.group_size
    m = a_codes.shape[0]
    # Integer block sums are exact in float64 (|sum| <= 127*127*256 < 2**53), and BLAS computes them fast.
    a = a_codes.reshape(m, -1, g).transpose(1, 0, 2).astype(np.float64)      # [ng, M, G]
    b = w.codes.reshape(w.n, -1, g).transpose(1, 2, 0).astype(np.float64)    # [ng, G, N]
    block_sums = np.matmul(a, b).astype(np.float32)                          # [ng, M, N], exact integers
    scaled = block_sums * a_scales.T[:, :, None] * w.scales.T[:, None, :]   # [ng, M, N]
    return scaled.sum(axis=0, dtype=np.float32)


def reference_gemm_f32(a: np.ndarray, w: StripCache) -> np.ndarray:
    """out[m,n] = sum_g w_scale[n,g] * sum_{k in g} A[m,k] Wq[n,k]; a: float32 [M, K] -> [M, N]."""
    g = w.group_size
    m = a.shape[0]
    x = a.astype(np.float32).reshape(m, -1, g).transpose(1, 0, 2)            # [ng, M, G]
    b = w.codes.reshape(w.n, -1, g).transpose(1, 2, 0).astype(np.float32)    # [ng, G, N]
    block_sums = np.matmul(x, b)                                             # [ng, M, N]
    return (block_sums * w.scales.T[:, None, :]).sum(axis=0, dtype=np.float32)
