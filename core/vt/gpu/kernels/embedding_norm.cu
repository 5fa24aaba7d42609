// ------------------------------------------------------------------------ embedding

// out[i, :] = dequant(table[ids[i], :]); an id outside [0, vocab) yields a NaN row.
template <int WT>
__device__ void vt_embedding(float* out, const void* data, const float* sm, int lg_block,
                             const int* ids, int n, int vocab, int dim) {
    int i = blockIdx.x;
    int id = ids[i];
    bool ok = id >= 0 && id < vocab;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        out[(long long)i * dim + d] =
            ok ? vt_wload<WT>(data, sm, lg_block, (long long)id * dim + d) : vt_nan();
    }
}

#define VT_EMBEDDING(SUFFIX, WT)                                                            \
    extern "C" __global__ void embedding_##SUFFIX(float* out, const void* data,             \
                                                  const float* sm, int lg_block,             \
                                                  const int* ids, int n, int vocab, int dim) { \
        vt_embedding<WT>(out, data, sm, lg_block, ids, n, vocab, dim);                       \
    }
VT_EMBEDDING(f32, WT_F32)
VT_EMBEDDING(f16, WT_F16)
VT_EMBEDDING(bf16, WT_BF16)
VT_EMBEDDING(q, WT_Q)

// out[e] = dequant(weight)[e] for the whole [rows, cols] weight (a float32 copy for the
// vendor BLAS path); rounded as vt_wload, so bit-exact to vt.reference.dequantize.
#define VT_DEQUANTIZE(SUFFIX, WT)                                                           \
    extern "C" __global__ void dequantize_##SUFFIX(float* out, const void* data,            \
                                                   const float* sm, int lg_block,            \
                                                   long long total) {                        \
        long long stride = (long long)gridDim.x * blockDim.x;                                \
        for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;      \
             e += stride)                                                                    \
            out[e] = vt_wload<WT>(data, sm, lg_block, e);                                    \
    }
VT_DEQUANTIZE(f16, WT_F16)
VT_DEQUANTIZE(bf16, WT_BF16)
VT_DEQUANTIZE(q, WT_Q)

// The same into IEEE half (the BLAS path with half inputs): each value dequantized as
// above, then rounded to half (nearest even).
#define VT_DEQUANTIZE_H(SUFFIX, WT)                                                         \
    extern "C" __global__ void dequantize_h_##SUFFIX(vt_u16* out, const void* data,         \
                                                     const float* sm, int lg_block,          \
                                                     long long total) {                      \
        long long stride = (long long)gridDim.x * blockDim.x;                                \
        for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;      \
             e += stride)                                                                    \
            out[e] = vt_float_to_half(vt_wload<WT>(data, sm, lg_block, e));                  \
    }
VT_DEQUANTIZE_H(bf16, WT_BF16)
VT_DEQUANTIZE_H(q, WT_Q)

// out[e] = half(x[e]): activations for the BLAS path with half inputs.
extern "C" __global__ void to_half(vt_u16* out, const float* x, long long total) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride)
        out[e] = vt_float_to_half(x[e]);
}

// out[i, j] += bias[j] for out[n, m] (the vendor BLAS path's bias epilogue).
extern "C" __global__ void bias_add(float* out, const float* bias, int n, int m) {
    long long total = (long long)n * m;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride)
        out[e] = out[e] + bias[e % m];
}

// ------------------------------------------------------------------------ rms_norm

// out[i] = x[i] * (1 / sqrt(mean(x[i]**2) + eps)) * w, one block per row. A thread keeps its
// first RN_KEEP values of x in registers for the second pass (one read of x from memory
// for rows of up to RN_KEEP * blockDim values: 2048 with 256 threads), and the weights it
// needs for them, read together with x; sums in the same order either way.
// Launched overlapped (common.cu): w is read before vt_grid_wait, x after.
extern "C" __global__ void rms_norm(float* out, const float* x, const float* w, int n, int dim,
                                    float eps) {
    __shared__ float red[256];
    vt_launch_dependents();
    const float* xr = x + (long long)blockIdx.x * dim;
    float* o = out + (long long)blockIdx.x * dim;
    float keep[RN_KEEP], wk[RN_KEEP];  // w read with x: one memory round trip, not two
#pragma unroll
    for (int i = 0; i < RN_KEEP; ++i) {
        int d = threadIdx.x + i * blockDim.x;
        wk[i] = d < dim ? w[d] : 0.0f;
    }
    vt_grid_wait();
    float scale = vt_rn_scale(xr, dim, eps, keep, red);
#pragma unroll
    for (int i = 0; i < RN_KEEP; ++i) {
        int d = threadIdx.x + i * blockDim.x;
        if (d < dim) o[d] = (keep[i] * scale) * wk[i];
    }
    for (int d = threadIdx.x + RN_KEEP * blockDim.x; d < dim; d += blockDim.x)
        o[d] = (xr[d] * scale) * w[d];
}

