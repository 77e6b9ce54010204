// The reads of batched decode attention without its arithmetic (benchmarks/cuda_attention.py): what attn_rows'
// keys and values cost at the copy speed, by the same pages and by one flat range.

// Row blockIdx.y's first ``pages`` pages (tables [rows][tb]) of KV head blockIdx.x: the keys' and values'
// page16 16-byte chunks of each page, four loads a thread in flight (a page of head_dim 128 at 256 threads).
extern "C" __global__ void __launch_bounds__(256) page_read(
    const uint4* __restrict__ kc, const uint4* __restrict__ vc, long long head16, const int* __restrict__ tables,
    int tb, int pages, int page16, unsigned* __restrict__ sink)
{
    const uint4* kb = kc + blockIdx.x * head16;
    const uint4* vb = vc + blockIdx.x * head16;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    unsigned acc = 0;
    for (int t = 0; t < pages; ++t) {
        const long long at = (long long)tables[blockIdx.y * tb + t] * page16;
        for (int i = threadIdx.x; i < page16; i += 512) {
            const bool two = i + 256 < page16;
            const uint4 k0 = __ldg(kb + at + i), v0 = __ldg(vb + at + i);
            const uint4 k1 = two ? __ldg(kb + at + i + 256) : zero, v1 = two ? __ldg(vb + at + i + 256) : zero;
            acc ^= k0.x ^ k0.w ^ v0.x ^ v0.w ^ k1.x ^ k1.w ^ v1.x ^ v1.w;
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // the loads are kept: the sum could be anything
}

// n16 16-byte chunks from p, grid-stride
extern "C" __global__ void __launch_bounds__(256) flat_read(const uint4* __restrict__ p, long long n16,
                                                            unsigned* __restrict__ sink)
{
    unsigned acc = 0;
    for (long long i = blockIdx.x * 256LL + threadIdx.x; i < n16; i += (long long)gridDim.x * 256) {
        const uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}
