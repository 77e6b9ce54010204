"""The residency window's uploads: the next layer's weights on their own stream while the current layer computes,
their GPU time, and the pinned bus bandwidth they are measured against.

At each layer boundary L (``WindowStreamer.boundary``) the compute stream first waits for layer L's prefetched
upload, if there was one; then the upload stream waits for everything computed so far (the buffers the window
just evicted to the pool were last read there) and uploads layer L + 1's missing weights
(``WeightCache.prefetch``: only if they fit without evicting anything, pinned until taken), so the bus moves
layer L + 1 while layer L computes. The window's rule is unchanged: it evicts only the past, and the weights
and kernels are the same, so the tokens are the same as with the window off.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kestrel_core.wkey import decode_wkey, model_layer
from kestrel_cuda.residency import PreloadItem, WeightCache

BUS_PROBE_BYTES = 256 << 20  # one pinned host-to-device copy of this size measures the bus
RESOLVE_EVERY = 1024  # upload spans kept before their events are read


class UploadTimer:
    """The bytes weight uploads move over the bus (the host arrays copied: int4 codes travel as the contract's
    int8 values and are packed on the device) and their GPU time: a (start, end) event pair recorded around
    each on its stream, read later, so timing never waits for the device."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self._pending: list[tuple[Any, Any]] = []
        self._seconds = 0.0
        self.bytes = 0

    @contextmanager
    def span(self, stream: Any, nbytes: int) -> Iterator[None]:
        start = stream.record()
        yield
        self.bytes += nbytes
        self._pending.append((start, stream.record()))
        if len(self._pending) >= RESOLVE_EVERY:
            self.seconds()

    def seconds(self) -> float:
        """Upload seconds so far (waits for the uploads in flight)."""
        for start, end in self._pending:
            end.synchronize()
            self._seconds += self.cp.cuda.get_elapsed_time(start, end) / 1e3
        self._pending.clear()
        return self._seconds


class WindowStreamer:
    """Prefetch for the residency window on ``upload_stream``; ``boundary(layer)`` at each layer boundary."""

    def __init__(self, cp: Any, cache: WeightCache, compute_stream: Any) -> None:
        self.cache, self.compute = cache, compute_stream
        self.upload_stream = cp.cuda.Stream(non_blocking=True)
        self._items: dict[int, list[PreloadItem]] = {}  # streamed model layer -> its weights, uploading there
        self._done: dict[int, Any] = {}  # prefetched layer -> the event after its uploads

    def plan(self, items: Sequence[PreloadItem], streamed: set[int]) -> None:
        """The weights the window prefetches: ``items`` (uploading on ``upload_stream``) of the ``streamed``
        model layers."""
        self._items.clear()
        for item in items:
            layer = model_layer(decode_wkey(item.wkey)[0])
            if layer in streamed:
                self._items.setdefault(layer, []).append(item)

    def boundary(self, layer: int) -> None:
        if self.cache.take_prefetched(layer):
            self.compute.wait_event(self._done.pop(layer))
        items = self._items.get(layer + 1)
        if not items:
            return
        self.upload_stream.wait_event(self.compute.record())
        if self.cache.prefetch(layer + 1, items, beside=self._items.get(layer, ())):
            self._done[layer + 1] = self.upload_stream.record()

    def clear(self) -> None:
        self._items.clear()
        self._done.clear()


def pinned_h2d_gb_s(cp: Any, nbytes: int = BUS_PROBE_BYTES) -> float:
    """The bus's host-to-device bandwidth: one ``cudaMemcpyAsync`` of ``nbytes`` from page-locked memory (after
    one untimed copy), timed by events."""
    host = cp.cuda.alloc_pinned_memory(nbytes)
    dev = cp.cuda.alloc(nbytes)
    stream = cp.cuda.Stream(non_blocking=True)

    def copy() -> None:
        cp.cuda.runtime.memcpyAsync(dev.ptr, host.ptr, nbytes, cp.cuda.runtime.memcpyHostToDevice, stream.ptr)

    copy()
    start = stream.record()
    copy()
    end = stream.record()
    end.synchronize()
    return nbytes / 1e9 / (cp.cuda.get_elapsed_time(start, end) / 1e3)
