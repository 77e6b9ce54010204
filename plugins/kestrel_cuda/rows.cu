// Row kernels of the residual stream: embed_rows (the step's first kernel), and the prologue and epilogue
// of prefill chunks that run the tiled GEMM (gemm_mma.cu): quantize_rows, add_rows.

// h[m][:] = dequantized embedding row of ids[m] (codes [V][D] int8, scales [V][D/G]).
extern "C" __global__ void embed_rows(const signed char* __restrict__ codes, const float* __restrict__ scales, int D,
                           int G, const int* __restrict__ ids, float* __restrict__ h, float* __restrict__ ssq_out)
{
    grid_dep_launch();
    grid_dep_wait();
    const int m = blockIdx.y;
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    float v = 0.f;
    if (k < D) {
        const size_t tok = (size_t)ids[m];
        v = (float)codes[tok * D + k] * scales[tok * (D / G) + k / G];
        h[(size_t)m * D + k] = v;
    }
    const int w0 = k & ~31;                     // the warp's first column
    if (ssq_out && w0 < D) store_warp_ssq(v, ssq_out, w0);  // M = 1
}

// Prologue alone, for the tiled-GEMM path: A = prologue(X) quantized per G-block -> codes [M][K], scales
// [M][K/G]. One block per (row, chunk of NT elements).
template <int G>
__global__ void __launch_bounds__(NT) quantize_rows(
    const float* __restrict__ X, int ldx, int M, int K, int pro, const float* __restrict__ pw, float eps,
    int xoff, signed char* __restrict__ codes, float* __restrict__ scales)
{
    grid_dep_launch();
    grid_dep_wait();
    __shared__ float s_red[NT / 32];
    __shared__ float s_r;
    const int m = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const float* xr = X + (size_t)m * ldx;
    if (pro == 1) {
        float ss = 0.f;
        for (int k = tid; k < K; k += NT) { const float v = xr[k]; ss += v * v; }
        ss = block_sum(ss, s_red);
        if (tid == 0) s_r = sqrtf(ss / (float)K + eps);
        __syncthreads();
    }
    const int k = blockIdx.x * NT + tid;
    float v = 0.f;
    if (k < K) {
        if (pro == 1) v = xr[k] / s_r * pw[k];
        else if (pro == 2) { const float g = xr[k]; v = g / (1.f + expf(-g)) * xr[k + xoff]; }
        else v = xr[k];
    }
    float amax = warp_max(fabsf(v));
    if (G == 256) {
        __syncthreads();
        if (lane == 0) s_red[warp] = amax;
        __syncthreads();
        amax = s_red[0];
        for (int w = 1; w < NT / 32; ++w) amax = fmaxf(amax, s_red[w]);
    }
    const float d = amax / 127.f;
    const float inv = d == 0.f ? 0.f : 1.f / d;
    if (k < K) {
        codes[(size_t)m * K + k] = (signed char)(int)roundf(v * inv);
        if (k % G == 0) scales[(size_t)m * (K / G) + k / G] = d;
    }
}

// Y[m][n] (+)= T[m][n] (+ bias[n]): the epilogue of the tiled-GEMM path.
extern "C" __global__ void add_rows(const float* __restrict__ T, int ldt, int M, int N, float* __restrict__ Y, int ldy,
                         int epi, const float* __restrict__ bias)
{
    grid_dep_launch();
    grid_dep_wait();
    const int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
    if (n >= N) return;
    float y = T[(size_t)m * ldt + n];
    if (bias) y = y + bias[n];
    float* dst = Y + (size_t)m * ldy + n;
    *dst = epi == 1 ? *dst + y : y;
}
