// Whole-step decoder kernels of the CUDA backend (kestrel_cuda.forward).
//
// Compiled after common.cu (its types, transpose4x4 and the int4 word layout) by NVRTC through cupy.RawModule with --fmad=false, so every float expression rounds exactly as
// written (the CPU decoder's numpy order where it matters: rmsnorm x / sqrt(ms + eps) * w, RoPE
// x1*c - x2*s, silu g / (1 + exp(-g)) * u, Q8_0 round-half-away codes).
//
// Layouts (float32 unless said):
//   weights   codes K-major [K][Npad] int8, or int4 [K/8][Npad] 32-bit words of 8 k of one column (common.cu),
//             scales [K/G][Npad]
//   h         [M][D] residual stream; qkv [M][Nqkv] (q | k | v); q [M][H*hd]; attn [M][H*hd]; gu [M][2F]
//   kv cache  one layer: k [KV][cap][hd], v [KV][cap][hd]
//   meta      int32 device memory: meta[0] = absolute position of row 0 (the graph reads it at run time)

#define NT 256          // threads of a GEMV block (8 warps)
#define TN 128          // columns of a GEMV tile: 32 lanes x 4 columns
#define FULL FULL_MASK
#define NEG_INF __int_as_float(0xff800000)  // -inf without math headers (NVRTC)

// Programmatic dependent launch (sm_90): a kernel launched with programmatic stream serialization may start
// while its predecessor in the stream is still running. Everything before grid_dep_wait() must touch only
// what no kernel of the step writes (weights, norms, tables); the wait returns once the predecessor has
// completed and its writes are visible. Without that launch attribute the wait returns at once. Every
// kernel here lets its dependents launch at its start: they only prefetch weights until their own wait.
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Timeline stamps (benchmarks/cuda_timeline.py compiles with -DKESTREL_TIMELINE; no code otherwise): thread 0 of
// each block appends (entry, after the PDL wait, work done, exit, kernel id, SM) in globaltimer ns.
#ifdef KESTREL_TIMELINE
#define KT_MAX (1 << 20)
__device__ unsigned long long kt_buf[KT_MAX * 6];
__device__ unsigned int kt_n;
__device__ __forceinline__ unsigned long long kt_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define KT_BEGIN unsigned long long kt0 = kt_now(), kt1 = 0, kt2 = 0;
#define KT_WAITED if (kt1 == 0) kt1 = kt_now();
#define KT_DONE kt2 = kt_now();
#define KT_END(id) if (threadIdx.x == 0) { \
        unsigned smid; asm volatile("mov.u32 %0, %%smid;" : "=r"(smid)); \
        const unsigned i = atomicAdd(&kt_n, 1u); \
        if (i < KT_MAX) { unsigned long long* r = kt_buf + 6 * (size_t)i; \
            r[0] = kt0; r[1] = kt1; r[2] = kt2; r[3] = kt_now(); r[4] = (unsigned long long)(id); r[5] = smid; } }
#else
#define KT_BEGIN
#define KT_WAITED
#define KT_DONE
#define KT_END(id)
#endif

__device__ __forceinline__ float warp_sum(float v) {
    // xor butterfly: every lane ends with the same bits (float addition is commutative)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

__device__ __forceinline__ int warp_isum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// Split-K hand-over, called by every thread of a block once its partials are stored: true in the block that
// arrives last of ``count`` (it then reads the others' partials). One thread's acq_rel atomic after the barrier
// publishes the whole block's stores (release is cumulative over the barrier) and, in the last block, makes
// the other blocks' stores visible to it (acquire, then the barrier): CUTLASS's semaphore pattern. Measured
// against fencing every thread around a relaxed atomic: 60 us (q4) and 97 us (q8) less per qwen3-8b step.
__device__ __forceinline__ bool arrive_last(int* counter, int count, int* flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        int old;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
        *flag = old == count - 1;
    }
    __syncthreads();
    return *flag;
}

// Split-K hand-over of qgemv at M = 1 without a fence or a counter round trip: each split stores its partial
// sums together with the launch's tag, the tile's epoch + 1, as one 64-bit word (single-copy atomic), in slot
// [tile][split][column] of ``merge``, and the tile's last split polls for the others' tags. A tile's epoch
// grows by one with every launch that merges it (its last split writes it, after the poll), so no slot holds
// the new tag before this launch writes it; the next launch reads it after its PDL wait.
#define MERGE_SPLITS 64  // K splits one tile's slots hold (forward_ops.MERGE_SPLITS)
__device__ __forceinline__ void st_tagged(unsigned long long* p, float v, unsigned tag) {
    const unsigned long long w = ((unsigned long long)tag << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" :: "l"(p), "l"(w) : "memory");
}
__device__ __forceinline__ unsigned long long ld_tagged(const unsigned long long* p) {
    unsigned long long w;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
    return w;
}

// Thread block clusters (sm_90): the K splits of a GEMV tile launched as one cluster add their partial sums
// through distributed shared memory, on chip, instead of through L2 (KESTREL_CUDA_CLUSTER, forward_ops).
#define MAX_CLUSTER 8   // portable cluster size
__device__ __forceinline__ unsigned cluster_size() {
    unsigned r = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
#endif
    return r;
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}

// mbarrier and distributed shared memory primitives (sm_90; no-ops below, where no cluster is launched)
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}
// the mbarrier initialisations before it visible to the cluster (and the async proxy)
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// one arrival that also expects ``bytes`` of asynchronous copies in the barrier's current phase
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n\t.reg .pred p;\n"
                 "WAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "\t@!p bra WAIT;\n}" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
#endif
}
// the address of *p in the shared memory of the cluster's block ``rank``
__device__ __forceinline__ unsigned cluster_addr(const void* p, unsigned rank) {
    unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_addr(p)), "r"(rank));
#endif
    return r;
}

// The cluster barrier's two halves: arrive early, wait late, for a block that only needs the others to have
// started; a block may exit without waiting. Together: shared-memory writes before them are visible to the
// cluster after.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The M=1 GEMV's cluster merge: block 0 counts the bytes the other blocks store into its shared memory on one
// mbarrier, so each of them sends its partial sums and exits at once instead of holding its SM slot until
// block 0 has read them (tenth session: q|k|v 8.6 -> 7.5 us at q8, 6.2 -> 5.6 at q4; docs/performance.md).
// v into *p of the cluster's block 0, counted on block 0's ``bar`` (fire and forget)
__device__ __forceinline__ void push_to_rank0(float* p, unsigned long long* bar, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
                 :: "r"(cluster_addr(p, 0)), "f"(v), "r"(cluster_addr(bar, 0)) : "memory");
#endif
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

// ssq[n0 / 32] = sum of the squares of the calling warp's outputs y (0 where a lane holds none), n0 the
// warp's first column
__device__ __forceinline__ void store_warp_ssq(float y, float* __restrict__ ssq, int n0) {
    const float s = warp_sum(y * y);
    if ((threadIdx.x & 31) == 0) ssq[n0 >> 5] = s;
}

// Weights and their G = 32 scales are read once a step: loaded through L2 without allocating L1 lines
// (ld.global.nc.L1::no_allocate). Measured on the H200 against __ldg (docs/performance.md, sixth session):
// weights -75 us per q8 step and -40 us per q4 step (of the copy bandwidth: gate/up 83 -> 89 %, down 96 -> 105 %,
// q|k|v 82 -> 87 %), scales another -25 / -10 us per step, although q and o alone measure 3 % slower with it.
__device__ __forceinline__ unsigned ld_stream(const unsigned* p) {
    unsigned v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ float4 ld_stream(const float4* p) {
    float4 v;
    asm("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

// One lane's 32-row slot of weights, 4 columns from col, rows kr .. kr + 31. int8: w[r] = row kr + r (byte c =
// column c); int4: w[4r + c] = the 8-k word of column c, k = kr + 8r .. kr + 8r + 7.
template <int BITS>
__device__ __forceinline__ void load_slot(const unsigned char* __restrict__ W, int Npad, int kr, int col,
                                          unsigned (&w)[BITS == 8 ? 32 : 16]) {
    if constexpr (BITS == 8) {
        const unsigned* p = reinterpret_cast<const unsigned*>(W + (size_t)kr * Npad + col);
#pragma unroll
        for (int r = 0; r < 32; ++r) w[r] = ld_stream(p + (size_t)r * (Npad / 4));
    } else {
        const uint4* p = reinterpret_cast<const uint4*>(W + ((size_t)(kr / 8) * Npad + col) * 4);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const uint4 v = ld_stream(p + (size_t)r * (Npad / 4));
            w[4 * r] = v.x; w[4 * r + 1] = v.y; w[4 * r + 2] = v.z; w[4 * r + 3] = v.w;
        }
    }
}

// isum[i][c] += sum over the slot's 32 k of code(k, column c) * a_i[k], aw[i]: a_i's 32 codes, 4 per word.
// int4 sums biased codes (code + 8): the caller subtracts 8 * sum(a_i). The high nibbles are multiplied in
// place (16 x code), so their sum is shifted back, exactly, once per slot.
template <int BITS, int MR>
__device__ __forceinline__ void dot_slot(const unsigned (&w)[BITS == 8 ? 32 : 16], const int (&aw)[MR][8],
                                         int (&isum)[MR][4]) {
    if constexpr (BITS == 8) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {      // 8 quads of 4 rows
            u32 cw[4];
            transpose4x4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3], cw[0], cw[1], cw[2], cw[3]);
#pragma unroll
            for (int i = 0; i < MR; ++i)
#pragma unroll
                for (int c = 0; c < 4; ++c) isum[i][c] = __dp4a((int)cw[c], aw[i][j], isum[i][c]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < MR; ++i) {
            int hi[4] = {0, 0, 0, 0};
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    isum[i][c] = __dp4a((int)(w[4 * r + c] & NIB_LO), aw[i][2 * r], isum[i][c]);
                    hi[c] = dp4a_us(w[4 * r + c] & NIB_HI, aw[i][2 * r + 1], hi[c]);
                }
#pragma unroll
            for (int c = 0; c < 4; ++c) isum[i][c] += hi[c] >> 4;
        }
    }
}

// ------------------------------------------------------------------------------------------------------
// Where the q|k|v heads go (qkv_rope, and qgemv's epilogue at M = 1): per-head rmsnorm weights (null: none),
// the RoPE tables [positions][hd / 2], the position, q [H * hd] of the row, and this layer's KV cache.
struct QkvRope {
    const float* qnorm;
    const float* knorm;
    const float* cosT;
    const float* sinT;
    const int* meta;
    float* qout;
    float* kc;
    float* vc;
    int H, KV, cap;
    float eps;
};

// One warp: head ``head`` (q: < H, k: < H + KV, then v) of a q|k|v row, src its hd values: q and k heads
// get the optional per-head rmsnorm and RoPE at pos, to qout or the key cache; v heads go to the value cache.
__device__ __forceinline__ void rope_head(const QkvRope& qr, const float* src, int head, int hd, int pos,
                                          int lane)
{
    const int H = qr.H, KV = qr.KV;
    if (head >= H + KV) {
        float* vdst = qr.vc + ((size_t)(head - H - KV) * qr.cap + pos) * hd;
        for (int d = lane; d < hd; d += 32) vdst[d] = src[d];
        return;
    }
    const bool isq = head < H;
    const int kvh = head - H;
    const int half = hd / 2;
    const float* nw = isq ? qr.qnorm : qr.knorm;
    const float* cs = qr.cosT + (size_t)pos * half;
    const float* sn = qr.sinT + (size_t)pos * half;
    float x1[2], x2[2], c[2], s[2];
    float ss = 0.f;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const int i = lane + 32 * t;
        x1[t] = x2[t] = c[t] = s[t] = 0.f;
        if (i < half) { x1[t] = src[i]; x2[t] = src[i + half]; c[t] = cs[i]; s[t] = sn[i]; }
        ss += x1[t] * x1[t] + x2[t] * x2[t];
    }
    if (nw) {
        ss = warp_sum(ss);
        const float r = sqrtf(ss / (float)hd + qr.eps);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const int i = lane + 32 * t;
            if (i < half) { x1[t] = x1[t] / r * nw[i]; x2[t] = x2[t] / r * nw[i + half]; }
        }
    }
    float* dst = isq ? qr.qout + (size_t)head * hd : qr.kc + ((size_t)kvh * qr.cap + pos) * hd;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const int i = lane + 32 * t;
        if (i < half) {
            dst[i] = x1[t] * c[t] - x2[t] * s[t];
            dst[i + half] = x2[t] * c[t] + x1[t] * s[t];
        }
    }
}

// ------------------------------------------------------------------------------------------------------
// Quantized GEMV / small-M GEMM with the activation prologue fused in.
//
// out[m][n] = sum_g (sum_{k in g} Aq[m][k] Wq[k][n]) * a_scale[m][g] * w_scale[g][n]   (integer block sums)
// where A = prologue(X): pro 0: X; pro 1: rmsnorm(X, pw, eps); pro 2: silu(X[:, k]) * X[:, k + xoff],
// quantized per G-block exactly as contract.quantize_activations.
// Grid: x = column tiles of TN, y = K splits (chunks of KC strided by gridDim.y), z = row blocks of MR.
// A chunk is 256 rows, one 32-row slot a warp (int8: 32 KB, int4: 16 KB). int4 chunks of 512 rows (two slots
// a warp, 32 KB like int8) measured slower: 2,250 against 2,010 us per qwen3-8b q4 step (docs/performance.md).
// With gridDim.y > 1 (M = 1 only) the K splits' partial sums are added in y order (deterministic, graph-safe,
// the same bits every way): launched as one cluster per tile (gridDim.y <= MAX_CLUSTER), the cluster's other
// blocks push theirs into block 0's shared memory and exit; with ``epochs`` (forward_ops.tagged_merge: grids of more
// than one wave) every split stores them tagged in ``merge`` (st_tagged), the tile's last split polls for them
// and the others exit at once, freeing their SM slots for the next wave; otherwise each block writes them to
// part[y][m][Npad] and the last block of a tile to arrive on its counter (then reset) reads them back.
// Epilogue: epi 0: Y = acc (+ bias); epi 1: Y += acc (+ bias). With qout (M = 1, the q|k|v projection,
// hd == TN: tile x is head x; the other pointers and H, KV, cap as QkvRope's, eps the prologue's) the tile's
// outputs go through rope_head instead of to Y: qkv_rope's work, in the block that has the head's sums,
// without a kernel of its own.
template <int BITS, int G, int MR>
__global__ void __launch_bounds__(NT, MR == 1 ? 4 : 1) qgemv(
    const unsigned char* __restrict__ W, const float* __restrict__ WS, int K, int N, int Npad,
    const float* __restrict__ X, int ldx, int M, int pro, const float* __restrict__ pw, float eps, int xoff,
    float* __restrict__ Y, int ldy, int epi, const float* __restrict__ bias,
    float* __restrict__ part, int* __restrict__ counters, unsigned long long* __restrict__ merge,
    unsigned* __restrict__ epochs, const float* __restrict__ ssq_in, float* __restrict__ ssq_out,
    const float* qnorm, const float* knorm, const float* cosT, const float* sinT, const int* meta, float* qout,
    float* kc, float* vc, int H, int KV, int cap)
{
    constexpr int KC = NT;                      // rows of a chunk: one 32-row slot a warp, one row a thread
    constexpr int NW = BITS == 8 ? 32 : 16;     // 4-byte words of one slot
    KT_BEGIN
    grid_dep_launch();  // the wait follows the block's first weight loads
    __shared__ int s_aq[MR][KC / 4];            // activation codes of this chunk, 4 per word
    __shared__ float s_as[MR][KC / 32];         // activation scale per group (G = 256: element 0)
    __shared__ int s_asum[MR][KC / 32];         // sum of activation codes per group (int4 bias)
    __shared__ float s_r[MR];                   // rmsnorm denominators
    __shared__ float s_red[NT / 32];
    __shared__ __align__(16) int s_acc[NT / 32][MR][TN];  // per-warp partial results (float bits; ints at G=256)
    __shared__ float s_part[MR][TN];            // with qout: the head's outputs for rope_head
    __shared__ float s_push[MR == 1 ? MAX_CLUSTER : 1][TN];  // cluster block 0: the other blocks' sums
    __shared__ __align__(8) unsigned long long s_push_bar;    // counts their bytes
    __shared__ int s_last;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n0 = blockIdx.x * TN;
    const int col = n0 + 4 * lane;
    const int m0 = blockIdx.z * MR;
    const int nck = (K + KC - 1) / KC;
    const unsigned csize = cluster_size();     // > 1: the tile's K splits are this cluster (csize == gridDim.y)
    // otherwise the K splits merge through ``merge`` (null epochs: through part and counters)
    const bool tagged = MR == 1 && gridDim.y > 1 && epochs != nullptr && csize == 1;
    if (MR == 1 && csize > 1) {                 // before any block of the cluster can send its sums
        if (cluster_rank() == 0 && threadIdx.x == 0) {
            mbar_init(&s_push_bar, 1);
            mbar_init_fence();
            mbar_expect_tx(&s_push_bar, (csize - 1) * TN * sizeof(float));
        }
        cluster_arrive();
    }
    unsigned epoch = 0;                         // tagged: the tile's, read after the PDL wait
    const bool colok = col < Npad;
    float acc[MR];
    // G = 32: each warp quantizes exactly its own slot's rows, so the chunk's activations need no block
    // barrier before the dot, and the first chunk none before them either (every warp computes the tile-sums
    // norm itself, r1: the same bits as one warp's)
    constexpr bool warp_local = G == 32;
    float r1 = 0.f;
#pragma unroll
    for (int i = 0; i < MR; ++i) acc[i] = 0.f;

    unsigned wr[NW];
    float4 ws;                                  // G = 32: weight scales of the warp's slot
    float wsg = 0.f;                            // G = 256: weight scale of the chunk's group (tid < TN)
    for (int c = blockIdx.y; c < nck; c += gridDim.y) {
        const int k0 = c * KC;
        const int kw = k0 + 32 * warp;          // first weight row of this warp's slot
        // Issue the weight and weight-scale loads first: they do not depend on the activations, so the
        // prologue below runs while they are in flight.
        if (colok && kw < K) {
            load_slot<BITS>(W, Npad, kw, col, wr);
            if (G == 32) ws = ld_stream(reinterpret_cast<const float4*>(WS + (size_t)(kw / 32) * Npad + col));
        }
        if (G != 32 && tid < TN && n0 + tid < Npad) wsg = __ldg(WS + (size_t)(k0 / G) * Npad + n0 + tid);
        // rmsnorm weight of this thread's chunk row (not step data)
        const float pwv = pro == 1 && k0 + tid < K ? __ldg(pw + k0 + tid) : 0.f;
        if (c == (int)blockIdx.y) {
            grid_dep_wait();                    // X (and the epoch) come from the kernels before this one
            if (tagged) epoch = __ldcg(epochs + blockIdx.x);
        }
        KT_WAITED
        // MR = 1: the thread's input (and SiLU*up's up value), loaded before the norm's sums and the barrier
        // below, so that the round trips overlap (measured 100-130 us per q4 step faster). Through L2
        // (ld.global.cg): a plain load of this const __restrict__ row compiles to ld.global.nc, which may be
        // scheduled above griddepcontrol.wait and read the previous step's values (measured: wrong logits).
        constexpr bool early = MR == 1;
        const bool eok = early && m0 < M && k0 + tid < K;
        const float xe = eok ? __ldcg(X + (size_t)m0 * ldx + k0 + tid) : 0.f;
        const float ue = eok && pro == 2 ? __ldcg(X + (size_t)m0 * ldx + k0 + tid + xoff) : 0.f;
        if (pro == 1 && c == (int)blockIdx.y && ssq_in) {  // M = 1: from the tile sums
            r1 = rms_from_tiles(ssq_in, K, eps);  // every warp: s_r is not needed (ssq_in implies MR = 1)
        } else if (pro == 1 && c == (int)blockIdx.y) {
            // rmsnorm denominators over the whole row, computed (identically) by every block, while its
            // first weight loads are in flight
            for (int i = 0; i < MR; ++i) {
                const int m = m0 + i;
                float ss = 0.f;
                if (m < M) {
                    const float* xr = X + (size_t)m * ldx;
#pragma unroll 8
                    for (int k = tid; k < K; k += NT) { const float v = xr[k]; ss += v * v; }
                }
                ss = block_sum(ss, s_red);
                if (tid == 0) s_r[i] = sqrtf(ss / (float)K + eps);
            }
        }
        if (!(warp_local && c == (int)blockIdx.y && (pro != 1 || ssq_in)))
            __syncthreads();  // the previous chunk is done with s_aq / s_acc; s_r is visible
        for (int i = 0; i < MR; ++i) {          // chunk row tid: this thread's
            const int m = m0 + i;
            const int k = k0 + tid;
            float v = 0.f;
            if (m < M && k < K) {
                const float* xr = X + (size_t)m * ldx;
                const float xk = early ? xe : xr[k];
                if (pro == 1) {
                    v = xk / (MR == 1 && ssq_in ? r1 : s_r[i]) * pwv;
                } else if (pro == 2) {
                    v = xk / (1.f + expf(-xk)) * (early ? ue : xr[k + xoff]);
                } else {
                    v = xk;
                }
            }
            float amax = warp_max(fabsf(v));
            if (G != 32) {                      // G = 256: the block's
                __syncthreads();
                if (lane == 0) s_red[warp] = amax;
                __syncthreads();
                amax = s_red[0];
#pragma unroll
                for (int w = 1; w < NT / 32; ++w) amax = fmaxf(amax, s_red[w]);
            }
            const float d = amax / 127.f;
            const float inv = d == 0.f ? 0.f : 1.f / d;
            const int q = (int)roundf(v * inv);  // roundf: half away from zero, like ggml
            reinterpret_cast<signed char*>(s_aq[i])[tid] = (signed char)q;
            const int gq = G == 32 ? warp : 0;  // the group's index in the chunk
            if (BITS == 4) {
                int qs = warp_isum(q);
                if (G == 32) {
                    if (lane == 0) s_asum[i][gq] = qs;
                } else {
                    __syncthreads();
                    if (lane == 0) s_red[warp] = __int_as_float(qs);
                    __syncthreads();
                    if (tid == 0) {
                        int t = 0;
                        for (int w = 0; w < NT / 32; ++w) t += __float_as_int(s_red[w]);
                        s_asum[i][gq] = t;
                    }
                }
            }
            if (G == 32) { if (lane == 0) s_as[i][gq] = d; }
            else { if (tid == 0) s_as[i][gq] = d; }
        }
        if constexpr (warp_local) __syncwarp();
        else __syncthreads();

        // this warp's slot: chunk rows 32 * warp .. 32 * warp + 31 (G = 32: group warp of the chunk)
        int isum[MR][4];
#pragma unroll
        for (int i = 0; i < MR; ++i) isum[i][0] = isum[i][1] = isum[i][2] = isum[i][3] = 0;
        const bool active = colok && kw < K;    // the same for every lane of the warp
        if (active) {
            int aw[MR][8];
#pragma unroll
            for (int i = 0; i < MR; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) aw[i][j] = s_aq[i][8 * warp + j];
            dot_slot<BITS, MR>(wr, aw, isum);
        }
#pragma unroll
        for (int i = 0; i < MR; ++i) {          // one 16-byte store a lane: no shared-memory bank conflicts
            int4 r = make_int4(isum[i][0], isum[i][1], isum[i][2], isum[i][3]);  // (0.f bits when inactive)
            if (G == 32 && active) {            // ws is loaded only for an active slot
                const float as = s_as[i][warp];
                const int bias8 = BITS == 4 ? 8 * s_asum[i][warp] : 0;
                r = make_int4(__float_as_int((float)(isum[i][0] - bias8) * as * ws.x),
                              __float_as_int((float)(isum[i][1] - bias8) * as * ws.y),
                              __float_as_int((float)(isum[i][2] - bias8) * as * ws.z),
                              __float_as_int((float)(isum[i][3] - bias8) * as * ws.w));
            }
            *reinterpret_cast<int4*>(&s_acc[warp][i][4 * lane]) = r;
        }
        __syncthreads();
        if (tid < TN && n0 + tid < Npad) {
#pragma unroll
            for (int i = 0; i < MR; ++i) {
                if (G == 32) {
                    float s = 0.f;
#pragma unroll
                    for (int w = 0; w < NT / 32; ++w) s += __int_as_float(s_acc[w][i][tid]);
                    acc[i] += s;
                } else {                        // G = 256: the chunk is one group
                    int t = 0;
#pragma unroll
                    for (int w = 0; w < NT / 32; ++w) t += s_acc[w][i][tid];
                    if (BITS == 4) t -= 8 * s_asum[i][0];
                    acc[i] += (float)t * s_as[i][0] * wsg;
                }
            }
        }
    }

    grid_dep_wait();  // blocks without a chunk: before the epoch (a no-op once waited)
    if (tagged && (int)blockIdx.y >= nck) epoch = __ldcg(epochs + blockIdx.x);
    KT_WAITED
    KT_DONE
    // the epilogue's inputs from earlier kernels, loaded now: their round trip overlaps the merge's
    float yin[MR], bn = 0.f;
    const int n = n0 + tid;
    const bool nok = tid < TN && n < N;
#pragma unroll
    for (int i = 0; i < MR; ++i) yin[i] = nok && epi == 1 && m0 + i < M ? Y[(size_t)(m0 + i) * ldy + n] : 0.f;
    if (nok && bias) bn = bias[n];
    if (MR == 1 && csize > 1) {                 // the cluster's shared memory: pushed to block 0
        const unsigned rank = cluster_rank();
        if (rank != 0) {
            cluster_wait();                     // block 0's barrier is initialised
            if (tid < TN) push_to_rank0(&s_push[rank][tid], &s_push_bar, acc[0]);
            KT_END((size_t)W) return;
        }
        mbar_wait(&s_push_bar, 0);
        if (tid < TN) {                         // in rank order: the same bits as the L2 merges
            float sum = 0.f;
            sum += acc[0];
            for (unsigned r = 1; r < csize; ++r) sum += s_push[r][tid];
            acc[0] = sum;
        }
    } else if (tagged) {
        unsigned long long* slots = merge + (size_t)blockIdx.x * MERGE_SPLITS * TN + tid;  // split 0's, column tid
        const unsigned tag = epoch + 1;
        const int ns = gridDim.y;
        constexpr int PB = 8;                   // polls in flight per thread (16: 12-20 bytes of spills, slower)
        if (tid < TN) st_tagged(slots + (size_t)blockIdx.y * TN, acc[0], tag);
        if ((int)blockIdx.y != ns - 1) { KT_END((size_t)W) return; }  // the tile's last split merges
        if (tid < TN) {
            float sum = 0.f;
            for (int y0 = 0; y0 < ns; y0 += PB) {  // PB slots at once, polled together until all are tagged
                unsigned long long w[PB];
#pragma unroll
                for (int j = 0; j < PB; ++j) w[j] = y0 + j < ns ? ld_tagged(slots + (size_t)(y0 + j) * TN) : 0ull;
                for (;;) {
                    bool ready = true;
#pragma unroll
                    for (int j = 0; j < PB; ++j) ready &= y0 + j >= ns || (unsigned)(w[j] >> 32) == tag;
                    if (ready) break;
#pragma unroll
                    for (int j = 0; j < PB; ++j)
                        if (y0 + j < ns && (unsigned)(w[j] >> 32) != tag)
                            w[j] = ld_tagged(slots + (size_t)(y0 + j) * TN);
                }
#pragma unroll
                for (int j = 0; j < PB; ++j) if (y0 + j < ns) sum += __uint_as_float((unsigned)w[j]);
            }
            acc[0] = sum;
        }
        if (tid == 0) epochs[blockIdx.x] = tag;
    } else if (gridDim.y > 1) {
        if (tid < TN && n0 + tid < Npad) {
            for (int i = 0; i < MR; ++i) {
                const int m = m0 + i;
                if (m < M) part[((size_t)blockIdx.y * M + m) * Npad + n0 + tid] = acc[i];
            }
        }
        const int tile = blockIdx.z * gridDim.x + blockIdx.x;
        if (!arrive_last(&counters[tile], gridDim.y, &s_last)) { KT_END((size_t)W) return; }
        if (tid < TN && n0 + tid < Npad) {
            for (int i = 0; i < MR; ++i) {
                const int m = m0 + i;
                float s = 0.f;
                if (m < M) {
#pragma unroll 16
                    for (int y = 0; y < (int)gridDim.y; ++y)  // up to 16 partials in flight at once
                        s += __ldcg(part + ((size_t)y * M + m) * Npad + n0 + tid);
                }
                acc[i] = s;
            }
        }
        if (tid == 0) counters[tile] = 0;
    }

    if (MR == 1 && qout) {
        if (tid < TN) s_part[0][tid] = nok ? (bias ? acc[0] + bn : acc[0]) : 0.f;
        __syncthreads();
        const QkvRope qr = {qnorm, knorm, cosT, sinT, meta, qout, kc, vc, H, KV, cap, eps};
        if (warp == 0) rope_head(qr, s_part[0], blockIdx.x, TN, meta[0], lane);
        KT_END((size_t)W | 1)
        return;
    }
    float y0 = 0.f;                             // row m0's output (ssq_out: M = 1)
    if (nok) {
        for (int i = 0; i < MR; ++i) {
            const int m = m0 + i;
            if (m >= M) continue;
            float y = acc[i];
            if (bias) y = y + bn;
            y = epi == 1 ? yin[i] + y : y;
            Y[(size_t)m * ldy + n] = y;
            if (i == 0) y0 = y;
        }
    }
    if (ssq_out && warp < TN / 32 && n0 + 32 * warp < N) store_warp_ssq(y0, ssq_out, n0 + 32 * warp);
    KT_END((size_t)W | 1)
}

// ------------------------------------------------------------------------------------------------------
// M = 1 GEMV, streaming: the decode step's projections (and lm_head).
//
// Same result definition as qgemv. Block: 8 warps on one column tile of TN = 128 columns (lane: 4 columns),
// grid x = column tiles, y = K splits (contiguous runs of whole G-groups).
// The block first quantizes the activations of its K run once into shared memory (RMSNorm / SiLU*up,
// Q8_0 per group, one warp per group), while the first weight loads are in flight; then every warp streams
// its groups (w, w + 8, ...) with no block barrier: a register ring of NB 32-row slots, the slot NB ahead
// loaded as soon as one is consumed, so each warp keeps its next slots' weights in flight while it reduces
// the current one. Warps are added in a fixed order, then the splits (last block of a tile, as qgemv).
// (Reloading quad by quad, as each 4 rows are transposed, and 32-column tiles whose lane quarters take 4
// groups at once, without K splits, measured slower: docs/performance.md.)
#define SMAXK 16384     // K rows one block of qgemv_m1 may quantize into shared memory
#define M1_WARPS (NT / 32)
#define LOAD_M1(b, t)                                                                                      \
    do {                                                                                                   \
        const int kr_ = k_base + (warp + M1_WARPS * ((t) / SPU)) * G + ((t) % SPU) * 32;                   \
        load_slot<BITS>(W, Npad, kr_, col, ring[b]);                                                       \
        ring_s[b] = ld_stream(reinterpret_cast<const float4*>(WS + (size_t)(kr_ / G) * Npad + col));       \
    } while (0)

template <int BITS, int G>
__global__ void __launch_bounds__(NT, 2) qgemv_m1(
    const unsigned char* __restrict__ W, const float* __restrict__ WS, int K, int N, int Npad,
    const float* __restrict__ X, int pro, const float* __restrict__ pw, float eps, int xoff,
    float* __restrict__ Y, int epi, const float* __restrict__ bias,
    float* __restrict__ part, int* __restrict__ counters, const float* __restrict__ ssq_in, float* __restrict__ ssq_out)
{
    constexpr int NW = BITS == 8 ? 32 : 16;     // 4-byte words a lane loads per 32-row slot
    constexpr int SPU = G / 32;                 // slots per group
    constexpr int NB = BITS == 8 ? 2 : 4;       // slots in the register ring (64 words: 8 KB a warp in flight)
    __shared__ __align__(16) int s_aq[SMAXK / 4];   // activation codes of the block's K run, 4 per word
    __shared__ float s_as[SMAXK / 32];          // per group: activation scale
    __shared__ int s_asum[SMAXK / 32];          // per group: sum of activation codes (int4 bias)
    __shared__ __align__(16) float s_acc[M1_WARPS][TN];
    __shared__ float s_red[M1_WARPS];
    __shared__ int s_last;

    grid_dep_launch();
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n0 = blockIdx.x * TN;
    const int col = n0 + 4 * lane;
    const bool colok = col < Npad;
    const int groups = K / G;
    const int per = (groups + (int)gridDim.y - 1) / (int)gridDim.y;
    const int g0 = blockIdx.y * per;
    const int ng = max(0, min(groups, g0 + per) - g0);        // groups of this block
    const int k_base = g0 * G;
    const int nt = (colok && ng > warp) ? ((ng - warp + M1_WARPS - 1) / M1_WARPS) * SPU : 0;  // this warp's slots

    unsigned ring[NB][NW];
    float4 ring_s[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b)
        if (b < nt) LOAD_M1(b, b);

    grid_dep_wait();  // X (and part / counters) come from the kernels before this one
    float r = 0.f;
    if (pro == 1 && ssq_in) {
        r = rms_from_tiles(ssq_in, K, eps);  // every warp: the same bits
    } else if (pro == 1) {   // rmsnorm denominator of the whole row, the same bits in every block
        float ss = 0.f;
#pragma unroll 16
        for (int k = tid; k < K; k += NT) { const float v = X[k]; ss += v * v; }
        ss = block_sum(ss, s_red);
        r = sqrtf(ss / (float)K + eps);
    }
    // One warp per group, UQ groups per pass so that a lane's 8 loads of a pass are in flight together.
    constexpr int UQ = SPU >= 8 ? 1 : 8 / SPU;
    for (int gb = warp; gb < ng; gb += M1_WARPS * UQ) {
        float v[UQ][SPU];
#pragma unroll
        for (int u = 0; u < UQ; ++u) {
            const int gl = gb + M1_WARPS * u;
#pragma unroll
            for (int i = 0; i < SPU; ++i) {
                const int k = k_base + gl * G + 32 * i + lane;
                v[u][i] = 0.f;
                if (gl < ng) {
                    float x = X[k];
                    if (pro == 1) x = x / r * pw[k];
                    else if (pro == 2) x = x / (1.f + expf(-x)) * X[k + xoff];
                    v[u][i] = x;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UQ; ++u) {
            const int gl = gb + M1_WARPS * u;
            if (gl >= ng) break;                  // the same for every lane of the warp
            float amax = 0.f;
#pragma unroll
            for (int i = 0; i < SPU; ++i) amax = fmaxf(amax, fabsf(v[u][i]));
            amax = warp_max(amax);
            const float d = amax / 127.f;
            const float inv = d == 0.f ? 0.f : 1.f / d;
            signed char* dst = reinterpret_cast<signed char*>(s_aq) + gl * G + lane;
            int qs = 0;
#pragma unroll
            for (int i = 0; i < SPU; ++i) {
                const int q = (int)roundf(v[u][i] * inv);  // roundf: half away from zero, like ggml
                dst[32 * i] = (signed char)q;
                qs += q;
            }
            if (BITS == 4) qs = warp_isum(qs);
            if (lane == 0) { s_as[gl] = d; s_asum[gl] = qs; }
        }
    }
    __syncthreads();

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    int isum[1][4] = {{0, 0, 0, 0}};            // integer sums of the current group
    for (int t0 = 0; t0 < nt; t0 += NB) {
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const int t = t0 + b;
            if (t < nt) {
                const int gl = warp + M1_WARPS * (t / SPU);
                const int sub = t % SPU;
                const int4* ap = reinterpret_cast<const int4*>(s_aq + (gl * G + sub * 32) / 4);
                const int4 a0 = ap[0], a1 = ap[1];
                const int aw[1][8] = {{a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w}};
                dot_slot<BITS, 1>(ring[b], aw, isum);
                if (sub == SPU - 1) {              // the group is complete: scale it like the reference
                    const float as = s_as[gl];
                    const int bias8 = BITS == 4 ? 8 * s_asum[gl] : 0;
                    const float4 ws = ring_s[b];
                    acc[0] += (float)(isum[0][0] - bias8) * as * ws.x;
                    acc[1] += (float)(isum[0][1] - bias8) * as * ws.y;
                    acc[2] += (float)(isum[0][2] - bias8) * as * ws.z;
                    acc[3] += (float)(isum[0][3] - bias8) * as * ws.w;
                    isum[0][0] = isum[0][1] = isum[0][2] = isum[0][3] = 0;
                }
                if (t + NB < nt) LOAD_M1(b, t + NB);
            }
        }
    }

    *reinterpret_cast<float4*>(&s_acc[warp][4 * lane]) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();
    const int n = n0 + tid;
    float y = 0.f;
    if (tid < TN) {
        y = s_acc[0][tid];
#pragma unroll
        for (int w = 1; w < M1_WARPS; ++w) y += s_acc[w][tid];
    }
    if (gridDim.y > 1) {
        if (tid < TN && n < Npad) part[(size_t)blockIdx.y * Npad + n] = y;
        if (!arrive_last(&counters[blockIdx.x], gridDim.y, &s_last)) return;
        if (tid < TN && n < Npad) {
            y = 0.f;
#pragma unroll 16
            for (int s = 0; s < (int)gridDim.y; ++s) y += __ldcg(part + (size_t)s * Npad + n);
        }
        if (tid == 0) counters[blockIdx.x] = 0;
    }
    if (tid < TN && n < N) {
        if (bias) y = y + bias[n];
        y = epi == 1 ? Y[n] + y : y;
        Y[n] = y;
    }
    if (ssq_out && warp < TN / 32 && n0 + 32 * warp < N) store_warp_ssq(tid < TN && n < N ? y : 0.f, ssq_out, n0 + 32 * warp);
}

// ------------------------------------------------------------------------------------------------------
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

// ------------------------------------------------------------------------------------------------------
// The decode step's last kernel: the greedy token of the logits row, numpy's argmax (the first index of the
// largest logit; a NaN counts as largest). Each block reduces FIN_T * FIN_E columns to (value, index) in
// bval / bidx; the last block to arrive reduces those and writes meta[1] = token (the next step's input),
// meta[0] += 1 (its position) while below limit (the KV capacity: a graph replayed without a new position
// never writes past the cache), tokens[position % ntok] = token (pinned host memory, which the host reads
// once the step's event has completed: the pipelined greedy decode of forward.py).
#define FIN_T 256
#define FIN_E 4
__device__ __forceinline__ bool argmax_beats(float va, int ia, float vb, int ib) {
    const bool na = va != va, nb = vb != vb;
    if (na || nb) return na && (!nb || ia < ib);
    return va > vb || (va == vb && ia < ib);
}

__device__ __forceinline__ void block_argmax(float& v, int& i, float* s_v, int* s_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, v, o);
        const int oi = __shfl_down_sync(0xffffffffu, i, o);
        if (argmax_beats(ov, oi, v, i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (lane == 0) { s_v[warp] = v; s_i[warp] = i; }
    __syncthreads();
    v = s_v[0]; i = s_i[0];
    for (int w = 1; w < FIN_T / 32; ++w)
        if (argmax_beats(s_v[w], s_i[w], v, i)) { v = s_v[w]; i = s_i[w]; }
}

extern "C" __global__ void __launch_bounds__(FIN_T) lm_finish(
    const float* __restrict__ logits, int N, float* __restrict__ bval, int* __restrict__ bidx,
    int* __restrict__ counter, int* __restrict__ meta, int limit, int* __restrict__ tokens, int ntok)
{
    KT_BEGIN
    grid_dep_launch();
    grid_dep_wait();
    __shared__ float s_v[FIN_T / 32];
    __shared__ int s_i[FIN_T / 32];
    __shared__ int s_last;
    const int tid = threadIdx.x;
    float v[FIN_E];
#pragma unroll
    for (int e = 0; e < FIN_E; ++e) {
        const int n = (blockIdx.x * FIN_E + e) * FIN_T + tid;
        v[e] = n < N ? __ldcg(logits + n) : 0.f;
    }
    float bv = NEG_INF;
    int bi = 0x7fffffff;
#pragma unroll
    for (int e = 0; e < FIN_E; ++e) {
        const int n = (blockIdx.x * FIN_E + e) * FIN_T + tid;
        if (n < N && argmax_beats(v[e], n, bv, bi)) { bv = v[e]; bi = n; }
    }
    block_argmax(bv, bi, s_v, s_i);
    if (tid == 0) { bval[blockIdx.x] = bv; bidx[blockIdx.x] = bi; }
    if (!arrive_last(counter, gridDim.x, &s_last)) { KT_END(0) return; }
    bv = NEG_INF;
    bi = 0x7fffffff;
    for (int b = tid; b < (int)gridDim.x; b += FIN_T) {
        const float ov = __ldcg(bval + b);
        const int oi = __ldcg(bidx + b);
        if (argmax_beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    block_argmax(bv, bi, s_v, s_i);
    if (tid == 0) {
        *counter = 0;
        const int pos = meta[0];
        meta[1] = bi;
        if (pos + 1 < limit) meta[0] = pos + 1;
        volatile int* t = tokens;
        t[pos % ntok] = bi;
    }
    KT_END(0)
}

// ------------------------------------------------------------------------------------------------------
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

// ------------------------------------------------------------------------------------------------------
// Per head of the qkv rows: optional per-head rmsnorm (Qwen3 q_norm/k_norm), RoPE (rotate_half) at the
// absolute position meta[0] + m, then q -> qout [M][H*hd] and k, v -> this layer's cache at that position.
// One warp per head (4 per block), no block barriers. Grid: x = ceil((H + 2 KV) / 4), y = M; hd <= 128.
// At M = 1 with hd == TN the q|k|v GEMV does this in its epilogue instead (qgemv's qr), one head a tile.
#define RW 4
extern "C" __global__ void __launch_bounds__(RW * 32) qkv_rope(
    const float* __restrict__ qkv, int ldqkv, int H, int KV, int hd,
    const float* __restrict__ qnorm, const float* __restrict__ knorm, float eps,
    const float* __restrict__ cosT, const float* __restrict__ sinT, const int* __restrict__ meta,
    float* __restrict__ qout, float* __restrict__ kc, float* __restrict__ vc, int cap)
{
    KT_BEGIN
    grid_dep_launch();
    grid_dep_wait();
    KT_WAITED
    KT_DONE
    KT_END((size_t)kc | 2)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = blockIdx.x * RW + warp, m = blockIdx.y;
    if (head >= H + 2 * KV) return;
    const QkvRope qr = {qnorm, knorm, cosT, sinT, meta, qout + (size_t)m * H * hd, kc, vc, H, KV, cap, eps};
    rope_head(qr, qkv + (size_t)m * ldqkv + (size_t)head * hd, head, hd, meta[0] + m, lane);
}

// ------------------------------------------------------------------------------------------------------
// Decode attention (one query row at position meta[0], keys 0..meta[0]), split over positions.
// Grid: x = H, y = NS splits; block 128 (4 warps). Each warp runs an online softmax over groups of AB
// positions (their keys and values loaded together: AB x 2 x hd/32 loads in flight per lane); the block
// merges its warps, writes (max, sum, acc[hd]) to part[h][split], and the last block of a head merges the
// NS splits (every split's partial loaded at once, merge weights computed once, fixed order). q is scaled
// by 1/sqrt(hd) before the dot products.
#define AW 4
#define AB 8
#define MAXJ 4   // hd <= 128
template <int NS>
__global__ void __launch_bounds__(AW * 32) attn_decode(
    const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc, int cap, int H,
    int KV, int hd, float scale, const int* __restrict__ meta, float* __restrict__ part,
    int* __restrict__ counters, float* __restrict__ out)
{
    KT_BEGIN
    grid_dep_launch();
    grid_dep_wait();
    KT_WAITED
    __shared__ float s_m[NS], s_l[NS], s_w[NS];
    __shared__ float s_acc[AW][128];
    __shared__ int s_last;
    const int h = blockIdx.x, split = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int len = meta[0] + 1;
    const int chunk = (len + NS - 1) / NS;
    const int pb = split * chunk;
    const int pe = min(len, pb + chunk);
    const int kvh = h / (H / KV);
    const float* kb = kc + (size_t)kvh * cap * hd;
    const float* vb = vc + (size_t)kvh * cap * hd;
    float qr[MAXJ], acc[MAXJ];
#pragma unroll
    for (int j = 0; j < MAXJ; ++j) {
        const int d = lane + 32 * j;
        qr[j] = d < hd ? q[(size_t)h * hd + d] * scale : 0.f;
        acc[j] = 0.f;
    }
    float mx = NEG_INF, l = 0.f;
    for (int p0 = pb + AB * warp; p0 < pe; p0 += AB * AW) {
        float kr[AB][MAXJ], vr[AB][MAXJ];
#pragma unroll
        for (int b = 0; b < AB; ++b) {
            const int p = p0 + b;
#pragma unroll
            for (int j = 0; j < MAXJ; ++j) {
                const int d = lane + 32 * j;
                const bool ok = p < pe && d < hd;
                kr[b][j] = ok ? kb[(size_t)p * hd + d] : 0.f;
                vr[b][j] = ok ? vb[(size_t)p * hd + d] : 0.f;
            }
        }
        float sc[AB];
#pragma unroll
        for (int b = 0; b < AB; ++b) {
            float t = 0.f;
#pragma unroll
            for (int j = 0; j < MAXJ; ++j) t += qr[j] * kr[b][j];
            sc[b] = t;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int b = 0; b < AB; ++b) sc[b] += __shfl_xor_sync(FULL, sc[b], o);
        float mb = NEG_INF;
#pragma unroll
        for (int b = 0; b < AB; ++b) if (p0 + b < pe) mb = fmaxf(mb, sc[b]);
        const float mn = fmaxf(mx, mb);
        const float corr = expf(mx - mn);
        l *= corr;
#pragma unroll
        for (int j = 0; j < MAXJ; ++j) acc[j] *= corr;
#pragma unroll
        for (int b = 0; b < AB; ++b) {
            if (p0 + b < pe) {
                const float e = expf(sc[b] - mn);
                l += e;
#pragma unroll
                for (int j = 0; j < MAXJ; ++j) acc[j] += e * vr[b][j];
            }
        }
        mx = mn;
    }
    if (lane == 0) { s_m[warp] = mx; s_l[warp] = l; }
#pragma unroll
    for (int j = 0; j < MAXJ; ++j) {
        const int d = lane + 32 * j;
        if (d < hd) s_acc[warp][d] = acc[j];
    }
    __syncthreads();
    float* pp = part + ((size_t)h * NS + split) * (hd + 2);
    float bm = NEG_INF;
#pragma unroll
    for (int w = 0; w < AW; ++w) bm = fmaxf(bm, s_m[w]);
    float wgt[AW];
#pragma unroll
    for (int w = 0; w < AW; ++w) wgt[w] = s_l[w] > 0.f ? expf(s_m[w] - bm) : 0.f;
    if (threadIdx.x == 0) {
        float bl = 0.f;
#pragma unroll
        for (int w = 0; w < AW; ++w) bl += s_l[w] * wgt[w];
        pp[0] = bm;
        pp[1] = bl;
    }
    for (int d = threadIdx.x; d < hd; d += AW * 32) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < AW; ++w) a += s_acc[w][d] * wgt[w];
        pp[2 + d] = a;
    }
    KT_DONE
    if (!arrive_last(&counters[h], NS, &s_last)) { KT_END((size_t)kc | 4) return; }
    const float* ph = part + (size_t)h * NS * (hd + 2);
    if (threadIdx.x < NS) {
        s_m[threadIdx.x] = __ldcg(ph + (size_t)threadIdx.x * (hd + 2));
        s_l[threadIdx.x] = __ldcg(ph + (size_t)threadIdx.x * (hd + 2) + 1);
    }
    __syncthreads();
    float gm = NEG_INF;
#pragma unroll
    for (int t = 0; t < NS; ++t) gm = fmaxf(gm, s_m[t]);
    if (threadIdx.x < NS)
        s_w[threadIdx.x] = s_l[threadIdx.x] > 0.f ? expf(s_m[threadIdx.x] - gm) : 0.f;
    __syncthreads();
    float gl = 0.f;
#pragma unroll
    for (int t = 0; t < NS; ++t) gl += s_l[t] * s_w[t];
    for (int d = threadIdx.x; d < hd; d += AW * 32) {
        float v[NS];
#pragma unroll
        for (int t = 0; t < NS; ++t) v[t] = __ldcg(ph + (size_t)t * (hd + 2) + 2 + d);
        float a = 0.f;
#pragma unroll
        for (int t = 0; t < NS; ++t) a += v[t] * s_w[t];
        out[(size_t)h * hd + d] = a / gl;
    }
    if (threadIdx.x == 0) counters[h] = 0;
    KT_END((size_t)kc | 5)
}

// ------------------------------------------------------------------------------------------------------
// Prefill attention: rows m of q at positions meta[0] + m see keys 0..meta[0] + m (causal). 16 query rows
// per block (two per warp), so each key/value tile staged in shared memory (PT positions) serves 16
// queries, and 16-byte shared-memory reads: lane j scores key j against both of its warp's queries, then
// accumulates 4 consecutive dimensions of each. hd % 4 == 0, hd <= 128.
// Grid: x = H, y = ceil(M / 16); block 256; dynamic shared memory (32*(hd+4) + 32*hd + 16*hd) floats.
#define PT 32
#define PQ2 16
extern "C" __global__ void __launch_bounds__(256) attn_prefill(
    const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc, int cap, int H,
    int KV, int hd, float scale, const int* __restrict__ meta, int M, float* __restrict__ out)
{
    grid_dep_launch();
    grid_dep_wait();
    extern __shared__ float smem[];
    const int ldk = hd + 4;                 // keeps rows 16-byte aligned; per quarter-warp conflict-free
    float* ks = smem;                       // [PT][hd+4]
    float* vs = ks + PT * ldk;              // [PT][hd]
    float* qs = vs + PT * hd;               // [PQ2][hd]
    const int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = blockIdx.y * PQ2;
    const int ma = r0 + 2 * warp, mb = ma + 1;   // this warp's two query rows
    const int pos0 = meta[0];
    const int pmax = pos0 + min(M - 1, r0 + PQ2 - 1);
    const int pa = pos0 + ma, pbq = pos0 + mb;
    const int kvh = h / (H / KV);
    const float* kb = kc + (size_t)kvh * cap * hd;
    const float* vb = vc + (size_t)kvh * cap * hd;
    for (int i = threadIdx.x; i < PQ2 * hd; i += 256) {
        const int r = i / hd, d = i - r * hd;
        qs[i] = r0 + r < M ? q[(size_t)(r0 + r) * H * hd + h * hd + d] * scale : 0.f;
    }
    const int d4 = 4 * lane;                // this lane's 4 dimensions in the accumulation
    float acc_a[4] = {0.f, 0.f, 0.f, 0.f}, acc_b[4] = {0.f, 0.f, 0.f, 0.f};
    float mxa = NEG_INF, mxb = NEG_INF, la = 0.f, lb = 0.f;
    const float4* qa4 = reinterpret_cast<const float4*>(qs + (2 * warp) * hd);
    const float4* qb4 = reinterpret_cast<const float4*>(qs + (2 * warp + 1) * hd);
    for (int t0 = 0; t0 <= pmax; t0 += PT) {
        __syncthreads();
        for (int i = threadIdx.x; i < PT * hd; i += 256) {
            const int r = i / hd, d = i - r * hd;
            const int p = t0 + r;
            float kv = 0.f, vv = 0.f;
            if (p <= pmax) { kv = kb[(size_t)p * hd + d]; vv = vb[(size_t)p * hd + d]; }
            ks[r * ldk + d] = kv;
            vs[r * hd + d] = vv;
        }
        __syncthreads();
        if (ma >= M || t0 > pbq) continue;  // the warp's later row sees at least as far as its earlier one
        const int p = t0 + lane;
        const float4* k4 = reinterpret_cast<const float4*>(ks + lane * ldk);
        float da = 0.f, db = 0.f;
        for (int dd = 0; dd < hd / 4; ++dd) {
            const float4 kk = k4[dd], xa = qa4[dd], xb = qb4[dd];
            da += xa.x * kk.x; da += xa.y * kk.y; da += xa.z * kk.z; da += xa.w * kk.w;
            db += xb.x * kk.x; db += xb.y * kk.y; db += xb.z * kk.z; db += xb.w * kk.w;
        }
        const bool va = p <= pa, vbk = mb < M && p <= pbq;
        const float sa = va ? da : NEG_INF, sb = vbk ? db : NEG_INF;
        // row a: every tile the loop reaches has key t0 <= pa unless t0 > pa
        float ea = 0.f, eb = 0.f, corr_a = 1.f, corr_b = 1.f;
        if (t0 <= pa) {
            const float mn = fmaxf(mxa, warp_max(sa));
            corr_a = expf(mxa - mn);
            ea = va ? expf(sa - mn) : 0.f;
            la = la * corr_a + warp_sum(ea);
            mxa = mn;
        }
        if (mb < M) {
            const float mn = fmaxf(mxb, warp_max(sb));
            corr_b = expf(mxb - mn);
            eb = vbk ? expf(sb - mn) : 0.f;
            lb = lb * corr_b + warp_sum(eb);
            mxb = mn;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) { acc_a[c] *= corr_a; acc_b[c] *= corr_b; }
        for (int r = 0; r < PT; ++r) {
            // every lane shuffles (full-mask shuffles must be reached by the whole warp); lanes past hd skip
            // the accumulation
            const float wa = __shfl_sync(FULL, ea, r), wb = __shfl_sync(FULL, eb, r);
            if ((wa != 0.f || wb != 0.f) && d4 < hd) {
                const float4 vv = *reinterpret_cast<const float4*>(vs + r * hd + d4);
                acc_a[0] += wa * vv.x; acc_a[1] += wa * vv.y; acc_a[2] += wa * vv.z; acc_a[3] += wa * vv.w;
                acc_b[0] += wb * vv.x; acc_b[1] += wb * vv.y; acc_b[2] += wb * vv.z; acc_b[3] += wb * vv.w;
            }
        }
    }
    if (d4 < hd) {
        if (ma < M) {
#pragma unroll
            for (int c = 0; c < 4; ++c) out[(size_t)ma * H * hd + h * hd + d4 + c] = acc_a[c] / la;
        }
        if (mb < M) {
#pragma unroll
            for (int c = 0; c < 4; ++c) out[(size_t)mb * H * hd + h * hd + d4 + c] = acc_b[c] / lb;
        }
    }
}
