// Activation quantization, Q8_0 semantics bit for bit as kestrel_core.contract.quantize_activations
// (common.cuh q8_scale; half away from zero is ggml's rounding, which contract.round_half_away reproduces).
// One warp per (row, block of G); each lane holds G / 32 values.
template <int G>
__global__ void k_quantize_act(const float* __restrict__ x, i8* __restrict__ codes,
                               float* __restrict__ scales, int M, int K) {
    const int warp = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    const int ng = K / G;
    if (warp >= M * ng) return;  // warp-uniform exit
    const int m = warp / ng, g = warp - m * ng;
    const size_t base = (size_t)m * K + (size_t)g * G;
    constexpr int PER = G / 32;
    float v[PER];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        v[i] = x[base + i * 32 + lane];
        amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
    const float d = q8_scale(amax), inv = q8_inv(d);
#pragma unroll
    for (int i = 0; i < PER; ++i) codes[base + i * 32 + lane] = q8_code(v[i], inv);
    if (lane == 0) scales[(size_t)m * ng + g] = d;
}
