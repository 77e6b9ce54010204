// Shared helpers of every kestrel_cuda kernel: the first source of both NVRTC modules (kernels.py). Compiled
// by NVRTC (CuPy RawModule) with --fmad=false and no system headers, so only builtin types are used.
typedef unsigned int u32;
typedef unsigned char u8;
typedef signed char i8;

#define FULL_MASK 0xffffffffu

// Q8_0 of a group of activations, bit for bit as kestrel_core.contract.quantize_activations: the scale
// d = amax / 127 (amax: the group's largest magnitude), inv = 1 / d (0 when d == 0), a value's code
// roundf(v * inv) (half away from zero), in float32 with IEEE division (NVRTC's default -prec-div=true).
__device__ __forceinline__ float q8_scale(float amax) { return amax / 127.0f; }
__device__ __forceinline__ float q8_inv(float d) { return d == 0.0f ? 0.0f : 1.0f / d; }
__device__ __forceinline__ i8 q8_code(float v, float inv) { return (i8)(int)roundf(v * inv); }

__device__ __forceinline__ float warp_sum(float v) {
    // xor butterfly: every lane ends with the same bits (float addition is commutative)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Four words holding rows k0..k3 of four consecutive columns (byte j = column j) become four words holding
// columns 0..3 (byte r = row k0+r): the operand order __dp4a and mma.sync want. 8 byte permutes.
__device__ __forceinline__ void transpose4x4(u32 w0, u32 w1, u32 w2, u32 w3,
                                             u32& c0, u32& c1, u32& c2, u32& c3) {
    const u32 t0 = __byte_perm(w0, w1, 0x5140);  // w0.b0 w1.b0 w0.b1 w1.b1
    const u32 t1 = __byte_perm(w0, w1, 0x7362);  // w0.b2 w1.b2 w0.b3 w1.b3
    const u32 t2 = __byte_perm(w2, w3, 0x5140);
    const u32 t3 = __byte_perm(w2, w3, 0x7362);
    c0 = __byte_perm(t0, t2, 0x5410);
    c1 = __byte_perm(t0, t2, 0x7632);
    c2 = __byte_perm(t1, t3, 0x5410);
    c3 = __byte_perm(t1, t3, 0x7632);
}

// int4 codes are stored offset by +8 (0..15) as 32-bit words of 8 consecutive k of one column: byte j holds
// k0 + j in its low nibble and k0 + 4 + j in its high one, so (x & 0x0F0F0F0F) is k0..k3 and (x & 0xF0F0F0F0)
// is 16 x (k4..k7), each ready for __dp4a against 4 activation codes without any byte transpose.
// ((u + 0x78) ^ 0x80) maps u in 0..15 to the signed byte u - 8 without carries between bytes.
#define NIB_LO 0x0F0F0F0Fu
#define NIB_HI 0xF0F0F0F0u
__device__ __forceinline__ u32 nib_lo(u32 x) { return ((x & NIB_LO) + 0x78787878u) ^ 0x80808080u; }
__device__ __forceinline__ u32 nib_hi(u32 x) { return (((x >> 4) & NIB_LO) + 0x78787878u) ^ 0x80808080u; }

// c + sum_j (unsigned byte j of a) * (signed byte j of b): __dp4a has no mixed-sign overload
__device__ __forceinline__ int dp4a_us(u32 a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// One BYTES-byte read-only load of a thread's columns (BYTES = 4, 8, or a multiple of 16), as 32-bit words.
template <int BYTES>
__device__ __forceinline__ void load_vec(const u8* __restrict__ p, u32 (&w)[BYTES / 4]) {
    if constexpr (BYTES >= 16) {
#pragma unroll
        for (int i = 0; i < BYTES / 16; ++i) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
            w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
        }
    } else if constexpr (BYTES == 8) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = v.x; w[1] = v.y;
    } else {
        w[0] = __ldg(reinterpret_cast<const u32*>(p));
    }
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

// Programmatic dependent launch (sm_90): a kernel launched with programmatic stream serialization may start while its
// predecessor in the stream is still running. Everything before grid_dep_wait() must touch only what no kernel of the
// step writes (weights, norms, tables; attn_rows: keys and values of positions earlier steps wrote), or what only the
// step's last kernel writes (a decode step's position meta[0], which qgemv's RoPE epilogue reads early: lm_finish,
// which waits for every kernel before it to complete); the wait returns once the predecessor has completed and its
// writes are visible. Without that launch attribute the wait returns at once. Every kernel of a captured step (the
// forward's, and the tiled GEMM of its steps of several rows) lets its dependents launch at its start: they only
// prefetch until their own wait. The one exception, a routed expert GEMV's choices (gemv.cu), holds because its
// predecessor lets it launch only after its own wait.
// A load of what no kernel of the step writes, issued before grid_dep_wait() and kept before it: ptxas moves an
// ld.global.nc (__ldg) past griddepcontrol.wait (in the SASS: the router fold's rows, moe_route's, norm_add_rows'
// weights), not a strong L2 load (ld.global.cg).
template <typename T>
__device__ __forceinline__ T ld_before_wait(const T* p) { return __ldcg(p); }

#ifdef KESTREL_TRACE
// The diagnostic build (KESTREL_CUDA_TRACE, trace.py): thread 0 of every block that waits records when its wait
// returned, as [%globaltimer ns, %gridid << 32 | block], in its SM's KESTREL_TRACE_PER_SM records of
// kestrel_trace_buf (SMs from KESTREL_TRACE_SMS on record nothing); the slot comes from the SM's own counter (no
// contention), taken before the wait. The two pointers are constants (set once by trace.py), so reading them is no
// global round trip.
__constant__ unsigned long long* kestrel_trace_buf;
__constant__ unsigned* kestrel_trace_count;
#endif

__device__ __forceinline__ void grid_dep_wait() {
#ifdef KESTREL_TRACE
    bool stamp = threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;
    unsigned sm = 0, slot = 0;
    if (stamp) {
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        stamp = sm < KESTREL_TRACE_SMS;
        if (stamp) slot = atomicAdd(kestrel_trace_count + sm, 1u);
    }
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef KESTREL_TRACE
    if (stamp && slot < KESTREL_TRACE_PER_SM) {
        unsigned long long t, grid;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
        const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        unsigned long long* r = kestrel_trace_buf + 2 * ((size_t)sm * KESTREL_TRACE_PER_SM + slot);
        r[0] = t;
        r[1] = grid << 32 | block;
    }
#endif
}

__device__ __forceinline__ void grid_dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// cp.async: 16-, 8- and 4-byte global -> shared copies (bytes < size: the rest zero-filled), groups, waits.
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async8(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// ldmatrix: four 8x8 matrices of 16-bit elements, lane l giving the shared address of row l % 8 of matrix l / 8;
// register i gets matrix i, lane t holding row t / 4, elements 2 (t % 4) and 2 (t % 4) + 1 (.trans: column t / 4,
// rows 2 (t % 4) and 2 (t % 4) + 1), the fragment layout of mma.sync's operands.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Thread block clusters (sm_90): the K splits of a GEMV tile (plan.cluster_split) or of a decode batch's GEMM
// tile (gemm.mma_splits) launched as one cluster add their partial sums through distributed shared memory, on
// chip, instead of through L2; KESTREL_CUDA_CLUSTER=0 turns them off. No-ops below sm_90, where no cluster is
// launched.
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

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// the address of *p in the shared memory of the cluster's block ``rank``
__device__ __forceinline__ unsigned cluster_addr(const void* p, unsigned rank) {
    unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_addr(p)), "r"(rank));
#endif
    return r;
}

// float4 at shared address ``addr`` of a cluster block (cluster_addr)
__device__ __forceinline__ float4 ld_cluster_f4(unsigned addr) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
#endif
    return v;
}

// The cluster barrier's two halves: arrive early, wait late, for a block that only needs the others to have
// started; a block may exit without waiting. Together: shared-memory writes before them are visible to the
// cluster after.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
// an arrive that orders no memory access (no fence): for a barrier that only keeps blocks alive
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
