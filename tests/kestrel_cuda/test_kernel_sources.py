"""The CUDA backend's two NVRTC modules compiled for the H200 (sm_90, machine code) on any machine, no GPU
needed: NVRTC from the ``nvidia-cuda-nvrtc`` wheel (in the dev extra), every template instance and extern "C"
kernel the backend looks up. A compile error, a failed static_assert or a missing instance would make the
backend fail to bind on the GPU; here it fails CI. Skipped where the library cannot be loaded."""

from __future__ import annotations

import ctypes
import glob
import sys
from pathlib import Path

import pytest

from kestrel_cuda.kernels import FORWARD_SOURCES, OPTIONS, SOURCES, kernel_names, source_text
from kestrel_cuda.ops_cupy import KERNELS, forward_kernel_names

ARCH = "sm_90"
PLAIN = {"hook": ("k_transpose_pack4",), "forward": KERNELS}  # extern "C" kernels, looked up by name


def _nvrtc() -> ctypes.CDLL | None:
    for base in sys.path:
        for path in sorted(glob.glob(str(Path(base) / "nvidia" / "*" / "lib" / "libnvrtc.so.*"))):
            if "builtins" not in path and ".alt." not in path:
                try:
                    return ctypes.CDLL(path)
                except OSError:
                    continue
    return None


NVRTC = _nvrtc()
pytestmark = pytest.mark.skipif(NVRTC is None, reason="no NVRTC library (pip install nvidia-cuda-nvrtc)")


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise AssertionError(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}")


def compile_module(source: str, names: list[str]) -> tuple[bytes, dict[str, str]]:
    """(the cubin, name expression -> lowered name); raises AssertionError with the log on failure."""
    lib = NVRTC
    assert lib is not None
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kestrel.cu", 0, None, None), "create")
    try:
        for name in names:
            _check(lib, lib.nvrtcAddNameExpression(prog, name.encode()), f"name {name}")
        opts = [o.encode() for o in (*OPTIONS, f"--gpu-architecture={ARCH}")]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        assert rc == 0, text
        lowered = {}
        for name in names:
            out = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out)), f"lowered {name}")
            lowered[name] = out.value.decode()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin.raw, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("module", ["hook", "forward"])
def test_every_kernel_compiles_for_sm90(module: str) -> None:
    sources, names = (SOURCES, kernel_names()) if module == "hook" else (FORWARD_SOURCES, forward_kernel_names())
    cubin, lowered = compile_module(source_text(sources), names)
    assert set(lowered) == set(names)
    for symbol in [*lowered.values(), *PLAIN[module]]:  # each kernel's entry in the machine code
        assert symbol.encode() + b"\0" in cubin, symbol
