"""Kernel launches with programmatic dependent launch (PDL, sm_90+), for the captured decode step.

CuPy's ``RawKernel`` launches through ``cuLaunchKernel``, which takes no launch attributes. A decode step is
~220 short kernels in a row, and each waits for its predecessor to drain before it starts (launch latency,
first loads). Launched through ``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``,
a kernel may start while its predecessor still runs: forward.cu's kernels let dependents launch at their
start (``griddepcontrol.launch_dependents``) and wait for the predecessor (``griddepcontrol.wait``) before
they touch anything it writes, so the next GEMV's first weight loads overlap the previous kernel's tail.
Stream capture records the launches as graph kernel nodes with programmatic edges.

The driver structures are declared with ctypes (layouts checked against CUDA 13's cuda.h: CUlaunchConfig 56
bytes, attrs at offset 40; CUlaunchAttribute 72 bytes, value at offset 8).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


_CTYPES = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int32): ctypes.c_int32,
           np.dtype(np.float32): ctypes.c_float}


class PdlLauncher:
    """``launch(kernel, grid, block, args, smem, stream)`` through cuLaunchKernelEx with the PDL attribute.

    ``kernel``: a CuPy RawKernel; ``args``: numpy scalars (uint64 pointers, int32, float32), as the CuPy
    launches of forward_ops pass them. Raises RuntimeError on a CUresult other than success.
    """

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._launch = lib.cuLaunchKernelEx
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self._attr = _LaunchAttr()
        self._attr.id = PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value[0] = 1  # programmaticStreamSerializationAllowed
        assert ctypes.sizeof(_LaunchConfig) == 56 and ctypes.sizeof(_LaunchAttr) == 72

    def launch(self, kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, smem: int,
               stream: Any) -> None:
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], smem, ctypes.c_void_p(stream.ptr),
                            ctypes.pointer(self._attr), 1)
        values = [_CTYPES[np.asarray(a).dtype](a.item() if hasattr(a, "item") else a) for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        err = self._launch(ctypes.byref(cfg), ctypes.c_void_p(kernel.kernel.ptr), params, None)
        if err != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")
