"""Binding: kind simulator (never auto), device selection, and not bound with a reason when it cannot be."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import kestrel_npu_sim.device as npu_device
from kestrel_core.registry import Registry


def _bind():  # noqa: ANN202
    registry = Registry()
    backend = registry.bind("npu_sim")
    return registry, backend


def test_kind_is_simulator_and_auto_never_picks_it(npu_backend) -> None:  # noqa: ANN001
    assert npu_backend.kind == "simulator" and npu_backend.name == "npu_sim"
    assert "simulated RK3588 NPU" in npu_backend.device_description
    registry = Registry()
    assert registry.select("auto").name != "npu_sim"
    registry.close()


@pytest.mark.parametrize("spec", ["7:3", "no-such-opencl-device"])
def test_bad_device_env_is_not_bound(npu_backend, monkeypatch: pytest.MonkeyPatch, spec: str) -> None:  # noqa: ANN001
    monkeypatch.setenv("KESTREL_NPU_SIM_DEVICE", spec)
    registry, backend = _bind()
    assert not backend.bound
    assert backend.reason.startswith(f"KESTREL_NPU_SIM_DEVICE={spec!r} names no OpenCL device (available: 0:0 ")
    registry.close()


def test_device_picked_by_index_and_by_name(npu_backend, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    name = npu_backend.device.queue.device.name.strip()
    for spec in ("0:0", name[:6].upper()):
        monkeypatch.setenv("KESTREL_NPU_SIM_DEVICE", spec)
        registry, backend = _bind()
        assert backend.bound, backend.reason
        assert name in backend.device_description
        registry.close()


def test_missing_pyopencl_is_not_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyopencl", None)  # import pyopencl now raises ImportError
    registry, backend = _bind()
    assert not backend.bound and backend.reason.startswith("pyopencl is not installed")
    assert registry.select("auto").name == "cpu"
    registry.close()


def test_kernel_build_failure_is_not_bound(npu_backend, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                           tmp_path: Path) -> None:
    broken = tmp_path / "block_matmul.cl"
    broken.write_text(npu_device.KERNEL_FILE.read_text().replace("hsum8(acc[r])", "hsum8(acc[r], undeclared)"))
    monkeypatch.setattr(npu_device, "KERNEL_FILE", broken)
    registry, backend = _bind()
    assert not backend.bound and backend.reason.startswith("OpenCL kernel build failed on ")
    registry.close()


def test_wrong_kernel_fails_the_self_check(npu_backend, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                           tmp_path: Path) -> None:
    wrong = tmp_path / "block_matmul.cl"
    wrong.write_text(npu_device.KERNEL_FILE.read_text().replace("= hsum8(acc[r]);", "= hsum8(acc[r]) + 1;"))
    monkeypatch.setattr(npu_device, "KERNEL_FILE", wrong)
    registry, backend = _bind()
    assert not backend.bound and "kernel self-check failed" in backend.reason
    registry.close()
