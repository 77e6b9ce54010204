// Decode-batch GEMM on sm_90 for int8 codes and G = 32, 17-64 rows: the split tensor-core GEMM of gemm_mma.cu
// (the same fragments, scaling and cluster merge: the same bits) fed by the tensor memory accelerator from a
// producer warp, so the warps that compute issue no copy and wait at no block barrier. Against the cp.async
// block (32x128s) it saves the copies' issue and the stage barriers, which cost it about a third of its time:
// docs/performance.md.
//
// A block is 4 consumer warps of 32 x 32 (BM = 32 rows by BN = 128 columns) and one producer warp. For each of
// TMA_STAGES shared-memory stages of BK = 128 k the producer's lane 0 issues three tensor copies
// (cp.async.bulk.tensor, completing on the stage's `full` mbarrier): the weight codes [BK][BN] and the
// activation codes [BM][BK], both with the 128-byte swizzle, and the weight scales [4][BN]. Its lanes load the
// row scales, round each once to 22 bits and store it paired with -MAGIC x it (gemm_tile.cuh), then arrive.
// The consumers wait on `full`, compute, and release the stage on its `empty` mbarrier. Rows past M arrive as
// zeros (the tensor copy's out-of-bounds fill) with zero scales.
// 128-byte swizzle: 16-byte chunk c of row r lies at chunk c ^ (r % 8) (stages 1024-byte aligned). ldmatrix's
// 8 rows then hit 8 bank groups; the 4 rows 4 tig + j of a thread's B word meet 2 ways.
// PDL: the first stages' weights are requested before the producer's grid_dep_wait, the activations after;
// the consumers touch global memory only through the producer's stages and their final stores.
// K splits: block z of the cluster takes ``kstages`` stages from z x kstages (gemm.py: the split of
// gemm.mma_splits, a function of the weight's shape, and from 33 rows half as many, about twice as long).
// ``add``: the sums added to what out holds, as gemm_mma.cu.
#define TMA_BK 128
#define TMA_BM 32
#define TMA_STAGES 3  // three blocks an SM (registers <= 136 and shared memory); 4 stages at 2 blocks: slower
struct __align__(64) TmaDesc { unsigned long long v[16]; };  // a CUtensorMap (cuTensorMapEncodeTiled)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.release.cta.shared::cta.b64 st, [%0]; }" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{ .reg .pred p; TMA_WAIT: mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%0], %1; "
                 "@!p bra TMA_WAIT; }" ::"r"(bar), "r"(parity) : "memory");
}
// box at coordinates (x inner, y outer) of the tensor map into shared memory at dst
__device__ __forceinline__ void tma_2d(u32 dst, const TmaDesc* map, int x, int y, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(bar) : "memory");
}
#endif

// 1 / sqrt(mean square + eps) of a row of K from its tiles' sums of squares (NormFold.ssq: K / 128 of them, M
// apart, in order), the factor quantize_rows divides the row by, with the approximate reciprocals (no slow-path
// calls). The producer forms it after its last stage and the store multiplies the row's sums by it: applied to
// the first stage's row scales it held that stage back by the loads' round trip (1 - 2 us a GEMM at 64 rows).
__device__ __forceinline__ float row_rsqrt(const float* __restrict__ ssq, int M, int K, float eps) {
    float s = 0.f;
    for (int t0 = 0; t0 < K / 128; t0 += 32) {  // one round trip up to K = 4096
        float v[32];
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = t0 + j < K / 128 ? __ldcg(ssq + (size_t)(t0 + j) * M) : 0.f;
#pragma unroll
        for (int j = 0; j < 32; ++j) s += v[j];
    }
    return rsqrtf(__fdividef(s, (float)K) + eps);
}

struct TmaTile {
    static constexpr int BM = TMA_BM, BN = 128, BK = TMA_BK, SG = BK / 32, CW = 4, STAGES = TMA_STAGES;
    static constexpr int THREADS = 32 * (CW + 1);
    static constexpr int B_OFF = 0, A_OFF = BK * BN, SW_OFF = A_OFF + BM * BK, AS_OFF = SW_OFF + SG * BN * 4;
    static constexpr int TX = BK * BN + BM * BK + SG * BN * 4;  // bytes of a stage's tensor copies
    static constexpr int STAGE = (AS_OFF + SG * BM * 8 + 1023) / 1024 * 1024;
    static constexpr int SMEM = 1024 + STAGES * STAGE + 16 * STAGES + 4 * BM;  // slack, stages, mbarriers, row_f
};

// NORM (the norm fold, gemm_tile.cuh NormFold; one instance each): 0 none; 1 the activations are the fold's
// codes and scales, the sums of whose rows are stored times 1 / rms from row_ssq; 2 the store folds (fold_*, a
// cluster's).
template <int NORM>
__global__ void __launch_bounds__(TmaTile::THREADS, 3) k_gemm_q8_tma(
        const __grid_constant__ TmaDesc tw, const __grid_constant__ TmaDesc tws, const __grid_constant__ TmaDesc ta,
        const float* __restrict__ As, int M, float* __restrict__ out, int ldo, int add, int N, int K, int kstages,
        const float* __restrict__ fold_w, i8* __restrict__ fold_codes,
        float* __restrict__ fold_scales, float* __restrict__ fold_ssq, const float* __restrict__ row_ssq, float eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using T = TmaTile;
    constexpr int BM = T::BM, BN = T::BN, BK = T::BK, SG = T::SG, CW = T::CW, STAGES = T::STAGES, MI = 2;
    extern __shared__ __align__(1024) unsigned char smem_raw[];

    grid_dep_launch();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int ng = K / 32;
    const int st0 = blockIdx.z * kstages;
    const int nst = min(K / BK, st0 + kstages) - st0;  // this split's stages
    const u32 raw = smem_u32(smem_raw);
    const u32 pad = (1024 - (raw & 1023)) & 1023;
    unsigned char* smem = smem_raw + pad;
    const u32 sbase = raw + pad;
    const u32 bars = sbase + STAGES * T::STAGE;  // full[s] at bars + 8 s, empty[s] at bars + 8 (STAGES + s)
    float* row_f = reinterpret_cast<float*>(smem + STAGES * T::STAGE + 16 * STAGES);  // NORM 1: rows' 1 / rms
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bars + 8 * s, 32);             // the producer's lanes (and the tensor copies' bytes)
            mbar_init(bars + 8 * (STAGES + s), CW);  // the consumer warps
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == CW) {  // producer
        if (lane == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&tw)) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&tws)) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&ta)) : "memory");
        }
        const int arows = min(BM, M - m0);
        auto weights = [&](int i) {  // stage i's weight codes and scales; lane 0
            const int st = st0 + i;
            const u32 sb = sbase + (i % STAGES) * T::STAGE, full = bars + 8 * (i % STAGES);
            mbar_expect_tx(full, T::TX);
            tma_2d(sb + T::B_OFF, &tw, n0, st * BK, full);
            tma_2d(sb + T::SW_OFF, &tws, n0, st * SG, full);
        };
        auto activations = [&](int i) {  // stage i's activation codes (lane 0) and row scales; every lane arrives
            const int buf = i % STAGES, st = st0 + i;
            const u32 sb = sbase + buf * T::STAGE, full = bars + 8 * buf;
            if (lane == 0) tma_2d(sb + T::A_OFF, &ta, st * BK, m0, full);
            float* sas = reinterpret_cast<float*>(smem + buf * T::STAGE + T::AS_OFF);
            {
                const int r = lane;  // BM == 32
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (r < arows) v = __ldg(reinterpret_cast<const float4*>(As + (size_t)(m0 + r) * ng + st * SG));
                const float sv[4] = {v.x, v.y, v.z, v.w};
                // row r is row (r % 16) / 8 of m16 tile r / 16, read by the lanes of group row r % 8
                const int pos = (r & 7) * 8 + ((r >> 4) * 2 + ((r & 15) >> 3)) * 2;
#pragma unroll
                for (int g = 0; g < SG; ++g) {
                    const float a = split_row_scale(sv[g]);
                    *reinterpret_cast<float2*>(sas + g * BM * 2 + pos) = make_float2(a, -GQ_MAGIC_F * a);
                }
            }
            mbar_arrive(full);
        };
        if (lane == 0)
            for (int i = 0; i < min(nst, STAGES); ++i) weights(i);
        grid_dep_wait();
        for (int i = 0; i < nst; ++i) {
            if (i >= STAGES) {
                mbar_wait(bars + 8 * (STAGES + i % STAGES), ((i / STAGES) - 1) & 1);
                if (lane == 0) weights(i);
            }
            activations(i);
        }
        if (NORM == 1) row_f[lane] = lane < arows ? row_rsqrt(row_ssq + m0 + lane, M, K, eps) : 0.f;
    }

    float facc[MI][4][4];
    tile_zero<MI>(facc);
    const int wn = warp % 4, gid = lane >> 2, tig = lane & 3;  // a consumer's columns wn * 32 ..
    if (warp < CW) {  // consumers
        const int magic[4] = {GQ_MAGIC, GQ_MAGIC, GQ_MAGIC, GQ_MAGIC};
        // ldmatrix: row mi * 16 + lane % 16, chunk 2 ks + lane / 16, swizzled by the row's lane % 8
        const int a_row = (lane & 15) * BK, a_x = (lane >> 4) ^ (lane & 7);
        // B word wn * 8 + gid (chunk 2 wn + gid / 4) of rows ks * 32 + h * 16 + 4 tig + j, whose row % 8 is
        // 4 (tig % 2) + j
        int b_off[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            b_off[j] = (4 * tig + j) * BN + (((2 * wn + (gid >> 2)) ^ (4 * (tig & 1) + j)) << 4) + 4 * (gid & 3);
        for (int i = 0; i < nst; ++i) {
            const int buf = i % STAGES;
            mbar_wait(bars + 8 * buf, (i / STAGES) & 1);
            const u32 sa = sbase + buf * T::STAGE + T::A_OFF;
            const unsigned char* sbp = smem + buf * T::STAGE + T::B_OFF;
            const float* sbsp = reinterpret_cast<const float*>(smem + buf * T::STAGE + T::SW_OFF);
            const float* sasp = reinterpret_cast<const float*>(smem + buf * T::STAGE + T::AS_OFF);
#pragma unroll
            for (int ks = 0; ks < BK / 32; ++ks) {
                u32 af[MI][4], bf[4][2];
                const int a_chunk = ((2 * ks) ^ a_x) << 4;
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) ldmatrix_x4(af[mi], sa + a_row + mi * 16 * BK + a_chunk);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    u32 w[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        w[j] = *reinterpret_cast<const u32*>(sbp + (ks * 32 + h * 16) * BN + b_off[j]);
                    transpose4x4(w[0], w[1], w[2], w[3], bf[0][h], bf[1][h], bf[2][h], bf[3][h]);
                }
                int iacc[MI][4][4];
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int ni = 0; ni < 4; ++ni) mma_s8(iacc[mi][ni], af[mi], bf[ni], magic);
                const float4 w0 = *reinterpret_cast<const float4*>(sbsp + ks * BN + wn * 32 + 8 * tig);
                const float4 w1 = *reinterpret_cast<const float4*>(sbsp + ks * BN + wn * 32 + 8 * tig + 4);
                const float sw[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
                // (scale, -MAGIC x scale) of rows gid, gid + 8 of each m16 tile
                const float4 p0 = *reinterpret_cast<const float4*>(sasp + ks * BM * 2 + gid * 8);
                const float4 p1 = *reinterpret_cast<const float4*>(sasp + ks * BM * 2 + gid * 8 + 4);
                const float sc[2 * MI] = {p0.x, p0.z, p1.x, p1.z}, nb[2 * MI] = {p0.y, p0.w, p1.y, p1.w};
                tile_scale_split<MI>(iacc, facc, sw, sc, nb);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(bars + 8 * (STAGES + buf));
        }
    }

    const bool vec = (ldo & 3) == 0 && (reinterpret_cast<size_t>(out) & 15) == 0;
    if (gridDim.z > 1) {  // the splits are one cluster (gemm.py launches no other way)
        __syncthreads();  // every stage is consumed: the buffers are free (NORM 1: row_f is written)
        tile_cluster_store<MI, BM, BN, NORM == 2>(facc, warp < CW, reinterpret_cast<float*>(smem), 0, wn * 32, out, ldo,
                                       M, N, m0, n0, vec, add,
                                       NormFold{fold_w, fold_codes, fold_scales, fold_ssq},
                                       NORM == 1 ? row_f : nullptr);
        return;
    }
    if (NORM == 1) __syncthreads();  // row_f is written
    if (warp < CW) {
        if (NORM == 1) tile_scale_rows<MI>(facc, row_f);
        tile_store_rows<MI>(facc, out, ldo, M, N, m0, n0 + wn * 32, vec, add);
    }
#else
    __trap();  // launched on sm_90 only (gemm.py)
#endif
}
