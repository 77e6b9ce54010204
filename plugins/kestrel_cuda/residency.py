"""Weight residency of the CUDA backend: weight cache, buffer pool, residency window, preload bookkeeping.

Nothing here touches a GPU: every device buffer comes from an ``Allocator`` (``kestrel_cuda.allocator``), so the
same logic runs in CI on numpy buffers and on the GPU on CuPy ones. Not thread-safe: one cache per device,
used from the thread that launches the kernels, on one stream (stream order is what makes reusing an
evicted buffer safe while an earlier kernel may still read it).

API for the backend (each weight laid out as its ``layout.Geometry`` says)
------------------------------------------------------------------------
``WeightCache(allocator, *, budget=None, keep=0)``: budget defaults to ``cache_budget(allocator.free_bytes())``;
    keep: the layers the residency window keeps (0: off).
    ``get_or_upload(wkey, geometry, upload_fn, *, source=None) -> DeviceWeight``
        hit: the resident weight (made most recently used). Miss: evict LRU entries while over budget or over
        its slots (512, or as many as the model's preload lists; into the pool, never freed), take a pooled
        buffer of the same layout or allocate, then ``upload_fn(weight)`` fills it. ``upload_fn`` gets the
        ``DeviceWeight`` (``.buffer``, ``.codes`` int8 1-D region, ``.scales`` float32 [ngroups][Npad]); the
        content is undefined (fresh or pooled), so it must write every byte of both regions, padding columns as
        zeros. If it raises, the buffer goes back to the pool, no entry is made, and the exception propagates
        (the backend declines; the CPU computes).
        ``source``: the StripCache uploaded (first member for fused); a hit whose source is another object
        (a different model on the same wkeys) or whose geometry differs is stale and is re-uploaded.
        wkey 0 is never cached: the result is a temporary (``.temporary``), to be handed back with
        ``release(weight)`` after the kernel launch (its buffer then goes to the pool).
    ``use(wkey, geometry, upload_fn, *, source=None)``: context manager around get_or_upload that pins the
        weight for the block (so fetching another weight cannot evict it) and releases a temporary at exit.
    ``pin(wkey)`` / ``unpin(wkey)``: pinned weights are never evicted by LRU or window (a CUDA graph that
        captured buffer addresses must pin them). A pinned set larger than the budget goes over it.
    ``on_layer_boundary(cur) -> int``: residency window; with keep > 0 evicts (to the pool) every weight whose
        model layer is < cur - keep + 1, except the kept layers. lm_head is never evicted; fused weights of
        layer L count as layer L; current and higher layers stay. keep == 0: nothing. Returns how many were
        evicted.
    ``preload(items) -> PreloadResult``: make ``PreloadItem(wkey, geometry, upload_fn, source)`` resident in
        order without evicting anything; stops at the first weight that does not fit the budget or slots.
        With the window on, only what ``kept_layers`` keeps (lm_head and the first layers that fit beside the
        window's own ``keep`` layers): those stay resident, and only the other layers stream each step.
    ``kept``: the model layers the window keeps (never evicted by it; by LRU only when nothing else can go).
    ``prefetch(layer, items, beside=()) -> bool``: the window's next layer, uploaded ahead of its use (on the
        backend's upload stream) when its missing weights fit the budget and the slots beside the missing ones
        of ``beside`` (the current layer's, fetched next) without evicting anything; they
        stay pinned until ``take_prefetched(layer)`` (the compute stream then waits for the upload), so an
        upload still in flight is never evicted or its buffer reused. The preload leaves room for
        PREFETCH_LAYERS beside the window's own ``keep``.
    ``release(weight)``, ``contains(wkey)``, ``len(cache)``, ``entries()`` (LRU first), ``stats() -> dict``,
    ``clear()`` (frees every cached and pooled buffer), ``close()`` (clear, free temporaries, refuse further use).
``cache_budget(free_bytes, cache_mb=None)``: ``cache_mb`` MiB (``CudaConfig.cache_mb``) if given, else free
    memory less a reserve of a quarter of it (at least 2 GiB) for the KV pool and scratch, floored at 256 MiB.
    The seed's half of free memory capped at 24 GiB streamed a 34 GB model (Qwen3-30B-A3B q8) through the
    bus on an H200 with 140 GB free: 345 MB uploaded a token, 4.4 tok/s.

Frees: eviction never frees (a device-synchronising free per layer measured costlier than the re-uploads
the window saved). Device memory is freed only (1) on clear/close, (2) when the 128-slot pool is full: its
oldest buffer is freed to make room for the newest (rather than the incoming one: the newest layout is the
one the layer loop needs next, while the oldest is likeliest a shape no longer in use: same cost, better
reuse), (3) when the device refuses an allocation: pooled buffers (oldest first), then LRU entries through
the pool, are freed until it fits or nothing is left (then ``DeviceOutOfMemory``).

Budget rule: resident bytes stay <= budget, except that a weight is always admitted after every unpinned
entry has been evicted: a single weight larger than the budget is cached alone (refusing it would upload it
on every call and use the same memory anyway), and pinned weights are never evicted to make room.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kestrel_core.errors import KestrelError
from kestrel_core.wkey import NO_CACHE, decode_wkey, model_layer
from kestrel_cuda.allocator import Allocator, Buffer, DeviceOutOfMemory
from kestrel_cuda.layout import Geometry

MAX_ENTRIES = 512
POOL_SLOTS = 128
MiB = 1 << 20
GiB = 1 << 30
BUDGET_RESERVE = 2 * GiB  # free memory the default budget leaves, at least (a quarter of it when more)
BUDGET_FLOOR = 256 * MiB
PREFETCH_LAYERS = 1  # layers the window uploads ahead of the one it computes

# -- configuration -----------------------------------------------------------------------------------


def cache_budget(free_bytes: int, cache_mb: int | None = None) -> int:
    """Cache budget in bytes: ``cache_mb`` MiB if given, else free less max(free/4, 2 GiB), floored at 256 MiB."""
    if cache_mb is not None:
        return cache_mb * MiB
    return max(free_bytes - max(free_bytes // 4, BUDGET_RESERVE), BUDGET_FLOOR)


def kept_layers(layer_bytes: dict[int, int], fixed_bytes: int, budget: int, keep: int) -> set[int]:
    """The layers a residency window of ``keep`` layers keeps resident under ``budget`` bytes: the first ones
    (``layer_bytes``: model layer -> bytes of its weights) that fit beside ``fixed_bytes`` (lm_head, never
    evicted) and the window's working set (the ``keep`` largest of the other layers), so that about
    model - budget bytes cross the bus a step instead of the whole model. Every layer when all fit."""
    layers = sorted(layer_bytes)
    if fixed_bytes + sum(layer_bytes.values()) <= budget:
        return set(layers)
    kept: set[int] = set()
    used = fixed_bytes
    for i, layer in enumerate(layers):
        window = sum(sorted((layer_bytes[x] for x in layers[i + 1:]), reverse=True)[:keep])
        if used + layer_bytes[layer] + window > budget:
            break
        kept.add(layer)
        used += layer_bytes[layer]
    return kept


# -- device weights and the pool ---------------------------------------------------------------------


class DeviceWeight:
    """One weight on the device. ``buffer`` is None once the weight was evicted or released."""

    __slots__ = ("wkey", "geometry", "buffer", "layer", "temporary", "pins", "_source")

    def __init__(self, wkey: int, geometry: Geometry, buffer: Buffer, layer: int | None, temporary: bool,
                 source: object | None) -> None:
        self.wkey = wkey
        self.geometry = geometry
        self.buffer: Any = buffer
        self.layer = layer  # model layer (fused: its layer); None for lm_head and temporaries
        self.temporary = temporary
        self.pins = 0
        self._source = _ref(source)

    @property
    def codes(self) -> Any:
        """The codes region, int8 1-D of ``codes_nbytes`` (reshape to [K][Npad] for int8 codes)."""
        return self.buffer[:self.geometry.codes_nbytes].view(np.int8)

    @property
    def scales(self) -> Any:
        """The scales region, float32 [ngroups][Npad]."""
        g = self.geometry
        region = self.buffer[g.scales_offset:g.scales_offset + g.scales_nbytes]
        return region.view(np.float32).reshape(g.ngroups, g.npad)

    def same_source(self, source: object | None) -> bool:
        return source is None or (self._source is not None and self._source() is source)

    def __repr__(self) -> str:
        state = "temporary" if self.temporary else ("gone" if self.buffer is None else "resident")
        return f"DeviceWeight(wkey={self.wkey:#x}, {self.geometry}, {state}, pins={self.pins})"


def _ref(source: object | None) -> Callable[[], object | None] | None:
    if source is None:
        return None
    try:
        return weakref.ref(source)  # a weak reference: stale entries must not keep an old model alive
    except TypeError:
        return lambda: source


class BufferPool:
    """Evicted buffers by layout: O(1) take of a given layout, O(1) removal of the oldest."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._order: OrderedDict[int, tuple[tuple[int, int], Any]] = OrderedDict()  # id -> (layout, buf)
        self._by_layout: dict[tuple[int, int], dict[int, None]] = {}  # layout -> ids, insertion-ordered
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._order)

    def buffers(self) -> list[Any]:
        """Pooled buffers, oldest first."""
        return [buf for _, buf in self._order.values()]

    def take(self, layout: tuple[int, int]) -> Any | None:
        ids = self._by_layout.get(layout)
        if not ids:
            return None
        bid, _ = ids.popitem()  # newest of that layout: likeliest still in the device's caches
        if not ids:
            del self._by_layout[layout]
        _, buf = self._order.pop(bid)
        self.nbytes -= buf.nbytes
        return buf

    def put(self, layout: tuple[int, int], buf: Any) -> Any | None:
        """Pool ``buf``; returns the buffer the caller must free to keep within the slots (or None)."""
        if self.slots <= 0:
            return buf
        victim = self.pop_oldest() if len(self._order) >= self.slots else None
        self._order[id(buf)] = (layout, buf)
        self._by_layout.setdefault(layout, {})[id(buf)] = None
        self.nbytes += buf.nbytes
        return victim

    def pop_oldest(self) -> Any | None:
        if not self._order:
            return None
        bid, (layout, buf) = self._order.popitem(last=False)
        ids = self._by_layout[layout]
        del ids[bid]
        if not ids:
            del self._by_layout[layout]
        self.nbytes -= buf.nbytes
        return buf


# -- the cache ---------------------------------------------------------------------------------------


class PreloadItem(NamedTuple):
    wkey: int
    geometry: Geometry
    upload_fn: Callable[[DeviceWeight], None]
    source: object | None = None


@dataclass
class PreloadResult:
    uploaded: int = 0
    already_resident: int = 0
    bytes: int = 0
    stopped: str = ""  # why preload stopped early ("" when everything it was to make resident was)
    streamed_layers: int = 0  # window on: layers not kept, uploaded at every step
    streamed_bytes: int = 0  # their weights' bytes


@dataclass
class Counters:
    uploads: int = 0
    upload_bytes: int = 0
    upload_errors: int = 0
    hits: int = 0
    misses: int = 0
    stale: int = 0
    evictions: int = 0
    window_evictions: int = 0
    prefetched_layers: int = 0
    pool_reuse: int = 0
    pool_frees: int = 0
    oom_frees: int = 0
    allocs: int = 0
    frees: int = 0
    temporaries: int = 0
    peak_bytes_resident: int = 0
    peak_bytes_device: int = 0


class ResidencyError(KestrelError):
    """The cache cannot serve a request (closed, or every slot pinned)."""


@dataclass
class WeightCache:
    allocator: Allocator
    budget: int | None = None
    keep: int = 0
    max_entries: int = MAX_ENTRIES
    pool_slots: int = POOL_SLOTS
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        if self.budget is None:
            self.budget = cache_budget(self.allocator.free_bytes())
        self._entries: OrderedDict[int, DeviceWeight] = OrderedDict()  # LRU first
        self.kept: set[int] = set()  # model layers the window keeps (preload)
        self._prefetched: dict[int, list[int]] = {}  # model layer -> its wkeys uploaded ahead, pinned until taken
        self._by_layer: dict[int, set[int]] = {}  # model layer -> resident wkeys (lm_head not indexed)
        self._temporaries: dict[int, DeviceWeight] = {}  # id -> temporary handed out, not yet released
        self.pool = BufferPool(self.pool_slots)
        self.bytes_resident = 0
        self.bytes_device = 0  # every live buffer of this cache: resident, pooled and temporary
        self.closed = False

    # -- lookup --------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, wkey: int) -> bool:
        return wkey in self._entries

    def entries(self) -> list[DeviceWeight]:
        """Resident weights, least recently used first."""
        return list(self._entries.values())

    def temporaries(self) -> list[DeviceWeight]:
        return list(self._temporaries.values())

    def get_or_upload(self, wkey: int, geometry: Geometry, upload_fn: Callable[[DeviceWeight], None], *,
                      source: object | None = None) -> DeviceWeight:
        if self.closed:
            raise ResidencyError("the CUDA weight cache is closed")
        if wkey == NO_CACHE:
            return self._temporary(geometry, upload_fn, source)
        entry = self._entries.get(wkey)
        if entry is not None:
            if self._fresh(entry, geometry, source):
                self._entries.move_to_end(wkey)
                self.counters.hits += 1
                return entry
            if entry.pins:
                raise ResidencyError(f"weight {wkey:#x} is pinned but was asked for with another "
                                     "geometry or source")
            self.counters.stale += 1
            self._evict(wkey)
        self.counters.misses += 1
        layer = model_layer(decode_wkey(wkey)[0])
        self._make_room(geometry.nbytes)
        entry = DeviceWeight(wkey, geometry, self._obtain(geometry), layer, False, source)
        self._upload(entry, upload_fn)
        self._entries[wkey] = entry
        if layer is not None:
            self._by_layer.setdefault(layer, set()).add(wkey)
        self.bytes_resident += geometry.nbytes
        self.counters.peak_bytes_resident = max(self.counters.peak_bytes_resident, self.bytes_resident)
        return entry

    def release(self, weight: DeviceWeight) -> None:
        """Hand back a temporary (its buffer goes to the pool); a no-op for cached weights."""
        if weight.temporary and self._temporaries.pop(id(weight), None) is weight:
            buf, weight.buffer = weight.buffer, None
            self._to_pool(weight.geometry, buf)

    @contextmanager
    def use(self, wkey: int, geometry: Geometry, upload_fn: Callable[[DeviceWeight], None], *,
            source: object | None = None) -> Iterator[DeviceWeight]:
        weight = self.get_or_upload(wkey, geometry, upload_fn, source=source)
        weight.pins += 1
        try:
            yield weight
        finally:
            weight.pins -= 1
            self.release(weight)

    def pin(self, wkey: int) -> None:
        self._entries[wkey].pins += 1

    def unpin(self, wkey: int) -> None:
        entry = self._entries[wkey]
        if entry.pins <= 0:
            raise ResidencyError(f"weight {wkey:#x} is not pinned")
        entry.pins -= 1

    # -- window and preload --------------------------------------------------------------------------

    def on_layer_boundary(self, cur: int) -> int:
        """The engine is about to run model layer ``cur``: evict layers < cur - keep + 1 (window on)."""
        if not self.keep or self.keep <= 0:
            return 0
        lo = cur - self.keep + 1
        evicted = 0
        for layer in [layer for layer in self._by_layer if layer < lo and layer not in self.kept]:
            for key in list(self._by_layer.get(layer, ())):
                if not self._entries[key].pins:
                    self._evict(key)
                    self.counters.window_evictions += 1
                    evicted += 1
        return evicted

    def prefetch(self, layer: int, items: Sequence[PreloadItem], beside: Sequence[PreloadItem] = ()) -> bool:
        assert self.budget is not None
        if self.closed or layer in self._prefetched:
            return False
        missing, now = self._missing(items), self._missing(beside)  # beside: the current layer's, fetched next
        need = sum(i.geometry.nbytes for i in missing + now)
        if not missing or (self.bytes_resident + need > self.budget
                           or len(self._entries) + len(missing) + len(now) > self.max_entries):
            return False
        keys = []
        for item in missing:
            weight = self.get_or_upload(item.wkey, item.geometry, item.upload_fn, source=item.source)
            weight.pins += 1
            keys.append(item.wkey)
        self._prefetched[layer] = keys
        self.counters.prefetched_layers += 1
        return True

    def _resident(self, item: PreloadItem) -> bool:
        entry = self._entries.get(item.wkey)
        return entry is not None and self._fresh(entry, item.geometry, item.source)

    def _missing(self, items: Sequence[PreloadItem]) -> list[PreloadItem]:
        return [i for i in items if not self._resident(i)]

    def take_prefetched(self, layer: int) -> bool:
        """Unpin what ``prefetch`` uploaded for ``layer``; whether it had (then the caller orders its use after
        the upload)."""
        keys = self._prefetched.pop(layer, None)
        if keys is None:
            return False
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.pins:
                entry.pins -= 1
        return True

    def preload(self, items: Iterable[PreloadItem]) -> PreloadResult:
        result = PreloadResult()
        assert self.budget is not None
        items = list(items)
        self.max_entries = max(self.max_entries, len(items))  # a slot for every weight (experts: thousands)
        if self.keep:
            layer_bytes: dict[int, int] = {}
            fixed = 0
            for item in items:
                layer = model_layer(decode_wkey(item.wkey)[0])
                if layer is None:
                    fixed += item.geometry.nbytes
                else:
                    layer_bytes[layer] = layer_bytes.get(layer, 0) + item.geometry.nbytes
            self.kept = kept_layers(layer_bytes, fixed, self.budget, self.keep + PREFETCH_LAYERS)
            streamed = sorted(set(layer_bytes) - self.kept)
            result.streamed_layers = len(streamed)
            result.streamed_bytes = sum(layer_bytes[x] for x in streamed)
            items = [i for i in items if model_layer(decode_wkey(i.wkey)[0]) in self.kept | {None}]
        for item in items:
            if self._resident(item):
                result.already_resident += 1
                continue
            if self.bytes_resident + item.geometry.nbytes > self.budget:
                result.stopped = f"cache budget full ({self.budget // MiB} MiB)"
                break
            if len(self._entries) >= self.max_entries:
                result.stopped = f"all {self.max_entries} cache slots used"
                break
            weight = self.get_or_upload(item.wkey, item.geometry, item.upload_fn, source=item.source)
            self.release(weight)
            result.uploaded += 1
            result.bytes += item.geometry.nbytes
        return result

    # -- teardown and stats --------------------------------------------------------------------------

    def clear(self) -> None:
        """Free every cached and pooled buffer (temporaries stay with whoever holds them)."""
        for entry in self._entries.values():
            self._free(entry.buffer)
            entry.buffer = None
        self._entries.clear()
        self._by_layer.clear()
        self.kept.clear()
        self._prefetched.clear()
        self.bytes_resident = 0
        while (buf := self.pool.pop_oldest()) is not None:
            self._free(buf)

    def close(self) -> None:
        if self.closed:
            return
        self.clear()
        for weight in self._temporaries.values():
            self._free(weight.buffer)
            weight.buffer = None
        self._temporaries.clear()
        self.closed = True

    def stats(self) -> dict[str, int | float]:
        out = asdict(self.counters)
        out.update(entries=len(self._entries), pooled=len(self.pool), bytes_resident=self.bytes_resident,
                   bytes_pooled=self.pool.nbytes, bytes_device=self.bytes_device, budget_bytes=self.budget or 0,
                   keep=self.keep or 0, kept_layers=len(self.kept))
        return out

    # -- internals -----------------------------------------------------------------------------------

    def _temporary(self, geometry: Geometry, upload_fn: Callable[[DeviceWeight], None],
                   source: object | None) -> DeviceWeight:
        weight = DeviceWeight(NO_CACHE, geometry, self._obtain(geometry), None, True, source)
        self._upload(weight, upload_fn)
        self._temporaries[id(weight)] = weight
        self.counters.temporaries += 1
        return weight

    def _upload(self, weight: DeviceWeight, upload_fn: Callable[[DeviceWeight], None]) -> None:
        try:
            upload_fn(weight)
        except BaseException:  # even an interrupt must leave every buffer accounted for
            self.counters.upload_errors += 1
            buf, weight.buffer = weight.buffer, None
            self._to_pool(weight.geometry, buf)
            raise
        self.counters.uploads += 1
        self.counters.upload_bytes += weight.geometry.nbytes

    @staticmethod
    def _fresh(entry: DeviceWeight, geometry: Geometry, source: object | None) -> bool:
        return (entry.geometry is geometry or entry.geometry == geometry) and entry.same_source(source)

    def _lru_victim(self) -> int | None:
        """The least recently used unpinned entry, one of a kept layer only when no other is left."""
        kept = None
        for key, entry in self._entries.items():
            if not entry.pins:
                if entry.layer is None or entry.layer not in self.kept:
                    return key
                kept = key if kept is None else kept
        return kept

    def _make_room(self, need: int) -> None:
        assert self.budget is not None
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self.bytes_resident + need > self.budget):
            victim = self._lru_victim()
            if victim is None:
                if len(self._entries) >= self.max_entries:
                    raise ResidencyError(f"all {self.max_entries} CUDA weight cache slots are pinned")
                return  # only pinned weights left: go over the budget rather than evict them
            self._evict(victim)

    def _evict(self, wkey: int) -> None:
        entry = self._entries.pop(wkey)
        if entry.layer is not None:
            keys = self._by_layer[entry.layer]
            keys.discard(wkey)
            if not keys:
                del self._by_layer[entry.layer]
        self.bytes_resident -= entry.geometry.nbytes
        self.counters.evictions += 1
        buf, entry.buffer = entry.buffer, None
        self._to_pool(entry.geometry, buf)

    def _to_pool(self, geometry: Geometry, buf: Any) -> None:
        victim = self.pool.put(geometry.layout, buf)
        if victim is not None:
            self.counters.pool_frees += 1
            self._free(victim)

    def _obtain(self, geometry: Geometry) -> Any:
        """A buffer of ``geometry``'s layout: pooled if one is, else allocated (freeing what it takes)."""
        while True:
            buf = self.pool.take(geometry.layout)
            if buf is not None:
                self.counters.pool_reuse += 1
                return buf
            try:
                buf = self.allocator.alloc(geometry.nbytes)
            except DeviceOutOfMemory:
                victim = self.pool.pop_oldest()
                if victim is not None:
                    self.counters.oom_frees += 1
                    self._free(victim)
                    continue
                key = self._lru_victim()
                if key is None:
                    raise
                self._evict(key)  # into the pool: reused just above if it fits, else freed next round
                continue
            self.counters.allocs += 1
            self.bytes_device += buf.nbytes
            self.counters.peak_bytes_device = max(self.counters.peak_bytes_device, self.bytes_device)
            return buf

    def _free(self, buf: Any) -> None:
        self.allocator.free(buf)
        self.counters.frees += 1
        self.bytes_device -= buf.nbytes
