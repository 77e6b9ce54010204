"""The CUDA GEMM's host-side choices (gemm.py), no GPU needed: block shapes, K splits and which weights the
split shapes take."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_cuda.gemm import (
    SPLIT_MAX_M,
    DeviceGemm,
    mma_splits,
    mma_tile_for,
    row_stride,
    split_fits,
    split_rows,
    tma_splits,
)
from kestrel_cuda.kernels import (
    MMA_BK,
    MMA_TILE_DEFAULT,
    MMA_TILE_SMALL_GRID,
    MMA_TILE_SPLIT,
    MMA_TILE_SPLIT_SMALL,
    MMA_TILES,
    TMA_TILE,
)
from kestrel_cuda.layout import Geometry
from kestrel_cuda.plan import MAX_CLUSTER


def test_mma_tile_choice() -> None:
    """Qwen3-8B shapes at M=512 on 132 SMs: the 64-row block where the large block's last wave is short."""
    assert MMA_TILES[MMA_TILE_DEFAULT].bm == 128 and MMA_TILES[MMA_TILE_SMALL_GRID].bm == 64
    assert mma_tile_for(512, 4096, 132) == MMA_TILE_DEFAULT       # 128 blocks: one wave, nearly full
    assert mma_tile_for(512, 24576, 132) == MMA_TILE_DEFAULT      # 768 blocks: last wave 108 of 132
    assert mma_tile_for(512, 6144, 132) == MMA_TILE_SMALL_GRID    # 192 blocks: last wave 60 of 132
    assert mma_tile_for(512, 1024, 132) == MMA_TILE_SMALL_GRID    # 32 blocks
    assert mma_tile_for(512, 4096 * 33, 132) == MMA_TILE_DEFAULT  # whole waves only
    assert [mma_tile_for(m, 4096, 132) for m in (2, 16, 17, 64)] == [MMA_TILE_SPLIT_SMALL] * 2 + [MMA_TILE_SPLIT] * 2
    assert MMA_TILES[mma_tile_for(65, 4096, 132)].bm == 64
    # decode batches of weights the split shapes do not take: the unsplit 64-row block
    assert mma_tile_for(8, 4096, 132, k=1120) == mma_tile_for(8, 4104, 132) == MMA_TILE_SMALL_GRID


def test_tensor_copy_block_choice() -> None:
    """17-64 rows of int8 codes at G = 32 run the tensor-copy block where tensor copies are there; 2-16 rows,
    int4 codes, G = 256 and GPUs without them keep the cp.async blocks."""
    gemm = DeviceGemm(cp=None, kernels=None, sm_count=132)
    gemm._clusters, gemm._tma = True, object()  # sm_90 with clusters, the driver's encoder found
    q8, q4, g256 = Geometry(4096, 4096, 128), Geometry(4096, 4096, 128, 4), Geometry(4096, 4096, 16)
    assert [gemm.tile_for(m, q8) for m in (2, 16, 17, 64)] == [MMA_TILE_SPLIT_SMALL] * 2 + [TMA_TILE] * 2
    assert gemm.tile_for(32, q4) == gemm.tile_for(32, g256) == MMA_TILE_SPLIT
    assert gemm.tile_for(65, q8) == mma_tile_for(65, 4096, 132)
    gemm._tma = None
    assert gemm.tile_for(32, q8) == MMA_TILE_SPLIT


def test_split_choice() -> None:
    """Qwen3-8B shapes on 132 SMs: enough K splits for ~2 blocks per SM, whole groups, one cluster at most,
    within the workspace."""
    assert mma_splits(4096, 4096, 32, 132) == (8, 4)       # o: 32 column tiles, 9 wanted, one cluster of 8
    assert mma_splits(12288, 4096, 256, 132) == (8, 12)    # down: splits of whole 256-groups (2 stages)
    assert mma_splits(4096, 6144, 32, 132, 1) == (3, 11)   # q|k|v: 48 tiles, one block per SM
    assert mma_splits(4096, 151936, 32, 132) == (1, 32)    # lm_head: 1187 tiles, no split
    assert mma_splits(4096, 24576, 256, 132, 3) == (2, 16)  # gate|up: 192 tiles, capped by the workspace


def test_tensor_copy_splits_halve_beyond_one_row_block() -> None:
    """From 33 rows the tensor-copy GEMM runs half the split target's K splits (two row blocks, the grid as
    deep as one row block's), rounded up; at 2-32 rows the target's."""
    assert tma_splits(32, 32, 8) == 8
    assert tma_splits(33, 32, 8) == 4  # o, down: clusters of 4 at 64 rows
    assert tma_splits(64, 32, 6) == 3  # q|k|v
    assert tma_splits(64, 32, 2) == 1  # gate|up
    assert tma_splits(64, 32, 1) == 1  # lm_head: no split
    gemm = DeviceGemm(cp=None, kernels=None, sm_count=132)
    qkv = Geometry(4096, 6144, 128)
    assert gemm._grid(32, qkv, TMA_TILE) == (6, 6, (1, 48, 6))
    assert gemm._grid(64, qkv, TMA_TILE) == (3, 11, (2, 48, 3))  # 11, 11 and 10 stages: the longest is short
    assert gemm._grid(64, qkv, TMA_TILE, splits=6) == (6, 6, (2, 48, 6))  # as asked
    assert gemm._grid(64, qkv, MMA_TILE_SPLIT) == (6, 6, (2, 48, 6))  # the cp.async block keeps the target's


def test_split_shapes_take_whole_stages_and_tiles() -> None:
    bn = MMA_TILES[MMA_TILE_SPLIT].bn
    assert MMA_TILES[MMA_TILE_SPLIT_SMALL].bn == bn and MMA_TILES[MMA_TILE_SPLIT].split
    assert split_fits(4096, 151936) and split_fits(MMA_BK, bn)
    assert not split_fits(4096 + 32, 4096) and not split_fits(4096, 4096 + 8)
    for m in (2, SPLIT_MAX_M):
        assert MMA_TILES[mma_tile_for(m, 4096 + 8, 132, 4096)].split is False


def test_splits_fit_one_cluster_in_whole_groups() -> None:
    """Every split count fits one portable cluster; every split is whole groups and holds some of K."""
    for k in (1024, 4096, 12288):
        for npad in (128, 1024, 4096, 6144):
            for g in (32, 256):
                for blocks in (1, 2, 4, 8):
                    nz, per = mma_splits(k, npad, g, 132, blocks)
                    assert 1 <= nz <= MAX_CLUSTER and per * 128 % g == 0 and (nz - 1) * per * MMA_BK < k


def test_rows_past_whole_large_blocks_run_apart() -> None:
    """From 512 rows in whole 128-row blocks, a last 1..64 rows run through the split shapes: a prompt chunk of
    512 tokens beside up to 64 decode rows leaves no padded row block."""
    assert [split_rows(m, 4096, 4096) for m in (512, 513, 543, 576, 577, 600)] == [0, 1, 31, 64, 0, 0]
    assert split_rows(130, 4096, 4096) == 0 and split_rows(64, 4096, 4096) == 0  # under 512 whole rows
    assert split_rows(1024 + 40, 12288, 4096) == 40
    assert split_rows(543, 4096 + 32, 4096) == 0 and split_rows(543, 4096, 4096 + 8) == 0  # not whole stages/tiles


def test_outputs_are_written_with_their_own_row_stride() -> None:
    """A GEMM output is any array whose rows are contiguous: a whole buffer, a column slice of a wider one
    (a fused q|k|v buffer's member: the buffer's width), rows of either; a transposed view is refused."""
    buf = np.zeros((8, 6144), np.float32)
    assert row_stride(buf) == 6144
    assert row_stride(buf[:, 4096:5120]) == row_stride(buf[3:, 4096:5120]) == 6144
    assert row_stride(np.zeros((4, 10), np.float32)) == 10
    with pytest.raises(ValueError, match="contiguous"):
        row_stride(buf.T)
    with pytest.raises(ValueError, match="contiguous"):
        row_stride(buf[:, ::2])
