// Attention over the device KV cache (float16 keys and values, forward.cuh kv_t; every sum in float32):
// attn_decode (one query row, split over positions) and attn_rows (a batch of sequences' decode rows over the
// paged pool); attn_prefill is attention_prefill.cu's, which follows this file in the module (PT, NCH).

// Decode attention (one query row at position meta[0], keys 0..meta[0], or the last ``window`` of them),
// split over positions (attend.cuh's pieces).
// Grid: x = H, y = NS splits; block 128 (4 warps). Each warp runs an online softmax over groups of AB = 32 / MAXJ
// positions (attend_warp: AB x 2 x MAXJ / 4 loads in flight per lane at either size); the block merges its
// warps into its record part[h][split], and the last block of a head merges the NS records (every split's loaded
// at once, merge weights computed once, fixed order). q is scaled by 1/sqrt(hd) before the dot products; with
// softcap > 0 each score is soft-capped (Gemma 2) before the softmax, as in attn_rows and attn_prefill. With
// sinks ([H], gpt-oss's; null: none) head h's softmax has one more logit, sinks[h], which takes no value: its
// exp joins the denominator, as in attn_rows and attn_prefill.
#define AW 4
#define PT 32    // positions of a shared-memory tile (attn_rows: one page of the pool, KV_BLOCK)
#define NCH 2    // attn_rows, attn_prefill: a lane's 4-dimension chunks, 128 dimensions apart (hd <= 256)
template <int NS, int MAXJ>
__global__ void __launch_bounds__(AW * 32) attn_decode(
    const float* __restrict__ q, const kv_t* __restrict__ kc, const kv_t* __restrict__ vc, int cap, int H,
    int KV, int hd, float scale, const int* __restrict__ meta, float* __restrict__ part,
    int* __restrict__ counters, float* __restrict__ out, int window, float softcap, const float* __restrict__ sinks)
{
    grid_dep_launch();
    grid_dep_wait();
    constexpr int NW = NS > AW ? NS : AW;   // s_m, s_l hold the warps' partials first, then the splits'
    __shared__ float s_m[NW], s_l[NW], s_w[NS];
    __shared__ __align__(16) float s_acc[AW][32 * MAXJ];
    __shared__ int s_last;
    const int h = blockIdx.x, split = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int pos = meta[0];
    int pb, pe;
    position_share(first_seen(pos, window), pos + 1, split, NS, pb, pe);
    const int kvh = h / (H / KV);
    const kv_t* kb = kc + (size_t)kvh * cap * hd;
    const kv_t* vb = vc + (size_t)kvh * cap * hd;
    float mx, l, acc[MAXJ];
    attend_warp<MAXJ, 32 / MAXJ>([&](float (&qr)[MAXJ]) {
#pragma unroll
        for (int j = 0; j < MAXJ; ++j) {
            const int d = 4 * lane + 128 * (j / 4) + j % 4;
            qr[j] = d < hd ? q[(size_t)h * hd + d] * scale : 0.f;
        }
    }, kb, vb, hd, pb, pe, warp, AW, lane, softcap, mx, l, acc);
    merge_warps<MAXJ, AW>(mx, l, acc, hd, warp, lane, s_m, s_l, s_acc, part + ((size_t)h * NS + split) * ATT_REC(hd));
    if (!arrive_last(&counters[h], NS, &s_last)) return;
    const float* ph = part + (size_t)h * NS * ATT_REC(hd);
    merge_records<NS, AW * 32, true>([&](int t, int i) { return __ldcg(ph + (size_t)t * ATT_REC(hd) + i); }, hd,
                                     s_m, s_l, s_w, out + (size_t)h * hd, sinks ? __ldg(sinks + h) : NEG_INF);
    if (threadIdx.x == 0) counters[h] = 0;
}

// ------------------------------------------------------------------------------------------------------
// Batched decode attention over the paged pool, on the tensor cores: row blockIdx.y, at position rows[2y], sees
// keys 0..rows[2y] (or the last ``window`` of them) of the sequence whose page table is tables[rows[2y + 1]]
// (rope.cuh kv_slot). blockIdx.z = part + parts * split. A block takes query heads part * 8 .. + 7 of the
// G = H / KV heads of KV head blockIdx.x (heads past G repeat head 0 and are dropped), over its split's share of
// the row's pages (``splits`` of them: enough blocks when the batch is small). It stages page after page
// (KV_BLOCK == PT contiguous positions) in shared memory by cp.async, NBUF pages of buffers (all but one
// in flight), so each key and value is read from memory once for all the heads; each of its two warps takes 16
// positions of a page: scores S = Q K^T as m16n8k16 float16 products with float32 sums, an online softmax in
// float32, O += P V likewise; at the end warp 1's state joins warp 0's through shared memory.
// The float16 operands keep float32's accuracy: the scaled query and the probabilities go in as two float16
// terms each, hi = f16(x) and lo = f16(x - hi) (keys and values are float16 already), so each product is exact
// and only the float32 sums round (in another order than the CPU's). Head h's hi terms are row h of the m16
// tiles and its lo terms row 8 + h, so one product carries both and a lane holds both halves of its head's
// scores and of its O (added at the end): half the products and softmax work of a head a row with its terms in
// two products (docs/performance.md). The query is multiplied by a power of two
// that keeps it below 2^14 (undone on the scores), the probabilities by 2^12 (undone at the end), so neither
// term leaves float16's normal range where it matters.
// With splits > 1 each head's (max, sum, acc[hd]) goes to part[row][head][split] (records of hd + 4 floats)
// and the last block of (row, KV head, part) merges the splits in order, as attn_decode does. sinks: as
// attn_decode's.
// HDP: an instance's head dimension, a power of two from 16 to 256; hd <= HDP, hd % 4 == 0 (dimensions hd..HDP
// are zero). Dynamic shared memory (float16): q [2][heads][HDP + 8] (hi, lo), then keys and values
// [NBUF][PT][HDP + 8] each: rows padded by 16 bytes, so the 8 rows one ldmatrix phase reads hit 8 bank groups.
#define ROWS_HEADS 8           // query heads of one attn_rows block (plan.ATTN_ROWS_HEADS)
#define ROWS_WARPS 2           // warps of one attn_rows block, each on 16 positions of a page (plan.ATTN_ROWS_WARPS)
#define ROWS_MAX_SPLITS 8      // position splits of attn_rows, at most (plan.ATTN_ROWS_MAX_SPLITS)
#define ROWS_BUFFERS 3         // pages in shared memory up to head_dim 128, two at 256 (plan.attn_rows_buffers):
                               // two in flight while one is read (8 pages an SM instead of 6: docs/performance.md)
#define P_SCALE 4096.f
#define P_UNSCALE (1.f / 4096.f)

// float16 pair of x0 (low half) and x1
__device__ __forceinline__ u32 pack_f16x2(float x0, float x1) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
    return r;
}

// x0, x1 as two float16 pairs: hi = f16(x), lo = f16(x - hi)
__device__ __forceinline__ void split_f16x2(float x0, float x1, u32& hi, u32& lo) {
    hi = pack_f16x2(x0, x1);
    lo = pack_f16x2(x0 - from_kv((kv_t)(hi & 0xffffu)), x1 - from_kv((kv_t)(hi >> 16)));
}

// e^x as the special-function unit's 2^(x log2 e): relative error about 2^-22, far inside the comparison bands
__device__ __forceinline__ float fexp(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
}

// d += a * b: m16n8k16, float16 operands, float32 sums
__device__ __forceinline__ void mma_f16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// out[at .. at + 3] = y where ``in``. With ``codes``, attn_rows also writes the o projection's activation codes
// and scales of its rows, as quantize_rows (pro 0, G = 32) would make them from out (common.cuh q8_scale): hd %
// 32 == 0, so a group is one head's; the 8 lanes holding a group (lanes 8 i .. 8 i + 7) exchange their largest
// magnitudes, so every lane of the warp calls this together.
__device__ __forceinline__ void store_out_codes4(float* out, i8* codes, float* cscales, size_t at, float4 y, bool in) {
    if (in) *reinterpret_cast<float4*>(out + at) = y;
    if (!codes) return;
    float amax = fmaxf(fmaxf(fabsf(y.x), fabsf(y.y)), fmaxf(fabsf(y.z), fabsf(y.w)));
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, o));
    const float d = q8_scale(amax), inv = q8_inv(d);
    if (!in) return;
    *reinterpret_cast<char4*>(codes + at) =
        make_char4(q8_code(y.x, inv), q8_code(y.y, inv), q8_code(y.z, inv), q8_code(y.w, inv));
    if ((at & 31) == 0) cscales[at / 32] = d;
}

template <int HDP>
__global__ void __launch_bounds__(32 * ROWS_WARPS) attn_rows(
    const float* __restrict__ q, const kv_t* __restrict__ kc, const kv_t* __restrict__ vc, int cap, int H,
    int KV, int hd, float scale, const int* __restrict__ rows, const int* __restrict__ tables, int tb,
    float* __restrict__ out, int splits, float* __restrict__ part, int* __restrict__ counters, int window,
    i8* __restrict__ codes, float* __restrict__ cscales, float softcap, const float* __restrict__ sinks)
{
    static_assert(HDP >= 16 && HDP <= 256 && (HDP & (HDP - 1)) == 0, "HDP: a power of two, 16..256");
    static_assert(ROWS_WARPS == 2, "each warp takes 16 of a page's PT = 32 positions; warp 1 joins warp 0 at the end");
    static_assert(PT == KV_BLOCK, "a staged tile is one page of the pool");
    constexpr int LD = HDP + 8, KS = HDP / 16, NV = HDP / 8;  // row stride, k16 steps of a score, n8 tiles of O
    constexpr int NBUF = HDP <= 128 ? ROWS_BUFFERS : 2;
    grid_dep_launch();  // the wait follows the copies of the pages earlier steps wrote (below)
    extern __shared__ __align__(16) kv_t smem_h[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
    const int G = H / KV, kvh = blockIdx.x, row = blockIdx.y;
    const int parts = (G + ROWS_HEADS - 1) / ROWS_HEADS, hpart = blockIdx.z % parts, split = blockIdx.z / parts;
    const int g0 = hpart * ROWS_HEADS, heads = min(ROWS_HEADS, G - g0), head0 = kvh * G + g0;
    kv_t* qs = smem_h;                      // [2][heads][LD]
    kv_t* ks = qs + 2 * heads * LD;         // [NBUF][PT][LD]
    kv_t* vs = ks + NBUF * PT * LD;         // [NBUF][PT][LD]
    const int len = rows[2 * row] + 1;
    const int lo = window > 0 ? max(0, len - window) : 0;  // a sliding window's first position
    const int* table = tables + (size_t)rows[2 * row + 1] * tb;
    const kv_t* kb = kc + (size_t)kvh * cap * hd;
    const kv_t* vb = vc + (size_t)kvh * cap * hd;
    const int p0 = lo / PT;                 // the first page holding a visible position
    const int per = ((len + PT - 1) / PT - p0 + splits - 1) / splits;  // pages of a split
    const int pb = p0 + split * per, pages = min((len + PT - 1) / PT, pb + per);
    // a page's copy: chunks of 8 dimensions (16 bytes; 4 dimensions, 8 bytes, where hd % 8 != 0), chunk i of
    // a thread being tid + 64 i of the page's, row-major
    constexpr int NTH = 32 * ROWS_WARPS;
    const int cw = (hd & 7) == 0 ? 8 : 4, cpr = hd / cw;
    const int r0 = tid / cpr, c0 = tid - r0 * cpr, dr = NTH / cpr, dc = NTH - dr * cpr;
    // the split's first 32 page numbers, lane i holding page pb + i's (read once, not before each page)
    const int first_pages = pb + lane < pages ? table[pb + lane] : 0;
    auto load = [&](int t, int buf) {       // page t, zero-filled past len
        const int page = t - pb < 32 ? __shfl_sync(FULL, first_pages, t - pb) : table[t];
        const size_t base = (size_t)page * PT * hd;  // kv_slot(table, t * PT)
        const int live = len - t * PT;
        const u32 kd = smem_u32(ks + buf * PT * LD), vd = smem_u32(vs + buf * PT * LD);
        if (hd == HDP) {  // a thread's chunks: one column, NTH / (HDP / 8) rows apart (the address math once)
            constexpr int CPR = HDP / 8, DR = NTH / CPR;
            const int r = tid / CPR, c = tid % CPR;
            const kv_t* kp = kb + base + r * HDP + c * 8;
            const kv_t* vp = vb + base + r * HDP + c * 8;
            const u32 so = 2 * (r * LD + c * 8);
#pragma unroll
            for (int i = 0; i < PT / DR; ++i) {
                const bool ok = r + i * DR < live;
                cp_async16(kd + so + 2 * i * DR * LD, ok ? kp + i * DR * HDP : kb, ok ? 16 : 0);
                cp_async16(vd + so + 2 * i * DR * LD, ok ? vp + i * DR * HDP : vb, ok ? 16 : 0);
            }
            return;
        }
        for (int r = r0, c = c0; r < PT;) {
            const bool ok = r < live;
            const size_t at = base + (size_t)r * hd + c * cw;
            const u32 so = 2 * (r * LD + c * cw);
            if (cw == 8) {
                cp_async16(kd + so, ok ? kb + at : kb, ok ? 16 : 0);
                cp_async16(vd + so, ok ? vb + at : vb, ok ? 16 : 0);
            } else {
                cp_async8(kd + so, ok ? kb + at : kb, ok ? 8 : 0);
                cp_async8(vd + so, ok ? vb + at : vb, ok ? 8 : 0);
            }
            r += dr; c += dc;
            if (c >= cpr) { c -= cpr; ++r; }
        }
    };
    // ldmatrix rows of this lane: the query's (A), the keys' of the warp's two n8 tiles (B), the values' (B,
    // .trans); warp w takes positions 16 w .. 16 w + 15 of each page
    const int qh = lane & 7;           // row lane % 16: head qh's hi (< 8) or lo term
    const u32 qa = smem_u32(qs + (((lane >> 3) & 1) * heads + (qh < heads ? qh : 0)) * LD + ((lane >> 4) << 3));
    const int krow = 16 * warp + ((lane >> 4) << 3) + (lane & 7), kcol = ((lane >> 3) & 1) << 3;
    const int vrow = 16 * warp + (lane & 7) + (((lane >> 3) & 1) << 3), vcol = (lane >> 4) << 3;

    float o[NV][4];
#pragma unroll
    for (int n = 0; n < NV; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    // head gid's max and this lane's terms of its sum; with sinks, split 0's warp 0 starts from the sink (its logit
    // the max so far, its exp the sum, in lane tig 0; no value), so that the merges count it once
    const bool sinker = sinks && split == 0 && warp == 0;
    float mx0 = sinker ? __ldg(sinks + head0 + (gid < heads ? gid : 0)) : NEG_INF;
    float l0 = sinker && tig == 0 ? 1.f : 0.f;
    // The first pages in flight, one copy group each. Those whose every position an earlier step wrote are
    // copied before the wait for the kernels before this one (PDL: qkv_rope writes this step's positions, and
    // the query). A sequence's rows of a pass are consecutive, at consecutive positions, so this pass writes
    // position q of this row's sequence iff row ``row - (len - 1 - q)`` is at q in the same sequence; a step
    // launched with PDL (a captured one) is one pass. The rows and page tables come from the host.
    auto settled = [&](int t) {             // page t's last visible position, so all of it, is older
        const int last = min((t + 1) * PT, len) - 1, back = row - (len - 1 - last);
        return back < 0 || rows[2 * back] != last || rows[2 * back + 1] != rows[2 * row + 1];
    };
    bool early[NBUF - 1];                   // a prefix of the pages: each one's positions precede the next's
#pragma unroll
    for (int i = 0; i < NBUF - 1; ++i) {
        early[i] = (i == 0 || early[i - 1]) && pb + i < pages && settled(pb + i);
        if (early[i]) {
            load(pb + i, i);
            cp_async_commit();
        }
    }
    grid_dep_wait();
#pragma unroll
    for (int i = 0; i < NBUF - 1; ++i) {
        if (early[i]) continue;
        if (pb + i < pages) load(pb + i, i);
        cp_async_commit();
    }
    // the query, scaled, as float16 hi and lo terms (dimensions hd..HDP zero), while the first page arrives:
    // float4 loads, four a lane in flight; multiplied by 2^-sh (sh > 0 only past float16's range: a second pass).
    // Each warp stages all of it (the same values), so each knows sh without a barrier.
    const float4* qr = reinterpret_cast<const float4*>(q + (size_t)row * H * hd + (size_t)head0 * hd);
    const int nq4 = heads * hd / 4, hd4 = hd / 4;
    auto stage_q = [&](float qmul) -> float {
        float amax = 0.f;
        for (int i0 = 0; i0 < nq4; i0 += 128) {
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int i = i0 + 32 * u + lane;
                v[u] = i < nq4 ? __ldg(qr + i) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int i = i0 + 32 * u + lane;
                if (i >= nq4) break;
                const float x[4] = {(v[u].x * scale) * qmul, (v[u].y * scale) * qmul, (v[u].z * scale) * qmul,
                                    (v[u].w * scale) * qmul};
                amax = fmaxf(amax, fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3]))));
                u32 hi[2], lo[2];
                split_f16x2(x[0], x[1], hi[0], lo[0]);
                split_f16x2(x[2], x[3], hi[1], lo[1]);
                const int h = i / hd4, d = 4 * (i - h * hd4);
                *reinterpret_cast<uint2*>(qs + h * LD + d) = make_uint2(hi[0], hi[1]);
                *reinterpret_cast<uint2*>(qs + (heads + h) * LD + d) = make_uint2(lo[0], lo[1]);
            }
        }
        return warp_max(amax);
    };
    const int ex = ((__float_as_int(stage_q(1.f)) >> 23) & 0xff) - 127;  // max |q| < 2^(ex + 1)
    const int sh = ex >= 14 ? ex - 13 : 0;
    if (sh) stage_q(__int_as_float((127 - sh) << 23));
    const float smul = __int_as_float((127 + sh) << 23);
    for (int i = tid; hd < HDP && i < 2 * heads * (HDP - hd); i += NTH)  // the query rows' padding
        qs[i / (HDP - hd) * LD + hd + i % (HDP - hd)] = 0;
    for (int i = tid; hd < HDP && i < 2 * NBUF * PT * (HDP - hd); i += NTH)  // every buffer's key and value rows'
        ks[i / (HDP - hd) * LD + hd + i % (HDP - hd)] = 0;
    for (int t = pb, buf = 0, next = NBUF - 1; t < pages; ++t) {  // page t in buffer buf, t + NBUF - 1 to next
        if (t + NBUF - 1 < pages) load(t + NBUF - 1, next);
        cp_async_commit();
        cp_async_wait<NBUF - 1>();
        __syncthreads();                    // page t, and the query at the first, visible to every thread
        const u32 kt = smem_u32(ks + buf * PT * LD), vt = smem_u32(vs + buf * PT * LD);
        float s[2][4] = {};  // n8 tile j: head gid's hi (0, 1) and lo (2, 3) terms x positions 16 w + 8 j + 2 tig, + 1
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            u32 a[4], b[4];
            ldmatrix_x4(a, qa + 32 * kk);
            ldmatrix_x4(b, kt + 2 * (krow * LD + 16 * kk + kcol));
            mma_f16(s[0], a, b[0], b[1]);
            mma_f16(s[1], a, b[2], b[3]);
        }
        float m0 = NEG_INF, sc[2][2];
        const bool whole = t * PT >= lo && (t + 1) * PT <= len;  // every position of the page visible
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int p = t * PT + 16 * warp + 8 * j + 2 * tig + e;
                float x = (s[j][e] + s[j][e + 2]) * smul;
                if (softcap > 0.f) x = soft_cap(x, softcap);  // Gemma 2
                sc[j][e] = whole || (p >= lo && p < len) ? x : NEG_INF;
                m0 = fmaxf(m0, sc[j][e]);
            }
        m0 = fmaxf(m0, __shfl_xor_sync(FULL, m0, 1));
        m0 = fmaxf(m0, __shfl_xor_sync(FULL, m0, 2));
        // a warp's half of a page may hold no visible position: z, the maximum or 0, keeps exp(-inf - z) at 0
        const float n0 = fmaxf(mx0, m0);
        const float z0 = n0 == NEG_INF ? 0.f : n0;
        const float cr0 = fexp(mx0 - z0);
        mx0 = n0;
        l0 *= cr0;
        if (__any_sync(FULL, cr0 != 1.f)) {
#pragma unroll
            for (int n = 0; n < NV; ++n) { o[n][0] *= cr0; o[n][1] *= cr0; o[n][2] *= cr0; o[n][3] *= cr0; }
        }
        u32 pa[4];                          // P as the A operand of the warp's 16 positions: hi, lo, hi, lo
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const float e0 = fexp(sc[j][0] - z0), e1 = fexp(sc[j][1] - z0);
            l0 += e0 + e1;
            split_f16x2(e0 * P_SCALE, e1 * P_SCALE, pa[2 * j], pa[2 * j + 1]);
        }
#pragma unroll
        for (int n = 0; n < NV; n += 2) {
            u32 b[4];
            ldmatrix_x4_trans(b, vt + 2 * (vrow * LD + 8 * n + vcol));
            mma_f16(o[n], pa, b[0], b[1]);
            mma_f16(o[n + 1], pa, b[2], b[3]);
        }
        __syncthreads();                    // every warp is done with buffer buf before page t + NBUF lands in it
        next = buf;
        buf = buf + 1 == NBUF ? 0 : buf + 1;
    }
    cp_async_wait<0>();
    l0 += __shfl_xor_sync(FULL, l0, 1);
    l0 += __shfl_xor_sync(FULL, l0, 2);
    {   // warp 1's (max, sum, acc) into warp 0's, lane by lane: both hold the same fragments of their rows
        float* xs = reinterpret_cast<float*>(ks);  // [NV * 4 + 2][32]: the staged pages are done with
        __syncthreads();
        if (warp == 1) {
#pragma unroll
            for (int n = 0; n < NV; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) xs[(4 * n + e) * 32 + lane] = o[n][e];
            xs[(4 * NV) * 32 + lane] = mx0;
            xs[(4 * NV + 1) * 32 + lane] = l0;
        }
        __syncthreads();
        if (warp == 0) {
            const float mb0 = xs[(4 * NV) * 32 + lane];
            const float m0 = fmaxf(mx0, mb0);
            const float z0 = m0 == NEG_INF ? 0.f : m0;  // an empty split
            const float wa0 = expf(mx0 - z0), wb0 = expf(mb0 - z0);
            l0 = l0 * wa0 + xs[(4 * NV + 1) * 32 + lane] * wb0;
            mx0 = m0;
#pragma unroll
            for (int n = 0; n < NV; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[n][e] = o[n][e] * wa0 + xs[(4 * n + e) * 32 + lane] * wb0;
        }
    }
    const int rec = hd + 4;                 // a split's record: max, sum, 2 spare, acc[hd] (16-byte aligned)
    float* staged = reinterpret_cast<float*>(vs);  // [heads][hd]: the block's output, unsplit, before its stores
    if (warp == 0) {                        // head gid (< heads: the others repeat head 0): hi and lo sums added
        const bool live = gid < heads;
        float* dst = splits == 1 ? staged + gid * hd
                                 : part + (((size_t)row * H + head0 + gid) * splits + split) * rec + 4;
        if (live && splits > 1 && tig == 0) { dst[-4] = mx0; dst[-3] = l0; }  // empty: -inf, 0
#pragma unroll
        for (int n = 0; n < NV; ++n) {
            const int d = 8 * n + 2 * tig;  // d < hd, hd % 4 == 0: d + 1 < hd
            float2 v = make_float2((o[n][0] + o[n][2]) * P_UNSCALE, (o[n][1] + o[n][3]) * P_UNSCALE);
            if (splits == 1) { v.x = v.x / l0; v.y = v.y / l0; }
            if (live && d < hd) *reinterpret_cast<float2*>(dst + d) = v;
        }
    }
    if (splits == 1) {  // the block's heads are contiguous in out: written a float4 a thread, coalesced
        __syncthreads();
        const int n4 = heads * hd / 4;      // a multiple of 8 where there are codes (hd % 32 == 0)
        const size_t at = ((size_t)row * H + head0) * hd;
        for (int i0 = 0; i0 < n4; i0 += NTH) {
            const int i = i0 + tid;
            const bool in = i < n4;
            store_out_codes4(out, codes, cscales, at + 4 * i,
                             in ? reinterpret_cast<const float4*>(staged)[i] : make_float4(0.f, 0.f, 0.f, 0.f), in);
        }
        return;
    }
    __shared__ int s_last;
    if (!arrive_last(counters + ((size_t)row * KV + kvh) * parts + hpart, splits, &s_last)) return;
    const int d4 = 4 * lane;                // chunk c holds dimensions d4 + 128 c .. + 3
    for (int r = 0; r < heads && warp == 0; ++r) {  // lane s holds split s's max and sum
        const float* ph = part + ((size_t)row * H + head0 + r) * splits * rec;
        const float ms = lane < splits ? __ldcg(ph + (size_t)lane * rec) : NEG_INF;
        const float ls = lane < splits ? __ldcg(ph + (size_t)lane * rec + 1) : 0.f;
        float4 v[ROWS_MAX_SPLITS][NCH];     // every split's chunks in flight at once
#pragma unroll
        for (int t = 0; t < ROWS_MAX_SPLITS; ++t)
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch) {
                const int d = d4 + 128 * ch;
                v[t][ch] = t < splits && d < hd ? __ldcg(reinterpret_cast<const float4*>(ph + (size_t)t * rec + 4 + d))
                                                : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        const float gm = warp_max(ms);
        const float ws = ls > 0.f ? expf(ms - gm) : 0.f;
        float gl = 0.f, a[NCH][4] = {};
#pragma unroll
        for (int t = 0; t < ROWS_MAX_SPLITS; ++t) {  // in split order
            if (t >= splits) break;
            const float w = __shfl_sync(FULL, ws, t);
            gl += __shfl_sync(FULL, ls, t) * w;
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch) {
                a[ch][0] += v[t][ch].x * w; a[ch][1] += v[t][ch].y * w; a[ch][2] += v[t][ch].z * w;
                a[ch][3] += v[t][ch].w * w;
            }
        }
        const size_t at = ((size_t)row * H + head0 + r) * hd + d4;
#pragma unroll
        for (int ch = 0; ch < NCH; ++ch)  // with codes, in is the same for a group's 8 lanes (hd % 32 == 0)
            store_out_codes4(out, codes, cscales, at + 128 * ch,
                             make_float4(a[ch][0] / gl, a[ch][1] / gl, a[ch][2] / gl, a[ch][3] / gl),
                             d4 + 128 * ch < hd);
    }
    if (tid == 0) counters[((size_t)row * KV + kvh) * parts + hpart] = 0;
}
#undef AW
