// Decode GEMV, warp-row layout (the default): out[m][n] = sum_g (sum_{k in g} A[m][k] W[k][n]) As[m][g] Ws[g][n].
//
// A warp's 32 lanes lie along the columns (VEC columns each, VEC-byte loads; int4: 4 * VEC bytes of one row of
// 8-k words), so every load instruction of a warp reads contiguous bytes of one stored row. Each warp of a block
// takes one 32-row slice of K per iteration (8 warps: 256 rows); a thread issues every load of its slice (rows,
// scales, activations) before the first use, so each thread has a whole slice in flight. Block sums are exact
// int32 (__dp4a on 4x4 byte-transposed words, int4 on its unpacked nibbles); for G = 32 a slice is a group and
// the thread scales it itself; for G = 256 the 8 warps' int32 slice sums are added exactly through shared memory
// before the one multiply by the scales.
// Blocks of blockIdx.y split K (interleaved 256-row steps); the last block of a column tile to finish adds
// the partials in a fixed order and re-arms its counter, so the next launch finds it at zero.
#define GW_WARPS 8
#define GW_THREADS 256

template <int MT, int VEC, int BITS>
__global__ void __launch_bounds__(GW_THREADS) k_gemv_warp(
        const i8* __restrict__ A, const float* __restrict__ As, int mcount,
        const u8* __restrict__ W, const float* __restrict__ Ws,
        float* __restrict__ out, int ldo, int N,
        float* __restrict__ partial, unsigned int* __restrict__ counters,
        int K, int Npad, int G) {
    constexpr int BN = 32 * VEC;                  // columns per block
    constexpr int NW = VEC / 4;                   // words per row per thread
    constexpr int PR = BITS == 8 ? 32 : 4;        // stored rows of a 32-row slice (int4: rows of 8-k words)
    constexpr int RW = BITS == 8 ? NW : VEC;      // 32-bit words of a stored row per thread
    constexpr int CPT = (MT * BN + GW_THREADS - 1) / GW_THREADS;  // (m, column) outputs per thread
    __shared__ float red[GW_WARPS][MT][BN];
    __shared__ int s_last;
    int* ired = reinterpret_cast<int*>(&red[0][0][0]);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n0 = blockIdx.x * BN;
    const int c0 = n0 + lane * VEC;
    const bool col_ok = c0 < Npad;
    const int ng = K / G;
    const int nslices = K / 32;
    const bool big = G > 32;

    float facc[MT][VEC];
    float cacc[CPT];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < VEC; ++j) facc[m][j] = 0.0f;
#pragma unroll
    for (int i = 0; i < CPT; ++i) cacc[i] = 0.0f;

    for (int base = blockIdx.y * GW_WARPS; base < nslices; base += gridDim.y * GW_WARPS) {
        const int s = base + warp;
        const bool ok = col_ok && s < nslices;
        const int k0 = s * 32;
        u32 rows[PR][RW];
        int aw[MT][8];
        float ws[VEC], sa[MT];
        if (ok) {
#pragma unroll
            for (int r = 0; r < PR; ++r)
                load_vec<4 * RW>(
                    W + (BITS == 8 ? (size_t)(k0 + r) * Npad + c0 : ((size_t)(k0 / 8 + r) * Npad + c0) * 4), rows[r]);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if (m < mcount) {
                    const uint4 x = __ldg(reinterpret_cast<const uint4*>(A + (size_t)m * K + k0));
                    const uint4 y = __ldg(reinterpret_cast<const uint4*>(A + (size_t)m * K + k0 + 16));
                    aw[m][0] = x.x; aw[m][1] = x.y; aw[m][2] = x.z; aw[m][3] = x.w;
                    aw[m][4] = y.x; aw[m][5] = y.y; aw[m][6] = y.z; aw[m][7] = y.w;
                } else {
#pragma unroll
                    for (int q = 0; q < 8; ++q) aw[m][q] = 0;
                }
            }
            if (!big) {
                const int g = k0 / 32;
#pragma unroll
                for (int w = 0; w < NW; ++w) {
                    const float4 v = __ldg(reinterpret_cast<const float4*>(Ws + (size_t)g * Npad + c0 + 4 * w));
                    ws[4 * w] = v.x; ws[4 * w + 1] = v.y; ws[4 * w + 2] = v.z; ws[4 * w + 3] = v.w;
                }
#pragma unroll
                for (int m = 0; m < MT; ++m) sa[m] = m < mcount ? __ldg(As + (size_t)m * ng + g) : 0.0f;
            }
        } else {
#pragma unroll
            for (int r = 0; r < PR; ++r)
#pragma unroll
                for (int w = 0; w < RW; ++w) rows[r][w] = 0u;
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int q = 0; q < 8; ++q) aw[m][q] = 0;
        }
        int acc[MT][VEC];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[m][j] = 0;
        if constexpr (BITS == 8) {
#pragma unroll
            for (int q = 0; q < 8; ++q) {
#pragma unroll
                for (int w = 0; w < NW; ++w) {
                    u32 c[4];
                    transpose4x4(rows[4 * q][w], rows[4 * q + 1][w], rows[4 * q + 2][w], rows[4 * q + 3][w],
                                 c[0], c[1], c[2], c[3]);
#pragma unroll
                    for (int m = 0; m < MT; ++m)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            acc[m][4 * w + e] = __dp4a(aw[m][q], (int)c[e], acc[m][4 * w + e]);
                }
            }
        } else {  // word j of row r: k0 + 8r .. k0 + 8r + 7 of column j
#pragma unroll
            for (int r = 0; r < PR; ++r)
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const int lo = (int)nib_lo(rows[r][j]), hi = (int)nib_hi(rows[r][j]);
#pragma unroll
                    for (int m = 0; m < MT; ++m)
                        acc[m][j] = __dp4a(aw[m][2 * r + 1], hi, __dp4a(aw[m][2 * r], lo, acc[m][j]));
                }
        }
        if (!big) {
            if (ok) {
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int j = 0; j < VEC; ++j) facc[m][j] += ((float)acc[m][j] * sa[m]) * ws[j];
            }
        } else {  // G = 256: this block-iteration's 8 slices are one group (base is a multiple of 8)
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int j = 0; j < VEC; ++j) ired[(warp * MT + m) * BN + lane * VEC + j] = acc[m][j];
            __syncthreads();
            const int g = (base * 32) / G;
#pragma unroll
            for (int i = 0; i < CPT; ++i) {
                const int t = threadIdx.x + GW_THREADS * i;
                const int m = t / BN, col = t - m * BN, n = n0 + col;
                if (t < MT * BN && m < mcount && n < Npad) {
                    int sum = 0;
#pragma unroll
                    for (int w = 0; w < GW_WARPS; ++w) sum += ired[(w * MT + m) * BN + col];
                    cacc[i] += ((float)sum * __ldg(As + (size_t)m * ng + g)) * __ldg(Ws + (size_t)g * Npad + n);
                }
            }
            __syncthreads();
        }
    }

    if (!big) {  // fold the 8 warps' float sums, fixed order
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int j = 0; j < VEC; ++j) red[warp][m][lane * VEC + j] = facc[m][j];
        __syncthreads();
#pragma unroll
        for (int i = 0; i < CPT; ++i) {
            const int t = threadIdx.x + GW_THREADS * i;
            if (t < MT * BN) {
                const int m = t / BN, col = t - m * BN;
                float v = red[0][m][col];
#pragma unroll
                for (int w = 1; w < GW_WARPS; ++w) v += red[w][m][col];
                cacc[i] = v;
            }
        }
    }
    if (gridDim.y == 1) {
#pragma unroll
        for (int i = 0; i < CPT; ++i) {
            const int t = threadIdx.x + GW_THREADS * i;
            const int m = t / BN, col = t - m * BN, n = n0 + col;
            if (t < MT * BN && m < mcount && n < N) out[(size_t)m * ldo + n] = cacc[i];
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
        const int t = threadIdx.x + GW_THREADS * i;
        const int m = t / BN, col = t - m * BN, n = n0 + col;
        if (t < MT * BN && n < Npad) partial[((size_t)blockIdx.y * MT + m) * Npad + n] = cacc[i];
    }
    if (!arrive_last(reinterpret_cast<int*>(counters) + blockIdx.x, gridDim.y, &s_last)) return;
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
        const int t = threadIdx.x + GW_THREADS * i;
        const int m = t / BN, col = t - m * BN, n = n0 + col;
        if (t < MT * BN && m < mcount && n < N) {
            float v = __ldcg(partial + (size_t)m * Npad + n);
            for (int y = 1; y < (int)gridDim.y; ++y) v += __ldcg(partial + ((size_t)y * MT + m) * Npad + n);
            out[(size_t)m * ldo + n] = v;
        }
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}
