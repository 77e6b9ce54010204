"""HostPins against a stand-in for CuPy's runtime: which arrays are registered, with which flags, what a
failure leaves, and that everything registered is released."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kestrel_cuda.host_pin import HOST_REGISTER_DEFAULT, HOST_REGISTER_READ_ONLY, HostPins


class FakeRuntime:
    def __init__(self, refuse: set[int]) -> None:
        self.refuse = refuse
        self.live: dict[int, tuple[int, int]] = {}  # ptr -> (nbytes, flags)
        self.calls = 0

    def hostRegister(self, ptr: int, nbytes: int, flags: int) -> None:  # noqa: N802 (CuPy's name)
        self.calls += 1
        if ptr in self.refuse or ptr in self.live:
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        self.live[ptr] = (nbytes, flags)

    def hostUnregister(self, ptr: int) -> None:  # noqa: N802
        del self.live[ptr]


def test_registers_each_array_once_read_only_where_it_must_and_releases_all() -> None:
    writable = np.zeros(4096, np.int8)
    mapped = np.ones(1024, np.float32)
    mapped.flags.writeable = False  # as a .kst artifact's mapped arrays
    refused = np.zeros(64, np.float32)
    runtime = FakeRuntime({int(refused.ctypes.data)})
    pins = HostPins(SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)))
    pins.register([writable, mapped, refused, writable, np.zeros(0, np.int8), writable[::2]])
    assert runtime.live == {int(writable.ctypes.data): (4096, HOST_REGISTER_DEFAULT),
                            int(mapped.ctypes.data): (4096, HOST_REGISTER_READ_ONLY)}
    assert runtime.calls == 3  # the repeat, the empty and the strided one are not offered
    assert pins.stats()["host_pinned_bytes"] == 8192 and pins.stats()["host_pin_failures"] == 1
    assert "AlreadyRegistered" in pins.stats()["host_pin_last_failure"]
    pins.release()
    assert runtime.live == {} and pins.stats()["host_pinned_bytes"] == 0
