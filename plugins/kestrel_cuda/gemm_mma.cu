// Prefill GEMM (M large) on int8 tensor cores: mma.sync.m16n8k32 s8 x s8 -> s32, fed by a multi-stage cp.async
// shared-memory pipeline.
//
// Tiles: a block of WM x WN warps covers BM = WM*MI*16 rows by BN = WN*32 columns; each warp owns MI m16 tiles
// by four n8 tiles. K advances in stages of BK = 128 bytes (4 k32 steps); STAGES = 3 stages are in flight
// (cp.async.cg 16-byte copies for the codes, 4-byte copies for the scales, zero-filled outside M, K and Npad, so
// a K that ends inside a stage adds exact zero terms), one barrier per stage. The block shapes in use are listed
// in kernels.MMA_TILES.
// blockIdx.x walks M: the blocks resident together share one weight tile, so the weights are read from device
// memory about once while the activations (a few MB) stay in L2.
// Grouped (a mixture of experts' prefill, the others only): with ``groups`` block row x takes the rows and the
// weights that groups[x] = (expert, first row, rows) names, the weights through etab (codes, scales pointers per
// expert, all of one shape): A holds every expert's rows, sorted by expert, and so does out.
// SPLIT instances (the decode batches' block shapes) split K over blockIdx.z: a batch's few rows give too few
// tiles to keep the memory system busy. Block z runs stages [z * kstages, (z + 1) * kstages) (kstages whole
// groups). Launched as one thread block cluster per tile (sm_90), the splits add their sums through
// distributed shared memory, each block a 1/nz slice of the tile in z order; otherwise each stores its sums to
// part[z][M][Npad] and the last block of a tile to arrive on its counter (then reset) adds them in z order:
// the same bits. With one split the sums go straight to out. ``add``: every shape adds its sums to what out
// holds (the residual add: out + sum, as add_rows would) instead of storing them. They take whole stages
// and column tiles only (K % BK == 0, Npad % BN == 0: gemm.split_fits), so their copies carry no bounds
// checks (about half the loop's instructions, docs/performance.md), and scale each group with two fused
// multiply-adds instead of three operations (the scaling is most of the loop's instructions; MAGIC: below):
// y = fmaf(MAGIC + s, a, -MAGIC * a) = s * a rounded once, for the row scale a rounded to 22 significant bits,
// so that MAGIC * a = 3 * 2^22 * a is exact; then acc = fmaf(y, w_scale, acc). Within the reference's bound,
// not its bits.
//
// Programmatic dependent launch (common.cuh; a captured step of several rows launches it so): a block copies its
// first stages' weights and weight scales, which no kernel writes, before it waits for the previous kernel,
// and its activations after; its dependents may launch at its start.
//
// Exact block sums. One k32 step is one block of G = 32 (an eighth of G = 256). The mma accumulators start
// from MAGIC = 0x4B400000 (the bits of 1.5 * 2^23) instead of 0: for |s| <= 2^22 the integer MAGIC + s is the
// bit pattern of the float 1.5 * 2^23 + s, so (float)s = __int_as_float(MAGIC + s) - 1.5 * 2^23 exactly, one
// FADD instead of an I2F (quarter rate: one per block sum would bound the kernel). Block sums of int8 codes
// satisfy |s| <= 256 * 128 * 128 = 2^22. With G = 32 the first (and only) mma of a block takes MAGIC as its C
// operand, so no reset is needed at all. In the unsplit shapes each finished block is then scaled exactly as
// the CPU reference does, ((float)s * a_scale) * w_scale (--fmad=false: two roundings), and added to the float
// accumulators in increasing group order: bit-identical to kestrel_core.contract.reference_gemm_q8.
//
// Shared memory per stage: A codes [BM][BK] bytes, 16-byte chunk c of row r stored at c ^ aswz(r) (ldmatrix.x4
// reads 8 rows of one chunk column conflict-free); B codes as they lie in device memory: int8 K-major [BK][BN]
// bytes, word w of row r stored at w ^ (((r / 4) & 3) << 3); int4 [BK/8][BN] words of 8 k (common.cuh), 16-byte
// chunk c of row r stored at c ^ ((r & 1) << 2); A scales [SG][BM] (rows permuted so a thread's are contiguous)
// and B scales [SG][BN] floats for the SG groups that end in the stage.
// The B fragment of an n8 tile wants 4 consecutive k of one column in a register. int8: each thread reads one
// word (4 columns) from 4 k rows and transposes the 4 x 4 bytes in registers; int4: it reads the 8-k words of
// the same 4 columns (one 16-byte read) and takes the nibble half of its 4 k. The n8 tile's column j is
// therefore physical column 4 * j + ni of the warp's 32 (ni = tile index), which makes each thread's outputs 8
// consecutive columns (two 16-byte stores) and its weight scales two float4 reads.
#define GQ_BK 128     // K per shared-memory stage: 64 measured 5-12 % slower (twice the barriers)
#define GQ_STAGES 3   // stages in flight

// Shared memory layout of one block (bytes); kernels.MmaTile.smem_bytes computes the same total.
template <int BITS, int G, int WM, int WN, int MI>
struct GqTile {
    static constexpr int BK = GQ_BK, STAGES = GQ_STAGES;
    static constexpr int BM = WM * MI * 16, BN = WN * 32, THREADS = WM * WN * 32;
    static constexpr int BKB = BK * BITS / 8;        // B bytes per column per stage (int4: packed)
    static constexpr int SG = G < BK ? BK / G : 1;   // scale slots per stage
    static constexpr int A_BYTES = BM * BK, B_BYTES = BKB * BN;
    static constexpr int AS_BYTES = SG * BM * 4, BS_BYTES = SG * BN * 4;
    static constexpr int STAGE = A_BYTES + B_BYTES + AS_BYTES + BS_BYTES;
    static constexpr int SMEM = STAGES * STAGE;
};

// 16-byte chunk swizzle of the A rows (128 bytes = 8 chunks): the 8 rows one ldmatrix phase reads land on 8
// different chunk columns
__device__ __forceinline__ int aswz(int row) { return row & 7; }

template <int BITS, int G, int WM, int WN, int MI, int MINB, bool SPLIT>
__global__ void __launch_bounds__(WM * WN * 32, MINB) k_gemm_q8_tc(
        const i8* __restrict__ A, const float* __restrict__ As, int M,
        const u8* __restrict__ W, const float* __restrict__ Ws,
        float* __restrict__ out, int ldo, int add, int N, int K, int Npad,
        float* __restrict__ part, unsigned* __restrict__ counters, int kstages,
        const int* __restrict__ groups, const unsigned long long* __restrict__ etab) {
    using T = GqTile<BITS, G, WM, WN, MI>;
    constexpr int BK = T::BK, STAGES = T::STAGES;
    constexpr int BM = T::BM, BN = T::BN, THREADS = T::THREADS, SG = T::SG;
    constexpr int KS = BK / 32;                   // k32 steps per stage
    constexpr int BROWS = BITS == 8 ? BK : BK / 8;  // stored B rows per stage (int4: rows of 8-k words)
    constexpr int BROWB = BITS == 8 ? BN : 4 * BN;  // bytes of one stored B row of the tile
    constexpr int GS = G / 32;                    // k32 steps per group
    static_assert(G == 32 || G == 256, "G must be 32 or 256");
    static_assert(MI == 1 || MI % 2 == 0, "row scales are read as float2 or float4");
    static_assert(BN == 128, "the B swizzle and fragment mapping assume 32-word shared rows (WN = 4)");
    static_assert(THREADS % BM == 0 && THREADS % BN == 0, "scale copy plan");
    extern __shared__ __align__(16) unsigned char smem[];

    grid_dep_launch();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int gid = lane >> 2, tig = lane & 3;
    int m0 = blockIdx.x * BM;
    const int n0 = blockIdx.y * BN;
    // grouped: block row x is rows [row0, row0 + rows) of expert e, whose weights etab holds. groups is step data
    // (moe_group's) read before the PDL wait: it holds because the gather between them (ops.gather_rows, a CuPy
    // take, launched without PDL) starts only once moe_group has finished.
    if (!SPLIT && groups) {
        if (groups[3 * blockIdx.x + 2] == 0) return;  // past the step's groups (moe_group pads to its capacity)
        const int e = groups[3 * blockIdx.x], row0 = groups[3 * blockIdx.x + 1];
        W = reinterpret_cast<const u8*>(etab[2 * e]);
        Ws = reinterpret_cast<const float*>(etab[2 * e + 1]);
        m0 = row0;
        M = row0 + groups[3 * blockIdx.x + 2];
    }
    const int ng = K / G;
    const int st0 = SPLIT ? blockIdx.z * kstages : 0;  // this split's stages
    const int nst = SPLIT ? min((K + BK - 1) / BK, st0 + kstages) : (K + BK - 1) / BK;
    const int krows = BITS == 8 ? K : K / 8;      // rows of the device code matrix
    const int ldb = BITS == 8 ? Npad : 4 * Npad;  // its bytes per row
    const bool b16 = (ldb & 15) == 0;             // 16-byte copies of B rows stay aligned (int4: always)
    const u32 sbase = smem_u32(smem);

    // Per-thread copy plan, fixed for the whole K loop (only the k offset moves). A: 16-byte chunk a_c of rows
    // a_r0 + p * A_RSTEP; B: chunk b_c of k rows b_r0 + p * B_RSTEP. The row steps keep every row of a thread on
    // the same swizzle (A: a multiple of 8; B: of 16 for int8, of 2 for int4).
    constexpr int ACH = BK / 16, BCH = BROWB / 16;
    constexpr int A_RSTEP = THREADS / ACH, B_RSTEP = THREADS / BCH;
    constexpr int AP = BM / A_RSTEP, BP = (BROWS + B_RSTEP - 1) / B_RSTEP;
    static_assert(BM % A_RSTEP == 0 && A_RSTEP % 8 == 0 && B_RSTEP % (BITS == 8 ? 16 : 2) == 0, "copy plan");
    const int a_c = tid % ACH, a_r0 = tid / ACH;
    const int b_c = tid % BCH, b_r0 = tid / BCH;
    const i8* a_src = A + (size_t)(m0 + a_r0) * K + 16 * a_c;
    const u32 a_dst = a_r0 * BK + ((a_c ^ aswz(a_r0)) << 4);
    const int b_byte0 = (BITS == 8 ? n0 : 4 * n0) + 16 * b_c;  // first byte of the chunk in its row
    const u8* b_src = W + (size_t)b_r0 * ldb + b_byte0;
    const int b_swz = BITS == 8 ? ((b_r0 / 4) & 3) << 1 : (b_r0 & 1) << 2;
    const u32 b_dst = T::A_BYTES + b_r0 * BROWB + ((b_c ^ b_swz) << 4);
    const i8* a_rows[SPLIT ? AP : 1];  // SPLIT: the A chunks' rows, nullptr past M (zero-filled)
#pragma unroll
    for (int p = 0; p < (SPLIT ? AP : 1); ++p)
        a_rows[p] = m0 + a_r0 + p * A_RSTEP < M ? A + (size_t)(m0 + a_r0 + p * A_RSTEP) * K + 16 * a_c : nullptr;
    const int b_left = ldb - b_byte0;
    const int b_nvalid = b_left < 0 ? 0 : b_left > 16 ? 16 : b_left;  // bytes of the chunk inside Npad
    // scales: thread tid copies row tid % BM of A's slots tid / BM + p * THREADS / BM, and column tid % BN of B's
    // slots tid / BN + p * THREADS / BN
    constexpr int ASP = (SG * BM + THREADS - 1) / THREADS, BSP = (SG * BN + THREADS - 1) / THREADS;
    const int as_row = tid % BM, bs_col = tid % BN;
    const bool as_on = m0 + as_row < M;
    const bool bs_on = n0 + bs_col < Npad;
    const float* as_src = As + (size_t)(m0 + as_row) * ng + tid / BM;
    const float* bs_src = Ws + (size_t)(tid / BN) * Npad + n0 + bs_col;
    // A scales are stored per slot as [warp row wm][gid][mi][h] so a thread's 2 * MI row scales are contiguous
    const int as_pos = (as_row / (MI * 16)) * (MI * 16) + (as_row % 8) * (2 * MI) + ((as_row % (MI * 16)) / 16) * 2
                       + (as_row % 16) / 8;
    const u32 as_dst = T::A_BYTES + T::B_BYTES + 4 * ((tid / BM) * BM + as_pos);
    const u32 bs_dst = T::A_BYTES + T::B_BYTES + T::AS_BYTES + 4 * tid;

    // -- one stage: global -> shared, asynchronous; zero-filled outside M, K and Npad ------------------------
    // The groups that end in stage st (their scales are copied with it): the first, or -1 for none.
    auto stage_group = [&](int st) -> int {
        if constexpr (G < BK) return st * SG;
        else return ((st + 1) * BK) % G == 0 ? ((st + 1) * BK) / G - 1 : -1;
    };
    auto load_b = [&](int st, int buf) {  // weight codes and scales
        const u32 sb = sbase + buf * T::STAGE;
        if constexpr (SPLIT) {  // whole stages and tiles: no bounds
            const u8* src = b_src + (size_t)st * BROWS * ldb;
#pragma unroll
            for (int p = 0; p < BP; ++p)
                cp_async16(sb + b_dst + p * B_RSTEP * BROWB, src + (size_t)p * B_RSTEP * ldb, 16);
        } else {
#pragma unroll
            for (int p = 0; p < BP; ++p) {
                const int r = b_r0 + p * B_RSTEP;
                if (BROWS % B_RSTEP != 0 && r >= BROWS) break;
                const int gr = st * BROWS + r;
                const u32 dst = sb + b_dst + p * B_RSTEP * BROWB;
                const u8* src = b_src + ((size_t)st * BROWS + p * B_RSTEP) * ldb;
                if (b16) {
                    const bool ok = gr < krows && b_nvalid > 0;
                    cp_async16(dst, ok ? src : W, ok ? 16 : 0);
                } else {  // int8, Npad % 16 != 0: word copies (Npad % 4 == 0 keeps a word wholly in or out)
#pragma unroll
                    for (int w = 0; w < 4; ++w) {
                        const bool ok = gr < krows && 4 * w < b_nvalid;
                        cp_async4(dst + 4 * w, ok ? src + 4 * w : W, ok ? 4 : 0);
                    }
                }
            }
        }
        const int g0 = stage_group(st);  // SPLIT: every group of the stage exists
        if (g0 < 0) return;
#pragma unroll
        for (int p = 0; p < BSP; ++p) {
            const int slot = tid / BN + p * (THREADS / BN);
            if (slot >= SG) break;
            const bool ok = SPLIT || (bs_on && g0 + slot < ng);
            cp_async4(sb + bs_dst + 4 * p * THREADS, ok ? bs_src + (size_t)(g0 + p * (THREADS / BN)) * Npad : Ws,
                      ok ? 4 : 0);
        }
    };
    auto load_a = [&](int st, int buf) {  // activation codes and scales
        const u32 sb = sbase + buf * T::STAGE;
        const int k0 = st * BK;
        if constexpr (SPLIT) {  // bounds on M only
#pragma unroll
            for (int p = 0; p < AP; ++p)
                cp_async16(sb + a_dst + p * A_RSTEP * BK, a_rows[p] ? a_rows[p] + k0 : A, a_rows[p] ? 16 : 0);
        } else {
            const bool a_kok = k0 + 16 * a_c < K;
#pragma unroll
            for (int p = 0; p < AP; ++p) {
                const bool ok = a_kok && m0 + a_r0 + p * A_RSTEP < M;
                cp_async16(sb + a_dst + p * A_RSTEP * BK, ok ? a_src + (size_t)p * A_RSTEP * K + k0 : A, ok ? 16 : 0);
            }
        }
        const int g0 = stage_group(st);
        if (g0 < 0) return;
#pragma unroll
        for (int p = 0; p < ASP; ++p) {
            const int slot = tid / BM + p * (THREADS / BM);
            if (slot >= SG) break;
            const bool ok = as_on && (SPLIT || g0 + slot < ng);
            cp_async4(sb + as_dst + 4 * p * THREADS, ok ? as_src + g0 + p * (THREADS / BM) : As, ok ? 4 : 0);
        }
    };

    float facc[MI][4][4];
    int iacc[MI][4][4];
    const int magic[4] = {GQ_MAGIC, GQ_MAGIC, GQ_MAGIC, GQ_MAGIC};
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) { facc[i][j][e] = 0.0f; iacc[i][j][e] = GQ_MAGIC; }

    // the first stages' weights before the wait for the previous kernel, its activations after: the first
    // commit group holds those weights and stage 0's activations, the others a stage's activations each
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (st0 + s < nst) load_b(st0 + s, s);
    grid_dep_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (st0 + s < nst) load_a(st0 + s, s);
        cp_async_commit();
    }

    for (int st = st0; st < nst; ++st) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage st is visible to all; every warp is done with stage st - 1's buffer
        {
            const int nx = st + STAGES - 1;
            if (nx < nst) {
                load_b(nx, (nx - st0) % STAGES);
                load_a(nx, (nx - st0) % STAGES);
            }
            cp_async_commit();
        }
        const int buf = (st - st0) % STAGES;
        const u32 sa = sbase + buf * T::STAGE;
        const unsigned char* sbp = smem + buf * T::STAGE + T::A_BYTES;
        const float* sasp = reinterpret_cast<const float*>(sbp + T::B_BYTES);
        const float* sbsp = sasp + SG * BM;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const int kk = st * KS + ks;  // global k32 step (past K in a half stage: zero codes, zero scales)
            u32 af[MI][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                const int row = wm * MI * 16 + mi * 16 + (lane & 15);
                const int c = ks * 2 + (lane >> 4);
                ldmatrix_x4(af[mi], sa + row * BK + ((c ^ aswz(row)) << 4));
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // k 16h + 4tig .. 16h + 4tig + 3 of this k32 step
                const int word = wn * 8 + gid;
                if constexpr (BITS == 8) {
                    u32 w[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int r = ks * 32 + h * 16 + 4 * tig + j;  // (r >> 2) & 3 == tig
                        w[j] = *reinterpret_cast<const u32*>(sbp + r * BN + 4 * (word ^ (tig << 3)));
                    }
                    transpose4x4(w[0], w[1], w[2], w[3], bf[0][h], bf[1][h], bf[2][h], bf[3][h]);
                } else {
                    const int r = ks * 4 + h * 2 + (tig >> 1);         // word row; nibble half tig & 1
                    const uint4 v = *reinterpret_cast<const uint4*>(sbp + r * BROWB + ((word ^ ((r & 1) << 2)) << 4));
                    const u32 vw[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int ni = 0; ni < 4; ++ni) bf[ni][h] = (tig & 1) ? nib_hi(vw[ni]) : nib_lo(vw[ni]);
                }
            }
            if constexpr (GS == 1) {
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int ni = 0; ni < 4; ++ni)
                        mma_s8(iacc[mi][ni], af[mi], bf[ni], magic);
            } else {
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int ni = 0; ni < 4; ++ni)
                        mma_s8(iacc[mi][ni], af[mi], bf[ni], iacc[mi][ni]);
            }
            if (GS == 1 || (kk + 1) % GS == 0) {  // a group is complete: scale its exact sums
                const int slot = GS == 1 ? ks : 0;
                float sw[8];
                const float4 w0 = *reinterpret_cast<const float4*>(sbsp + slot * BN + wn * 32 + 8 * tig);
                const float4 w1 = *reinterpret_cast<const float4*>(sbsp + slot * BN + wn * 32 + 8 * tig + 4);
                sw[0] = w0.x; sw[1] = w0.y; sw[2] = w0.z; sw[3] = w0.w;
                sw[4] = w1.x; sw[5] = w1.y; sw[6] = w1.z; sw[7] = w1.w;
                float sa[2 * MI];  // rows mi * 16 + gid + 8 * h of the warp, at 2 * mi + h
                if constexpr (MI == 1) {
                    const float2 v = *reinterpret_cast<const float2*>(sasp + slot * BM + wm * 16 + gid * 2);
                    sa[0] = v.x; sa[1] = v.y;
                } else {
#pragma unroll
                    for (int q = 0; q < 2 * MI; q += 4) {
                        const float4 v =
                            *reinterpret_cast<const float4*>(sasp + slot * BM + wm * MI * 16 + gid * 2 * MI + q);
                        sa[q] = v.x; sa[q + 1] = v.y; sa[q + 2] = v.z; sa[q + 3] = v.w;
                    }
                }
                float nb[2 * MI];  // SPLIT: -MAGIC * the row scale rounded to 22 bits (exact: see above)
                if constexpr (SPLIT) {
#pragma unroll
                    for (int q = 0; q < 2 * MI; ++q) {
                        sa[q] = split_row_scale(sa[q]);
                        nb[q] = -GQ_MAGIC_F * sa[q];
                    }
                }
                if constexpr (SPLIT) {  // two fused multiply-adds a term (gemm_tile.cuh)
                    tile_scale_split<MI>(iacc, facc, sw, sa, nb);
                } else {  // ((float)s * a_scale) * w_scale, as the reference
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi) {
                        const float sa0 = sa[2 * mi], sa1 = sa[2 * mi + 1];
#pragma unroll
                        for (int ni = 0; ni < 4; ++ni) {
                            const float f0 = __int_as_float(iacc[mi][ni][0]) - GQ_MAGIC_F;
                            const float f1 = __int_as_float(iacc[mi][ni][1]) - GQ_MAGIC_F;
                            const float f2 = __int_as_float(iacc[mi][ni][2]) - GQ_MAGIC_F;
                            const float f3 = __int_as_float(iacc[mi][ni][3]) - GQ_MAGIC_F;
                            facc[mi][ni][0] += (f0 * sa0) * sw[ni];
                            facc[mi][ni][1] += (f1 * sa0) * sw[4 + ni];
                            facc[mi][ni][2] += (f2 * sa1) * sw[ni];
                            facc[mi][ni][3] += (f3 * sa1) * sw[4 + ni];
                        }
                    }
                }
                if constexpr (GS > 1) {
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
                            for (int e = 0; e < 4; ++e) iacc[mi][ni][e] = GQ_MAGIC;
                }
            }
        }
    }
    cp_async_wait<0>();  // nothing is left in flight (the tail groups are empty), but leave no copy pending

    const int nz = SPLIT ? gridDim.z : 1;
    const bool vec = (ldo & 3) == 0 && (reinterpret_cast<size_t>(out) & 15) == 0;  // 16-byte output stores
    if (SPLIT && nz > 1 && cluster_size() > 1) {  // the splits are one cluster: every block adds 1/nz of the tile
        __syncthreads();  // every warp is done with the pipeline's buffers
        tile_cluster_store<MI, BM, BN, false>(facc, true, reinterpret_cast<float*>(smem), wm * MI * 16, wn * 32, out,
                                              ldo, M, N, m0, n0, vec, add, NormFold{}, nullptr);
        return;
    }
    if (nz > 1) {  // this split's sums to part; the tile's last block adds every split's in z order
        // a thread's 8 columns of a row as two float4 (Npad % 4 == 0: each wholly inside Npad or outside)
        const int c = n0 + wn * 32 + 8 * tig;
        const bool c0ok = c < Npad, c1ok = c + 4 < Npad;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = m0 + wm * MI * 16 + mi * 16 + gid + 8 * h;
                if (r >= M) continue;
                float4* p = reinterpret_cast<float4*>(part + ((size_t)blockIdx.z * M + r) * Npad + c);
                const int e = 2 * h;
                if (c0ok) __stcg(p, make_float4(facc[mi][0][e], facc[mi][1][e], facc[mi][2][e], facc[mi][3][e]));
                if (c1ok) __stcg(p + 1, make_float4(facc[mi][0][e + 1], facc[mi][1][e + 1], facc[mi][2][e + 1],
                                                    facc[mi][3][e + 1]));
            }
        __shared__ int s_last;
        const int tile = blockIdx.y * gridDim.x + blockIdx.x;
        if (!arrive_last(reinterpret_cast<int*>(counters) + tile, nz, &s_last)) return;
        // every split's float4s of this thread, ZR splits at a time in flight, added in z order
        constexpr int ZR = 4;
        const size_t zstride = (size_t)M * Npad / 4;  // float4s between two splits' partials
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = m0 + wm * MI * 16 + mi * 16 + gid + 8 * h;
                if (r >= M || !c0ok) continue;
                const float4* p = reinterpret_cast<const float4*>(part + (size_t)r * Npad + c);
                float4 s0 = __ldcg(p), s1 = c1ok ? __ldcg(p + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
                for (int z0 = 1; z0 < nz; z0 += ZR) {
                    float4 v0[ZR], v1[ZR];
#pragma unroll
                    for (int j = 0; j < ZR; ++j) {
                        const bool ok = z0 + j < nz;
                        v0[j] = ok ? __ldcg(p + (z0 + j) * zstride) : make_float4(0.f, 0.f, 0.f, 0.f);
                        v1[j] = ok && c1ok ? __ldcg(p + (z0 + j) * zstride + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
                    }
#pragma unroll
                    for (int j = 0; j < ZR; ++j) {
                        if (z0 + j >= nz) break;
                        s0.x += v0[j].x; s0.y += v0[j].y; s0.z += v0[j].z; s0.w += v0[j].w;
                        s1.x += v1[j].x; s1.y += v1[j].y; s1.z += v1[j].z; s1.w += v1[j].w;
                    }
                }
                const int e = 2 * h;
                facc[mi][0][e] = s0.x; facc[mi][1][e] = s0.y; facc[mi][2][e] = s0.z; facc[mi][3][e] = s0.w;
                facc[mi][0][e + 1] = s1.x; facc[mi][1][e + 1] = s1.y; facc[mi][2][e + 1] = s1.z;
                facc[mi][3][e + 1] = s1.w;
            }
        if (tid == 0) counters[tile] = 0;
    }

    tile_store_rows<MI>(facc, out, ldo, M, N, m0 + wm * MI * 16, n0 + wn * 32, vec, add);
}
