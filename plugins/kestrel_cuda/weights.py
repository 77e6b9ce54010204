"""Upload of strip-caches into the K-major device layout the kernels read.

Host ``[N][K]`` int8 codes and ``[N][K/G]`` float32 scales are copied to the device as they are, then
transposed there once (32x32 tiled kernels, ``transpose.cu``) into one buffer laid out as
``layout.Geometry`` says: codes ``[K][Npad]`` int8, or for int4 weights ``[K/8][Npad]`` 32-bit words of 8
consecutive k of one column (+8 offset, common.cuh: half the bytes a decode step reads), and scales
``[K/G][Npad]`` float32. ``Npad = (N+3) & ~3``; the whole buffer is zeroed first, so padding columns read 0.
A fused buffer (Q|K|V, gate|up) holds its members side by side (``col_off``), NG = sum of N, when
``layout.fusable`` allows it (every N % 4 == 0, same K, G, bits); otherwise the backend keeps
per-projection weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kestrel_core.contract import StripCache
from kestrel_cuda.layout import Geometry, fusable
from kestrel_cuda.residency import DeviceWeight

TILE = 32
TRANSPOSE_BLOCK = (32, 8)


def geometry_for(strips: Sequence[StripCache]) -> Geometry:
    """One weight, or a fused buffer of several (the caller checked ``fusable``); int4 always packed."""
    if len(strips) == 1:
        return Geometry.of(strips[0], pack_int4=True)
    return Geometry.fused(strips, pack_int4=True)


def column_offsets(strips: Sequence[StripCache]) -> list[int]:
    """First column of each member in a fused buffer."""
    return [int(x) for x in np.cumsum([0] + [s.n for s in strips[:-1]])]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_upload(cp: Any, kernels: Any, strips: Sequence[StripCache], stream: Any | None = None,
                timer: Any = None) -> Callable[[DeviceWeight], None]:
    """The ``upload_fn`` the weight cache calls to fill a (fresh or pooled) buffer with ``strips`` on ``stream``
    (``timer``: a ``streaming.UploadTimer`` that records the upload's GPU time)."""
    strips = list(strips)
    if len(strips) > 1 and not fusable(strips):
        raise ValueError("these weights cannot share a fused buffer")

    moved = sum(s.codes.nbytes + s.scales.nbytes for s in strips)  # host bytes over the bus

    def upload(weight: DeviceWeight) -> None:
        g = weight.geometry
        i32 = np.int32
        with stream if stream is not None else _null(), \
                timer.span(cp.cuda.get_current_stream(), moved) if timer is not None else _null():
            weight.buffer.fill(0)
            codes = weight.codes
            scales = weight.scales
            for off, s in zip(column_offsets(strips), strips):
                src = cp.asarray(s.codes)       # [N][K] int8
                src_s = cp.asarray(s.scales)    # [N][K/G] float32
                grid = (_cdiv(s.k, TILE), _cdiv(s.n, TILE))
                args = (src, codes, i32(s.n), i32(s.k), i32(g.npad), i32(off))
                if g.code_bits == 4:
                    kernels.transpose_pack4(grid, TRANSPOSE_BLOCK, args)
                else:
                    kernels.transpose_i8(grid, TRANSPOSE_BLOCK, args)
                kernels.transpose_f32((_cdiv(s.ngroups, TILE), _cdiv(s.n, TILE)), TRANSPOSE_BLOCK,
                                      (src_s, scales, i32(s.n), i32(s.ngroups), i32(g.npad), i32(off)))

    return upload


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
