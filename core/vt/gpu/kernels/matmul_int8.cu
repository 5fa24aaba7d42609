
// --------------------------------------------- int8 activations: quantize_rows, dp4a

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
#define VT_MMA_U8 2  // 8 tiles (33-64 rows, no BLAS); 1 until run 159 (+16-18% on the 1B shape)
#endif
#define MMA_U(NT) ((NT) >= 8 ? VT_MMA_U8 : (NT) >= 4 ? VT_MMA_U4 : VT_MMA_U1)
#ifndef VT_MMA_SKIP_ZERO
#define VT_MMA_SKIP_ZERO 1  // since run 119 (docs/gpu.md, twenty-fourth session)
#endif

// acc[m][j][e] += K block kb's products of weight m's rows (fragments a[m], scales sa[m] of
// rows g, sb[m] of g + 8) with x's tile j, each scaled as the dp4a path scales it.
template <int KB, int MT, int NT>
__device__ __forceinline__ void vt_mma_kblock(float (*acc)[NT][4], const vt_u32 (*a)[4],
                                              const vt_f2* sa, const vt_f2* sb,
                                              const unsigned char* x, int n, long long rs,
                                              const vt_f2* pairs, int n8, int kb, bool one) {
    constexpr int CW = KB / 4;  // a lane's codes of a row per K block: 8 (k32) or 4 (k16)
    int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
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
        const vt_f4* pr = (const vt_f4*)(pairs + (long long)(kb * KB / 16) * n8 + j * 8 + 2 * t);
        vt_f4 p0 = pr[0];
        float dx[2] = {p0.x, p0.z}, xs[2] = {p0.y, p0.w};
        if (KB == 32 && !one) {
            vt_f4 p1 = pr[n8 / 2];  // the second block of 16
            xs[0] += p1.y, xs[1] += p1.w;
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            int c[4] = {0, 0, 0, 0};
            if (KB == 32) vt_mma_k32(c, a[m], b);
            else vt_mma_k16(c, a[m], b);
            if (one) {  // scales alone: the offsets' + 0 * sum(x) left out
                acc[m][j][0] += __fmul_rn(sa[m].x * dx[0], (float)c[0]);
                acc[m][j][1] += __fmul_rn(sa[m].x * dx[1], (float)c[1]);
                acc[m][j][2] += __fmul_rn(sb[m].x * dx[0], (float)c[2]);
                acc[m][j][3] += __fmul_rn(sb[m].x * dx[1], (float)c[3]);
                continue;
            }
            acc[m][j][0] += sa[m].x * dx[0] * (float)c[0] + sa[m].y * xs[0];
            acc[m][j][1] += sa[m].x * dx[1] * (float)c[1] + sa[m].y * xs[1];
            acc[m][j][2] += sb[m].x * dx[0] * (float)c[2] + sb[m].y * xs[0];
            acc[m][j][3] += sb[m].x * dx[1] * (float)c[3] + sb[m].y * xs[1];
        }
    }
}

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
                vt_mma_kblock<KB, MT, NT>(acc, a[u], sa[u], sb[u], x, n, rs, pairs, n8, kb, one);
            }
        }
    }
}

// VT_MMA_STAGE (0: off): a warp's round of weight codes goes through shared memory. Run 167's
// ncu (1B shape, batch 8, H100): the loop above reaches 2.1 TB/s on the output projection
// where the batch-1 gemv reaches 2.9, both latency-bound (long_scoreboard), and its L1 sends
// L2 three times the requests (l1tex2xbar 19.9% against 6.3%): each 8-byte load of a lane
// takes one 32-byte sector of 8 rows, so a request carries 32 bytes. Here the warp copies
// its 16 rows' U K blocks in 16-byte pieces, 8 lanes a 128-byte line (cp.async.cg, past
// L1), then each lane reads the same bytes of its rows as above from shared memory: the
// same fragments, so the same sums and bits. The codes leave the registers while the copies
// fly (the a[] above are U * MT * 4 registers), and the scales come in 4 times fewer loads
// (below). GpuBackend.mma_stage sets it (1: on).
#ifndef VT_MMA_STAGE
#define VT_MMA_STAGE 0
#endif
// bytes a staged row takes in shared memory: U K blocks of int8 codes (the most a layout
// has) and a pad that puts rows g and g + 1 eight banks apart (8-byte reads, conflict-free)
template <int KB, int U>
struct VtMmaStage {
    static constexpr int RS = U * KB + (U * KB >= 128 ? 32 : 16);
};

// a float from lane src of the caller's 32, by its bits
__device__ __forceinline__ float vt_shfl32f(float v, int src) {
    return __uint_as_float((vt_u32)VT_SHFL32((int)__float_as_uint(v), src));
}

template <int KB, int MT, int NT, int WARPS>
__device__ __forceinline__ void vt_mma_loop_staged(float (*acc)[NT][4], const vt_i8* const* wd,
                                                   const float* const* ws, const int* lgs,
                                                   int f, int N, const unsigned char* x, int n,
                                                   int K, int kb_lo, int kb_hi,
                                                   unsigned char* stage) {
    constexpr int CW = KB / 4;
    constexpr int U = MMA_U(NT);
    constexpr int RS = VtMmaStage<KB, U>::RS;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int g = lane >> 2, t = lane & 3;
    long long rs = vt_q8a_stride(K);
    int n8 = vt_q8a_n8(n);
    const vt_f2* pairs = vt_q8a_pairs((unsigned char*)x, n, K);
    unsigned char* mine = stage + (long long)warp * MT * 16 * RS;
    long long ra = min(f + g, N - 1), rb = min(f + g + 8, N - 1);
    bool waited = false;
    bool one = VT_MMA_SKIP_ZERO != 0;
#pragma unroll
    for (int m = 0; m < MT; ++m) one = one && (VT_QF(lgs[m]) & VT_Q_ONE);
    for (int kb0 = kb_lo + warp * U; kb0 < kb_hi; kb0 += WARPS * U) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            int sh = (VT_QF(lgs[m]) & VT_Q_NIB) ? 1 : 0;  // bytes = values >> sh
            int span = (U * KB) >> sh, cpr = span / 16;     // a row's bytes, 16-byte pieces
            // the last piece of the slice's K blocks in a row: pieces past it (K blocks this
            // round skips) copy that one instead, never a byte past the slice
            int last = ((kb_hi - kb0) * KB >> sh) - 16;
            for (int c = lane; c < 16 * cpr; c += 32) {
                int r = c / cpr, q = c - r * cpr;
                long long row = min(f + r, N - 1);
                const unsigned char* src = (const unsigned char*)wd[m] +
                                           ((row * K + (long long)kb0 * KB) >> sh) +
                                           min(q * 16, last);  // fmt: skip
                vt_copy16_async<false>(mine + (m * 16 + r) * RS + q * 16, src);
            }
        }
        // the scales in 4 times fewer requests: lane t loads K block u = t (of each 4) of its
        // rows g and g + 8, 4 consecutive scales of a row a request, and the warp's shuffles
        // hand lane (g, t') the 4 (the values vt_mma_loop loads one by one)
        vt_f2 sa[U][MT], sb[U][MT];
#pragma unroll
        for (int u0 = 0; u0 < U; u0 += 4) {
            int kb = min(kb0 + u0 + t, kb_hi - 1);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                long long ia = ra * K + (long long)kb * KB, ib = rb * K + (long long)kb * KB;
                vt_f2 ma = vt_qso(ws[m], lgs[m], ia >> VT_Q_LG(lgs[m]));
                vt_f2 mb = vt_qso(ws[m], lgs[m], ib >> VT_Q_LG(lgs[m]));
#pragma unroll
                for (int u = u0; u < U && u < u0 + 4; ++u) {
                    int from = g * 4 + (u - u0);
                    sa[u][m].x = vt_shfl32f(ma.x, from), sb[u][m].x = vt_shfl32f(mb.x, from);
                    sa[u][m].y = one ? 0.0f : vt_shfl32f(ma.y, from);
                    sb[u][m].y = one ? 0.0f : vt_shfl32f(mb.y, from);
                }
            }
        }
        if (!waited) vt_grid_wait(), waited = true;  // the first weights on their way: x next
        vt_copy_wait();
        VT_SYNC32();
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int kb = kb0 + u;
            if (kb < kb_hi) {  // the same for the whole warp
                vt_u32 a[MT][4];
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const unsigned char* rg = mine + (m * 16 + g) * RS;
                    int at = u * KB + t * CW;  // the value index in the staged rows
                    if (KB == 32) {
                        vt_codes<8> va = vt_qcodes<8>(rg, lgs[m], at);
                        vt_codes<8> vb = vt_qcodes<8>(rg + 8 * RS, lgs[m], at);
                        a[m][0] = va.w[0], a[m][2] = va.w[1];
                        a[m][1] = vb.w[0], a[m][3] = vb.w[1];
                    } else {
                        a[m][0] = vt_qcodes<4>(rg, lgs[m], at).w[0];
                        a[m][1] = vt_qcodes<4>(rg + 8 * RS, lgs[m], at).w[0];
                    }
                }
                vt_mma_kblock<KB, MT, NT>(acc, a, sa[u], sb[u], x, n, rs, pairs, n8, kb, one);
            }
        }
        VT_SYNC32();  // every lane's reads done before the next round's copies land
    }
}

// What MODE 3's epilogue needs for RoPE and the KV store (rope_kv_store's arguments).
struct VtRopeKv {
    const int* positions;
    const int* slots;
    float* cache;
    int head_dim, n_slots, n_layers, max_len, layer;
};

// MODE 0: out = x @ W.T (+ bias) (+ residual: out may alias it); 1: out = silu(x @ G.T) *
// (x @ U.T) (weights 0 and 1, the same block size, each in its own layout); 2: q, k, v of
// weights 0, 1, 2 over N0 + N1 + N2 features (the host checks N0 and N1 are multiples of
// 16, so a block's 16 features are one weight's); 3: 2, then rope_kv_store's work in the
// epilogue (pairs (2i, 2i + 1) only: the host checks the style), q and k rotated and k
// and v stored into the cache, with rope_kv_store's roundings: its bits, one launch fewer.
// x: quantize_rows's packed rows.
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
                          float* part, int* counts, const VtRopeKv* rk = nullptr,
                          const RopeTable* table = nullptr) {
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
    int kind = 0;  // MODE 2 and 3: the block's weight, 0 q, 1 k, 2 v
    if (MODE >= 2 && f >= N0 + N1) {
        f -= N0 + N1, wd[0] = w2, ws[0] = s2, lgs[0] = lg2, N = N2, out = o2, bias = b2;
        kind = 2;
    } else if (MODE >= 2 && f >= N0) {
        f -= N0, wd[0] = w1, ws[0] = s1, lgs[0] = lg1, N = N1, out = o1, bias = b1;
        kind = 1;
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
    // the warps' sums (red) and, with VT_MMA_STAGE, the staged codes before them: one buffer
    // (one loop compiled a kernel, by the preprocessor: a module's compile time stays)
    constexpr int RED = WARPS * E * 32 * 4;
#if VT_MMA_STAGE
    constexpr int STAGE = WARPS * MT * 16 * VtMmaStage<32, MMA_U(NT)>::RS;
#else
    constexpr int STAGE = 0;
#endif
    __shared__ vt_f4 smem[(RED > STAGE ? RED : STAGE) / 16];
#if VT_MMA_STAGE
    if (VT_Q_LG(lgs[0]) == 5)
        vt_mma_loop_staged<32, MT, NT, WARPS>(acc, wd, ws, lgs, f, N, x, n, K, kb_lo, kb_hi,
                                              (unsigned char*)smem);
    else
        vt_mma_loop_staged<16, MT, NT, WARPS>(acc, wd, ws, lgs, f, N, x, n, K, kb_lo, kb_hi,
                                              (unsigned char*)smem);
#else
    if (VT_Q_LG(lgs[0]) == 5)
        vt_mma_loop<32, MT, NT, WARPS>(acc, wd, ws, lgs, ra, rb, x, n, K, kb_lo, kb_hi);
    else vt_mma_loop<16, MT, NT, WARPS>(acc, wd, ws, lgs, ra, rb, x, n, K, kb_lo, kb_hi);
#endif
    vt_grid_wait();  // a warp without K blocks waits here, before the epilogue's reads
    if (VT_MMA_STAGE) __syncthreads();  // every warp's last reads of its stage done
    float (*red)[E][32] = (float (*)[E][32])smem;
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
        if (MODE == 3) {
            // the pair's other feature (o ^ 1) is lane ^ 4's, in the same iteration (within
            // a wave64's half on HIP too)
            float val = bias && o < N ? v[0] + bias[o] : v[0];
            float other = VT_SHFL_XOR(val, 4);
            if (row >= n || o >= N) continue;
            int pos = rk->positions[row], slot = rk->slots[row];
            if (kind < 2) {
                double theta = (double)pos * table->inv[(o % rk->head_dim) >> 1];
                float c = (float)cos(theta), sn = (float)sin(theta), ra, rb;
                bool even = (o & 1) == 0;
                vt_rope_pair(even ? val : other, even ? other : val, c, sn, &ra, &rb);
                val = even ? ra : rb;
            }
            out[(long long)row * N + o] = val;
            if (kind == 0 || slot < 0 || slot >= rk->n_slots || pos < 0 || pos >= rk->max_len)
                continue;  // an out-of-range slot or position is not stored (as kv_store)
            rk->cache[vt_kv_index(pos, slot, rk->layer, kind - 1, rk->n_slots, rk->n_layers,
                                  N1) + o] = val;  // fmt: skip
            continue;
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
    extern "C" __global__ void swiglu_mma##NO##_##SUFFIX(                                      \
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
// qkv_mma then rope_kv_store in one launch (MODE 3): the arguments of both, less
// rope_kv_store's q, k, v, n, n_heads, n_kv and neox (pairs (2i, 2i + 1) only).
#define VT_DECODE_MMA_ROPE(SUFFIX, NO)                                                        \
    extern "C" __global__ void qkv_rope_mma##NO##_##SUFFIX(                                   \
        float* q, float* k, float* v, const unsigned char* x, const vt_i8* wq,                \
        const float* sq, int lgq, const float* bq, const vt_i8* wk, const float* sk, int lgk, \
        const float* bk, const vt_i8* wv, const float* sv, int lgv, const float* bv, int n,   \
        int Nq, int Nk, int Nv, int K, float* part, int* counts, const int* positions,        \
        const int* slots, float* cache, int head_dim, int n_slots, int n_layers, int max_len, \
        int layer, RopeTable table) {                                                          \
        VtRopeKv rk = {positions, slots, cache, head_dim, n_slots, n_layers, max_len, layer};  \
        vt_mma_op<3, NO>(q, k, v, x, wq, sq, lgq, bq, wk, sk, lgk, bk, wv, sv, lgv, bv, 0, n,  \
                         Nq, Nk, Nv, K, part, counts, &rk, &table);                            \
    }
VT_DECODE_MMA(q8a, 1)
VT_DECODE_MMA(q8a, 2)
VT_DECODE_MMA(q8a, 4)
VT_DECODE_MMA(q8a, 8)

// swiglu_mma1_q8a held to 4 blocks an SM by its registers (64 where it takes 72 at 3 an
// SM): the backend launches it where a launch has more blocks than 3 an SM hold
// (GpuBackend.mma_sw1_wave_blocks), so they run in one wave, not two (the 1B shape's 512
// at batch 8 against the H100's 396 places: +3.5% to +6.8%, runs 170-174), in the layouts
// of scales alone (the others spill at 64 registers). The same code, so the same bits.
#define VT_MMA_WAVE_BOUNDS __launch_bounds__(256, 4)
extern "C" __global__ void VT_MMA_WAVE_BOUNDS swiglu_mma1w_q8a(
    float* out, const unsigned char* x, const vt_i8* gdata, const float* gsm, int glg,
    const vt_i8* udata, const float* usm, int ulg, int n, int N, int K, float* part,
    int* counts) {
    vt_mma_op<1, 1>(out, out, out, x, gdata, gsm, glg, 0, udata, usm, ulg, 0, udata, usm, ulg,
                    0, 0, n, N, 0, 0, K, part, counts);
}
VT_DECODE_MMA_ROPE(q8a, 1)
VT_DECODE_MMA_ROPE(q8a, 2)
VT_DECODE_MMA_ROPE(q8a, 4)
VT_DECODE_MMA_ROPE(q8a, 8)
