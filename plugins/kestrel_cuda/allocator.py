"""The device-memory interface the weight cache allocates through, and a numpy implementation of it.

``Allocator`` is what ``kestrel_cuda.residency.WeightCache`` needs from a device: ``alloc(nbytes)`` returns a
1-D uint8 buffer (anything with ``.nbytes`` that slices and ``.view(dtype)``s like an array: a numpy array
here, a CuPy array on the GPU), ``free(buffer)`` gives it back, ``free_bytes()`` says how much device memory is
free now. An allocation the device cannot satisfy raises ``DeviceOutOfMemory`` (the CuPy allocator translates
``cupy.cuda.memory.OutOfMemoryError`` into it), which the cache answers by freeing pooled buffers and retrying.

``NumpyAllocator`` backs the CPU tests: real numpy buffers against a fixed capacity, with every alloc and free
counted and checked (freeing an unknown or already-freed buffer is a bug and raises ``AllocatorError``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


class DeviceOutOfMemory(MemoryError):
    """The device cannot hold another allocation of the requested size."""


class AllocatorError(RuntimeError):
    """An allocator used wrongly (double free, freeing a foreign buffer): a bug in the caller."""


@runtime_checkable
class Buffer(Protocol):
    """One device allocation: a 1-D uint8 array-like of ``nbytes`` bytes."""

    @property
    def nbytes(self) -> int: ...

    def __getitem__(self, key: Any) -> Any: ...


@runtime_checkable
class Allocator(Protocol):
    def alloc(self, nbytes: int) -> Buffer:
        """A new uint8 buffer of ``nbytes`` bytes (content undefined); raises ``DeviceOutOfMemory``."""
        ...

    def free(self, buffer: Buffer) -> None:
        """Give ``buffer`` back to the device. The cache calls it only on close/clear, a full pool, or OOM."""
        ...

    def free_bytes(self) -> int:
        """Device memory free right now, in bytes."""
        ...


POISON = 0xCD  # fresh and reused buffers read as garbage, so an upload that skips bytes shows up in tests


class NumpyAllocator:
    """A pretend device of ``capacity`` bytes made of numpy buffers; counts and checks every alloc/free."""

    def __init__(self, capacity: int, *, poison: bool = True) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.poison = poison
        self.used = 0
        self.allocs = 0
        self.frees = 0
        self.failed_allocs = 0
        # id -> (serial, buffer). Serials, unlike ids, are never reused, so they name buffers after free.
        self._live: dict[int, tuple[int, np.ndarray]] = {}
        self.freed: list[int] = []  # serials, in the order they were freed

    def alloc(self, nbytes: int) -> np.ndarray:
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        if self.used + nbytes > self.capacity:
            self.failed_allocs += 1
            raise DeviceOutOfMemory(f"cannot allocate {nbytes} bytes: {self.free_bytes()} of "
                                    f"{self.capacity} free")
        buf = np.empty(nbytes, dtype=np.uint8)
        if self.poison:
            buf.fill(POISON)
        self.allocs += 1
        self._live[id(buf)] = (self.allocs, buf)
        self.used += nbytes
        return buf

    def free(self, buffer: np.ndarray) -> None:
        if not self.is_live(buffer):
            raise AllocatorError("free of a buffer that is not live (double free or foreign buffer)")
        serial, _ = self._live.pop(id(buffer))
        self.used -= buffer.nbytes
        self.frees += 1
        self.freed.append(serial)

    def free_bytes(self) -> int:
        return self.capacity - self.used

    def is_live(self, buffer: np.ndarray) -> bool:
        entry = self._live.get(id(buffer))
        return entry is not None and entry[1] is buffer

    def serial_of(self, buffer: np.ndarray) -> int:
        """The allocation number (1, 2, ...) of a live buffer."""
        if not self.is_live(buffer):
            raise AllocatorError("not a live buffer of this allocator")
        return self._live[id(buffer)][0]

    @property
    def live_count(self) -> int:
        return len(self._live)
