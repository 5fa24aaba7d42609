// ------------------------------------------------------------------------ matmul

// What every matmul family shares (matmul_small.cu, matmul_gemv.cu, matmul_int8.cu,
// blas_copies.cu, rope_kv.cu's qkv gemv): the codes' loads, a weight row, int8 x's layout,
// 4-way int8 dot products. Each family is a kernel module of its own (vt.gpu.modules).
template <int CH>  // CH int8 codes in one load
struct alignas(CH) vt_codes {
    vt_u32 w[CH / 4];
};

// CH (4, 8 or 16) codes of a WT_Q weight from value index at (a multiple of CH), as int8
// codes, in one load: CH bytes of int8 codes, or the nibbles that hold them (VT_Q_NIB: a
// 16-value chunk's 8 bytes, whose low or high nibbles are values 0-7 or 8-15).
template <int CH>
__device__ __forceinline__ vt_codes<CH> vt_qcodes(const void* data, int lg, long long at) {
    if (!(VT_QF(lg) & VT_Q_NIB)) return *(const vt_codes<CH>*)((const vt_i8*)data + at);
    const unsigned char* chunk = (const unsigned char*)data + (at >> 4) * 8;
    vt_codes<CH> c;
    if (CH == 4) {
        c.w[0] = vt_unnib(*(const vt_u32*)(chunk + (at & 4)), (int)(at >> 3) & 1, lg);
        return c;
    }
    vt_codes<8> r = *(const vt_codes<8>*)chunk;
    int hi = CH == 16 ? 0 : (int)(at >> 3) & 1;
#pragma unroll
    for (int j = 0; j < CH / 4; ++j) c.w[j] = vt_unnib(r.w[j & 1], hi + (j >> 1), lg);
    return c;
}

// One weight row of a decode kernel: its data, (scale, offset) pairs, block size and layout
// (lg: lg_block | VT_Q_* flags) and the flat index of its first element.
struct VtRow {
    const void* data;
    const float* sm;
    int lg;
    long long at;
};

// sum of the four int8 products of a and b, plus c: dp4a on NVIDIA, sdot4 where AMD has it.
__device__ __forceinline__ int vt_dot4(int a, int b, int c) {
#if defined(VT_HIP)
#if defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) || defined(__gfx940__) || \
    defined(__gfx941__) || defined(__gfx942__)
    return __builtin_amdgcn_sdot4(a, b, c, false);
#else
    for (int j = 0; j < 4; ++j) c += (int)(vt_i8)(a >> (8 * j)) * (int)(vt_i8)(b >> (8 * j));
    return c;
#endif
#else
    return __dp4a(a, b, c);
#endif
}
