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

// acc[i][r] = sum_k dequant(row i)[k] * x[r0 + r, k] for r < min(MM_R, n - r0), reduced over
// the warp (every lane gets every sum).
// Int8 activations (WT_Q8A): each row of x is packed by quantize_rows as K int8 codes, then
// K/32 float scales dx (x ~ dx * code, dx = max|x| / 127 over a block of 32, codes rounded to
// nearest even), then K/16 float sums of x over each 16 values, padded to 16 bytes.
__device__ __forceinline__ long long vt_q8a_stride(int K) {
    return ((long long)K + K / 8 + K / 4 + 15) / 16 * 16;
}
// After the n packed rows, for the int8 mma kernels: (dx, sum) per block of 16 values and
// row, [K / 16][n8] (n8: 64, the most rows they take, or n rounded up to 8; the padding
// rows are never written and their sums never stored), so a lane's two rows of a tile, 2t
// and 2t + 1, are one 16-byte load.
__device__ __forceinline__ int vt_q8a_n8(int n) { return n <= 64 ? 64 : (n + 7) / 8 * 8; }
__device__ __forceinline__ vt_f2* vt_q8a_pairs(unsigned char* x, int n, int K) {
    return (vt_f2*)(x + (long long)n * vt_q8a_stride(K));
}

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
    if (WT == WT_Q8A) {  // the host checked: K % 32 == 0, weight blocks of 16 or 32
        long long rs = vt_q8a_stride(K);
        const unsigned char* xb = (const unsigned char*)x + (long long)r0 * rs;
        for (int k = lane * 16; k < K; k += VT_WARP * 16) {
            vt_codes<16> wc[NW];
            vt_f2 so[NW];
#pragma unroll
            for (int i = 0; i < NW; ++i) {
                long long at = w[i].at + k;
                wc[i] = vt_qcodes<16>(w[i].data, w[i].lg, at);
                so[i] = vt_qso(w[i].sm, w[i].lg, at >> VT_Q_LG(w[i].lg));  // 16 codes, one block
            }
#pragma unroll
            for (int r = 0; r < MM_R; ++r) {
                if (r < nr) {
                    const unsigned char* row = xb + (long long)r * rs;
                    vt_codes<16> xq = *(const vt_codes<16>*)(row + k);
                    float dx = ((const float*)(row + K))[k >> 5];
                    float xsum = ((const float*)(row + K + K / 8))[k >> 4];
#pragma unroll
                    for (int i = 0; i < NW; ++i) {
                        int d = 0;
#pragma unroll
                        for (int c = 0; c < 4; ++c) d = vt_dot4((int)wc[i].w[c], (int)xq.w[c], d);
                        acc[i][r] += so[i].x * dx * (float)d + so[i].y * xsum;
                    }
                }
            }
        }
    } else if (WT == WT_Q && (K & 15) == 0 && (((unsigned long long)x) & 15ull) == 0) {
        constexpr int CH = NW <= 2 ? 16 : 8;
        for (int k = lane * CH; k < K; k += VT_WARP * CH) {
            float wv[NW][CH];
#pragma unroll
            for (int i = 0; i < NW; ++i) {
                long long at = w[i].at + k;
                vt_codes<CH> raw = vt_qcodes<CH>(w[i].data, w[i].lg, at);
                vt_f2 so = vt_qso(w[i].sm, w[i].lg, at >> VT_Q_LG(w[i].lg));  // one block
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
// Quantized weights against int8 activations (decode batches; the host packs x first).
VT_DECODE_MM(q8a, WT_Q8A, 4)
VT_DECODE_SW(q8a, WT_Q8A, 2)

// ------------------------------------------------------------------------ batch 1 (gemv)
//
// One row of x against quantized weights (WT_Q with K a multiple of 16, x, the codes and the
// pairs aligned: the host checks): a block of 64-256 threads (the host's choice by K;
// blockDim.x, at most GV_MAX_THREADS) per GV output features (1, 2 or 4), every thread of
// the block on every feature. Each thread reads 16 codes of each of the block's weight rows
// in one 128-bit load, with their (scale, offset) pair, per pass of blockDim.x * 16 values
// (K = 2048 is one pass of 128 threads), VT_GV_UNROLL passes' loads issued before any of
// their arithmetic. Why: matmul_small1 (a warp per feature) walks K in K / 512 dependent
// passes and gives the 1B shape's o projection 2,048 warps in all, too few loads in flight
// to cover the memory's latency (1.45 TB/s of 4.8, docs/gpu.md run 25). The sums: warp
// shuffles, then the block's warps in a fixed order through shared memory. Dequantization is
// vt_wload's two roundings, products and sums float32 (matmul_small1's numerics; the order of
// the sums differs).
#define GV_MAX_THREADS 256  // 256: gemv_long_threads (long rows: down)
#ifndef VT_GV_UNROLL
#define VT_GV_UNROLL 1
#endif
#ifndef VT_GV_SKIP_ZERO
#define VT_GV_SKIP_ZERO 1
#endif

// 16 codes from global memory: on NVIDIA read-only and not kept in L1 (every weight byte is
// read once a step; ld.global.nc.L1::no_allocate, sm_70+: 1B shape 804 -> 819 tok/s at batch
// 1, 135M 866 -> 888, run 29); plain loads on HIP, or where a tool defines VT_GV_L1.
#ifndef VT_GV_L1
#if !defined(VT_HIP) && !defined(VT_EMULATE)
#define VT_GV_NC 1
#endif
#endif
__device__ __forceinline__ vt_codes<16> vt_gv_load(const vt_i8* p) {
#ifdef VT_GV_NC
    vt_codes<16> c;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(c.w[0]), "=r"(c.w[1]), "=r"(c.w[2]), "=r"(c.w[3])
        : "l"(p));
    return c;
#else
    return *(const vt_codes<16>*)p;
#endif
}
__device__ __forceinline__ vt_codes<8> vt_gv_load8(const unsigned char* p) {
#ifdef VT_GV_NC
    vt_codes<8> c;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(c.w[0]), "=r"(c.w[1]) : "l"(p));
    return c;
#else
    return *(const vt_codes<8>*)p;
#endif
}

// Code conversion in the gemv kernels. I2F (an int8 code to float) runs at a quarter of the
// FP32 rate on sm_90 (16 a clock a multiprocessor). VT_GV_MAGIC=1 (off): a byte permute
// puts a code's biased byte u (0-255) under the exponent of 2^23, whose float is 2^23 + u
// exactly, and one subtraction of 2^23 + bias leaves the code: exact either way, so the
// same bits, and no I2F. Run 79 (docs/gpu.md): swiglu_gemv2_q 2% faster, qkv_rope_gemv_q
// 29% slower (registers 40 -> 48), the 1B shape -1.3%: the conversion is not the limit.
#ifndef VT_GV_MAGIC
#define VT_GV_MAGIC 0
#endif

// 16 codes of a WT_Q weight from value index at, through these loads: int8 codes, or with
// VT_GV_MAGIC each code + vt_gv_magic's bias as an unsigned byte (int8 codes with their
// sign bit flipped, 4-bit codes as stored).
__device__ __forceinline__ vt_codes<16> vt_gv_codes(const void* data, int lg, long long at) {
    if (!(VT_QF(lg) & VT_Q_NIB)) {
        vt_codes<16> c = vt_gv_load((const vt_i8*)data + at);
#if VT_GV_MAGIC
#pragma unroll
        for (int j = 0; j < 4; ++j) c.w[j] ^= 0x80808080u;
#endif
        return c;
    }
    vt_codes<8> r = vt_gv_load8((const unsigned char*)data + (at >> 4) * 8);
    vt_codes<16> c;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#if VT_GV_MAGIC
        c.w[j] = ((j >> 1) ? r.w[j & 1] >> 4 : r.w[j & 1]) & 0x0f0f0f0fu;
#else
        c.w[j] = vt_unnib(r.w[j & 1], j >> 1, lg);
#endif
    }
    return c;
}

// 2^23 + the bias of vt_gv_codes's bytes in layout lg (VT_GV_MAGIC): 128 for int8 codes, 8
// for 4-bit codes less 8 (VT_Q_NIB8), 0 for 4-bit codes as they are.
__device__ __forceinline__ float vt_gv_magic(int lg) {
    lg = VT_QF(lg);
    if (!(lg & VT_Q_NIB)) return 8388736.0f;
    return (lg & VT_Q_NIB8) ? 8388616.0f : 8388608.0f;
}

// Code j (0-3) of a word of vt_gv_codes as a float (exact either way).
__device__ __forceinline__ float vt_code_f(vt_u32 word, int j, float magic) {
#if VT_GV_MAGIC
    return __fsub_rn(__uint_as_float(__byte_perm(word, 0x4b000000u, 0x7440u | (vt_u32)j)), magic);
#else
    return (float)(int)(vt_i8)((word >> (8 * j)) & 0xffu);
#endif
}

// x as 16-bit integer codes in the gemv kernels (VT_GV_X16 = R: blocks of at least R weight
// rows; 0, never, unless the backend compiles it in: by default R = 4 in the 4-bit layouts'
// modules, GpuBackend.gemv_x16_layout_flags; run 125 on an H200, the 1B Q4_K_M shape +8.3%,
// the 135M shape +2.4%; on Q8_0 it gains nothing, docs/gpu.md). The float32 path spends
// four to five instructions a weight value (the code's byte, I2F at a quarter of the FP32
// rate, the scale's FMUL, the FFMA; ncu: the gemvs
// bound by issue, not by the memory, run 73), once per row. Here each thread rounds its 16
// values of x of a pass once for all its rows, to c = rint(x * m) with m the power of two
// that keeps every |c| <= 32767 (per 16 values: at least 15 bits of their largest value),
// and a row takes 8 dp2a (two int16 times two int8 products) for its 16 codes, then (scale *
// isum) / m (+ offset * sum(c) / m) in float32: 11 instructions for 16 values, beside the
// pass's rounding (about 50, shared by the rows). Not the exact dequantization's roundings:
// the activations rounded to 16 bits, as vt_cpu's integer decode rounds them by default (16
// bits a block of 32, VT_CPU_ACT_BITS; greedy ids those of an exact forward,
// benchmarks/act_quant_vs_float64.py, whose "16-bit per 16, a power of two" setting is this
// rounding); within the kit's bounds. A value that is not finite makes the row's sum NaN.
#ifndef VT_GV_X16
#define VT_GV_X16 0
#endif
#if VT_GV_X16 && (VT_GV_MAGIC || defined(VT_GV_FACTOR))
#error "VT_GV_X16 takes the codes as int8, without VT_GV_MAGIC's bias or VT_GV_FACTOR's sums"
#endif

// c + a.h0 * b.b0 + a.h1 * b.b1 (lo) or with bytes b2, b3 (hi): two int16 codes of x (low,
// high half of a) times two int8 weight codes, PTX dp2a; plain products on HIP (no AMD GPU
// here to measure a builtin against them).
__device__ __forceinline__ int vt_dot2_lo(vt_u32 a, vt_u32 b, int c) {
#if defined(VT_HIP)
    return c + (int)(short)(a & 0xffffu) * (int)(vt_i8)(b & 0xffu) +
           (int)(short)(a >> 16) * (int)(vt_i8)((b >> 8) & 0xffu);
#else
    return __dp2a_lo((int)a, (int)b, c);
#endif
}
__device__ __forceinline__ int vt_dot2_hi(vt_u32 a, vt_u32 b, int c) {
#if defined(VT_HIP)
    return c + (int)(short)(a & 0xffffu) * (int)(vt_i8)((b >> 16) & 0xffu) +
           (int)(short)(a >> 16) * (int)(vt_i8)(b >> 24);
#else
    return __dp2a_hi((int)a, (int)b, c);
#endif
}

// 16 values of x as 16-bit codes: c[j] holds codes 2j (low half) and 2j + 1, x ~ d * code.
struct VtX16 {
    vt_u32 c[8];
    float d;    // 1 / m, a power of two
    bool bad;   // a value is inf or NaN
};
__device__ __forceinline__ VtX16 vt_x16(const float* xv) {
    // The largest |x| by its bits (NaN's above inf's, above every finite value's), its
    // exponent taken one higher within 2^-15 of the next power of two, so that |x| * m <
    // 32767.5 rounds to at most 32767: m = 2^(141 - e) for the biased exponent e (2^14 /
    // 2^(e - 127)), e in [15, 254] so that m and d are normal floats (|x| below 2^-112
    // keeps fewer bits).
    vt_u32 mb = 0;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        vt_u32 b = __float_as_uint(xv[j]) & 0x7fffffffu;
        mb = b > mb ? b : mb;
    }
    int e = (int)((mb + 0x100u) >> 23);
    VtX16 r;
    r.bad = e >= 255;
    e = min(max(e, 15), 254);
    float m = __uint_as_float((vt_u32)(268 - e) << 23);
    r.d = __uint_as_float((vt_u32)(e - 14) << 23);
    // rint(x * m) by the float's bits: x * m + 1.5 * 2^23 holds the rounded code (ties to
    // even) in its low bits, two's complement in the low 16; a byte permute pairs them.
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        vt_u32 lo = __float_as_uint(fmaf(xv[2 * j], m, 12582912.0f));
        vt_u32 hi = __float_as_uint(fmaf(xv[2 * j + 1], m, 12582912.0f));
        r.c[j] = __byte_perm(lo, hi, 0x5410);
    }
    return r;
}

// Bring the 16 codes of w at value index at into L2 (no registers; a hint, no-op off NVIDIA).
__device__ __forceinline__ void vt_gv_prefetch(const VtRow& w, long long at) {
    vt_prefetch_l2((const char*)w.data + ((VT_QF(w.lg) & VT_Q_NIB) ? (at >> 4) * 8 : at));
}

// The scale rms_norm computes for a row of dim values, 1 / sqrt(mean(x**2) + eps), in its
// summation order, by this block of fewer threads (each takes RN_THREADS / blockDim.x of
// rms_norm's), so the two agree bit for bit: sq(j) is the sum of squares of rms_norm's
// thread t + j * blockDim.x (thread v of RN_THREADS sums x[v], x[v + RN_THREADS], ...); then
// each warp's shuffle tree and the first warp's over the warps' sums. Every thread of the
// block must call it; every thread gets the scale.
#define RN_THREADS 256
template <typename F>
__device__ __forceinline__ float vt_norm_reduce(F sq, int dim, float eps, float* red) {
    int t = threadIdx.x, lane = t % VT_WARP, warp = t / VT_WARP;
    int warps = blockDim.x / VT_WARP, per = RN_THREADS / blockDim.x;
#pragma unroll
    for (int j = 0; j < RN_THREADS / VT_WARP; ++j) {
        if (j >= per) break;
        float ss = vt_warp_sum(sq(j));
        if (lane == 0) red[warp + j * warps] = ss;  // rms_norm's warp (t + j * blockDim.x) / VT_WARP
    }
    __syncthreads();
    float r = lane < RN_THREADS / VT_WARP ? red[lane] : 0.0f;
    r = vt_warp_sum(r);
    __syncthreads();
    return 1.0f / sqrtf(r / (float)dim + eps);
}

// vt_norm_reduce of a row x in memory.
__device__ float vt_norm_scale(const float* x, int dim, float eps, float* red) {
    int t = threadIdx.x;
    auto sq = [&](int j) {
        float ss = 0.0f;
        for (int d = t + j * blockDim.x; d < dim; d += RN_THREADS)
            ss = __fadd_rn(ss, __fmul_rn(x[d], x[d]));
        return ss;
    };
    return vt_norm_reduce(sq, dim, eps, red);
}

// The deferred norm's partial sums of squares (PSQ below): np of them at psq, one a block of
// the producer. vt_psq_fetch, right after the wait, copies this thread's float4s of the
// first PSQ_MAX into shared memory (cp.async: no registers held during the products);
// vt_psq_share, at the end, sums them (float4 t, t + blockDim.x, ...; then the tail past
// them one at a time). Every block sums the same values in the same order.
#ifndef PSQ_MAX  // a tool may lower it (emulate_kernels.py -D PSQ_MAX=64: the tail's loop)
#define PSQ_MAX 2048
#endif
__device__ __forceinline__ void vt_psq_fetch(vt_f4* pqs, const float* psq, int np) {
    int n4 = min(np, PSQ_MAX) / 4;
    for (int j = threadIdx.x; j < n4; j += blockDim.x) vt_copy16_async(pqs + j, psq + 4 * j);
}
__device__ __forceinline__ float vt_psq_share(const vt_f4* pqs, const float* psq, int np) {
    vt_copy_wait();
    int n4 = min(np, PSQ_MAX) / 4;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < n4; j += blockDim.x) {
        vt_f4 a = pqs[j];
        ss += (a.x + a.y) + (a.z + a.w);
    }
    for (int r = 4 * n4 + threadIdx.x; r < np; r += blockDim.x) ss += psq[r];
    return ss;
}

struct VtNoop {
    __device__ void operator()() const {}
};

// VT_NORM_LATE=1 (GpuBackend.norm_late, or norm_fold_max_k: on by default): the NORM
// kernels below sum x's squares beside the products of (x * nw) and scale the row's sums
// at the end, so no block waits on a sum of squares before its products; the sums then
// round differently from rms_norm's launch followed by the gemv (not bit-equal; within the
// kit's tolerances). The bit-equal form (0) runs only with both settings off.
#ifndef VT_NORM_LATE
#define VT_NORM_LATE 0
#endif

// sums[i] (every thread gets them) = dequant(w[i]) . x over K, for the block's NW weight rows.
// NORM: . rms_norm(x) (weight nw, eps) instead, each value as rms_norm rounds it ((x * scale)
// * nw), so the sums equal rms_norm's launch followed by this one's; the block waits for x
// and sums its squares first, the first pass's codes prefetched into L2 meanwhile.
// after_wait(): called by every thread once the previous kernel's writes are visible, before
// the products (a caller's loads of what that kernel wrote, in flight during them).
// UR: passes whose loads a thread issues together (VT_GV_UNROLL, or the caller's).
// PSQ (the deferred norm's consumers, *_psq_gemv*): x is already x * nw, as its producer
// (matmul_psq_gemv*_q) left it, and nw holds that producer's np partial sums of x's
// squares (one a block); the block sums them (vt_psq_share) beside its products and
// scales its sums at the end, as VT_NORM_LATE does: the norm with no pass over nw here.
template <int NW, bool NORM = false, typename F = VtNoop, int UR = VT_GV_UNROLL,
          bool PSQ = false>
__device__ __forceinline__ void vt_gv_rows(const VtRow* w, const float* x, int K, float* sums,
                                           const float* nw = nullptr, float eps = 0.0f,
                                           F after_wait = F(), int np = 0) {
    static_assert(!(NORM && PSQ), "x is normalised one way");
    constexpr bool LATE = (NORM && VT_NORM_LATE) || PSQ;
    __shared__ float red[GV_MAX_THREADS / VT_WARP][NW + LATE];  // LATE: x's squares too
    __shared__ vt_f4 pqs[PSQ ? PSQ_MAX / 4 : 1];
    constexpr int U = NORM ? 1 : UR;
    int t = threadIdx.x, lane = t % VT_WARP, warp = t / VT_WARP;
    int step = blockDim.x * 16;
    float acc[NW], magic[NW];
#pragma unroll
    for (int i = 0; i < NW; ++i) acc[i] = 0.0f, magic[i] = vt_gv_magic(w[i].lg);
    float scale = 1.0f, ss = 0.0f;  // ss: LATE's share of x's squares
    constexpr bool X16 = VT_GV_X16 > 0 && NW >= VT_GV_X16;
    bool bad = false, offsets = false;  // X16: a value not finite; a row with offsets
#pragma unroll
    for (int i = 0; i < NW; ++i) offsets = offsets || !(VT_QF(w[i].lg) & VT_Q_ONE);
    if (NORM && !LATE) {
        __shared__ float nred[RN_THREADS / VT_WARP];
        if (t * 16 < K) {
#pragma unroll
            for (int i = 0; i < NW; ++i) vt_gv_prefetch(w[i], w[i].at + t * 16);
        }
        vt_grid_wait();
        after_wait();
        scale = vt_norm_scale(x, K, eps, nred);
    }
    bool waited = NORM && !LATE;
    for (int k0 = t * 16; k0 < K; k0 += U * step) {
        vt_codes<16> raw[U][NW];
        vt_f2 so[U][NW];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int k = min(k0 + u * step, K - 16);  // past K: a valid load, never used
#pragma unroll
            for (int i = 0; i < NW; ++i) {
                long long at = w[i].at + k;
                raw[u][i] = vt_gv_codes(w[i].data, w[i].lg, at);
                so[u][i] = vt_qso(w[i].sm, w[i].lg, at >> VT_Q_LG(w[i].lg));  // 16 codes, one block
            }
        }
        // Launched overlapped (common.cu): the first pass's weights are in flight while the
        // previous kernel finishes; x (its output) is read only after the wait.
        if (!waited) {
            vt_grid_wait();
            after_wait();
            if (PSQ) vt_psq_fetch(pqs, nw, np);
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int k = k0 + u * step;
            if (k < K) {
                const vt_f4* xp = (const vt_f4*)(x + k);
                float xv[16];
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    vt_f4 a = xp[c];
                    xv[4 * c] = a.x, xv[4 * c + 1] = a.y, xv[4 * c + 2] = a.z, xv[4 * c + 3] = a.w;
                }
                if (NORM) {
                    const vt_f4* np = (const vt_f4*)(nw + k);
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        vt_f4 g = np[c];
                        float gs[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            float xe = xv[4 * c + e];
                            if (LATE) ss = __fadd_rn(ss, __fmul_rn(xe, xe));
                            xv[4 * c + e] = LATE ? __fmul_rn(xe, gs[e])
                                                 : __fmul_rn(__fmul_rn(xe, scale), gs[e]);
                        }
                    }
                }
                if (X16) {
                    VtX16 xq = vt_x16(xv);
                    bad = bad || xq.bad;
                    float cs = 0.0f;  // d * sum(c), for the rows with offsets
                    if (offsets) {
                        int c = 0;
#pragma unroll
                        for (int j = 0; j < 8; ++j) c = vt_dot2_lo(xq.c[j], 0x0101u, c);
                        cs = (float)c * xq.d;
                    }
#pragma unroll
                    for (int i = 0; i < NW; ++i) {
                        int is = 0;
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            is = vt_dot2_lo(xq.c[2 * j], raw[u][i].w[j], is);
                            is = vt_dot2_hi(xq.c[2 * j + 1], raw[u][i].w[j], is);
                        }
                        float s = fmaf(so[u][i].x, (float)is * xq.d, acc[i]);
                        if (!(VT_QF(w[i].lg) & VT_Q_ONE)) s = fmaf(so[u][i].y, cs, s);
                        acc[i] = s;
                    }
                    continue;
                }
#ifdef VT_GV_FACTOR
                float xs = 0.0f;  // scale * sum(q x) + offset * sum(x): not vt_wload's roundings
#pragma unroll
                for (int j = 0; j < 16; ++j) xs += xv[j];
#endif
#pragma unroll
                for (int i = 0; i < NW; ++i) {
                    float s = acc[i];
#ifdef VT_GV_FACTOR
                    float d = 0.0f;
#endif
#pragma unroll
                    for (int j = 0; j < 16; ++j) {
                        float q = vt_code_f(raw[u][i].w[j >> 2], j & 3, magic[i]);
#ifdef VT_GV_FACTOR
                        d += q * xv[j];
#else
                        float wq = __fmul_rn(so[u][i].x, q);
                        // A layout of scales alone (VT_Q_ONE: Q8_0, Q4_0) would add +0.0
                        // here, which changes no sum (an FMA of +-0 leaves a nonzero s as it
                        // is, and s, which starts at +0, is never -0: in RN x + -x is +0), so
                        // VT_GV_SKIP_ZERO (1 by default) skips it: one instruction of about
                        // five a value in an issue-bound loop (docs/gpu.md, runs 73-76: the
                        // same bits on the H200, 1B shape +2%).
#if VT_GV_SKIP_ZERO
                        if (!(VT_QF(w[i].lg) & VT_Q_ONE))
#endif
                            wq = __fadd_rn(wq, so[u][i].y);
                        s += wq * xv[j];
#endif
                    }
#ifdef VT_GV_FACTOR
                    s += so[u][i].x * d + so[u][i].y * xs;
#endif
                    acc[i] = s;
                }
            }
        }
    }
    if (!waited) {  // threads with no pass (t * 16 >= K) wait here, before any store
        vt_grid_wait();
        after_wait();
        if (PSQ) vt_psq_fetch(pqs, nw, np);
    }
    if (PSQ) ss = vt_psq_share(pqs, nw, np);
    if (X16 && bad) {
#pragma unroll
        for (int i = 0; i < NW; ++i) acc[i] = __uint_as_float(0x7fffffffu);
    }
#pragma unroll
    for (int i = 0; i < NW; ++i) acc[i] = vt_warp_sum(acc[i]);
    if (LATE) ss = vt_warp_sum(ss);
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < NW; ++i) red[warp][i] = acc[i];
        if (LATE) red[warp][NW] = ss;
    }
    __syncthreads();
    int warps = blockDim.x / VT_WARP;
    if (LATE) {
        float q = red[0][NW];
        for (int v = 1; v < warps; ++v) q += red[v][NW];
        scale = 1.0f / sqrtf(q / (float)K + eps);
    }
#pragma unroll
    for (int i = 0; i < NW; ++i) {
        float s = red[0][i];
        for (int v = 1; v < warps; ++v) s += red[v][i];
        sums[i] = LATE ? s * scale : s;
    }
}

// matmul_norm_gemv*_q's end (every thread of every block calls it): the blocks count
// themselves done (device-wide; the last leaves count 0 for the next launch), and the last
// normalises the row of N values in out into normed as rms_norm does, bit for bit
// (vt_norm_reduce's order; out read through L2, where the other blocks' stores landed). Its
// values t, t + blockDim.x, ... (NE_KEEP of them: rows of up to 2,048 values at 128
// threads) come in one batch of loads into registers, as rms_norm keeps its own: run 91's
// first form, a dependent L2 load at a time, cost its serial tail more than the launch it
// saves (-23% at batch 1 on the 1B shape).
#define NE_KEEP 16
__device__ void vt_norm_epilogue(const float* out, float* normed, const float* nw, int N,
                                 float eps, int* count) {
    __shared__ float red[RN_THREADS / VT_WARP];
    if (!vt_last_block(count, (int)gridDim.x)) return;  // the whole block
    int t = threadIdx.x, bd = blockDim.x, per = RN_THREADS / bd;  // per: a power of two
    float keep[NE_KEEP];
#pragma unroll
    for (int m = 0; m < NE_KEEP; ++m) keep[m] = t + m * bd < N ? vt_ld_l2(out + t + m * bd) : 0.0f;
    // rms_norm's thread t + j * bd sums values t + (j + i * per) * bd for i = 0, 1, ...: the
    // kept ones (m = j + i * per < NE_KEEP) in order, then the rest of its stride.
    auto sq = [&](int j) {
        float ss = 0.0f;
#pragma unroll
        for (int m = 0; m < NE_KEEP; ++m)
            if ((m & (per - 1)) == j && t + m * bd < N) ss = __fadd_rn(ss, __fmul_rn(keep[m], keep[m]));
        for (int d = t + j * bd + NE_KEEP / per * RN_THREADS; d < N; d += RN_THREADS) {
            float v = vt_ld_l2(out + d);
            ss = __fadd_rn(ss, __fmul_rn(v, v));
        }
        return ss;
    };
    float scale = vt_norm_reduce(sq, N, eps, red);
#pragma unroll
    for (int m = 0; m < NE_KEEP; ++m)
        if (t + m * bd < N) normed[t + m * bd] = (keep[m] * scale) * nw[t + m * bd];
    for (int d = t + NE_KEEP * bd; d < N; d += bd) normed[d] = (vt_ld_l2(out + d) * scale) * nw[d];
}

// out = x @ W.T (+ bias) (+ residual: out may alias it) for one row: features GV * blockIdx.x..
// (UR passes' loads a thread in flight together: matmul_gemvu*, for long rows).
// psq (the deferred norm's producer, matmul_psq_gemv*_q): also normed[o] = out[o] * nw[o],
// not yet scaled, and psq[blockIdx.x] = the sum of the block's out[o]**2 (features in
// order, pairwise), for a *_psq_gemv* consumer to sum and scale by.
template <int GV, int UR = VT_GV_UNROLL>
__device__ void vt_gemv(float* out, const float* x, const void* data, const float* sm, int lg,
                        const float* bias, const float* residual, int N, int K,
                        float* normed = nullptr, const float* nw = nullptr,
                        float* psq = nullptr) {
    int o0 = blockIdx.x * GV;
    VtRow w[GV];
#pragma unroll
    for (int i = 0; i < GV; ++i) w[i] = {data, sm, lg, (long long)min(o0 + i, N - 1) * K};
    // Thread i < GV writes feature o0 + i: its bias (a weight) read now, its residual (an
    // earlier kernel's output) once the wait allows, both in flight during the products.
    int me = threadIdx.x, o = o0 + me;
    bool mine = me < GV && o < N;
    float b = mine && bias ? bias[o] : 0.0f, r = 0.0f;
    float g = mine && psq ? nw[o] : 0.0f;  // a weight too
    float s[GV];
    auto late = [&]() {
        if (mine && residual) r = residual[o];
    };
    vt_gv_rows<GV, false, decltype(late), UR>(w, x, K, s, nullptr, 0.0f, late);
    float v = 0.0f;
#pragma unroll
    for (int i = 0; i < GV; ++i) {
        if (me == i && mine) {
            v = bias ? s[i] + b : s[i];
            v = residual ? __fadd_rn(r, v) : v;
            out[o] = v;
        }
    }
    if (psq && me < VT_WARP) {  // the features are warp 0's first GV lanes
        float q = mine ? __fmul_rn(v, v) : 0.0f;
#pragma unroll
        for (int m = 1; m < GV; m <<= 1) q = __fadd_rn(q, VT_SHFL_XOR(q, m));
        if (mine) normed[o] = __fmul_rn(v, g);
        if (me == 0) psq[blockIdx.x] = q;
    }
}

// out = silu(x @ G.T) * (x @ U.T) for one row: gate and up rows of GV features in one pass
// (NORM: of rms_norm(x), weight nw, eps; vt_gv_rows).
// (PSQ: x is x * nw, nw the partial sums of squares, np of them: vt_gv_rows.)
template <int GV, bool NORM = false, bool PSQ = false>
__device__ void vt_swiglu_gemv(float* out, const float* x, const void* gdata, const float* gsm,
                               int glg, const void* udata, const float* usm, int ulg, int N,
                               int K, const float* nw = nullptr, float eps = 0.0f, int np = 0) {
    int o0 = blockIdx.x * GV;
    VtRow w[2 * GV];
#pragma unroll
    for (int i = 0; i < GV; ++i) {
        long long at = (long long)min(o0 + i, N - 1) * K;
        w[i] = {gdata, gsm, glg, at};
        w[GV + i] = {udata, usm, ulg, at};
    }
    float s[2 * GV];
    vt_gv_rows<2 * GV, NORM, VtNoop, VT_GV_UNROLL, PSQ>(w, x, K, s, nw, eps, VtNoop(), np);
#pragma unroll
    for (int i = 0; i < GV; ++i) {
        int o = o0 + i;
        if ((int)threadIdx.x == i && o < N) {
            float g = s[i], u = s[GV + i];
            float denom = __fadd_rn(expf(-g), 1.0f);
            out[o] = __fdiv_rn(__fmul_rn(g, u), denom);
        }
    }
}

// q, k, v for one row: GV of the Nq + Nk + Nv features per block, each of its own weight.
template <int GV>
__device__ void vt_qkv_gemv(float* q, float* k, float* v, const float* x, const void* wq,
                            const float* sq, int lgq, const float* bq, const void* wk,
                            const float* sk, int lgk, const float* bk, const void* wv,
                            const float* sv, int lgv, const float* bv, int Nq, int Nk, int Nv,
                            int K) {
    int total = Nq + Nk + Nv;
    int g0 = blockIdx.x * GV;
    VtRow w[GV];
    float* outs[GV];
    const float* biases[GV];
    int os[GV];
#pragma unroll
    for (int i = 0; i < GV; ++i) {
        int g = min(g0 + i, total - 1);
        if (g >= Nq + Nk) {
            os[i] = g - Nq - Nk, outs[i] = v, biases[i] = bv;
            w[i] = {wv, sv, lgv, (long long)os[i] * K};
        } else if (g >= Nq) {
            os[i] = g - Nq, outs[i] = k, biases[i] = bk;
            w[i] = {wk, sk, lgk, (long long)os[i] * K};
        } else {
            os[i] = g, outs[i] = q, biases[i] = bq;
            w[i] = {wq, sq, lgq, (long long)os[i] * K};
        }
    }
    int me = threadIdx.x;
    float b = 0.0f;  // thread i's bias, a weight: read before the wait
#pragma unroll
    for (int i = 0; i < GV; ++i)
        if (me == i && g0 + i < total && biases[i]) b = biases[i][os[i]];
    float s[GV];
    vt_gv_rows<GV>(w, x, K, s);
#pragma unroll
    for (int i = 0; i < GV; ++i) {
        if (me == i && g0 + i < total) outs[i][os[i]] = biases[i] ? s[i] + b : s[i];
    }
}

// matmul_gemv1_q, swiglu_gemv2_q, qkv_gemv4_q, ...: the arguments of the matching *_small
// kernels less n and rpb; swiglu_norm_gemv2_q, ...: swiglu's, then the norm's weight and eps
// (the rms_norm_swiglu op); matmul_psq_gemv2_q, ...: matmul's, then normed, the norm's
// weight and the partial sums (the deferred norm's producer; matmul_psq_gemvu2_q, ...: two
// passes' loads in flight, as matmul_gemvu*); swiglu_psq_gemv2_q, ...:
// swiglu's of x * nw, then the partial sums, their count and eps (its consumer). Launched
// overlapped (common.cu; vt_gv_rows waits).
#define VT_GEMV(GV)                                                                            \
    extern "C" __global__ void matmul_gemv##GV##_q(float* out, const float* x, const void* data, \
                                                   const float* sm, int lg_block,              \
                                                   const float* bias, const float* residual,   \
                                                   int N, int K) {                             \
        vt_launch_dependents();                                                                \
        vt_gemv<GV>(out, x, data, sm, lg_block, bias, residual, N, K);                         \
    }                                                                                          \
    extern "C" __global__ void matmul_norm_gemv##GV##_q(                                       \
        float* out, const float* x, const void* data, const float* sm, int lg_block,          \
        const float* bias, const float* residual, int N, int K, float* normed,                \
        const float* nw, float eps, int* count) {                                             \
        vt_launch_dependents();                                                                \
        vt_gemv<GV>(out, x, data, sm, lg_block, bias, residual, N, K);                         \
        vt_norm_epilogue(out, normed, nw, N, eps, count);                                      \
    }                                                                                          \
    extern "C" __global__ void matmul_gemvu##GV##_q(                                           \
        float* out, const float* x, const void* data, const float* sm, int lg_block,          \
        const float* bias, const float* residual, int N, int K) {                             \
        vt_launch_dependents();                                                                \
        vt_gemv<GV, 2>(out, x, data, sm, lg_block, bias, residual, N, K);                      \
    }                                                                                          \
    extern "C" __global__ void swiglu_gemv##GV##_q(                                            \
        float* out, const float* x, const void* gdata, const float* gsm, int glg,             \
        const void* udata, const float* usm, int ulg, int N, int K) {                         \
        vt_launch_dependents();                                                                \
        vt_swiglu_gemv<GV>(out, x, gdata, gsm, glg, udata, usm, ulg, N, K);                    \
    }                                                                                          \
    extern "C" __global__ void qkv_gemv##GV##_q(                                               \
        float* q, float* k, float* v, const float* x, const void* wq, const float* sq,        \
        int lgq, const float* bq, const void* wk, const float* sk, int lgk, const float* bk,  \
        const void* wv, const float* sv, int lgv, const float* bv, int Nq, int Nk, int Nv,    \
        int K) {                                                                               \
        vt_launch_dependents();                                                                \
        vt_qkv_gemv<GV>(q, k, v, x, wq, sq, lgq, bq, wk, sk, lgk, bk, wv, sv, lgv, bv, Nq, Nk, \
                        Nv, K);                                                                \
    }                                                                                          \
    extern "C" __global__ void swiglu_norm_gemv##GV##_q(                                       \
        float* out, const float* x, const void* gdata, const float* gsm, int glg,             \
        const void* udata, const float* usm, int ulg, int N, int K, const float* nw,          \
        float eps) {                                                                           \
        vt_launch_dependents();                                                                \
        vt_swiglu_gemv<GV, true>(out, x, gdata, gsm, glg, udata, usm, ulg, N, K, nw, eps);     \
    }                                                                                          \
    extern "C" __global__ void matmul_psq_gemv##GV##_q(                                        \
        float* out, const float* x, const void* data, const float* sm, int lg_block,          \
        const float* bias, const float* residual, int N, int K, float* normed,                \
        const float* nw, float* psq) {                                                        \
        vt_launch_dependents();                                                                \
        vt_gemv<GV>(out, x, data, sm, lg_block, bias, residual, N, K, normed, nw, psq);        \
    }                                                                                          \
    extern "C" __global__ void matmul_psq_gemvu##GV##_q(                                       \
        float* out, const float* x, const void* data, const float* sm, int lg_block,          \
        const float* bias, const float* residual, int N, int K, float* normed,                \
        const float* nw, float* psq) {                                                        \
        vt_launch_dependents();                                                                \
        vt_gemv<GV, 2>(out, x, data, sm, lg_block, bias, residual, N, K, normed, nw, psq);     \
    }                                                                                          \
    extern "C" __global__ void swiglu_psq_gemv##GV##_q(                                        \
        float* out, const float* x, const void* gdata, const float* gsm, int glg,             \
        const void* udata, const float* usm, int ulg, int N, int K, const float* psq, int np, \
        float eps) {                                                                           \
        vt_launch_dependents();                                                                \
        vt_swiglu_gemv<GV, false, true>(out, x, gdata, gsm, glg, udata, usm, ulg, N, K, psq,   \
                                        eps, np);                                              \
    }
VT_GEMV(1)
VT_GEMV(2)
VT_GEMV(4)

// A warp's block of 32 values (lane j: value 32 * bc + j of row r) into out, as the int8
// kernels read it: the codes, dx = max |v| / 127, the sums of each 16 (shuffles over each
// 16 lanes, every lane the same bits), and the mma kernels' (dx, sum) pairs.
__device__ __forceinline__ void vt_q8a_block(unsigned char* out, int n, int K, int r, int bc,
                                             float v) {
    int lane = threadIdx.x % 32;
    float amax = fabsf(v), s = v;
    for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, VT_SHFL_XOR(amax, m));
    for (int m = 8; m > 0; m >>= 1) s += VT_SHFL_XOR(s, m);  // over each 16 lanes
    float dx = amax / 127.0f;
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    unsigned char* row = out + (long long)r * vt_q8a_stride(K);
    row[bc * 32 + lane] = (unsigned char)(vt_i8)(int)rintf(v * inv);
    if ((lane & 15) == 0) {
        int h = 2 * bc + lane / 16;  // the block of 16
        ((float*)(row + K + K / 8))[h] = s;
        if (lane == 0) ((float*)(row + K))[bc] = dx;
        vt_f2* pairs = vt_q8a_pairs(out, n, K);
        pairs[(long long)h * vt_q8a_n8(n) + r] = {dx, s};
    }
}

// x[n, K] float32 -> packed int8 rows for the WT_Q8A decode kernels (see vt_q8a_stride),
// then, after the n rows, the int8 mma kernels' pairs (vt_q8a_pairs): a group of 32 lanes
// per block of 32 values, a lane per value (the max and the sums by shuffles); grid
// (ceil(K / 256), n), 256 threads.
// Launched overlapped with GpuBackend.overlap_mma (common.cu): x read after vt_grid_wait.
extern "C" __global__ void quantize_rows(unsigned char* out, const float* x, int n, int K) {
    vt_launch_dependents();
    int b = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (b >= K / 32) return;  // the whole warp: every shuffle keeps its warp
    int r = blockIdx.y;
    vt_grid_wait();
    vt_q8a_block(out, n, K, r, b, x[(long long)r * K + b * 32 + threadIdx.x % 32]);
}

// rms_norm then quantize_rows in one launch (GpuBackend.norm_quantize: the norm ops at
// 8-64 rows, before their int8 mma kernels): a block of blockDim threads (a multiple of
// 32) per row computes the scale and each value as rms_norm does, with the same sums in
// the same order (vt_rn_scale, rms_norm's own), so the values
// are its bits; a warp's 32 consecutive values (t, t + blockDim, ...) are then one block
// of 32, quantized as quantize_rows quantizes it (the same shuffles): out holds the bytes
// those two launches leave. K % 32 == 0. Launched overlapped with GpuBackend.overlap_mma:
// the norm's weights read before vt_grid_wait, x after.
// gridDim.y > 1 (GpuBackend.norm_quantize_values): block (r, c) packs only chunk c of the
// row's blocks of 32 (ceil(K / 32 / gridDim.y) of them), each block computing the row's
// scale itself (the same sums: the same bits), so the quantization's shuffles are spread
// over gridDim.y blocks.
extern "C" __global__ void quantize_norm_rows(unsigned char* out, const float* x,
                                              const float* w, int n, int K, float eps) {
    __shared__ float red[256];
    int t = threadIdx.x, bd = blockDim.x, r = blockIdx.x;
    int per = (K / 32 + gridDim.y - 1) / gridDim.y * 32, lo = blockIdx.y * per;
    int hi = min(lo + per, K);
    const float* xr = x + (long long)r * K;
    float keep[RN_KEEP], wk[RN_KEEP];
    vt_launch_dependents();
#pragma unroll
    for (int i = 0; i < RN_KEEP; ++i) {
        int d = t + i * bd;
        wk[i] = d >= lo && d < hi ? w[d] : 0.0f;
    }
    vt_grid_wait();
    float scale = vt_rn_scale(xr, K, eps, keep, red);
    // A warp's 32 values are one block of 32, all in the chunk or none (per % 32 == 0,
    // K % 32 == 0), so every shuffle has its whole warp.
#pragma unroll
    for (int i = 0; i < RN_KEEP; ++i) {
        int d = t + i * bd, d0 = d - t % 32;
        if (d0 >= lo && d0 < hi) vt_q8a_block(out, n, K, r, d / 32, (keep[i] * scale) * wk[i]);
    }
    for (int d = t + RN_KEEP * bd; d - t % 32 < hi; d += bd)
        if (d - t % 32 >= lo) vt_q8a_block(out, n, K, r, d / 32, (xr[d] * scale) * w[d]);
}

// ------------------------------------------------------------------------ int8 mma
//
// Decode steps of 8-64 rows on int8 activations, on the tensor cores: mma.sync
// m16n8k32 (weights in blocks of 32) or m16n8k16 (blocks of 16: Q6_K) with s8 inputs and
// s32 sums, sm_80 and later. A block computes 16 output features (of one weight; of the
// gate and the up weight for swiglu) for every row of x, in NT tiles of 8 rows, its
// WARPS warps taking the K blocks in turn (U blocks a warp in one go, their loads issued
// together), so each weight byte is read from memory once for all rows; the warps' sums
// meet in shared memory (a fixed order) for the epilogue. Per K block of 32 (16) values the
// integer sum of codes is scaled as the dp4a path scales it: scale_w * dx * isum +
// offset_w * sum(x) (x's sums over the block from quantize_rows), accumulated in float32.
// Weights are the A operand (16 feature rows), x the B operand (8 rows): a lane (g, t) =
// (lane / 4, lane % 4) holds A rows g and g + 8 and B row g; K is permuted within a block
// (the dot product does not care) so that a lane's share of a row is one 8-byte (4-byte)
// load: logical 4-byte units t and 4 + t of the PTX fragment are bytes [8t, 8t + 8).
// Without sm_80 (older NVIDIA parts, HIP: no AMD GPU here, never run) vt_mma_* compute the
// same sums from warp shuffles and 4-way dot products; the host picks these kernels only
// where the tensor cores have them (GpuBackend.int8_mma).
#if !defined(VT_HIP) && !defined(VT_EMULATE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define VT_MMA_NATIVE 1
#endif

// c[4] += A (16 x 16, a[2]: rows g and g + 8, unit t) B (16 x 8, b[0]: column g, unit t).
__device__ __forceinline__ void vt_mma_k16(int* c, const vt_u32* a, const vt_u32* b) {
#ifdef VT_MMA_NATIVE
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(b[0]));
#else
    int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        int ga = g * 4 + s, n0 = 8 * t + s, n1 = 8 * t + 4 + s;
        int a0 = (int)VT_SHFL32((int)a[0], ga), a1 = (int)VT_SHFL32((int)a[1], ga);
        int b0 = (int)VT_SHFL32((int)b[0], n0), b1 = (int)VT_SHFL32((int)b[0], n1);
        c[0] = vt_dot4(a0, b0, c[0]);
        c[1] = vt_dot4(a0, b1, c[1]);
        c[2] = vt_dot4(a1, b0, c[2]);
        c[3] = vt_dot4(a1, b1, c[3]);
    }
#endif
}

// c[4] += A (16 x 32, a[4]) B (32 x 8, b[2]): PTX's fragments of mma.m16n8k32 .s8: a[0] row
// g units t, a[1] row g + 8 unit t, a[2] row g unit 4 + t, a[3] row g + 8 unit 4 + t; b[0]
// column g unit t, b[1] unit 4 + t; c[0], c[1] row g columns 2t, 2t + 1, c[2], c[3] row g + 8.
// Without the instruction: units t and 4 + t as two k16 products (integer sums: the same).
__device__ __forceinline__ void vt_mma_k32(int* c, const vt_u32* a, const vt_u32* b) {
#ifdef VT_MMA_NATIVE
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    vt_mma_k16(c, a + 2, b + 1);
    vt_mma_k16(c, a, b);
#endif
}

// K blocks a warp loads in one go: more for fewer tiles of x (less work a block, so more
// loads in flight to cover the memory's latency), within the registers. (A tool may
// define them before the source: bench_variant.py --kdefine.)
#ifndef VT_MMA_U1
#define VT_MMA_U1 4  // 1 or 2 tiles of 8 rows
#endif
#ifndef VT_MMA_U4
#define VT_MMA_U4 4  // 4 tiles (17-32 rows); 2 until run 57 (matmul_mma4_q8a +30% on Q8_0)
#endif
#ifndef VT_MMA_U8
#define VT_MMA_U8 1
#endif
#define MMA_U(NT) ((NT) >= 8 ? VT_MMA_U8 : (NT) >= 4 ? VT_MMA_U4 : VT_MMA_U1)
#ifndef VT_MMA_SKIP_ZERO
#define VT_MMA_SKIP_ZERO 1  // since run 119 (docs/gpu.md, twenty-fourth session)
#endif

// acc[m][j][e] += this warp's K blocks, of blocks [kb_lo, kb_hi), of weight m's rows (ra,
// rb) against x's tile j (weight m in layout lgs[m]; every weight's blocks KB values).
template <int KB, int MT, int NT, int WARPS>
__device__ __forceinline__ void vt_mma_loop(float (*acc)[NT][4], const vt_i8* const* wd,
                                            const float* const* ws, const int* lgs, long long ra,
                                            long long rb, const unsigned char* x, int n, int K,
                                            int kb_lo, int kb_hi) {
    constexpr int CW = KB / 4;  // a lane's codes of a row per K block: 8 (k32) or 4 (k16)
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int g = lane >> 2, t = lane & 3;
    long long rs = vt_q8a_stride(K);
    int n8 = vt_q8a_n8(n);
    const vt_f2* pairs = vt_q8a_pairs((unsigned char*)x, n, K);
    constexpr int U = MMA_U(NT);
    bool waited = false;
    // VT_MMA_SKIP_ZERO (1 by default; run 116 alone: the 1B shape +3% to +4% at batches 8 and
    // 32, the 135M shape within noise, H100): where every weight's layout has
    // scales alone (VT_Q_ONE: Q8_0, Q4_0; known at compile time in a layout's module), the
    // + offset * sum(x) term is + 0 * a finite sum, which changes no sum (as
    // VT_GV_SKIP_ZERO's argument), so it and the second pair load of x's sums are left
    // out; the product is kept unfused with the sum (__fmul_rn), as before: the same bits.
    bool one = VT_MMA_SKIP_ZERO != 0;
#pragma unroll
    for (int m = 0; m < MT; ++m) one = one && (VT_QF(lgs[m]) & VT_Q_ONE);
    for (int kb0 = kb_lo + warp * U; kb0 < kb_hi; kb0 += WARPS * U) {
        vt_u32 a[U][MT][4];
        vt_f2 sa[U][MT], sb[U][MT];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int kb = min(kb0 + u, kb_hi - 1);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                long long ia = ra * K + (long long)kb * KB, ib = rb * K + (long long)kb * KB;
                int lg = lgs[m];
                if (KB == 32) {
                    vt_codes<8> va = vt_qcodes<8>(wd[m], lg, ia + t * CW);
                    vt_codes<8> vb = vt_qcodes<8>(wd[m], lg, ib + t * CW);
                    a[u][m][0] = va.w[0], a[u][m][2] = va.w[1];
                    a[u][m][1] = vb.w[0], a[u][m][3] = vb.w[1];
                } else {
                    a[u][m][0] = vt_qcodes<4>(wd[m], lg, ia + t * CW).w[0];
                    a[u][m][1] = vt_qcodes<4>(wd[m], lg, ib + t * CW).w[0];
                }
                sa[u][m] = vt_qso(ws[m], lg, ia >> VT_Q_LG(lg));
                sb[u][m] = vt_qso(ws[m], lg, ib >> VT_Q_LG(lg));
            }
        }
        if (!waited) vt_grid_wait(), waited = true;  // the first weights on their way: x next
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int kb = kb0 + u;
            if (kb < kb_hi) {  // the same for the whole warp
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const unsigned char* xb = x + (long long)min(j * 8 + g, n - 1) * rs;
                    vt_u32 b[2];
                    if (KB == 32) {
                        vt_codes<8> vx = *(const vt_codes<8>*)(xb + kb * KB + t * CW);
                        b[0] = vx.w[0], b[1] = vx.w[1];
                    } else {
                        b[0] = *(const vt_u32*)(xb + kb * KB + t * CW);
                    }
                    // x rows 2t and 2t + 1 of the tile: their scale and sum over the block
                    const vt_f4* pr = (const vt_f4*)(pairs + (long long)(kb * KB / 16) * n8 +
                                                     j * 8 + 2 * t);  // fmt: skip
                    vt_f4 p0 = pr[0];
                    float dx[2] = {p0.x, p0.z}, xs[2] = {p0.y, p0.w};
                    if (KB == 32 && !one) {
                        vt_f4 p1 = pr[n8 / 2];  // the second block of 16
                        xs[0] += p1.y, xs[1] += p1.w;
                    }
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        int c[4] = {0, 0, 0, 0};
                        if (KB == 32) vt_mma_k32(c, a[u][m], b);
                        else vt_mma_k16(c, a[u][m], b);
                        if (one) {  // scales alone: the offsets' + 0 * sum(x) left out
                            acc[m][j][0] += __fmul_rn(sa[u][m].x * dx[0], (float)c[0]);
                            acc[m][j][1] += __fmul_rn(sa[u][m].x * dx[1], (float)c[1]);
                            acc[m][j][2] += __fmul_rn(sb[u][m].x * dx[0], (float)c[2]);
                            acc[m][j][3] += __fmul_rn(sb[u][m].x * dx[1], (float)c[3]);
                            continue;
                        }
                        acc[m][j][0] += sa[u][m].x * dx[0] * (float)c[0] + sa[u][m].y * xs[0];
                        acc[m][j][1] += sa[u][m].x * dx[1] * (float)c[1] + sa[u][m].y * xs[1];
                        acc[m][j][2] += sb[u][m].x * dx[0] * (float)c[2] + sb[u][m].y * xs[0];
                        acc[m][j][3] += sb[u][m].x * dx[1] * (float)c[3] + sb[u][m].y * xs[1];
                    }
                }
            }
        }
    }
}

// MODE 0: out = x @ W.T (+ bias) (+ residual: out may alias it); 1: out = silu(x @ G.T) *
// (x @ U.T) (weights 0 and 1, the same block size, each in its own layout); 2: q, k, v of
// weights 0, 1, 2 over N0 + N1 + N2 features (the host checks N0 and N1 are multiples of
// 16, so a block's 16 features are one weight's). x: quantize_rows's packed rows.
// K split (gridDim.y = S > 1, GpuBackend.mma_split_blocks): block (b, s) sums the K blocks
// of slice s (ceil(K blocks / S) each) and writes its warps' sums to part[b][s]; the last
// of the S blocks of b to finish (counts[b], zero before, left zero) adds the slices' sums
// in order s = 0..S-1 and runs the epilogue. The same sums whichever block is last, not
// the unsplit kernel's bits (its warps' sums over the whole K, then added): within the
// kit's bounds, as every int8 path is. Launched overlapped (GpuBackend.overlap_mma), a
// warp's first K blocks of weights are on their way before vt_grid_wait; x, the residual
// and the split's scratch are read after it.
template <int MODE, int NT>
__device__ void vt_mma_op(float* o0, float* o1, float* o2, const unsigned char* x,
                          const vt_i8* w0, const float* s0, int lg0, const float* b0,
                          const vt_i8* w1, const float* s1, int lg1, const float* b1,
                          const vt_i8* w2, const float* s2, int lg2, const float* b2,
                          const float* residual, int n, int N0, int N1, int N2, int K,
                          float* part, int* counts) {
    constexpr int MT = MODE == 1 ? 2 : 1;
    constexpr int E = MT * NT * 4;
    constexpr int WARPS = E <= 32 ? 8 : 4;  // the host launches 32 * WARPS threads
    int f = blockIdx.x * 16;
    const vt_i8* wd[MT];
    const float* ws[MT];
    int lgs[MT];
    int N = N0;
    float* out = o0;
    const float* bias = b0;
    wd[0] = w0, ws[0] = s0, lgs[0] = lg0;
    if (MODE == 1) wd[MT - 1] = w1, ws[MT - 1] = s1, lgs[MT - 1] = lg1;
    if (MODE == 2 && f >= N0 + N1) {
        f -= N0 + N1, wd[0] = w2, ws[0] = s2, lgs[0] = lg2, N = N2, out = o2, bias = b2;
    } else if (MODE == 2 && f >= N0) {
        f -= N0, wd[0] = w1, ws[0] = s1, lgs[0] = lg1, N = N1, out = o1, bias = b1;
    }
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int g = lane >> 2;
    long long ra = min(f + g, N - 1), rb = min(f + g + 8, N - 1);
    vt_launch_dependents();
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][j][e] = 0.0f;
    int S = (int)gridDim.y, kb_all = VT_Q_LG(lgs[0]) == 5 ? K / 32 : K / 16;
    int per = (kb_all + S - 1) / S, kb_lo = min((int)blockIdx.y * per, kb_all);
    int kb_hi = min(kb_lo + per, kb_all);
    if (VT_Q_LG(lgs[0]) == 5)
        vt_mma_loop<32, MT, NT, WARPS>(acc, wd, ws, lgs, ra, rb, x, n, K, kb_lo, kb_hi);
    else vt_mma_loop<16, MT, NT, WARPS>(acc, wd, ws, lgs, ra, rb, x, n, K, kb_lo, kb_hi);
    vt_grid_wait();  // a warp without K blocks waits here, before the epilogue's reads
    __shared__ float red[WARPS][E][32];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) red[warp][(m * NT + j) * 4 + e][lane] = acc[m][j][e];
    __syncthreads();
    constexpr int PE = NT * 4 * 32;  // a block's sums a weight: part[b][s][m][PE]
    const float* all = S > 1 ? part + (long long)blockIdx.x * S * MT * PE : part;
    if (S > 1) {  // this slice's sums out; the last of the block's slices goes on
        float* mine = part + ((long long)blockIdx.x * S + blockIdx.y) * MT * PE;
        for (int it = threadIdx.x; it < PE; it += WARPS * 32) {
            int L = it % 32, e = (it / 32) % 4, j = it / 128;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                float s = 0.0f;
                for (int w = 0; w < WARPS; ++w) s += red[w][(m * NT + j) * 4 + e][L];
                mine[m * PE + it] = s;
            }
        }
        if (!vt_last_block(counts + blockIdx.x, S)) return;
    }
    for (int it = threadIdx.x; it < PE; it += WARPS * 32) {
        int L = it % 32, e = (it / 32) % 4, j = it / 128;
        int o = f + (L >> 2) + 8 * (e >> 1), row = j * 8 + 2 * (L & 3) + (e & 1);
        float v[MT];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            float s = 0.0f;
            if (S > 1) {
                for (int z = 0; z < S; ++z) s += vt_ld_l2(all + ((long long)z * MT + m) * PE + it);
            } else {
                for (int w = 0; w < WARPS; ++w) s += red[w][(m * NT + j) * 4 + e][L];
            }
            v[m] = s;
        }
        if (row < n && o < N) {
            long long at = (long long)row * N + o;
            if (MODE == 1) {
                float gv = v[0], uv = v[MT - 1];
                float denom = __fadd_rn(expf(-gv), 1.0f);
                out[at] = __fdiv_rn(__fmul_rn(gv, uv), denom);
            } else {
                float val = bias ? v[0] + bias[o] : v[0];
                out[at] = residual ? __fadd_rn(residual[at], val) : val;
            }
        }
    }
}

// Per NO (tiles of 8 rows: 1, 2, 4, 8): matmul_mma1_q8a, swiglu_mma2_q8a, qkv_mma4_q8a, ...
// with the arguments of the matching *_small kernels less rpb.
#define VT_DECODE_MMA(SUFFIX, NO)                                                             \
    extern "C" __global__ void matmul_mma##NO##_##SUFFIX(                                     \
        float* out, const unsigned char* x, const vt_i8* data, const float* sm, int lg_block, \
        const float* bias, const float* residual, int n, int N, int K, float* part,           \
        int* counts) {                                                                         \
        vt_mma_op<0, NO>(out, out, out, x, data, sm, lg_block, bias, data, sm, lg_block, bias, \
                         data, sm, lg_block, bias, residual, n, N, 0, 0, K, part, counts);     \
    }                                                                                          \
    extern "C" __global__ void swiglu_mma##NO##_##SUFFIX(                                     \
        float* out, const unsigned char* x, const vt_i8* gdata, const float* gsm, int glg,    \
        const vt_i8* udata, const float* usm, int ulg, int n, int N, int K, float* part,      \
        int* counts) {                                                                         \
        vt_mma_op<1, NO>(out, out, out, x, gdata, gsm, glg, 0, udata, usm, ulg, 0, udata, usm, \
                         ulg, 0, 0, n, N, 0, 0, K, part, counts);                              \
    }                                                                                          \
    extern "C" __global__ void qkv_mma##NO##_##SUFFIX(                                        \
        float* q, float* k, float* v, const unsigned char* x, const vt_i8* wq,                \
        const float* sq, int lgq, const float* bq, const vt_i8* wk, const float* sk, int lgk, \
        const float* bk, const vt_i8* wv, const float* sv, int lgv, const float* bv, int n,   \
        int Nq, int Nk, int Nv, int K, float* part, int* counts) {                             \
        vt_mma_op<2, NO>(q, k, v, x, wq, sq, lgq, bq, wk, sk, lgk, bk, wv, sv, lgv, bv, 0, n,  \
                         Nq, Nk, Nv, K, part, counts);                                         \
    }
VT_DECODE_MMA(q8a, 1)
VT_DECODE_MMA(q8a, 2)
VT_DECODE_MMA(q8a, 4)
VT_DECODE_MMA(q8a, 8)
