"""The device layout of a weight: its geometry, which projections share one buffer, and host packing.

``Geometry(k, npad, ngroups, code_bits=8)``: the shape of one device weight. ``Geometry.of(strip)`` for one
    StripCache, ``Geometry.fused(strips)`` for a Q|K|V or gate|up buffer (``fusable(strips)`` says whether the
    members may share one, else use per-projection weights); ``pack_int4=True`` sizes int4 codes at 4 bits.
    One allocation of ``nbytes`` holds both regions (``npad = pad_n(N) = (N+3) & ~3``, fused: sum of the Ns):
        [0, codes_nbytes)                        codes, K-major: int8 [K][Npad]; code_bits=4: [K/8][Npad]
                                                 32-bit words of 8 consecutive k of one column (common.cuh)
        [scales_offset, +scales_nbytes)          scales, float32 [ngroups][Npad]; offset = codes rounded up to
                                                 256 bytes (cudaMalloc alignment, so vector loads stay aligned)
    The pool key ``layout = (codes_nbytes, scales_nbytes)`` is exactly what makes two buffers interchangeable:
    same size and same region offsets. It is coarser than (Npad, ngroups) on purpose: gate/up [F, D] and
    down [D, F] (and q [H*hd, D] / o [D, H*hd]) have different geometries but one layout, so an evicted down
    buffer serves the next gate; every byte is rewritten by the upload, so nothing else matters.
``layer_groups(layer, weights)``: a layer's projections in launch order, Q|K|V, O, gate|up, down, with the
    wkeys of their members and of the fused buffer.
``pack_kmajor`` / ``unpack_kmajor``: the same layout made on the host (the forward's own uploads without a
    weight cache, and the numpy mirrors); weights.py makes it on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np

from kestrel_core.contract import StripCache
from kestrel_core.model.weights import LayerWeights
from kestrel_core.wkey import MLP_GROUPS

ALIGN = 256
VEC = 4  # columns per vectorised store: Npad is a multiple of it


def pad_n(n: int) -> int:
    return (n + VEC - 1) & ~(VEC - 1)


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def _code_bits(bits: int, pack_int4: bool) -> int:
    return 4 if pack_int4 and bits == 4 else 8


@dataclass(frozen=True)
class Geometry:
    """Shape of one device weight: codes [K][Npad] (``code_bits`` per code), scales float32 [ngroups][Npad]."""

    k: int
    npad: int
    ngroups: int
    code_bits: int = 8

    def __post_init__(self) -> None:
        if self.k <= 0 or self.ngroups <= 0 or self.k % self.ngroups:
            raise ValueError(f"bad geometry: K={self.k} must be a positive multiple of ngroups={self.ngroups}")
        if self.npad <= 0 or self.npad % VEC:
            raise ValueError(f"bad geometry: Npad={self.npad} must be a positive multiple of {VEC}")
        if self.code_bits not in (4, 8):
            raise ValueError(f"bad geometry: code_bits must be 4 or 8, got {self.code_bits}")

    @classmethod
    def of(cls, weight: StripCache, *, pack_int4: bool = False) -> Geometry:
        return cls(weight.k, pad_n(weight.n), weight.ngroups, _code_bits(weight.bits, pack_int4))

    @classmethod
    def fused(cls, weights: Sequence[StripCache], *, pack_int4: bool = False) -> Geometry:
        """One buffer whose columns are the members' N side by side (NG = sum of N, no gaps)."""
        if not fusable(weights):
            raise ValueError("these weights cannot share a fused buffer (see fusable())")
        w0 = weights[0]
        return cls(w0.k, sum(w.n for w in weights), w0.ngroups, _code_bits(w0.bits, pack_int4))

    @property
    def group_size(self) -> int:
        return self.k // self.ngroups

    @cached_property  # the hot path asks for sizes at every miss and eviction
    def codes_nbytes(self) -> int:
        return self.k * self.npad * self.code_bits // 8

    @cached_property
    def scales_offset(self) -> int:
        return _align(self.codes_nbytes)

    @cached_property
    def scales_nbytes(self) -> int:
        return self.ngroups * self.npad * 4

    @cached_property
    def nbytes(self) -> int:
        return self.scales_offset + self.scales_nbytes

    @cached_property
    def layout(self) -> tuple[int, int]:
        """The pool key: buffers of equal layout are byte-for-byte interchangeable."""
        return self.codes_nbytes, self.scales_nbytes


def fusable(weights: Sequence[StripCache]) -> bool:
    """Members may share one [K][NG] buffer: same K, G and bits, every N a multiple of 4 (K % G holds by
    the strip-cache contract). Otherwise the backend uses per-projection weights; that is not an error."""
    if len(weights) < 2:
        return False
    w0 = weights[0]
    return all(w.k == w0.k and w.group_size == w0.group_size and w.bits == w0.bits and w.n % VEC == 0
               and w.k % w.group_size == 0 for w in weights)


class StripGroup(NamedTuple):
    """Projections that read one input, in one buffer where ``fusable`` allows it."""

    strips: list[StripCache]
    keys: list[int]  # each member's wkey
    fused_key: int  # the fused buffer's wkey; 0 for a group of one


def layer_groups(layer: int, lw: LayerWeights) -> list[StripGroup]:
    """The projections of model layer ``layer`` in launch order: ``LayerWeights.proj_groups`` (a mixture of
    experts layer: Q|K|V, O, then each expert's gate|up and down under its wkeys, the shared one's last)."""
    out = [StripGroup(list(strips), list(group.keys(layer)), group.fused_key(layer))
           for group, strips in lw.proj_groups()]
    for e, ex in enumerate(lw.all_experts()):
        out += [StripGroup(list(strips), list(group.keys(layer, e)), group.fused_key(layer, e))
                for group, strips in zip(MLP_GROUPS, ex.groups())]
    return out


def pack_kmajor(codes: np.ndarray, bits: int) -> np.ndarray:
    """Host packing of int8 codes [N][K] into the device layout: uint8 [K][Npad] or, 4-bit, [K/8][4 * Npad].

    The layout the transpose kernels produce (Npad = (N+3) & ~3, padding zero). int4: 32-bit words of 8
    consecutive k of one column, +8 biased, byte b = k0 + b (low nibble) | k0 + 4 + b (high nibble), as
    common.cuh describes.
    """
    n, k = codes.shape
    npad = pad_n(n)
    t = np.zeros((k, npad), np.int8)
    t[:, :n] = codes.T
    if bits == 8:
        return t.view(np.uint8)
    if k % 8:
        raise ValueError(f"int4 packing needs K % 8 == 0, got {k}")
    u = (t.astype(np.int16) + 8).astype(np.uint8).reshape(k // 8, 2, 4, npad)  # [kw][half][b][n]
    words = u[:, 0] | (u[:, 1] << 4)                                           # [kw][b][n]
    return np.ascontiguousarray(words.transpose(0, 2, 1)).reshape(k // 8, 4 * npad)


def unpack_kmajor(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``pack_kmajor``: int8 codes [K][Npad]."""
    if bits == 8:
        return packed.view(np.int8)
    kw, npad = packed.shape[0], packed.shape[1] // 4
    b = packed.reshape(kw, npad, 4).transpose(0, 2, 1)  # [kw][b][n]
    out = np.empty((kw, 2, 4, npad), np.int8)
    out[:, 0] = (b & 0x0F).astype(np.int8) - 8
    out[:, 1] = (b >> 4).astype(np.int8) - 8
    return out.reshape(8 * kw, npad)
