// vt's GPU kernels: ONE source for CUDA (nvrtc) and HIP (hiprtc).
//
// Compiled at run time with -DVT_WARP=<warp size> (32 on NVIDIA, 32 or 64 on AMD). No
// #include: nvrtc and hiprtc find no system headers, and every helper needed is here.
// Conventions (see vt.backend): activations float32, ids/positions/slots int32, row-major.
// Every kernel is written so that no thread returns before a barrier or a shuffle: a thread
// outside the problem computes on clamped indices and skips only its final store.
//
// Weight formats (what GpuBackend.upload_weight makes of a GGUF tensor):
//   WT_F32, WT_F16, WT_BF16: the file's values, row-major [rows, cols].
//   WT_Q: int8 codes [rows, cols] plus one (scale, offset) float pair per block of
//         2**lg_block values along a row; value = scale * q + offset, rounded exactly as
//         gguf's dequantization rounds it (every GGML block type vt reads fits this form).

#if defined(__HIPCC_RTC__) || defined(__HIP_PLATFORM_AMD__)
#define VT_HIP 1
#endif

#ifndef VT_WARP
#error "compile with -DVT_WARP=<the device's warp size>"
#endif

#ifndef VT_EMULATE
#ifdef VT_HIP
#define VT_SHFL_XOR(v, m) __shfl_xor((v), (m), VT_WARP)
#else
#define VT_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m), VT_WARP)
#endif
#define VT_DYN_SHARED(T, name) extern __shared__ T name[]
#endif

typedef unsigned int vt_u32;
typedef unsigned long long vt_u64;
typedef unsigned short vt_u16;
typedef signed char vt_i8;

#define WT_F32 0
#define WT_F16 1
#define WT_BF16 2
#define WT_Q 3

// ------------------------------------------------------------------------ helpers

__device__ __forceinline__ float vt_nan() { return __uint_as_float(0x7fc00000u); }

// IEEE half to float, exact for every value (normals, subnormals, inf, NaN).
__device__ __forceinline__ float vt_half_to_float(vt_u16 h) {
    vt_u32 sign = ((vt_u32)h & 0x8000u) << 16;
    vt_u32 exp = ((vt_u32)h >> 10) & 0x1fu;
    vt_u32 mant = (vt_u32)h & 0x3ffu;
    if (exp == 0u) {
        float f = (float)mant * 5.9604644775390625e-08f;  // mant * 2**-24, exact
        return sign ? -f : f;
    }
    if (exp == 31u) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

__device__ __forceinline__ float vt_bf16_to_float(vt_u16 h) {
    return __uint_as_float((vt_u32)h << 16);
}

// One weight element. Quantized: scale * q + offset with two roundings, as numpy does.
template <int WT>
__device__ __forceinline__ float vt_wload(const void* data, const float* sm, int lg_block,
                                          long long idx) {
    if (WT == WT_F32) return ((const float*)data)[idx];
    if (WT == WT_F16) return vt_half_to_float(((const vt_u16*)data)[idx]);
    if (WT == WT_BF16) return vt_bf16_to_float(((const vt_u16*)data)[idx]);
    long long b = idx >> lg_block;
    float q = (float)((const vt_i8*)data)[idx];
    return __fadd_rn(__fmul_rn(sm[2 * b], q), sm[2 * b + 1]);
}

// Block-wide reductions over shared scratch of blockDim.x entries (blockDim a power of 2).
// Every thread gets the result. Fixed tree order: deterministic run to run.
__device__ float vt_block_sum(float v, float* red) {
    int t = threadIdx.x;
    red[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) red[t] = red[t] + red[t + s];
        __syncthreads();
    }
    float r = red[0];
    __syncthreads();
    return r;
}

__device__ float vt_block_max(float v, float* red) {
    int t = threadIdx.x;
    red[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) red[t] = fmaxf(red[t], red[t + s]);
        __syncthreads();
    }
    float r = red[0];
    __syncthreads();
    return r;
}

__device__ unsigned int vt_block_sum_u(unsigned int v, unsigned int* red) {
    int t = threadIdx.x;
    red[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) red[t] = red[t] + red[t + s];
        __syncthreads();
    }
    unsigned int r = red[0];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float vt_warp_sum(float v) {
    for (int m = VT_WARP / 2; m > 0; m >>= 1) v += VT_SHFL_XOR(v, m);
    return v;
}

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

// ------------------------------------------------------------------------ rms_norm

// out[i] = x[i] * (1 / sqrt(mean(x[i]**2) + eps)) * w, one block per row.
extern "C" __global__ void rms_norm(float* out, const float* x, const float* w, int n, int dim,
                                    float eps) {
    __shared__ float red[256];
    const float* xr = x + (long long)blockIdx.x * dim;
    float* o = out + (long long)blockIdx.x * dim;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) ss = __fadd_rn(ss, __fmul_rn(xr[d], xr[d]));
    ss = vt_block_sum(ss, red);
    float scale = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int d = threadIdx.x; d < dim; d += blockDim.x) o[d] = (xr[d] * scale) * w[d];
}

// ------------------------------------------------------------------------ matmul

// Decode batches (n < tiled_min_rows): one warp per NO output features (NO = 1, 2 or 4, the
// host's choice: 1 for one row, where the weights' bandwidth is all that counts; more for
// several rows, so that each x value read from L1 serves NO weight rows). The rows of x are
// taken MM_R at a time, and a block's rows are [blockIdx.y * rpb, (blockIdx.y + 1) * rpb):
// with grid.y = 1 a weight row is read from memory once for every row of x. Quantized
// weights with K a multiple of 16 and x 16-byte aligned take the vector path: each lane
// reads CH int8 codes of a row in one load (16 in 128 bits where the warp reads one or two
// weight rows, 8 in 64 bits for more, to hold the registers) with their (scale, offset)
// pair, and x as float4s; anything else reads one element per lane per step. Dequantization is the exact
// two-rounding form of vt_wload either way; accumulation is float32.
#define MM_R 8
template <int CH>  // CH int8 codes in one load
struct alignas(CH) vt_codes {
    vt_u32 w[CH / 4];
};
struct alignas(8) vt_f2 {
    float x, y;
};
struct alignas(16) vt_f4 {
    float x, y, z, w;
};

// One weight row of a decode kernel: its data, (scale, offset) pairs, block size and the
// flat index of its first element.
struct VtRow {
    const void* data;
    const float* sm;
    int lg;
    long long at;
};

// acc[i][r] = sum_k dequant(row i)[k] * x[r0 + r, k] for r < min(MM_R, n - r0), reduced over
// the warp (every lane gets every sum).
template <int WT, int NW>
__device__ __forceinline__ void vt_mm_rows(const VtRow* w, const float* x, int n, int K, int r0,
                                           float (*acc)[MM_R]) {
    int lane = threadIdx.x % VT_WARP;
    int nr = min(MM_R, n - r0);
#pragma unroll
    for (int i = 0; i < NW; ++i)
#pragma unroll
        for (int r = 0; r < MM_R; ++r) acc[i][r] = 0.0f;
    const float* xr = x + (long long)r0 * K;
    if (WT == WT_Q && (K & 15) == 0 && (((unsigned long long)x) & 15ull) == 0) {
        constexpr int CH = NW <= 2 ? 16 : 8;
        for (int k = lane * CH; k < K; k += VT_WARP * CH) {
            float wv[NW][CH];
#pragma unroll
            for (int i = 0; i < NW; ++i) {
                long long at = w[i].at + k;
                vt_codes<CH> raw = *(const vt_codes<CH>*)((const vt_i8*)w[i].data + at);
                vt_f2 so = *(const vt_f2*)(w[i].sm + 2 * (at >> w[i].lg));  // one block
#pragma unroll
                for (int j = 0; j < CH; ++j) {
                    int code = (int)(vt_i8)((raw.w[j >> 2] >> (8 * (j & 3))) & 0xffu);
                    wv[i][j] = __fadd_rn(__fmul_rn(so.x, (float)code), so.y);
                }
            }
#pragma unroll
            for (int r = 0; r < MM_R; ++r) {
                if (r < nr) {
                    const vt_f4* xp = (const vt_f4*)(xr + (long long)r * K + k);
                    float xv[CH];
#pragma unroll
                    for (int c = 0; c < CH / 4; ++c) {
                        vt_f4 a = xp[c];
                        xv[4 * c] = a.x, xv[4 * c + 1] = a.y, xv[4 * c + 2] = a.z;
                        xv[4 * c + 3] = a.w;
                    }
#pragma unroll
                    for (int i = 0; i < NW; ++i) {
                        float s = acc[i][r];
#pragma unroll
                        for (int j = 0; j < CH; ++j) s += wv[i][j] * xv[j];
                        acc[i][r] = s;
                    }
                }
            }
        }
    } else {
        for (int k = lane; k < K; k += VT_WARP) {
            float wv[NW];
#pragma unroll
            for (int i = 0; i < NW; ++i) wv[i] = vt_wload<WT>(w[i].data, w[i].sm, w[i].lg, w[i].at + k);
#pragma unroll
            for (int r = 0; r < MM_R; ++r) {
                if (r < nr) {
                    float xv = xr[(long long)r * K + k];
#pragma unroll
                    for (int i = 0; i < NW; ++i) acc[i][r] += wv[i] * xv;
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < NW; ++i)
#pragma unroll
        for (int r = 0; r < MM_R; ++r) acc[i][r] = vt_warp_sum(acc[i][r]);
}

// out = x @ W.T (+ bias) (+ residual: out may alias it); this warp's NO features.
template <int WT, int NO>
__device__ void vt_matmul_small(float* out, const float* x, const void* data, const float* sm,
                                int lg_block, const float* bias, const float* residual, int n,
                                int N, int K, int rpb) {
    int warps = blockDim.x / VT_WARP;
    int lane = threadIdx.x % VT_WARP;
    int o0 = (blockIdx.x * warps + threadIdx.x / VT_WARP) * NO;
    if (o0 >= N) return;  // a whole warp leaves: no barrier or shuffle is left out
    VtRow w[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) w[i] = {data, sm, lg_block, (long long)min(o0 + i, N - 1) * K};
    int row_end = min(n, ((int)blockIdx.y + 1) * rpb);
    for (int r0 = (int)blockIdx.y * rpb; r0 < row_end; r0 += MM_R) {
        float acc[NO][MM_R];
        vt_mm_rows<WT, NO>(w, x, row_end, K, r0, acc);
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            int o = o0 + i;
#pragma unroll
            for (int r = 0; r < MM_R; ++r) {
                int row = r0 + r;
                if (lane == r && row < row_end && o < N) {
                    long long at = (long long)row * N + o;
                    float v = bias ? acc[i][r] + bias[o] : acc[i][r];
                    out[at] = residual ? __fadd_rn(residual[at], v) : v;
                }
            }
        }
    }
}

// out = silu(x @ G.T) * (x @ U.T): gate and up rows of this warp's NO features read in one
// pass; the SiLU-mul epilogue rounded as silu_mul rounds it.
template <int WT, int NO>
__device__ void vt_swiglu_small(float* out, const float* x, const void* gdata, const float* gsm,
                                int glg, const void* udata, const float* usm, int ulg, int n,
                                int N, int K, int rpb) {
    int warps = blockDim.x / VT_WARP;
    int lane = threadIdx.x % VT_WARP;
    int o0 = (blockIdx.x * warps + threadIdx.x / VT_WARP) * NO;
    if (o0 >= N) return;
    VtRow w[2 * NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) {
        long long at = (long long)min(o0 + i, N - 1) * K;
        w[i] = {gdata, gsm, glg, at};
        w[NO + i] = {udata, usm, ulg, at};
    }
    int row_end = min(n, ((int)blockIdx.y + 1) * rpb);
    for (int r0 = (int)blockIdx.y * rpb; r0 < row_end; r0 += MM_R) {
        float acc[2 * NO][MM_R];
        vt_mm_rows<WT, 2 * NO>(w, x, row_end, K, r0, acc);
#pragma unroll
        for (int i = 0; i < NO; ++i) {
            int o = o0 + i;
#pragma unroll
            for (int r = 0; r < MM_R; ++r) {
                int row = r0 + r;
                if (lane == r && row < row_end && o < N) {
                    float g = acc[i][r], u = acc[NO + i][r];
                    float denom = __fadd_rn(expf(-g), 1.0f);
                    out[(long long)row * N + o] = __fdiv_rn(__fmul_rn(g, u), denom);
                }
            }
        }
    }
}

// q, k, v = x @ Wq.T (+ bq), x @ Wk.T (+ bk), x @ Wv.T (+ bv): one launch over the Nq + Nk +
// Nv output features, NO per warp, each taking its own weight (same kind, own block size).
template <int WT, int NO>
__device__ void vt_qkv_small(float* q, float* k, float* v, const float* x, const void* wq,
                             const float* sq, int lgq, const float* bq, const void* wk,
                             const float* sk, int lgk, const float* bk, const void* wv,
                             const float* sv, int lgv, const float* bv, int n, int Nq, int Nk,
                             int Nv, int K, int rpb) {
    int warps = blockDim.x / VT_WARP;
    int lane = threadIdx.x % VT_WARP;
    int total = Nq + Nk + Nv;
    int g0 = (blockIdx.x * warps + threadIdx.x / VT_WARP) * NO;
    if (g0 >= total) return;
    VtRow w[NO];
    float* outs[NO];
    const float* biases[NO];
    int os[NO], Ns[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) {
        int g = min(g0 + i, total - 1);
        if (g >= Nq + Nk) {
            os[i] = g - Nq - Nk, Ns[i] = Nv, outs[i] = v, biases[i] = bv;
            w[i] = {wv, sv, lgv, (long long)os[i] * K};
        } else if (g >= Nq) {
            os[i] = g - Nq, Ns[i] = Nk, outs[i] = k, biases[i] = bk;
            w[i] = {wk, sk, lgk, (long long)os[i] * K};
        } else {
            os[i] = g, Ns[i] = Nq, outs[i] = q, biases[i] = bq;
            w[i] = {wq, sq, lgq, (long long)os[i] * K};
        }
    }
    int row_end = min(n, ((int)blockIdx.y + 1) * rpb);
    for (int r0 = (int)blockIdx.y * rpb; r0 < row_end; r0 += MM_R) {
        float acc[NO][MM_R];
        vt_mm_rows<WT, NO>(w, x, row_end, K, r0, acc);
#pragma unroll
        for (int i = 0; i < NO; ++i) {
#pragma unroll
            for (int r = 0; r < MM_R; ++r) {
                int row = r0 + r;
                if (lane == r && row < row_end && g0 + i < total) {
                    float b = biases[i] ? biases[i][os[i]] : 0.0f;
                    outs[i][(long long)row * Ns[i] + os[i]] = biases[i] ? acc[i][r] + b : acc[i][r];
                }
            }
        }
    }
}

// Larger batches (prefill): 64x64 output tiles, K in steps of 16 through shared memory,
// weights dequantized on the way in, 4x4 outputs per thread (256 threads); optional bias and
// residual (out may alias it) in the epilogue.
#define TM 64
#define TN 64
#define TK 16
template <int WT>
__device__ void vt_matmul_tiled(float* out, const float* x, const void* data, const float* sm,
                                int lg_block, const float* bias, const float* residual, int n,
                                int N, int K) {
    __shared__ float xs[TK][TM + 1];
    __shared__ float ws[TK][TN + 1];
    int t = threadIdx.x;
    int tx = t % 16, ty = t / 16;
    int row0 = blockIdx.y * TM, col0 = blockIdx.x * TN;
    float acc[4][4];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TK) {
        for (int e = t; e < TM * TK; e += 256) {
            int r = e / TK, kk = e % TK;
            int row = row0 + r, k = k0 + kk;
            xs[kk][r] = (row < n && k < K) ? x[(long long)row * K + k] : 0.0f;
            int c = col0 + r;
            ws[kk][r] = (c < N && k < K) ? vt_wload<WT>(data, sm, lg_block, (long long)c * K + k)
                                         : 0.0f;
        }
        __syncthreads();
        for (int kk = 0; kk < TK; ++kk) {
            float a[4], b[4];
            for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty * 4 + i];
            for (int j = 0; j < 4; ++j) b[j] = ws[kk][tx * 4 + j];
            for (int i = 0; i < 4; ++i)
                for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
    for (int i = 0; i < 4; ++i) {
        int row = row0 + ty * 4 + i;
        for (int j = 0; j < 4; ++j) {
            int c = col0 + tx * 4 + j;
            if (row < n && c < N) {
                long long at = (long long)row * N + c;
                float v = bias ? acc[i][j] + bias[c] : acc[i][j];
                out[at] = residual ? __fadd_rn(residual[at], v) : v;
            }
        }
    }
}

// Decode kernels per NO (features per warp): matmul_small1_q, matmul_small4_q, qkv_small1_q,
// qkv_small4_q, swiglu_small1_q, swiglu_small2_q (2 features = 4 weight rows), ...
#define VT_DECODE_MM(SUFFIX, WT, NO)                                                          \
    extern "C" __global__ void matmul_small##NO##_##SUFFIX(                                   \
        float* out, const float* x, const void* data, const float* sm, int lg_block,          \
        const float* bias, const float* residual, int n, int N, int K, int rpb) {             \
        vt_matmul_small<WT, NO>(out, x, data, sm, lg_block, bias, residual, n, N, K, rpb);     \
    }                                                                                          \
    extern "C" __global__ void qkv_small##NO##_##SUFFIX(                                      \
        float* q, float* k, float* v, const float* x, const void* wq, const float* sq,        \
        int lgq, const float* bq, const void* wk, const float* sk, int lgk, const float* bk,  \
        const void* wv, const float* sv, int lgv, const float* bv, int n, int Nq, int Nk,     \
        int Nv, int K, int rpb) {                                                              \
        vt_qkv_small<WT, NO>(q, k, v, x, wq, sq, lgq, bq, wk, sk, lgk, bk, wv, sv, lgv, bv, n, \
                             Nq, Nk, Nv, K, rpb);                                              \
    }
#define VT_DECODE_SW(SUFFIX, WT, NO)                                                          \
    extern "C" __global__ void swiglu_small##NO##_##SUFFIX(                                   \
        float* out, const float* x, const void* gdata, const float* gsm, int glg,             \
        const void* udata, const float* usm, int ulg, int n, int N, int K, int rpb) {         \
        vt_swiglu_small<WT, NO>(out, x, gdata, gsm, glg, udata, usm, ulg, n, N, K, rpb);       \
    }
#define VT_MATMUL(SUFFIX, WT)                                                                 \
    VT_DECODE_MM(SUFFIX, WT, 1)                                                                \
    VT_DECODE_MM(SUFFIX, WT, 4)                                                                \
    VT_DECODE_SW(SUFFIX, WT, 1)                                                                \
    VT_DECODE_SW(SUFFIX, WT, 2)                                                                \
    extern "C" __global__ void matmul_tiled_##SUFFIX(                                          \
        float* out, const float* x, const void* data, const float* sm, int lg_block,          \
        const float* bias, const float* residual, int n, int N, int K) {                      \
        vt_matmul_tiled<WT>(out, x, data, sm, lg_block, bias, residual, n, N, K);              \
    }
VT_MATMUL(f32, WT_F32)
VT_MATMUL(f16, WT_F16)
VT_MATMUL(bf16, WT_BF16)
VT_MATMUL(q, WT_Q)

// ------------------------------------------------------------------------ rope

// Per-pair inverse frequencies, already divided by the linear factor, in float64 (the
// reference computes theta in float64); passed by value so a step uploads nothing.
#define ROPE_MAX_PAIRS 128
struct RopeTable {
    double inv[ROPE_MAX_PAIRS];
};

// x[n, n_heads, head_dim] rotated in place. neox: pairs (i, i + d/2); else (2i, 2i+1).
extern "C" __global__ void rope(float* x, const int* positions, int n, int n_heads,
                                int head_dim, int neox, RopeTable table) {
    int half = head_dim / 2;
    long long total = (long long)n * n_heads * half;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        int i = (int)(e % half);
        long long rh = e / half;  // row * n_heads + head
        int row = (int)(rh / n_heads);
        double theta = (double)positions[row] * table.inv[i];
        float c = (float)cos(theta), s = (float)sin(theta);
        float* v = x + rh * head_dim;
        int ia = neox ? i : 2 * i;
        int ib = neox ? i + half : 2 * i + 1;
        float a = v[ia], b = v[ib];
        v[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        v[ib] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
}

// ------------------------------------------------------------------------ KV cache

// Element (pos, slot, layer, kv, head, d) of the position-major cache (vt.KVLayout).
__device__ __forceinline__ long long vt_kv_index(int pos, int slot, int layer, int kv,
                                                 int n_slots, int n_layers, int row) {
    return ((((long long)pos * n_slots + slot) * n_layers + layer) * 2 + kv) * row;
}

// cache[positions[i], slots[i], layer, 0|1] = k[i] | v[i]; rows with an out-of-range slot
// or position are skipped (the backend checks host-visible inputs before launching).
extern "C" __global__ void kv_store(float* cache, const float* k, const float* v,
                                    const int* slots, const int* positions, int n, int row,
                                    int n_slots, int n_layers, int max_len, int layer) {
    long long total = (long long)n * row;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        int i = (int)(e / row), j = (int)(e % row);
        int slot = slots[i], pos = positions[i];
        if (slot < 0 || slot >= n_slots || pos < 0 || pos >= max_len) continue;
        long long base = vt_kv_index(pos, slot, layer, 0, n_slots, n_layers, row);
        cache[base + j] = k[e];
        cache[base + row + j] = v[e];
    }
}

// rope(q) and rope(k) in place, then k and v into the cache: one thread per rotated pair of
// the n * (n_heads + n_kv) heads. A K head's thread also stores its roped pair and the same
// two elements of v (so every element of k and v is stored once); rounding as rope's, and a
// row with an out-of-range slot or position is roped but not stored (as kv_store).
extern "C" __global__ void rope_kv_store(float* q, float* k, const float* v,
                                         const int* positions, const int* slots, float* cache,
                                         int n, int n_heads, int n_kv, int head_dim, int neox,
                                         int n_slots, int n_layers, int max_len, int layer,
                                         RopeTable table) {
    int half = head_dim / 2;
    int heads = n_heads + n_kv;
    int row_w = n_kv * head_dim;
    long long total = (long long)n * heads * half;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        int i = (int)(e % half);
        long long rh = e / half;  // row * heads + head
        int row = (int)(rh / heads), hh = (int)(rh % heads);
        int pos = positions[row];
        double theta = (double)pos * table.inv[i];
        float c = (float)cos(theta), s = (float)sin(theta);
        bool is_q = hh < n_heads;
        int kh = hh - n_heads;
        float* vec = is_q ? q + ((long long)row * n_heads + hh) * head_dim
                          : k + (long long)row * row_w + (long long)kh * head_dim;
        int ia = neox ? i : 2 * i;
        int ib = neox ? i + half : 2 * i + 1;
        float a = vec[ia], b = vec[ib];
        float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        float rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
        vec[ia] = ra;
        vec[ib] = rb;
        if (!is_q) {
            int slot = slots[row];
            if (slot < 0 || slot >= n_slots || pos < 0 || pos >= max_len) continue;
            long long base = vt_kv_index(pos, slot, layer, 0, n_slots, n_layers, row_w) +
                             (long long)kh * head_dim;
            const float* vr = v + (long long)row * row_w + (long long)kh * head_dim;
            cache[base + ia] = ra;
            cache[base + ib] = rb;
            cache[base + row_w + ia] = vr[ia];
            cache[base + row_w + ib] = vr[ib];
        }
    }
}

// Causal attention, one block per (row i, query head h), ATT_THREADS threads (>= head_dim).
// Positions 0..positions[i] of slot slots[i] in chunks of ATT_CHUNK with an online softmax
// (running max and sum), so any context length works with fixed shared memory.
#define ATT_THREADS 256
#define ATT_CHUNK 1024
extern "C" __global__ void attention(float* out, const float* q, const float* cache,
                                     const int* slots, const int* positions, int n, int n_heads,
                                     int n_kv, int head_dim, int n_slots, int n_layers,
                                     int max_len, int layer, float scale) {
    __shared__ float qs[256];
    __shared__ float sc[ATT_CHUNK];
    __shared__ float red[ATT_THREADS];
    int i = blockIdx.x, h = blockIdx.y, t = threadIdx.x;
    int row = n_kv * head_dim;
    int kvh = h / (n_heads / n_kv);
    int slot = slots[i], pos = positions[i];
    bool ok = slot >= 0 && slot < n_slots && pos >= 0 && pos < max_len;
    int length = ok ? pos + 1 : 0;
    const float* qi = q + ((long long)i * n_heads + h) * head_dim;
    for (int d = t; d < head_dim; d += blockDim.x) qs[d] = qi[d];
    __syncthreads();
    long long pos_stride = (long long)n_slots * n_layers * 2 * row;
    long long kbase = ok ? vt_kv_index(0, slot, layer, 0, n_slots, n_layers, row) + kvh * head_dim
                         : 0;
    long long vbase = kbase + row;
    float m = -__uint_as_float(0x7f800000u);  // -inf
    float l = 0.0f, acc = 0.0f;
    for (int c0 = 0; c0 < length; c0 += ATT_CHUNK) {
        int cn = min(ATT_CHUNK, length - c0);
        float cmax = -__uint_as_float(0x7f800000u);
        for (int j = t; j < cn; j += blockDim.x) {
            const float* kp = cache + kbase + (long long)(c0 + j) * pos_stride;
            float s = 0.0f;
            for (int d = 0; d < head_dim; ++d) s += qs[d] * kp[d];
            s = s * scale;
            sc[j] = s;
            cmax = fmaxf(cmax, s);
        }
        cmax = vt_block_max(cmax, red);
        float new_m = fmaxf(m, cmax);
        float part = 0.0f;
        for (int j = t; j < cn; j += blockDim.x) {
            float p = expf(sc[j] - new_m);
            sc[j] = p;
            part += p;
        }
        part = vt_block_sum(part, red);  // its barriers also publish sc[]
        float corr = expf(m - new_m);    // 0 on the first chunk (m = -inf)
        l = l * corr + part;
        if (t < head_dim) {  // four partial sums: four value rows in flight
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            const float* vp = cache + vbase + t;
            int j = 0;
            for (; j + 3 < cn; j += 4) {
                const float* p = vp + (long long)(c0 + j) * pos_stride;
                a0 += sc[j] * p[0];
                a1 += sc[j + 1] * p[pos_stride];
                a2 += sc[j + 2] * p[2 * pos_stride];
                a3 += sc[j + 3] * p[3 * pos_stride];
            }
            for (; j < cn; ++j) a0 += sc[j] * vp[(long long)(c0 + j) * pos_stride];
            acc = acc * corr + ((a0 + a1) + (a2 + a3));
        }
        m = new_m;
        __syncthreads();  // sc[] is rewritten by the next chunk
    }
    if (t < head_dim) out[((long long)i * n_heads + h) * head_dim + t] = ok ? acc / l : vt_nan();
}

// ------------------------------------------------------------------------ elementwise

// silu(g) * u = g * u / (1 + exp(-g)), rounded as the reference rounds it.
extern "C" __global__ void silu_mul(float* out, const float* gate, const float* up, int n) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
        float g = gate[e];
        float denom = __fadd_rn(expf(-g), 1.0f);
        out[e] = __fdiv_rn(__fmul_rn(g, up[e]), denom);
    }
}

extern "C" __global__ void add(float* out, const float* a, const float* b, int n) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x)
        out[e] = __fadd_rn(a[e], b[e]);
}

// out[i] = x[rows[i]]; a row outside [0, m) yields NaNs.
extern "C" __global__ void gather_rows(float* out, const float* x, const int* rows, int n,
                                       int dim, int m) {
    int i = blockIdx.x;
    int r = rows[i];
    bool ok = r >= 0 && r < m;
    for (int d = threadIdx.x; d < dim; d += blockDim.x)
        out[(long long)i * dim + d] = ok ? x[(long long)r * dim + d] : vt_nan();
}

// ------------------------------------------------------------------------ sampling
//
// vt.reference.sample, one block of SAMPLE_THREADS per row. The reference sorts the
// candidates by (l desc, id asc) and walks running sums; the kernel never sorts. It maps
// each l to an order-preserving 32-bit key and finds, by binary search over keys (then over
// ids within a run of equal keys), the element where a running sum in that order crosses a
// threshold. Sums are float32 in a fixed tree order: they round differently from numpy's
// running sums, so a draw may differ only where u * c[-1] (or top_p) lies within rounding of
// a boundary of the running sum, as the reference documents. A row whose inputs make the
// reference raise (NaN or +inf logits, NaN temperature, top_p <= 0, all logits -inf)
// yields id -1.

#define SAMPLE_THREADS 512

struct SampleParams {
    float temperature;
    float top_p;
    int top_k;
    vt_u32 seed;
    vt_u32 counter;
};

__device__ __forceinline__ vt_u32 vt_key(float l) {
    if (l == 0.0f) l = 0.0f;  // -0 and +0 are one value to the sort
    vt_u32 u = __float_as_uint(l);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ vt_u64 vt_splitmix64(vt_u64 x) {
    vt_u64 z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

struct SampleRow {
    const float* lg;
    int vocab;
    float t;        // temperature
    float lmax;     // max over l
    float sum;      // float32 sum of exp(l - lmax) over the candidates
    // candidates (top-k): key > kkey, or key == kkey and id <= kid
    vt_u32 kkey;
    int kid;
    // kept (top-p): candidates with key > pkey, or key == pkey and id <= pid
    vt_u32 pkey;
    int pid;
};

__device__ __forceinline__ float vt_l(const SampleRow& R, int i) { return R.lg[i] / R.t; }

__device__ __forceinline__ bool vt_in(vt_u32 key, int i, vt_u32 lim_key, int lim_id) {
    return key > lim_key || (key == lim_key && i <= lim_id);
}

// The probability of element i (0 outside the candidates), as the reference computes it.
__device__ __forceinline__ float vt_prob(const SampleRow& R, float l, vt_u32 key, int i) {
    if (!vt_in(key, i, R.kkey, R.kid)) return 0.0f;
    return expf(l - R.lmax) / R.sum;
}

// Sum of probabilities over the elements (kept_only: the kept ones) with key >= kmin
// (strict: key > kmin), or (group) with key == kmin and id <= id_max.
__device__ float vt_mass(const SampleRow& R, bool kept_only, vt_u32 kmin, bool strict,
                         bool group, int id_max, float* red) {
    float part = 0.0f;
    for (int i = threadIdx.x; i < R.vocab; i += blockDim.x) {
        float l = vt_l(R, i);
        vt_u32 key = vt_key(l);
        if (kept_only && !vt_in(key, i, R.pkey, R.pid)) continue;
        bool sel = group ? (key == kmin && i <= id_max) : (strict ? key > kmin : key >= kmin);
        if (sel) part += vt_prob(R, l, key, i);
    }
    return vt_block_sum(part, red);
}

// The first element, in (l desc, id asc) order over the kept elements, where the running
// sum of probabilities c satisfies c >= target (ge) or c > target (!ge). Returns false when
// no element does; else its key and id.
__device__ bool vt_crossing(const SampleRow& R, bool kept_only, float target, bool ge,
                            vt_u32* out_key, int* out_id, float* red) {
    float total = vt_mass(R, kept_only, 0u, false, false, 0, red);
    if (!(ge ? total >= target : total > target)) return false;
    vt_u32 g = 0u;  // the largest key whose mass of keys >= it satisfies the condition
    for (int b = 31; b >= 0; --b) {
        vt_u32 cand = g | (1u << b);
        float s = vt_mass(R, kept_only, cand, false, false, 0, red);
        if (ge ? s >= target : s > target) g = cand;
    }
    float prefix = (g == 0xffffffffu) ? 0.0f : vt_mass(R, kept_only, g, true, false, 0, red);
    // Smallest id x in the run of key g with prefix + mass(run, id <= x) satisfying it.
    int lo = 0, hi = R.vocab - 1, found = -1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        float s = prefix + vt_mass(R, kept_only, g, false, true, mid, red);
        if (ge ? s >= target : s > target) {
            found = mid;
            hi = mid - 1;
        } else {
            lo = mid + 1;
        }
    }
    if (found < 0) {
        // Rounding put the whole run just short: take the run's last member (largest id).
        int mine = -1;
        for (int i = threadIdx.x; i < R.vocab; i += blockDim.x) {
            vt_u32 key = vt_key(vt_l(R, i));
            if (key == g && (!kept_only || vt_in(key, i, R.pkey, R.pid))) mine = i;
        }
        found = (int)vt_block_max((float)mine, red);  // ids < 2**24 are exact floats
    }
    *out_key = g;
    *out_id = found;
    return found >= 0;
}

extern "C" __global__ void sample(int* out, const float* logits, const SampleParams* params,
                                  int n, int vocab) {
    __shared__ float red[SAMPLE_THREADS];
    __shared__ int ired[SAMPLE_THREADS];
    int r = blockIdx.x, t = threadIdx.x;
    const float* lg = logits + (long long)r * vocab;
    SampleParams p = params[r];

    // 1. argmax (lowest id on ties) and the checks the reference makes. Each thread walks
    // its ids in increasing order (four at a time, one 128-bit load, where the row allows).
    float best = -__uint_as_float(0x7f800000u);
    int best_id = 0x7fffffff;
    int bad = 0;
    int vec = ((vocab & 3) == 0 && (((unsigned long long)lg) & 15ull) == 0) ? vocab : 0;
    for (int i4 = 4 * t; i4 < vec; i4 += 4 * blockDim.x) {
        vt_f4 v4 = *(const vt_f4*)(lg + i4);
        float vs[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float v = vs[j];
            if (v != v || v == __uint_as_float(0x7f800000u)) bad = 1;
            if (v > best || (v == best && i4 + j < best_id)) {
                best = v;
                best_id = i4 + j;
            }
        }
    }
    for (int i = vec + t; i < vocab; i += blockDim.x) {
        float v = lg[i];
        if (v != v || v == __uint_as_float(0x7f800000u)) bad = 1;
        if (v > best || (v == best && i < best_id)) {
            best = v;
            best_id = i;
        }
    }
    red[t] = best;
    ired[t] = best_id;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) {
            float ov = red[t + s];
            int oi = ired[t + s];
            if (ov > red[t] || (ov == red[t] && oi < ired[t])) {
                red[t] = ov;
                ired[t] = oi;
            }
        }
        __syncthreads();
    }
    best = red[0];
    best_id = ired[0];
    __syncthreads();
    bad = (int)vt_block_sum((float)bad, red) > 0;
    if (best_id == 0x7fffffff) best_id = 0;  // every logit -inf: numpy's argmax is 0
    float temp = p.temperature;
    int result;
    if (bad || temp != temp) {
        result = -1;
    } else if (temp <= 0.0f) {
        result = best_id;
    } else if (!(p.top_p > 0.0f) || best == -__uint_as_float(0x7f800000u)) {
        result = -1;
    } else {
        SampleRow R;
        R.lg = lg;
        R.vocab = vocab;
        R.t = temp;
        R.lmax = best / temp;  // division by t > 0 preserves the order, so max l = l[argmax]
        R.sum = 1.0f;
        // 2. top-k: kkey = the key of the k-th candidate; ties at it kept by ascending id.
        int k = p.top_k;
        if (k > 0 && k < vocab) {
            unsigned int* ured = (unsigned int*)red;
            vt_u32 g = 0u;
            for (int b = 31; b >= 0; --b) {
                vt_u32 cand = g | (1u << b);
                unsigned int c = 0;
                for (int i = t; i < vocab; i += blockDim.x) c += vt_key(vt_l(R, i)) >= cand;
                if (vt_block_sum_u(c, ured) >= (unsigned int)k) g = cand;
            }
            unsigned int above = 0;
            for (int i = t; i < vocab; i += blockDim.x) above += vt_key(vt_l(R, i)) > g;
            above = vt_block_sum_u(above, ured);
            unsigned int need = (unsigned int)k - above;  // >= 1 by the choice of g
            int lo = 0, hi = vocab - 1, found = vocab - 1;
            while (lo <= hi) {
                int mid = lo + (hi - lo) / 2;
                unsigned int c = 0;
                for (int i = t; i <= mid; i += blockDim.x) c += vt_key(vt_l(R, i)) == g;
                if (vt_block_sum_u(c, ured) >= need) {
                    found = mid;
                    hi = mid - 1;
                } else {
                    lo = mid + 1;
                }
            }
            R.kkey = g;
            R.kid = found;
        } else {
            R.kkey = 0u;
            R.kid = 0x7fffffff;  // key >= 0 always: everything is a candidate
        }
        // 3. the float32 sum of exp(l - lmax) over the candidates.
        float part = 0.0f;
        for (int i = t; i < vocab; i += blockDim.x) {
            float l = vt_l(R, i);
            if (vt_in(vt_key(l), i, R.kkey, R.kid)) part += expf(l - R.lmax);
        }
        R.sum = vt_block_sum(part, red);
        // 4. top-p: keep the shortest prefix whose running sum reaches top_p.
        R.pkey = 0u;
        R.pid = 0x7fffffff;
        if (p.top_p < 1.0f) {
            vt_u32 key;
            int id;
            if (vt_crossing(R, false, p.top_p, true, &key, &id, red)) {
                R.pkey = key;
                R.pid = id;
            }
        }
        // 5. the draw: the first kept element whose running sum exceeds u * c[-1].
        float c_last = vt_mass(R, true, 0u, false, false, 0, red);
        vt_u64 z = vt_splitmix64(((vt_u64)p.seed << 32) | (vt_u64)p.counter);
        float u = (float)(z >> 40) * 5.9604644775390625e-08f;  // exact: 24 bits * 2**-24
        float target = u * c_last;
        vt_u32 key;
        int id;
        if (vt_crossing(R, true, target, false, &key, &id, red)) {
            result = id;
        } else {
            // Past the end by rounding: the last kept element with a non-zero probability.
            // Smallest key among those, then the largest id with that key.
            unsigned int* ured = (unsigned int*)red;
            // The smallest such key: the largest g with no such element below it.
            vt_u32 g = 0u;
            for (int b = 31; b >= 0; --b) {
                vt_u32 cand = g | (1u << b);
                unsigned int c = 0;
                for (int i = t; i < vocab; i += blockDim.x) {
                    float l = vt_l(R, i);
                    vt_u32 kk = vt_key(l);
                    if (vt_in(kk, i, R.pkey, R.pid) && vt_prob(R, l, kk, i) > 0.0f && kk < cand)
                        c += 1;
                }
                if (vt_block_sum_u(c, ured) == 0u) g = cand;
            }
            int mine = -1;
            for (int i = t; i < vocab; i += blockDim.x) {
                float l = vt_l(R, i);
                vt_u32 kk = vt_key(l);
                if (kk == g && vt_in(kk, i, R.pkey, R.pid) && vt_prob(R, l, kk, i) > 0.0f)
                    mine = i;
            }
            result = (int)vt_block_max((float)mine, red);
        }
    }
    if (t == 0) out[r] = result;
}
