
// ------------------------------------------------- matmul: 2-7 rows, tiled (no BLAS)

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
