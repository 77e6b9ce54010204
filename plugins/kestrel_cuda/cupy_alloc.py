"""The weight cache's ``Allocator`` on the GPU: plain ``cudaMalloc`` buffers through CuPy.

Buffers bypass CuPy's memory pool on purpose: the weight cache keeps its own pool of evicted buffers (reused
only for an identical layout) and decides itself when device memory is given back; a buffer freed here goes
back to the device as soon as its last reference (a view held by a kernel launch argument) is dropped.
"""

from __future__ import annotations

from typing import Any

from kestrel_cuda.allocator import AllocatorError, DeviceOutOfMemory

CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


def is_out_of_memory(cp: Any, exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, cp.cuda.memory.OutOfMemoryError)):
        return True
    return isinstance(exc, cp.cuda.runtime.CUDARuntimeError) and exc.status == CUDA_ERROR_MEMORY_ALLOCATION


class CupyAllocator:
    """``alloc(nbytes)`` -> a 1-D ``cupy.uint8`` array on the current device; see ``allocator.Allocator``."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self._live: dict[int, Any] = {}
        self.allocs = 0
        self.frees = 0

    def alloc(self, nbytes: int) -> Any:
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        cp = self.cp
        for attempt in range(2):
            try:
                mem = cp.cuda.Memory(nbytes)
                break
            except Exception as exc:
                if not is_out_of_memory(cp, exc):
                    raise
                if attempt:
                    raise DeviceOutOfMemory(f"cannot allocate {nbytes} bytes on the GPU "
                                            f"({self.free_bytes()} free)") from exc
                # CuPy's own pool (activations, upload scratch) may hold the memory: hand it back, retry once
                cp.get_default_memory_pool().free_all_blocks()
        buf = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        self._live[id(buf)] = buf
        self.allocs += 1
        return buf

    def free(self, buffer: Any) -> None:
        if self._live.get(id(buffer)) is not buffer:
            raise AllocatorError("free of a buffer that is not live (double free or foreign buffer)")
        del self._live[id(buffer)]
        self.frees += 1

    def free_bytes(self) -> int:
        free, _total = self.cp.cuda.runtime.memGetInfo()
        return int(free) + int(self.cp.get_default_memory_pool().free_bytes())

    @property
    def live_count(self) -> int:
        return len(self._live)
