"""The strip-cache contract: the one weight format every backend consumes.

A strip-cache tensor holds int8 codes ``[N][K]`` (int8 mode: values in [-127, 127]; int4 mode: values in
[-8, 7], one per byte) and one float32 scale per output row per K-block of ``G`` columns, ``[N][K/G]``.
The quantizers reproduce gguf-py's Q8_0 / Q4_0 codes bit for bit (Q4_0 with its +8 offset removed); the
scales are theirs before the float16 rounding. The reference GEMMs below define what every backend must
compute.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from kestrel_core.errors import ContractError

GROUP_SIZES = (32, 256)
BITS = (4, 8)
CODE_RANGE = {8: (-127, 127), 4: (-8, 7)}


@dataclass(frozen=True, eq=False)
class StripCache:
    """One quantized weight: ``codes`` int8 [N, K], ``scales`` float32 [N, K/G]."""

    codes: np.ndarray
    scales: np.ndarray
    group_size: int
    bits: int

    def __post_init__(self) -> None:
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
        lo, hi = CODE_RANGE[bits]
        if codes.size and (int(codes.min()) < lo or int(codes.max()) > hi):
            raise ContractError(f"int{bits} codes must lie in [{lo}, {hi}]")

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


def _describe(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} array of shape {list(a.shape)}"
    return type(a).__name__


def _blocks(x: np.ndarray, group_size: int) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float16) and x.dtype.name != "bfloat16":
        x = x.astype(np.float32)
    x = x.astype(np.float32)
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


def _quantize_q8(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # blocks: [R, ng, G] float32
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    codes = round_half_away(blocks * inv).astype(np.int8)
    return codes, d[..., 0].astype(np.float32)


def _quantize_q4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # blocks: [R, ng, G] float32; the signed value of largest magnitude maps to -8
    imax = np.abs(blocks).argmax(axis=-1)[..., None]
    d = np.take_along_axis(blocks, imax, axis=-1) / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.trunc(blocks * inv + np.float32(8.5)).clip(0, 15).astype(np.int16) - 8
    return q.astype(np.int8), d[..., 0].astype(np.float32)


def quantize_weight(w: np.ndarray, bits: int = 8, group_size: int = 32) -> StripCache:
    """Quantize float weights [N, K] into a strip-cache (Q8_0 semantics for 8 bits, Q4_0 for 4)."""
    if bits not in BITS:
        raise ContractError(f"bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ContractError(f"group size must be one of {GROUP_SIZES}, got {group_size}")
    blocks = _blocks(w, group_size)
    codes, scales = (_quantize_q8 if bits == 8 else _quantize_q4)(blocks)
    return StripCache(np.ascontiguousarray(codes.reshape(w.shape[0], -1)), np.ascontiguousarray(scales),
                      group_size, bits)


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
    compiled = _compiled_q8_rows()
    if compiled is not None:
        codes = np.empty(a.shape, np.int8)
        scales = np.empty((m, a.shape[1] // group_size), np.float32)
        try:
            compiled(np.ascontiguousarray(a), group_size, codes, scales)
            return codes, scales
        except Exception as exc:  # a numba that cannot compile this: the numpy path below is the same
            _disable_compiled(exc)
    blocks = a.reshape(m, -1, group_size)  # [M, K/G, G]
    d = np.maximum.reduce(np.abs(blocks), axis=-1) / np.float32(127)  # [M, K/G]
    inv = np.float32(1) / (d + (d == 0))  # an all-zero block: 1/1, and its codes are 0 either way
    v = blocks * inv[..., None]
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
            scales[i, g] = d
            for j in range(base, base + group_size):
                v = a[i, j] * inv
                codes[i, j] = np.int8(v + half if v >= 0 else v - half)


_COMPILED: dict[str, Any] = {}


def _compiled_q8_rows() -> Any:
    """The numba build of _q8_rows (cached on disk), or None where numba is missing or failed."""
    if "q8_rows" not in _COMPILED:
        try:
            from numba import njit

            _COMPILED["q8_rows"] = njit(cache=True, nogil=True)(_q8_rows)
        except Exception as exc:
            _disable_compiled(exc)
    return _COMPILED["q8_rows"]


def _disable_compiled(exc: BaseException) -> None:
    logging.getLogger("kestrel").debug("compiled activation quantizer unavailable: %s", exc)
    _COMPILED["q8_rows"] = None


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
