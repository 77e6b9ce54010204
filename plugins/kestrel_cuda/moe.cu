// A mixture of experts on the device: moe_route (each row's experts and weights, chosen by the router),
// moe_combine (the chosen experts' outputs, weighted, into the residual stream) and, for a step of several rows,
// moe_group (the rows' chosen experts sorted into the grouped GEMM's blocks). Between route and combine a
// decode step's experts run as qgemv over a table of expert weights (gemv.cu: block z takes slot z's expert),
// a step of several rows' as grouped GEMMs (gemm_mma.cu), so either step is one captured graph.

#define ROUTE_ROWS 8          // router rows a block
#define ROUTE_PREFETCH 2      // float4s of each row a thread loads before the PDL wait (all of D <= 2048)

// Router rows R = E (+ 1: Qwen2-MoE's shared-expert gate, row E) of D floats, [R][D] (D % 4 == 0); grid
// (ceil(R / ROUTE_ROWS), M), NT threads, D floats of dynamic shared memory. Each block normalises its row,
// x = rmsnorm(h[m], w) (M = 1: from the residual stream's tile sums, as qgemv's prologue; else a sum of its
// own), block 0 stores it in xn[m] (the experts' input), and computes logits[m][r] = x . router[r] for its
// ROUTE_ROWS rows, every thread over its float4s of each row (loaded before the wait where they fit: the
// router is not step data), plus rbias[r] for an expert's row where there is one (gpt-oss's router bias [E]).
// The row's last block to arrive (counters[m], reset) chooses (route.cuh route_top, route_weights): sel[m][0..k)
// the experts in increasing order, wts[m] (rows of k + 1) their weights, then a shared gate's.
extern "C" __global__ void __launch_bounds__(NT) moe_route(
    const float* __restrict__ h, int ldh, int D, const float* __restrict__ normw, float eps,
    const float* __restrict__ ssq_in, const float* __restrict__ router, int E, int shared_gate, int k,
    int norm_topk, float* __restrict__ xn, int ldxn, float* __restrict__ logits, int* __restrict__ counters,
    int* __restrict__ sel, float* __restrict__ wts, const float* __restrict__ rbias)
{
    grid_dep_launch();
    extern __shared__ float4 s_x4[];            // [D / 4]: the normed row
    float* s_x = reinterpret_cast<float*>(s_x4);
    __shared__ float s_red[NT / 32];
    __shared__ float s_dot[ROUTE_ROWS][NT / 32];
    __shared__ int s_last;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, m = blockIdx.y;
    const int R = E + (shared_gate ? 1 : 0), D4 = D / 4, r0 = blockIdx.x * ROUTE_ROWS;
    float4 wpre[ROUTE_ROWS][ROUTE_PREFETCH];
#pragma unroll
    for (int q = 0; q < ROUTE_ROWS; ++q)
#pragma unroll
        for (int i = 0; i < ROUTE_PREFETCH; ++i) {
            const int j = tid + i * NT;
            const float4* row = reinterpret_cast<const float4*>(router + (size_t)(r0 + q) * D);
            wpre[q][i] = r0 + q < R && j < D4 ? ld_before_wait(row + j) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    // the row in passes of ROW_LOADS columns a thread, a pass's loads issued together: the norm weights of the
    // first before the wait (not step data), its row after it
    constexpr int PASS = NT * ROW_LOADS;
    float xv[ROW_LOADS], wv[ROW_LOADS];
#pragma unroll
    for (int i = 0; i < ROW_LOADS; ++i) wv[i] = tid + i * NT < D ? ld_before_wait(normw + tid + i * NT) : 0.f;
    grid_dep_wait();
    const float* hr = h + (size_t)m * ldh;
#pragma unroll
    for (int i = 0; i < ROW_LOADS; ++i) xv[i] = tid + i * NT < D ? __ldcg(hr + tid + i * NT) : 0.f;
    float r;
    if (ssq_in) {
        r = rms_from_tiles(ssq_in, D, eps);
    } else {
        r = sqrtf(block_sum(thread_ssq(hr, D), s_red) / (float)D + eps);
    }
    for (int p = 0; p < D; p += PASS) {
        if (p > 0) {
#pragma unroll
            for (int i = 0; i < ROW_LOADS; ++i) {
                const int j = p + tid + i * NT;
                xv[i] = j < D ? __ldcg(hr + j) : 0.f;
                wv[i] = j < D ? __ldg(normw + j) : 0.f;
            }
        }
#pragma unroll
        for (int i = 0; i < ROW_LOADS; ++i) {
            const int j = p + tid + i * NT;
            if (j >= D) break;
            const float v = xv[i] / r * wv[i];
            s_x[j] = v;
            if (blockIdx.x == 0) xn[(size_t)m * ldxn + j] = v;
        }
    }
    __syncthreads();
    float acc[ROUTE_ROWS];
#pragma unroll
    for (int q = 0; q < ROUTE_ROWS; ++q) acc[q] = 0.f;
#pragma unroll
    for (int i = 0; i < ROUTE_PREFETCH; ++i) {
        const int j = tid + i * NT;
        if (j >= D4) break;
        const float4 x = s_x4[j];
#pragma unroll
        for (int q = 0; q < ROUTE_ROWS; ++q)
            acc[q] += x.x * wpre[q][i].x + x.y * wpre[q][i].y + x.z * wpre[q][i].z + x.w * wpre[q][i].w;
    }
    for (int j = tid + ROUTE_PREFETCH * NT; j < D4; j += NT) {  // D > 2048: the rest, loaded now
        const float4 x = s_x4[j];
#pragma unroll
        for (int q = 0; q < ROUTE_ROWS; ++q) {
            if (r0 + q >= R) break;
            const float4 w = __ldg(reinterpret_cast<const float4*>(router + (size_t)(r0 + q) * D) + j);
            acc[q] += x.x * w.x + x.y * w.y + x.z * w.z + x.w * w.w;
        }
    }
#pragma unroll
    for (int q = 0; q < ROUTE_ROWS; ++q) {
        const float v = warp_sum(acc[q]);
        if (lane == 0) s_dot[q][warp] = v;
    }
    __syncthreads();
    if (tid < ROUTE_ROWS && r0 + tid < R) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < NT / 32; ++w) v += s_dot[tid][w];
        if (rbias && r0 + tid < E) v = v + __ldg(rbias + r0 + tid);
        logits[(size_t)m * R + r0 + tid] = v;
    }
    if (!arrive_last(counters + m, gridDim.x, &s_last)) return;

    const float* lr = logits + (size_t)m * R;
    const float l = tid < E ? __ldcg(lr + tid) : 0.f;
    route_top(l, E, k, sel + (size_t)m * k);
    __syncthreads();
    route_weights(l, tid == 0 && shared_gate ? __ldcg(lr + E) : 0.f, E, k, norm_topk, shared_gate, sel + (size_t)m * k,
                  wts + (size_t)m * (k + 1));
    if (tid == 0) counters[m] = 0;
}

// h[m][:] += sum_{j < K} Y[y(m, j)][:] * wts[m][j], then + Ysh[m][:] * wts[m][K] (a shared expert), summed from
// zero in that order as the CPU decoder does (a row's chosen experts are in increasing order); y(m, j) =
// index[m * K + j] (a prefill's expert-sorted rows) or m * K + j. wts rows hold ldw floats. Grid (ceil(D / NT),
// M); ssq_out (M = 1): h's sums of squares per 32 columns (forward.cuh). With rssq (M = 1, a RouteFold's choice:
// wts holds the chosen experts' router totals and the gate's, rtotals all E, rsel the experts) every block first
// weighs them, each total divided by h's rms (from rssq, its sums of squares): norm_topk, a softmax over the k
// chosen (the same weights as route_weights' renormalised probabilities), else as route_weights does.
#define COMBINE_REGS 8        // slots a thread loads at once: every k of Qwen3-MoE, Qwen2-MoE and Mixtral
extern "C" __global__ void __launch_bounds__(NT) moe_combine(
    const float* __restrict__ Y, int ldy, int K, const int* index, const float* __restrict__ Ysh,
    int ldsh, const float* __restrict__ wts, int ldw, float* __restrict__ h, int ldh, int D,
    float* __restrict__ ssq_out, const float* __restrict__ rssq, const float* __restrict__ rtotals,
    const int* __restrict__ rsel, int E, int norm_topk, float eps)
{
    __shared__ float s_w[ROUTE_MAX_EXPERTS + 1];
    grid_dep_launch();
    grid_dep_wait();
    const int m = blockIdx.y, n = blockIdx.x * NT + threadIdx.x;
    auto y_at = [&](int j) {                    // this thread's value of the row of slot j
        // index (moe_group's) is not __restrict__, so its plain load stays after the wait as the value's __ldcg
        // does, where an ld.global.nc of a const __restrict__ may be hoisted above it (__ldcg for index too: 142
        // against 134 us of moe_combine a qwen3-30b-a3b step)
        const size_t row = index ? (size_t)index[(size_t)m * K + j] : (size_t)m * K + j;
        return __ldcg(Y + row * ldy + n);
    };
    // the first COMBINE_REGS slots' values, h's, the shared expert's and a fold's totals loaded together, before
    // the weights
    float yv[COMBINE_REGS], hv = 0.f, shv = 0.f;
#pragma unroll
    for (int j = 0; j < COMBINE_REGS; ++j) yv[j] = j < K && n < D ? y_at(j) : 0.f;
    if (n < D) {
        hv = h[(size_t)m * ldh + n];
        if (Ysh) shv = __ldcg(Ysh + (size_t)m * ldsh + n);
    }
    const float total = rssq && norm_topk && (int)threadIdx.x <= K ? __ldcg(wts + threadIdx.x) : 0.f;
    const float* w = wts + (size_t)m * ldw;
    if (rssq) {
        const int tid = threadIdx.x;
        float ss = 0.f;                         // h's sum of squares, as rms_from_tiles adds it
        for (int t = tid & 31; t < (D + 31) / 32; t += 32) ss += __ldcg(rssq + t);
        const float r = sqrtf(warp_sum(ss) / (float)D + eps);
        if (norm_topk) {                        // the k chosen totals read once: no block-wide sums over the E
            if (tid <= K) s_w[tid] = total / r;
            __syncthreads();
            float mx = s_w[0], z = 0.f;
            for (int j = 1; j < K; ++j) mx = fmaxf(mx, s_w[j]);
            for (int j = 0; j < K; ++j) z += expf(s_w[j] - mx);
            const float mine = tid < K ? expf(s_w[tid] - mx) / z : Ysh ? 1.f / (1.f + expf(-s_w[K])) : 0.f;
            __syncthreads();
            if (tid <= K) s_w[tid] = mine;
        } else {
            const float l = tid < E ? __ldcg(rtotals + tid) / r : 0.f;
            route_weights(l, tid == 0 && Ysh ? __ldcg(wts + K) / r : 0.f, E, K, 0, Ysh != nullptr, rsel, s_w);
        }
        __syncthreads();
        w = s_w;
    }
    float y = 0.f;
    if (n < D) {
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < COMBINE_REGS; ++j)
            if (j < K) acc += yv[j] * w[j];
        for (int j = COMBINE_REGS; j < K; ++j) acc += y_at(j) * w[j];
        if (Ysh) acc += shv * w[K];
        y = hv + acc;
        h[(size_t)m * ldh + n] = y;
    }
    const int w0 = n & ~31;
    if (ssq_out && w0 < D) store_warp_ssq(y, ssq_out, w0);
}

// plan.expert_groups on the device, for a step of several rows: sel [M][k] (each row's experts), P = M k pairs,
// pair p = row * k + slot. Sorted by expert, then by p: position[p] is where pair p lands, source[q] the row
// that sorted position q reads, groups[g] = (expert, first position, count) for blocks of at most ``rows``
// positions of one expert in expert order, then (0, 0, 0) up to ``capacity`` groups (grouped GEMM blocks that
// do nothing, so the launch's grid is fixed and the step can be captured). One block: thread e counts, then
// places, expert e's pairs (E <= NT) in p order, over chunks of the pairs staged in shared memory.
#define GROUP_CHUNK 2048
extern "C" __global__ void __launch_bounds__(NT) moe_group(
    const int* __restrict__ sel, int P, int k, int E, int rows, int capacity, int* __restrict__ source,
    int* __restrict__ position, int* __restrict__ groups)
{
    grid_dep_launch();
    grid_dep_wait();
    __shared__ int s_sel[GROUP_CHUNK];
    __shared__ int s_warp[2][NT / 32];
    const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
    auto stage = [&](int c0) {                  // pairs c0 .. c0 + GROUP_CHUNK into shared memory
        __syncthreads();
        for (int i = threadIdx.x; i < GROUP_CHUNK && c0 + i < P; i += NT) s_sel[i] = sel[c0 + i];
        __syncthreads();
    };
    int count = 0;
    for (int c0 = 0; c0 < P; c0 += GROUP_CHUNK) {
        stage(c0);
        const int n = min(GROUP_CHUNK, P - c0);
        if (e < E)
            for (int i = 0; i < n; ++i) count += s_sel[i] == e;
    }
    const int blocks = (count + rows - 1) / rows;
    int first = count, g0 = blocks;             // inclusive scans over the threads, made exclusive below
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int a = __shfl_up_sync(FULL, first, o), b = __shfl_up_sync(FULL, g0, o);
        if (lane >= o) { first += a; g0 += b; }
    }
    if (lane == 31) { s_warp[0][warp] = first; s_warp[1][warp] = g0; }
    __syncthreads();
    int total = 0;
    for (int w = 0; w < NT / 32; ++w) {
        if (w < warp) { first += s_warp[0][w]; g0 += s_warp[1][w]; }
        total += s_warp[1][w];
    }
    first -= count;
    g0 -= blocks;
    int placed = 0;
    for (int c0 = 0; c0 < P; c0 += GROUP_CHUNK) {
        stage(c0);
        const int n = min(GROUP_CHUNK, P - c0);
        if (e < E && placed < count)
            for (int i = 0; i < n; ++i)
                if (s_sel[i] == e) {
                    const int q = first + placed++;
                    position[c0 + i] = q;
                    source[q] = (c0 + i) / k;
                }
    }
    for (int j = 0; j < blocks; ++j) {
        int* g = groups + 3 * (g0 + j);
        g[0] = e;
        g[1] = first + j * rows;
        g[2] = min(rows, count - j * rows);
    }
    for (int g = total + threadIdx.x; g < capacity; g += NT) groups[3 * g] = groups[3 * g + 1] = groups[3 * g + 2] = 0;
}
#undef GROUP_CHUNK

// Y[q][n] += bias[e][n] for the rows q of each of a grouped GEMM's groups (expert e, first row, rows: moe_group's;
// a count of 0, a block past the step's groups, does nothing): gpt-oss's expert biases, on a step of several rows'
// gate|up and down outputs (a decode step's routed GEMVs add them in their epilogue). Grid (ceil(N / NT), the
// groups); a thread a column, the group's rows in order.
extern "C" __global__ void __launch_bounds__(NT) moe_bias(
    float* __restrict__ Y, int ldy, int N, const int* __restrict__ groups, const float* __restrict__ bias)
{
    grid_dep_launch();
    grid_dep_wait();
    const int* g = groups + 3 * blockIdx.y;     // step data: through L2, after the wait (moe_combine's index)
    const int n = blockIdx.x * NT + threadIdx.x, count = __ldcg(g + 2);
    if (count == 0 || n >= N) return;
    const float b = __ldg(bias + (size_t)__ldcg(g) * N + n);
    float* y = Y + (size_t)__ldcg(g + 1) * ldy + n;
    for (int r = 0; r < count; ++r) y[(size_t)r * ldy] += b;
}
