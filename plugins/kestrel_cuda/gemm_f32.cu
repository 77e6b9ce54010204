// Float-activation GEMM: out[m][n] = sum_g Ws[g][n] * sum_{k in g} A[m][k] * W[k][n] (float32 block sums,
// accumulated in k order; the groups in order). Simple on purpose: one thread per 4 columns x 4 rows; the
// engine's hot path is the int8 one.
#define F32_THREADS 128
#define F32_MT 4

template <int BITS>
__global__ void __launch_bounds__(F32_THREADS) k_gemm_f32(
        const float* __restrict__ A, int M,
        const u8* __restrict__ W, const float* __restrict__ Ws,
        float* __restrict__ out, int ldo, int N, int K, int Npad, int G) {
    const int n = 4 * (blockIdx.x * F32_THREADS + threadIdx.x);
    const int m0 = blockIdx.y * F32_MT;
    if (n >= Npad) return;
    const int ng = K / G;
    float facc[F32_MT][4];
#pragma unroll
    for (int m = 0; m < F32_MT; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) facc[m][j] = 0.0f;
    for (int g = 0; g < ng; ++g) {
        float bs[F32_MT][4];
#pragma unroll
        for (int m = 0; m < F32_MT; ++m)
#pragma unroll
            for (int j = 0; j < 4; ++j) bs[m][j] = 0.0f;
        for (int k = g * G; k < (g + 1) * G; ++k) {
            float w[4];
            if constexpr (BITS == 8) {
                const u32 word = __ldg(reinterpret_cast<const u32*>(W + (size_t)k * Npad + n));
#pragma unroll
                for (int j = 0; j < 4; ++j) w[j] = (float)(i8)(word >> (8 * j));
            } else {  // the 8-k words of columns n..n+3; k's nibble
                const uint4 v = __ldg(reinterpret_cast<const uint4*>(W + ((size_t)(k >> 3) * Npad + n) * 4));
                const u32 words[4] = {v.x, v.y, v.z, v.w};
                const int shift = 8 * (k & 3) + 4 * ((k >> 2) & 1);
#pragma unroll
                for (int j = 0; j < 4; ++j) w[j] = (float)((int)((words[j] >> shift) & 0xFu) - 8);
            }
#pragma unroll
            for (int m = 0; m < F32_MT; ++m) {
                const float a = (m0 + m < M) ? __ldg(A + (size_t)(m0 + m) * K + k) : 0.0f;
#pragma unroll
                for (int j = 0; j < 4; ++j) bs[m][j] += a * w[j];
            }
        }
        const float4 sw = __ldg(reinterpret_cast<const float4*>(Ws + (size_t)g * Npad + n));
#pragma unroll
        for (int m = 0; m < F32_MT; ++m) {
            facc[m][0] += bs[m][0] * sw.x;
            facc[m][1] += bs[m][1] * sw.y;
            facc[m][2] += bs[m][2] * sw.z;
            facc[m][3] += bs[m][3] * sw.w;
        }
    }
#pragma unroll
    for (int m = 0; m < F32_MT; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (m0 + m < M && n + j < N) out[(size_t)(m0 + m) * ldo + n + j] = facc[m][j];
}
