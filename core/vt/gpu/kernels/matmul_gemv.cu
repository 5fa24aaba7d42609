
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
