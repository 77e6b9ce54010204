"""Page-locking the host arrays the residency window streams, so their uploads run at the bus's speed.

A copy from pageable memory goes through the driver's staging buffers (about 6-19 GB/s on the H200 machine);
from page-locked memory the DMA engines read it directly (55 GB/s measured there with torch). The window
re-uploads its streamed layers' strip-caches every step, so those arrays are registered in place once
(``cudaHostRegister``: no copy, no second buffer; read-only for the mapped, read-only arrays of a ``.kst``
artifact) and unregistered at close. An array that cannot be registered (an old driver, a range that shares
a page with one registered before, locked-memory limits) stays pageable: its uploads are slower, not wrong.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

HOST_REGISTER_DEFAULT = 0x00
HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: a read-only mapping may be registered too


class HostPins:
    """The host arrays page-locked for one device: registered once each, all released by ``release``."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self._registered: dict[int, np.ndarray] = {}  # pointer -> array (kept alive while registered)
        self.bytes = 0
        self.failures = 0
        self.last_failure = ""

    def register(self, arrays: Iterable[np.ndarray]) -> None:
        runtime = self.cp.cuda.runtime
        for a in arrays:
            if not isinstance(a, np.ndarray) or a.nbytes == 0 or not a.flags.c_contiguous:
                continue
            ptr = int(a.ctypes.data)
            if ptr in self._registered:
                continue
            flags = HOST_REGISTER_DEFAULT if a.flags.writeable else HOST_REGISTER_READ_ONLY
            try:
                runtime.hostRegister(ptr, a.nbytes, flags)
            except Exception as exc:  # CUDARuntimeError: the array stays pageable
                self.failures += 1
                self.last_failure = f"{type(exc).__name__}: {exc}"
                continue
            self._registered[ptr] = a
            self.bytes += a.nbytes

    def release(self) -> None:
        runtime = self.cp.cuda.runtime
        for ptr in list(self._registered):
            try:
                runtime.hostUnregister(ptr)
            except Exception:  # the context may already be gone at interpreter exit
                pass
            del self._registered[ptr]
        self.bytes = 0

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"host_pinned_bytes": self.bytes, "host_pin_failures": self.failures}
        if self.last_failure:
            out["host_pin_last_failure"] = self.last_failure
        return out
