// bench_stream.py's kernel (not part of vt's kernels): a batch-1 decode step's weight
// stream as one persistent launch, to measure what docs/gpu.md's persistent decode plan
// would gain before vt is rebuilt around it.
//
// The step is a list of phases (struct Phase): gemv phases read a weight (int8 codes [n, k] and
// an IEEE-half scale per 32 values, Q8_0's bytes) and a vector x written by the phase before
// (the RMSNorm before a projection folded into it, scaled late); the stand-in for attention
// (kind 2) reads no weight and only takes time on 64 blocks (spin_ns). Each block reads the
// launch's phases into shared memory once. Phase p's work waits for every block to have
// finished phase p - 1 (a counter per phase, released by each block, spun on with acquire;
// --define DP4A: x as int8 codes and integer dot products). A block's weight chunks form one
// stream across all phases: with RING, its last warp (the producer) copies the next chunks into
// a ring of shared-memory slots (cp.async.bulk; a "full" and an "empty" mbarrier a slot) as
// soon as a slot is free, so the memory keeps streaming while the consumer warps wait on a
// counter or run a phase without weights; the consumer warps take the rows of a phase in turn
// (row i of the block's share on warp i mod WARPS), each on its own: no barrier between them
// inside a phase. Without RING they read their codes from global memory as vt's gemv kernels
// do. sm_90 (bulk copies); NVIDIA only.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

#ifndef WARPS
#define WARPS 16  // consumer warps; one more warp copies the weights
#endif
#define THREADS (32 * (WARPS + 1))
#define CONSUMERS (32 * WARPS)
#define MAX_PHASES 128
// After the slots: x in shared memory, rows of up to 8192 values (32 KB; bench_stream.py)

struct Phase {
    int kind;  // 0 gemv, 1 swiglu (rows gate, up, gate, up, ...), 2 attention's stand-in
    int n, k;  // weight rows and values a row (kind 2: n is the vector's length)
    int rc;    // rows a chunk
    int nchunks, spin_ns, pad0, pad1;
    const signed char* codes;
    const u16* scales;
    const float* x;
    float* y;
    const float* residual;  // y = residual + W x (may alias y)
    const float* nw;        // folded RMSNorm: y = scale(x) * W (x * nw), scale late
};

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ float half_f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}
__device__ __forceinline__ uint4 ld_nc(const void* p) {
    uint4 c;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(c.x), "=r"(c.y), "=r"(c.z), "=r"(c.w)
        : "l"(p));
    return c;
}

__device__ __forceinline__ void bar_wait(u64* bar, u32 parity) {
    u32 a = smem_u32(bar), done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(a), "r"(parity)
            : "memory");
    }
}
// One bulk copy of bytes (a multiple of 16, both addresses 16-byte aligned) into shared
// memory, counted by the slot's mbarrier.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
}
__device__ __forceinline__ void bar_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}

// The block's stream of weight chunks: phase pp's chunk cc, then cc + gridDim.x, ...
struct Cursor {
    int pp, cc;
};
__device__ __forceinline__ void advance(const Phase* ph, int p1, Cursor& c, bool first) {
    if (!first) c.cc += gridDim.x;
    while (c.pp < p1 && (ph[c.pp].kind > 1 || c.cc >= ph[c.pp].nchunks)) {
        ++c.pp;
        c.cc = blockIdx.x;
    }
}
__device__ __forceinline__ int chunk_rows(const Phase& p, int cc) {
    return min(p.rc, p.n - cc * p.rc);
}


__device__ __forceinline__ void bar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void bar_consumers() {  // the consumer warps only (not the producer)
    asm volatile("bar.sync 1, %0;" ::"r"(CONSUMERS) : "memory");
}

// Row r's 16 codes of unit u and their scale, from the slot (ring) or global memory.
__device__ __forceinline__ uint4 load_unit(const unsigned char* cb, const u16* sb, int r, int k,
                                           int u, bool ring, float& sc) {
    size_t at = (size_t)r * k + u * 16;
    int si = r * (k / 32) + u / 2;
    sc = half_f(ring ? sb[si] : __ldg(sb + si));
    return ring ? *(const uint4*)(cb + at) : ld_nc(cb + at);
}

// One item of a weight phase: a row (kind 0) or a gate and up pair (kind 1): the dot
// product(s) of the warp's lanes over the row's 16-value units, summed in the warp.
template <int NR>
__device__ __forceinline__ void dot_rows(const unsigned char* cb, const u16* sb, int r, int k,
                                         bool ring, const float4* xs4, int lane, float* out) {
    int upr = k / 16;
    float acc[NR][2];
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i][0] = acc[i][1] = 0.0f;
#ifdef DP4A  // x as int8 codes and a scale per 32 (llama.cpp's q8_1 numerics, not vt's batch 1)
    const signed char* xq = (const signed char*)xs4;
    const float* xd = (const float*)(xq + k);
#pragma unroll 2
    for (int u = lane; u < upr; u += 32) {
        uint4 xc = *(const uint4*)(xq + u * 16);
        float dx = xd[u / 2];
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            float sc;
            uint4 c4 = load_unit(cb, sb, r + i, k, u, ring, sc);
            int d = __dp4a((int)c4.x, (int)xc.x, 0);
            d = __dp4a((int)c4.y, (int)xc.y, d);
            d = __dp4a((int)c4.z, (int)xc.z, d);
            d = __dp4a((int)c4.w, (int)xc.w, d);
            acc[i][u & 1] += sc * dx * (float)d;
        }
    }
#else
#pragma unroll 2
    for (int u = lane; u < upr; u += 32) {
        float4 xv[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) xv[c] = xs4[c * upr + u];
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            float sc;
            uint4 c4 = load_unit(cb, sb, r + i, k, u, ring, sc);
            u32 w4[4] = {c4.x, c4.y, c4.z, c4.w};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                float xa[4] = {xv[c].x, xv[c].y, xv[c].z, xv[c].w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    float q = (float)(int)(signed char)((w4[c] >> (8 * j)) & 0xffu);
                    acc[i][c & 1] += __fadd_rn(__fmul_rn(sc, q), 0.0f) * xa[j];
                }
            }
        }
    }
#endif
#pragma unroll
    for (int i = 0; i < NR; ++i) out[i] = warp_sum(acc[i][0] + acc[i][1]);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    stream_step(const Phase* phases, int p0, int p1, int* counters, int epoch, int wait,
                int ring, int slots, int slot_bytes, int* err) {
    extern __shared__ __align__(128) unsigned char smem[];  // the ring's slots, then x
    float* xs = (float*)(smem + (size_t)slots * slot_bytes);
    __shared__ __align__(8) u64 full[16], empty[16];
    __shared__ float nred[WARPS];
    __shared__ Phase sph[MAX_PHASES];  // the launch's phases, read once
    int t = threadIdx.x, lane = t % 32, warp = t / 32;
    int G = gridDim.x;
    for (int i = t; i < p1 - p0; i += THREADS) sph[i] = phases[p0 + i];
    if (t == 0) {
        for (int s = 0; s < slots; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(&empty[s])),
                         "r"(WARPS));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == WARPS) {  // the producer: every chunk of the block's stream, in order
        if (!ring || lane != 0) return;
        Cursor c = {p0, (int)blockIdx.x};
        const Phase* ph = sph - p0;  // indexed by phase number
        advance(ph, p1, c, true);
        for (int i = 0; c.pp < p1; ++i, advance(ph, p1, c, false)) {
            const Phase& p = ph[c.pp];
            int s = i % slots;
            if (i >= slots) bar_wait(&empty[s], (u32)((i / slots - 1) & 1));
            int rows = chunk_rows(p, c.cc);
            long long r0 = (long long)c.cc * p.rc;
            u32 cb = (u32)(rows * p.k), sb = (u32)(rows * (p.k / 16));
            unsigned char* dst = smem + (size_t)s * slot_bytes;
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            bar_expect(&full[s], cb + sb);
            bulk_copy(dst, p.codes + r0 * p.k, cb, &full[s]);
            bulk_copy(dst + cb, (const unsigned char*)p.scales + r0 * (p.k / 16), sb, &full[s]);
        }
        return;
    }

    int used = 0;  // chunks of the stream consumed (the slot and its parity)
    for (int pi = p0; pi < p1; ++pi) {
        const Phase& p = sph[pi - p0];
        if (wait && pi > p0 && t == 0) {
            int target = G * epoch;
            long long it = 0;
            // A watchdog, not a hang: give up (and say where) after about a second, or at
            // once after another wait gave up.
            while (ld_acquire(&counters[pi - 1]) < target) {
                if ((++it & 1023) == 0 && (it > (1ll << 23) || ld_acquire(err))) {
                    atomicCAS(err, 0, pi);
                    break;
                }
            }
        }
        bar_consumers();
        if (p.kind <= 1) {
            // x (times the norm's weight where folded) into shared memory, permuted so that
            // a lane's four float4s of unit u are xs4[c * upr + u], c = 0..3: the lanes of a
            // warp read consecutive float4s (no bank conflicts).
            float ss = 0.0f;
#ifdef DP4A  // a warp per 32 values: their codes and scale (max |x| / 127, rounded to even)
            for (int b = warp; b < p.k / 32; b += WARPS) {
                int e = b * 32 + lane;
                float xe = ld_cg(p.x + e);
                if (p.nw) {
                    ss += xe * xe;
                    xe *= p.nw[e];
                }
                float amax = fabsf(xe);
#pragma unroll
                for (int m = 16; m >= 1; m >>= 1)
                    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
                float d = amax / 127.0f;
                ((signed char*)xs)[e] = (signed char)(d > 0.0f ? __float2int_rn(xe / d) : 0);
                if (lane == 0) ((float*)((signed char*)xs + p.k))[b] = d;
            }
#else
            int upr = p.k / 16;
            for (int e = t; e < p.k; e += CONSUMERS) {
                float xe = ld_cg(p.x + e);
                if (p.nw) {
                    ss += xe * xe;
                    xe *= p.nw[e];
                }
                xs[((e % 16) / 4 * upr + e / 16) * 4 + e % 4] = xe;
            }
#endif
            if (p.nw) {
                ss = warp_sum(ss);
                if (lane == 0) nred[warp] = ss;
            }
            bar_consumers();
            float scale = 1.0f;
            if (p.nw) {
                float q = 0.0f;
                for (int v = 0; v < WARPS; ++v) q += nred[v];
                scale = 1.0f / sqrtf(q / (float)p.k + 1e-5f);
            }
            const float4* xs4 = (const float4*)xs;
            int per = p.kind == 1 ? 2 : 1;  // rows an item (gate and up: a pair)
            int item = 0;                   // items of this phase's chunks so far (this block)
            for (int cc = blockIdx.x; cc < p.nchunks; cc += G, ++used) {
                int rows = chunk_rows(p, cc), items = rows / per;
                long long r0 = (long long)cc * p.rc;
                const unsigned char* cb;
                const u16* sb;
                int s = used % slots;
                if (ring) {
                    cb = smem + (size_t)s * slot_bytes;
                    sb = (const u16*)(cb + rows * p.k);
                    bar_wait(&full[s], (u32)((used / slots) & 1));
                } else {
                    cb = (const unsigned char*)p.codes + r0 * p.k;
                    sb = p.scales + r0 * (p.k / 32);
                }
                int first = ((warp - item) % WARPS + WARPS) % WARPS;  // this warp's first item
                for (int i = first; i < items; i += WARPS) {
                    long long o = r0 / per + i;  // the output
                    bool res = p.kind == 0 && p.residual && lane == 0;
                    float rv = res ? ld_cg(p.residual + o) : 0.0f;  // in flight meanwhile
                    float d[2];
                    if (per == 2) {
                        dot_rows<2>(cb, sb, 2 * i, p.k, ring, xs4, lane, d);
                    } else {
                        dot_rows<1>(cb, sb, i, p.k, ring, xs4, lane, d);
                    }
                    if (p.kind == 1 && lane == 0) {
                        float g = d[0] * scale, up = d[1] * scale;
                        p.y[o] = g / (1.0f + expf(-g)) * up;
                    } else if (p.kind == 0 && lane == 0) {
                        p.y[o] = res ? rv + d[0] * scale : d[0] * scale;
                    }
                }
                item += items;
                if (ring) {
                    __syncwarp();
                    if (lane == 0) bar_arrive(&empty[s]);
                }
            }
        } else if (p.kind == 2) {  // attention's stand-in: 64 blocks copy x, taking spin_ns
            if ((int)blockIdx.x < 64) {
                u64 t0 = now_ns();
                int per = (p.n + 63) / 64;
                for (int i = t; i < per; i += CONSUMERS) {
                    int o = blockIdx.x * per + i;
                    if (o < p.n) p.y[o] = ld_cg(p.x + o);
                }
                if (t == 0)
                    while (now_ns() - t0 < (u64)p.spin_ns) {
                    }
            }
        }
        bar_consumers();
        if (t == 0)  // release: the block's writes before the count (no fence stall)
            asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(&counters[pi]) : "memory");
    }
}
