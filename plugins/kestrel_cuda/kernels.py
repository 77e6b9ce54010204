"""The CUDA sources of the backend's two NVRTC modules, and the hook kernels' module compiled and looked up.

Each module is its sources joined in order (NVRTC reads no files): headers (``.cuh``: device functions
shared by several kernel files) first, then kernel files, which need nothing of each other. The hook
kernels (``SOURCES``) are compiled when the device opens; the whole-step forward's (``FORWARD_SOURCES``,
one op a file) by ``ops_cupy`` on first use.

All or nothing: ``compile_kernels`` either returns a ``Kernels`` with every function resolved (so a compile
error surfaces at bind time, not at the first GEMM) or raises ``KernelCompileError``. Options (both modules):
``--fmad=false`` (no multiply-add contraction: each float operation rounds as written, like the CPU
reference) and ``-std=c++17``; CuPy adds ``-arch=sm_XX`` for the current device itself (NVRTC then emits
machine code for it, not PTX), so the architecture is the device's, capped at what NVRTC supports.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SOURCES = ("common.cuh", "gemm_tile.cuh", "transpose.cu", "quantize.cu", "gemv_warp.cu", "gemm_mma.cu", "gemm_tma.cu",
           "gemm_f32.cu")
FORWARD_SOURCES = ("common.cuh", "forward.cuh", "merge.cuh", "rope.cuh", "attend.cuh", "route.cuh",
                   "gemv.cu", "rope.cu", "attention.cu", "attention_prefill.cu", "rows.cu", "lm_finish.cu",
                   "moe.cu")
OPTIONS = ("--fmad=false", "-std=c++17")

# GEMV variants (gemv_warp.cu): (MT rows per launch, VEC columns per lane, BITS). MT = 1 only: from two rows
# the split tensor-core GEMM is faster (all GEMMs of a qwen3-8b step at 8 rows: 3.43 ms against 7.97 for the
# GEMV at MT = 4, docs/performance.md).
GEMV_WARP_VARIANTS: tuple[tuple[int, int, int], ...] = tuple((1, vec, bits) for bits in (8, 4) for vec in (8, 4))
GROUP_SIZES = (32, 256)
TRANSPOSE_I8, TRANSPOSE_F32 = "k_transpose<signed char>", "k_transpose<float>"
BITS = (8, 4)


@dataclass(frozen=True)
class MmaTile:
    """One block shape of the tensor-core kernel (gemm_mma.cu): WM x WN warps, MI m16 tiles per warp."""

    wm: int
    wn: int
    mi: int
    min_blocks: int  # __launch_bounds__ minimum resident blocks per SM (caps the registers)
    split: bool = False  # K splits, whole stages and column tiles only (decode batches, gemm_mma.cu SPLIT)

    @property
    def key(self) -> str:
        """Its name in MMA_TILES."""
        return f"{self.bm}x{self.bn}" + ("s" if self.split else "")

    @property
    def bm(self) -> int:
        return self.wm * self.mi * 16

    @property
    def bn(self) -> int:
        return self.wn * 32

    @property
    def threads(self) -> int:
        return self.wm * self.wn * 32

    def smem_bytes(self, bits: int, group_size: int) -> int:
        """Dynamic shared memory of one block; the same sum as GqTile::SMEM in gemm_mma.cu."""
        slots = MMA_BK // group_size if group_size < MMA_BK else 1
        stage = self.bm * MMA_BK + MMA_BK * bits // 8 * self.bn + 4 * slots * (self.bm + self.bn)
        return MMA_STAGES * stage

    def name(self, bits: int, group_size: int) -> str:
        split = "true" if self.split else "false"
        return f"k_gemm_q8_tc<{bits}, {group_size}, {self.wm}, {self.wn}, {self.mi}, {self.min_blocks}, {split}>"


MMA_BK, MMA_STAGES = 128, 3  # K bytes per shared-memory stage, stages in flight (GQ_BK, GQ_STAGES in gemm_mma.cu)
# Block shapes (measured on the H200, docs/performance.md): 128x128 with 8 warps of 64x32 (1 block/SM, ~210
# registers) for large grids, 64x128 with 8 warps of 32x32 (<= 128 registers, 2 blocks/SM) for short ones and a
# prefill's grouped expert GEMM, 16x128 with 4 warps of 16x32 for a decode batch's grouped expert GEMM; split
# over K for decode batches: 16x128s with 4 warps of 16x32 for 2-16 rows, 32x128s with 4 warps of 32x32 for
# 17-64 (three blocks/SM each; on sm_90 at int8 G = 32 the tensor-copy block TMA_TILE takes 17-64).
MMA_TILES: dict[str, MmaTile] = {
    "128x128": MmaTile(2, 4, 4, 1),
    "64x128": MmaTile(2, 4, 2, 2),
    "16x128": MmaTile(1, 4, 1, 3),
    "16x128s": MmaTile(1, 4, 1, 3, split=True),
    "32x128s": MmaTile(1, 4, 2, 3, split=True),
}


@dataclass(frozen=True)
class TmaTile:
    """The tensor-copy split block (gemm_tma.cu, sm_90, int8 G = 32): 4 consumer warps of 32x32 and a producer."""

    bm: int = 32
    bn: int = 128
    threads: int = 160
    stages: int = 3  # TMA_STAGES
    split: bool = True

    def smem_bytes(self, bits: int, group_size: int) -> int:
        """TmaTile::SMEM in gemm_tma.cu: 1 KiB of alignment slack, the stages, their mbarriers, the rows' factors."""
        stage = -(-(MMA_BK * self.bn + self.bm * MMA_BK + 4 * self.bn * 4 + 4 * self.bm * 8) // 1024) * 1024
        return 1024 + self.stages * stage + 16 * self.stages + 4 * self.bm

    def name(self, bits: int, group_size: int) -> str:
        return tma_kernel_name(0)


def tma_kernel_name(norm: int) -> str:
    """The tensor-copy block's instance for the norm fold's role ``norm`` (gemm_tma.cu NORM: TMA_NORMS)."""
    return f"k_gemm_q8_tma<{norm}>"


TMA_NORMS = (0, 1, 2)  # none, reading the fold's rows, folding the store
TMA_TILE = "32x128t"  # the split block of 17-64 rows at int8 G = 32 where tensor copies and clusters are there
TMA_TILES: dict[str, TmaTile] = {TMA_TILE: TmaTile()}
BLOCK_SHAPES: dict[str, MmaTile | TmaTile] = {**MMA_TILES, **TMA_TILES}  # every block shape by name
MMA_TILE_DEFAULT = "128x128"  # large grids
MMA_TILE_SMALL_GRID = "64x128"  # grids whose last wave of MMA_TILE_DEFAULT blocks would be under half full
MMA_TILE_SPLIT_SMALL, MMA_TILE_SPLIT = "16x128s", "32x128s"  # decode batches


class KernelCompileError(RuntimeError):
    """NVRTC rejected the sources or a kernel could not be loaded."""


def gemv_warp_name(mt: int, vec: int, bits: int) -> str:
    return f"k_gemv_warp<{mt}, {vec}, {bits}>"


def source_text(names: Sequence[str] = SOURCES) -> str:
    """One module's source: the files ``names`` beside this module, joined in order."""
    return "\n".join((HERE / name).read_text(encoding="utf-8") for name in names)


@dataclass
class Kernels:
    """Every compiled kernel of the backend, by role."""

    module: Any
    transpose_i8: Any
    transpose_f32: Any
    transpose_pack4: Any
    quantize: dict[int, Any]  # G -> kernel
    gemv_warp: dict[tuple[int, int, int], Any]
    mma: dict[tuple[int, int, str], Any]  # (bits, G, tile name) -> kernel
    tma: dict[int, Any]  # the tensor-copy block by its norm-fold role (TMA_NORMS); mma's is role 0
    f32: dict[int, Any]  # bits -> kernel
    compile_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


def kernel_names() -> list[str]:
    """The name expressions of every template kernel of the hook module (``SOURCES``)."""
    return ([TRANSPOSE_I8, TRANSPOSE_F32] + [f"k_quantize_act<{g}>" for g in GROUP_SIZES]
            + [gemv_warp_name(*v) for v in GEMV_WARP_VARIANTS]
            + [t.name(b, g) for b in BITS for g in GROUP_SIZES for t in MMA_TILES.values()]
            + [tma_kernel_name(norm) for norm in TMA_NORMS]
            + [f"k_gemm_f32<{b}>" for b in BITS])


def compile_kernels(cp: Any) -> Kernels:
    """Compile and resolve every kernel on the current device; raises KernelCompileError."""
    names = kernel_names()
    start = time.perf_counter()
    try:
        module = cp.RawModule(code=source_text(), options=OPTIONS, name_expressions=names)
        get = module.get_function
        tma = {norm: get(tma_kernel_name(norm)) for norm in TMA_NORMS}
        kernels = Kernels(
            module=module,
            transpose_i8=get(TRANSPOSE_I8),
            transpose_f32=get(TRANSPOSE_F32),
            transpose_pack4=get("k_transpose_pack4"),
            quantize={g: get(f"k_quantize_act<{g}>") for g in GROUP_SIZES},
            gemv_warp={v: get(gemv_warp_name(*v)) for v in GEMV_WARP_VARIANTS},
            mma={(b, g, tn): get(t.name(b, g)) for b in BITS for g in GROUP_SIZES for tn, t in MMA_TILES.items()}
            | {(8, 32, TMA_TILE): tma[0]},
            tma=tma,
            f32={b: get(f"k_gemm_f32<{b}>") for b in BITS},
        )
        for (b, g, tn), kern in kernels.mma.items():  # above 48 KiB a block must ask for its shared memory
            kern.max_dynamic_shared_size_bytes = BLOCK_SHAPES[tn].smem_bytes(b, g)
        for kern in kernels.tma.values():
            kern.max_dynamic_shared_size_bytes = TMA_TILES[TMA_TILE].smem_bytes(8, 32)
    except Exception as exc:  # CompileException, a missing symbol, a driver that cannot load the cubin
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KernelCompileError(f"{type(exc).__name__}: {first}") from exc
    kernels.compile_s = time.perf_counter() - start
    try:
        attrs = kernels.mma[(8, 32, MMA_TILE_DEFAULT)].attributes
        kernels.info = {"binary_version": attrs.get("binary_version"), "ptx_version": attrs.get("ptx_version"),
                        "mma_registers": attrs.get("num_regs")}
    except Exception:  # attributes are informative only
        kernels.info = {}
    return kernels
