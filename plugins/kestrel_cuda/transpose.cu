// Upload layout kernels: strip-cache [R][C] (R = N output rows, C = K) -> K-major [C][ldo] at column col_off,
// tiled 32x32 through shared memory with a +1 pad against bank conflicts. ldo = Npad (or NG for a fused
// buffer); the caller zeroes the padding columns.
#define TT 32

extern "C" __global__ void k_transpose_i8(const i8* __restrict__ in, i8* __restrict__ out,
                                          int R, int C, int ldo, int col_off) {
    __shared__ i8 t[TT][TT + 1];
    const int x = blockIdx.x * TT + threadIdx.x;  // input column (k)
    const int y0 = blockIdx.y * TT;               // first input row (n)
    for (int j = threadIdx.y; j < TT; j += blockDim.y) {
        const int y = y0 + j;
        if (x < C && y < R) t[j][threadIdx.x] = in[(size_t)y * C + x];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < TT; j += blockDim.y) {
        const int ro = blockIdx.x * TT + j;  // output row = input column
        const int co = y0 + threadIdx.x;     // output column = input row
        if (ro < C && co < R) out[(size_t)ro * ldo + col_off + co] = t[threadIdx.x][j];
    }
}

extern "C" __global__ void k_transpose_f32(const float* __restrict__ in, float* __restrict__ out,
                                           int R, int C, int ldo, int col_off) {
    __shared__ float t[TT][TT + 1];
    const int x = blockIdx.x * TT + threadIdx.x;
    const int y0 = blockIdx.y * TT;
    for (int j = threadIdx.y; j < TT; j += blockDim.y) {
        const int y = y0 + j;
        if (x < C && y < R) t[j][threadIdx.x] = in[(size_t)y * C + x];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < TT; j += blockDim.y) {
        const int ro = blockIdx.x * TT + j;
        const int co = y0 + threadIdx.x;
        if (ro < C && co < R) out[(size_t)ro * ldo + col_off + co] = t[threadIdx.x][j];
    }
}

// int4: [R][C] codes in -8..7 -> [C/2][ldo] bytes, byte (kp, n) = (w[n][2kp] + 8) | (w[n][2kp+1] + 8) << 4.
// C is a multiple of 32 (K % G == 0), so a tile never splits a row pair.
extern "C" __global__ void k_transpose_pack4(const i8* __restrict__ in, u8* __restrict__ out,
                                             int R, int C, int ldo, int col_off) {
    __shared__ i8 t[TT][TT + 1];
    const int x = blockIdx.x * TT + threadIdx.x;
    const int y0 = blockIdx.y * TT;
    for (int j = threadIdx.y; j < TT; j += blockDim.y) {
        const int y = y0 + j;
        if (x < C && y < R) t[j][threadIdx.x] = in[(size_t)y * C + x];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < TT / 2; j += blockDim.y) {
        const int kp = blockIdx.x * (TT / 2) + j;  // output packed row: input columns 2kp, 2kp+1
        const int co = y0 + threadIdx.x;
        if (2 * kp < C && co < R) {
            const int lo = (t[threadIdx.x][2 * j] + 8) & 0xF;
            const int hi = (t[threadIdx.x][2 * j + 1] + 8) & 0xF;
            out[(size_t)kp * ldo + col_off + co] = (u8)(lo | (hi << 4));
        }
    }
}
