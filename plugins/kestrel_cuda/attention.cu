// Attention over the device KV cache (float16 keys and values, forward.cuh kv_t; every sum in float32):
// attn_decode (one query row, split over positions), attn_rows (a batch of sequences' decode rows over the
// paged pool) and attn_prefill (causal, 16 query rows a block).

// Decode attention (one query row at position meta[0], keys 0..meta[0], or the last ``window`` of them),
// split over positions.
// Grid: x = H, y = NS splits; block 128 (4 warps). Each warp runs an online softmax over groups of AB
// positions (their keys and values loaded together: AB x 2 x MAXJ loads in flight per lane); the block
// merges its warps, writes (max, sum, acc[hd]) to part[h][split], and the last block of a head merges the
// NS splits (every split's partial loaded at once, merge weights computed once, fixed order). q is scaled
// by 1/sqrt(hd) before the dot products.
#define AW 4
#define PT 32    // positions of a shared-memory tile (attn_rows: one page of the pool, KV_BLOCK)
#define NCH 2    // attn_rows, attn_prefill: a lane's 4-dimension chunks, 128 dimensions apart (hd <= 256)
// MAXJ: a lane's dimensions, hd <= 32 * MAXJ (4: hd <= 128, 8: hd <= 256), in chunks of 4 consecutive ones
// 128 apart (dimension 4 lane + 128 (j / 4) + j % 4), each chunk of a key or value one 8-byte load of float16;
// AB = 32 / MAXJ positions a step keep AB x 2 x MAXJ / 4 loads in flight per lane at either size.
template <int NS, int MAXJ>
__global__ void __launch_bounds__(AW * 32) attn_decode(
    const float* __restrict__ q, const kv_t* __restrict__ kc, const kv_t* __restrict__ vc, int cap, int H,
    int KV, int hd, float scale, const int* __restrict__ meta, float* __restrict__ part,
    int* __restrict__ counters, float* __restrict__ out, int window)
{
    grid_dep_launch();
    grid_dep_wait();
    constexpr int AB = 32 / MAXJ;
    constexpr int NW = NS > AW ? NS : AW;   // s_m, s_l hold the warps' partials first, then the splits'
    __shared__ float s_m[NW], s_l[NW], s_w[NS];
    __shared__ __align__(16) float s_acc[AW][32 * MAXJ];
    __shared__ int s_last;
    const int h = blockIdx.x, split = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int len = meta[0] + 1;
    // positions from a sliding window's first, lo, counted from there (the loop then is the windowless one)
    const int lo = window > 0 ? max(0, len - window) : 0, seen = len - lo;
    const int chunk = (seen + NS - 1) / NS;
    const int pb = split * chunk;
    const int pe = min(seen, pb + chunk);
    const int kvh = h / (H / KV);
    const kv_t* kb = kc + ((size_t)kvh * cap + lo) * hd;
    const kv_t* vb = vc + ((size_t)kvh * cap + lo) * hd;
    constexpr int NC = MAXJ / 4;            // a lane's chunks
    float qr[MAXJ], acc[MAXJ];
#pragma unroll
    for (int j = 0; j < MAXJ; ++j) {
        const int d = 4 * lane + 128 * (j / 4) + j % 4;
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
            for (int c = 0; c < NC; ++c) {
                const int d = 4 * lane + 128 * c;
                const bool ok = p < pe && d < hd;
                const size_t at = (size_t)(p < pe ? p : 0) * hd + d;
                const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
                const float4 kk = ok ? from_kv4(*reinterpret_cast<const uint2*>(kb + at)) : zero;
                const float4 vv = ok ? from_kv4(*reinterpret_cast<const uint2*>(vb + at)) : zero;
                kr[b][4 * c] = kk.x; kr[b][4 * c + 1] = kk.y; kr[b][4 * c + 2] = kk.z; kr[b][4 * c + 3] = kk.w;
                vr[b][4 * c] = vv.x; vr[b][4 * c + 1] = vv.y; vr[b][4 * c + 2] = vv.z; vr[b][4 * c + 3] = vv.w;
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
    for (int c = 0; c < NC; ++c) {
        const int d = 4 * lane + 128 * c;
        if (d < hd)
            *reinterpret_cast<float4*>(&s_acc[warp][d]) =
                make_float4(acc[4 * c], acc[4 * c + 1], acc[4 * c + 2], acc[4 * c + 3]);
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
    if (!arrive_last(&counters[h], NS, &s_last)) return;
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
}

// ------------------------------------------------------------------------------------------------------
// Batched decode attention over the paged pool: row blockIdx.y, at position rows[2y], sees keys 0..rows[2y] (or
// the last ``window`` of them) of the sequence whose page table is tables[rows[2y + 1]] (rope.cuh kv_slot). blockIdx.z = part + parts * split:
// a block takes query heads part * NW .. part * NW + NW - 1 (NW = blockDim.x / 32 <= 8 warps, one a head) of
// the G = H / KV heads of KV head blockIdx.x, over its split's share of the row's pages (``splits`` of them:
// enough blocks when the batch is small), so each page of keys and values is read from memory once for them:
// the block stages page after page in shared memory (two buffers, 8-byte cp.async of 4 float16; a page's
// KV_BLOCK == PT positions are contiguous), and each warp runs attn_prefill's scheme on it: lane j scores
// position j (8-byte shared reads of 4 dimensions, conflict-free with key rows padded by 4), a warp-wide online
// softmax, lane j accumulates dimensions 4j..4j+3. With splits > 1 each head's (max,
// sum, acc[hd]) goes to part[row][head][split] (records of hd + 4 floats) and the last block of (row, KV head,
// part) to arrive merges the splits in order, as attn_decode does. hd % 4 == 0, hd <= 256 (a lane's NCH
// chunks of 4 dimensions, 128 apart); HD: hd known at
// compile time (the page copy's index arithmetic and the dot products unrolled), 0: read from ``hd``. The dot
// products and the value sums are fused multiply-adds (--fmad=false keeps every other kernel's apart).
// Dynamic shared memory: 2 * PT * (2 * hd + 4) float16, then NW * hd floats.
template <int HD>
__global__ void __launch_bounds__(256) attn_rows(
    const float* __restrict__ q, const kv_t* __restrict__ kc, const kv_t* __restrict__ vc, int cap, int H,
    int KV, int hd_arg, float scale, const int* __restrict__ rows, const int* __restrict__ tables, int tb,
    float* __restrict__ out, int splits, float* __restrict__ part, int* __restrict__ counters, int window)
{
    grid_dep_launch();
    grid_dep_wait();
    extern __shared__ float smem[];
    const int hd = HD ? HD : hd_arg;
    const int ldk = hd + 4;                 // 8-byte aligned rows, conflict-free per half warp
    const int G = H / KV, kvh = blockIdx.x, row = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int parts = (G + nw - 1) / nw, hpart = blockIdx.z % parts, split = blockIdx.z / parts;
    const int g0 = hpart * nw, heads = min(nw, G - g0);  // this block's heads of the group
    kv_t* ks = reinterpret_cast<kv_t*>(smem);  // [2][PT][hd + 4]
    kv_t* vs = ks + 2 * PT * ldk;           // [2][PT][hd]
    float* qs = reinterpret_cast<float*>(vs + 2 * PT * hd);  // [NW][hd], scaled (16-byte aligned: 128 (2 hd + 4) B)
    const int len = rows[2 * row] + 1;
    const int lo = window > 0 ? max(0, len - window) : 0;  // a sliding window's first position
    const int* table = tables + (size_t)rows[2 * row + 1] * tb;
    const kv_t* kb = kc + (size_t)kvh * cap * hd;
    const kv_t* vb = vc + (size_t)kvh * cap * hd;
    const float* qr = q + (size_t)row * H * hd + (size_t)(kvh * G + g0) * hd;
    for (int i = threadIdx.x; i < heads * hd; i += blockDim.x) qs[i] = qr[i] * scale;
    const int p0 = lo / PT;                 // the first page holding a visible position
    const int per = ((len + PT - 1) / PT - p0 + splits - 1) / splits;  // pages of a split
    const int pb = p0 + split * per, pages = min((len + PT - 1) / PT, pb + per);
    const int hd4 = hd / 4;
    auto load = [&](int t, int buf) {       // page t, zero-filled past len
        const size_t base = (size_t)kv_slot(table, t * PT) * hd;
        for (int i = threadIdx.x; i < PT * hd4; i += blockDim.x) {
            const int r = i / hd4, d = 4 * (i - r * hd4);
            const bool ok = t * PT + r < len;
            cp_async8(smem_u32(ks + (buf * PT + r) * ldk + d), ok ? kb + base + (size_t)r * hd + d : kb, ok ? 8 : 0);
            cp_async8(smem_u32(vs + (buf * PT + r) * hd + d), ok ? vb + base + (size_t)r * hd + d : vb, ok ? 8 : 0);
        }
    };
    if (pb < pages) load(pb, 0);
    cp_async_commit();
    const int d4 = 4 * lane;                // chunk c holds dimensions d4 + 128 c .. + 3
    float acc[NCH][4] = {};
    float mx = NEG_INF, l = 0.f;
    const float4* q4 = reinterpret_cast<const float4*>(qs + warp * hd);
    for (int t = pb; t < pages; ++t) {
        if (t + 1 < pages) load(t + 1, (t + 1 - pb) & 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();                    // page t (and the scaled q) visible to every warp
        const kv_t* kt = ks + ((t - pb) & 1) * PT * ldk;
        const kv_t* vt = vs + ((t - pb) & 1) * PT * hd;
        const int p = t * PT + lane;
        const uint2* k4 = reinterpret_cast<const uint2*>(kt + lane * ldk);
        float sc = 0.f;
#pragma unroll 8
        for (int dd = 0; dd < hd4; ++dd) {
            const float4 kk = from_kv4(k4[dd]), qq = q4[dd];
            sc = fmaf(qq.x, kk.x, sc); sc = fmaf(qq.y, kk.y, sc); sc = fmaf(qq.z, kk.z, sc);
            sc = fmaf(qq.w, kk.w, sc);
        }
        const bool valid = p < len && p >= lo;
        // some position of every page from p0 on is visible (lo < (p0 + 1) * PT, t * PT < len): mn is finite
        const float mn = fmaxf(mx, warp_max(valid ? sc : NEG_INF));
        const float corr = expf(mx - mn);
        const float e = valid ? expf(sc - mn) : 0.f;
        l = l * corr + warp_sum(e);
        mx = mn;
#pragma unroll
        for (int ch = 0; ch < NCH; ++ch)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[ch][c] *= corr;
        const int live = min(PT, len - t * PT);
#pragma unroll 4
        for (int r = 0; r < live; ++r) {    // the same count in every lane: the shuffle sees the whole warp
            const float w = __shfl_sync(FULL, e, r);
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch) {
                const int d = d4 + 128 * ch;
                if (d < hd) {
                    const float4 vv = from_kv4(*reinterpret_cast<const uint2*>(vt + r * hd + d));
                    acc[ch][0] = fmaf(w, vv.x, acc[ch][0]); acc[ch][1] = fmaf(w, vv.y, acc[ch][1]);
                    acc[ch][2] = fmaf(w, vv.z, acc[ch][2]); acc[ch][3] = fmaf(w, vv.w, acc[ch][3]);
                }
            }
        }
        __syncthreads();                    // every warp is done with buffer t & 1 before page t + 2 lands in it
    }
    const int head = kvh * G + g0 + warp;
    float* o = out + (size_t)row * H * hd + (size_t)head * hd + d4;
    if (splits == 1) {
        if (warp < heads) {
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch)
                if (d4 + 128 * ch < hd) {
#pragma unroll
                    for (int c = 0; c < 4; ++c) o[128 * ch + c] = acc[ch][c] / l;
                }
        }
        return;
    }
    const int rec = hd + 4;                 // a split's record: max, sum, 2 spare, acc[hd] (16-byte aligned)
    float* ph = part + ((size_t)row * H + head) * splits * rec;  // this head's splits
    if (warp < heads) {
        float* pp = ph + (size_t)split * rec;
        if (lane == 0) { pp[0] = mx; pp[1] = l; }  // an empty split: max -inf, sum 0
#pragma unroll
        for (int ch = 0; ch < NCH; ++ch)
            if (d4 + 128 * ch < hd)
                *reinterpret_cast<float4*>(pp + 4 + d4 + 128 * ch) =
                    make_float4(acc[ch][0], acc[ch][1], acc[ch][2], acc[ch][3]);
    }
    __shared__ int s_last;
    if (!arrive_last(counters + ((size_t)row * KV + kvh) * parts + hpart, splits, &s_last)) return;
    if (warp < heads) {                     // lane s holds split s's max and sum (splits <= 32)
        const float ms = lane < splits ? __ldcg(ph + (size_t)lane * rec) : NEG_INF;
        const float ls = lane < splits ? __ldcg(ph + (size_t)lane * rec + 1) : 0.f;
        const float gm = warp_max(ms);
        const float ws = ls > 0.f ? expf(ms - gm) : 0.f;
        float gl = 0.f, a[NCH][4] = {};
        for (int t = 0; t < splits; ++t) {  // in split order
            const float w = __shfl_sync(FULL, ws, t);
            gl += __shfl_sync(FULL, ls, t) * w;
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch) {
                const int d = d4 + 128 * ch;
                if (d < hd) {
                    const float4 v = __ldcg(reinterpret_cast<const float4*>(ph + (size_t)t * rec + 4 + d));
                    a[ch][0] += v.x * w; a[ch][1] += v.y * w; a[ch][2] += v.z * w; a[ch][3] += v.w * w;
                }
            }
        }
#pragma unroll
        for (int ch = 0; ch < NCH; ++ch)
            if (d4 + 128 * ch < hd) {
#pragma unroll
                for (int c = 0; c < 4; ++c) o[128 * ch + c] = a[ch][c] / gl;
            }
    }
    if (threadIdx.x == 0) counters[((size_t)row * KV + kvh) * parts + hpart] = 0;
}

// ------------------------------------------------------------------------------------------------------
// Prefill attention: rows m of q at positions meta[0] + m see keys 0..meta[0] + m (causal; with ``window``,
// the last ``window`` of them). 16 query rows
// per block (two per warp), so each key/value tile staged in shared memory (PT positions) serves 16
// queries, and 16-byte shared-memory reads: lane j scores key j against both of its warp's queries, then
// accumulates its chunks of 4 consecutive dimensions of each. hd % 4 == 0, hd <= 256.
// Grid: x = H, y = ceil(M / 16); block 256; dynamic shared memory (32*(hd+4) + 32*hd + 16*hd) floats.
#define PQ2 16
extern "C" __global__ void __launch_bounds__(256) attn_prefill(
    const float* __restrict__ q, const kv_t* __restrict__ kc, const kv_t* __restrict__ vc, int cap, int H,
    int KV, int hd, float scale, const int* __restrict__ meta, int M, float* __restrict__ out, int window)
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
    const int loa = window > 0 ? pa - window + 1 : 0;  // the rows' sliding windows' first keys
    const int lob = window > 0 ? loa + 1 : 0;
    const int first = window > 0 ? max(0, pos0 + r0 - window + 1) : 0;  // the block's first row's first key
    const int kvh = h / (H / KV);
    const kv_t* kb = kc + (size_t)kvh * cap * hd;
    const kv_t* vb = vc + (size_t)kvh * cap * hd;
    for (int i = threadIdx.x; i < PQ2 * hd; i += 256) {
        const int r = i / hd, d = i - r * hd;
        qs[i] = r0 + r < M ? q[(size_t)(r0 + r) * H * hd + h * hd + d] * scale : 0.f;
    }
    const int d4 = 4 * lane;                // this lane's chunks of 4 dimensions: d4 + 128 c .. + 3
    float acc_a[NCH][4] = {}, acc_b[NCH][4] = {};
    float mxa = NEG_INF, mxb = NEG_INF, la = 0.f, lb = 0.f;
    const float4* qa4 = reinterpret_cast<const float4*>(qs + (2 * warp) * hd);
    const float4* qb4 = reinterpret_cast<const float4*>(qs + (2 * warp + 1) * hd);
    for (int t0 = first / PT * PT; t0 <= pmax; t0 += PT) {
        __syncthreads();
        for (int i = threadIdx.x; i < PT * hd; i += 256) {
            const int r = i / hd, d = i - r * hd;
            const int p = t0 + r;
            float kv = 0.f, vv = 0.f;
            if (p <= pmax) { kv = from_kv(kb[(size_t)p * hd + d]); vv = from_kv(vb[(size_t)p * hd + d]); }
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
        const bool va = p <= pa && p >= loa, vbk = mb < M && p <= pbq && p >= lob;
        const float sa = va ? da : NEG_INF, sb = vbk ? db : NEG_INF;
        // a row updates only on a tile holding one of its keys (then its max is finite)
        float ea = 0.f, eb = 0.f, corr_a = 1.f, corr_b = 1.f;
        if (t0 <= pa && t0 + PT > loa) {
            const float mn = fmaxf(mxa, warp_max(sa));
            corr_a = expf(mxa - mn);
            ea = va ? expf(sa - mn) : 0.f;
            la = la * corr_a + warp_sum(ea);
            mxa = mn;
        }
        if (mb < M && t0 + PT > lob) {
            const float mn = fmaxf(mxb, warp_max(sb));
            corr_b = expf(mxb - mn);
            eb = vbk ? expf(sb - mn) : 0.f;
            lb = lb * corr_b + warp_sum(eb);
            mxb = mn;
        }
#pragma unroll
        for (int ch = 0; ch < NCH; ++ch)
#pragma unroll
            for (int c = 0; c < 4; ++c) { acc_a[ch][c] *= corr_a; acc_b[ch][c] *= corr_b; }
        for (int r = 0; r < PT; ++r) {
            // every lane shuffles (full-mask shuffles must be reached by the whole warp); lanes past hd skip
            // the accumulation
            const float wa = __shfl_sync(FULL, ea, r), wb = __shfl_sync(FULL, eb, r);
            if (wa == 0.f && wb == 0.f) continue;
#pragma unroll
            for (int ch = 0; ch < NCH; ++ch) {
                const int d = d4 + 128 * ch;
                if (d < hd) {
                    const float4 vv = *reinterpret_cast<const float4*>(vs + r * hd + d);
                    acc_a[ch][0] += wa * vv.x; acc_a[ch][1] += wa * vv.y; acc_a[ch][2] += wa * vv.z;
                    acc_a[ch][3] += wa * vv.w;
                    acc_b[ch][0] += wb * vv.x; acc_b[ch][1] += wb * vv.y; acc_b[ch][2] += wb * vv.z;
                    acc_b[ch][3] += wb * vv.w;
                }
            }
        }
    }
#pragma unroll
    for (int ch = 0; ch < NCH; ++ch) {
        const int d = d4 + 128 * ch;
        if (d >= hd) continue;
        if (ma < M) {
#pragma unroll
            for (int c = 0; c < 4; ++c) out[(size_t)ma * H * hd + h * hd + d + c] = acc_a[ch][c] / la;
        }
        if (mb < M) {
#pragma unroll
            for (int c = 0; c < 4; ++c) out[(size_t)mb * H * hd + h * hd + d + c] = acc_b[ch][c] / lb;
        }
    }
}
#undef AW
#undef NCH
#undef PT
#undef PQ2
