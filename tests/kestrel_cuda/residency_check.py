"""How the residency tests check the CUDA backend's weight cache on a real allocator of numpy buffers: geometries of
known sizes, an upload that stamps its whole buffer (so aliasing shows in the content) and one that fails, and the
accounting of every live buffer against the allocator's own record of live and freed buffers."""

from __future__ import annotations

from kestrel_cuda.allocator import NumpyAllocator
from kestrel_cuda.layout import Geometry
from kestrel_cuda.residency import WeightCache

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
