"""CPU tests of the CUDA backend's residency logic, on a real allocator of numpy buffers (residency_check.py):
the cache budget, weight geometries, the LRU and its slots, the pool of evicted buffers, wkey 0's temporaries,
upload failures, out-of-memory recovery, stale entries, pinning, and clear and close.

The expected values come from the residency rules (kestrel_cuda.residency's docstring), written out here; the
cache's buffers are checked by content (each upload stamps its buffer) and by identity against the allocator's own
record of live and freed buffers. The residency window and preload, and random sequences against a reference
model, have test_residency modules of their own.
"""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_core.contract import quantize_weight
from kestrel_core.wkey import Proj, wkey
from kestrel_cuda.allocator import AllocatorError, DeviceOutOfMemory, NumpyAllocator
from kestrel_cuda.layout import Geometry, fusable, pad_n
from kestrel_cuda.residency import ResidencyError, WeightCache, cache_budget

from .residency_check import (
    BIG,
    G_A,
    G_A_PACKED,
    G_A_TWIN,
    G_B,
    GiB,
    MiB,
    Stamper,
    assert_accounted,
    failing_upload,
    ids,
)

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


# -- clear, close ------------------------------------------------------------------------------------


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
