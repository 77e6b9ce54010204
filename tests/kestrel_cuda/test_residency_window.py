"""CPU tests of the CUDA backend's residency window (residency_check.py's setup): the window's walk over the layers
(lm_head kept, fused weights mapped to their layer), preload within the budget and its slots, the layers kept beside
the window, the layers streamed, and the next layer prefetched within the budget."""

from __future__ import annotations

import pytest

from kestrel_core.wkey import Proj, fused_wkey, lm_head_wkey, wkey
from kestrel_cuda.allocator import NumpyAllocator
from kestrel_cuda.layout import Geometry
from kestrel_cuda.residency import PreloadItem, WeightCache, kept_layers

from .residency_check import BIG, G_A, G_A_PACKED, G_A_TWIN, G_B, Stamper, assert_accounted

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
