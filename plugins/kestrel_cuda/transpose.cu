// Upload layout kernels: strip-cache [R][C] (R = N output rows, C = K) -> K-major at column col_off of a
// buffer of ldo columns (Npad, or NG for a fused buffer), tiled 32x32 through shared memory with a +1 pad
// against bank conflicts. The caller zeroes the padding columns. Block: 32 x blockDim.y threads.
#define TT 32

// t[j][i] = in[y0 + j][x0 + i] (inside R x C)
template <typename T>
__device__ __forceinline__ void load_tile(const T* __restrict__ in, int R, int C, T (&t)[TT][TT + 1]) {
    const int x = blockIdx.x * TT + threadIdx.x;
    const int y0 = blockIdx.y * TT;
    for (int j = threadIdx.y; j < TT; j += blockDim.y) {
        const int y = y0 + j;
        if (x < C && y < R) t[j][threadIdx.x] = in[(size_t)y * C + x];
    }
    __syncthreads();
}

// int8 codes and float32 scales: [R][C] -> [C][ldo]
template <typename T>
__global__ void k_transpose(const T* __restrict__ in, T* __restrict__ out, int R, int C, int ldo, int col_off) {
    __shared__ T t[TT][TT + 1];
    load_tile(in, R, C, t);
    for (int j = threadIdx.y; j < TT; j += blockDim.y) {
        const int ro = blockIdx.x * TT + j;         // output row = input column
        const int co = blockIdx.y * TT + threadIdx.x;  // output column = input row
        if (ro < C && co < R) out[(size_t)ro * ldo + col_off + co] = t[threadIdx.x][j];
    }
}

// int4 codes in -8..7: [R][C] -> words [C/8][ldo] (common.cuh's layout): word (kw, n) byte b =
// (w[n][8kw + b] + 8) | (w[n][8kw + 4 + b] + 8) << 4. C is a multiple of 32 (K % G == 0), so a tile holds
// whole words.
extern "C" __global__ void k_transpose_pack4(const i8* __restrict__ in, u32* __restrict__ out,
                                             int R, int C, int ldo, int col_off) {
    __shared__ i8 t[TT][TT + 1];
    load_tile(in, R, C, t);
    for (int j = threadIdx.y; j < TT / 8; j += blockDim.y) {
        const int kw = blockIdx.x * (TT / 8) + j;      // output word row: input columns 8kw .. 8kw + 7
        const int co = blockIdx.y * TT + threadIdx.x;
        if (8 * kw < C && co < R) {
            u32 word = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const u32 lo = (t[threadIdx.x][8 * j + b] + 8) & 0xF;
                const u32 hi = (t[threadIdx.x][8 * j + 4 + b] + 8) & 0xF;
                word |= (lo | (hi << 4)) << (8 * b);
            }
            out[(size_t)kw * ldo + col_off + co] = word;
        }
    }
}
