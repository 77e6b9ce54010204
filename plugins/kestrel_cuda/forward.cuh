// Device helpers shared by the whole-step forward's kernels (gemv.cu, rope.cu, attention.cu,
// attention_prefill.cu, rows.cu, lm_finish.cu): one NVRTC unit after common.cuh, in the order of
// kernels.FORWARD_SOURCES.
//
// NVRTC compiles it with --fmad=false, so every float expression rounds exactly as written (the CPU decoder's
// numpy order where it matters: rmsnorm x / sqrt(ms + eps) * w, RoPE x1*c - x2*s, silu g / (1 + exp(-g)) * u,
// gelu_tanh and gpt-oss's clamped SwiGLU below,
// Q8_0 round-half-away codes).
//
// Layouts (float32 unless said):
//   weights   codes K-major [K][Npad] int8, or int4 [K/8][Npad] 32-bit words of 8 k of one column (common.cuh),
//             scales [K/G][Npad]
//   h         [M][D] residual stream; qkv [M][Nqkv] (q | k | v); q [M][H*hd]; attn [M][H*hd]; gu [M][2F]
//   kv cache  one layer: k [KV][cap][hd], v [KV][cap][hd], float16 (kv_t): the CPU decoder's float16 rounding
//   meta      int32 device memory: meta[0] = absolute position of row 0 (the graph reads it at run time)

#define NT 256          // threads of a GEMV block (8 warps)
#define TN 128          // columns of a GEMV tile: 32 lanes x 4 columns
#define FULL FULL_MASK
#define NEG_INF __int_as_float(0xff800000)  // -inf without math headers (NVRTC)

// Keys and values are cached as IEEE float16, rounded to nearest even like the CPU decoder's (kernels.f16),
// and read back exactly. Conversions by PTX: NVRTC sees no cuda_fp16.h.
typedef unsigned short kv_t;
__device__ __forceinline__ kv_t to_kv(float x) {
    kv_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ float from_kv(kv_t h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}
// four float16 of a uint2 (memory order), as floats
__device__ __forceinline__ float4 from_kv4(uint2 w) {
    return make_float4(from_kv((kv_t)(w.x & 0xffffu)), from_kv((kv_t)(w.x >> 16)), from_kv((kv_t)(w.y & 0xffffu)),
                       from_kv((kv_t)(w.y >> 16)));
}


// gelu_tanh(g) * u in the CPU decoder's order: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u (Gemma's
// GeGLU); tanhf's last bits may differ from numpy's tanh.
__device__ __forceinline__ float gelu_tanh_mul(float g, float u) {
    float t = g * g;
    t = t * g;
    t = t * 0.044715f;
    t = t + g;
    t = t * 0.7978845608028654f;
    t = tanhf(t);
    t = t + 1.f;
    t = t * 0.5f;
    return g * t * u;
}

// gpt-oss's clamped SwiGLU of gate g and up u in the CPU decoder's order (host_ops.swiglu_oai_mul): g' = min(g,
// limit), g' / (1 + exp(g' * -alpha)) * (clamp(u, -limit, limit) + 1); expf's last bits may differ from numpy's.
__device__ __forceinline__ float swiglu_oai_mul(float g, float u, float limit, float alpha) {
    g = fminf(g, limit);
    const float s = g / (1.f + expf(g * -alpha));
    return s * (fminf(fmaxf(u, -limit), limit) + 1.f);
}

// Gemma 2's soft cap of an attention score or a logit: tanh(x / cap) * cap, the CPU decoder's order (cap > 0;
// tanhf's last bits may differ from numpy's tanh, as gelu_tanh_mul's)
__device__ __forceinline__ float soft_cap(float x, float cap) { return tanhf(x / cap) * cap; }

__device__ __forceinline__ int warp_isum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// Sum over the NT threads of a block, same bits in every thread; red: >= 8 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) s += red[w];
    return s;
}

// This thread's share of a row's sum of squares: x[k]^2 for k = tid, tid + NT, ... added in that order (the
// same bits as one load at a time), the loads issued ROW_LOADS at once (one at a time, each waited for,
// Gemma 3 12B's 96 post-norms took 665 us a step, 392 so). Through L2 (ld.global.cg): x is step data,
// written by the kernel before (see qgemv's early loads).
#define ROW_LOADS 16
__device__ __forceinline__ float thread_ssq(const float* x, int K) {
    float ss = 0.f;
    for (int k0 = threadIdx.x; k0 < K; k0 += NT * ROW_LOADS) {
        float v[ROW_LOADS];
#pragma unroll
        for (int j = 0; j < ROW_LOADS; ++j) v[j] = k0 + j * NT < K ? __ldcg(x + k0 + j * NT) : 0.f;
#pragma unroll
        for (int j = 0; j < ROW_LOADS; ++j) ss += v[j] * v[j];  // past K: + 0, exact
    }
    return ss;
}

// The residual stream's sums of squares, one per 32 columns (a warp's outputs), kept for M = 1 so that an
// RMSNorm prologue reads ceil(K / 32) floats instead of the whole row in every block: the kernels that write
// the stream (embed_rows, the residual-add GEMVs) leave them in ssq_out, the norm's consumers read ssq_in.

// rmsnorm denominator of a row of K from its sums, the same bits in every lane of the calling warp
__device__ __forceinline__ float rms_from_tiles(const float* __restrict__ ssq, int K, float eps) {
    const int lane = threadIdx.x & 31;
    float s = 0.f;
    for (int t = lane; t < (K + 31) / 32; t += 32) s += ssq[t];  // written by an earlier kernel
    s = warp_sum(s);
    return sqrtf(s / (float)K + eps);
}

// A post-norm h' = h + out * w / ro folded into the GEMVs around it (plan.PostNorm): from the sums st[t] (one
// float4 a column tile t of out's GEMV, T = ceil(K / TN)) of out², h·out·w, (out·w)² and h² that out's GEMV left,
// the post-norm's denominator ro and h''s, rh (sum h'² = sum h² + 2 / ro sum h·out·w + 1 / ro² sum (out·w)²).
// Every warp computes the same.
__device__ __forceinline__ void postnorm_rms(const float4* __restrict__ st, int K, float eps, float& ro, float& rh) {
    const int lane = threadIdx.x & 31, T = (K + TN - 1) / TN;  // T <= 64 (plan.POSTNORM_MAX_D); a loop spilled
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    float4 s = lane < T ? __ldcg(st + lane) : z;  // written by the kernel before
    const float4 v = lane + 32 < T ? __ldcg(st + lane + 32) : z;
    s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
    const float ik = __frcp_rn((float)K);  // one division instead of four: the M = 1 GEMV has 64 registers
    ro = sqrtf(warp_sum(s.x) * ik + eps);
    const float io = __frcp_rn(ro);
    rh = sqrtf(fmaxf(warp_sum(s.w) + io * (2.f * warp_sum(s.y) + io * warp_sum(s.z)), 0.f) * ik + eps);
}

// ssq[n0 / 32] = sum of the squares of the calling warp's outputs y (0 where a lane holds none), n0 the
// warp's first column
__device__ __forceinline__ void store_warp_ssq(float y, float* __restrict__ ssq, int n0) {
    const float s = warp_sum(y * y);
    if ((threadIdx.x & 31) == 0) ssq[n0 >> 5] = s;
}

// Weights and their G = 32 scales are read once a step: loaded through L2 without allocating L1 lines
// (ld.global.nc.L1::no_allocate). Measured on the H200 against __ldg (docs/performance.md):
// weights -75 us per q8 step and -40 us per q4 step (of the copy bandwidth: gate/up 83 -> 89 %, down 96 -> 105 %,
// q|k|v 82 -> 87 %), scales another -25 / -10 us per step, although q and o alone measure 3 % slower with it.
__device__ __forceinline__ unsigned ld_stream(const unsigned* p) {
    unsigned v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ float4 ld_stream(const float4* p) {
    float4 v;
    asm("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
        : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
