"""The CUDA backend's two NVRTC modules compiled for the H200 (sm_90, machine code) on any machine, no GPU
needed: NVRTC from the ``nvidia-cuda-nvrtc`` wheel (in the dev extra), every template instance and extern "C"
kernel the backend looks up. A compile error, a failed static_assert or a missing instance would make the
backend fail to bind on the GPU; here it fails CI. Skipped where the library cannot be loaded. Also, with no
compiler: each module is its headers then its kernel files, and the constants the launches share with the
sources are the sources'."""

from __future__ import annotations

import ctypes
import glob
import re
import sys
from pathlib import Path

import pytest

from kestrel_cuda import kernels, plan
from kestrel_cuda.kernels import FORWARD_SOURCES, OPTIONS, SOURCES, kernel_names, source_text
from kestrel_cuda.ops_cupy import KERNELS, forward_kernel_names
from kestrel_cuda.trace import options as trace_options

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
needs_nvrtc = pytest.mark.skipif(NVRTC is None, reason="no NVRTC library (pip install nvidia-cuda-nvrtc)")


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise AssertionError(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}")


def compile_module(source: str, names: list[str], extra: tuple[str, ...] = ()) -> tuple[bytes, dict[str, str]]:
    """(the cubin, name expression -> lowered name), compiled with OPTIONS and ``extra``; raises AssertionError
    with the log on failure."""
    lib = NVRTC
    assert lib is not None
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kestrel.cu", 0, None, None), "create")
    try:
        for name in names:
            _check(lib, lib.nvrtcAddNameExpression(prog, name.encode()), f"name {name}")
        opts = [o.encode() for o in (*OPTIONS, *extra, f"--gpu-architecture={ARCH}")]
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


@needs_nvrtc
@pytest.mark.parametrize("module", ["hook", "forward", "forward traced"])
def test_every_kernel_compiles_for_sm90(module: str) -> None:
    """The traced forward is its diagnostic build (KESTREL_CUDA_TRACE): its records' globals are in it too."""
    sources, names = (SOURCES, kernel_names()) if module == "hook" else (FORWARD_SOURCES, forward_kernel_names())
    traced = module == "forward traced"
    cubin, lowered = compile_module(source_text(sources), names, trace_options() if traced else ())
    assert set(lowered) == set(names)
    globals_ = ("kestrel_trace_buf", "kestrel_trace_count") if traced else ()
    for symbol in [*lowered.values(), *PLAIN[module.split()[0]], *globals_]:  # each entry in the machine code
        assert symbol.encode() + b"\0" in cubin, symbol
    assert (b"kestrel_trace_buf\0" in cubin) == traced


@pytest.mark.parametrize("sources", (kernels.SOURCES, kernels.FORWARD_SOURCES))
def test_each_module_is_its_headers_then_its_kernel_files(sources: tuple[str, ...]) -> None:
    headers = [name for name in sources if name.endswith(".cuh")]
    assert list(sources[:len(headers)]) == headers and all((kernels.HERE / name).is_file() for name in sources)


def test_forward_sources_define_each_kernel_the_ops_load_once() -> None:
    from kestrel_cuda import ops_cupy

    text = kernels.source_text(kernels.FORWARD_SOURCES)
    for name in ("qgemv", "attn_decode", "quantize_rows", *ops_cupy.KERNELS):
        assert len(re.findall(rf"__global__ void (?:__launch_bounds__\([^)]*\) )?{name}\(", text)) == 1, name


def test_the_routers_constants_are_the_kernels() -> None:
    """plan.ROUTE_ROWS and ROUTE_MAX_EXPERTS (the launch's grid, the experts the device forward takes) are
    moe.cu's and route.cuh's: router rows a block, one logit per thread of NT; EXPERT_TABLE_ROWS is NT (a routed
    GEMV copies a table row a thread); ROUTE_FOLD_ROWS and ROUTE_FOLD_MAX_SPAN (a RouteFold's groups and span)
    are route.cuh's rows a fold block and its 16 threads a row of ROUTE_FOLD_F4 float4s."""
    text = kernels.source_text(kernels.FORWARD_SOURCES)
    define = {name: value for name, value in re.findall(r"#define (\w+) (\w+)", text)}
    assert int(define["ROUTE_ROWS"]) == plan.ROUTE_ROWS and int(define["NT"]) == plan.EXPERT_TABLE_ROWS
    assert define["ROUTE_MAX_EXPERTS"] == "NT" and int(define["NT"]) == plan.ROUTE_MAX_EXPERTS
    rows = int(define["ROUTE_FOLD_ROWS"])
    assert rows == plan.ROUTE_FOLD_ROWS and int(define["NT"]) // rows * 4 * int(define["ROUTE_FOLD_F4"]) == (
        plan.ROUTE_FOLD_MAX_SPAN)


def test_the_gemv_folds_are_gemv_cus() -> None:
    """plan.FOLD_ROUTER and FOLD_ATTENTION, the qgemv instances the ops pick, are gemv.cu's FOLD values; the
    attention folds only into clusters, whose blocks are MAX_CLUSTER at most, as attend.cuh's records."""
    text = kernels.source_text(kernels.FORWARD_SOURCES)
    define = {name: value for name, value in re.findall(r"#define (\w+) (\w+)", text)}
    assert (int(define["FOLD_ROUTER"]), int(define["FOLD_ATTENTION"])) == (plan.FOLD_ROUTER, plan.FOLD_ATTENTION)
    assert int(define["MAX_CLUSTER"]) == plan.MAX_CLUSTER


def test_the_attn_rows_constants_are_attention_cus() -> None:
    """plan.ATTN_ROWS_HEADS (the launch's parts of a group), ATTN_ROWS_WARPS (its block), ATTN_ROWS_MAX_SPLITS
    (the planner's cap), ATTN_ROWS_BUFFERS (its shared memory) and KV_BLOCK (a staged page) are attention.cu's."""
    text = kernels.source_text(kernels.FORWARD_SOURCES)
    define = {name: value for name, value in re.findall(r"#define (\w+) (\w+)", text)}
    assert int(define["ROWS_BUFFERS"]) == plan.ATTN_ROWS_BUFFERS
    assert int(define["ROWS_HEADS"]) == plan.ATTN_ROWS_HEADS
    assert int(define["ROWS_WARPS"]) == plan.ATTN_ROWS_WARPS
    assert int(define["ROWS_MAX_SPLITS"]) == plan.ATTN_ROWS_MAX_SPLITS
    assert int(define["PT"]) == plan.KV_BLOCK


def test_the_quantize_rows_chunk_is_rows_cus() -> None:
    """ops_cupy.QUANT_CHUNK (the launch's blocks a row) is rows.cu's NT * QUANT_LOADS."""
    from kestrel_cuda.ops_cupy import QUANT_CHUNK

    text = kernels.source_text(kernels.FORWARD_SOURCES)
    define = {name: value for name, value in re.findall(r"#define (\w+) (\w+)", text)}
    assert int(define["NT"]) * int(define["QUANT_LOADS"]) == QUANT_CHUNK


def test_the_cluster_merge_loads_only_what_it_stores() -> None:
    """gemm_tile.cuh's tile_cluster_store skips the float4s it will not store (rows past M, columns past N)
    before it loads them from the cluster's blocks: a distributed shared-memory load whose value no store waits
    for may still be in flight at the relaxed arrive, and the block it reads may have exited by then."""
    text = (kernels.HERE / "gemm_tile.cuh").read_text(encoding="utf-8")
    body = text[text.index("void tile_cluster_store("):]
    body = body[:body.index("\n}\n")]
    first_load = body.index("ld_cluster_f4(")
    skip = re.search(r"if \(row >= M \|\| \(!FOLD && col >= N\)\) continue;", body)
    inside = re.search(r"const bool in = col < N;", body)
    guard = re.search(r"if \(in\) \{", body)
    assert skip and inside and guard and skip.start() < inside.start() < guard.start() < first_load
    assert body.index("cluster_arrive_relaxed()") > body.rindex("ld_cluster_f4(")
