"""The simulated NPU bound once per session on this machine's OpenCL device.

Where there is no pyopencl or no OpenCL device the device tests are skipped with that reason, except in CI
(which installs PoCL). Any other reason not to bind (a kernel that does not build or fails its self-check)
is a failure everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kestrel_core.registry import Backend, Registry

MISSING = ("pyopencl is not installed", "no OpenCL platform", "no OpenCL device")  # this machine lacks OpenCL


@pytest.fixture(scope="session")
def npu_backend(clean_session_env: None) -> Iterator[Backend]:
    """Bound without the user's KESTREL_* settings (the device, padding, probe cache), like every test."""
    registry = Registry()
    try:
        backend = registry.bind("npu_sim")
        if not backend.bound:
            if os.environ.get("CI") or not backend.reason.startswith(MISSING):
                pytest.fail(f"npu_sim did not bind: {backend.reason}")
            pytest.skip(f"npu_sim not bound here: {backend.reason}")
        yield backend
    finally:
        registry.close()


@pytest.fixture
def npu(npu_backend: Backend):  # noqa: ANN201 - the device handle
    """The device handle with fresh counters for each test (weights stay cached across tests)."""
    from kestrel_npu_sim.stats import NpuSimStats

    dev = npu_backend.device
    dev.stats = NpuSimStats()
    dev.pad_n = True
    return dev
