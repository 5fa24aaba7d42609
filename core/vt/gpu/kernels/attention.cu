// Causal attention, split over positions (flash-decoding): one block per (row i, group of
// GB query heads sharing one KV head, split s of the row's positions). The positions 0..positions[i] are cut into
// `splits` ranges; a block scores its range FA_CHUNK positions at a time (one position per
// thread, each K row read once for the GB heads), keeps a running max and sum per head
// (online softmax) and accumulates its V rows. With splits == 1 it writes the output; else
// it writes its unnormalized partial (acc[head_dim], max, sum) for attention_combine. So a
// single row at a long context fills the GPU (the positions are spread over blocks), and
// the KV rows of a group are read once for its GB heads. The split ranges come from the
// device-side positions, so a captured graph stays valid as the context grows. With
// tile > 0 (a step of many rows) only the rows of tiles attention_tiled leaves are done.
// With counts (splits > 1), the last block of a (row, group) to finish combines the
// group's partials itself (vt_attention_combine_warp: attention_combine's sums), so no
// second launch waits behind this one; counts[] (one int per (row, group), zero before
// the launch) is left zero again for the next.
// With xq (GpuBackend.attention_q8a, int8 rows) the kernel that writes a row's output also
// packs it as quantize_rows would (vt_attn_out), for the int8 projection after attention.
// FA_THREADS: a block's threads (GpuBackend.attention_threads compiles another: 512 is 16
// warps a split block, a short context in 1-2 rounds of the warp path, so one split and no
// combine launch: bench_variant.py --attention-threads 512 --splits 1; runs 100-101: +6.9%
// on the 135M shape at 128 positions, -19% to -43% at 2,048, so 128 stays).
#ifndef FA_THREADS
#define FA_THREADS 128
#endif
#define FA_CHUNK FA_THREADS  // one position per thread per pass
#if FA_THREADS > 128  // at most 128 registers a thread, or a block could not launch
#define VT_FA_BOUNDS __launch_bounds__(FA_THREADS)
#else
#define VT_FA_BOUNDS
#endif
#define FA_MAXG 8     // query heads per block (the host picks a divisor of the group size)
// VT_FA_COMBINE_EARLY (default 1): attention_combine loads the partials' values with their
// maxima and sums, before the two reductions that weigh them, not after: one dependent
// round trip less, the same sums in the same order (the same bits). Runs 83-84: 3.01 ->
// 2.49 us a call, +0.8% to +4.4% tok/s at batch 1 (both shapes, 128 and 2,048 positions).
#ifndef VT_FA_COMBINE_EARLY
#define VT_FA_COMBINE_EARLY 1
#endif
// VT_FA_REG_ACC (default 1): attention_split's loops over head_dim's two halves unrolled,
// so its accumulators acc[half][g] are indexed by constants and kept in registers; with a
// run-time bound (=0) they live in local memory (LDL/STL in the machine code:
// sass_count.py attention_split). The same operations in the same order; runs 83-84: +0.2%
// to +1.2% over the combine's alone.
#ifndef VT_FA_REG_ACC
#define VT_FA_REG_ACC 1
#endif
// VT_FA_WARP=1 (on since runs 88-89; 0: the block path alone): attention_split's decode path
// for head_dim 64 and 128 with a running softmax per warp instead of per block
// (vt_fa_warp_split): no block barrier per chunk, and a pass's K and V rows loaded together
// (one memory round trip where the block path takes two). Run 84's ncu: the block path's
// warps stall on its shared-memory reductions and barriers, not on its loads. Runs 88-89:
// +2.7% to +3.4% tok/s at batch 1 on both shapes, at 128 and 2,048 positions. Not the
// block path's sums (each warp's softmax and values meet at the end): within the kit's
// bounds, not the same bits.
#ifndef VT_FA_WARP
#define VT_FA_WARP 1
#endif
// gb * head_dim at most on the warp path (its merge's shared floats a warp: 16 KiB in all)
#define FA_WARP_ACC (128 * 1024 / FA_THREADS)
// VT_FA_DIRECT=1 (off: run 88, with --min-split 256 so the bench's rows are one split, -11%
// tok/s at batch 1 on the 1B shape: one split's chain is longer than 8-16 splits and a
// combine): where a row's positions all fall in its first split (a short context, or GpuBackend.attention_min_split
// at least the context), that split's blocks write the output as one split does, and
// attention_combine only waits and leaves: the same bits (the combine of one partial is
// acc * 1 / (1 * l)), one launch's work less a layer. Rows with no positions (an invalid
// slot) still go to the combine, which writes their NaN.
#ifndef VT_FA_DIRECT
#define VT_FA_DIRECT 0
#endif
// A warp's position groups whose loads the warp path issues together: 1 since the sixteenth
// session (runs 90-91: +1.4% to +4.7% tok/s at batch 1 over 2, 128 registers against 168;
// the same sums in the same order either way).
#ifndef VT_FA_WARP_GROUPS
#define VT_FA_WARP_GROUPS 1
#endif
#if VT_FA_REG_ACC
#define FA_HALVES(cond) _Pragma("unroll") for (int half = 0; half < 2; ++half) if (cond)
#else  // stops at the first half where cond fails: cond is monotone in half either way
#define FA_HALVES(cond) for (int half = 0; half < 2 && (cond); ++half)
#endif

// Element d of head (oh % n_heads) of row i = oh / n_heads of attention's output, v; with xq
// (GpuBackend.attention_q8a: the int8 projection after attention reads it) also its row
// packed as quantize_rows packs x (the same function on the same float: the same bytes), so
// that projection needs no quantize_rows launch. With xq each whole group of 32 lanes
// (threadIdx.x / 32) calls it on 32 consecutive elements of one head (head_dim % 32 == 0:
// one block of 32).
__device__ __forceinline__ void vt_attn_out(float* out, unsigned char* xq, int n, int n_heads,
                                            int head_dim, long long oh, int d, float v) {
    out[oh * head_dim + d] = v;
    if (xq)
        vt_q8a_block(xq, n, n_heads * head_dim, (int)(oh / n_heads),
                     (int)(oh % n_heads * head_dim + d) / 32, v);
}

// out[oh] (oh = row * n_heads + head) from attention_split's `splits` partials, by the
// whole block (FA_THREADS threads; wt and red: FA_THREADS floats of shared memory each):
// attention_combine's. Thread s reads split s's max and sum, so the weights exp(m_s - max)
// come from one block reduction each, not a chain of loads per thread; then a thread per
// element sums the weighted partials. A split that saw no position (sum 0) weighs 0; only
// the first `used` splits (those attention_split gave positions) are read. splits <=
// FA_MAX_SPLITS.
#define FA_MAX_SPLITS FA_THREADS
__device__ void vt_attention_combine_block(float* out, const float* part, long long oh,
                                           int head_dim, int splits, int used, bool ok,
                                           float* wt, float* red, unsigned char* xq, int n,
                                           int n_heads) {
    int t = threadIdx.x;
    const float* pp = part + oh * splits * (head_dim + 2);
#if VT_FA_COMBINE_EARLY
    constexpr int PV = 32;  // the values of up to this many splits (the backend's most) up front
    float pv[PV];
#pragma unroll
    for (int k = 0; k < PV; ++k)
        pv[k] = t < head_dim && k < used ? pp[(long long)k * (head_dim + 2) + t] : 0.0f;
#endif
    float m = -__uint_as_float(0x7f800000u), l = 0.0f;
    if (t < used) {  // both loads in flight together
        float mt = pp[(long long)t * (head_dim + 2) + head_dim];
        l = pp[(long long)t * (head_dim + 2) + head_dim + 1];
        if (l > 0.0f) m = mt;
    }
    // Two barriers a reduction (warps, then their results), not log2(FA_THREADS).
    float mx = vt_block_max_warps(m, red);
    float w = l > 0.0f ? expf(m - mx) : 0.0f;
    wt[t] = w;
    float den = vt_block_sum_warps(w * l, red);  // its barriers also publish wt[]
    for (int d = t; d < head_dim; d += FA_THREADS) {
        float num = 0.0f;
        int k = 0;
#if VT_FA_COMBINE_EARLY
        if (d == t) {  // the first FA_THREADS elements: their values are in pv[]
#pragma unroll
            for (; k < PV; ++k)
                if (k < used) num += wt[k] * pv[k];
            k = min(used, PV);
        }
#endif
#pragma unroll 8
        for (; k < used; ++k) num += wt[k] * pp[(long long)k * (head_dim + 2) + d];
        vt_attn_out(out, xq, n, n_heads, head_dim, oh, d, ok ? num / den : vt_nan());
    }
}

// The same by one warp, for the last split block of a group (its warps take the group's
// heads at once): lane j reads splits j, j + VT_WARP, ... (through L2: other blocks of this
// kernel wrote them), keeps their weights in registers, the denominator sums by shuffles;
// then each lane takes elements, 8 splits' loads in flight, each weight fetched by a
// shuffle. For splits <= VT_WARP (the backend's at most 32) its sums are the block
// version's, term for term: the outputs equal attention_combine's bit for bit.
__device__ void vt_attention_combine_warp(float* out, const float* part, long long oh,
                                          int head_dim, int splits, bool ok, unsigned char* xq,
                                          int n, int n_heads) {
    constexpr int PER = (FA_MAX_SPLITS + VT_WARP - 1) / VT_WARP;
    int lane = threadIdx.x % VT_WARP;
    const float* pp = part + oh * splits * (head_dim + 2);
    float w[PER], l[PER];
    float mx = -__uint_as_float(0x7f800000u);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        long long s = min(lane + j * VT_WARP, splits - 1);
        l[j] = lane + j * VT_WARP < splits ? vt_ld_l2(pp + s * (head_dim + 2) + head_dim + 1)
                                           : 0.0f;
        w[j] = l[j] > 0.0f ? vt_ld_l2(pp + s * (head_dim + 2) + head_dim)
                           : -__uint_as_float(0x7f800000u);
        mx = fmaxf(mx, w[j]);
    }
    for (int k = VT_WARP / 2; k > 0; k >>= 1) mx = fmaxf(mx, VT_SHFL_XOR(mx, k));
    float den = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        w[j] = l[j] > 0.0f ? expf(w[j] - mx) : 0.0f;
        den += w[j] * l[j];
    }
    den = vt_warp_sum(den);
    for (int d0 = 0; d0 < head_dim; d0 += VT_WARP) {  // the same for the whole warp
        int d = min(d0 + lane, head_dim - 1);
        float num = 0.0f;
        for (int k0 = 0; k0 < splits; k0 += 8) {  // VT_WARP is a multiple of 8
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u)
                v[u] = vt_ld_l2(pp + (long long)min(k0 + u, splits - 1) * (head_dim + 2) + d);
            float wj = w[0];
#pragma unroll
            for (int j = 1; j < PER; ++j)
                if (j == k0 / VT_WARP) wj = w[j];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                float wk = VT_SHFL_IDX(wj, (k0 + u) % VT_WARP);
                if (k0 + u < splits) num += wk * v[u];
            }
        }
        // with xq (head_dim % 32 == 0) whole groups of 32 lanes pass or not (wave64 too)
        if (d0 + lane < head_dim)
            vt_attn_out(out, xq, n, n_heads, head_dim, oh, d, ok ? num / den : vt_nan());
    }
}

// Thread-block clusters (attention_split_cluster, NVIDIA sm_90 and later): the barrier
// of all the cluster's threads (release, then acquire: what each block wrote before it is
// seen by every other after it) and this block's rank in its cluster. Elsewhere stubs,
// never reached (the cluster kernel exists only there).
#define FA_CLUSTER 8  // the most blocks a cluster may portably have
#if !defined(VT_HIP) && !defined(VT_EMULATE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void vt_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
                 ::: "memory");
}
__device__ __forceinline__ unsigned vt_cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
#else
__device__ __forceinline__ void vt_cluster_sync() {}
__device__ __forceinline__ unsigned vt_cluster_rank() { return 0; }
#endif

// After a split block wrote its partials (splits > 1): the cluster's first block, or with
// counts the group's last block to finish, combines the group's heads; else nothing (the
// attention_combine launch follows). Every thread of the block calls it.
template <bool CLUSTER>
__device__ __forceinline__ void vt_attention_split_end(float* out, const float* part, int i,
                                                       int n_heads, int h0, int gb,
                                                       int head_dim, int splits, bool ok,
                                                       int* counts, unsigned char* xq, int n) {
    int t = threadIdx.x, warp = t / VT_WARP, warps = FA_THREADS / VT_WARP;
    if (CLUSTER) {  // splits == the cluster's blocks (FA_CLUSTER), tile == 0: all arrive
        __threadfence();  // this block's partials visible beyond its SM, then the barrier
        vt_cluster_sync();
        if (vt_cluster_rank() != 0) return;
        for (int g = warp; g < gb; g += warps)  // a head a warp (reads through L2: vt_ld_l2)
            vt_attention_combine_warp(out, part, (long long)i * n_heads + h0 + g, head_dim,
                                      splits, ok, xq, n, n_heads);
        return;
    }
    if (splits == 1 || !counts) return;  // the whole block: attention_combine follows
    // The block that brings the group's count to `splits` reads every split's partials
    // (from L2: vt_ld_l2).
    if (!vt_last_block(counts + (long long)i * gridDim.y + blockIdx.y, splits)) return;
    for (int g = warp; g < gb; g += warps)  // a head a warp, the warps at once
        vt_attention_combine_warp(out, part, (long long)i * n_heads + h0 + g, head_dim, splits,
                                  ok, xq, n, n_heads);
}

// VT_FA_WARP's body of attention_split for positions [p0, p1) of a block's group of gb
// heads (q in qs, head_dim HD: 64 or 128, 16-byte K loads): each warp takes groups of PPW =
// VT_WARP / LPN positions in turn (LPN lanes a position, 16 K values a lane, as the block
// path scores), loads a group's K rows and its V rows (lane l the elements l, l + VT_WARP,
// ...) together, scores them (the LPN lanes' sums meet by shuffles), keeps a running max
// and sum per head over its own positions and sums its V rows, each position's weight
// taken from its lanes by a shuffle. One barrier at the end: the warps' maxima, sums and
// values meet in shared memory (weights exp(m_w - max)), then the block writes the output
// (one split) or its partial, as the block path does. wacc: the caller's shared memory,
// FA_THREADS / VT_WARP * FA_WARP_ACC floats (one array for both head sizes).
#define FA_WARPS (FA_THREADS / VT_WARP)
template <int HD>
__device__ void vt_fa_warp_split(float* out, float* part, const float* cache, long long kbase,
                                 long long vbase, long long pos_stride, int p0, int p1,
                                 const float* qs, int i, int n_heads, int h0, int gb,
                                 int splits, int s, float scale, bool ok,
                                 float (*wacc)[FA_WARP_ACC], bool direct, unsigned char* xq,
                                 int n) {
    constexpr int WARPS = FA_WARPS, LPN = HD / 16, PPW = VT_WARP / LPN;
    constexpr int E = HD / VT_WARP;  // V elements a lane
    __shared__ float wms[WARPS][FA_MAXG], wls[WARPS][FA_MAXG];
    const float NEG = -__uint_as_float(0x7f800000u);
    int t = threadIdx.x, lane = t % VT_WARP, warp = t / VT_WARP;
    int lp = lane % LPN, pj = lane / LPN;
    float m[FA_MAXG], l[FA_MAXG], acc[FA_MAXG][E];
#pragma unroll
    for (int g = 0; g < FA_MAXG; ++g) {
        m[g] = NEG, l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = 0.0f;
    }
    // VT_FA_WARP_GROUPS of the warp's groups a round, all their loads issued first (a split of
    // 64 positions at head_dim 64 is two groups a warp: one memory round trip), then each
    // group in turn, in the order one group a round would take them (the same sums).
    constexpr int G = VT_FA_WARP_GROUPS;
    for (int jr = p0 + warp * PPW; jr < p1; jr += G * WARPS * PPW) {  // the same for the warp
        vt_f4 k4[G][4];
        float vv[G][PPW][E];
#pragma unroll
        for (int u = 0; u < G; ++u) {
            int jb = jr + u * WARPS * PPW;
            if (jb < p1) {
                const float* kp = cache + kbase + (long long)min(jb + pj, p1 - 1) * pos_stride;
#pragma unroll
                for (int c = 0; c < 4; ++c) k4[u][c] = *(const vt_f4*)(kp + (lp + c * LPN) * 4);
#pragma unroll
                for (int q = 0; q < PPW; ++q) {
                    const float* vp = cache + vbase + (long long)min(jb + q, p1 - 1) * pos_stride;
#pragma unroll
                    for (int e = 0; e < E; ++e) vv[u][q][e] = vp[e * VT_WARP + lane];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < G; ++u) {
            int jb = jr + u * WARPS * PPW;
            if (jb >= p1) continue;  // the same for the warp
            bool valid = jb + pj < p1;
#pragma unroll
            for (int g = 0; g < FA_MAXG; ++g) {
                if (g >= gb) continue;  // gb is the same for the whole block
                float sg = 0.0f;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const float* qg = qs + g * 256 + (lp + c * LPN) * 4;
                    sg += qg[0] * k4[u][c].x;
                    sg += qg[1] * k4[u][c].y;
                    sg += qg[2] * k4[u][c].z;
                    sg += qg[3] * k4[u][c].w;
                }
#pragma unroll
                for (int o = LPN / 2; o > 0; o >>= 1) sg += VT_SHFL_XOR(sg, o);
                float sc = valid ? sg * scale : NEG;
                float mx = sc;  // the group's maximum: the xor offsets walk its positions' lanes
#pragma unroll
                for (int o = LPN; o < VT_WARP; o <<= 1) mx = fmaxf(mx, VT_SHFL_XOR(mx, o));
                float nm = fmaxf(m[g], mx);  // finite: position jb is valid
                float p = valid ? expf(sc - nm) : 0.0f;
                float sum = p;  // each position once
#pragma unroll
                for (int o = LPN; o < VT_WARP; o <<= 1) sum += VT_SHFL_XOR(sum, o);
                float corr = expf(m[g] - nm);  // 0 on the warp's first group (m = -inf)
                l[g] = l[g] * corr + sum;
                m[g] = nm;
                float a[E];
#pragma unroll
                for (int e = 0; e < E; ++e) a[e] = 0.0f;
#pragma unroll
                for (int q = 0; q < PPW; ++q) {
                    float pq = VT_SHFL_IDX(p, q * LPN);  // position jb + q's weight (0 past p1)
#pragma unroll
                    for (int e = 0; e < E; ++e) a[e] += pq * vv[u][q][e];
                }
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * corr + a[e];
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < FA_MAXG; ++g)
            if (g < gb) wms[warp][g] = m[g], wls[warp][g] = l[g];
    }
#pragma unroll
    for (int g = 0; g < FA_MAXG; ++g)
        if (g < gb) {
#pragma unroll
            for (int e = 0; e < E; ++e) wacc[warp][g * HD + e * VT_WARP + lane] = acc[g][e];
        }
    __syncthreads();
    for (int idx = t; idx < gb * HD; idx += FA_THREADS) {
        int g = idx / HD, d = idx % HD;
        float mx = NEG;
#pragma unroll
        for (int w = 0; w < WARPS; ++w)
            if (wls[w][g] > 0.0f) mx = fmaxf(mx, wms[w][g]);
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {  // a warp that saw no position weighs 0
            float wt = wls[w][g] > 0.0f ? expf(wms[w][g] - mx) : 0.0f;
            num += wt * wacc[w][idx];
            den += wt * wls[w][g];
        }
        long long oh = (long long)i * n_heads + h0 + g;
        if (splits == 1 || direct) {  // a warp's lanes: 32 consecutive d of one head
            vt_attn_out(out, xq, n, n_heads, HD, oh, d, ok ? num / den : vt_nan());
        } else {
            float* pp = part + (oh * splits + s) * (HD + 2);
            pp[d] = num;
            if (d == 0) {
                pp[HD] = mx;
                pp[HD + 1] = den;
            }
        }
    }
    __syncthreads();
}

#ifndef VT_PF_LATE
#define VT_PF_LATE 0
#endif
// CLUSTER (attention_split_cluster): the row's splits of a group are one thread-block
// cluster, and its first block combines their partials after the cluster's barrier.
template <bool CLUSTER>
__device__ __forceinline__ void vt_attention_split(float* out, float* part, const float* q,
                                                   const float* cache, const int* slots,
                                                   const int* positions, int n, int n_heads,
                                                   int n_kv, int head_dim, int n_slots,
                                                   int n_layers, int max_len, int layer,
                                                   float scale, int gb, int splits,
                                                   int min_per_split, int tile, int* counts,
                                                   unsigned char* xq, const VtPrefetch& pf) {
    __shared__ float qs[FA_MAXG * 256];
    __shared__ float sc[FA_MAXG * FA_CHUNK];
    __shared__ float ms[FA_MAXG], ls[FA_MAXG], cs[FA_MAXG];
    __shared__ int red[FA_THREADS / VT_WARP];
    vt_launch_dependents();  // the next overlapped kernel may start (common.cu)
    // the ops after attention: their weights toward L2 meanwhile (VT_PF_LATE: once the
    // kernel before has finished, so the prefetches do not queue beside its loads)
    if (!VT_PF_LATE) vt_prefetch_ranges(pf);
    int i = blockIdx.x, s = blockIdx.z, t = threadIdx.x;
    if (vt_tile_is_tiled(slots, positions, n, n_slots, max_len, i - i % max(tile, 1), tile, red))
        return;  // attention_tiled writes this row (the whole block leaves together)
    int lane = t % VT_WARP, warp = t / VT_WARP, warps = FA_THREADS / VT_WARP;
    int group = n_heads / n_kv, subs = group / gb;
    int kvh = blockIdx.y / subs;
    int h0 = kvh * group + (blockIdx.y % subs) * gb;
    int row = n_kv * head_dim;
    int slot = slots[i], pos = positions[i];
    bool ok = slot >= 0 && slot < n_slots && pos >= 0 && pos < max_len;
    int length = ok ? pos + 1 : 0;
    int per = max((length + splits - 1) / splits, min_per_split);
    int p0 = min(length, s * per), p1 = min(length, p0 + per);
    // VT_FA_DIRECT: the row's positions all in split 0, whose blocks write the output
    bool direct = VT_FA_DIRECT && splits > 1 && !counts && !CLUSTER && length > 0 &&
                  per >= length;
    // A split past the row's positions (a short context) leaves at once: attention_combine
    // reads only the splits before it (the last-block combine counts every block, and every
    // block of a cluster meets at its barrier, so not then).
    if (splits > 1 && !counts && !CLUSTER && p0 >= p1) {
        if (VT_PF_LATE) vt_grid_wait(), vt_prefetch_ranges(pf);
        return;
    }
    long long pos_stride = (long long)n_slots * n_layers * 2 * row;
    long long kbase = ok ? vt_kv_index(0, slot, layer, 0, n_slots, n_layers, row) + kvh * head_dim
                         : 0;
    long long vbase = kbase + row;
    // Launched overlapped (GpuBackend.overlap_attention), the block's K and V rows go to L2
    // while the kernel before (the one writing q and this step's K and V) finishes; slots and
    // positions are the step's inputs, copied before its first kernel. Then wait for it.
    int lines = (head_dim + 31) / 32;  // 128-byte lines a head's K (V) row spans
    for (int e = t; e < (p1 - p0) * 2 * lines; e += FA_THREADS) {
        int j = e / (2 * lines), c = e % (2 * lines);
        vt_prefetch_l2(cache + (c < lines ? kbase : vbase) + (long long)(p0 + j) * pos_stride +
                       (c % lines) * 32);
    }
    vt_grid_wait();
    if (VT_PF_LATE) vt_prefetch_ranges(pf);
    for (int e = t; e < gb * head_dim; e += FA_THREADS) {
        int g = e / head_dim, d = e % head_dim;
        qs[g * 256 + d] = q[((long long)i * n_heads + h0 + g) * head_dim + d];
    }
    if (t < FA_MAXG) {
        ms[t] = -__uint_as_float(0x7f800000u);
        ls[t] = 0.0f;
    }
    __syncthreads();
    // Values: thread t owns element d = t % hd_lanes (and d + 128 for head_dim > 128) and the
    // positions j with j % R == t / hd_lanes; R partial sums are added at the end.
    int hd_lanes = head_dim <= FA_THREADS && FA_THREADS % head_dim == 0 ? head_dim : FA_THREADS;
    int R = FA_THREADS / hd_lanes, r = t / hd_lanes, d0 = t % hd_lanes;
    float acc[2][FA_MAXG];
#pragma unroll
    for (int g = 0; g < FA_MAXG; ++g) acc[0][g] = acc[1][g] = 0.0f;
    // Scores: lpn lanes per position (head_dim / 16 rounded up to a power of 2, at most 16:
    // 4 float4s of a K row a lane), two positions a thread, 2 * FA_THREADS / lpn positions per
    // pass (64 for head_dim 64), every load of a pass issued before its products, then the
    // lanes' sums meet by shuffles. A thread walking a whole row (VT_FA_ROW, the kernel up
    // to run 29) waited on one load after another: 13 us a call at 200 positions (run 29).
    int lpn = 1;
    while (lpn * 16 < head_dim && lpn < 16) lpn <<= 1;
    int lp = t % lpn, pj = t / lpn, hp = FA_THREADS / lpn;
    bool k16 = ((head_dim | row) & 3) == 0 && ((vt_u64)cache & 15) == 0;  // 16-byte loads
#if VT_FA_WARP
    if (k16 && (head_dim == 64 || head_dim == 128) && gb * head_dim <= FA_WARP_ACC) {
        __shared__ float wacc[FA_WARPS][FA_WARP_ACC];
        if (head_dim == 64)
            vt_fa_warp_split<64>(out, part, cache, kbase, vbase, pos_stride, p0, p1, qs, i,
                                 n_heads, h0, gb, splits, s, scale, ok, wacc, direct, xq,
                                 n);
        else
            vt_fa_warp_split<128>(out, part, cache, kbase, vbase, pos_stride, p0, p1, qs, i,
                                  n_heads, h0, gb, splits, s, scale, ok, wacc, direct, xq,
                                  n);
        vt_attention_split_end<CLUSTER>(out, part, i, n_heads, h0, gb, head_dim, splits, ok,
                                        counts, xq, n);
        return;
    }
#endif
    for (int c0 = p0; c0 < p1; c0 += FA_CHUNK) {
        int cn = min(FA_CHUNK, p1 - c0);
#ifdef VT_FA_ROW
        float sr[FA_MAXG];
#pragma unroll
        for (int g = 0; g < FA_MAXG; ++g) sr[g] = 0.0f;
        if (t < cn) {
            const float* kp = cache + kbase + (long long)(c0 + t) * pos_stride;
            int d = 0;
            if (k16) {
                for (; d < head_dim; d += 4) {
                    vt_f4 k4 = *(const vt_f4*)(kp + d);
#pragma unroll
                    for (int g = 0; g < FA_MAXG; ++g)
                        if (g < gb) {
                            const float* qg = qs + g * 256 + d;
                            sr[g] += qg[0] * k4.x;
                            sr[g] += qg[1] * k4.y;
                            sr[g] += qg[2] * k4.z;
                            sr[g] += qg[3] * k4.w;
                        }
                }
            }
            for (; d < head_dim; ++d) {
                float kd = kp[d];
#pragma unroll
                for (int g = 0; g < FA_MAXG; ++g)
                    if (g < gb) sr[g] += qs[g * 256 + d] * kd;
            }
#pragma unroll
            for (int g = 0; g < FA_MAXG; ++g)
                if (g < gb) sc[g * FA_CHUNK + t] = sr[g] * scale;
        }
#else
        for (int j0 = 0; j0 < cn; j0 += 2 * hp) {  // the same for the whole block
            float sg[2][FA_MAXG];
#pragma unroll
            for (int p = 0; p < 2; ++p)
#pragma unroll
                for (int g = 0; g < FA_MAXG; ++g) sg[p][g] = 0.0f;
            if (k16) {
                vt_f4 k4[2][4];
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    int j = j0 + pj + p * hp;
                    const float* kp = cache + kbase + (long long)(c0 + min(j, cn - 1)) * pos_stride;
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        int d = (lp + c * lpn) * 4;
                        k4[p][c] = {0.0f, 0.0f, 0.0f, 0.0f};
                        if (j < cn && d < head_dim) k4[p][c] = *(const vt_f4*)(kp + d);
                    }
                }
#pragma unroll
                for (int p = 0; p < 2; ++p)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        int d = (lp + c * lpn) * 4;
                        if (d < head_dim) {
#pragma unroll
                            for (int g = 0; g < FA_MAXG; ++g)
                                if (g < gb) {
                                    const float* qg = qs + g * 256 + d;
                                    sg[p][g] += qg[0] * k4[p][c].x;
                                    sg[p][g] += qg[1] * k4[p][c].y;
                                    sg[p][g] += qg[2] * k4[p][c].z;
                                    sg[p][g] += qg[3] * k4[p][c].w;
                                }
                        }
                    }
            } else {
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    int j = j0 + pj + p * hp;
                    const float* kp = cache + kbase + (long long)(c0 + min(j, cn - 1)) * pos_stride;
                    for (int d = lp; d < head_dim; d += lpn) {
                        float kd = kp[d];
#pragma unroll
                        for (int g = 0; g < FA_MAXG; ++g)
                            if (g < gb) sg[p][g] += qs[g * 256 + d] * kd;
                    }
                }
            }
#pragma unroll
            for (int p = 0; p < 2; ++p)
#pragma unroll
                for (int g = 0; g < FA_MAXG; ++g)
                    if (g < gb)
                        for (int m = lpn / 2; m > 0; m >>= 1) sg[p][g] += VT_SHFL_XOR(sg[p][g], m);
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                int j = j0 + pj + p * hp;
                if (lp == 0 && j < cn) {
#pragma unroll
                    for (int g = 0; g < FA_MAXG; ++g)
                        if (g < gb) sc[g * FA_CHUNK + j] = sg[p][g] * scale;
                }
            }
        }
#endif
        __syncthreads();
        // Warp w updates heads w, w + warps, ...: chunk max, exp, sum, correction.
        for (int g = warp; g < gb; g += warps) {
            float mx = -__uint_as_float(0x7f800000u);
            for (int j = lane; j < cn; j += VT_WARP) mx = fmaxf(mx, sc[g * FA_CHUNK + j]);
            for (int m = VT_WARP / 2; m > 0; m >>= 1) mx = fmaxf(mx, VT_SHFL_XOR(mx, m));
            float old = ms[g], nm = fmaxf(old, mx);
            float sum = 0.0f;
            for (int j = lane; j < cn; j += VT_WARP) {
                float p = expf(sc[g * FA_CHUNK + j] - nm);
                sc[g * FA_CHUNK + j] = p;
                sum += p;
            }
            sum = vt_warp_sum(sum);
            if (lane == 0) {
                float corr = expf(old - nm);  // 0 on the first chunk (old = -inf)
                cs[g] = corr;
                ls[g] = ls[g] * corr + sum;
                ms[g] = nm;
            }
        }
        __syncthreads();
        FA_HALVES(half * FA_THREADS + d0 < head_dim) {
            int d = half * FA_THREADS + d0;
            float a[FA_MAXG];
#pragma unroll
            for (int g = 0; g < FA_MAXG; ++g) a[g] = 0.0f;
            // 8: 16 the same, 32 -2% to -6% at 2,048 positions (run 85)
#pragma unroll 8
            for (int j = r; j < cn; j += R) {  // unrolled: V loads in flight together
                float vd = cache[vbase + (long long)(c0 + j) * pos_stride + d];
#pragma unroll
                for (int g = 0; g < FA_MAXG; ++g)
                    if (g < gb) a[g] += sc[g * FA_CHUNK + j] * vd;
            }
#pragma unroll
            for (int g = 0; g < FA_MAXG; ++g)
                if (g < gb) acc[half][g] = acc[half][g] * cs[g] + a[g];
        }
        __syncthreads();  // sc[], cs[] are rewritten by the next chunk
    }
    // Add the R partial sums of each element through sc[] (gb * R * hd_lanes <= its size).
    FA_HALVES(half * FA_THREADS < head_dim) {  // the same for the whole block
        int d = half * FA_THREADS + d0;
        bool mine = d < head_dim;
#pragma unroll
        for (int g = 0; g < FA_MAXG; ++g)
            if (g < gb) sc[(g * R + r) * hd_lanes + d0] = mine ? acc[half][g] : 0.0f;
        __syncthreads();
        if (r == 0 && mine) {
            for (int g = 0; g < gb; ++g) {
                float v = 0.0f;
                for (int k = 0; k < R; ++k) v += sc[(g * R + k) * hd_lanes + d0];
                long long oh = (long long)i * n_heads + h0 + g;
                if (splits == 1 || direct) {  // r == 0 && mine: whole warps (head_dim % 32)
                    vt_attn_out(out, xq, n, n_heads, head_dim, oh, d, ok ? v / ls[g] : vt_nan());
                } else {
                    float* pp = part + (oh * splits + s) * (head_dim + 2);
                    pp[d] = v;
                    if (d == 0) {
                        pp[head_dim] = ms[g];
                        pp[head_dim + 1] = ls[g];
                    }
                }
            }
        }
        __syncthreads();
    }
    vt_attention_split_end<CLUSTER>(out, part, i, n_heads, h0, gb, head_dim, splits, ok, counts,
                                    xq, n);
}

extern "C" __global__ void VT_FA_BOUNDS attention_split(
    float* out, float* part, const float* q, const float* cache, const int* slots,
    const int* positions, int n, int n_heads, int n_kv, int head_dim, int n_slots, int n_layers,
    int max_len, int layer, float scale, int gb, int splits, int min_per_split, int tile,
    int* counts, unsigned char* xq, VtPrefetch pf) {
    vt_attention_split<false>(out, part, q, cache, slots, positions, n, n_heads, n_kv, head_dim,
                              n_slots, n_layers, max_len, layer, scale, gb, splits,
                              min_per_split, tile, counts, xq, pf);
}

// attention_split with its combine in the same launch (GpuBackend.attention_cluster; NVIDIA
// sm_90 and later, not in the HIP branch): the grid's z is FA_CLUSTER splits, each (row,
// group)'s splits one cluster (__cluster_dims__), so the cluster's barrier, not a second
// launch or a device-wide counter, tells its first block that every partial is written.
// The same arguments as attention_split's (counts unused); the outputs are bit for bit
// attention_split's with FA_CLUSTER splits and attention_combine (the warp combine's sums).
#if !defined(VT_HIP) && !defined(VT_EMULATE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
extern "C" __global__ void __cluster_dims__(1, 1, FA_CLUSTER) attention_split_cluster(
    float* out, float* part, const float* q, const float* cache, const int* slots,
    const int* positions, int n, int n_heads, int n_kv, int head_dim, int n_slots, int n_layers,
    int max_len, int layer, float scale, int gb, int splits, int min_per_split, int tile,
    int* counts, unsigned char* xq, VtPrefetch pf) {
    vt_attention_split<true>(out, part, q, cache, slots, positions, n, n_heads, n_kv, head_dim,
                             n_slots, n_layers, max_len, layer, scale, gb, splits,
                             min_per_split, tile, counts, xq, pf);
}
#endif

// attention_split's partials combined by a second launch: one block per (row, query head).
extern "C" __global__ void VT_FA_BOUNDS attention_combine(
    float* out, const float* part, const int* slots, const int* positions, int n, int n_heads,
    int head_dim, int n_slots, int max_len, int splits, int tile, int min_per_split,
    unsigned char* xq) {
    __shared__ float wt[FA_THREADS];
    __shared__ float red[FA_THREADS];
    __shared__ int ired[FA_THREADS / VT_WARP];
    vt_launch_dependents();
    int oh = blockIdx.x, i = oh / n_heads;
    if (vt_tile_is_tiled(slots, positions, n, n_slots, max_len, i - i % max(tile, 1), tile, ired))
        return;  // attention_tiled wrote this row
    int slot = slots[i], pos = positions[i];
    bool ok = slot >= 0 && slot < n_slots && pos >= 0 && pos < max_len;
    int length = ok ? pos + 1 : 0;  // attention_split's splits: those with positions first
    int per = max((length + splits - 1) / splits, min_per_split);
    int used = min(splits, (length + per - 1) / per);
    vt_grid_wait();  // the partials come from attention_split
#if VT_FA_DIRECT
    if (used == 1) return;  // attention_split wrote the row (waited for: overlapped, its
                            // end must still follow the split kernel's for the next kernel)
#endif
    vt_attention_combine_block(out, part, oh, head_dim, splits, used, ok, wt, red, xq, n,
                               n_heads);
}
