// Decode GEMV (M <= MT rows per launch): out[m][n] = sum_g (sum_{k in g} A[m][k] W[k][n]) * As[m][g] * Ws[g][n].
//
// Layout: W is K-major, int8 [K][Npad] or int4 packed [K/2][Npad]; Ws float32 [K/G][Npad]; Npad % VEC == 0.
// A block is 4 warps; lane = cl * 8 + kl: 4 column lanes of VEC columns each (BN = 4 * VEC columns per
// block, VEC-byte loads, so a warp reads 4 * VEC contiguous bytes of 8 rows per load) and 8 slice lanes.
// A slice is R consecutive rows of K; each thread sums its slice exactly in int32 (__dp4a on 4x4
// byte-transposed words). When a group of G rows spans several slices (G / R lanes, consecutive in kl),
// their int32 sums are added exactly with shuffles before the one multiply by the scales, so every block
// sum is exact and only the order of the float additions over groups differs from the CPU reference.
// Blocks of blockIdx.y split K; the last block of a column tile to finish adds the partials in a fixed
// order (deterministic, no atomics on data) and re-arms its counter for the next launch.
#define GEMV_WARPS 4
#define GEMV_THREADS (GEMV_WARPS * 32)
#define SLICES_PER_ITER (GEMV_WARPS * 8)

template <int VEC>
__device__ __forceinline__ void load_vec(const u8* __restrict__ p, u32 (&w)[VEC / 4]) {
    if constexpr (VEC == 16) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if constexpr (VEC == 8) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = v.x; w[1] = v.y;
    } else {
        w[0] = __ldg(reinterpret_cast<const u32*>(p));
    }
}

template <int MT, int VEC, int BITS, int R>
__global__ void __launch_bounds__(GEMV_THREADS) k_gemv(
        const i8* __restrict__ A, const float* __restrict__ As, int mcount,
        const u8* __restrict__ W, const float* __restrict__ Ws,
        float* __restrict__ out, int ldo, int N,
        float* __restrict__ partial, unsigned int* __restrict__ counters,
        int K, int Npad, int G) {
    constexpr int BN = 4 * VEC;
    constexpr int NW = VEC / 4;             // words per row per thread
    constexpr int CH = R < 16 ? R : 16;     // rows loaded before use
    __shared__ float red[GEMV_WARPS][MT][BN];
    __shared__ int s_last;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int cl = lane >> 3, kl = lane & 7;
    const int c0 = blockIdx.x * BN + cl * VEC;
    const bool col_ok = c0 < Npad;
    const int ng = K / G;
    const int nslices = K / R;
    const int lpg = G / R;                  // lanes whose slices form one group (1..8, a power of two)

    float facc[MT][VEC];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < VEC; ++j) facc[m][j] = 0.0f;

    for (int base = blockIdx.y * SLICES_PER_ITER; base < nslices; base += gridDim.y * SLICES_PER_ITER) {
        const int s = base + warp * 8 + kl;
        const bool ok = col_ok && s < nslices;
        const int k0 = s * R;
        int acc[MT][VEC];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[m][j] = 0;

#pragma unroll
        for (int h = 0; h < R / CH; ++h) {
            // rows[r][w]: row k0 + h*CH + r, columns c0 + 4w .. 4w+3
            u32 rows[CH][NW];
            if (ok) {
                if constexpr (BITS == 8) {
#pragma unroll
                    for (int r = 0; r < CH; ++r)
                        load_vec<VEC>(W + (size_t)(k0 + h * CH + r) * Npad + c0, rows[r]);
                } else {
#pragma unroll
                    for (int r = 0; r < CH / 2; ++r) {
                        u32 packed[NW];
                        load_vec<VEC>(W + (size_t)((k0 + h * CH) / 2 + r) * Npad + c0, packed);
#pragma unroll
                        for (int w = 0; w < NW; ++w) {
                            rows[2 * r][w] = nib_lo(packed[w]);
                            rows[2 * r + 1][w] = nib_hi(packed[w]);
                        }
                    }
                }
            } else {
#pragma unroll
                for (int r = 0; r < CH; ++r)
#pragma unroll
                    for (int w = 0; w < NW; ++w) rows[r][w] = 0u;
            }
#pragma unroll
            for (int q = 0; q < CH / 4; ++q) {
                int aw[MT];
#pragma unroll
                for (int m = 0; m < MT; ++m)
                    aw[m] = (ok && m < mcount)
                        ? __ldg(reinterpret_cast<const int*>(A + (size_t)m * K + k0 + h * CH + 4 * q)) : 0;
#pragma unroll
                for (int w = 0; w < NW; ++w) {
                    u32 c[4];
                    transpose4x4(rows[4 * q][w], rows[4 * q + 1][w], rows[4 * q + 2][w], rows[4 * q + 3][w],
                                 c[0], c[1], c[2], c[3]);
#pragma unroll
                    for (int m = 0; m < MT; ++m)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[m][4 * w + e] = __dp4a(aw[m], (int)c[e], acc[m][4 * w + e]);
                }
            }
        }
        // exact: integer partial sums of one group, added across its lanes
        for (int o = 1; o < lpg; o <<= 1) {
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[m][j] += __shfl_xor_sync(FULL_MASK, acc[m][j], o);
        }
        if (ok && (kl & (lpg - 1)) == 0) {
            const int g = k0 / G;
            float ws[VEC];
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                const float4 v = __ldg(reinterpret_cast<const float4*>(Ws + (size_t)g * Npad + c0 + 4 * w));
                ws[4 * w] = v.x; ws[4 * w + 1] = v.y; ws[4 * w + 2] = v.z; ws[4 * w + 3] = v.w;
            }
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const float sa = m < mcount ? __ldg(As + (size_t)m * ng + g) : 0.0f;
#pragma unroll
                for (int j = 0; j < VEC; ++j) facc[m][j] += ((float)acc[m][j] * sa) * ws[j];
            }
        }
    }

    // block reduction: 8 slice lanes (shuffles), then 4 warps (shared memory), fixed order
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            float v = facc[m][j];
            v += __shfl_xor_sync(FULL_MASK, v, 1);
            v += __shfl_xor_sync(FULL_MASK, v, 2);
            v += __shfl_xor_sync(FULL_MASK, v, 4);
            if (kl == 0) red[warp][m][cl * VEC + j] = v;
        }
    __syncthreads();
    const int n0 = blockIdx.x * BN;
    if (gridDim.y == 1) {
        for (int t = threadIdx.x; t < MT * BN; t += GEMV_THREADS) {
            const int m = t / BN, col = t - m * BN, n = n0 + col;
            if (m < mcount && n < N) {
                float v = red[0][m][col];
#pragma unroll
                for (int w = 1; w < GEMV_WARPS; ++w) v += red[w][m][col];
                out[(size_t)m * ldo + n] = v;
            }
        }
        return;
    }
    for (int t = threadIdx.x; t < MT * BN; t += GEMV_THREADS) {
        const int m = t / BN, col = t - m * BN, n = n0 + col;
        if (n < Npad) {
            float v = red[0][m][col];
#pragma unroll
            for (int w = 1; w < GEMV_WARPS; ++w) v += red[w][m][col];
            partial[((size_t)blockIdx.y * MT + m) * Npad + n] = v;
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int t = threadIdx.x; t < MT * BN; t += GEMV_THREADS) {
        const int m = t / BN, col = t - m * BN, n = n0 + col;
        if (m < mcount && n < N) {
            float v = __ldcg(partial + (size_t)m * Npad + n);
            for (int y = 1; y < (int)gridDim.y; ++y) v += __ldcg(partial + ((size_t)y * MT + m) * Npad + n);
            out[(size_t)m * ldo + n] = v;
        }
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}
