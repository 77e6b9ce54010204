// Where the q|k|v heads go (qkv_rope, and qgemv's epilogue at M = 1): per-head rmsnorm weights (null: none),
// the RoPE tables [positions][hd / 2], the position, q [H * hd] of the row, and this layer's KV cache
// (float16).
struct QkvRope {
    const float* qnorm;
    const float* knorm;
    const float* cosT;
    const float* sinT;
    const int* meta;
    float* qout;
    kv_t* kc;
    kv_t* vc;
    int H, KV, cap;
    float eps;
};

// The cache row of position pos: pos itself in a sequence's own cache (table null), else its place in the
// paged pool, table[pos / KV_BLOCK] being the block that holds it (the engine's page table).
#define KV_BLOCK 32
__device__ __forceinline__ int kv_slot(const int* table, int pos) {
    return table ? table[pos / KV_BLOCK] * KV_BLOCK + pos % KV_BLOCK : pos;
}

// A lane's factors of a head for rope_head, pairs lane + 32 t (zero past hd / 2 and for v heads): RoPE's
// cosines and sines at pos and the head norm's weights. qgemv's epilogue loads them before its PDL wait.
template <int PAIRS>
struct RopeLane {
    float c[PAIRS], s[PAIRS], w1[PAIRS], w2[PAIRS];
};
template <int PAIRS>
__device__ __forceinline__ RopeLane<PAIRS> rope_lane(const QkvRope& qr, int head, int hd, int pos, int lane)
{
    RopeLane<PAIRS> f;
    const int half = hd / 2;
    const bool rotated = head < qr.H + qr.KV;
    const float* nw = head < qr.H ? qr.qnorm : qr.knorm;
#pragma unroll
    for (int t = 0; t < PAIRS; ++t) {
        const int i = lane + 32 * t;
        const bool ok = rotated && i < half;
        f.c[t] = ok ? qr.cosT[(size_t)pos * half + i] : 0.f;
        f.s[t] = ok ? qr.sinT[(size_t)pos * half + i] : 0.f;
        f.w1[t] = ok && nw ? nw[i] : 0.f;
        f.w2[t] = ok && nw ? nw[i + half] : 0.f;
    }
    return f;
}

// One warp: head ``head`` (q: < H, k: < H + KV, then v) of a q|k|v row, src its hd values, f its lanes'
// rope_lane: q and k heads get the optional per-head rmsnorm and RoPE, to qout (or ``qdst``) or the key cache;
// v heads go to the value cache, both at cache row ``slot``. With ``kv_now`` (the q|k|v GEMV that folds decode
// attention in, attend.cuh) keys and values also go there as tagged words, as the cache rounds them: KV head
// j's keys at [2 j hd], its values at [(2 j + 1) hd].
// PAIRS: a lane's (x1, x2) pairs, hd <= 64 * PAIRS (2: hd <= 128, the GEMV epilogue's; 4: hd <= 256), so the
// fused epilogue carries no registers for head_dims it never sees.
template <int PAIRS>
__device__ __forceinline__ void rope_head(const QkvRope& qr, const float* src, int head, int hd, int slot,
                                          int lane, const RopeLane<PAIRS>& f, float* qdst = nullptr,
                                          unsigned long long* kv_now = nullptr, unsigned tag = 0)
{
    const int H = qr.H, KV = qr.KV;
    if (head >= H + KV) {
        const int kvh = head - H - KV;
        kv_t* vdst = qr.vc + ((size_t)kvh * qr.cap + slot) * hd;
        for (int d = lane; d < hd; d += 32) {
            const kv_t v = to_kv(src[d]);
            vdst[d] = v;
            if (kv_now) st_tagged(kv_now + (size_t)(2 * kvh + 1) * hd + d, from_kv(v), tag);
        }
        return;
    }
    const bool isq = head < H;
    const int kvh = head - H;
    const int half = hd / 2;
    float x1[PAIRS], x2[PAIRS];  // pairs lane + 32 t
    float ss = 0.f;
#pragma unroll
    for (int t = 0; t < PAIRS; ++t) {
        const int i = lane + 32 * t;
        x1[t] = x2[t] = 0.f;
        if (i < half) { x1[t] = src[i]; x2[t] = src[i + half]; }
        ss += x1[t] * x1[t] + x2[t] * x2[t];
    }
    if (isq ? qr.qnorm : qr.knorm) {
        ss = warp_sum(ss);
        const float r = sqrtf(ss / (float)hd + qr.eps);
#pragma unroll
        for (int t = 0; t < PAIRS; ++t) {
            const int i = lane + 32 * t;
            if (i < half) { x1[t] = x1[t] / r * f.w1[t]; x2[t] = x2[t] / r * f.w2[t]; }
        }
    }
    if (!qdst) qdst = qr.qout + (size_t)head * hd;
    kv_t* kdst = qr.kc + ((size_t)kvh * qr.cap + slot) * hd;
    unsigned long long* know = kv_now ? kv_now + (size_t)2 * kvh * hd : nullptr;
#pragma unroll
    for (int t = 0; t < PAIRS; ++t) {
        const int i = lane + 32 * t;
        if (i < half) {
            const float y1 = x1[t] * f.c[t] - x2[t] * f.s[t], y2 = x2[t] * f.c[t] + x1[t] * f.s[t];
            if (isq) { qdst[i] = y1; qdst[i + half] = y2; }
            else {
                const kv_t k1 = to_kv(y1), k2 = to_kv(y2);
                kdst[i] = k1; kdst[i + half] = k2;
                if (know) { st_tagged(know + i, from_kv(k1), tag); st_tagged(know + i + half, from_kv(k2), tag); }
            }
        }
    }
}
