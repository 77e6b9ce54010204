// finish_logits: Granite's logits divisor and Gemma 2's final soft cap, where a model has them; lm_finish: the
// decode step's greedy token, on the device (the pipelined greedy decode); argmax_rows: the greedy tokens of a
// batched step's rows.

// Logits [rows][N] (row stride ldx) in place, the CPU decoder's order: divided by ``div`` (1: unchanged), then
// soft-capped by ``cap`` (soft_cap; 0: none). Grid: x = blocks of 256 columns, y = rows. It runs right after
// lm_head's projection, so lm_finish, argmax_rows and the host all see the finished logits.
extern "C" __global__ void finish_logits(float* __restrict__ x, int ldx, int N, float div, float cap)
{
    grid_dep_launch();
    grid_dep_wait();
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    float* p = x + (size_t)blockIdx.y * ldx + n;
    float v = *p;
    if (div != 1.f) v = v / div;
    if (cap > 0.f) v = soft_cap(v, cap);
    *p = v;
}

// The decode step's last kernel: the greedy token of the logits row, numpy's argmax (the first index of the
// largest logit; a NaN counts as largest). Each block reduces FIN_T * FIN_E columns to (value, index) in
// bval / bidx; the last block to arrive reduces those and writes meta[1] = token (the next step's input),
// meta[0] += 1 (its position) while below limit (the KV capacity: a graph replayed without a new position
// never writes past the cache), tokens[position % ntok] = token (pinned host memory, which the host reads
// once the step's event has completed: the pipelined greedy decode of forward.py).
#define FIN_T 256
#define FIN_E 4
__device__ __forceinline__ bool argmax_beats(float va, int ia, float vb, int ib) {
    const bool na = va != va, nb = vb != vb;
    if (na || nb) return na && (!nb || ia < ib);
    return va > vb || (va == vb && ia < ib);
}

__device__ __forceinline__ void block_argmax(float& v, int& i, float* s_v, int* s_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, v, o);
        const int oi = __shfl_down_sync(0xffffffffu, i, o);
        if (argmax_beats(ov, oi, v, i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (lane == 0) { s_v[warp] = v; s_i[warp] = i; }
    __syncthreads();
    v = s_v[0]; i = s_i[0];
    for (int w = 1; w < FIN_T / 32; ++w)
        if (argmax_beats(s_v[w], s_i[w], v, i)) { v = s_v[w]; i = s_i[w]; }
}

// This thread's best (value bv, index bi) of its FIN_E columns of block blockIdx.x's FIN_T * FIN_E in x [N],
// their loads all in flight at once; returns whether one of them is a NaN or an infinity.
__device__ __forceinline__ bool block_columns(const float* __restrict__ x, int N, float& bv, int& bi) {
    float v[FIN_E];
#pragma unroll
    for (int e = 0; e < FIN_E; ++e) {
        const int n = (blockIdx.x * FIN_E + e) * FIN_T + threadIdx.x;
        v[e] = n < N ? __ldcg(x + n) : 0.f;
    }
    bv = NEG_INF;
    bi = 0x7fffffff;
    bool bad = false;
#pragma unroll
    for (int e = 0; e < FIN_E; ++e) {
        const int n = (blockIdx.x * FIN_E + e) * FIN_T + threadIdx.x;
        if (n >= N) continue;
        bad |= (__float_as_uint(v[e]) & 0x7f800000u) == 0x7f800000u;  // exponent all ones: inf or NaN
        if (argmax_beats(v[e], n, bv, bi)) { bv = v[e]; bi = n; }
    }
    return bad;
}

extern "C" __global__ void __launch_bounds__(FIN_T) lm_finish(
    const float* __restrict__ logits, int N, float* __restrict__ bval, int* __restrict__ bidx,
    int* __restrict__ counter, int* __restrict__ meta, int limit, int* __restrict__ tokens, int ntok)
{
    grid_dep_launch();
    grid_dep_wait();
    __shared__ float s_v[FIN_T / 32];
    __shared__ int s_i[FIN_T / 32];
    __shared__ int s_last;
    const int tid = threadIdx.x;
    float bv;
    int bi;
    block_columns(logits, N, bv, bi);
    block_argmax(bv, bi, s_v, s_i);
    if (tid == 0) { bval[blockIdx.x] = bv; bidx[blockIdx.x] = bi; }
    if (!arrive_last(counter, gridDim.x, &s_last)) return;
    bv = NEG_INF;
    bi = 0x7fffffff;
    for (int b = tid; b < (int)gridDim.x; b += FIN_T) {
        const float ov = __ldcg(bval + b);
        const int oi = __ldcg(bidx + b);
        if (argmax_beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    block_argmax(bv, bi, s_v, s_i);
    if (tid == 0) {
        *counter = 0;
        const int pos = meta[0];
        meta[1] = bi;
        if (pos + 1 < limit) meta[0] = pos + 1;
        volatile int* t = tokens;
        t[pos % ntok] = bi;
    }
}

// The greedy token of each row of logits [rows][N] (grid: column blocks x rows), numpy's argmax as above, or -1
// for a row holding a NaN or an infinity (the engine declines such a step, as it does non-finite logits). Each
// block leaves its (value, index, non-finite) in bval / bidx / bbad [rows][gridDim.x]; the row's last block to
// arrive on counter[row] (then reset) reduces them into ids[row].
extern "C" __global__ void __launch_bounds__(FIN_T) argmax_rows(
    const float* __restrict__ logits, int N, float* __restrict__ bval, int* __restrict__ bidx,
    int* __restrict__ bbad, int* __restrict__ counter, int* __restrict__ ids)
{
    __shared__ float s_v[FIN_T / 32];
    __shared__ int s_i[FIN_T / 32];
    __shared__ int s_last;
    grid_dep_launch();
    grid_dep_wait();
    const int tid = threadIdx.x, row = blockIdx.y, nb = gridDim.x;
    float bv;
    int bi;
    int bad = __syncthreads_or(block_columns(logits + (size_t)row * N, N, bv, bi));
    block_argmax(bv, bi, s_v, s_i);
    if (tid == 0) {
        bval[row * nb + blockIdx.x] = bv;
        bidx[row * nb + blockIdx.x] = bi;
        bbad[row * nb + blockIdx.x] = bad;
    }
    if (!arrive_last(counter + row, nb, &s_last)) return;
    bv = NEG_INF;
    bi = 0x7fffffff;
    bad = 0;
    for (int b = tid; b < nb; b += FIN_T) {
        const float ov = __ldcg(bval + row * nb + b);
        const int oi = __ldcg(bidx + row * nb + b);
        bad |= __ldcg(bbad + row * nb + b);
        if (argmax_beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    bad = __syncthreads_or(bad);
    block_argmax(bv, bi, s_v, s_i);
    if (tid == 0) {
        counter[row] = 0;
        ids[row] = bad ? -1 : bi;
    }
}
#undef FIN_T
#undef FIN_E
