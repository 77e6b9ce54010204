// The tensor-core GEMMs' shared pieces (gemm_mma.cu, gemm_tma.cu): the int8 product, the split shapes' scaling
// of a finished group and their epilogues. A warp's sums are facc[MI][4][4]: element e of n8 tile ni of m16
// tile mi is row mi * 16 + gid + 8 (e / 2) of the warp's rows, physical column 8 tig + 4 (e % 2) + ni of its 32.
#define GQ_MAGIC 0x4B400000
#define GQ_MAGIC_F 12582912.0f

// d = a * b + c
__device__ __forceinline__ void mma_s8(int (&d)[4], const u32 (&a)[4], const u32 (&b)[2], const int (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
}

// The split shapes' form of a row scale: rounded to 22 significant bits, so that MAGIC times it is exact.
__device__ __forceinline__ float split_row_scale(float a) { return __uint_as_float((__float_as_uint(a) + 2u) & ~3u); }

// A finished group's exact sums (biased by MAGIC) into the float sums, two fused multiply-adds each:
// (MAGIC + s) * a - MAGIC * a = s * a rounded once (a: the row scale rounded to 22 bits, sa[2 mi + h], with
// nb = -MAGIC * a), then times the weight scale sw[4 (e % 2) + ni] into the sum.
template <int MI>
__device__ __forceinline__ void tile_scale_split(const int (&iacc)[MI][4][4], float (&facc)[MI][4][4],
                                                 const float (&sw)[8], const float (&sa)[2 * MI],
                                                 const float (&nb)[2 * MI]) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            const float y0 = fmaf(__int_as_float(iacc[mi][ni][0]), sa[2 * mi], nb[2 * mi]);
            const float y1 = fmaf(__int_as_float(iacc[mi][ni][1]), sa[2 * mi], nb[2 * mi]);
            const float y2 = fmaf(__int_as_float(iacc[mi][ni][2]), sa[2 * mi + 1], nb[2 * mi + 1]);
            const float y3 = fmaf(__int_as_float(iacc[mi][ni][3]), sa[2 * mi + 1], nb[2 * mi + 1]);
            facc[mi][ni][0] = fmaf(y0, sw[ni], facc[mi][ni][0]);
            facc[mi][ni][1] = fmaf(y1, sw[4 + ni], facc[mi][ni][1]);
            facc[mi][ni][2] = fmaf(y2, sw[ni], facc[mi][ni][2]);
            facc[mi][ni][3] = fmaf(y3, sw[4 + ni], facc[mi][ni][3]);
        }
}

// out's four floats at o (columns col.. of N; vec: 16-byte aligned and whole), 0 past N
__device__ __forceinline__ float4 load_out4(const float* o, int col, int N, bool vec) {
    if (vec && col + 4 <= N) return *reinterpret_cast<const float4*>(o);
    float v[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = col + c < N ? o[c] : 0.f;
    return make_float4(v[0], v[1], v[2], v[3]);
}

// v to out's four floats at o, those past N skipped
__device__ __forceinline__ void store_out4(float* o, float4 v, int col, int N, bool vec) {
    if (vec && col + 4 <= N) {
        *reinterpret_cast<float4*>(o) = v;
        return;
    }
    const float w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int c = 0; c < 4; ++c)
        if (col + c < N) o[c] = w[c];
}

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// A warp's sums stored to rows r0.. (its first row; rows >= M skipped), columns c0 + 8 tig .. + 7 of out, or
// with ``add`` added to what out holds there (its values all loaded before the first store).
template <int MI>
__device__ __forceinline__ void tile_store_rows(const float (&facc)[MI][4][4], float* __restrict__ out, int ldo,
                                                int M, int N, int r0, int c0, bool vec, bool add) {
    const int gid = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
    const int c = c0 + 8 * tig;
    float4 res[MI][2][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + mi * 16 + gid + 8 * h;
            const float* o = out + (size_t)r * ldo + c;
            res[mi][h][0] = res[mi][h][1] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (add && r < M) {
                res[mi][h][0] = load_out4(o, c, N, vec);
                res[mi][h][1] = load_out4(o + 4, c + 4, N, vec);
            }
        }
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + mi * 16 + gid + 8 * h;
            if (r >= M) continue;
            const int e = 2 * h;
            float4 v0 = make_float4(facc[mi][0][e], facc[mi][1][e], facc[mi][2][e], facc[mi][3][e]);
            float4 v1 = make_float4(facc[mi][0][e + 1], facc[mi][1][e + 1], facc[mi][2][e + 1], facc[mi][3][e + 1]);
            if (add) {
                v0 = add4(res[mi][h][0], v0);
                v1 = add4(res[mi][h][1], v1);
            }
            float* o = out + (size_t)r * ldo + c;
            store_out4(o, v0, c, N, vec);
            store_out4(o + 4, v1, c + 4, N, vec);
        }
}

template <int MI>
__device__ __forceinline__ void tile_zero(float (&facc)[MI][4][4]) {
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) facc[i][j][e] = 0.0f;
}

// A warp's sums times their row's factor (f[r]: row r of the warp's rows)
template <int MI>
__device__ __forceinline__ void tile_scale_rows(float (&facc)[MI][4][4], const float* f) {
    const int gid = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float a = f[mi * 16 + gid + 8 * (e / 2)];
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) facc[mi][ni][e] *= a;
        }
}

// A warp's sums into a BM x BN tile (row-major floats; its rows from wr0, columns from wc0)
template <int MI, int BN>
__device__ __forceinline__ void tile_put(const float (&facc)[MI][4][4], float* tile, int wr0, int wc0) {
    const int gid = (threadIdx.x & 31) >> 2, tig = threadIdx.x & 3;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float4* t = reinterpret_cast<float4*>(tile + (wr0 + mi * 16 + gid + 8 * h) * BN + wc0 + 8 * tig);
            const int e = 2 * h;
            t[0] = make_float4(facc[mi][0][e], facc[mi][1][e], facc[mi][2][e], facc[mi][3][e]);
            t[1] = make_float4(facc[mi][0][e + 1], facc[mi][1][e + 1], facc[mi][2][e + 1], facc[mi][3][e + 1]);
        }
}

// The norm fold: where a residual-add GEMM stores its rows, the next normed projection's input is quantized
// too, the codes and G = 32 scales of out * w (the norm's weights) as quantize_rows makes them of the normed
// row, the row's 1 / rms left to the GEMM that reads them (gemm_tma.cu row_ssq), from the sums of squares of
// out that the fold leaves, one a BN-column tile of a row, tile-major so that the reader's lanes, a row each,
// find a tile's in one line (scattered, a row's partials took 11 us more a GEMM at 64 rows). All null: no fold.
struct NormFold {
    const float* w;  // [N]
    i8* codes;       // [M][N]
    float* scales;   // [M][N / 32]
    float* ssq;      // [N / BN][M]
};

// A warp's fold of one row's BN columns, four a lane (s: its sums at columns col..col + 3; N % BN == 0)
template <int BN>
__device__ __forceinline__ void norm_fold_row(const NormFold& f, float4 w, float4 s, int row, int col, int M,
                                              int N) {
    static_assert(BN == 128, "a row of the tile is one warp's, a G = 32 group eight lanes'");
    const int lane = threadIdx.x & 31;
    const float v[4] = {s.x * w.x, s.y * w.y, s.z * w.z, s.w * w.w};
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
    const float d = q8_scale(amax), inv = q8_inv(d);
    u32 c = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) c |= (u32)(u8)q8_code(v[j], inv) << (8 * j);
    *reinterpret_cast<u32*>(f.codes + (size_t)row * N + col) = c;
    if ((lane & 7) == 0) f.scales[(size_t)row * (N / 32) + col / 32] = d;
    const float ss = warp_sum(s.x * s.x + s.y * s.y + s.z * s.z + s.w * s.w);
    if (lane == 0) f.ssq[(size_t)(col / BN) * M + row] = ss;
}

// The K splits of a BM x BN tile launched as one cluster (blockIdx.z = split) add their sums through
// distributed shared memory: each block's warps that hold sums (``holds``; their tile rows from wr0, columns
// from wc0) put them in its shared ``tile``, then every block adds its share of the tile's rows over the splits
// in z order and stores them, a row's BN / 4 float4s one warp's.
// ``row_f`` (or null): the sums of tile row r times row_f[r], before ``add``. ``add``: the tile added to what out
// holds. FOLD: the norm fold of the stored rows (``fold``), each block's share whole rows. Called by every thread
// of the block, after its last read of ``tile``'s memory.
template <int MI, int BM, int BN, bool FOLD>
__device__ __forceinline__ void tile_cluster_store(float (&facc)[MI][4][4], bool holds, float* tile, int wr0,
                                                   int wc0, float* __restrict__ out, int ldo, int M, int N, int m0,
                                                   int n0, bool vec, bool add,
                                                   const NormFold& fold, const float* row_f) {
    // FOLD: a thread's columns are the same in every pass (its lane's four of the tile): their norm weights, which
    // no kernel writes, loaded before the barrier
    const int wcol = n0 + 4 * (threadIdx.x % 32);
    const float4 w = FOLD && wcol < N ? *reinterpret_cast<const float4*>(fold.w + wcol)
                                      : make_float4(0.f, 0.f, 0.f, 0.f);
    if (holds) tile_put<MI, BN>(facc, tile, wr0, wc0);
    cluster_arrive();
    cluster_wait();  // every split's sums are in its block's shared memory
    constexpr int RQ = BN / 4, Q = BM * RQ;  // float4s of a tile row (32: a warp's) and of the tile
    const int nz = gridDim.z, z = blockIdx.z;
    const int q0 = FOLD ? z * BM / nz * RQ : z * Q / nz, q1 = FOLD ? (z + 1) * BM / nz * RQ : (z + 1) * Q / nz;
    for (int q = q0 + (int)threadIdx.x; q < q1; q += (int)blockDim.x) {  // FOLD: whole warps (blockDim % 32 == 0)
        const int row = m0 + q / RQ, col = n0 + 4 * (q % RQ);
        // what is not stored (rows past M, columns past N) is not loaded: a load whose value nothing waits for
        // may still be in flight when the block it reads exits after the last barrier (its arrive is relaxed),
        // and reading an exited block's shared memory is an error
        if (row >= M || (!FOLD && col >= N)) continue;  // FOLD: the warp's row
        const bool in = col < N;
        float* o = out + (size_t)row * ldo + col;
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
        if (in) {
            // every split's loads in flight at once, and with ``add`` the residual's
            float4 split[MAX_CLUSTER];
            const float4 res = add ? load_out4(o, col, N, vec) : s;
#pragma unroll
            for (int r = 0; r < MAX_CLUSTER; ++r)
                if (r < nz) split[r] = ld_cluster_f4(cluster_addr(tile + 4 * q, r));
            s = split[0];
#pragma unroll
            for (int r = 1; r < MAX_CLUSTER; ++r)  // in z order, as the workspace merge
                if (r < nz) s = add4(s, split[r]);
            if (row_f) {
                const float f = row_f[row - m0];
                s = make_float4(s.x * f, s.y * f, s.z * f, s.w * f);
            }
            if (add) s = add4(res, s);
            store_out4(o, s, col, N, vec);
        }
        if constexpr (FOLD) norm_fold_row<BN>(fold, w, s, row, col, M, N);
    }
    cluster_arrive_relaxed();  // every load above is done (its sum is stored): nothing to publish
    cluster_wait();  // no block leaves while another still reads its shared memory
}
