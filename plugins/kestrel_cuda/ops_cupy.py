"""The whole-step forward's kernels on the GPU: ``CupyOps``, the interface of ``ops_numpy.NumpyOps`` launched on
one CUDA stream (the kernels: ``kernels.FORWARD_SOURCES``, compiled once per process on first use).

CuPy kernels get the data pointer and the row stride of each 2-D row view. ``on_launch(name, launch)``, if
given, is called instead of each launch with the kernel's name and the launch itself, which it must call
once (benchmarks/cuda_e2e.py times every kernel of a prefill that way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from kestrel_cuda.forward_launch import ExLauncher
from kestrel_cuda.forward_launch import i32_arg as _i32
from kestrel_cuda.forward_launch import ld_arg as _ld
from kestrel_cuda.forward_launch import ptr_arg as _ptr
from kestrel_cuda.kernels import FORWARD_SOURCES, OPTIONS, source_text
from kestrel_cuda.layout import Geometry
from kestrel_cuda.ops_attention import AttentionOps, _attn_prefill_smem, _attn_rows_smem
from kestrel_cuda.ops_moe import MoeOps
from kestrel_cuda.plan import (
    ATTN_CODES_GROUP,
    ATTN_ROWS_HEAD_DIMS,
    ATTN_ROWS_HEADS,
    ATTN_SPLITS,
    EPI_ADD,
    EXPERT_TABLE_ROWS,
    FINISH_COLS,
    FOLD_ATTENTION,
    FOLD_EXPERTS,
    FOLD_ROUTER,
    MAX_HEAD_DIM,
    MERGE_MODES,
    MERGE_SPLITS,
    NO_SWIGLU,
    PRO_PLAIN,
    PRO_POSTNORM,
    PRO_RMSNORM,
    PRO_SWIGLU_OAI,
    SMALL_M,
    TILE_N,
    AttendFold,
    Lin,
    PostNorm,
    QkvRope,
    RouteFold,
    check_add_scale,
    check_route_fold,
    tagged_merge,
)
from kestrel_cuda.trace import StepTrace
from kestrel_cuda.trace import options as trace_options

ATTN_DECODE_LANE_DIMS = (4, 8)  # attn_decode instances: a lane's dimensions (head_dim <= 128, <= 256)
QUANT_CHUNK = 256 * 4  # elements of a row that one quantize_rows block takes (rows.cu: NT * QUANT_LOADS)
# (bits, G, MR, FOLD): qgemv with MR rows per block: M = 1 (MR = 1) and, without a tiled GEMM, M > 1 (MR = 8);
# FOLD_ROUTER: a decode step's o projection with its router's blocks beside it (plan.RouteFold, G = 32);
# FOLD_ATTENTION: its q|k|v projection with decode attention in its clusters (plan.AttendFold); FOLD_EXPERTS: a
# routed GEMV with its experts' biases or prologue PRO_SWIGLU_OAI (gpt-oss's)
GEMV_VARIANTS = ([(bits, g, mr, 0) for bits in (8, 4) for g in (32, 256) for mr in (1, SMALL_M)]
                 + [(bits, 32, 1, FOLD_ROUTER) for bits in (8, 4)]
                 + [(bits, g, 1, fold) for fold in (FOLD_ATTENTION, FOLD_EXPERTS) for bits in (8, 4)
                    for g in (32, 256)])
QUANT_VARIANTS = [(g, oai) for g in (32, 256) for oai in (False, True)]  # quantize_rows<G, OAI>: OAI has PRO 5
# extern "C" kernels: no name expression
KERNELS = ("embed_rows", "qkv_rope", "attn_prefill", "add_rows", "norm_add_rows", "finish_logits", "lm_finish",
           "argmax_rows", "moe_route", "moe_combine", "moe_group", "moe_bias")
Observer = Callable[[str, Callable[[], None]], None]


def forward_kernel_names() -> list[str]:
    """The name expressions of every template kernel of the forward module (``FORWARD_SOURCES``)."""
    return ([f"qgemv<{b},{g},{mr},{fold}>" for b, g, mr, fold in GEMV_VARIANTS]
            + [f"attn_decode<{ATTN_SPLITS}, {j}>" for j in ATTN_DECODE_LANE_DIMS]
            + [f"quantize_rows<{g}, {str(oai).lower()}>" for g, oai in QUANT_VARIANTS]
            + [f"attn_rows<{hd}>" for hd in ATTN_ROWS_HEAD_DIMS])


@lru_cache(maxsize=2)
def _module(trace: bool = False) -> Any:
    import cupy as cp

    names = forward_kernel_names()
    options = OPTIONS + (trace_options() if trace else ())
    mod = cp.RawModule(code=source_text(FORWARD_SOURCES), options=options, name_expressions=tuple(names))
    mod.compile()
    return mod


@lru_cache(maxsize=1)
def _trace_records() -> StepTrace:
    """The diagnostic build's records (trace.py), shared by every traced CupyOps as the module is."""
    import cupy as cp

    return StepTrace(_module(True), cp)


class CupyOps(MoeOps, AttentionOps):
    """The forward's kernels on one stream. ``gemm``: optional tiled GEMM for M > 1 (see ``gemv``).

    ``pdl``: captured launches after the first may overlap their predecessor (programmatic dependent launch);
    ``cluster``: split M=1 GEMVs planned as clusters run as clusters (both need sm_90 and cuLaunchKernelEx,
    else they are off); ``merge``: how the other split M=1 GEMVs add their splits (``plan.tagged_merge``);
    ``on_launch``: see the module docstring; ``trace``: the kernels' diagnostic build, its records (those of
    every traced launch of the process) in ``self.trace`` (trace.py; else None).
    """

    name = "cuda"

    def __init__(self, stream: Any = None, gemm: Any = None, *, pdl: bool = True, cluster: bool = True,
                 merge: str = "auto", on_launch: Observer | None = None, trace: bool = False) -> None:
        import cupy as cp
        import cupyx

        if merge not in MERGE_MODES:
            raise ValueError(f"merge must be one of {MERGE_MODES}, got {merge!r}")
        self.cp = cp
        self.cupyx = cupyx
        self.xp = cp
        self.stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
        mod = _module(trace)
        self.trace = _trace_records() if trace else None
        self._gemv = {v: mod.get_function("qgemv<{},{},{},{}>".format(*v)) for v in GEMV_VARIANTS}
        self._attn_decode = {j: mod.get_function(f"attn_decode<{ATTN_SPLITS}, {j}>") for j in ATTN_DECODE_LANE_DIMS}
        self._attn_rows = {hd: mod.get_function(f"attn_rows<{hd}>") for hd in ATTN_ROWS_HEAD_DIMS}
        for hdp, fn in self._attn_rows.items():
            fn.max_dynamic_shared_size_bytes = _attn_rows_smem(hdp, ATTN_ROWS_HEADS)
        self._attn_rows_regs = {hdp: int(fn.attributes.get("num_regs", 0)) for hdp, fn in self._attn_rows.items()}
        self._quant = {v: mod.get_function(f"quantize_rows<{v[0]}, {str(v[1]).lower()}>") for v in QUANT_VARIANTS}
        self._fn = {name: mod.get_function(name) for name in KERNELS}
        self._fn["attn_prefill"].max_dynamic_shared_size_bytes = _attn_prefill_smem(MAX_HEAD_DIM)
        self.gemm = gemm
        self.on_launch = on_launch
        self.launches = 0
        self.pdl = pdl
        self.cluster = cluster and int(cp.cuda.Device().compute_capability) >= 90
        self.merge_mode = merge
        self._ex: Any = None
        if self.pdl or self.cluster:
            try:
                self._ex = ExLauncher()
            except (OSError, AttributeError):  # no driver library / no cuLaunchKernelEx: plain launches
                self.pdl = self.cluster = False
        self._capturing = False
        self._captured = 0  # launches so far in the capture under way
        self.sm_count = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.sm_smem = cp.cuda.Device().attributes["MaxSharedMemoryPerMultiprocessor"]  # 1 KB a block is the driver's
        self.sm_regs = cp.cuda.Device().attributes["MaxRegistersPerMultiprocessor"]
        # scratch, sized by ``reserve``
        self.part = self.zeros(1, np.float32)  # split-K partials and counters of qgemv's counter merge
        self.counters = self.zeros(1, np.int32)
        self.merge_tiles = 0  # tiles qgemv's tagged split-K slots and epochs (merge.cuh) hold
        self.merge = self.zeros(1, np.uint64)
        self.epochs = self.zeros(1, np.uint32)
        self.attn_part = self.zeros(1, np.float32)
        self.attn_counters = self.zeros(1, np.int32)
        self._tiled_bufs: dict[str, Any] = {}
        self._outgrown: list[Any] = []  # scratch buffers a captured graph may still write and read

    def reserve(self, part: int, counters: int, attn_part: int, attn_counters: int, merge_tiles: int = 0) -> None:
        """Grow the split-K and attention scratch (counters start and end every launch at zero; the merge slots
        and their epochs only ever grow together, zeroed, so that no slot holds a tag its tile has not reached).
        What a graph captured before may still use stays allocated (``_outgrown``): freed, its memory would go to
        the next array, which that graph's replays would then write."""
        if merge_tiles > self.merge_tiles:
            self._outgrown += [self.merge, self.epochs]
            self.merge = self.zeros(merge_tiles * MERGE_SPLITS * TILE_N, np.uint64)
            self.epochs = self.zeros(merge_tiles, np.uint32)
            self.merge_tiles = merge_tiles
        for name, size, dtype in (("part", part, np.float32), ("counters", counters, np.int32),
                                  ("attn_part", attn_part, np.float32), ("attn_counters", attn_counters, np.int32)):
            old = getattr(self, name)
            if size > old.size:  # twice the size at least: a batch a row larger does not grow it again
                self._outgrown.append(old)
                setattr(self, name, self.zeros(max(size, 2 * old.size), dtype))

    # memory: on the forward's stream, so that nothing races with its kernels (it does not wait for the
    # legacy default stream)
    def upload(self, a: np.ndarray) -> Any:
        with self.stream:
            return self.cp.asarray(np.ascontiguousarray(a))

    def zeros(self, shape: Any, dtype: Any) -> Any:
        with self.stream:
            return self.cp.zeros(shape, dtype)

    def copy(self, dst: Any, src: Any) -> None:
        with self.stream:
            dst[...] = src

    def download(self, a: Any, rows: int) -> np.ndarray:
        """The first ``rows`` rows of ``a`` in a new host array: pinned memory from CuPy's pool, so the copy
        runs at the bus's speed and a batch's logits (tens of MB) are neither staged nor copied again."""
        host = self.cupyx.empty_pinned((rows, *a.shape[1:]), a.dtype)
        a[:rows].get(stream=self.stream, out=host, blocking=True)
        return host

    def download_later(self, a: Any, rows: int) -> Callable[[], np.ndarray]:
        """``download``, enqueued: the call waits for the copy (not for later work on the stream) and returns
        the rows."""
        host = self.cupyx.empty_pinned((rows, *a.shape[1:]), a.dtype)
        a[:rows].get(stream=self.stream, out=host, blocking=False)
        done = self.record()
        return lambda: (done.synchronize(), host)[1]

    def put_ids(self, dst: Any, at: np.ndarray, src: Any, take: np.ndarray) -> None:
        """dst[at[i]] = src[take[i]] on the stream (device int32 arrays; ``at``/``take`` host indices)."""
        with self.stream:
            dst[self.cp.asarray(at)] = src[self.cp.asarray(take)]

    def write_meta(self, meta: Any, values: np.ndarray) -> None:
        meta[:len(values)].set(np.ascontiguousarray(values, np.int32), stream=self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def synchronize_device(self) -> None:
        self.cp.cuda.Device().synchronize()

    def mapped_ints(self, n: int) -> np.ndarray:
        """int32 [n] in pinned host memory that kernels write directly: with unified addressing (every 64-bit
        CUDA platform) a cudaHostAlloc pointer is also the device's pointer to it."""
        mem = self.cp.cuda.alloc_pinned_memory(4 * n)
        arr = np.frombuffer(mem, np.int32, n)  # keeps ``mem`` alive
        arr[:] = 0
        return arr

    def record(self) -> Any:
        event = self.cp.cuda.Event(block=False, disable_timing=True)
        event.record(self.stream)
        return event

    def wait(self, event: Any) -> None:
        event.synchronize()

    # graph
    def capture(self, body: Callable[[], None]) -> Callable[[], None]:
        s = self.stream
        with s:
            s.begin_capture()
            self._capturing, self._captured = True, 0
            try:
                body()
            finally:
                self._capturing = False
                graph = s.end_capture()

        def replay() -> None:
            self.launches += 1
            graph.launch(s)
        replay.graph = graph  # type: ignore[attr-defined]
        return replay

    def launch(self, kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, smem: int = 0,
               cluster: int = 1, name: str = "") -> None:
        """Launch ``kernel`` (a CuPy RawKernel, this module's or another) on the stream. Inside a graph capture
        with PDL on, every launch after the capture's first may overlap its predecessor (forward_launch; each
        kernel waits for it before reading its outputs). ``cluster`` > 1: grid y in clusters of that many
        blocks (the M=1 GEMV's K splits). ``name``: what ``on_launch`` is told."""
        self._observed(name, lambda: self._launch(kernel, grid, block, args, smem, cluster))

    def _observed(self, name: str, run: Callable[[], None]) -> None:
        """run(), or handed to ``on_launch`` as ``name``."""
        if self.on_launch is not None:
            self.on_launch(name, run)
        else:
            run()

    def _pdl(self) -> bool:
        """Counts a launch; whether it may overlap its predecessor (inside a capture, after its first)."""
        self.launches += 1
        if not self._capturing:
            return False
        self._captured += 1
        return self.pdl and self._captured > 1

    def _launch(self, fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, smem: int,
                cluster: int) -> None:
        pdl = self._pdl()
        if pdl or cluster > 1:
            self._ex.launch(fn, grid, block, args, smem, self.stream, pdl, (1, cluster, 1) if cluster > 1 else None)
            return
        with self.stream:
            fn(grid, block, args, shared_mem=smem)

    # kernels
    def embed(self, codes: Any, scales: Any, group: int, ids: Any, h: Any, ssq_out: Any = None,
              mul: float = 1.0) -> None:
        m, d = h.shape
        self.launch(self._fn["embed_rows"], (-(-d // 256), m), (256,),
                    (_ptr(codes), _ptr(scales), _i32(d), _i32(group), _ptr(ids), np.float32(mul), _ptr(h),
                     _ptr(ssq_out if m == 1 else None)), name="embed_rows")

    def norm_add(self, x: Any, w: Any, eps: float, y: Any, ssq_out: Any = None) -> None:
        """y += rmsnorm(x, w, eps) row by row (rows.cu norm_add_rows); ssq_out (M = 1): y's tile sums."""
        m, d = x.shape
        self.launch(self._fn["norm_add_rows"], (m,), (256,),
                    (_ptr(x), _ld(x), _i32(d), _ptr(w), np.float32(eps), _ptr(y), _ld(y),
                     _ptr(ssq_out if m == 1 else None)), name="norm_add_rows")

    def gemv(self, lin: Lin, x: Any, pro: int, pw: Any, eps: float, xoff: int, y: Any, epi: int,
             bias: Any, ssq_in: Any = None, ssq_out: Any = None, rope: QkvRope | None = None,
             experts: tuple[Any, Any, int] | None = None, sel_ready: bool = False,
             post: PostNorm | None = None, quantized: bool = False, fold_norm: Any = None,
             prenormed: bool = False, route: RouteFold | None = None, add_scale: float = 1.0,
             swiglu: tuple[float, float] = NO_SWIGLU) -> None:
        """``add_scale`` (EPI_ADD, none of the folds below): y += (lin(x) + bias) * add_scale, Granite's residual
        multiplier (plan.check_add_scale). ``swiglu``: prologue PRO_SWIGLU_OAI's (clamp, slope) (plan.gate_prologue).
        ssq_in / ssq_out (M = 1 only): the residual stream's tile sums of
        squares, read by an RMSNorm prologue (pro 1) instead of the row, written with a residual-add epilogue's
        outputs. ``post`` (M = 1):
        with pro PRO_POSTNORM this GEMV reads the post-norm (x is its ``h``), else it is the projection before
        it (y is its ``out``). ``rope`` (M = 1,
        one head per column tile): the epilogue does qkv_rope's work instead of storing. ``experts`` (table,
        sel, slots): row j of y gets the expert sel[j] of ``table`` (``expert_table``; ``lin`` has their shape
        and plan) on row j of x, or on its one row, plus row sel[j] of ``bias`` [experts, lin.n] where there is
        one; ``sel_ready``: the launch before this one in the stream is
        a routed GEMV on the same ``sel`` (gemv.cu: this one then reads sel before its PDL wait). ``quantized``
        (M > 1, the tiled GEMM, PRO_PLAIN, G = 32): x's codes are where that GEMM reads them already
        (``attention(quantize_for=lin)`` wrote them), so no prologue kernel runs. The norm fold (M > 1, where
        ``norm_fold`` says): ``fold_norm``, the next norm's weights, with EPI_ADD: the GEMM also quantizes y's
        new rows for the normed GEMMs after it; ``prenormed`` (pro PRO_RMSNORM): x's are those codes. ``route``
        (M = 1, the o projection: PRO_PLAIN, EPI_STORE, ``bias`` the residual h, y the other row, G = 32): the
        router's blocks beside it (plan.RouteFold), its K splits merged through the counters or a cluster."""
        m = x.shape[0]
        folded = experts is not None or post is not None or rope is not None
        if route is not None:
            check_route_fold(route, lin, m, pro, epi, bias, folded)
        if post is not None and (m != 1 or experts is not None):
            raise ValueError("a post-norm folds into M = 1 GEMVs only")
        check_add_scale(add_scale, epi, folded or route is not None)
        if m > 1:
            ssq_in = ssq_out = None
        ldx = _ld(x)
        if experts is not None and bias is not None and tuple(bias.shape[1:]) != (lin.n,):
            raise ValueError(f"a routed GEMV's biases are [experts, {lin.n}], got {tuple(bias.shape)}")
        if experts is not None:
            table, sel, m = experts
            ldx = _i32(0) if x.shape[0] == 1 else ldx
        elif m > 1 and self.gemm is not None:
            self._tiled(lin, x, pro, pw, eps, xoff, y, epi, bias, quantized, fold_norm, prenormed, add_scale,
                        swiglu)
            return
        if quantized or prenormed or fold_norm is not None:
            raise ValueError("pre-quantized rows are the tiled GEMM's (M > 1)")
        one = m == 1 or experts is not None  # one row a block
        mr = 1 if one else SMALL_M
        ksplit = lin.ksplit if one else 1
        attend = rope.attend if rope is not None else None
        oai = experts is not None and (bias is not None or pro == PRO_SWIGLU_OAI)  # gpt-oss's routed GEMVs
        if pro == PRO_SWIGLU_OAI and not oai:
            raise ValueError("the clamped SwiGLU prologue runs in routed GEMVs (M = 1) and the tiled GEMMs' rows")
        fold = (FOLD_ROUTER if route is not None else FOLD_ATTENTION if attend is not None
                else FOLD_EXPERTS if oai else 0)
        fn = self._gemv[(lin.bits, lin.group_size, mr, fold)]
        cluster = ksplit if one and lin.cluster and self.cluster else 1
        if attend is not None and (m != 1 or cluster < 2):
            raise ValueError("decode attention folds into an M = 1 q|k|v GEMV whose K splits are clusters")
        tagged = (ksplit > 1 and cluster == 1 and experts is None and route is None
                  and tagged_merge(self.merge_mode, lin.tiles * ksplit, self.sm_count))
        if tagged and (lin.tiles > self.merge_tiles or ksplit > MERGE_SPLITS):
            raise RuntimeError(f"split-K merge area for {lin.tiles} tiles x {ksplit} splits not reserved")
        if ksplit > 1 and not tagged and cluster == 1 and (ksplit * m * lin.npad > self.part.size
                                                           or lin.tiles * -(-m // mr) > self.counters.size):
            raise RuntimeError(f"split-K scratch for {m} rows x {lin.tiles} tiles x {ksplit} splits not reserved")
        self.launch(fn, (lin.tiles + (route.groups if route else 0), ksplit, -(-m // mr)), (256,),
                    (_ptr(lin.codes), _ptr(lin.scales), _i32(lin.k), _i32(lin.n), _i32(lin.npad),
                     _ptr(x), ldx, _i32(m), _i32(pro), _ptr(pw), np.float32(eps), _i32(xoff),
                     _ptr(y), _ld(y), _i32(epi), np.float32(add_scale), _ptr(bias), _ptr(self.part),
                     _ptr(self.counters), _ptr(self.merge),
                     _ptr(self.epochs if tagged else None), _ptr(ssq_in), _ptr(ssq_out), *_rope_args(rope),
                     *((_ptr(None), _ptr(None)) if experts is None else (_ptr(table), _ptr(sel))),
                     _i32(sel_ready and experts is not None), *_post_args(post, pro), *_route_args(route),
                     *_attend_args(attend), np.float32(swiglu[0]), np.float32(swiglu[1])),
                    EXPERT_TABLE_ROWS * 16 if experts is not None else 0, cluster=cluster, name="qgemv")

    def _tiled(self, lin: Lin, x: Any, pro: int, pw: Any, eps: float, xoff: int, y: Any, epi: int,
               bias: Any, quantized: bool, fold_norm: Any, prenormed: bool, add_scale: float = 1.0,
               swiglu: tuple[float, float] = NO_SWIGLU) -> None:
        """Prologue kernel -> codes/scales, the tiled GEMM (gemm.DeviceGemm) -> tmp, epilogue kernel -> y;
        without a bias or a residual multiplier the GEMM stores into y, or adds to it (EPI_ADD), itself."""
        m, k, g = x.shape[0], lin.k, lin.group_size
        direct = bias is None and add_scale == 1.0
        tmp = y if direct else self._scratch("tmp", m * lin.npad, np.float32).reshape(m, lin.npad)
        add = direct and epi == EPI_ADD
        if prenormed and pro != PRO_RMSNORM or fold_norm is not None and not add:
            raise ValueError("the norm fold goes from a residual add (no bias) to an RMSNorm prologue")
        codes, scales, ssq = self.norm_input(m, k) if prenormed else (*self.gemm_input(m, k, g), None)
        if not (quantized or prenormed):
            self._quantize_rows(x, m, k, g, pro, pw, eps, xoff, codes, scales, swiglu)
        elif quantized and (g != ATTN_CODES_GROUP or pro != PRO_PLAIN):
            raise ValueError(f"pre-quantized rows are plain G = {ATTN_CODES_GROUP} codes")
        weight = _as_device_weight(lin)
        fold = None if fold_norm is None else (fold_norm, *self.norm_input(m, lin.n))
        row_ssq = None if ssq is None else (ssq, eps)
        self._observed("gemm_q8 (tiled)", lambda: self._gemm_q8(codes, scales, weight, tmp, lin.n, add, fold, row_ssq))
        if direct:
            return
        self.launch(self._fn["add_rows"], (-(-lin.n // 256), m), (256,),
                    (_ptr(tmp), _ld(tmp), _i32(m), _i32(lin.n), _ptr(y), _ld(y), _i32(epi), np.float32(add_scale),
                     _ptr(bias)),
                    name="add_rows")

    def gemm_input(self, m: int, k: int, g: int) -> tuple[Any, Any]:
        """The codes int8 [m, k] and scales float32 [m, k / g] the tiled GEMMs read their input from (scratch:
        each GEMM's prologue, or ``attention(quantize_for=...)``, writes them just before it)."""
        codes = self._scratch("codes", m * k, np.int8).reshape(m, k)
        return codes, self._scratch("scales", m * (k // g), np.float32).reshape(m, k // g)

    def norm_input(self, m: int, k: int) -> tuple[Any, ...]:
        """The norm fold's codes int8 [m, k], scales float32 [m, k / 32] and sums of squares [k / 128, m]
        (gemm.DeviceGemm.q8 ``fold``): apart from ``gemm_input``, which the GEMM that writes them reads."""
        parts = (("codes", 1, np.int8), ("scales", 32, np.float32), ("ssq", 128, np.float32))
        bufs = [self._scratch(f"norm_{name}", m * k // d, t).reshape(m, k // d) for name, d, t in parts]
        return bufs[0], bufs[1], bufs[2].reshape(k // 128, m)

    def norm_fold(self, m: int, producer: Lin, consumers: Sequence[Lin]) -> bool:
        """Whether an M-row residual add through ``producer`` quantizes its rows for the normed ``consumers``
        after it (``gemv(fold_norm=...)``, then theirs with ``prenormed``): gemm.DeviceGemm.norm_fold."""
        return (m > 1 and self.gemm is not None
                and self.gemm.norm_fold(m, _as_device_weight(producer).geometry, producer.n,
                                        [_as_device_weight(c).geometry for c in consumers]))

    def _quantize_rows(self, x: Any, m: int, k: int, g: int, pro: int, pw: Any, eps: float, xoff: int,
                       codes: Any, scales: Any, swiglu: tuple[float, float] = NO_SWIGLU) -> None:
        """codes [m, k] int8 and scales [m, k / g] of prologue ``pro`` of x's rows (rows.cu quantize_rows)."""
        self.launch(self._quant[(g, pro == PRO_SWIGLU_OAI)], (-(-k // QUANT_CHUNK), m), (256,),
                    (_ptr(x), _ld(x), _i32(m), _i32(k), _i32(pro), _ptr(pw), np.float32(eps), _i32(xoff),
                     _ptr(codes), _ptr(scales), np.float32(swiglu[0]), np.float32(swiglu[1])), name="quantize_rows")

    def _gemm_q8(self, codes: Any, scales: Any, weight: Any, out: Any, n: int, accumulate: bool,
                 fold: tuple | None = None, row_ssq: tuple | None = None) -> None:
        self.gemm.q8(codes, scales, weight, out, n, self.stream, pdl=self._pdl(), accumulate=accumulate, fold=fold,
                     row_ssq=row_ssq)

    def _scratch(self, name: str, size: int, dtype: Any) -> Any:
        """A flat scratch buffer of at least ``size`` elements, grown outside graph capture. A buffer it
        outgrows stays allocated, since a batch graph captured earlier still uses it (freed, CuPy's pool would
        hand it to other arrays); growth at least doubles, so those add up to less than the buffer in use."""
        buf = self._tiled_bufs.get(name)
        if buf is None or buf.size < size:
            grown = size if buf is None else max(size, 2 * buf.size)
            if buf is not None:
                self._outgrown.append(buf)
            buf = self._tiled_bufs[name] = self.zeros(grown, dtype)
        return buf[:size]

    def finish_logits(self, logits: Any, div: float, cap: float) -> None:
        """logits [rows, N] in place: divided by ``div``, then cap * tanh(x / cap) where cap > 0 (lm_finish.cu
        finish_logits: Granite's logits_scaling, Gemma 2's final soft cap)."""
        m, n = logits.shape
        self.launch(self._fn["finish_logits"], (-(-n // 256), m), (256,),
                    (_ptr(logits), _ld(logits), _i32(n), np.float32(div), np.float32(cap)), name="finish_logits")

    def greedy_token(self, logits: Any, scratch: tuple[Any, Any, Any], meta: Any, limit: int,
                     tokens: np.ndarray) -> None:
        """The argmax of ``logits`` [1, N] to meta[1] and tokens[meta[0] % len(tokens)]; meta[0] advances while
        below ``limit`` (lm_finish.cu; ``scratch``: its per-block values, indices and counter)."""
        val, idx, count = scratch
        n = logits.shape[1]
        self.launch(self._fn["lm_finish"], (-(-n // FINISH_COLS),), (FINISH_COLS // 4,),
                    (_ptr(logits), _i32(n), _ptr(val), _ptr(idx), _ptr(count), _ptr(meta), _i32(limit),
                     np.uint64(tokens.ctypes.data), _i32(len(tokens))), name="lm_finish")

    def argmax_rows(self, logits: Any, rows: int, scratch: tuple[Any, Any, Any, Any, Any]) -> Any:
        """Each of the first ``rows`` rows' argmax into scratch's ids (int32 [rows] on the device; -1: a row
        with a NaN or an infinity) by lm_finish.cu's argmax_rows."""
        val, idx, bad, count, ids = scratch
        n = logits.shape[1]
        self.launch(self._fn["argmax_rows"], (-(-n // FINISH_COLS), rows), (FINISH_COLS // 4,),
                    (_ptr(logits), _i32(n), _ptr(val), _ptr(idx), _ptr(bad), _ptr(count), _ptr(ids)),
                    name="argmax_rows")
        return ids[:rows]

    def qkv_rope(self, qkv: Any, heads: int, kv_heads: int, hd: int, qnorm: Any, knorm: Any, eps: float,
                 cos: Any, sin: Any, meta: Any, q: Any, kc: Any, vc: Any, rows: Any = None,
                 tables: Any = None) -> None:
        """``rows`` int32 [M, 2] (position, page-table row) and ``tables`` int32 [S, tb]: a batch of sequences
        whose keys and values go to the paged pool ``kc``/``vc`` (rope.cu); None: one sequence at meta[0]."""
        m = qkv.shape[0]
        self.launch(self._fn["qkv_rope"], (-(-(heads + 2 * kv_heads) // 4), m), (128,),
                    (_ptr(qkv), _ld(qkv), _i32(heads), _i32(kv_heads), _i32(hd), _ptr(qnorm), _ptr(knorm),
                     np.float32(eps), _ptr(cos), _ptr(sin), _ptr(meta), _ptr(q), _ptr(kc), _ptr(vc),
                     _i32(kc.shape[1]), _ptr(rows), _ptr(tables), _i32(0 if tables is None else tables.shape[1])),
                    name="qkv_rope")

    def gather_rows(self, src: Any, index: Any, dst: Any) -> None:
        """dst[i] = src[index[i]] (the rows whose logits a batched step returns; an expert's rows)."""
        with self.stream:
            self.cp.take(src, index, axis=0, out=dst)

    def write_rows(self, dst: Any, values: np.ndarray) -> None:
        """The first len(values) rows of dst from host float32 values."""
        dst[:len(values)].set(np.ascontiguousarray(values, np.float32), stream=self.stream)


def _rope_args(r: QkvRope | None) -> tuple[Any, ...]:
    """qgemv's trailing parameters: qkv_rope's work in the epilogue, or none (null q)."""
    if r is None:
        return (*(_ptr(None),) * 8, _i32(0), _i32(0), _i32(0))
    return (_ptr(r.qnorm), _ptr(r.knorm), _ptr(r.cos), _ptr(r.sin), _ptr(r.meta), _ptr(r.q), _ptr(r.kc),
            _ptr(r.vc), _i32(r.heads), _i32(r.kv_heads), _i32(r.kc.shape[1]))


def _attend_args(a: AttendFold | None) -> tuple[Any, ...]:
    """qgemv's decode attention (plan.AttendFold: attend.cuh AttendArgs), or none (null output)."""
    if a is None:
        return (_ptr(None), np.float32(0), _i32(0), _ptr(None), _ptr(None))
    return (_ptr(a.out), np.float32(a.scale), _i32(a.window), _ptr(a.kv_now), _ptr(a.epochs))


def _route_args(r: RouteFold | None) -> tuple[Any, ...]:
    """qgemv's router fold (plan.RouteFold: route.cuh RouteArgs), or none (null weights)."""
    if r is None:
        return (_ptr(None), *(_i32(0),) * 6, *(_ptr(None),) * 4)
    return (_ptr(r.weights), _i32(r.groups), _i32(r.rows), _i32(r.experts), _i32(r.k), _i32(r.norm_topk), _i32(r.span),
            _ptr(r.part), _ptr(r.counter), _ptr(r.sel), _ptr(r.wts))


def _post_args(p: PostNorm | None, pro: int) -> tuple[Any, ...]:
    """qgemv's post-norm parameters (pn_w, pn_src, pn_stats, pn_next): the GEMV after the post-norm reads out,
    the one before it the residual h; none (null stats)."""
    if p is None:
        return (_ptr(None),) * 4
    if pro == PRO_POSTNORM:
        return _ptr(None), _ptr(p.out), _ptr(p.stats), _ptr(p.h_next)
    return _ptr(p.weight), _ptr(p.h), _ptr(p.stats), _ptr(None)


def _as_device_weight(lin: Lin) -> Any:
    """The object the tiled GEMM takes (``residency.DeviceWeight``-like) for one projection."""
    dw = getattr(lin, "device_weight", None)
    if dw is not None:
        return dw
    from types import SimpleNamespace

    geometry = Geometry(lin.k, lin.npad, lin.k // lin.group_size, lin.bits)
    return SimpleNamespace(geometry=geometry, codes=lin.codes.reshape(-1).view(np.int8), scales=lin.scales)
