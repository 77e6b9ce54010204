// Frozen copy of the previous prefill kernel (plugins/kestrel_cuda/gemm_mma.cu at commit 2d471ba), kept only as
// the baseline that benchmarks/cuda_prefill.py times and checks the current kernel against; the backend never
// compiles it. Needs common.cu's helpers in front of it (one NVRTC unit).
//
// Prefill GEMM (M large) on int8 tensor cores: mma.sync.m16n8k32 s8 x s8 -> s32.
//
// Block tile 64 (M) x 128 (N), 8 warps as 2 x 4, warp tile 32 x 32 (2 x 4 mma tiles); K in stages of BK
// (64 or 128) bytes, double-buffered in shared memory with the next stage's global loads in flight during
// the mma (a longer stage hides more of the load latency).
// One k32 step is exactly one block of G = 32 (an eighth of G = 256): the int32 mma accumulators hold exact
// block sums; when a group completes they are scaled as ((float)sum * As) * Ws, the CPU reference's
// expression, and added to float accumulators in increasing group order, the reference's order too.
//
// Shared memory holds both operands as [row][BK/4 words] with k contiguous (A rows = m, B rows = n); word kw
// of row r is stored at kw ^ (swz(r) << 2), which keeps the fragment loads conflict-free and the transposing
// B stores at 2-way (BK 64) or conflict-free (BK 128). B arrives K-major ([K][Npad]), so each thread loads a 4 (k) x 4 (n) byte piece and
// transposes it in registers (4 words -> 4 words) before storing.
#define MMA_BM 64
#define MMA_BN 128
#define MMA_THREADS 256

template <int BK>
__device__ __forceinline__ int swz(int r) {
    if constexpr (BK == 64) return ((r >> 1) ^ (r >> 3)) & 3;
    else return (r ^ (r >> 3)) & 7;
}

__device__ __forceinline__ void mma_s8(int (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int BITS, int BK>
__global__ void __launch_bounds__(MMA_THREADS, BK == 64 ? 2 : 1) k_gemm_mma(
        const i8* __restrict__ A, const float* __restrict__ As, int M,
        const u8* __restrict__ W, const float* __restrict__ Ws,
        float* __restrict__ out, int ldo, int N, int K, int Npad, int G) {
    constexpr int RW = BK / 4;            // words per shared-memory row
    constexpr int AP = MMA_BM * BK / 16 / MMA_THREADS;   // 16-byte A chunks per thread per stage
    constexpr int BP = (BK / 4) * (MMA_BN / 4) / MMA_THREADS;  // 4x4 B pieces per thread per stage
    constexpr int KS = BK / 32;           // k32 steps per stage
    __shared__ __align__(16) u32 sA[2][MMA_BM * RW];
    __shared__ __align__(16) u32 sB[2][MMA_BN * RW];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;
    const int gid = lane >> 2, tig = lane & 3;
    const int m0 = blockIdx.y * MMA_BM, n0 = blockIdx.x * MMA_BN;
    const int ng = K / G;
    const int nst = (K + BK - 1) / BK;

    // global -> register staging of one stage
    uint4 ra[AP];
    u32 rb[BP][4];
    constexpr int CPR = BK / 16;          // 16-byte chunks per A row
    auto load_stage = [&](int st) {
#pragma unroll
        for (int p = 0; p < AP; ++p) {
            const int idx = p * MMA_THREADS + tid, row = idx / CPR, chunk = idx % CPR;
            const int gm = m0 + row, gk = st * BK + chunk * 16;
            ra[p] = make_uint4(0u, 0u, 0u, 0u);
            if (gm < M && gk < K) ra[p] = __ldg(reinterpret_cast<const uint4*>(A + (size_t)gm * K + gk));
        }
#pragma unroll
        for (int it = 0; it < BP; ++it) {
            const int combo = it * 8 + warp;
            const int cq = (combo & 3) * 8 + (lane & 7);
            const int q = (combo >> 2) * 4 + (lane >> 3);
            const int n = n0 + 4 * cq, k = st * BK + 4 * q;
            u32 w0 = 0u, w1 = 0u, w2 = 0u, w3 = 0u;
            if (n < Npad && k < K) {
                if constexpr (BITS == 8) {
                    const u8* p = W + (size_t)k * Npad + n;
                    w0 = __ldg(reinterpret_cast<const u32*>(p));
                    w1 = __ldg(reinterpret_cast<const u32*>(p + Npad));
                    w2 = __ldg(reinterpret_cast<const u32*>(p + 2 * (size_t)Npad));
                    w3 = __ldg(reinterpret_cast<const u32*>(p + 3 * (size_t)Npad));
                } else {
                    const u8* p = W + (size_t)(k >> 1) * Npad + n;
                    const u32 x = __ldg(reinterpret_cast<const u32*>(p));
                    const u32 y = __ldg(reinterpret_cast<const u32*>(p + Npad));
                    w0 = nib_lo(x); w1 = nib_hi(x); w2 = nib_lo(y); w3 = nib_hi(y);
                }
            }
            transpose4x4(w0, w1, w2, w3, rb[it][0], rb[it][1], rb[it][2], rb[it][3]);
        }
    };
    auto store_stage = [&](int buf) {
#pragma unroll
        for (int p = 0; p < AP; ++p) {
            const int idx = p * MMA_THREADS + tid, row = idx / CPR, chunk = idx % CPR;
            *reinterpret_cast<uint4*>(&sA[buf][row * RW + ((chunk ^ swz<BK>(row)) << 2)]) = ra[p];
        }
#pragma unroll
        for (int it = 0; it < BP; ++it) {
            const int combo = it * 8 + warp;
            const int cq = (combo & 3) * 8 + (lane & 7);
            const int q = (combo >> 2) * 4 + (lane >> 3);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int n = 4 * cq + j;
                sB[buf][n * RW + (q ^ (swz<BK>(n) << 2))] = rb[it][j];
            }
        }
    };

    float facc[2][4][4];
    int iacc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) { facc[i][j][e] = 0.0f; iacc[i][j][e] = 0; }

    load_stage(0);
    store_stage(0);
    __syncthreads();
    for (int st = 0; st < nst; ++st) {
        const int buf = st & 1;
        if (st + 1 < nst) load_stage(st + 1);
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const int kk = st * KS + ks;  // global k32 step
            if (kk * 32 >= K) break;
            u32 af[2][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int r = wm * 32 + mi * 16 + gid;
                const int kw = ks * 8 + tig;
                af[mi][0] = sA[buf][r * RW + (kw ^ (swz<BK>(r) << 2))];
                af[mi][1] = sA[buf][(r + 8) * RW + (kw ^ (swz<BK>(r + 8) << 2))];
                af[mi][2] = sA[buf][r * RW + ((kw + 4) ^ (swz<BK>(r) << 2))];
                af[mi][3] = sA[buf][(r + 8) * RW + ((kw + 4) ^ (swz<BK>(r + 8) << 2))];
            }
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const int n = wn * 32 + ni * 8 + gid;
                const int kw = ks * 8 + tig;
                bf[ni][0] = sB[buf][n * RW + (kw ^ (swz<BK>(n) << 2))];
                bf[ni][1] = sB[buf][n * RW + ((kw + 4) ^ (swz<BK>(n) << 2))];
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) mma_s8(iacc[mi][ni], af[mi], bf[ni]);
            if (((kk + 1) * 32) % G == 0) {  // a group is complete: scale its exact sums
                const int g = (kk * 32) / G;
                float sa[2][2];
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int row = m0 + wm * 32 + mi * 16 + gid + 8 * hf;
                        sa[mi][hf] = row < M ? __ldg(As + (size_t)row * ng + g) : 0.0f;
                    }
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) {
                    const int col = n0 + wn * 32 + ni * 8 + tig * 2;
                    float2 sw = make_float2(0.0f, 0.0f);
                    if (col < Npad) sw = __ldg(reinterpret_cast<const float2*>(Ws + (size_t)g * Npad + col));
#pragma unroll
                    for (int mi = 0; mi < 2; ++mi) {
                        facc[mi][ni][0] += ((float)iacc[mi][ni][0] * sa[mi][0]) * sw.x;
                        facc[mi][ni][1] += ((float)iacc[mi][ni][1] * sa[mi][0]) * sw.y;
                        facc[mi][ni][2] += ((float)iacc[mi][ni][2] * sa[mi][1]) * sw.x;
                        facc[mi][ni][3] += ((float)iacc[mi][ni][3] * sa[mi][1]) * sw.y;
#pragma unroll
                        for (int e = 0; e < 4; ++e) iacc[mi][ni][e] = 0;
                    }
                }
            }
        }
        if (st + 1 < nst) store_stage(buf ^ 1);
        __syncthreads();
    }

#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            const int row = m0 + wm * 32 + mi * 16 + gid;
            const int col = n0 + wn * 32 + ni * 8 + tig * 2;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = row + (e >> 1) * 8, c = col + (e & 1);
                if (r < M && c < N) out[(size_t)r * ldo + c] = facc[mi][ni][e];
            }
        }
}
