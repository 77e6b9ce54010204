"""CPU tests of the CUDA backend's residency logic, on a real allocator of numpy buffers.

The expected values come from the residency rules (kestrel_cuda.residency's docstring), written out here, or
from a small reference model of the LRU and window rules kept in this file; the cache's buffers are checked by
content (each upload stamps its buffer) and by identity against the allocator's own record of live and freed
buffers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kestrel_core.contract import quantize_weight
from kestrel_core.wkey import Proj, fused_wkey, lm_head_wkey, wkey
from kestrel_cuda.allocator import AllocatorError, DeviceOutOfMemory, NumpyAllocator
from kestrel_cuda.layout import Geometry, fusable, pad_n
from kestrel_cuda.residency import PreloadItem, ResidencyError, WeightCache, cache_budget, kept_layers

MiB = 1 << 20
GiB = 1 << 30
BIG = 1 << 40  # a capacity the tests never reach

G_A = Geometry(k=64, npad=64, ngroups=2)                 # codes 4096 B, scales 512 B
G_A_PACKED = Geometry(k=64, npad=64, ngroups=2, code_bits=4)
G_A_TWIN = Geometry(k=128, npad=32, ngroups=4)           # another geometry, the same two region sizes as G_A
G_B = Geometry(k=256, npad=128, ngroups=8)


class Stamper:
    """upload_fn factory: fills the whole buffer with a per-upload stamp, so aliasing shows in the content."""

    def __init__(self) -> None:
        self.count = 0
        self.stamp: dict[int, int] = {}  # id(DeviceWeight) -> stamp

    def __call__(self, weight) -> None:
        self.count += 1
        s = self.count % 127
        weight.codes[:] = s
        weight.scales[:] = float(self.count)
        self.stamp[id(weight)] = self.count

    def intact(self, weight) -> bool:
        n = self.stamp[id(weight)]
        return bool((weight.codes == n % 127).all() and (weight.scales == float(n)).all())


def failing_upload(weight) -> None:
    weight.codes[:5] = 1  # a partial write, then the device error
    raise RuntimeError("simulated CUDA error during upload")


def ids(bufs: list) -> list[int]:
    return [id(b) for b in bufs]


def owned_buffers(cache: WeightCache) -> list:
    return ([e.buffer for e in cache.entries()] + cache.pool.buffers()
            + [t.buffer for t in cache.temporaries()])


def assert_accounted(cache: WeightCache, alloc: NumpyAllocator) -> None:
    """Every live buffer is held exactly once (cached, pooled or temporary), and nothing else is live."""
    bufs = owned_buffers(cache)
    assert len({id(b) for b in bufs}) == len(bufs), "a buffer is held twice"
    assert all(alloc.is_live(b) for b in bufs), "the cache holds a freed buffer"
    assert alloc.live_count == len(bufs), "a live buffer is held by nobody (leak)"
    assert len(set(alloc.freed)) == len(alloc.freed) == alloc.frees, "a buffer was freed twice"
    assert cache.bytes_resident == sum(e.geometry.nbytes for e in cache.entries())
    assert cache.bytes_device == alloc.used
    st_ = cache.stats()
    assert st_["allocs"] == alloc.allocs and st_["frees"] == alloc.frees


# -- configuration -----------------------------------------------------------------------------------


@pytest.mark.parametrize("free, expected", [
    (8 * GiB, 6 * GiB),          # a quarter of free memory left for the KV pool and scratch
    (140 * GiB, 105 * GiB),      # an H200: a 34 GB model fits
    (8 * GiB + 3, 6 * GiB + 3),  # the quarter rounds down
    (6 * GiB, 4 * GiB),          # at least 2 GiB left
    (2 * GiB + 300 * MiB, 300 * MiB),
    (2 * GiB, 256 * MiB),        # floored
    (0, 256 * MiB),
])
def test_budget_from_free_memory(free: int, expected: int) -> None:
    assert cache_budget(free) == expected
    assert WeightCache(NumpyAllocator(free)).budget == expected


def test_budget_given_in_mib() -> None:
    assert cache_budget(80 * GiB, 100) == 100 * MiB  # below the floor and below half: the user's choice wins
    assert WeightCache(NumpyAllocator(1 * GiB), budget=cache_budget(GiB, 40000)).budget == 40000 * MiB
    assert WeightCache(NumpyAllocator(GiB)).keep == 0  # the window is off unless asked for


# -- geometry ----------------------------------------------------------------------------------------


def test_geometry_of_strip_caches() -> None:
    rng = np.random.default_rng(0)
    w = quantize_weight(rng.standard_normal((10, 64)).astype(np.float32), bits=8, group_size=32)
    g = Geometry.of(w)
    assert (g.k, g.npad, g.ngroups, g.code_bits) == (64, 12, 2, 8)
    assert g.codes_nbytes == 64 * 12 and g.scales_offset == 768 and g.scales_nbytes == 2 * 12 * 4
    w4 = quantize_weight(rng.standard_normal((8, 256)).astype(np.float32), bits=4, group_size=256)
    assert Geometry.of(w4).code_bits == 8 and Geometry.of(w4, pack_int4=True).code_bits == 4
    assert Geometry.of(w4, pack_int4=True).codes_nbytes == 256 * 8 // 2
    assert Geometry.of(w, pack_int4=True).code_bits == 8  # int8 weights never pack
    assert [pad_n(n) for n in (1, 4, 5, 7, 8, 4093)] == [4, 4, 8, 8, 8, 4096]
    assert Geometry(k=64, npad=200, ngroups=2).scales_offset % 256 == 0


def test_fused_geometry() -> None:
    rng = np.random.default_rng(1)
    q, k, v = (quantize_weight(rng.standard_normal((n, 64)).astype(np.float32)) for n in (16, 8, 8))
    assert fusable([q, k, v])
    assert Geometry.fused([q, k, v]) == Geometry(k=64, npad=32, ngroups=2)
    odd = quantize_weight(rng.standard_normal((6, 64)).astype(np.float32))
    g256 = quantize_weight(rng.standard_normal((8, 256)).astype(np.float32), group_size=256)
    assert not fusable([q, odd]) and not fusable([q]) and not fusable([q, g256])
    with pytest.raises(ValueError):
        Geometry.fused([q, odd])


# -- LRU and budget ----------------------------------------------------------------------------------


def test_lru_512_slots() -> None:
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=BIG)
    keys = [wkey(i, Proj.Q) for i in range(513)]
    for key in keys[:512]:
        cache.get_or_upload(key, G_A, up)
    assert len(cache) == 512 and cache.stats()["evictions"] == 0
    cache.get_or_upload(keys[0], G_A, up)  # keys[0] becomes most recent: keys[1] is now the LRU
    cache.get_or_upload(keys[512], G_A, up)
    assert len(cache) == 512
    assert not cache.contains(keys[1]) and cache.contains(keys[0]) and cache.contains(keys[512])
    assert [e.wkey for e in cache.entries()] == keys[2:512] + [keys[0], keys[512]]
    s = cache.stats()
    assert (s["hits"], s["misses"], s["evictions"], s["uploads"]) == (1, 513, 1, 513)
    assert s["pool_reuse"] == 1 and s["allocs"] == 512 and alloc.frees == 0  # keys[1]'s buffer reused
    assert all(up.intact(e) for e in cache.entries())


def test_lru_by_budget_and_peak() -> None:
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=3 * G_A.nbytes)
    a, b, c, d = (wkey(i, Proj.O) for i in range(4))
    for key in (a, b, c):
        cache.get_or_upload(key, G_A, up)
    assert cache.get_or_upload(a, G_A, up) is cache.entries()[-1]
    cache.get_or_upload(d, G_A, up)
    assert [e.wkey for e in cache.entries()] == [c, a, d]  # b was the least recently used
    assert cache.bytes_resident == 3 * G_A.nbytes == cache.stats()["peak_bytes_resident"]
    double = Geometry(k=64, npad=128, ngroups=2)
    assert double.nbytes == 2 * G_A.nbytes
    cache.get_or_upload(wkey(9, Proj.O), double, up)  # twice the size: evicts the two oldest
    assert [e.wkey for e in cache.entries()] == [d, wkey(9, Proj.O)]
    assert cache.bytes_resident == cache.budget and cache.stats()["evictions"] == 3
    assert alloc.frees == 0
    assert_accounted(cache, alloc)


def test_single_weight_over_budget_is_cached_alone() -> None:
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=G_A.nbytes)
    cache.get_or_upload(wkey(0, Proj.Q), G_A, up)
    big = cache.get_or_upload(wkey(1, Proj.Q), G_B, up)
    assert cache.entries() == [big] and cache.bytes_resident == G_B.nbytes > cache.budget
    assert cache.get_or_upload(wkey(1, Proj.Q), G_B, up) is big and cache.stats()["hits"] == 1


# -- pool --------------------------------------------------------------------------------------------


def test_eviction_pools_and_reuses_only_the_same_layout() -> None:
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=G_B.nbytes)
    w1 = cache.get_or_upload(wkey(0, Proj.Q), G_A, up)
    buf1 = w1.buffer
    cache.get_or_upload(wkey(1, Proj.Q), G_B, up)  # evicts w1: its buffer is pooled, not freed
    assert w1.buffer is None and ids(cache.pool.buffers()) == [id(buf1)] and alloc.frees == 0
    assert alloc.is_live(buf1)
    assert cache.stats()["allocs"] == 2
    # another layout: no reuse, a fresh allocation (and G_B's weight is evicted to the pool)
    cache.get_or_upload(wkey(2, Proj.Q), G_A_PACKED, up)
    assert cache.stats()["pool_reuse"] == 0 and cache.stats()["allocs"] == 3
    # the twin geometry has G_A's layout: it takes buf1
    twin = cache.get_or_upload(wkey(3, Proj.Q), G_A_TWIN, up)
    assert twin.buffer is buf1 and cache.stats()["pool_reuse"] == 1 and up.intact(twin)
    assert alloc.frees == 0
    assert_accounted(cache, alloc)


def test_padding_and_geometry_twins_share_the_pool() -> None:
    rng = np.random.default_rng(2)
    gate = quantize_weight(rng.standard_normal((96, 64)).astype(np.float32))   # [F, D]
    down = quantize_weight(rng.standard_normal((64, 96)).astype(np.float32))   # [D, F]
    odd = quantize_weight(rng.standard_normal((61, 96)).astype(np.float32))    # N=61 pads to down's 64
    assert Geometry.of(gate) != Geometry.of(down) and Geometry.of(gate).layout == Geometry.of(down).layout
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=Geometry.of(gate).nbytes)
    first = cache.get_or_upload(wkey(0, Proj.DOWN), Geometry.of(down), up).buffer
    assert cache.get_or_upload(wkey(1, Proj.GATE), Geometry.of(gate), up).buffer is first
    assert Geometry.of(odd) == Geometry.of(down)
    assert cache.get_or_upload(wkey(2, Proj.DOWN), Geometry.of(odd), up).buffer is first
    assert alloc.allocs == 1 and cache.stats()["pool_reuse"] == 2


def test_pool_limit_frees_oldest() -> None:
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=1)  # one resident weight at a time
    geoms = [Geometry(k=32, npad=4 * (i + 1), ngroups=1) for i in range(140)]  # 140 distinct layouts
    bufs = [cache.get_or_upload(wkey(i, Proj.Q), g, up).buffer for i, g in enumerate(geoms)]
    serials = [alloc.serial_of(b) if alloc.is_live(b) else None for b in bufs]
    # 139 evicted; the pool keeps the newest 128 and freed the 11 oldest, each exactly once
    assert len(cache.pool) == 128 and cache.stats()["pool_frees"] == 11 == alloc.frees
    assert alloc.freed == list(range(1, 12)) and serials[:11] == [None] * 11
    assert ids(cache.pool.buffers()) == ids(bufs[11:139])
    assert serials[11:] == list(range(12, 141))
    with pytest.raises(AllocatorError):
        alloc.free(bufs[0])  # the numpy allocator really tracks frees: a double free is caught
    assert_accounted(cache, alloc)


# -- wkey 0 ------------------------------------------------------------------------------------------


def test_wkey_zero_is_never_cached() -> None:
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=BIG)
    t1 = cache.get_or_upload(0, G_A, up)
    assert t1.temporary and len(cache) == 0 and up.intact(t1) and cache.temporaries() == [t1]
    buf = t1.buffer
    cache.release(t1)
    assert t1.buffer is None and ids(cache.pool.buffers()) == [id(buf)] and cache.temporaries() == []
    cache.release(t1)  # a second release is harmless
    with cache.use(0, G_A, up) as t2:
        assert t2.buffer is buf and len(cache) == 0
    assert ids(cache.pool.buffers()) == [id(buf)]
    s = cache.stats()
    assert (s["uploads"], s["hits"], s["misses"], s["temporaries"], s["allocs"]) == (2, 0, 0, 2, 1)
    assert_accounted(cache, alloc)


# -- residency window --------------------------------------------------------------------------------

N_LAYERS = 36


def layer_weights(layer: int) -> list[tuple[int, Geometry]]:
    """What one layer uploads: fused QKV and gate|up on even layers, per-projection weights on odd ones."""
    if layer % 2 == 0:
        return [(fused_wkey(layer, Proj.QKV), G_B), (wkey(layer, Proj.O), G_A),
                (fused_wkey(layer, Proj.GATE_UP), G_B), (wkey(layer, Proj.DOWN), G_A_TWIN)]
    return [(wkey(layer, p), G_A) for p in (Proj.Q, Proj.K, Proj.V, Proj.O, Proj.GATE, Proj.UP)] + \
        [(wkey(layer, Proj.DOWN), G_A_PACKED)]


@pytest.mark.parametrize("keep", [1, 4, 16])
def test_window_walk(keep: int) -> None:
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=BIG, keep=keep)
    layer_of: dict[int, int | None] = {lm_head_wkey(): None}
    allocs_after: list[int] = []
    for token in range(3):
        for cur in range(N_LAYERS):
            before = {e.wkey for e in cache.entries()}
            cache.on_layer_boundary(cur)
            lo = cur - keep + 1
            expected = {k for k in before if layer_of[k] is None or layer_of[k] >= lo}
            assert {e.wkey for e in cache.entries()} == expected, (token, cur)
            for key, geom in layer_weights(cur):
                layer_of[key] = cur
                cache.get_or_upload(key, geom, up)
        cache.get_or_upload(lm_head_wkey(), G_B, up)
        allocs_after.append(alloc.allocs)
        resident_layers = {layer_of[e.wkey] for e in cache.entries()}
        assert resident_layers == set(range(N_LAYERS - keep, N_LAYERS)) | {None}
    assert alloc.frees == 0  # eviction never frees
    assert allocs_after[1] == allocs_after[2]  # from the 2nd token on, every upload reuses a pooled buffer
    s = cache.stats()
    assert s["window_evictions"] == s["evictions"] > 0
    # Tokens 2 and 3 hit lm_head and the last `keep` layers of the token before: the boundaries 0..L of
    # the next token never evict layer L (current and higher layers stay), so it is still there at L.
    tail = sum(len(layer_weights(layer)) for layer in range(N_LAYERS - keep, N_LAYERS))
    assert s["hits"] == 2 * (1 + tail)
    assert all(up.intact(e) for e in cache.entries())
    assert_accounted(cache, alloc)


def test_window_keeps_lm_head_and_maps_fused_to_their_layer() -> None:
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=BIG, keep=2)
    cache.get_or_upload(lm_head_wkey(), G_A, up)
    for layer in range(4):
        cache.get_or_upload(fused_wkey(layer, Proj.QKV), G_A, up)
        cache.get_or_upload(wkey(layer, Proj.O), G_A, up)
    assert cache.on_layer_boundary(2) == 2  # layer 0: its fused QKV and its o
    assert {e.wkey for e in cache.entries()} == {lm_head_wkey()} | {
        k for layer in (1, 2, 3) for k in (fused_wkey(layer, Proj.QKV), wkey(layer, Proj.O))}
    assert cache.on_layer_boundary(1000) == 6 and [e.wkey for e in cache.entries()] == [lm_head_wkey()]
    off = WeightCache(NumpyAllocator(BIG), budget=BIG, keep=0)
    off.get_or_upload(wkey(0, Proj.Q), G_A, up)
    assert off.on_layer_boundary(1000) == 0 and len(off) == 1


# -- failures ----------------------------------------------------------------------------------------


def test_upload_failure_leaves_cache_consistent() -> None:
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=2 * G_A.nbytes)
    a = cache.get_or_upload(wkey(0, Proj.Q), G_A, up)
    with pytest.raises(RuntimeError, match="simulated"):
        cache.get_or_upload(wkey(1, Proj.Q), G_A, failing_upload)  # fresh buffer
    assert not cache.contains(wkey(1, Proj.Q)) and len(cache.pool) == 1 and cache.entries() == [a]
    assert cache.stats()["upload_errors"] == 1 and cache.stats()["uploads"] == 1
    pooled = cache.pool.buffers()[0]
    with pytest.raises(RuntimeError):
        cache.get_or_upload(wkey(1, Proj.Q), G_A, failing_upload)  # pooled buffer: back to the pool
    assert ids(cache.pool.buffers()) == [id(pooled)]
    with pytest.raises(RuntimeError):
        cache.get_or_upload(0, G_A, failing_upload)  # a temporary
    assert cache.temporaries() == [] and ids(cache.pool.buffers()) == [id(pooled)]
    b = cache.get_or_upload(wkey(1, Proj.Q), G_A, up)
    assert b.buffer is pooled and up.intact(b) and up.intact(a)
    assert alloc.frees == 0
    assert_accounted(cache, alloc)


def test_out_of_memory_frees_pool_then_lru_then_raises() -> None:
    alloc, up = NumpyAllocator(G_B.nbytes + 1000), Stamper()
    cache = WeightCache(alloc, budget=BIG)
    cache.get_or_upload(wkey(0, Proj.Q), G_A, up)
    cache.get_or_upload(0, G_A_PACKED, up)
    assert len(cache.pool) == 0
    cache.release(cache.temporaries()[0])  # pooled G_A_PACKED buffer
    b = cache.get_or_upload(wkey(1, Proj.Q), G_B, up)  # needs the pooled buffer and the LRU entry freed
    assert cache.entries() == [b] and len(cache.pool) == 0
    assert cache.stats()["oom_frees"] == 2 and alloc.frees == 2
    with pytest.raises(DeviceOutOfMemory):
        with cache.use(wkey(2, Proj.Q), G_B, up):
            cache.get_or_upload(wkey(3, Proj.Q), Geometry(k=4096, npad=4096, ngroups=128), up)
    assert_accounted(cache, alloc)


def test_stale_entry_is_reuploaded() -> None:
    rng = np.random.default_rng(3)
    old, new = (quantize_weight(rng.standard_normal((8, 64)).astype(np.float32)) for _ in range(2))
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=BIG)
    first = cache.get_or_upload(wkey(0, Proj.Q), Geometry.of(old), up, source=old)
    assert cache.get_or_upload(wkey(0, Proj.Q), Geometry.of(old), up, source=old) is first
    second = cache.get_or_upload(wkey(0, Proj.Q), Geometry.of(new), up, source=new)  # another model
    assert second is not first and cache.stats()["stale"] == 1 and up.count == 2
    third = cache.get_or_upload(wkey(0, Proj.Q), G_B, up, source=new)  # another shape on the same key
    assert third is not second and cache.stats()["stale"] == 2 and len(cache) == 1
    assert_accounted(cache, alloc)


def test_pinned_weights_survive_lru_and_window() -> None:
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=G_A.nbytes, keep=1)
    with cache.use(wkey(0, Proj.Q), G_A, up) as q:
        k = cache.get_or_upload(wkey(0, Proj.K), G_A, up)  # over budget rather than evict the pinned q
        assert cache.contains(wkey(0, Proj.Q)) and up.intact(q) and k.buffer is not q.buffer
        assert cache.on_layer_boundary(5) == 1 and cache.entries() == [q]
    assert q.pins == 0
    cache.pin(wkey(0, Proj.Q))
    assert cache.on_layer_boundary(6) == 0
    cache.unpin(wkey(0, Proj.Q))
    with pytest.raises(ResidencyError):
        cache.unpin(wkey(0, Proj.Q))
    assert cache.on_layer_boundary(6) == 1 and len(cache) == 0


def test_all_slots_pinned() -> None:
    cache = WeightCache(NumpyAllocator(BIG), budget=BIG, max_entries=2)
    up = Stamper()
    for i in range(2):
        cache.get_or_upload(wkey(i, Proj.Q), G_A, up)
        cache.pin(wkey(i, Proj.Q))
    with pytest.raises(ResidencyError, match="pinned"):
        cache.get_or_upload(wkey(2, Proj.Q), G_A, up)


# -- preload, clear, close ---------------------------------------------------------------------------


def test_preload_stops_at_budget_without_evicting() -> None:
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=3 * G_A.nbytes)
    items = [PreloadItem(wkey(i, Proj.Q), G_A, up) for i in range(5)]
    res = cache.preload(items)
    assert (res.uploaded, res.bytes, cache.stats()["evictions"]) == (3, 3 * G_A.nbytes, 0)
    assert "budget" in res.stopped and [e.wkey for e in cache.entries()] == [i.wkey for i in items[:3]]
    again = cache.preload(items[:3])
    assert (again.uploaded, again.already_resident, again.stopped) == (0, 3, "")
    windowed = WeightCache(NumpyAllocator(BIG), budget=BIG, keep=4)
    res = windowed.preload(items)  # everything fits: the window keeps every layer, nothing streams
    assert (res.uploaded, res.streamed_layers, windowed.kept) == (5, 0, set(range(5)))


def test_preload_gives_every_weight_of_the_model_a_slot() -> None:
    """A mixture of experts lists more weights than the 512 default slots: preload grows the slots to them, so
    every expert stays resident and a decode step uploads nothing."""
    up = Stamper()
    cache = WeightCache(NumpyAllocator(BIG), budget=BIG, max_entries=4)
    items = [PreloadItem(wkey(0, Proj.GATE, expert=e), G_A, up) for e in range(10)]
    res = cache.preload(items)
    assert (res.uploaded, res.stopped, cache.max_entries) == (10, "", 10)
    calls = up.count
    for item in items:
        cache.release(cache.get_or_upload(item.wkey, item.geometry, up))
    assert up.count == calls and cache.stats()["evictions"] == 0


def test_kept_layers_are_the_first_that_fit_beside_the_window() -> None:
    sizes = {0: 10, 1: 10, 2: 30, 3: 10, 4: 10}
    assert kept_layers(sizes, 5, 75, 1) == set(range(5))  # all of it fits
    assert kept_layers(sizes, 5, 74, 1) == {0, 1, 2}  # then 55 kept + 10 + a window of 10 > 74
    assert kept_layers(sizes, 5, 64, 1) == {0, 1}  # 25 + 30 + a window of 10 > 64 at layer 2
    assert kept_layers(sizes, 5, 74, 2) == {0, 1}  # a window of two layers: 25 + 30 + 10 + 10 > 74
    assert kept_layers(sizes, 5, 20, 1) == set()  # not even the window's working set fits


def test_the_window_streams_only_the_layers_that_do_not_fit() -> None:
    """Budget for lm_head and 5 of 8 layers, keep = 1: the first 3 layers stay (room for the window's layer and
    the one it prefetches); the other 5 stream, the last of them staying into the next step while the room
    allows, so a step uploads 4 layers, never a kept weight again, within the budget."""
    alloc, up = NumpyAllocator(BIG), Stamper()
    n_layers, unit = 8, G_A.nbytes
    cache = WeightCache(alloc, budget=11 * unit, keep=1)
    weights = {layer: [wkey(layer, Proj.Q), wkey(layer, Proj.O)] for layer in range(n_layers)}
    items = [PreloadItem(k, G_A, up) for layer in range(n_layers) for k in weights[layer]]
    res = cache.preload([*items, PreloadItem(lm_head_wkey(), G_A, up)])
    assert cache.kept == {0, 1, 2} and (res.streamed_layers, res.streamed_bytes) == (5, 10 * unit)
    assert res.uploaded == 7 and res.stopped == ""
    kept_weights = {e.wkey: e for e in cache.entries()}
    per_step = []
    for _ in range(3):
        before = cache.counters.upload_bytes
        for cur in range(n_layers):
            cache.on_layer_boundary(cur)
            for k in weights[cur]:
                cache.get_or_upload(k, G_A, up)
                assert cache.bytes_resident <= cache.budget
        cache.get_or_upload(lm_head_wkey(), G_A, up)
        per_step.append(cache.counters.upload_bytes - before)
    assert per_step[1:] == [8 * unit, 8 * unit]  # layers 3-6, once each
    assert all(cache.contains(k) and cache._entries[k] is e and up.intact(e) for k, e in kept_weights.items())
    assert_accounted(cache, alloc)


def test_the_window_prefetches_the_next_layer_within_the_budget() -> None:
    """The streamer's walk (kestrel_cuda.streaming): at boundary L take L's prefetch, then prefetch L + 1 beside
    L's own weights. The same bytes cross as without prefetch, ahead of their use where the budget allows, never
    over budget;
    a prefetched weight stays pinned (the window and the LRU leave it alone) until taken, and its use is a
    hit; the content of every weight is its own."""
    alloc, up = NumpyAllocator(BIG), Stamper()
    n_layers, unit = 8, G_A.nbytes
    cache = WeightCache(alloc, budget=11 * unit, keep=1)
    weights = {layer: [wkey(layer, Proj.Q), wkey(layer, Proj.O)] for layer in range(n_layers)}
    by_layer = {layer: [PreloadItem(k, G_A, up) for k in weights[layer]] for layer in range(n_layers)}
    cache.preload([*(i for layer in range(n_layers) for i in by_layer[layer]), PreloadItem(lm_head_wkey(), G_A, up)])
    streamed = set(range(n_layers)) - cache.kept
    prefetched, per_step = [], []
    for _ in range(3):
        before = cache.counters.upload_bytes
        for cur in range(n_layers):
            cache.on_layer_boundary(cur)
            took = cache.take_prefetched(cur)
            beside = by_layer[cur] if cur in streamed else []
            if cur + 1 in streamed and cache.prefetch(cur + 1, by_layer[cur + 1], beside):
                prefetched.append(cur + 1)
                assert all(cache._entries[k].pins == 1 for k in weights[cur + 1])
                assert not cache.prefetch(cur + 1, by_layer[cur + 1])  # already under way
            assert cache.bytes_resident <= cache.budget
            misses = cache.counters.misses
            for k in weights[cur]:
                w = cache.get_or_upload(k, G_A, up)
                assert up.intact(w) and w.pins == 0
            assert cache.counters.misses == misses or not (took or cur in cache.kept)  # a prefetched layer: hits
            assert cache.bytes_resident <= cache.budget
        cache.get_or_upload(lm_head_wkey(), G_A, up)
        per_step.append(cache.counters.upload_bytes - before)
    assert per_step[1:] == [8 * unit, 8 * unit]  # as without prefetch: layers 3-6 once each, 7 stays
    assert set(prefetched) == streamed and cache.counters.prefetched_layers == len(prefetched)
    assert not cache.prefetch(n_layers - 1, by_layer[n_layers - 1][:0])  # nothing missing: nothing to do
    assert_accounted(cache, alloc)


def test_a_prefetch_that_does_not_fit_uploads_nothing() -> None:
    """A prefetch never evicts: over the budget (or the slots) it declines and the layer is fetched on use."""
    up = Stamper()
    cache = WeightCache(NumpyAllocator(BIG), budget=3 * G_A.nbytes, keep=1)
    for layer in range(2):
        cache.get_or_upload(wkey(layer, Proj.Q), G_A, up)
    items = [PreloadItem(wkey(2, Proj.Q), G_A, up), PreloadItem(wkey(2, Proj.O), G_A, up)]
    assert not cache.prefetch(2, items) and not cache.contains(wkey(2, Proj.Q))
    assert cache.counters.evictions == 0 and not cache.take_prefetched(2)
    slots = WeightCache(NumpyAllocator(BIG), budget=BIG, keep=1, max_entries=1)
    assert not slots.prefetch(0, items) and len(slots) == 0


def test_clear_and_close_free_everything_once() -> None:
    alloc, up = NumpyAllocator(BIG), Stamper()
    cache = WeightCache(alloc, budget=2 * G_A.nbytes)
    for i in range(4):
        cache.get_or_upload(wkey(i, Proj.Q), G_A if i % 2 else G_B, up)
    temp = cache.get_or_upload(0, G_A, up)
    cache.clear()
    assert len(cache) == 0 and len(cache.pool) == 0 and alloc.live_count == 1  # the temporary
    assert_accounted(cache, alloc)
    cache.close()
    cache.close()
    assert temp.buffer is None and alloc.live_count == 0 and alloc.frees == alloc.allocs
    assert sorted(alloc.freed) == list(range(1, alloc.allocs + 1))
    with pytest.raises(ResidencyError, match="closed"):
        cache.get_or_upload(wkey(0, Proj.Q), G_A, up)


# -- random sequences against a reference model ------------------------------------------------------


@dataclass
class RefModel:
    """The LRU + window rules, written plainly: a list in LRU order of (wkey, geometry, layer)."""

    budget: int
    max_entries: int
    keep: int
    lru: list[tuple[int, Geometry, int | None]] = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(g.nbytes for _, g, _ in self.lru)

    def access(self, key: int, geom: Geometry, layer: int | None, ok: bool) -> tuple[bool, bool, list[int]]:
        """(hit, stale, evicted wkeys) of one get_or_upload; ok=False: the upload fails."""
        stale = False
        for i, (k, g, _) in enumerate(self.lru):
            if k == key:
                if g == geom:
                    self.lru.append(self.lru.pop(i))
                    return True, False, []
                self.lru.pop(i)
                stale = True
                break
        evicted = []
        while self.lru and (len(self.lru) >= self.max_entries or self.nbytes() + geom.nbytes > self.budget):
            evicted.append(self.lru.pop(0)[0])
        if ok:
            self.lru.append((key, geom, layer))
        return False, stale, evicted

    def boundary(self, cur: int) -> None:
        if self.keep:
            self.lru = [e for e in self.lru if e[2] is None or e[2] >= cur - self.keep + 1]


KEYS = [(wkey(layer, p), layer) for layer in range(6) for p in (Proj.Q, Proj.DOWN)] + \
    [(fused_wkey(layer, Proj.QKV), layer) for layer in range(6)] + [(lm_head_wkey(), None)]
GEOMS = [G_A, G_A_PACKED, G_A_TWIN, G_B]


class ResidencyMachine(RuleBasedStateMachine):
    @initialize(budget_units=st.integers(1, 8), keep=st.sampled_from([0, 1, 2, 4]),
                slots=st.integers(1, 6), pool_slots=st.integers(0, 4))
    def setup(self, budget_units: int, keep: int, slots: int, pool_slots: int) -> None:
        budget = budget_units * G_A.nbytes
        self.alloc = NumpyAllocator(BIG)
        self.up = Stamper()
        self.cache = WeightCache(self.alloc, budget=budget, keep=keep, max_entries=slots,
                                 pool_slots=pool_slots)
        self.ref = RefModel(budget, slots, keep)
        self.held: list = []

    def _access(self, key: int, layer: int | None, geom: Geometry, ok: bool) -> None:
        before_pool = {id(b) for b in self.cache.pool.buffers()}
        before_entries = {e.wkey: e.buffer for e in self.cache.entries()}
        allocs = self.alloc.allocs
        hit, stale, evicted = self.ref.access(key, geom, layer, ok)
        if ok:
            w = self.cache.get_or_upload(key, geom, self.up)
            assert self.up.intact(w)
        else:
            with pytest.raises(RuntimeError):
                self.cache.get_or_upload(key, geom, failing_upload)
        if hit:
            assert w.buffer is before_entries[key] and self.alloc.allocs == allocs
            return
        gone = set(before_entries) - {e.wkey for e in self.cache.entries()}
        assert gone == set(evicted) | ({key} if stale and not ok else set())
        if ok:
            # In GEOMS, equal nbytes <=> equal layout. A fresh allocation only when, after the evictions,
            # no pooled buffer of the layout was left; otherwise a pooled or just-evicted buffer was reused.
            if self.alloc.allocs > allocs:
                assert self.alloc.allocs == allocs + 1
                assert not any(b.nbytes == geom.nbytes for b in self.cache.pool.buffers())
            else:
                assert id(w.buffer) in before_pool or any(w.buffer is b for b in before_entries.values())

    @rule(i=st.integers(0, len(KEYS) - 1), g=st.integers(0, len(GEOMS) - 1), stable=st.booleans())
    def get(self, i: int, g: int, stable: bool) -> None:
        key, layer = KEYS[i]
        geom = GEOMS[(i if stable else g) % len(GEOMS)]  # mostly one geometry per key; sometimes stale
        self._access(key, layer, geom, ok=True)

    @rule(i=st.integers(0, len(KEYS) - 1))
    def get_failing(self, i: int) -> None:
        key, layer = KEYS[i]
        geom = GEOMS[i % len(GEOMS)]
        if self.cache.contains(key):
            return  # a hit never calls upload
        self._access(key, layer, geom, ok=False)

    @rule(g=st.integers(0, len(GEOMS) - 1))
    def temporary(self, g: int) -> None:
        t = self.cache.get_or_upload(0, GEOMS[g], self.up)
        assert t.temporary and not self.cache.contains(0)
        self.held.append(t)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.held:
            self.cache.release(self.held.pop(data.draw(st.integers(0, len(self.held) - 1))))

    @rule(cur=st.integers(0, 7))
    def boundary(self, cur: int) -> None:
        self.cache.on_layer_boundary(cur)
        self.ref.boundary(cur)

    @invariant()
    def consistent(self) -> None:
        cache = self.cache
        assert [e.wkey for e in cache.entries()] == [k for k, _, _ in self.ref.lru]
        assert len(cache) <= cache.max_entries and len(cache.pool) <= max(cache.pool_slots, 0)
        assert cache.bytes_resident <= cache.budget or len(cache) == 1
        assert all(self.up.intact(e) for e in cache.entries())
        assert all(self.up.intact(t) for t in self.held)
        assert_accounted(cache, self.alloc)
        assert self.alloc.frees == cache.stats()["pool_frees"]  # the only frees before close

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.cache.close()
            assert self.alloc.live_count == 0
            assert sorted(self.alloc.freed) == list(range(1, self.alloc.allocs + 1))


TestResidencyMachine = ResidencyMachine.TestCase
TestResidencyMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_random_sequences_hold_invariants() -> None:
    """A plain seeded variant of the state machine, with many more steps per run."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        m = ResidencyMachine()
        m.setup(budget_units=int(rng.integers(1, 9)), keep=int(rng.choice([0, 1, 2, 4])),
                slots=int(rng.integers(1, 7)), pool_slots=int(rng.integers(0, 5)))
        for _ in itertools.repeat(None, 400):
            op = rng.integers(0, 10)
            i = int(rng.integers(0, len(KEYS)))
            if op < 6:
                m.get(i, int(rng.integers(0, len(GEOMS))), bool(rng.random() < 0.85))
            elif op == 6:
                m.get_failing(i)
            elif op == 7:
                m.temporary(int(rng.integers(0, len(GEOMS))))
            elif op == 8 and m.held:
                m.cache.release(m.held.pop(int(rng.integers(0, len(m.held)))))
            else:
                m.boundary(int(rng.integers(0, 8)))
            m.consistent()
        m.teardown()
