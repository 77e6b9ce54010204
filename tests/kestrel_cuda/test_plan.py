"""The whole-step forward's planners (``kestrel_cuda.plan``) for the GPU they were measured on (132 SMs, the
H200): K splits, clusters, merges, decode attention's splits and shared memory, expert groups. Pure functions of
shapes and the SM count, so checked on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_cuda import plan
from kestrel_cuda.layout import pad_n


def test_attn_rows_splits_fill_whole_waves() -> None:
    """396 slots (132 SMs x 3 blocks): 32 rows x 8 KV heads (256 blocks) split 3 ways fill 768 of 792; 48 rows
    (384 blocks) need no split; a small batch takes the most splits."""
    assert plan.attn_rows_splits(256, 396) == 3
    assert plan.attn_rows_splits(512, 396) == 3
    assert plan.attn_rows_splits(384, 396) == 1
    assert plan.attn_rows_splits(16, 396) == plan.ATTN_ROWS_MAX_SPLITS


def test_attn_rows_instances_and_residency() -> None:
    """A head_dim runs in the smallest power-of-two instance holding it, with three page buffers up to 128 and
    two at 256; the H200's 228 KiB hold 4 blocks of qwen3-8b's (hd 128, 4 heads: 54,400 bytes), 3 of hd 256,
    and never more than 32; 255 and 168 registers a thread leave room for 4 and 6 in the 64 K registers."""
    from kestrel_cuda.ops_cupy import _attn_rows_smem

    assert [plan.attn_rows_instance(hd) for hd in (16, 32, 36, 64, 96, 128, 200, 256)] == [
        16, 32, 64, 64, 128, 128, 256, 256]
    with pytest.raises(StopIteration):
        plan.attn_rows_instance(plan.MAX_HEAD_DIM + 4)
    assert [plan.attn_rows_buffers(h) for h in plan.ATTN_ROWS_HEAD_DIMS] == [3, 3, 3, 3, 2]
    assert _attn_rows_smem(128, 4) == 54_400
    assert plan.attn_rows_per_sm(_attn_rows_smem(128, 4), 233_472) == 4
    assert plan.attn_rows_per_sm(_attn_rows_smem(256, 2), 233_472) == 3
    assert plan.attn_rows_per_sm(4096, 233_472) == plan.BLOCKS_PER_SM_MAX
    assert plan.attn_rows_per_sm(_attn_rows_smem(64, 4), 233_472) == 7
    assert plan.attn_rows_per_sm(_attn_rows_smem(64, 4), 233_472, regs=255) == 4  # 2 warps x 8,192
    assert plan.attn_rows_per_sm(_attn_rows_smem(64, 4), 233_472, regs=168) == 6


def test_plan_ksplit_fills_the_gpu_without_exceeding_chunks() -> None:
    lin = plan.Lin(None, None, 4096, 4096, 4096, 32, 8)
    assert plan.plan_ksplit(lin, 1056) == 16  # 32 tiles x 16 chunks
    big = plan.Lin(None, None, 4096, 151936, 151936, 32, 8)
    assert plan.plan_ksplit(big, 1056) == 1
    down = plan.Lin(None, None, 12288, 4096, 4096, 32, 8)
    assert plan.plan_ksplit(down, 1056) == 33


@pytest.mark.parametrize("bits", (8, 4))
def test_plan_ksplit_prefers_an_even_split_of_two_chunks_or_more(bits: int) -> None:
    """qwen3-8b on 132 SMs: the fused gate|up (192 tiles, 16 chunks) wants 6 splits, which leave some blocks a
    third chunk: 8 splits of 2 each instead; the unfused gate/up (96 tiles) wants 11, and no even split above
    it keeps 2 chunks a block: 11."""
    fused = plan.Lin(None, None, 4096, 24576, 24576, 32, bits)
    assert (fused.tiles, fused.chunks, plan.plan_ksplit(fused, 1056)) == (192, 16, 8)
    assert plan.plan_split(fused, 132) == 8
    unfused = plan.Lin(None, None, 4096, 12288, 12288, 32, bits)
    assert plan.plan_ksplit(unfused, 1056) == 11
    assert plan.plan_ksplit(fused, 192 * 3) == 4  # 3 wanted: 4 of 4 chunks


@pytest.mark.parametrize("k,n,bits,cluster", [(4096, 6144, 4, 8), (4096, 4096, 4, 0), (4096, 24576, 4, 0),
                                              (12288, 4096, 4, 0), (4096, 6144, 8, 8), (4096, 4096, 8, 0),
                                              (12288, 4096, 8, 0), (4096, 151936, 4, 0), (3840, 8192, 8, 5),
                                              (3840, 8192, 4, 5), (4096, 3840, 8, 0)])
def test_cluster_splits_only_within_one_wave(k: int, n: int, bits: int, cluster: int) -> None:
    """Qwen3-8B's projections on 132 SMs (256-row chunks at both widths): q|k|v runs as clusters of 8 splits
    (two chunks a block, 384 blocks: more than half the wave), o does not (256 blocks); gate|up, down and
    lm_head keep the planner's splits and the global merge. Gemma 3 12B's q|k|v (15 chunks, which 8 splits
    would share unevenly) runs 5 as clusters of three chunks a block (320 blocks); its o (240 blocks at 8
    splits) keeps the planner's 16."""
    lin = plan.Lin(None, None, k, n, pad_n(n), 32, bits)
    free = plan.plan_split(lin, 132)
    assert not lin.cluster
    split = plan.plan_split(lin, 132, clusters=True)
    assert lin.cluster == (cluster > 0)
    assert split == (cluster or free)
    if lin.cluster:
        blocks = lin.tiles * split
        assert blocks <= 4 * 132 and (lin.chunks <= split or (2 * blocks > 4 * 132 and lin.chunks % split == 0
                                                              and lin.chunks <= 3 * split))


def test_attention_folds_into_q_k_v_only_as_clusters_and_for_short_contexts() -> None:
    """Qwen3-30B-A3B's q|k|v on 132 SMs (2048 -> 32 + 2 x 4 heads of 128): clusters of 8 splits, so its decode
    attention folds in up to ATTEND_FOLD_MAX_CONTEXT positions of capacity; without clusters, or beyond, it does
    not."""
    lin = plan.Lin(None, None, 2048, 5120, 5120, 32, 8)
    lin.ksplit = plan.plan_split(lin, 132, clusters=True)
    assert lin.cluster and lin.ksplit == 8
    assert plan.attend_folds(lin, plan.ATTEND_FOLD_MAX_CONTEXT, clusters=True)
    assert not plan.attend_folds(lin, plan.ATTEND_FOLD_MAX_CONTEXT + 1, clusters=True)
    assert not plan.attend_folds(lin, 64, clusters=False)
    lin.ksplit = plan.plan_split(lin, 132)
    assert not plan.attend_folds(lin, 64, clusters=True)


@pytest.mark.parametrize("k,n,slots,free,cluster", [(2048, 1536, 8, 8, 4), (768, 2048, 8, 3, 3),
                                                      (4096, 28672, 2, 4, 0)])
def test_routed_experts_cluster_by_the_whole_grid(k: int, n: int, slots: int, free: int, cluster: int) -> None:
    """Routed experts on 132 SMs. Qwen3-30B-A3B's 8 slots: down (16 tiles x 3 splits x 8 = 384 blocks, a chunk
    each) runs a cluster a tile and slot; gate|up, whose planned 8 splits (768 blocks) are beyond one wave, runs
    4 splits of two chunks as clusters (384 blocks). Mixtral's gate|up (224 tiles, 2 slots) has no one-wave
    split of at most three chunks a block and keeps the counters' merge."""
    lin = plan.Lin(None, None, k, n, pad_n(n), 32, 8)
    assert plan.plan_routed(lin, slots, 132) == free and not lin.cluster
    split = plan.plan_routed(lin, slots, 132, clusters=True)
    assert lin.cluster == (cluster > 0) and split == (cluster or free)
    if lin.cluster:
        assert lin.tiles * split * slots <= 4 * 132 and lin.chunks % split == 0 and lin.chunks <= 3 * split


def test_narrow_projections_run_one_wave_of_k_splits() -> None:
    """qwen3-8b's down (32 column tiles) on 132 SMs: one wave of 16 splits instead of the two-wave target's 33;
    wider projections keep the target; an explicit target wins."""
    sm, resident = 132, plan.CHUNK_BLOCKS_PER_SM * 132
    for bits in (8, 4):
        down = plan.Lin(None, None, 12288, 4096, 4096, 32, bits)
        assert plan.plan_split(down, sm) == 16 and down.tiles * 16 <= resident
        assert plan.plan_split(down, sm, target_blocks=8 * sm) == min(down.chunks, 33)
        gate_up = plan.Lin(None, None, 4096, 24576, 24576, 32, bits)
        assert plan.plan_split(gate_up, sm) == plan.plan_ksplit(gate_up, 8 * sm)
    qkv = plan.Lin(None, None, 4096, 6144, 6144, 32, 8)  # one wave would be 11 splits: the target's 16
    assert plan.plan_split(qkv, sm) == 16


@pytest.mark.parametrize("mode,blocks,tagged", [("auto", 1056, True), ("auto", 528, False), ("auto", 529, True),
                                                ("counter", 1056, False), ("tagged", 64, True)])
def test_split_merge_is_tagged_only_beyond_one_wave(mode: str, blocks: int, tagged: bool) -> None:
    """By default ("auto") split GEMVs of more than one wave (4 blocks per SM, 132 SMs) merge tagged, one wave
    through the counter; "tagged" / "counter" (CupyOps(merge=...)) force one."""
    assert plan.tagged_merge(mode, blocks, 132) is tagged


def test_k_splits_never_exceed_the_merge_slots() -> None:
    """A tile's tagged merge slots hold MERGE_SPLITS splits: the planner stays within them at any K."""
    for k in (4096, 32768, 65536):
        lin = plan.Lin(None, None, k, 128, 128, 32, 8)  # one tile, K / 256 chunks
        assert plan.plan_split(lin, 132) <= plan.MERGE_SPLITS
        assert plan.plan_ksplit(lin, 10**6) == min(lin.chunks, plan.MERGE_SPLITS)


def test_expert_groups_sort_each_rows_experts_into_blocks() -> None:
    """Every (row, slot) once, sorted by expert then row; blocks of one expert and at most ``rows``."""
    rng = np.random.default_rng(2)
    top = np.sort(np.stack([rng.choice(9, 3, replace=False) for _ in range(30)]), axis=1)
    source, position, groups = plan.expert_groups(top, rows=4)
    flat = top.reshape(-1)
    assert sorted(position.tolist()) == list(range(90))
    assert np.array_equal(source[position], np.repeat(np.arange(30), 3))
    experts = flat[np.argsort(position)]
    assert np.all(np.diff(experts) >= 0)
    assert groups[:, 2].max() <= 4 and groups[:, 2].sum() == 90
    for e, first, rows in groups:
        assert np.all(experts[first:first + rows] == e)
        assert np.all(np.diff(source[first:first + rows]) > 0)


def test_grouped_blocks_are_small_for_a_decode_batch_and_large_for_a_prefill() -> None:
    """Qwen3-30B-A3B (8 of 128 experts): up to 256 decode rows (at most 16 pairs an expert on average) take
    blocks of 16 positions; a 512-token prefill chunk's (32 an expert) blocks of 64."""
    assert plan.grouped_rows(32 * 8, 128) == plan.grouped_rows(256 * 8, 128) == 16
    assert plan.grouped_rows(257 * 8, 128) == plan.grouped_rows(512 * 8, 128) == 64


def test_an_expert_table_holds_experts_of_one_shape_up_to_its_rows() -> None:
    """A routed GEMV reads every expert's weights through the first's shape and plan, from a table of
    EXPERT_TABLE_ROWS rows: another shape, or more experts than rows, is refused."""
    def lin(n: int = 96) -> plan.Lin:
        return plan.Lin(None, None, 2048, n, pad_n(n), 32, 8)

    plan.check_expert_table([lin() for _ in range(plan.EXPERT_TABLE_ROWS)])
    with pytest.raises(ValueError, match="differ"):
        plan.check_expert_table([lin(), lin(128)])
    with pytest.raises(ValueError, match="rows"):
        plan.check_expert_table([lin() for _ in range(plan.EXPERT_TABLE_ROWS + 1)])


def test_a_folded_router_gives_the_routers_logits_on_the_residual_after_the_o_projection() -> None:
    """(fold · [h | Q(a)]) / rms(h') is rmsnorm(h', norm) · router for h' = h + W_o Q(a), in float64 from the
    contract's own dequantization and activation codes; a fold without the norm's weights is not."""
    from kestrel_core.contract import StripCache, quantize_activations

    rng = np.random.default_rng(5)
    d, k, e = 64, 96, 10
    codes = rng.integers(-127, 128, (d, k)).astype(np.int8)
    o = StripCache(codes, rng.uniform(0.01, 0.02, (d, k // 32)).astype(np.float32), 32, 8)
    router = rng.standard_normal((e, d)).astype(np.float32)
    norm = (1 + 0.5 * rng.standard_normal(d)).astype(np.float32)
    h, a = rng.standard_normal(d), rng.standard_normal((1, k)).astype(np.float32)
    a_codes, scales = quantize_activations(a, 32)
    qa = (a_codes.reshape(-1, 32) * scales.reshape(-1, 1).astype(np.float64)).reshape(-1)
    h1 = h + o.dequantize().astype(np.float64) @ qa
    rms = np.sqrt(np.mean(h1 * h1) + 1e-6)
    want = (h1 / rms * norm) @ router.T.astype(np.float64)
    fold = plan.route_fold_weights(router, norm, o)
    assert fold.shape == (e, d + k) and fold.dtype == np.float32
    np.testing.assert_allclose(fold @ np.concatenate([h, qa]) / rms, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    unnormed = plan.route_fold_weights(router, np.ones(d, np.float32), o)
    assert not np.allclose(unnormed @ np.concatenate([h, qa]) / rms, want, rtol=1e-2)


def test_a_folded_routers_span_is_its_k_split_of_the_whole_row() -> None:
    """A fold block sums (D + K) / splits of [h | a]: qwen3-30b-a3b's o (D 2048, K 4096, 16 splits) 384;
    none where the splits do not divide it into multiples of 64 up to 512, or D is not whole groups of 32."""
    assert plan.route_fold_span(2048, 4096, 16) == 384
    assert plan.route_fold_span(64, 64, 1) == 128
    assert plan.route_fold_span(2048, 4096, 8) == 0  # 768 > 512
    assert plan.route_fold_span(2048, 2048, 3) == 0
    assert plan.route_fold_span(48, 80, 1) == 0  # D not whole groups
    assert plan.route_fold_span(4096, 2048, 16) == 384
