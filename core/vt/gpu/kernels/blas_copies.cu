
// ------------------------------------------- the vendor BLAS path's copies, 16 bytes a load

// The BLAS path (matmuls of many rows: prefill) copies each quantized weight into float32
// or half scratch once per matmul, so these copies are bound by memory bandwidth: 16
// values a thread from one load of codes (128 bits of int8 codes, 64 of nibbles) and one
// (scale, offset) pair (blocks of 16 or 32 values, so the 16 share it), written as 128-bit
// stores. Values rounded exactly
// as vt_wload (scale * q, then + offset, each rounded), so the float32 copy stays bit-exact
// to vt.reference.dequantize; the half copy rounds that to nearest even. The backend takes
// these when the weight's element count is a multiple of 16 and its codes 16-byte aligned,
// else the one-value-a-thread kernels of embedding_norm.cu.
struct alignas(16) vt_u4 {
    vt_u32 x, y, z, w;
};

// float -> IEEE half, nearest even: the conversion instruction on CUDA; vt_float_to_half's
// integer arithmetic on HIP (the same rounding; no AMD GPU here to measure another way).
__device__ __forceinline__ vt_u32 vt_half_bits(float f) {
#ifdef VT_HIP
    return vt_float_to_half(f);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

__device__ __forceinline__ void vt_dequantize16(float v[16], const vt_i8* data, const float* sm,
                                                int lg_block, long long e) {
    vt_codes<16> c = vt_qcodes<16>(data, lg_block, e);
    vt_f2 so = vt_qso(sm, lg_block, e >> VT_Q_LG(lg_block));
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        float q = (float)(vt_i8)(c.w[k / 4] >> (8 * (k % 4)));
        v[k] = __fadd_rn(__fmul_rn(so.x, q), so.y);
    }
}

// out[e] = dequant(weight)[e] into float32, 16 values a thread (total % 16 == 0).
extern "C" __global__ void dequantize16_q(float* out, const vt_i8* data, const float* sm,
                                          int lg_block, long long total) {
    long long stride = (long long)gridDim.x * blockDim.x * 16;
    for (long long e = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 16; e < total;
         e += stride) {
        float v[16];
        vt_dequantize16(v, data, sm, lg_block, e);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            vt_f4 o = {v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]};
            *(vt_f4*)(out + e + 4 * k) = o;
        }
    }
}

// The same into IEEE half (blas_inputs = "f16").
extern "C" __global__ void dequantize16_h_q(vt_u16* out, const vt_i8* data, const float* sm,
                                            int lg_block, long long total) {
    long long stride = (long long)gridDim.x * blockDim.x * 16;
    for (long long e = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 16; e < total;
         e += stride) {
        float v[16];
        vt_dequantize16(v, data, sm, lg_block, e);
        vt_u32 h[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) h[k] = vt_half_bits(v[2 * k]) | (vt_half_bits(v[2 * k + 1]) << 16);
        vt_u4 lo = {h[0], h[1], h[2], h[3]}, hi = {h[4], h[5], h[6], h[7]};
        *(vt_u4*)(out + e) = lo;
        *(vt_u4*)(out + e + 8) = hi;
    }
}

// out[e] = half(x[e]), 8 values a thread (total % 8 == 0): the activations' half copy.
extern "C" __global__ void to_half8(vt_u16* out, const float* x, long long total) {
    long long stride = (long long)gridDim.x * blockDim.x * 8;
    for (long long e = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8; e < total;
         e += stride) {
        vt_f4 a = *(const vt_f4*)(x + e), b = *(const vt_f4*)(x + e + 4);
        vt_u4 o = {vt_half_bits(a.x) | (vt_half_bits(a.y) << 16),
                   vt_half_bits(a.z) | (vt_half_bits(a.w) << 16),
                   vt_half_bits(b.x) | (vt_half_bits(b.y) << 16),
                   vt_half_bits(b.z) | (vt_half_bits(b.w) << 16)};
        *(vt_u4*)(out + e) = o;
    }
}
