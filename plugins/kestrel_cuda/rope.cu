// qkv_rope: per-head norms and RoPE of the q|k|v rows, keys and values into the KV cache (rope.cuh).

// Per head of the qkv rows: optional per-head rmsnorm (Qwen3 q_norm/k_norm), RoPE (rotate_half) at the
// absolute position meta[0] + m, then q -> qout [M][H*hd] and k, v -> this layer's cache at that position.
// With ``rows`` (a batch of sequences), row m is at position rows[2m] of the sequence whose page table is
// tables[rows[2m + 1]] (tb entries a table), and its k, v go to the paged pool.
// One warp per head (4 per block), no block barriers. Grid: x = ceil((H + 2 KV) / 4), y = M; hd <= 128.
// At M = 1 with hd == TN the q|k|v GEMV does this in its epilogue instead (qgemv's qr), one head a tile.
#define RW 4
extern "C" __global__ void __launch_bounds__(RW * 32) qkv_rope(
    const float* __restrict__ qkv, int ldqkv, int H, int KV, int hd,
    const float* __restrict__ qnorm, const float* __restrict__ knorm, float eps,
    const float* __restrict__ cosT, const float* __restrict__ sinT, const int* __restrict__ meta,
    float* __restrict__ qout, kv_t* __restrict__ kc, kv_t* __restrict__ vc, int cap,
    const int* __restrict__ rows, const int* __restrict__ tables, int tb)
{
    grid_dep_launch();
    grid_dep_wait();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = blockIdx.x * RW + warp, m = blockIdx.y;
    if (head >= H + 2 * KV) return;
    const QkvRope qr = {qnorm, knorm, cosT, sinT, meta, qout + (size_t)m * H * hd, kc, vc, H, KV, cap, eps};
    const int pos = rows ? rows[2 * m] : meta[0] + m;
    const int slot = kv_slot(rows ? tables + (size_t)rows[2 * m + 1] * tb : nullptr, pos);
    const float* src = qkv + (size_t)m * ldqkv + (size_t)head * hd;
    if (hd <= 128) rope_head<2>(qr, src, head, hd, slot, lane, rope_lane<2>(qr, head, hd, pos, lane));
    else rope_head<4>(qr, src, head, hd, slot, lane, rope_lane<4>(qr, head, hd, pos, lane));
}
#undef RW
