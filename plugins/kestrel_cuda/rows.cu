// Row kernels of the residual stream: embed_rows (the step's first kernel), the prologue and epilogue of
// prefill chunks that run the tiled GEMM (gemm_mma.cu): quantize_rows, add_rows; and norm_add_rows (Gemma's
// post-norms).

// h[m][:] = dequantized embedding row of ids[m] (codes [V][D] int8, scales [V][D/G]) times mul (Gemma's
// sqrt(D); 1 elsewhere, an exact multiply).
extern "C" __global__ void embed_rows(const signed char* __restrict__ codes, const float* __restrict__ scales, int D,
                           int G, const int* __restrict__ ids, float mul, float* __restrict__ h,
                           float* __restrict__ ssq_out)
{
    grid_dep_launch();
    grid_dep_wait();
    const int m = blockIdx.y;
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    float v = 0.f;
    if (k < D) {
        const size_t tok = (size_t)ids[m];
        v = (float)codes[tok * D + k] * scales[tok * (D / G) + k / G] * mul;
        h[(size_t)m * D + k] = v;
    }
    const int w0 = k & ~31;                     // the warp's first column
    if (ssq_out && w0 < D) store_warp_ssq(v, ssq_out, w0);  // M = 1
}

// Prologue alone, for the tiled-GEMM path: A = prologue(X) quantized per G-block -> codes [M][K], scales
// [M][K/G]; the prologues are qgemv's 0-3, and in the OAI instances 5 (glimit, galpha: gpt-oss's clamped SwiGLU;
// the other instances, every other model's, have none of its code). One block per (row, chunk of NT *
// QUANT_LOADS elements); a thread takes elements tid + i NT of its chunk, so warp w holds group 8 i + w of it
// whole (G = 32; G = 256: the 8 warps' of pass i). The RMSNorm's sum
// of squares is thread_ssq's; a row of up to NT * ROW_LOADS takes one round trip of loads, the block's values
// being among thread_ssq's. Four values a thread measured best at 64 rows (docs/performance.md).
#define QUANT_LOADS 4
template <int G, bool OAI>
__global__ void __launch_bounds__(NT) quantize_rows(
    const float* __restrict__ X, int ldx, int M, int K, int pro, const float* __restrict__ pw, float eps,
    int xoff, signed char* __restrict__ codes, float* __restrict__ scales, float glimit, float galpha)
{
    static_assert(G == 32 || G == NT, "a group: one warp's or the block's values of a pass");
    grid_dep_launch();
    __shared__ float s_red[NT / 32];
    __shared__ float s_max[QUANT_LOADS][NT / 32];
    const int m = blockIdx.y, c = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int k0 = c * NT * QUANT_LOADS + tid;
    const float* xr = X + (size_t)m * ldx;
    float v[QUANT_LOADS], u[QUANT_LOADS];
    if (pro == 1) {  // the norm's weights (not step data) before the PDL wait
#pragma unroll
        for (int i = 0; i < QUANT_LOADS; ++i) u[i] = k0 + i * NT < K ? pw[k0 + i * NT] : 0.f;
    }
    grid_dep_wait();
    if (pro == 1) {
        float ss = 0.f;
        if (K <= NT * ROW_LOADS) {  // thread_ssq's one pass, keeping this chunk's values
            float row[ROW_LOADS];
#pragma unroll
            for (int j = 0; j < ROW_LOADS; ++j) row[j] = tid + j * NT < K ? __ldcg(xr + tid + j * NT) : 0.f;
#pragma unroll
            for (int j = 0; j < ROW_LOADS; ++j) {
                ss += row[j] * row[j];
                if (j / QUANT_LOADS == c) v[j % QUANT_LOADS] = row[j];
            }
        } else {
            ss = thread_ssq(xr, K);
#pragma unroll
            for (int i = 0; i < QUANT_LOADS; ++i) v[i] = k0 + i * NT < K ? __ldcg(xr + k0 + i * NT) : 0.f;
        }
        const float r = sqrtf(block_sum(ss, s_red) / (float)K + eps);
#pragma unroll
        for (int i = 0; i < QUANT_LOADS; ++i) v[i] = v[i] / r * u[i];
    } else {
#pragma unroll
        for (int i = 0; i < QUANT_LOADS; ++i) {
            const int k = k0 + i * NT;
            v[i] = k < K ? __ldcg(xr + k) : 0.f;
            u[i] = pro >= 2 && k < K ? __ldcg(xr + k + xoff) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < QUANT_LOADS; ++i) {
            if (pro == 2) v[i] = v[i] / (1.f + expf(-v[i])) * u[i];
            else if (pro == 3) v[i] = gelu_tanh_mul(v[i], u[i]);
            else if (OAI && pro == 5) v[i] = swiglu_oai_mul(v[i], u[i], glimit, galpha);
        }
    }
    float amax[QUANT_LOADS];
#pragma unroll
    for (int i = 0; i < QUANT_LOADS; ++i) amax[i] = warp_max(fabsf(v[i]));
    if (G == NT) {
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < QUANT_LOADS; ++i) s_max[i][warp] = amax[i];
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < QUANT_LOADS; ++i) {
            amax[i] = s_max[i][0];
            for (int w = 1; w < NT / 32; ++w) amax[i] = fmaxf(amax[i], s_max[i][w]);
        }
    }
#pragma unroll
    for (int i = 0; i < QUANT_LOADS; ++i) {
        const int k = k0 + i * NT;
        const float d = q8_scale(amax[i]), inv = q8_inv(d);
        if (k < K) {
            codes[(size_t)m * K + k] = q8_code(v[i], inv);
            if (k % G == 0) scales[(size_t)m * (K / G) + k / G] = d;
        }
    }
}

// Y[m][n] = T[m][n] (+ bias[n]) (epi 0), or Y[m][n] += (T[m][n] (+ bias[n])) * mul (epi 1; mul: Granite's residual
// multiplier, 1 elsewhere, an exact multiply): the epilogue of the tiled-GEMM path.
extern "C" __global__ void add_rows(const float* __restrict__ T, int ldt, int M, int N, float* __restrict__ Y, int ldy,
                         int epi, float mul, const float* __restrict__ bias)
{
    grid_dep_launch();
    grid_dep_wait();
    const int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
    if (n >= N) return;
    float y = T[(size_t)m * ldt + n];
    if (bias) y = y + bias[n];
    float* dst = Y + (size_t)m * ldy + n;
    *dst = epi == 1 ? *dst + y * mul : y;
}

// Y[m][:] += rmsnorm(X[m][:], w, eps): a post-norm on a projection's output before the residual add (Gemma),
// X / sqrt(mean(X^2) + eps) * w as the CPU decoder computes it (a sum per row; here per block, then its
// threads' partials in order). One block of NT threads per row; ssq_out (M = 1): Y's sums of squares per 32
// columns (forward.cuh), each 32 columns being one warp's in one pass of the loop. A pass takes ROW_LOADS
// columns a thread, their loads issued together; the first pass's norm weights are loaded before the PDL wait
// (not step data) and its X and Y together after it, so a row of up to NT * ROW_LOADS takes one round trip.
extern "C" __global__ void __launch_bounds__(NT) norm_add_rows(
    const float* __restrict__ X, int ldx, int D, const float* __restrict__ w, float eps, float* __restrict__ Y,
    int ldy, float* __restrict__ ssq_out)
{
    grid_dep_launch();
    __shared__ float s_red[NT / 32];
    constexpr int PASS = NT * ROW_LOADS;
    const int tid = threadIdx.x;
    const float* xr = X + (size_t)blockIdx.x * ldx;
    float* yr = Y + (size_t)blockIdx.x * ldy;
    float xv[ROW_LOADS], yv[ROW_LOADS], wv[ROW_LOADS];
#pragma unroll
    for (int j = 0; j < ROW_LOADS; ++j) wv[j] = j * NT + tid < D ? ld_before_wait(w + j * NT + tid) : 0.f;
    grid_dep_wait();
#pragma unroll
    for (int j = 0; j < ROW_LOADS; ++j) {
        const bool ok = j * NT + tid < D;
        xv[j] = ok ? __ldcg(xr + j * NT + tid) : 0.f;
        yv[j] = ok ? yr[j * NT + tid] : 0.f;
    }
    float ss = 0.f;  // thread_ssq's order: the first pass, then the rest
#pragma unroll
    for (int j = 0; j < ROW_LOADS; ++j) ss += xv[j] * xv[j];
    if (D > PASS) ss += thread_ssq(xr + PASS, D - PASS);
    const float r = sqrtf(block_sum(ss, s_red) / (float)D + eps);
    for (int k0 = 0; k0 < D; k0 += PASS) {  // the same passes in every thread (warp sums below)
        if (k0 > 0) {
#pragma unroll
            for (int j = 0; j < ROW_LOADS; ++j) {
                const int k = k0 + j * NT + tid;
                const bool ok = k < D;
                xv[j] = ok ? __ldcg(xr + k) : 0.f;
                yv[j] = ok ? yr[k] : 0.f;
                wv[j] = ok ? w[k] : 0.f;
            }
        }
#pragma unroll
        for (int j = 0; j < ROW_LOADS; ++j) {
            const int k = k0 + j * NT + tid;
            float y = 0.f;
            if (k < D) {
                y = yv[j] + xv[j] / r * wv[j];
                yr[k] = y;
            }
            if (ssq_out && (k & ~31) < D) store_warp_ssq(y, ssq_out, k & ~31);
        }
    }
}
