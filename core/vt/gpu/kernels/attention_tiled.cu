
// ------------------------------------------------------------------ prefill attention

// Causal attention for many query rows (prefill), tiled in the flash-attention way, float32
// throughout: a block takes BM = 16 * RM consecutive rows of x and one query head, stages
// their q rows in shared memory once, then walks the KV positions BN at a time: K tile into
// shared memory, a BM x BN score tile (each thread RM rows x BN/8 positions from 16-byte
// shared loads, the dot products in head_dim order), the causal mask, an online softmax
// per row (running max and sum, as attention_split), P into shared memory, the V tile
// into the same buffer, and O += P V (each thread RM rows x DMAX/8 elements). Each K/V row
// is read from memory once per block instead of once per query row (attention_split reads
// every position of every row), and every score costs one shared load per 4 FMAs.
//
// Any rows, not only one sequence's: each row has its own (slot, position) from the
// device. Rows with an out-of-range slot or position get NaN (as attention_split); the
// others are taken in passes, one per distinct slot among the tile's rows, in increasing
// slot order: a pass walks positions 0..(the largest position of its rows) of its slot and
// masks every other row. A tile of one sequence (a prefill chunk, any start position,
// positions in any order) is one pass, a tile across two chunks two; a tile of three or
// more sequences (decode rows beside a chunk) is left to attention_split, which the host
// launches with the same tile size (vt_tile_is_tiled decides for both). The pass's slot
// and length come from block reductions, so the control flow is uniform and no thread
// leaves before a barrier.
//
// Threads: 128 = 16 row groups x 8 lanes (tc = t % 8, consecutive lanes of one warp, so a
// row's max and sum are three xor shuffles). Thread (tr, tc) owns rows tr + 16k (k < RM;
// strided so the 4 row groups of a warp hit distinct banks), positions tc + 8c of a tile
// and output elements 32m + 4tc + e. Shared rows are padded to DMAX + 4 floats: 16-byte
// aligned, and 8 lanes reading 8 different K rows at the same d touch 32 distinct banks.
// head_dim <= DMAX (64, 128 or 256); elements past head_dim are zero in q and K.
#define AT_THREADS 128
#define AT_TC 8
#define AT_TR 16
#define AT_NONE 0x7fffffff  // a row in no pass: invalid, or past the batch

template <int DMAX, int RM, int BN>
__device__ __forceinline__ void vt_attention_tiled(float* out, const float* q, const float* cache,
                                                   const int* slots, const int* positions,
                                                   int n, int n_heads, int n_kv, int head_dim,
                                                   int n_slots, int n_layers, int max_len,
                                                   int layer, float scale) {
    const int BM = AT_TR * RM, QP = DMAX + 4, PP = BN + 4, NC = BN / AT_TC, NM = DMAX / 32;
    // Declared as vt_f4 so the 16-byte loads below are aligned (QP, PP are multiples of 4).
    __shared__ vt_f4 qs4[BM * QP / 4], kv4[BN * QP / 4], ps4[BM * PP / 4];
    float *qs = (float*)qs4, *kv = (float*)kv4, *ps = (float*)ps4;
    __shared__ int r_slot[BM], r_pos[BM], red[AT_THREADS / VT_WARP];
    int t = threadIdx.x, tc = t % AT_TC, tr = t / AT_TC;
    // The last tiles (longest contexts) first, so the short ones fill the tail.
    int i0 = (gridDim.x - 1 - blockIdx.x) * BM, h = blockIdx.y;
    if (!vt_tile_is_tiled(slots, positions, n, n_slots, max_len, i0, BM, red))
        return;  // rows of three or more sequences: attention_split's (the block leaves together)
    int kvh = h / (n_heads / n_kv), row = n_kv * head_dim;
    int dlim = (head_dim + 3) & ~3;  // the score loop's extent, in float4 steps
    long long pos_stride = (long long)n_slots * n_layers * 2 * row;
    bool vec = ((head_dim | row) & 3) == 0 && ((vt_u64)cache & 15) == 0 && ((vt_u64)q & 15) == 0;
    for (int r = t; r < BM; r += AT_THREADS) {
        int i = i0 + r, slot = AT_NONE, pos = -1;
        if (i < n) {
            int s = slots[i], p = positions[i];
            if (s >= 0 && s < n_slots && p >= 0 && p < max_len) slot = s, pos = p;
        }
        r_slot[r] = slot;
        r_pos[r] = pos;
    }
    for (int e = t; e < BM * (DMAX / 4); e += AT_THREADS) {  // q rows, zero past head_dim
        int r = e / (DMAX / 4), d = (e % (DMAX / 4)) * 4;
        if (d >= dlim) continue;
        int i = min(i0 + r, n - 1);
        const float* src = q + ((long long)i * n_heads + h) * head_dim;
        vt_f4 v;
        if (vec) {
            v = *(const vt_f4*)(src + d);
        } else {
            v.x = d < head_dim ? src[d] : 0.0f;
            v.y = d + 1 < head_dim ? src[d + 1] : 0.0f;
            v.z = d + 2 < head_dim ? src[d + 2] : 0.0f;
            v.w = d + 3 < head_dim ? src[d + 3] : 0.0f;
        }
        *(vt_f4*)(qs + r * QP + d) = v;
    }
    const float NEG = -__uint_as_float(0x7f800000u);
    float o[RM][NM][4], m_run[RM], l_run[RM];
#pragma unroll
    for (int k = 0; k < RM; ++k) {
        m_run[k] = NEG;
        l_run[k] = 0.0f;
#pragma unroll
        for (int mm = 0; mm < NM; ++mm) o[k][mm][0] = o[k][mm][1] = o[k][mm][2] = o[k][mm][3] = 0.0f;
    }
    __syncthreads();
    int last = -1;
    for (;;) {
        int cand = AT_NONE;
        for (int r = t; r < BM; r += AT_THREADS)
            if (r_slot[r] > last && r_slot[r] < cand) cand = r_slot[r];
        cand = vt_block_min_int(cand, red);
        if (cand == AT_NONE) break;  // every valid row had its pass
        int end = 0x7fffffff;  // -(the largest position of the pass's rows), as a min
        for (int r = t; r < BM; r += AT_THREADS)
            if (r_slot[r] == cand) end = min(end, -r_pos[r]);
        end = -vt_block_min_int(end, red);
        last = cand;
        bool mine[RM];
        int mpos[RM];
#pragma unroll
        for (int k = 0; k < RM; ++k) {
            mine[k] = r_slot[tr + AT_TR * k] == cand;
            mpos[k] = r_pos[tr + AT_TR * k];
        }
        const float* kb = cache + vt_kv_index(0, cand, layer, 0, n_slots, n_layers, row) +
                          (long long)kvh * head_dim;
        for (int c0 = 0; c0 <= end; c0 += BN) {
            // K rows c0..c0+BN of the pass's slot; zero past its last position.
            for (int e = t; e < BN * (DMAX / 4); e += AT_THREADS) {
                int j = e / (DMAX / 4), d = (e % (DMAX / 4)) * 4;
                if (d >= dlim) continue;
                vt_f4 v = {0.0f, 0.0f, 0.0f, 0.0f};
                if (c0 + j <= end) {
                    const float* src = kb + (long long)(c0 + j) * pos_stride;
                    if (vec) {
                        v = *(const vt_f4*)(src + d);
                    } else {
                        v.x = d < head_dim ? src[d] : 0.0f;
                        v.y = d + 1 < head_dim ? src[d + 1] : 0.0f;
                        v.z = d + 2 < head_dim ? src[d + 2] : 0.0f;
                        v.w = d + 3 < head_dim ? src[d + 3] : 0.0f;
                    }
                }
                *(vt_f4*)(kv + j * QP + d) = v;
            }
            __syncthreads();
            float s[RM][NC];
#pragma unroll
            for (int k = 0; k < RM; ++k)
#pragma unroll
                for (int c = 0; c < NC; ++c) s[k][c] = 0.0f;
#pragma unroll 2
            for (int d = 0; d < dlim; d += 4) {
                vt_f4 a[RM], b[NC];
#pragma unroll
                for (int k = 0; k < RM; ++k) a[k] = *(const vt_f4*)(qs + (tr + AT_TR * k) * QP + d);
#pragma unroll
                for (int c = 0; c < NC; ++c) b[c] = *(const vt_f4*)(kv + (tc + AT_TC * c) * QP + d);
#pragma unroll
                for (int k = 0; k < RM; ++k)
#pragma unroll
                    for (int c = 0; c < NC; ++c) {
                        s[k][c] += a[k].x * b[c].x;
                        s[k][c] += a[k].y * b[c].y;
                        s[k][c] += a[k].z * b[c].z;
                        s[k][c] += a[k].w * b[c].w;
                    }
            }
            // Mask, then the online softmax per row: the tile's max over the row's 8 lanes,
            // the running sum kept per lane (added up once at the end).
#pragma unroll
            for (int k = 0; k < RM; ++k) {
                float mx = NEG;
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    bool keep = mine[k] && c0 + tc + AT_TC * c <= mpos[k];
                    s[k][c] = keep ? s[k][c] * scale : NEG;
                    mx = fmaxf(mx, s[k][c]);
                }
                mx = fmaxf(mx, VT_SHFL_XOR(mx, 1));
                mx = fmaxf(mx, VT_SHFL_XOR(mx, 2));
                mx = fmaxf(mx, VT_SHFL_XOR(mx, 4));
                float nm = fmaxf(m_run[k], mx);
                float base = nm == NEG ? 0.0f : nm;  // a row with nothing seen yet stays 0
                float corr = expf(m_run[k] - base);  // 0 on the row's first tile
                m_run[k] = nm;
                float sum = 0.0f;
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    float p = expf(s[k][c] - base);
                    sum += p;
                    ps[(tr + AT_TR * k) * PP + tc + AT_TC * c] = p;
                }
                l_run[k] = l_run[k] * corr + sum;
#pragma unroll
                for (int mm = 0; mm < NM; ++mm) {
                    o[k][mm][0] *= corr;
                    o[k][mm][1] *= corr;
                    o[k][mm][2] *= corr;
                    o[k][mm][3] *= corr;
                }
            }
            __syncthreads();  // K read by every thread, P written
            // V rows into the same buffer (zero past the last position: P is 0 there, and
            // 0 * garbage could be NaN).
            for (int e = t; e < BN * (DMAX / 4); e += AT_THREADS) {
                int j = e / (DMAX / 4), d = (e % (DMAX / 4)) * 4;
                vt_f4 v = {0.0f, 0.0f, 0.0f, 0.0f};
                if (c0 + j <= end && d < head_dim) {
                    const float* src = kb + row + (long long)(c0 + j) * pos_stride;
                    if (vec) {
                        v = *(const vt_f4*)(src + d);
                    } else {
                        v.x = src[d];
                        v.y = d + 1 < head_dim ? src[d + 1] : 0.0f;
                        v.z = d + 2 < head_dim ? src[d + 2] : 0.0f;
                        v.w = d + 3 < head_dim ? src[d + 3] : 0.0f;
                    }
                }
                *(vt_f4*)(kv + j * QP + d) = v;
            }
            __syncthreads();
#pragma unroll 2
            for (int j = 0; j < BN; j += 4) {
                vt_f4 p4[RM];
#pragma unroll
                for (int k = 0; k < RM; ++k) p4[k] = *(const vt_f4*)(ps + (tr + AT_TR * k) * PP + j);
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
                    for (int mm = 0; mm < NM; ++mm) {
                        vt_f4 v = *(const vt_f4*)(kv + (j + jj) * QP + 32 * mm + 4 * tc);
#pragma unroll
                        for (int k = 0; k < RM; ++k) {
                            float p = jj == 0 ? p4[k].x : jj == 1 ? p4[k].y : jj == 2 ? p4[k].z : p4[k].w;
                            o[k][mm][0] += p * v.x;
                            o[k][mm][1] += p * v.y;
                            o[k][mm][2] += p * v.z;
                            o[k][mm][3] += p * v.w;
                        }
                    }
                }
            }
            __syncthreads();  // kv[] and ps[] are rewritten by the next tile
        }
    }
#pragma unroll
    for (int k = 0; k < RM; ++k) {
        float l = l_run[k];
        l += VT_SHFL_XOR(l, 1);
        l += VT_SHFL_XOR(l, 2);
        l += VT_SHFL_XOR(l, 4);
        int r = tr + AT_TR * k, i = i0 + r;
        if (i >= n) continue;
        bool ok = r_slot[r] != AT_NONE;
        float* dst = out + ((long long)i * n_heads + h) * head_dim;
#pragma unroll
        for (int mm = 0; mm < NM; ++mm)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int d = 32 * mm + 4 * tc + e;
                if (d < head_dim) dst[d] = ok ? o[k][mm][e] / l : vt_nan();
            }
    }
}

// One kernel per (DMAX, rows per block): attention_tiled_h<DMAX>r<BM>; the backend picks
// the smallest DMAX >= head_dim and the largest BM that still gives the GPU enough blocks.
#define VT_ATTENTION_TILED(SUFFIX, DMAX, RM, BN)                                              \
    extern "C" __global__ void attention_tiled_##SUFFIX(float* out, const float* q, const float* cache,              \
                                 const int* slots, const int* positions, int n, int n_heads,  \
                                 int n_kv, int head_dim, int n_slots, int n_layers,           \
                                 int max_len, int layer, float scale) {                       \
        vt_attention_tiled<DMAX, RM, BN>(out, q, cache, slots, positions, n, n_heads, n_kv,   \
                                         head_dim, n_slots, n_layers, max_len, layer, scale); \
    }
VT_ATTENTION_TILED(h64r64, 64, 4, 32)
VT_ATTENTION_TILED(h64r32, 64, 2, 64)
VT_ATTENTION_TILED(h64r16, 64, 1, 64)
VT_ATTENTION_TILED(h128r32, 128, 2, 32)
VT_ATTENTION_TILED(h128r16, 128, 1, 32)
VT_ATTENTION_TILED(h256r16, 256, 1, 16)
