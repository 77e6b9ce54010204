// Prefill attention: rows m of q at positions meta[0] + m see keys 0..meta[0] + m (causal; with ``window``,
// the last ``window`` of them). 16 query rows
// per block (two per warp), so each key/value tile staged in shared memory (PT positions) serves 16
// queries, and 16-byte shared-memory reads: lane j scores key j against both of its warp's queries, then
// accumulates its chunks of 4 consecutive dimensions of each. hd % 4 == 0, hd <= 256. softcap > 0: each score
// soft-capped (Gemma 2) before the softmax; sinks ([H], gpt-oss's; null: none): head h's softmax has one more
// logit, sinks[h], which takes no value, as in attn_decode.
// Grid: x = H, y = ceil(M / 16); block 256; dynamic shared memory (32*(hd+4) + 32*hd + 16*hd) floats.
#define PQ2 16
extern "C" __global__ void __launch_bounds__(256) attn_prefill(
    const float* __restrict__ q, const kv_t* __restrict__ kc, const kv_t* __restrict__ vc, int cap, int H,
    int KV, int hd, float scale, const int* __restrict__ meta, int M, float* __restrict__ out, int window,
    float softcap, const float* __restrict__ sinks)
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
    // the online softmax starts from the sink (its logit the max so far, its exp the sum, no value), or empty
    const float sink = sinks ? __ldg(sinks + h) : NEG_INF;
    float mxa = sink, mxb = sink, la = sinks ? 1.f : 0.f, lb = la;
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
        if (softcap > 0.f) { da = soft_cap(da, softcap); db = soft_cap(db, softcap); }
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
#undef NCH
#undef PT
#undef PQ2
