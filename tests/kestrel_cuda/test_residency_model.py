"""Random sequences of the CUDA backend's weight cache operations against a small reference model of the LRU and
window rules kept in this file (a hypothesis state machine, and a plain seeded variant with many more steps),
every buffer's content and accounting checked after each step (residency_check.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kestrel_core.wkey import Proj, fused_wkey, lm_head_wkey, wkey
from kestrel_cuda.allocator import NumpyAllocator
from kestrel_cuda.layout import Geometry
from kestrel_cuda.residency import WeightCache

from .residency_check import BIG, G_A, G_A_PACKED, G_A_TWIN, G_B, Stamper, assert_accounted, failing_upload


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
