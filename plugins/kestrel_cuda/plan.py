"""What the whole-step forward launches: projections (``Lin``), the constants it shares with the kernels, and
the M=1 GEMV's K-split planners.

Every planner is a pure function of shapes and the SM count, so the plans are tested on the CPU
(tests/kestrel_cuda/test_plan.py) for the GPU they were measured on (132 SMs, the H200).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kestrel_core.contract import StripCache

TILE_N = 128  # columns of a GEMV block (forward.cuh TN)
SSQ_COLS = 32  # columns per entry of the residual stream's sums of squares (forward.cuh)
CHUNK_K = 256  # rows of a GEMV chunk (gemv.cu KC: one 32-row slot per warp), int8 and int4
SMALL_M = 8  # rows of one fused-GEMV pass at M > 1 (MR = 8), where there is no tiled GEMM
MAX_CLUSTER = 8  # K splits launched as one thread block cluster, at most (common.cuh): M=1 GEMVs, split GEMMs
MERGE_SPLITS = 64  # K splits of an M=1 GEMV, at most: slots per tile of its tagged merge area (merge.cuh)
CHUNK_BLOCKS_PER_SM = 4  # qgemv's resident blocks per SM at M = 1 (__launch_bounds__(NT, 4))
TARGET_BLOCKS_PER_SM = 8  # GEMV blocks per SM the K-split planner aims for: measured fastest on the H200
ONE_WAVE_SPLITS = 16  # a projection whose one wave of blocks gives each tile this many K splits runs one wave
ATTN_SPLITS = 16  # position splits of decode attention (attn_decode<NS>): 16 measured faster than 32
ATTEND_FOLD_MAX_CONTEXT = 1024  # KV positions of a sequence up to which decode attention folds into q|k|v
ATTN_ROWS_HEADS = 8  # query heads of one KV head that one attn_rows block takes (rows h, 8 + h: hi, lo)
ATTN_ROWS_WARPS = 2  # warps of an attn_rows block, each on 16 positions of every page
ATTN_ROWS_HEAD_DIMS = (16, 32, 64, 128, 256)  # attn_rows instances: a head_dim runs in the smallest holding it
BLOCKS_PER_SM_MAX = 32  # resident blocks of one multiprocessor, at most (sm_80 and later)
ATTN_ROWS_MAX_SPLITS = 8
ATTN_ROWS_BUFFERS = 3  # attn_rows' page buffers up to head_dim 128 (attention.cu ROWS_BUFFERS)
ATTN_CODES_GROUP = 32  # attn_rows writes the o projection's codes at this group size (a head holds whole groups)
MAX_HEAD_DIM = 256  # attention and qkv_rope keep hd/32 (<= 8) values a lane
PRO_PLAIN, PRO_RMSNORM, PRO_SILU_MUL, PRO_GELU_MUL = 0, 1, 2, 3  # prologues (gemv.cu, rows.cu)
PRO_POSTNORM = 4  # gemv.cu, M = 1: rmsnorm(h + rmsnorm(out, w)) from a PostNorm's tile sums
PRO_SWIGLU_OAI = 5  # gpt-oss's clamped SwiGLU (gemv.cu, rows.cu): its clamp and slope are the launch's own
NO_SWIGLU = (0.0, 0.0)  # the (clamp, slope) of a launch whose prologue is another
POSTNORM_MAX_D = 64 * TILE_N  # widest residual stream a PostNorm folds (forward.cuh postnorm_rms: two loads a lane)
EPI_STORE, EPI_ADD = 0, 1
FOLD_ROUTER, FOLD_ATTENTION, FOLD_EXPERTS = 1, 2, 3  # what else an M = 1 qgemv instance does (gemv.cu FOLD)
PASS_ROWS = 1024  # rows of one pass of a pooled step: a whole prompt chunk (PREFILL_CHUNK) beside 512 decode rows
KV_BLOCK = 32  # positions per block of the paged KV pool (rope.cuh KV_BLOCK): the engine's page size
KV_DTYPE = np.float16  # keys and values on the device (forward.cuh kv_t), rounded as the CPU decoder rounds them
TOKEN_RING = 64  # greedy tokens kept in host memory by lm_finish, indexed by position modulo this
FINISH_COLS = 1024  # columns one lm_finish block reduces (lm_finish.cu FIN_T x FIN_E)
MERGE_MODES = ("auto", "tagged", "counter")
ROUTE_ROWS = 8  # router rows of one moe_route block (moe.cu ROUTE_ROWS)
ROUTE_MAX_EXPERTS = 256  # moe_route: a router logit per thread of the choosing block (route.cuh ROUTE_MAX_EXPERTS)
ROUTE_MAX_HIDDEN = 8192  # moe_route: the normed row in 32 KiB of shared memory (48 KiB with no opt-in)
ROUTE_FOLD_ROWS = 16  # router rows of one block of a RouteFold (route.cuh: 16 threads a row)
ROUTE_FOLD_MAX_SPAN = 512  # K range of one RouteFold block at most (route.cuh ROUTE_FOLD_F4: 8 float4s a thread)
EXPERT_TABLE_ROWS = 256  # rows of a routed GEMV's expert table: one a thread, copied to shared memory (gemv.cu)
GROUPED_ROWS = 64  # positions of one block of a mixture of experts' grouped GEMM (gemm.GROUPED_TILES' rows)
GROUPED_ROWS_FEW = 16  # ... where the pairs average at most that many an expert (a decode batch's)


@dataclass
class Lin:
    """One device projection in the K-major layout, and where its N outputs go in the output buffer.

    codes: uint8 [K][Npad] (8-bit codes, as int8 bits) or [K/8][4 * Npad] (4-bit words of 8 k, +8 biased);
    scales: float32 [K/G][Npad]; ``col``: first output column; ``ksplit``: K splits of the M=1 GEMV.
    """

    codes: Any
    scales: Any
    k: int
    n: int
    npad: int
    group_size: int
    bits: int
    col: int = 0
    ksplit: int = 1
    wkey: int = 0
    cluster: bool = False  # its M=1 K splits run as one thread block cluster per tile (plan_split)
    slots: int = 1  # rows of its M=1 launch: a mixture of experts' chosen experts (plan_routed), else 1

    @classmethod
    def from_device_weight(cls, dw: Any, n: int, col: int = 0, wkey: int = 0) -> Lin:
        """A projection over a cache weight (``residency.DeviceWeight``), its codes viewed as pack_kmajor lays
        them out."""
        g = dw.geometry
        shape = (g.k, g.npad) if g.code_bits == 8 else (g.k // 8, 4 * g.npad)
        return cls(dw.codes.view(np.uint8).reshape(shape), dw.scales, g.k, n, g.npad, g.group_size, g.code_bits,
                   col, wkey=wkey)

    @property
    def tiles(self) -> int:
        return -(-self.npad // TILE_N)

    @property
    def chunks(self) -> int:
        return -(-self.k // CHUNK_K)


@dataclass
class AttendFold:
    """Decode attention done by the q|k|v projection's clusters (attend.cuh, gemv.cu FOLD_ATTENTION) instead of
    a launch of its own: the output row, the query's scale, the sliding window (0: none) and the state's scratch:
    this position's keys and values as tagged words (uint64 [2 KV hd]) and every tile's epoch (uint32 [H + 2 KV],
    zeroed once; each launch adds one to all of them)."""

    out: Any  # [1, H * hd]
    scale: float
    window: int
    kv_now: Any
    epochs: Any


@dataclass
class QkvRope:
    """What qkv_rope does after the q|k|v projection, handed to that projection's M=1 GEMV when each of its
    column tiles is one head (head_dim == TILE_N): per-head norms (or None), RoPE tables, the position
    (``meta``), and where q and this layer's keys and values go; with ``attend``, decode attention as well."""

    heads: int
    kv_heads: int
    qnorm: Any
    knorm: Any
    eps: float
    cos: Any
    sin: Any
    meta: Any
    q: Any
    kc: Any
    vc: Any
    attend: AttendFold | None = None


@dataclass
class PostNorm:
    """A post-norm h' = h + rmsnorm(out, weight) (Gemma) folded into the M = 1 GEMVs around it instead of a
    kernel of its own (gemv.cu): the projection stores out·weight in ``out`` and leaves ``stats``, the tile
    sums of out², h·out·weight, (out·weight)² and h² per 32 columns; the next GEMV (prologue PRO_POSTNORM,
    input ``h``) forms h' and its norm from them, and its first column tile stores h' in ``h_next``."""

    weight: Any  # [D]
    h: Any  # [1, D]: the residual stream before the post-norm's add
    out: Any  # [1, D]: out·weight
    stats: Any  # float32 [4 * ssq_count(D)]
    h_next: Any  # [1, D]


@dataclass
class RouteFold:
    """A decode step's router run by blocks of its own beside the o projection's M = 1 GEMV (gemv.cu FOLD,
    route.cuh), instead of by ``moe_route`` after it. The router reads rmsnorm(h', norm) for h' = h + W_o a, so
    a logit is (router·diag(norm)·h + router·diag(norm)·W_o·Q(a)) / rms(h'), where Q(a) is the quantized input
    the o GEMV itself multiplies: these blocks need h and a, which are ready when the o projection starts, and
    only the division waits for h'. The last of them chooses (the order of the logits does not depend on the
    division) and ``moe_combine(fold=...)`` weighs the choice. The o GEMV stores h' in the other residual row
    (``bias`` h, EPI_STORE), so h stays readable."""

    weights: Any  # float32 [R, D + K] (``route_fold_weights``): R = experts (+ 1: a shared-expert gate)
    experts: int
    k: int  # experts chosen a row
    norm_topk: bool
    span: int  # K range of [h | a] one block sums (``route_fold_span``)
    part: Any  # float32 [>= K splits x R]: each split's sums, row 0 then the totals (moe_combine weighs them)
    counter: Any  # int32 [1]: the router blocks' arrivals (reset by the last)
    sel: Any  # int32 [1, k]
    wts: Any  # float32 [1, k + 1]: the chosen experts' totals, then the shared gate's

    @property
    def rows(self) -> int:
        return int(self.weights.shape[0])

    @property
    def groups(self) -> int:
        """Router blocks of each K split."""
        return -(-self.rows // ROUTE_FOLD_ROWS)


def route_fold_weights(router: np.ndarray, norm: np.ndarray, o: StripCache) -> np.ndarray:
    """A RouteFold's weights, float32 [R, D + K]: g = router·diag(norm) [R, D], then g times the o projection's
    dequantized weights [D, K]."""
    g = (np.asarray(router, np.float32) * np.asarray(norm, np.float32)[None, :]).astype(np.float32)
    return np.concatenate([g, g @ o.dequantize()], axis=1).astype(np.float32)


def route_fold_span(d: int, k: int, ksplit: int) -> int:
    """The K range one RouteFold block sums when the o projection (input width ``k``, residual width ``d``) runs
    ``ksplit`` K splits: (d + k) / ksplit, a multiple of 64 (16 threads a row, a float4 each) up to
    ROUTE_FOLD_MAX_SPAN with d a multiple of 32 (a warp quantizes one group of a); 0 where it is none."""
    total = d + k
    if d % 32 or total % ksplit:
        return 0
    span = total // ksplit
    return span if span % 64 == 0 and span <= ROUTE_FOLD_MAX_SPAN else 0


def check_route_fold(route: RouteFold, lin: Lin, m: int, pro: int, epi: int, bias: Any, other: bool) -> None:
    """What a GEMV with a RouteFold must be (``ops.gemv(route=...)``): one row, the plain prologue, a store with
    the residual as its bias, G = 32, the fold's span over this plan's K splits, and ``other`` (experts, a
    post-norm or RoPE) none."""
    if (m != 1 or pro != PRO_PLAIN or epi != EPI_STORE or bias is None or other or lin.group_size != 32
            or route.span != route_fold_span(lin.n, lin.k, lin.ksplit)):
        raise ValueError("a router folds into the o projection's M = 1 GEMV at G = 32 only, storing h + o(x)")


def gate_prologue(config: Any) -> tuple[int, tuple[float, float]]:
    """The prologue that combines an MLP's gate|up output for the down projection by ``config``'s activation
    (SwiGLU, GeGLU, gpt-oss's clamped SwiGLU), and the clamped SwiGLU's (clamp, slope) (NO_SWIGLU otherwise)."""
    if config.activation == "swiglu_oai":
        return PRO_SWIGLU_OAI, (float(np.float32(config.swiglu_limit)), float(np.float32(config.swiglu_alpha)))
    return (PRO_GELU_MUL if config.activation == "gelu_tanh" else PRO_SILU_MUL), NO_SWIGLU


def check_add_scale(add_scale: float, epi: int, folded: bool) -> None:
    """A residual multiplier (``ops.gemv(add_scale=...)``, Granite's) scales a plain residual add's projection
    only: EPI_ADD, and ``folded`` (experts, a post-norm, RoPE or a router) none."""
    if add_scale != 1.0 and (epi != EPI_ADD or folded):
        raise ValueError("a residual multiplier scales a plain residual add (EPI_ADD) only")


def plan_ksplit(lin: Lin, target_blocks: int) -> int:
    """K splits of the M=1 GEMV: enough blocks (tiles x splits) to fill the GPU, at most one per chunk. Where
    a split at or above that divides the chunks evenly and still gives every block two chunks or more, the
    smallest such, so that no block carries a chunk more than the others: qwen3-8b's fused gate|up (192
    tiles, 16 chunks) runs 8 splits of 2 chunks instead of 6 of 2 or 3, 40-55 us a step faster at q8 and q4;
    the unfused gate/up (96 tiles: 11 splits) has no such split and keeps its own, which measured faster than
    8 or 16 at q4 (docs/performance.md)."""
    split = max(1, min(lin.chunks, MERGE_SPLITS, -(-target_blocks // lin.tiles)))
    even = (s for s in range(split, min(lin.chunks // 2, MERGE_SPLITS) + 1) if lin.chunks % s == 0)
    return next(even, split)


def one_wave_split(lin: Lin, sm_count: int) -> int:
    """K splits of a narrow projection's M=1 GEMV as one wave of resident blocks, or 0 (use the two-wave
    target). Where one wave still gives every tile ONE_WAVE_SPLITS splits or more (qwen3-8b's down: 32 tiles,
    16 splits on 132 SMs, 3 chunks a block), it measured 60-100 us per step faster than the target's two waves
    of 33 splits: an extra wave's block starts and a merge of more partials cost more than the longer blocks;
    wider projections (q|k|v at q8: one wave = 11 splits) measured slower that way (docs/performance.md)."""
    split = min(lin.chunks, MERGE_SPLITS, CHUNK_BLOCKS_PER_SM * sm_count // lin.tiles)
    return split if split >= ONE_WAVE_SPLITS else 0


def cluster_split(lin: Lin, ksplit: int, sm_count: int, slots: int = 1) -> int:
    """K splits of the M=1 GEMV to run as one thread block cluster per tile (their partial sums added in
    shared memory, not through L2), or 0 to keep ``ksplit`` and the global merge. Clusters measured faster
    only for a grid of one wave (CHUNK_BLOCKS_PER_SM per SM): larger grids lose more to the clusters' placement
    on whole GPCs than the merge saves. Within one wave, blocks of one chunk each always gained; blocks of
    several chunks gained where the grid still fills more than half the wave (q|k|v at q8: 384 blocks of two
    chunks, 80.5 against 77.0 % of copy, -40 us per step) and lost where it does not (q and o at q8: 256
    blocks, 64 against 74 %), and where the chunks do not divide evenly among the cluster's blocks.
    Where ``ksplit`` gives no such cluster, the most splits of at most three chunks a block that do, if any:
    Gemma 3 12B's q|k|v (15 chunks) as 5 splits, 320 blocks, 10.16 against 11.27 us for the planner's 15
    (6.98 against 7.84 at q4; 8 as a cluster, uneven, 13.1); qwen3-30b-a3b's routed
    gate|up as 4 splits, 384 blocks, not 8 in 768 (docs/performance.md). ``slots``: rows a launch runs, each
    its own grid z (plan_routed)."""
    wave = CHUNK_BLOCKS_PER_SM * sm_count

    def fits(split: int) -> bool:
        blocks = lin.tiles * split * slots
        even = lin.chunks <= split or (2 * blocks > wave and lin.chunks % split == 0)
        return split > 1 and blocks <= wave and even

    split = min(ksplit, MAX_CLUSTER)
    if fits(split):
        return split
    fewer = (s for s in range(split - 1, 1, -1) if lin.chunks % s == 0 and lin.chunks <= 3 * s and fits(s))
    return next(fewer, 0)


def plan_split(lin: Lin, sm_count: int, target_blocks: int | None = None, clusters: bool = False) -> int:
    """The K splits of ``lin``'s M=1 GEMV (and ``lin.cluster``, whether they run as one cluster per tile).

    ``target_blocks``: the blocks to aim for (``plan_ksplit``); by default TARGET_BLOCKS_PER_SM per SM, or one
    wave for narrow projections (``one_wave_split``). ``clusters``: the device launches clusters
    (``CupyOps.cluster``)."""
    if target_blocks is None:
        ksplit = one_wave_split(lin, sm_count) or plan_ksplit(lin, TARGET_BLOCKS_PER_SM * sm_count)
    else:
        ksplit = plan_ksplit(lin, target_blocks)
    split = cluster_split(lin, ksplit, sm_count) if clusters else 0
    lin.cluster = split > 0
    return split or ksplit


def plan_routed(lin: Lin, slots: int, sm_count: int, clusters: bool = False) -> int:
    """K splits of a routed expert's M=1 GEMV, launched for ``slots`` chosen experts at once (a grid z each):
    TARGET_BLOCKS_PER_SM per SM over all of them, merged through the counters (the tagged merge is per column
    tile, not per slot) or, by cluster_split's rule over the whole grid, as one cluster per tile and slot
    (qwen3-30b-a3b's experts' down, 384 blocks: 318.6 against 383.3 us a decode step, docs/performance.md).
    qwen3-30b-a3b's gate|up, beyond one wave at its 8 planned splits, runs 4 as clusters."""
    lin.slots = slots
    ksplit = plan_ksplit(lin, max(1, TARGET_BLOCKS_PER_SM * sm_count // slots))
    split = cluster_split(lin, ksplit, sm_count, slots) if clusters else 0
    lin.cluster = split > 0
    return split or ksplit


def expert_groups(top: np.ndarray, rows: int = GROUPED_ROWS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A several-row step's chosen experts ``top`` [M, k] (each row's in increasing order) as the grouped GEMMs
    take them: every (row, slot) sorted by expert, then by row. Returns ``source`` int32 [M * k] (the row each
    sorted position reads), ``position`` int32 [M * k] (where (row, slot) lands, at row * k + slot) and
    ``groups`` int32 [blocks, 3] (expert, first position, count) of at most ``rows`` positions each."""
    k = top.shape[1]
    flat = top.reshape(-1)
    order = np.argsort(flat, kind="stable")  # sorted position -> row * k + slot
    position = np.empty(len(flat), np.int32)
    position[order] = np.arange(len(flat), dtype=np.int32)
    counts = np.bincount(flat, minlength=int(flat.max()) + 1)
    starts = np.cumsum(counts) - counts
    groups = [(e, int(starts[e]) + r, min(rows, int(counts[e]) - r))
              for e in np.nonzero(counts)[0] for r in range(0, int(counts[e]), rows)]
    return (order // k).astype(np.int32), position, np.array(groups, np.int32).reshape(-1, 3)


def grouped_rows(pairs: int, experts: int) -> int:
    """Positions of one grouped GEMM block for ``pairs`` (row, expert) pairs over ``experts`` experts: a
    prefill's experts take tens of rows each, a decode batch's one or two, whose 64-row blocks would be
    almost all padding."""
    return GROUPED_ROWS_FEW if pairs <= GROUPED_ROWS_FEW * experts else GROUPED_ROWS


def group_capacity(pairs: int, experts: int, rows: int = GROUPED_ROWS) -> int:
    """Groups (blocks of the grouped GEMM) that ``pairs`` (row, expert) pairs over ``experts`` experts can need,
    at most: ceil(count / rows) for each chosen expert adds up to no more than this."""
    return -(-pairs // rows) + min(experts, pairs)


def check_expert_table(lins: list[Lin]) -> None:
    """The experts of one table (``ops.expert_table``) share their shape and plan: the launch takes the first's."""
    if len(lins) > EXPERT_TABLE_ROWS:
        raise ValueError(f"{len(lins)} experts in a table of {EXPERT_TABLE_ROWS} rows")
    first = lins[0]
    shape = (first.k, first.n, first.npad, first.group_size, first.bits, first.col, first.ksplit)
    if any((lin.k, lin.n, lin.npad, lin.group_size, lin.bits, lin.col, lin.ksplit) != shape for lin in lins):
        raise ValueError("the experts of a table differ in shape or plan")


def tagged_merge(mode: str, blocks: int, sm_count: int) -> bool:
    """Whether a split M=1 GEMV of ``blocks`` blocks (not a cluster) merges its K splits tagged: each split
    stores tagged partial sums and exits, the tile's last split polls for them; otherwise the last block to
    arrive on an atomic counter reads them back. ``mode``: one of MERGE_MODES, "tagged" or "counter" forcing
    one (tests, benchmarks).

    "auto": grids of more than one wave of resident blocks. Measured on the H200 (docs/performance.md):
    tagged, a split's block frees its SM slot as soon as its sums are stored, so the next wave starts sooner
    (qwen3-8b gate/up 16.5 -> 15.4 us at q8, 12.2 -> 9.9 us at q4); in one wave nothing waits for a slot and
    the fixed last split's polls cost more than the counter (o 6.3 -> 7.2 us at q8)."""
    return mode == "tagged" or (mode == "auto" and blocks > CHUNK_BLOCKS_PER_SM * sm_count)


def gemv_scratch(lins: list[Lin]) -> tuple[int, int, int]:
    """(partial floats, counters, merge tiles) the M=1 GEMVs of these projections need (CupyOps.reserve)."""
    split = [lin for lin in lins if lin.ksplit > 1]
    part = max((lin.ksplit * lin.npad * lin.slots for lin in split), default=1)
    counters = max((lin.tiles * lin.slots for lin in lins), default=1)
    return part, counters, max((lin.tiles for lin in split), default=0)


def attn_rows_splits(blocks: int, slots: int) -> int:
    """Position splits of batched decode attention (attn_rows) whose unsplit grid has ``blocks`` blocks, on a
    GPU that holds ``slots`` of them at once: of 1..ATTN_ROWS_MAX_SPLITS, the one whose grid fills its waves
    best (the fewest on a tie). A function of the batch's size only, so a captured bucket keeps it."""
    def fill(s: int) -> float:
        n = blocks * s
        return n / (-(-n // slots) * slots)
    return max(range(1, ATTN_ROWS_MAX_SPLITS + 1), key=lambda s: (round(fill(s), 3), -s))


def attn_rows_buffers(hdp: int) -> int:
    """Pages of keys and values an attn_rows block of instance ``hdp`` holds in shared memory (attention.cu
    NBUF): ATTN_ROWS_BUFFERS up to 128 (two in flight while one is read), two at 256."""
    return ATTN_ROWS_BUFFERS if hdp <= 128 else 2


def attn_rows_instance(hd: int) -> int:
    """The attn_rows instance that runs head_dim ``hd`` (<= MAX_HEAD_DIM): its dimensions past hd are zero."""
    return next(h for h in ATTN_ROWS_HEAD_DIMS if h >= hd)


def attn_rows_per_sm(smem: int, sm_smem: int, regs: int = 0, sm_regs: int = 65536) -> int:
    """attn_rows blocks one multiprocessor holds at once: its shared memory (1 KiB a block is the driver's),
    its registers (``regs`` a thread, allocated 256 a warp at a time; 0: unknown, not counted) and the
    resident-block limit decide."""
    by_regs = sm_regs // (ATTN_ROWS_WARPS * -(-regs * 32 // 256) * 256) if regs else BLOCKS_PER_SM_MAX
    return min(BLOCKS_PER_SM_MAX, sm_smem // (smem + 1024), by_regs)


def attend_folds(qkv: Lin, capacity: int, clusters: bool) -> bool:
    """Whether a decode step's attention folds into the q|k|v projection's M = 1 GEMV (AttendFold): its K splits
    run as clusters (``clusters``: the device launches them) of at least two blocks, block 0 taking the position
    itself and the others the earlier ones, and the sequence holds at most ATTEND_FOLD_MAX_CONTEXT positions
    (``capacity``): a head's earlier positions are spread over at most 7 blocks there, over ATTN_SPLITS by
    attn_decode, and on an H100 the fold took 3.5 % off a qwen3-8b q8 step at 64-128 positions and was 0.4 %
    slower at 900-964 (docs/performance.md). The cluster planner's grids are one wave of resident blocks, so
    every KV head's tile that a q head's block polls for runs beside it."""
    return clusters and qkv.cluster and qkv.ksplit >= 2 and capacity <= ATTEND_FOLD_MAX_CONTEXT


def attn_part_size(heads: int, hd: int) -> int:
    """Floats of attention scratch: one query row split ATTN_SPLITS ways (attn_decode)."""
    return heads * ATTN_SPLITS * (hd + 2)


def ssq_count(n: int) -> int:
    """Entries of the residual stream's sums of squares for a row of n (one per 32 columns, forward.cuh)."""
    return -(-n // SSQ_COLS)


def head_scale(hd: int) -> float:
    return float(np.float32(1.0 / math.sqrt(hd)))
