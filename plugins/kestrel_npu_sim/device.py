"""Opening the simulated NPU: pick an OpenCL device, build the kernels, check them once.

Every failure here is a ``BackendUnavailable`` with the reason, so the registry leaves npu_sim not bound
and kestrel carries on: pyopencl missing, no OpenCL platform or device, a ``KESTREL_NPU_SIM_DEVICE`` that
names no device, a kernel that does not build or computes wrong on this device.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kestrel_core.contract import StripCache
from kestrel_core.env import env_flag, env_str
from kestrel_core.errors import BackendUnavailable

from .cost import CostModel
from .layout import Geometry, fuse, geometry, repack
from .stats import NpuSimStats

ENV_DEVICE = "KESTREL_NPU_SIM_DEVICE"  # "P:D" (platform:device indices) or a device/platform name substring
ENV_PAD_N = "KESTREL_NPU_SIM_PAD_N"  # 0 (off): decline N not a multiple of 32 instead of padding it
KERNEL_FILE = Path(__file__).with_name("block_matmul.cl")


@dataclass
class PackedWeight:
    """One weight (or several fused along N) in the NPU's native layout on the device."""

    members: tuple[StripCache, ...]  # identity check: a wkey reused for other tensors is repacked
    offsets: tuple[int, ...]  # first row of each member in the fused weight
    geo: Geometry
    buffer: Any  # cl.Buffer, int8 [n_pad * K]
    scales_t: np.ndarray  # float32 [K/G, N], zero on the rows padding the members apart

    def holds(self, weights: Sequence[StripCache]) -> bool:
        return len(weights) == len(self.members) and all(a is b for a, b in zip(weights, self.members))


@dataclass
class NpuSimDevice:
    cl: Any  # the pyopencl module
    context: Any
    queue: Any
    kernels: dict[int, Any]  # rows per work-group -> kernel
    description: str
    max_alloc: int
    pad_n: bool = True
    cost: CostModel = field(default_factory=CostModel)
    stats: NpuSimStats = field(default_factory=NpuSimStats)
    cache: dict[int, PackedWeight] = field(default_factory=dict)
    _scratch: dict[str, Any] = field(default_factory=dict)

    def scratch(self, name: str, nbytes: int) -> Any:
        """A reusable device buffer of at least ``nbytes`` (grown, never shrunk)."""
        buf = self._scratch.get(name)
        if buf is None or buf.size < nbytes:
            buf = self.cl.Buffer(self.context, self.cl.mem_flags.READ_WRITE, size=max(nbytes, 64))
            self._scratch[name] = buf
        return buf

    def packed(self, weights: Sequence[StripCache], wkey: int) -> PackedWeight:
        """The native-layout copy of ``weights`` (one, or several sharing K fused along N): repacked once per
        wkey, every call for wkey 0."""
        entry = self.cache.get(wkey) if wkey else None
        if entry is not None and entry.holds(weights):
            return entry
        codes, scales, offsets = fuse(weights)
        geo = geometry(codes.shape[0], codes.shape[1])
        host = repack(codes, geo)
        mf = self.cl.mem_flags
        buffer = self.cl.Buffer(self.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=host)
        entry = PackedWeight(tuple(weights), offsets, geo, buffer, np.ascontiguousarray(scales.T))
        self.stats.repacks += 1
        self.stats.repack_bytes += host.nbytes
        if wkey:
            self.cache[wkey] = entry
        else:
            self.stats.uncached_repacks += 1
        return entry

    @property
    def cached_bytes(self) -> int:
        return sum(e.geo.nbytes for e in self.cache.values())

    def close(self) -> None:
        self.queue.finish()
        for entry in self.cache.values():
            entry.buffer.release()
        for buf in self._scratch.values():
            buf.release()
        self.cache.clear()
        self._scratch.clear()


def _import_pyopencl() -> Any:
    try:
        import pyopencl
    except ImportError as exc:
        raise BackendUnavailable(f"pyopencl is not installed ({exc}); pip install 'kestrel[npu-sim]'") from None
    return pyopencl


def _devices(cl: Any) -> list[tuple[str, Any, Any]]:
    """Every (``P:D``, platform, device) this machine's OpenCL ICD loader offers."""
    try:
        platforms = cl.get_platforms()
    except Exception as exc:  # no ICD at all raises PLATFORM_NOT_FOUND_KHR
        raise BackendUnavailable(f"no OpenCL platform ({_first_line(exc)}); install an OpenCL driver such "
                                 "as Debian's pocl-opencl-icd") from None
    found = []
    for pi, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except Exception:  # a platform without devices raises DEVICE_NOT_FOUND
            continue
        found.extend((f"{pi}:{di}", platform, device) for di, device in enumerate(devices))
    if not found:
        raise BackendUnavailable("no OpenCL device on any platform")
    return found


def select_device(cl: Any, spec: str | None) -> tuple[Any, Any]:
    """(platform, device) named by ``spec`` ("P:D" or a name substring), or the first device if unset."""
    found = _devices(cl)
    if not spec:
        return found[0][1], found[0][2]
    spec = spec.strip()
    if re.fullmatch(r"\d+:\d+", spec):
        matches = [f for f in found if f[0] == spec]
    else:
        matches = [f for f in found if spec.lower() in f"{f[1].name} {f[2].name}".lower()]
    if not matches:
        have = ", ".join(f"{i} {d.name.strip()!r}" for i, _, d in found)
        raise BackendUnavailable(f"{ENV_DEVICE}={spec!r} names no OpenCL device (available: {have})")
    return matches[0][1], matches[0][2]


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def _build_error(log: str) -> str:
    errors = [ln.strip() for ln in log.splitlines() if "error" in ln.lower()]
    return errors[0] if errors else _first_line(Exception(log))


def build_kernels(cl: Any, context: Any, device: Any, source: str) -> dict[int, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pyopencl warns on any compiler output, even notes
            program = cl.Program(context, source).build(options=["-cl-std=CL1.2"], devices=[device])
    except Exception as exc:
        log = getattr(exc, "build_log", None) or str(exc)
        raise BackendUnavailable(f"OpenCL kernel build failed on {device.name.strip()}: {_build_error(log)}") \
            from None
    return {rows: cl.Kernel(program, f"block_matmul_m{rows}") for rows in (1, 8)}


def open_device(options: dict[str, Any]) -> NpuSimDevice:
    pad_n = env_flag(ENV_PAD_N, default=True)
    cl = _import_pyopencl()
    platform, device = select_device(cl, env_str(ENV_DEVICE))
    try:
        context = cl.Context([device])
        queue = cl.CommandQueue(context, device)
    except Exception as exc:
        raise BackendUnavailable(f"cannot open OpenCL device {device.name.strip()}: {_first_line(exc)}") from None
    kernels = build_kernels(cl, context, device, KERNEL_FILE.read_text())
    for kernel in kernels.values():
        kernel.set_scalar_arg_dtypes([None, np.int32, np.int64, None, np.int64, np.int32, np.int32, np.int32,
                                      None, np.int64, np.int32, np.int32])
    description = f"simulated RK3588 NPU on OpenCL {device.name.strip()} ({platform.name.strip()})"
    return NpuSimDevice(cl, context, queue, kernels, description, int(device.max_mem_alloc_size), pad_n)
