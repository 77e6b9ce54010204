// Shared helpers of the kestrel_cuda kernels, prepended to the other .cu files (one NVRTC unit). Compiled
// by NVRTC (CuPy RawModule) with --fmad=false and no system headers, so only builtin types are used.
typedef unsigned int u32;
typedef unsigned char u8;
typedef signed char i8;

#define FULL_MASK 0xffffffffu

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

// int4 codes are stored offset by +8 (0..15), two rows per byte: low nibble = even row, high = odd row.
// ((u + 0x78) ^ 0x80) maps u in 0..15 to the signed byte u - 8 without carries between bytes.
__device__ __forceinline__ u32 nib_lo(u32 x) { return ((x & 0x0F0F0F0Fu) + 0x78787878u) ^ 0x80808080u; }
__device__ __forceinline__ u32 nib_hi(u32 x) { return (((x >> 4) & 0x0F0F0F0Fu) + 0x78787878u) ^ 0x80808080u; }

// One VEC-byte read-only load of a thread's columns (VEC = 16, 8 or 4), as 32-bit words.
template <int VEC>
__device__ __forceinline__ void load_vec(const u8* __restrict__ p, u32 (&w)[VEC / 4]) {
    if constexpr (VEC == 16) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if constexpr (VEC == 8) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = v.x; w[1] = v.y;
    } else {
        w[0] = __ldg(reinterpret_cast<const u32*>(p));
    }
}
