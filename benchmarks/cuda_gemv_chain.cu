// A persistent chain of M = 1 decode GEMVs (benchmarks/cuda_gemv_chain.py): the experiment behind issue 4's
// last goal. Compiled after plugins/kestrel_cuda/common.cu and forward.cu (their helpers: load layouts,
// dot_slot, tagged 64-bit words, mbarriers, cluster addresses and barriers), not part of the backend.
//
// Stage s computes y_s = W_s rmsnorm(x_s), x_s = the first K outputs of stage s - 1, with no kernel boundary
// between stages: one block per SM, clusters of C blocks; tile t (128 columns) of every stage belongs to
// cluster t % nclusters, whose block of rank r takes the tile's 256-row chunks c = r, r + C, ... Each block
// streams its chunks' weights, stage after stage, into a ring of D shared-memory slots (tensor copies, D - 1
// chunks in flight while one is used), so the next stage's weights arrive while this one waits for its input.
// A stage needs every sum of squares of the previous one (its RMSNorm): each merged tile adds one to the
// previous stage's counter (release), and one thread of a block polls it (acquire) before the block reads x.
// Outputs are stored as 64-bit words tagged with their stage (st_tagged), so the host can check who wrote what.
// The cluster adds its blocks' partial sums of a tile in its shared memory (rank order); rank 0 writes the
// tile's outputs and their sums of squares, tagged.
#define CH_KC 256                      // rows of a chunk (qgemv's KC)
#define CH_SCALES (CH_KC / 32 * TN * 4)   // bytes of a chunk's G = 32 weight scales: 8 groups x 128 columns
#define CH_SPIN (1 << 22)              // polls before a block gives up (sets *err): never in a correct run

struct ChainStage {                     // one stage, as 12 words (cuda_gemv_chain.py writes them)
    const unsigned char* W;             // codes in qgemv's layout: int8 [K][Npad], int4 [K / 8][Npad] words
    const float* WS;                    // [K / 32][Npad]
    const float* pw;                    // rmsnorm weight [K]
    const unsigned long long* x;        // tagged inputs (the previous stage's y, or the chain's input)
    const unsigned long long* xssq;     // tagged sums of squares of x, one per 32
    unsigned long long* y;              // tagged outputs [N]
    unsigned long long* yssq;           // tagged [N / 32]
    long long N, K, Npad;
    const void* tmap_w;                 // CUtensorMap of the codes (box: 128 columns x one chunk's rows)
    const void* tmap_s;                 // CUtensorMap of the scales (box: 128 columns x 8 groups)
};

// every thread of every block of the cluster: shared-memory writes before it are visible to the cluster after
__device__ __forceinline__ void cluster_sync() { cluster_arrive(); cluster_wait(); }
// *p in the shared memory of the cluster's block ``rank``
__device__ __forceinline__ float ld_cluster(const float* p, unsigned rank) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
}
// the box of ``tmap`` at (column c0, row c1) into shared memory by the tensor-copy engine, completing on ``bar``
__device__ __forceinline__ void tensor_copy(void* dst, const void* tmap, int c0, int c1, unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(smem_addr(dst)), "l"(tmap), "r"(c0), "r"(c1), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// stamps (optional, thread 0): per block and stage, %globaltimer at the stage's start, after its input wait,
// when its first chunk is ready, after its last tile's cluster barrier, at its last tile's release, and once
// its inputs are quantized (before the first chunk's wait)
#define CH_NSTAMP 6
__device__ __forceinline__ void stamp(unsigned long long* stamps, int nstages, int s, int i) {
    if (stamps && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");  // (not moved across barriers)
        stamps[((size_t)blockIdx.x * nstages + s) * CH_NSTAMP + i] = t;
    }
}
#define CH_COPY_WARP (NT / 32 - 1)     // the warp that fills the ring

// The block's item j (stage s, tile t, chunk c) in its order: stages, then its cluster's tiles, then its chunks.
struct ChainItem { int s, t, c; };

// Thread 0 of the copy warp fills a ring slot with chunk ``it``: the codes' box and the scales' box, two tensor
// copies completing on the slot's barrier. (Measured slower, docs/performance.md, ninth session: 16-byte
// cp.async by every thread or by one warp, and bulk copies of each 128-byte row.)
template <int BITS>
__device__ __forceinline__ void chain_issue(const ChainStage& st, const ChainItem& it, unsigned char* slot,
                                            unsigned long long* bar) {
    if ((threadIdx.x & 31) != 0) return;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the slot's reads before the copies' writes
    mbar_expect_tx(bar, CH_KC * TN * BITS / 8 + CH_SCALES);
    const int n0 = it.t * TN, k0 = it.c * CH_KC;
    tensor_copy(slot, st.tmap_w, n0, BITS == 8 ? k0 : k0 / 8, bar);
    tensor_copy(slot + CH_KC * TN * BITS / 8, st.tmap_s, n0, k0 / 32, bar);
}

// Row ``tid`` of a chunk, v, quantized as qgemv does: warp w holds rows 32w .. 32w + 31, its group w (G = 32).
template <int BITS>
__device__ __forceinline__ void chain_quantize(float v, int* aq, float* as, int* asum) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const float d = warp_max(fabsf(v)) / 127.f;
    const float inv = d == 0.f ? 0.f : 1.f / d;
    const int q = (int)roundf(v * inv);
    reinterpret_cast<signed char*>(aq)[tid] = (signed char)q;
    if (BITS == 4) { const int qs = warp_isum(q); if (lane == 0) asum[warp] = qs; }
    if (lane == 0) as[warp] = d;
}

// The chunk in ``slot`` against its codes (aq, as, asum: one chunk's, as chain_quantize left them): each warp's
// 32-row slot, its 4 columns a lane, into acc[warp][column] (float bits).
template <int BITS>
__device__ __forceinline__ void chain_dot(const unsigned char* slot, const int* aq, const float* as, const int* asum,
                                          float (&acc)[NT / 32][TN]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    unsigned w[BITS == 8 ? 32 : 16];
    const unsigned* sw = reinterpret_cast<const unsigned*>(slot);
    if constexpr (BITS == 8) {
#pragma unroll
        for (int i = 0; i < 32; ++i) w[i] = sw[(32 * warp + i) * (TN / 4) + lane];
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint4 u = reinterpret_cast<const uint4*>(sw + (4 * warp + i) * TN)[lane];
            w[4 * i] = u.x; w[4 * i + 1] = u.y; w[4 * i + 2] = u.z; w[4 * i + 3] = u.w;
        }
    }
    const float4 ws = reinterpret_cast<const float4*>(slot + CH_KC * TN * BITS / 8)[warp * (TN / 4) + lane];
    int aw[1][8];
#pragma unroll
    for (int i = 0; i < 8; ++i) aw[0][i] = aq[8 * warp + i];
    int isum[1][4] = {{0, 0, 0, 0}};
    dot_slot<BITS, 1>(w, aw, isum);
    const float a = as[warp];
    const int bias8 = BITS == 4 ? 8 * asum[warp] : 0;
    *reinterpret_cast<float4*>(&acc[warp][4 * lane]) =
        make_float4((float)(isum[0][0] - bias8) * a * ws.x, (float)(isum[0][1] - bias8) * a * ws.y,
                    (float)(isum[0][2] - bias8) * a * ws.z, (float)(isum[0][3] - bias8) * a * ws.w);
}

// Column tid's sum of the chunk over the block's warps, in warp order (tid < TN, after chain_dot and a barrier)
__device__ __forceinline__ float chain_columns(const float (&acc)[NT / 32][TN]) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < NT / 32; ++i) sum += acc[i][threadIdx.x];
    return sum;
}

// The tile's outputs y (thread tid < TN: column n) and their sums of squares, tagged; then, once the tile's 128
// threads have stored, one more merged tile on the stage's counter (release)
__device__ __forceinline__ void chain_store_tile(const ChainStage& st, int n, float y, unsigned tag, int* count) {
    st_tagged(st.y + n, y, tag);
    const float sq = warp_sum(y * y);
    if ((threadIdx.x & 31) == 0) st_tagged(st.yssq + (n >> 5), sq, tag);
    asm volatile("bar.sync 1, %0;" :: "n"(TN) : "memory");
    if (threadIdx.x == 32) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(count) : "memory");
}

#define CH_MAXC 4   // chunks of a tile one block takes per stage (K / CH_KC / C), at most
#define CH_MAXQ 4   // sums of squares of x a lane reads (K / 32 / 32), at most: K <= 4096

// The stage's rmsnorm denominator from the sums of squares of x, read by warp 0 and shared through *s_r (a
// barrier for the whole block). (Read by every warp instead, as qgemv's rms_from_tiles does: the same time.)
__device__ __forceinline__ float chain_norm(const ChainStage& st, int K, float eps, float* s_r) {
    const int lane = threadIdx.x & 31;
    if (threadIdx.x < 32) {
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < CH_MAXQ; ++i)
            if (lane + 32 * i < K / 32) ss += __uint_as_float((unsigned)__ldcg(st.xssq + lane + 32 * i));
        ss = warp_sum(ss);
        if (lane == 0) *s_r = sqrtf(ss / (float)K + eps);
    }
    __syncthreads();
    return *s_r;
}

template <int BITS>
__global__ void __launch_bounds__(NT, 1) gemv_chain(const long long* __restrict__ desc, int nstages, int depth,
                                                     unsigned base, float eps, int* __restrict__ count,
                                                     int* __restrict__ err, unsigned long long* __restrict__ stamps) {
    extern __shared__ __align__(128) unsigned char ring_raw[];
    // tensor copies need 128-byte aligned destinations, and the dynamic part starts after the static one
    unsigned char* ring = ring_raw + ((128u - (smem_addr(ring_raw) & 127u)) & 127u);
    constexpr int SLOT = CH_KC * TN * BITS / 8 + CH_SCALES;
    __shared__ int s_aq[CH_MAXC][CH_KC / 4];   // the stage's activation codes of this block's chunks
    __shared__ float s_as[CH_MAXC][CH_KC / 32];
    __shared__ int s_asum[CH_MAXC][CH_KC / 32];
    __shared__ __align__(16) float s_acc[NT / 32][TN];
    __shared__ float s_part[2][TN];     // this block's sums of a tile, read by rank 0 (double-buffered by tile)
    __shared__ __align__(8) unsigned long long s_full[16];  // a ring slot's chunk has landed (phase j / depth)
    __shared__ float s_r;               // the stage's rmsnorm denominator

    const ChainStage* stages = reinterpret_cast<const ChainStage*>(desc);
    const int tid = threadIdx.x, warp = tid >> 5;
    const int C = (int)cluster_size(), rank = (int)cluster_rank();
    const int cl = blockIdx.x / C, ncl = gridDim.x / C;

    // this block's items in order, walked by two cursors: the ring's refill (``fill``) runs depth items ahead of
    // the one in use (``use``); a cursor reads a stage's shape once, when it enters the stage
    struct Cursor { int s, ti, ci, nt, nc; };
    auto enter = [&](Cursor& u) {       // from stage u.s on, the first stage with items for this block
        for (; u.s < nstages; ++u.s) {
            const int nt = (int)(stages[u.s].N / TN), nc = (int)(stages[u.s].K / CH_KC);
            u.nt = nt > cl ? (nt - cl + ncl - 1) / ncl : 0;
            u.nc = nc > rank ? (nc - rank + C - 1) / C : 0;
            if (u.nt > 0 && u.nc > 0) break;
        }
        u.ti = u.ci = 0;
    };
    auto advance = [&](Cursor& u) {
        if (++u.ci < u.nc) return;
        u.ci = 0;
        if (++u.ti < u.nt) return;
        ++u.s;
        enter(u);
    };
    auto item_of = [&](const Cursor& u) { return ChainItem{u.s, cl + u.ti * ncl, rank + u.ci * C}; };
    if (tid == 0) {
        for (int i = 0; i < depth; ++i) mbar_init(&s_full[i], 1);
        mbar_init_fence();
    }
    __syncthreads();
    const bool copier = warp == CH_COPY_WARP;
    Cursor use{0, 0, 0, 0, 0}, fill{0, 0, 0, 0, 0};
    enter(use);
    enter(fill);
    for (int j = 0; j < depth && fill.s < nstages; ++j) {  // the ring's first D chunks
        if (copier) {
            chain_issue<BITS>(stages[fill.s], item_of(fill), ring + (size_t)j * SLOT, &s_full[j]);
        }
        advance(fill);
    }
    float acc = 0.f;
    int cur_s = -1, buf = 0;
    for (int j = 0; use.s < nstages; ++j, advance(use)) {
        const ChainItem it = item_of(use);
        const ChainStage& st = stages[it.s];
        const unsigned ytag = base + it.s + 1;
        const unsigned char* slot = ring + (size_t)(j % depth) * SLOT;
        const int K = (int)st.K;
        const bool first = it.s != cur_s;
        if (first) {
            stamp(stamps, nstages, it.s, 0);
            // A new stage: wait until every tile of the previous one is out (one thread polls its counter:
            // 30,000 threads polling their own input words flooded L2, 141 us a stage), then read this block's
            // chunks of x and every sum of squares of x, and quantize them once for all its tiles.
            const int nc = use.nc;
            float pwv[CH_MAXC];
#pragma unroll
            for (int i = 0; i < CH_MAXC; ++i) pwv[i] = i < nc ? __ldg(st.pw + (rank + i * C) * CH_KC + tid) : 0.f;
            if (it.s > 0 && tid == 32) {
                const int want = (int)(stages[it.s - 1].N / TN);
                for (int spin = 0; ld_acquire(count + it.s - 1) < want; ++spin)
                    if (spin == CH_SPIN) { atomicExch(err, 1); break; }
            }
            __syncthreads();
            stamp(stamps, nstages, it.s, 1);
            unsigned long long wx[CH_MAXC];
#pragma unroll
            for (int i = 0; i < CH_MAXC; ++i) wx[i] = i < nc ? __ldcg(st.x + (rank + i * C) * CH_KC + tid) : 0ull;
            const float r = chain_norm(st, K, eps, &s_r);
#pragma unroll
            for (int i = 0; i < CH_MAXC; ++i) {
                if (i >= nc) break;
                chain_quantize<BITS>(__uint_as_float((unsigned)wx[i]) / r * pwv[i], s_aq[i], s_as[i], s_asum[i]);
            }
            cur_s = it.s;
            stamp(stamps, nstages, it.s, 5);
        }
        const int ci = (it.c - rank) / C;
        mbar_wait(&s_full[j % depth], (unsigned)(j / depth) & 1u);  // chunk j has landed
        __syncthreads();                // (and every warp is done with s_acc)
        if (first) stamp(stamps, nstages, it.s, 2);

        chain_dot<BITS>(slot, s_aq[ci], s_as[ci], s_asum[ci], s_acc);
        __syncthreads();                // slot j and s_acc read; the ring slot may be refilled
        if (fill.s < nstages) {
            if (copier) {
                chain_issue<BITS>(stages[fill.s], item_of(fill), ring + (size_t)(j % depth) * SLOT,
                                  &s_full[j % depth]);
            }
            advance(fill);
        }
        if (tid < TN) acc += chain_columns(s_acc);
        if (it.c + C < K / CH_KC) continue;  // not this block's last chunk of the tile
        // the tile's sums: the cluster's blocks' partials, added by rank 0 in rank order
        if (tid < TN) s_part[buf][tid] = acc;
        acc = 0.f;
        cluster_sync();
        const bool last_tile = use.ti == use.nt - 1;
        if (last_tile) stamp(stamps, nstages, it.s, 3);
        if (rank == 0 && tid < TN) {
            float y = 0.f;
            for (int q2 = 0; q2 < C; ++q2) y += ld_cluster(&s_part[buf][tid], q2);
            chain_store_tile(st, it.t * TN + tid, y, ytag, count + it.s);
        }
        if (last_tile) stamp(stamps, nstages, it.s, 4);
        buf ^= 1;                       // s_part[buf] is rewritten two tiles on, after the next cluster_sync
    }
    cluster_sync();                     // rank 0 may still read this block's s_part
}

// ------------------------------------------------------------------------------------------------------
// The same chain with a control block per cluster (``--kernel ctl``). In gemv_chain's timeline a block takes
// 2.4-3 us from its input wait's end to its quantized inputs, about the time its share of the bandwidth needs
// for the weight bytes it has in flight (72-80 KB): were its input loads queued behind them? Here rank 0 of
// each cluster streams nothing: it waits for the previous stage, reads and quantizes the whole input, and hands
// the codes to the cluster's other blocks through distributed shared memory; they only stream weights, take the
// cluster's items (tile, chunk) in turn, and send their partial sums of each tile back to rank 0's shared
// memory, which adds them in rank order and writes the tile. (Measured slower: one block reading and
// quantizing all of K takes 6-12 us.)
#define CTL_MAXK 16     // chunks of K (K <= 4096)
#define CTL_MAXT 4      // tiles of a stage one cluster takes (every stage of a chain has one shape)

__device__ __forceinline__ void arrive_remote(unsigned long long* bar, unsigned rank) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];"
                 :: "r"(cluster_addr(bar, rank)) : "memory");
}
__device__ __forceinline__ void wait_cluster(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n\t.reg .pred p;\n"
                 "WAITC:\n\tmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
                 "\t@!p bra WAITC;\n}" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ unsigned ld_remote_u32(const void* p, unsigned rank) {
    unsigned v;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
}
__device__ __forceinline__ void st_remote_f32(const void* p, unsigned rank, float v) {
    asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(cluster_addr(p, rank)), "f"(v) : "memory");
}

template <int BITS>
__global__ void __launch_bounds__(NT, 1) gemv_chain_ctl(const long long* __restrict__ desc, int nstages, int depth,
                                                         unsigned base, float eps, int* __restrict__ count,
                                                         int* __restrict__ err,
                                                         unsigned long long* __restrict__ stamps) {
    extern __shared__ __align__(128) unsigned char ring_raw[];
    unsigned char* ring = ring_raw + ((128u - (smem_addr(ring_raw) & 127u)) & 127u);
    constexpr int SLOT = CH_KC * TN * BITS / 8 + CH_SCALES;
    // rank 0: the stage's codes of every chunk (the others copy them); the others' partial sums per tile
    __shared__ int s_aq[CTL_MAXK][CH_KC / 4];
    __shared__ float s_as[CTL_MAXK][CH_KC / 32];
    __shared__ int s_asum[CTL_MAXK][CH_KC / 32];
    __shared__ float s_part[CTL_MAXT][MAX_CLUSTER - 1][TN];
    __shared__ __align__(16) float s_acc[NT / 32][TN];
    __shared__ __align__(8) unsigned long long s_full[16];       // ring slots (streaming blocks)
    __shared__ __align__(8) unsigned long long s_codes_bar;      // the stage's codes are in rank 0 (streaming blocks)
    __shared__ __align__(8) unsigned long long s_part_bar[CTL_MAXT];  // a tile's partials are in (rank 0)
    __shared__ float s_r;

    const ChainStage* stages = reinterpret_cast<const ChainStage*>(desc);
    const int tid = threadIdx.x, warp = tid >> 5;
    const int C = (int)cluster_size(), rank = (int)cluster_rank(), S = C - 1;
    const int cl = blockIdx.x / C, ncl = gridDim.x / C;
    auto tiles_of = [&](int s) {
        const int nt = (int)(stages[s].N / TN);
        return nt > cl ? (nt - cl + ncl - 1) / ncl : 0;
    };

    if (tid == 0) {
        for (int i = 0; i < depth; ++i) mbar_init(&s_full[i], 1);
        mbar_init(&s_codes_bar, 1);
        for (int i = 0; i < CTL_MAXT; ++i) mbar_init(&s_part_bar[i], S);
        mbar_init_fence();
    }
    cluster_sync();                     // every barrier of the cluster initialised before any remote arrival

    if (rank == 0) {                    // control: inputs, codes, merges
        int phase = 0;                  // stages this cluster has taken part in
        for (int s = 0; s < nstages; ++s) {
            const int nt = tiles_of(s);
            if (nt == 0) continue;
            const ChainStage& st = stages[s];
            const int K = (int)st.K, nck = K / CH_KC;
            stamp(stamps, nstages, s, 0);
            if (s > 0 && tid == 32) {
                const int want = (int)(stages[s - 1].N / TN);
                for (int spin = 0; ld_acquire(count + s - 1) < want; ++spin)
                    if (spin == CH_SPIN) { atomicExch(err, 1); break; }
            }
            __syncthreads();
            stamp(stamps, nstages, s, 1);
            float xv[CTL_MAXK], pwv[CTL_MAXK];
#pragma unroll
            for (int i = 0; i < CTL_MAXK; ++i) {
                xv[i] = i < nck ? __uint_as_float((unsigned)__ldcg(st.x + i * CH_KC + tid)) : 0.f;
                pwv[i] = i < nck ? __ldg(st.pw + i * CH_KC + tid) : 0.f;
            }
            const float r = chain_norm(st, K, eps, &s_r);
#pragma unroll
            for (int i = 0; i < CTL_MAXK; ++i) {
                if (i >= nck) break;
                chain_quantize<BITS>(xv[i] / r * pwv[i], s_aq[i], s_as[i], s_asum[i]);
            }
            __syncthreads();
            if (tid >= 1 && tid <= S) arrive_remote(&s_codes_bar, (unsigned)tid);  // (release: the codes above)
            stamp(stamps, nstages, s, 5);
            for (int i = 0; i < nt; ++i) {
                wait_cluster(&s_part_bar[i], (unsigned)phase & 1u);
                if (i == nt - 1) stamp(stamps, nstages, s, 3);
                if (tid < TN) {
                    float y = 0.f;
                    for (int q2 = 0; q2 < S; ++q2) y += s_part[i][q2][tid];
                    chain_store_tile(st, (cl + i * ncl) * TN + tid, y, base + s + 1, count + s);
                }
            }
            stamp(stamps, nstages, s, 4);
            stamp(stamps, nstages, s, 2);
            ++phase;
        }
        cluster_sync();                 // the streaming blocks may still read s_aq
        return;
    }

    // streaming blocks: items q = rank - 1, rank - 1 + S, ... of the cluster's (tile, chunk) sequence, q = i * nck + c
    struct Cursor { int s, q, n; };     // n: the cluster's items in stage s
    auto enter = [&](Cursor& u) {
        for (; u.s < nstages; ++u.s) {
            u.n = tiles_of(u.s) * (int)(stages[u.s].K / CH_KC);
            if (u.n > rank - 1) break;
        }
        u.q = rank - 1;
    };
    auto advance = [&](Cursor& u) { u.q += S; if (u.q >= u.n) { ++u.s; enter(u); } };
    auto item_of = [&](const Cursor& u) {
        const int nck = (int)(stages[u.s].K / CH_KC);
        return ChainItem{u.s, cl + (u.q / nck) * ncl, u.q % nck};
    };
    const bool copier = warp == CH_COPY_WARP;
    Cursor use{0, 0, 0}, fill{0, 0, 0};
    enter(use);
    enter(fill);
    for (int j = 0; j < depth && fill.s < nstages; ++j) {
        if (copier) chain_issue<BITS>(stages[fill.s], item_of(fill), ring + (size_t)j * SLOT, &s_full[j]);
        advance(fill);
    }
    float acc = 0.f;
    int cur_s = -1, phase = 0;
    for (int j = 0; use.s < nstages; ++j, advance(use)) {
        const ChainItem it = item_of(use);
        const int nck = (int)(stages[it.s].K / CH_KC);
        const unsigned char* slot = ring + (size_t)(j % depth) * SLOT;
        const bool first = it.s != cur_s;
        if (first) {                    // the stage's codes: from rank 0's shared memory into this block's
            stamp(stamps, nstages, it.s, 0);
            wait_cluster(&s_codes_bar, (unsigned)phase & 1u);
            ++phase;
            stamp(stamps, nstages, it.s, 1);
            for (int w = tid; w < nck * CH_KC / 4; w += NT)
                (&s_aq[0][0])[w] = (int)ld_remote_u32(&s_aq[0][0] + w, 0);
            for (int w = tid; w < nck * CH_KC / 32; w += NT) {
                (&s_as[0][0])[w] = __uint_as_float(ld_remote_u32(&s_as[0][0] + w, 0));
                if (BITS == 4) (&s_asum[0][0])[w] = (int)ld_remote_u32(&s_asum[0][0] + w, 0);
            }
            cur_s = it.s;
            stamp(stamps, nstages, it.s, 5);
        }
        mbar_wait(&s_full[j % depth], (unsigned)(j / depth) & 1u);
        __syncthreads();                // (the codes copied above; every warp done with s_acc)
        if (first) stamp(stamps, nstages, it.s, 2);
        chain_dot<BITS>(slot, s_aq[it.c], s_as[it.c], s_asum[it.c], s_acc);
        __syncthreads();
        if (fill.s < nstages) {
            if (copier)
                chain_issue<BITS>(stages[fill.s], item_of(fill), ring + (size_t)(j % depth) * SLOT,
                                  &s_full[j % depth]);
            advance(fill);
        }
        if (tid < TN) acc += chain_columns(s_acc);
        const int ti = use.q / nck;     // the tile's index in the cluster's stage
        if (use.q + S < (ti + 1) * nck) continue;  // not this block's last item of the tile
        if (tid < TN) {                 // the tile's partial, into rank 0's slot for this block
            st_remote_f32(&s_part[ti][rank - 1][tid], 0, acc);
            asm volatile("bar.sync 1, %0;" :: "n"(TN) : "memory");
            if (tid == 0) arrive_remote(&s_part_bar[ti], 0);
        }
        acc = 0.f;
        if (ti == use.n / nck - 1) { stamp(stamps, nstages, it.s, 3); stamp(stamps, nstages, it.s, 4); }
    }
    cluster_sync();
}
