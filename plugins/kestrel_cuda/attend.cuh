// Decode attention's pieces, shared by attn_decode (attention.cu) and the q|k|v GEMV that folds decode
// attention into its clusters (gemv.cu FOLD_ATTENTION): a warp's online softmax over a range of positions, a
// block's warps merged into one record, records merged into the head's output.
// A lane holds dimensions 4 lane + 128 (j / 4) + j % 4, j < MAXJ (4: hd <= 128, 8: hd <= 256), in chunks of 4
// consecutive ones, each chunk of a key or value one 8-byte load of float16. A record is an online softmax's
// state (max, sum, acc[hd]): ATT_REC(hd) floats.
#define ATT_REC(hd) ((hd) + 2)

// One warp's online softmax over positions [pb, pe) of one head: groups of AB positions from pb + AB * warp,
// every AB * nw-th, the next group's keys and values loaded while one is computed. kb, vb: the head's keys and
// values (position p at p * hd). ``query(qr)`` gives the lane's scaled query, called once the first group's
// loads are issued (so that they overlap whatever it waits for). ``cap`` > 0: each score soft-capped (soft_cap,
// Gemma 2) before the softmax. The warp's state ends in mx, l, acc (-inf, 0 and zeros where it saw no position).
template <int MAXJ, int AB, class Query>
__device__ __forceinline__ void attend_warp(Query query, const kv_t* kb, const kv_t* vb, int hd, int pb, int pe,
                                            int warp, int nw, int lane, float cap, float& mx, float& l,
                                            float (&acc)[MAXJ])
{
    constexpr int NC = MAXJ / 4;            // a lane's chunks
#pragma unroll
    for (int j = 0; j < MAXJ; ++j) acc[j] = 0.f;
    mx = NEG_INF;
    l = 0.f;
    // the float16 keys and values of AB positions from p0 (zero past pe and hd)
    uint2 kraw[AB][NC], vraw[AB][NC];
    auto load = [&](int p0) {
#pragma unroll
        for (int b = 0; b < AB; ++b) {
            const int p = p0 + b;
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const int d = 4 * lane + 128 * c;
                const bool ok = p < pe && d < hd;
                const size_t at = (size_t)(p < pe ? p : 0) * hd + d;
                kraw[b][c] = ok ? *reinterpret_cast<const uint2*>(kb + at) : make_uint2(0u, 0u);
                vraw[b][c] = ok ? *reinterpret_cast<const uint2*>(vb + at) : make_uint2(0u, 0u);
            }
        }
    };
    if (pb + AB * warp < pe) load(pb + AB * warp);
    float qr[MAXJ];
    query(qr);
    for (int p0 = pb + AB * warp; p0 < pe; p0 += AB * nw) {
        float kr[AB][MAXJ], vr[AB][MAXJ];
#pragma unroll
        for (int b = 0; b < AB; ++b)
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const float4 kk = from_kv4(kraw[b][c]), vv = from_kv4(vraw[b][c]);
                kr[b][4 * c] = kk.x; kr[b][4 * c + 1] = kk.y; kr[b][4 * c + 2] = kk.z; kr[b][4 * c + 3] = kk.w;
                vr[b][4 * c] = vv.x; vr[b][4 * c + 1] = vv.y; vr[b][4 * c + 2] = vv.z; vr[b][4 * c + 3] = vv.w;
            }
        if (p0 + AB * nw < pe) load(p0 + AB * nw);
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
        if (cap > 0.f) {  // (a position past pe: its score is not read)
#pragma unroll
            for (int b = 0; b < AB; ++b) sc[b] = soft_cap(sc[b], cap);
        }
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
}

// The block's NW warps' states (attend_warp) as one record ``rec`` (shared or global memory), merged in warp
// order through s_m, s_l [NW] and s_acc [NW][32 MAXJ]. Every thread of the block (NW warps) calls it; ``rec`` is
// written, not synchronised.
template <int MAXJ, int NW>
__device__ __forceinline__ void merge_warps(float mx, float l, const float (&acc)[MAXJ], int hd, int warp, int lane,
                                            float* s_m, float* s_l, float (*s_acc)[32 * MAXJ], float* rec)
{
    if (lane == 0) { s_m[warp] = mx; s_l[warp] = l; }
#pragma unroll
    for (int c = 0; c < MAXJ / 4; ++c) {
        const int d = 4 * lane + 128 * c;
        if (d < hd)
            *reinterpret_cast<float4*>(&s_acc[warp][d]) =
                make_float4(acc[4 * c], acc[4 * c + 1], acc[4 * c + 2], acc[4 * c + 3]);
    }
    __syncthreads();
    float bm = NEG_INF;
#pragma unroll
    for (int w = 0; w < NW; ++w) bm = fmaxf(bm, s_m[w]);
    float wgt[NW];
#pragma unroll
    for (int w = 0; w < NW; ++w) wgt[w] = s_l[w] > 0.f ? expf(s_m[w] - bm) : 0.f;
    if (threadIdx.x == 0) {
        float bl = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) bl += s_l[w] * wgt[w];
        rec[0] = bm;
        rec[1] = bl;
    }
    for (int d = threadIdx.x; d < hd; d += NW * 32) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) a += s_acc[w][d] * wgt[w];
        rec[2 + d] = a;
    }
}

// The head's output out[d] = sum_t acc_t[d] w_t / sum_t l_t w_t over NS records in record order, w_t =
// exp(m_t - max m) (0 for a record that saw no position); rec(t, i) reads record t's float i, each d's NS
// values loaded at once. Every thread of the block (NTH of them) calls it; s_m, s_l, s_w [NS]. SINK: the
// denominator also takes exp(sink - max m), a logit that joins the softmax and takes no value (gpt-oss's; -inf
// adds exactly 0).
template <int NS, int NTH, bool SINK = false, class Rec>
__device__ __forceinline__ void merge_records(Rec rec, int hd, float* s_m, float* s_l, float* s_w, float* out,
                                              float sink = 0.f)
{
    if (threadIdx.x < NS) {
        s_m[threadIdx.x] = rec(threadIdx.x, 0);
        s_l[threadIdx.x] = rec(threadIdx.x, 1);
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
    if constexpr (SINK) gl += expf(sink - gm);  // past float's range: inf, and the output its limit, 0
    for (int d = threadIdx.x; d < hd; d += NTH) {
        float v[NS];
#pragma unroll
        for (int t = 0; t < NS; ++t) v[t] = rec(t, 2 + d);
        float a = 0.f;
#pragma unroll
        for (int t = 0; t < NS; ++t) a += v[t] * s_w[t];
        out[d] = a / gl;
    }
}

// The first position a decode row at pos sees: 0, or with a sliding window the window's first.
__device__ __forceinline__ int first_seen(int pos, int window) { return window > 0 ? max(0, pos + 1 - window) : 0; }
// Share ``part`` of ``parts`` of positions [lo, end): [pb, pe).
__device__ __forceinline__ void position_share(int lo, int end, int part, int parts, int& pb, int& pe) {
    const int chunk = (end - lo + parts - 1) / parts;
    pb = lo + part * chunk;
    pe = min(end, pb + chunk);
}

// ---------------------------------------------------------------------------------------------------------
// Decode attention folded into the q|k|v GEMV (gemv.cu FOLD_ATTENTION: M = 1, hd == TN, each head's K splits one
// cluster). A q head's cluster does the head's attention right after its GEMV, with no launch of its own and no
// merge through L2: block 0 merges the head's sums and applies RoPE (rope_head) into its q, which it pushes to
// the other blocks' shared memory; block r > 0 attends over share r - 1 of the positions before this one (the
// cache holds them: earlier steps wrote them) and pushes its record to block 0; block 0, which has the GEMV's
// merge and RoPE on its path already, takes the position itself, whose key and value the KV heads' clusters
// publish as tagged words (``kv_now``, rope_head) in the same launch, and merges the records into ``out``. The tag is the tile's epoch + 1: every tile's epoch grows by one with
// each launch, so all of them agree (the state's own ``epochs``, zeroed). A q head's block 0 polls the KV
// heads' words, so the KV heads' tiles are the grid's first blocks (qgemv's tile order).
struct AttendArgs {
    float* out;                  // [H * hd]: the attention's output row
    float scale;                 // the query's scale
    int window;                  // sliding window (0: none)
    unsigned long long* kv_now;  // [2 KV hd]: this position's keys and values, tagged
    unsigned* epochs;            // [H + 2 KV]
};
#define ATTEND_AB 2              // positions of a warp's group: two keep the GEMV's 64 registers a thread

struct AttendSmem {                           // float4 accesses: q and acc first, 16-byte aligned
    float q[TN];                              // the head's q (block 0: its own; the others: pushed to them)
    float acc[NT / 32][TN];                   // merge_warps' warp partials
    float rec[MAX_CLUSTER + 1][ATT_REC(TN)];  // block 0: block r's record at r, the position's last; block r: its
                                              // own at 0
    float m[MAX_CLUSTER + 1], l[MAX_CLUSTER + 1], w[MAX_CLUSTER + 1];
    float score[NT / 32];
    unsigned long long q_bar, rec_bar;        // q's bytes (blocks 1..), the other blocks' records (block 0)
};
__device__ __forceinline__ AttendSmem& attend_smem() {
    __shared__ __align__(16) AttendSmem s;
    return s;
}

// Thread 0 of every block of the cluster, before the cluster barrier's arrive: its mbarriers (fenced by the
// caller's mbar_init_fence, then armed by attend_arm).
__device__ __forceinline__ void attend_init() {
    AttendSmem& s = attend_smem();
    mbar_init(&s.q_bar, 1);
    mbar_init(&s.rec_bar, 1);
}
__device__ __forceinline__ void attend_arm(unsigned rank, unsigned csize) {
    AttendSmem& s = attend_smem();
    if (rank != 0) mbar_expect_tx(&s.q_bar, TN * sizeof(float));
    else mbar_expect_tx(&s.rec_bar, (csize - 1) * ATT_REC(TN) * sizeof(float));
}

// Block rank > 0 of a q head's cluster: its share of the head's earlier positions as a record (q from s.q once
// block 0 has pushed it), pushed to block 0.
__device__ __forceinline__ void attend_rest(const AttendArgs& a, const kv_t* kb, const kv_t* vb, int pos,
                                            unsigned rank, unsigned csize)
{
    AttendSmem& s = attend_smem();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int pb, pe;
    position_share(first_seen(pos, a.window), pos, rank - 1, csize - 1, pb, pe);
    float mx, l, acc[4];
    attend_warp<4, ATTEND_AB>([&](float (&qr)[4]) {
        mbar_wait(&s.q_bar, 0);
        const float4 q = *reinterpret_cast<const float4*>(&s.q[4 * lane]);
        qr[0] = q.x * a.scale; qr[1] = q.y * a.scale; qr[2] = q.z * a.scale; qr[3] = q.w * a.scale;
    }, kb, vb, TN, pb, pe, warp, NT / 32, lane, 0.f, mx, l, acc);  // no soft cap: capped models keep attn_decode
    merge_warps<4, NT / 32>(mx, l, acc, TN, warp, lane, s.m, s.l, s.acc, s.rec[0]);
    __syncthreads();
    if (threadIdx.x < ATT_REC(TN)) push_to(&s.rec[rank][threadIdx.x], &s.rec_bar, s.rec[0][threadIdx.x], 0);
}

// Block 0 of a q head's cluster, s.q its roped q: pushes it to the other blocks, attends to the position itself,
// merges every record into a.out (head ``head``).
__device__ __forceinline__ void attend_first(const AttendArgs& a, int head, int kvh, unsigned csize, unsigned tag)
{
    AttendSmem& s = attend_smem();
    const int tid = threadIdx.x;
    __syncthreads();                        // s.q is whole
    cluster_wait();                         // the other blocks' mbarriers are armed
    if (tid < TN)
        for (unsigned r = 1; r < csize; ++r) push_to(&s.q[tid], &s.q_bar, s.q[tid], r);
    // the position itself: its key (threads < TN) and value (the next TN), published by the KV heads' blocks
    const unsigned long long* now = a.kv_now + (size_t)2 * kvh * TN + tid;
    unsigned long long wd = ld_tagged(now);
    while ((unsigned)(wd >> 32) != tag) wd = ld_tagged(now);
    const float x = __uint_as_float((unsigned)wd);
    if (tid < TN) {
        const float sc = warp_sum(s.q[tid] * a.scale * x);
        if ((tid & 31) == 0) s.score[tid >> 5] = sc;
    } else {
        s.rec[MAX_CLUSTER][2 + tid - TN] = x;
    }
    __syncthreads();
    if (tid == 0) {
        float sc = 0.f;
#pragma unroll
        for (int w = 0; w < TN / 32; ++w) sc += s.score[w];
        s.rec[MAX_CLUSTER][0] = sc;
        s.rec[MAX_CLUSTER][1] = 1.f;
    }
    mbar_wait(&s.rec_bar, 0);
    __syncthreads();
    merge_records<MAX_CLUSTER + 1, NT>([&](int t, int i) {
        return (t > 0 && t < (int)csize) || t == MAX_CLUSTER ? s.rec[t][i] : i == 0 ? NEG_INF : 0.f;
    }, TN, s.m, s.l, s.w, a.out + (size_t)head * TN);
}
