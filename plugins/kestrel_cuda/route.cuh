// A mixture of experts' router on the device: route_top and route_weights choose a row's experts from its
// logits (moe.cu moe_route; for the router folded into a decode step's o projection, route_top in the fold's
// last block and route_weights in moe_combine); route_part and route_choose_folded are that fold's blocks
// (plan.RouteFold, run by qgemv beside the o projection's own).

#define ROUTE_MAX_EXPERTS NT  // the choosing block holds one router logit a thread
#define ROUTE_FOLD_ROWS 16    // router rows of one fold block: 16 threads a row
#define ROUTE_FOLD_F4 8       // float4s of its row a fold thread holds: a K span of at most 16 x 4 x 8 = 512

// A row's choice as kestrel_core.model.decoder.route makes it, in two steps (the fold's first runs before the
// row's rms is known): route_top, the k experts of the highest logits (the most probable: softmax keeps their
// order; ties: the lower expert) into sel[0..k) in increasing order, the order the CPU decoder adds them in; and
// route_weights, their softmax probabilities over the E (renormalised over the k if norm_topk) into wts[0..k),
// and with a shared gate wts[k] = sigmoid(gate). Thread e holds expert e's logit l (e < E) or, for route_top,
// any value in the same order (it returns e's slot, or -1); every thread calls them.
__device__ __forceinline__ int route_top(float l, int E, int k, int* __restrict__ sel)
{
    __shared__ __align__(16) float s_l[ROUTE_MAX_EXPERTS];  // past E: -inf, below every logit
    __shared__ int s_count[NT / 32];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    s_l[tid] = tid < E ? l : NEG_INF;           // NT == ROUTE_MAX_EXPERTS
    __syncthreads();
    int rank = 0;                               // experts ahead of this one
    if (tid < E)
#pragma unroll 8
        for (int j = 0; j < E; j += 4) {        // four a load: 295 against 356 us a qwen3-30b-a3b step
            const float4 q = *reinterpret_cast<const float4*>(s_l + j);
            rank += (q.x > l || (q.x == l && j < tid)) + (q.y > l || (q.y == l && j + 1 < tid))
                  + (q.z > l || (q.z == l && j + 2 < tid)) + (q.w > l || (q.w == l && j + 3 < tid));
        }
    const bool chosen = tid < E && rank < k;
    const unsigned below = __ballot_sync(FULL, chosen);
    if (lane == 0) s_count[warp] = __popc(below);
    __syncthreads();
    int slot = -1;
    if (chosen) {
        slot = __popc(below & ((1u << lane) - 1));  // chosen experts below this one
        for (int w = 0; w < warp; ++w) slot += s_count[w];
        sel[slot] = tid;
    }
    return slot;                                // -1: not chosen
}

// sel: written by this block before a barrier, or by another before this block's arrival.
__device__ __forceinline__ void route_weights(float l, float gate, int E, int k, int norm_topk, int shared_gate,
                                              const int* sel, float* __restrict__ wts)
{
    __shared__ float s_red[NT / 32];
    __shared__ float s_p[ROUTE_MAX_EXPERTS];
    __shared__ int s_sel[ROUTE_MAX_EXPERTS];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid < k) s_sel[tid] = __ldcg(sel + tid);
    if (tid >= E) l = NEG_INF;
    float mx = warp_max(l);
    if (lane == 0) s_red[warp] = mx;
    __syncthreads();
    mx = s_red[0];
#pragma unroll
    for (int w = 1; w < NT / 32; ++w) mx = fmaxf(mx, s_red[w]);
    const float p = tid < E ? expf(l - mx) : 0.f;
    s_p[tid] = p / block_sum(p, s_red);         // block_sum's barrier publishes s_sel too
    __syncthreads();
    if (tid < k) {
        float total = 0.f;                      // the chosen probabilities summed in expert order
        for (int q = 0; q < k; ++q) total += s_p[s_sel[q]];
        const float prob = s_p[s_sel[tid]];
        wts[tid] = norm_topk ? prob / total : prob;
    }
    if (tid == 0 && shared_gate) wts[k] = 1.f / (1.f + expf(-gate));
}

// The router's arguments for a fold (plan.RouteFold, qgemv's last parameters r*): w [R][D + K] (router·diag(norm),
// then its product with the o projection's weights), R rows (E experts, + 1: a shared-expert gate), k chosen a
// row, span the K range of [h | a] a fold block sums, part [K splits][R] their sums (row 0 then the totals),
// count the arrivals, sel [k] the choice and wts [k + 1] its totals (the gate's last), which moe_combine weighs
// once h''s rms is known; groups = ceil(R / ROUTE_FOLD_ROWS) fold blocks a K split.
struct RouteArgs {
    const float* w;
    int groups, R, E, k, norm_topk, span;
    float* part;
    int* count;
    int* sel;
    float* wts;
};

// The last fold block: each row's total over the splits in split order (into part's row 0, each thread over its
// own column), the experts by those totals (route_top: dividing by h''s rms keeps their order), their totals
// into wts; the count reset for the next launch.
__device__ __forceinline__ void route_choose_folded(const RouteArgs& ra, int splits)
{
    const int tid = threadIdx.x;
    float l = 0.f, gate = 0.f;
    if (tid < ra.R)
#pragma unroll 16
        for (int s = 0; s < splits; ++s) l += __ldcg(ra.part + (size_t)s * ra.R + tid);
    if (tid == 0 && ra.R > NT)                  // a shared gate after NT experts
        for (int s = 0; s < splits; ++s) gate += __ldcg(ra.part + (size_t)s * ra.R + NT);
    if (tid < ra.R) ra.part[tid] = l;
    if (tid == 0 && ra.R > NT) ra.part[NT] = gate;
    const int slot = route_top(l, ra.E, ra.k, ra.sel);
    if (slot >= 0) ra.wts[slot] = l;
    if (ra.R > ra.E && tid == (ra.E < NT ? ra.E : 0)) ra.wts[ra.k] = ra.E < NT ? l : gate;
    if (tid == 0) *ra.count = 0;
}

// Fold block (group, split) of a decode step's o projection: router rows e0 = group x ROUTE_FOLD_ROWS on the
// span [k0, k0 + span) of the row [h | Q(a)] (h: the residual stream before the o projection's add, D wide; a:
// its input, quantized per 32 as its prologue quantizes it, each value code x scale); the sums go to part[split],
// then it arrives (route_choose_folded if last). Its rows are loaded before the PDL wait: not step data.
__device__ __forceinline__ void route_part(const RouteArgs& ra, int group, int split, int splits,
                                           const float* __restrict__ h, const float* __restrict__ a, int D)
{
    __shared__ __align__(16) float s_in[ROUTE_FOLD_F4 * 4 * ROUTE_FOLD_ROWS];
    __shared__ int s_last;
    const int tid = threadIdx.x, row = tid >> 4, sub = tid & 15, e = group * ROUTE_FOLD_ROWS + row;
    const int k0 = split * ra.span, nf = ra.span / (4 * ROUTE_FOLD_ROWS), KR = ra.span * splits;  // D + K
    const float4* wrow = reinterpret_cast<const float4*>(ra.w + (size_t)e * KR + k0) + sub;
    float4 wv[ROUTE_FOLD_F4];
#pragma unroll
    for (int i = 0; i < ROUTE_FOLD_F4; ++i)
        wv[i] = e < ra.R && i < nf ? ld_before_wait(wrow + 16 * i) : make_float4(0.f, 0.f, 0.f, 0.f);
    grid_dep_wait();
    for (int j = tid; j < ra.span; j += NT) {   // a warp's 32 values: one group of h or of a (D % 32 == 0)
        const int kk = k0 + j;
        float v;
        if (kk < D) {
            v = __ldcg(h + kk);
        } else {
            const float x = __ldcg(a + kk - D);
            const float d = warp_max(fabsf(x)) / 127.f;
            const float inv = d == 0.f ? 0.f : 1.f / d;
            v = (float)(int)roundf(x * inv) * d;  // qgemv's code times its scale
        }
        s_in[j] = v;
    }
    __syncthreads();
    const float4* in4 = reinterpret_cast<const float4*>(s_in);
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < ROUTE_FOLD_F4; ++i) {
        if (i >= nf) break;
        const float4 x = in4[sub + 16 * i];
        acc += x.x * wv[i].x + x.y * wv[i].y + x.z * wv[i].z + x.w * wv[i].w;
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) acc += __shfl_xor_sync(FULL, acc, o);  // the row's 16 threads
    if (sub == 0 && e < ra.R) ra.part[(size_t)split * ra.R + e] = acc;
    if (arrive_last(ra.count, ra.groups * splits, &s_last)) route_choose_folded(ra, splits);
}
