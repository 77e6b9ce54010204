"""Kernel launches with launch attributes (sm_90+): programmatic dependent launch (PDL), for the captured
decode step, and thread block clusters, for the K splits of the M=1 GEMV and of the decode batches' GEMM.

CuPy's ``RawKernel`` launches through ``cuLaunchKernel``, which takes no launch attributes. A decode step is
~220 short kernels in a row, and each waits for its predecessor to drain before it starts (launch latency,
first loads). Launched through ``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``,
a kernel may start while its predecessor still runs: the forward's kernels let dependents launch at their
start (``griddepcontrol.launch_dependents``) and wait for the predecessor (``griddepcontrol.wait``) before
they touch anything it writes, so the next GEMV's first weight loads overlap the previous kernel's tail.
Stream capture records the launches as graph kernel nodes with programmatic edges. A cluster launch groups
the K splits of a GEMV tile on one GPC, so they add their partial sums in block 0's shared memory.

The driver structures are declared with ctypes (layouts checked against CUDA 13's cuda.h: CUlaunchConfig 56
bytes, attrs at offset 40; CUlaunchAttribute 72 bytes, value at offset 8).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

CLUSTER_DIMENSION = 4  # CUlaunchAttributeID
PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


class TensorMap(ctypes.Structure):
    """A CUtensorMap (128 bytes, 64-byte aligned on the device: gemm_tma.cu TmaDesc), passed by value."""

    _fields_ = [("v", ctypes.c_uint64 * 16)]


_CTYPES = {np.uint64: ctypes.c_uint64, np.int32: ctypes.c_int32, np.float32: ctypes.c_float}  # by scalar type


def ptr_arg(a: Any) -> np.uint64:
    """A kernel pointer argument: the data pointer of a CuPy array (view), or NULL (None)."""
    return np.uint64(0 if a is None else a.data.ptr)


def i32_arg(v: int) -> np.int32:
    """A kernel int argument."""
    return np.int32(v)


def ld_arg(a: Any) -> np.int32:
    """A kernel row-stride argument: the elements between two rows of a 2-D view."""
    return np.int32(a.strides[0] // a.itemsize)


class ExLauncher:
    """``launch(kernel, grid, block, args, smem, stream, pdl, cluster)`` through cuLaunchKernelEx: ``pdl``
    sets programmatic stream serialization, ``cluster`` (x, y, z) the cluster shape.

    ``kernel``: a CuPy RawKernel; ``args``: numpy scalars (uint64 pointers, int32, float32), as the CuPy
    launches of ops_cupy pass them. Raises RuntimeError on a CUresult other than success.
    """

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._launch = lib.cuLaunchKernelEx
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self._attrs = (_LaunchAttr * 2)()
        assert ctypes.sizeof(_LaunchConfig) == 56 and ctypes.sizeof(_LaunchAttr) == 72

    def launch(self, kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, smem: int,
               stream: Any, pdl: bool = True, cluster: tuple[int, int, int] | None = None) -> None:
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        n = 0
        if pdl:
            self._attrs[n].id = PROGRAMMATIC_STREAM_SERIALIZATION
            self._attrs[n].value[0] = 1  # programmaticStreamSerializationAllowed
            n += 1
        if cluster is not None:
            self._attrs[n].id = CLUSTER_DIMENSION
            self._attrs[n].value[0], self._attrs[n].value[1], self._attrs[n].value[2] = cluster
            n += 1
        cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], smem, ctypes.c_void_p(stream.ptr),
                            self._attrs, n)
        values = [a if isinstance(a, TensorMap) else _CTYPES[type(a)](a) for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        err = self._launch(ctypes.byref(cfg), ctypes.c_void_p(kernel.kernel.ptr), params, None)
        if err != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")


class TensorMapEncoder:
    """``tiled(ptr, dtype, dims, row_bytes, box, swizzle128)``: a 2-D CUtensorMap through cuTensorMapEncodeTiled
    (dims and box innermost first; uint8 or float32; out-of-bounds elements read as zeros)."""

    UINT8, FLOAT32 = 0, 7  # CUtensorMapDataType
    SWIZZLE_NONE, SWIZZLE_128B = 0, 3
    L2_PROMOTION_128B = 2

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._encode = lib.cuTensorMapEncodeTiled
        self._encode.restype = ctypes.c_int
        u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        self._encode.argtypes = [ctypes.POINTER(TensorMap), ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                                 u64p, u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]

    def tiled(self, ptr: int, dtype: int, dims: tuple[int, int], row_bytes: int, box: tuple[int, int],
              swizzle128: bool) -> TensorMap:
        tmap = TensorMap()
        gdim = (ctypes.c_uint64 * 2)(*dims)
        gstride = (ctypes.c_uint64 * 1)(row_bytes)
        bdim = (ctypes.c_uint32 * 2)(*box)
        estride = (ctypes.c_uint32 * 2)(1, 1)
        err = self._encode(ctypes.byref(tmap), dtype, 2, ctypes.c_void_p(ptr), gdim, gstride, bdim, estride, 0,
                           self.SWIZZLE_128B if swizzle128 else self.SWIZZLE_NONE, self.L2_PROMOTION_128B, 0)
        if err != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err}")
        return tmap
