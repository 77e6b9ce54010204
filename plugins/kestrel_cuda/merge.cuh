// How the K splits of one M = 1 GEMV tile (qgemv, gemv.cu) add their partial sums besides the counter of
// arrive_last (forward.cuh): tagged slots in global memory, or one thread block cluster adding them in shared
// memory. Both add the splits in y order, as the counter merge does: the same bits every way.

// Split-K hand-over of qgemv at M = 1 without a fence or a counter round trip: each split stores its partial
// sums together with the launch's tag, the tile's epoch + 1, as one 64-bit word (single-copy atomic), in slot
// [tile][split][column] of ``merge``, and the tile's last split polls for the others' tags. A tile's epoch
// grows by one with every launch that merges it (its last split writes it, after the poll), so no slot holds
// the new tag before this launch writes it; the next launch reads it after its PDL wait.
#define MERGE_SPLITS 64  // K splits one tile's slots hold (plan.MERGE_SPLITS)
__device__ __forceinline__ void st_tagged(unsigned long long* p, float v, unsigned tag) {
    const unsigned long long w = ((unsigned long long)tag << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" :: "l"(p), "l"(w) : "memory");
}
__device__ __forceinline__ unsigned long long ld_tagged(const unsigned long long* p) {
    unsigned long long w;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
    return w;
}
// The sum in split order of the ns slots slots[0], slots[stride], ... once each carries ``tag``: the tile's last
// split's poll, PB slots at a time, polled together until all of them are tagged.
template <int PB>
__device__ __forceinline__ float sum_tagged(const unsigned long long* slots, size_t stride, int ns, unsigned tag) {
    float sum = 0.f;
    for (int y0 = 0; y0 < ns; y0 += PB) {
        unsigned long long w[PB];
#pragma unroll
        for (int j = 0; j < PB; ++j) w[j] = y0 + j < ns ? ld_tagged(slots + (size_t)(y0 + j) * stride) : 0ull;
        for (;;) {
            bool ready = true;
#pragma unroll
            for (int j = 0; j < PB; ++j) ready &= y0 + j >= ns || (unsigned)(w[j] >> 32) == tag;
            if (ready) break;
#pragma unroll
            for (int j = 0; j < PB; ++j)
                if (y0 + j < ns && (unsigned)(w[j] >> 32) != tag) w[j] = ld_tagged(slots + (size_t)(y0 + j) * stride);
        }
#pragma unroll
        for (int j = 0; j < PB; ++j) if (y0 + j < ns) sum += __uint_as_float((unsigned)w[j]);
    }
    return sum;
}

// mbarrier primitives (sm_90; no-ops below, where no cluster is launched)
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}
// the mbarrier initialisations before it visible to the cluster (and the async proxy)
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// one arrival that also expects ``bytes`` of asynchronous copies in the barrier's current phase
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n\t.reg .pred p;\n"
                 "WAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "\t@!p bra WAIT;\n}" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
#endif
}
// The M=1 GEMV's cluster merge: block 0 counts the bytes the other blocks store into its shared memory on one
// mbarrier, so each of them sends its partial sums and exits at once instead of holding its SM slot until
// block 0 has read them (q|k|v 8.6 -> 7.5 us at q8, 6.2 -> 5.6 at q4; docs/performance.md).
// v into *p of the cluster's block ``rank``, counted on that block's ``bar`` (fire and forget)
__device__ __forceinline__ void push_to(float* p, unsigned long long* bar, float v, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
                 :: "r"(cluster_addr(p, rank)), "f"(v), "r"(cluster_addr(bar, rank)) : "memory");
#endif
}
