/* kestrel_npu_sim: the RK3588 NPU's int8 x int8 -> int32 matmul, one K-block (strip) at a time.
 *
 * One launch is one simulated NPU submission for one K-segment and one N-chunk of a weight. For every
 * K-block g of G = 32 * tpb columns in the segment it computes the exact integer block sums
 *     c[g, m, n] = sum_{k in block g} a[m, k] * w[n, k]
 * with the weight in the NPU's native int8 layout [Nc/32, Kseg/32, 32, 32] (K fastest inside a 32 x 32
 * tile, tiles K-major within an N-tile). Scales are never seen here: the host applies them, exactly as the
 * strip-cache contract's reference does.
 *
 * Work-group = one native N-tile (32 output columns, one per work-item) x TM activation rows. The rows of
 * one K-block are staged in local memory and shared by the 32 work-items; each work-item streams its own
 * 32-byte weight row of each tile with two 16-byte vector loads.
 */

#define TN 32      /* native N-tile (int8) */
#define TK 32      /* native K-tile */
#define GMAX 256   /* largest strip-cache block width */
#define TM_MAX 8

inline int hsum8(const int8 v) {
    const int4 b = v.lo + v.hi;
    const int2 c = b.lo + b.hi;
    return c.x + c.y;
}

inline void block_matmul(const int tm, __local char *a_loc,
                         __global const char *a, const int lda, const long a_off,
                         __global const char *w, const long w_off, const int kt_seg, const int tpb,
                         const int nblocks, __global int *c, const long c_off, const int ldc, const int m) {
    const int lid = get_local_id(0);
    const int nt = get_group_id(0);
    const int m0 = get_group_id(1) * tm;
    const int rows = min(tm, m - m0);
    const int g_len = tpb * TK;
    const int vecs = g_len / 16;
    /* row `lid` of native tile (nt, kt = 0); the next K-tile of the same N-tile is 32 * 32 bytes further */
    __global const char *w_row = w + w_off + ((long)nt * kt_seg * TN + lid) * TK;

    for (int blk = 0; blk < nblocks; ++blk) {
        /* a_loc: [tm, G] activation codes of this K-block; rows past M read as zero */
        for (int i = lid; i < tm * vecs; i += TN) {
            const int r = i / vecs, v = i - (i / vecs) * vecs;
            char16 val = (char16)(0);
            if (r < rows) val = vload16(0, a + a_off + (long)(m0 + r) * lda + (long)blk * g_len + v * 16);
            vstore16(val, 0, a_loc + r * g_len + v * 16);
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        /* 8-lane accumulators: 16-lane int vectors would change the call ABI on AVX2 CPUs (PoCL warns) */
        int8 acc[TM_MAX];
        for (int r = 0; r < tm; ++r) acc[r] = (int8)(0);
        for (int t = 0; t < tpb; ++t) {
            __global const char *wt = w_row + (long)(blk * tpb + t) * (TN * TK);
            const short16 w0 = convert_short16(vload16(0, wt));
            const short16 w1 = convert_short16(vload16(1, wt));
            for (int r = 0; r < tm; ++r) {
                __local const char *ar = a_loc + r * g_len + t * TK;
                /* each int8 x int8 product fits a short; widen before adding so -128 * -128 is safe */
                const short16 p = convert_short16(vload16(0, ar)) * w0;
                const short16 q = convert_short16(vload16(1, ar)) * w1;
                acc[r] += convert_int8(p.lo) + convert_int8(p.hi) + convert_int8(q.lo) + convert_int8(q.hi);
            }
        }
        for (int r = 0; r < rows; ++r)
            c[c_off + ((long)blk * m + m0 + r) * ldc + nt * TN + lid] = hsum8(acc[r]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
}

/* decode-shaped calls (a few activation rows) */
__kernel __attribute__((reqd_work_group_size(TN, 1, 1)))
void block_matmul_m1(__global const char *a, const int lda, const long a_off,
                     __global const char *w, const long w_off, const int kt_seg, const int tpb,
                     const int nblocks, __global int *c, const long c_off, const int ldc, const int m) {
    __local char a_loc[1 * GMAX];
    block_matmul(1, a_loc, a, lda, a_off, w, w_off, kt_seg, tpb, nblocks, c, c_off, ldc, m);
}

/* prefill-shaped calls: each weight row is reused for 8 activation rows */
__kernel __attribute__((reqd_work_group_size(TN, 1, 1)))
void block_matmul_m8(__global const char *a, const int lda, const long a_off,
                     __global const char *w, const long w_off, const int kt_seg, const int tpb,
                     const int nblocks, __global int *c, const long c_off, const int ldc, const int m) {
    __local char a_loc[8 * GMAX];
    block_matmul(8, a_loc, a, lda, a_off, w, w_off, kt_seg, tpb, nblocks, c, c_off, ldc, m);
}
