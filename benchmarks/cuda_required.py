"""The CUDA benchmarks' first step: a CUDA GPU and CuPy, or one line saying which is missing (exit 1)."""

from __future__ import annotations

import sys
from pathlib import Path


def require_cuda() -> None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as exc:  # ImportError, CUDARuntimeError, ...: what is missing, in one line
        sys.exit(f"{Path(sys.argv[0]).name}: this benchmark needs a CUDA GPU and CuPy ({type(exc).__name__}: "
                 f"{str(exc).splitlines()[0] if str(exc) else 'unavailable'})")
