// qgemv: every projection of the whole-step forward (and lm_head) at M <= 8, its activation prologue
// (RMSNorm, SiLU*up) and quantization fused in; split-K merges in merge.cuh.

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

// Quantized GEMV / small-M GEMM with the activation prologue fused in.
//
// out[m][n] = sum_g (sum_{k in g} Aq[m][k] Wq[k][n]) * a_scale[m][g] * w_scale[g][n]   (integer block sums)
// where A = prologue(X): pro 0: X; pro 1: rmsnorm(X, pw, eps); pro 2: silu(X[:, k]) * X[:, k + xoff]; pro 3:
// gelu_tanh(X[:, k]) * X[:, k + xoff]; pro 4 (M = 1): rmsnorm(h', pw, eps) for h' = X + pn_src / ro, a
// post-norm (plan.PostNorm) whose sums pn_stats holds (postnorm_rms) and whose weight its projection has applied
// (pn_src = out * w); column tile 0 stores h' in pn_next; pro 5 (FOLD_EXPERTS): swiglu_oai(X[:, k],
// X[:, k + xoff]) with clamp glimit and slope galpha (gpt-oss's).
// quantized per G-block exactly as contract.quantize_activations.
// Grid: x = column tiles of TN, y = K splits (chunks of KC strided by gridDim.y), z = row blocks of MR.
// A chunk is 256 rows, one 32-row slot a warp (int8: 32 KB, int4: 16 KB). int4 chunks of 512 rows (two slots
// a warp, 32 KB like int8) measured slower: 2,250 against 2,010 us per qwen3-8b q4 step (docs/performance.md).
// With gridDim.y > 1 (M = 1 only) the K splits' partial sums are added in y order (deterministic, graph-safe,
// the same bits every way): launched as one cluster per tile (gridDim.y <= MAX_CLUSTER), the cluster's other
// blocks push theirs into block 0's shared memory and exit; with ``epochs`` (plan.tagged_merge: grids of more
// than one wave) every split stores them tagged in ``merge`` (st_tagged), the tile's last split polls for them
// and the others exit at once, freeing their SM slots for the next wave; otherwise each block writes them to
// part[y][m][Npad] and the last block of a tile to arrive on its counter (then reset) reads them back.
// With etab (MR = 1 only: a mixture of experts' chosen experts, one a row) block z's weights are expert esel[z]'s,
// codes and scales pointers etab[2e], etab[2e + 1] of the same shape; row z of X (ldx 0: one row for all) and
// of Y is the slot's (FOLD_EXPERTS: a bias is the expert's row of bias [E][N]). The table's NT rows are copied to
// NT * 16 bytes of dynamic shared memory before the PDL
// wait, so the weights are one L2 round trip (esel) after it. Such a block lets its dependents launch only once
// it knows esel, so when a routed GEMV follows another on the same choices (esel_ready: the router's kernel has
// completed before it can launch), it reads esel before its PDL wait and streams its first weights while its
// predecessor runs, as a dense projection does.
// Epilogue: epi 0: Y = acc (+ bias); epi 1: Y += (acc (+ bias)) * ymul (Granite's residual multiplier; 1 elsewhere,
// an exact multiply). With qout (M = 1, the q|k|v projection,
// hd == TN: tile x is head x; the other pointers and H, KV, cap as QkvRope's, eps the prologue's) the tile's
// outputs go through rope_head instead of to Y: qkv_rope's work, in the block that has the head's sums,
// without a kernel of its own. With pn_stats and pro != 4 (M = 1: the projection before a post-norm) it stores
// y * pn_w (so the next GEMV needs no second weight a row: with one it spilled) and the column tile's sums of
// y², pn_src·y·pn_w, (y·pn_w)² and pn_src² (pn_src: the residual h) in pn_stats.
// FOLD, what else the GEMV does, each an instance of its own (with the router's code in every instance, ptxas
// spilled 24-48 bytes in them):
// - FOLD_ROUTER (M = 1: a decode step's o projection, the bias its residual h, Y the other residual row): the
//   last rgroups column tiles of the grid are the router's (route.cuh route_part): they run beside the
//   projection's blocks, from h and the projection's input, and choose (moe_combine weighs the choice);
// - FOLD_ATTENTION (M = 1: the q|k|v projection with qout, its K splits one cluster a head): decode attention in
//   the q heads' clusters (attend.cuh), the KV heads' tiles first in the grid;
// - FOLD_EXPERTS (a routed GEMV, etab: gpt-oss's experts): each slot's expert's row of biases, and prologue 5, its
//   clamped SwiGLU (the instances of every other model keep their code: none of this is in them).
#define FOLD_ROUTER 1
#define FOLD_ATTENTION 2
#define FOLD_EXPERTS 3
template <int BITS, int G, int MR, int FOLD>
__global__ void __launch_bounds__(NT, MR == 1 ? 4 : 1) qgemv(
    const unsigned char* __restrict__ W, const float* __restrict__ WS, int K, int N, int Npad,
    const float* __restrict__ X, int ldx, int M, int pro, const float* __restrict__ pw, float eps, int xoff,
    float* __restrict__ Y, int ldy, int epi, float ymul, const float* __restrict__ bias,
    float* __restrict__ part, int* __restrict__ counters, unsigned long long* __restrict__ merge,
    unsigned* __restrict__ epochs, const float* __restrict__ ssq_in, float* __restrict__ ssq_out,
    const float* qnorm, const float* knorm, const float* cosT, const float* sinT, const int* meta, float* qout,
    kv_t* kc, kv_t* vc, int H, int KV, int cap, const unsigned long long* __restrict__ etab,
    const int* __restrict__ esel, int esel_ready, const float* __restrict__ pn_w, const float* __restrict__ pn_src,
    float* pn_stats, float* __restrict__ pn_next, const float* __restrict__ rw, int rgroups, int rrows, int rexperts,
    int rk, int rnorm_topk, int rspan, float* rpart, int* rcount, int* rsel, float* rwts, float* aout,
    float ascale, int awindow, unsigned long long* akv, unsigned* aepoch, float glimit, float galpha)
{
    constexpr int KC = NT;                      // rows of a chunk: one 32-row slot a warp, one row a thread
    constexpr int NW = BITS == 8 ? 32 : 16;     // 4-byte words of one slot
    if constexpr (FOLD == FOLD_ROUTER) {  // MR = 1, the o projection: no other option (constants: no spills)
        pro = 0; epi = 0; etab = nullptr; qout = nullptr; pn_stats = nullptr; ssq_in = nullptr; epochs = nullptr;
    }
    if constexpr (FOLD == FOLD_EXPERTS) {  // MR = 1, etab: no RoPE, post-norm or tagged merge
        qout = nullptr; pn_stats = nullptr; epochs = nullptr;
    }
    const bool routed = MR == 1 && etab;
    if (!routed) grid_dep_launch();  // the wait follows the block's first weight loads
    if constexpr (FOLD == FOLD_ROUTER) {
        if ((int)blockIdx.x >= (int)gridDim.x - rgroups) {  // a block of the router folded in
            const RouteArgs ra{rw, rgroups, rrows, rexperts, rk, rnorm_topk, rspan, rpart, rcount, rsel, rwts};
            const int tiles = gridDim.x - rgroups;
            route_part(ra, blockIdx.x - tiles, blockIdx.y, gridDim.y, bias, X, N);
            return;
        }
    }
    __shared__ int s_aq[MR][KC / 4];            // activation codes of this chunk, 4 per word
    __shared__ float s_as[MR][KC / 32];         // activation scale per group (G = 256: element 0)
    __shared__ int s_asum[MR][KC / 32];         // sum of activation codes per group (int4 bias)
    __shared__ float s_r[MR];                   // rmsnorm denominators
    __shared__ float s_red[NT / 32];
    __shared__ __align__(16) int s_acc[NT / 32][MR][TN];  // per-warp partial results (float bits; ints at G=256)
    __shared__ float s_part[MR][TN];            // with qout: the head's outputs for rope_head
    __shared__ RopeLane<TN / 64> s_rope[MR == 1 ? 32 : 1];  // with qout: warp 0's rope_lane factors
    __shared__ int s_pos;                       // with qout: the row's position
    __shared__ float s_push[MR == 1 ? MAX_CLUSTER : 1][TN];  // cluster block 0: the other blocks' sums
    __shared__ __align__(8) unsigned long long s_push_bar;    // counts their bytes
    __shared__ int s_last;

    if (routed) {                               // block z runs slot z's expert, which an earlier kernel chose
        extern __shared__ uint4 s_etab[];       // [EXPERT_TABLE_ROWS == NT]: every expert's (codes, scales)
        s_etab[threadIdx.x] = __ldg(reinterpret_cast<const uint4*>(etab) + threadIdx.x);  // not step data
        if (!esel_ready) grid_dep_wait();
        grid_dep_launch();
        const int e = __ldcg(esel + blockIdx.z);
        __syncthreads();
        const uint4 t = s_etab[e];
        W = reinterpret_cast<const unsigned char*>(((unsigned long long)t.y << 32) | t.x);
        WS = reinterpret_cast<const float*>(((unsigned long long)t.w << 32) | t.z);
    }
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // the column tile: FOLD_ATTENTION puts the KV heads' (tiles H..) first
    const int tile = FOLD == FOLD_ATTENTION ? ((int)blockIdx.x + H) % (int)gridDim.x : (int)blockIdx.x;
    const int n0 = tile * TN;
    const int col = n0 + 4 * lane;
    const int m0 = blockIdx.z * MR;
    const int nck = (K + KC - 1) / KC;
    const unsigned csize = cluster_size();     // > 1: the tile's K splits are this cluster (csize == gridDim.y)
    // otherwise the K splits merge through ``merge`` (null epochs: through part and counters)
    const bool tagged = MR == 1 && gridDim.y > 1 && epochs != nullptr && csize == 1;
    if (MR == 1 && csize > 1) {                 // before any block of the cluster can send its sums
        if (threadIdx.x == 0) {
            const bool first = cluster_rank() == 0;
            if (first) mbar_init(&s_push_bar, 1);
            if constexpr (FOLD == FOLD_ATTENTION) attend_init();
            mbar_init_fence();
            if (first) mbar_expect_tx(&s_push_bar, (csize - 1) * TN * sizeof(float));
            if constexpr (FOLD == FOLD_ATTENTION) attend_arm(cluster_rank(), csize);
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
    float r1 = 0.f, ro = 0.f;                   // pro 4: r1 is h''s
#pragma unroll
    for (int i = 0; i < MR; ++i) acc[i] = 0.f;

    // with qout, warp 0: the row's position and its head's rope_lane factors, the step's constants (meta changes
    // only in the step's last kernel, lm_finish, or on the host between steps), loaded before the PDL wait
    constexpr int PAIRS = TN / 64;
    const QkvRope qr = {qnorm, knorm, cosT, sinT, meta, qout, kc, vc, H, KV, cap, eps};
    auto rope_preload = [&]() {
        if (MR == 1 && qout && warp == 0) {
            const int pos = meta[0];
            s_rope[lane] = rope_lane<PAIRS>(qr, tile, TN, pos, lane);
            if (lane == 0) s_pos = pos;
        }
    };

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
        // rmsnorm weights of this thread's chunk row (not step data)
        const float pwv = (pro == 1 || pro == 4) && k0 + tid < K ? __ldg(pw + k0 + tid) : 0.f;
        if (c == (int)blockIdx.y) {
            rope_preload();
            grid_dep_wait();                    // X (and the epoch) come from the kernels before this one
            if (tagged) epoch = __ldcg(epochs + blockIdx.x);
        }
        // MR = 1: the thread's input (and the gated activation's up value), loaded before the norm's sums and the
        // barrier below, so that the round trips overlap (measured 100-130 us per q4 step faster). Through L2
        // (ld.global.cg): a plain load of this const __restrict__ row compiles to ld.global.nc, which may be
        // scheduled above griddepcontrol.wait and read the previous step's values (measured: wrong logits).
        constexpr bool early = MR == 1;
        const bool eok = early && m0 < M && k0 + tid < K;
        const float xe = eok ? __ldcg(X + (size_t)m0 * ldx + k0 + tid) : 0.f;
        const float ue = eok && (pro == 2 || pro == 3 || (FOLD == FOLD_EXPERTS && pro == 5))
                         ? __ldcg(X + (size_t)m0 * ldx + k0 + tid + xoff)
                         : eok && pro == 4 ? __ldcg(pn_src + k0 + tid) : 0.f;  // pro 4: out
        if (pro == 1 && c == (int)blockIdx.y && ssq_in) {  // M = 1: from the tile sums
            r1 = rms_from_tiles(ssq_in, K, eps);  // every warp: s_r is not needed (ssq_in implies MR = 1)
        } else if (pro == 4 && c == (int)blockIdx.y) {
            postnorm_rms(reinterpret_cast<const float4*>(pn_stats), K, eps, ro, r1);
        } else if (pro == 1 && c == (int)blockIdx.y) {
            // rmsnorm denominators over the whole row, computed (identically) by every block, while its
            // first weight loads are in flight
            for (int i = 0; i < MR; ++i) {
                const int m = m0 + i;
                float ss = 0.f;
                if (m < M) {  // not thread_ssq: its 16 loads in flight would not fit the M=1 kernel's 64 registers
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
                } else if (pro == 4) {          // MR = 1
                    const float hn = xk + ue / ro;
                    if (blockIdx.x == 0) pn_next[k] = hn;
                    v = hn / r1 * pwv;
                } else if (pro == 2) {
                    v = xk / (1.f + expf(-xk)) * (early ? ue : xr[k + xoff]);
                } else if (pro == 3) {
                    v = gelu_tanh_mul(xk, early ? ue : xr[k + xoff]);
                } else if (FOLD == FOLD_EXPERTS && pro == 5) {
                    v = swiglu_oai_mul(xk, early ? ue : xr[k + xoff], glimit, galpha);
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

    if ((int)blockIdx.y >= nck) rope_preload();  // a block without a chunk
    grid_dep_wait();  // blocks without a chunk: before the epoch (a no-op once waited)
    if (tagged && (int)blockIdx.y >= nck) epoch = __ldcg(epochs + blockIdx.x);
    // the epilogue's inputs from earlier kernels, loaded now: their round trip overlaps the merge's
    float yin[MR], bn = 0.f;
    const int n = n0 + tid;
    const bool nok = tid < TN && n < N;
#pragma unroll
    for (int i = 0; i < MR; ++i) yin[i] = nok && epi == 1 && m0 + i < M ? Y[(size_t)(m0 + i) * ldy + n] : 0.f;
    if (nok && bias) {  // through L2: the router fold's bias is the residual stream
        // FOLD_EXPERTS: the slot's expert's row (esel read again: no register held through the loop)
        const float* b = FOLD == FOLD_EXPERTS ? bias + (size_t)__ldcg(esel + blockIdx.z) * N : bias;
        bn = __ldcg(b + n);
    }
    const bool pn_prod = pn_stats && pro != 4;  // the projection before a post-norm: its sums
    const float hres = pn_prod && nok ? __ldcg(pn_src + n) : 0.f, pwn = pn_prod && nok ? __ldg(pn_w + n) : 0.f;
    // FOLD_ATTENTION: the attention's arguments, and in block 0 the launch's tag
    const AttendArgs aa{aout, ascale, awindow, akv, aepoch};
    const unsigned atag = FOLD == FOLD_ATTENTION && cluster_rank() == 0 ? __ldcg(aepoch + tile) + 1u : 0u;
    const int akvh = FOLD == FOLD_ATTENTION && tile < H ? tile / (H / KV) : 0;  // a q head's KV head
    const kv_t* akb = qr.kc + (size_t)akvh * cap * TN;
    const kv_t* avb = qr.vc + (size_t)akvh * cap * TN;
    if (MR == 1 && csize > 1) {                 // the cluster's shared memory: pushed to block 0
        const unsigned rank = cluster_rank();
        if (rank != 0) {
            cluster_wait();                     // block 0's barrier is initialised
            if (tid < TN) push_to(&s_push[rank][tid], &s_push_bar, acc[0], 0);
            if constexpr (FOLD == FOLD_ATTENTION)
                if (tile < H) attend_rest(aa, akb, avb, s_pos, rank, csize);
            return;
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
        if ((int)blockIdx.y != ns - 1) return;  // the tile's last split merges
        if (tid < TN) acc[0] = sum_tagged<PB>(slots, TN, ns, tag);
        if (tid == 0) epochs[blockIdx.x] = tag;
    } else if (gridDim.y > 1) {
        if (tid < TN && n0 + tid < Npad) {
            for (int i = 0; i < MR; ++i) {
                const int m = m0 + i;
                if (m < M) part[((size_t)blockIdx.y * M + m) * Npad + n0 + tid] = acc[i];
            }
        }
        const int counter = blockIdx.z * gridDim.x + blockIdx.x;
        if (!arrive_last(&counters[counter], gridDim.y, &s_last)) return;
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
        if (tid == 0) counters[counter] = 0;
    }

    if (MR == 1 && qout) {
        if (tid < TN) s_part[0][tid] = nok ? (bias ? acc[0] + bn : acc[0]) : 0.f;
        __syncthreads();
        if constexpr (FOLD == FOLD_ATTENTION) {
            const bool isq = tile < H;
            if (warp == 0)
                rope_head<PAIRS>(qr, s_part[0], tile, TN, s_pos, lane, s_rope[lane], isq ? attend_smem().q : nullptr,
                                 isq ? nullptr : akv, atag);
            if (isq) attend_first(aa, tile, akvh, csize, atag);
            if (tid == 0) aepoch[tile] = atag;
            return;
        }
        if (warp == 0) rope_head<PAIRS>(qr, s_part[0], tile, TN, s_pos, lane, s_rope[lane]);
        return;
    }
    float y0 = 0.f;                             // row m0's output (ssq_out: M = 1)
    if (nok) {
        for (int i = 0; i < MR; ++i) {
            const int m = m0 + i;
            if (m >= M) continue;
            float y = acc[i];
            if (bias) y = y + bn;
            y = epi == 1 ? yin[i] + y * ymul : y;
            Y[(size_t)m * ldy + n] = pn_prod ? y * pwn : y;
            if (i == 0) y0 = y;
        }
    }
    if (ssq_out && warp < TN / 32 && n0 + 32 * warp < N) store_warp_ssq(y0, ssq_out, n0 + 32 * warp);
    if (pn_prod) {                              // the tile's sums, its warps' in order (postnorm_rms)
        if (warp < TN / 32) {
            const float yw = y0 * pwn;
            const float s0 = warp_sum(y0 * y0), s1 = warp_sum(hres * yw), s2 = warp_sum(yw * yw);
            const float s3 = warp_sum(hres * hres);
            if (lane < 4) s_part[0][4 * warp + lane] = lane == 0 ? s0 : lane == 1 ? s1 : lane == 2 ? s2 : s3;
        }
        __syncthreads();
        if (tid < 4) {
            float t = 0.f;
#pragma unroll
            for (int w = 0; w < TN / 32; ++w) t += s_part[0][4 * w + tid];
            pn_stats[4 * blockIdx.x + tid] = t;
        }
    }
}
