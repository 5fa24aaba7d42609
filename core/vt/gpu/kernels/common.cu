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
//   WT_Q: a code q per value plus one (scale, offset) pair per block of 2**lg_block values
//         along a row; value = scale * q + offset, rounded exactly as gguf's dequantization
//         rounds it (every GGML block type vt reads fits this form). How they are stored is
//         the weight's layout: the kernels' "lg" argument is lg_block | VT_Q_* flags (below).

#if defined(__HIPCC_RTC__) || defined(__HIP_PLATFORM_AMD__)
#define VT_HIP 1
#endif

#ifndef VT_WARP
#error "compile with -DVT_WARP=<the device's warp size>"
#endif

#ifndef VT_EMULATE
#ifdef VT_HIP
#define VT_SHFL_XOR(v, m) __shfl_xor((v), (m), VT_WARP)
#define VT_SHFL_IDX(v, src) __shfl((v), (src), VT_WARP)
// Lane src of the caller's group of 32 lanes (the int8 mma kernels' warp; a wave64 is two).
#define VT_SHFL32(v, src) __shfl((v), (src), 32)
#else
#define VT_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m), VT_WARP)
#define VT_SHFL_IDX(v, src) __shfl_sync(0xffffffffu, (v), (src), VT_WARP)
#define VT_SHFL32(v, src) __shfl_sync(0xffffffffu, (v), (src), 32)
#endif
#define VT_DYN_SHARED(T, name) extern __shared__ T name[]
// The lanes of a group of 32 (the int8 mma kernels' warp) meet: shared memory one lane
// wrote is then seen by the others. A wave64 runs its lanes in step and its LDS accesses in
// order, so there only the compiler is held.
#ifdef VT_HIP
#define VT_SYNC32() __builtin_amdgcn_wave_barrier()
#else
#define VT_SYNC32() __syncwarp()
#endif
#endif

typedef unsigned int vt_u32;
typedef unsigned long long vt_u64;
typedef unsigned short vt_u16;
typedef signed char vt_i8;

#define WT_F32 0
#define WT_F16 1
#define WT_BF16 2
#define WT_Q 3
// WT_Q layouts (vt.gpu.weights.LAYOUTS), flags of the kernels' lg argument over lg_block:
// VT_Q_NIB: 4-bit codes two a byte, each 16 values in 8 bytes (value j the low nibble of
// byte j, value j + 8 its high nibble), else int8 codes; VT_Q_NIB8: a nibble n is the code
// n - 8; VT_Q_HALF: scales and offsets IEEE half, else float32; VT_Q_ONE: a scale per block
// and no offset (0), else (scale, offset) pairs. Every layout yields the same float32 values.
#define VT_Q_NIB 0x100
#define VT_Q_NIB8 0x200
#define VT_Q_HALF 0x400
#define VT_Q_ONE 0x800
#define VT_Q_LG(lg) ((lg) & 0xff)
// A tool may fix the flags at compile time (bench_variant.py --kdefine VT_Q_FLAGS=0xc00:
// every WT_Q weight taken to be in that layout) to measure what reading them costs.
#ifdef VT_Q_FLAGS
#define VT_QF(lg) (((lg) & 0xff) | (VT_Q_FLAGS))
#else
#define VT_QF(lg) (lg)
#endif
// Not a stored format: WT_Q weights against int8 activations (the decode kernels' x is then
// vt_quantize_rows's packed rows, not float32; see matmul_int8.cu).
#define WT_Q8A 4

// ------------------------------------------------------------------------ overlapped launches
//
// Programmatic dependent launch (sm_90+, PTX griddepcontrol): a kernel the host launches
// overlapped (GpuRuntime.launch_overlapped; GpuBackend's _OVERLAP names them) may start
// while the stream's previous kernel still runs. It reads only weights (never written
// during a step) before vt_grid_wait(), which returns once the previous kernel has finished
// and its writes are visible; everything else comes after. vt_launch_dependents() at a
// kernel's start lets the next overlapped kernel's blocks start as soon as all of this
// kernel's blocks have (so none of them waits behind its successor). Both are no-ops on
// HIP, in the emulator, before sm_90, and for a kernel launched the plain way.
#if !defined(VT_HIP) && !defined(VT_EMULATE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define VT_PDL 1
#endif
__device__ __forceinline__ void vt_grid_wait() {
#ifdef VT_PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void vt_launch_dependents() {
#ifdef VT_PDL
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// ------------------------------------------------------------------------ helpers

// Bring the 128-byte line at p into L2 (no registers; a hint, a no-op off NVIDIA). Safe
// before vt_grid_wait() even on a line the previous kernel writes: its store lands in L2.
__device__ __forceinline__ void vt_prefetch_l2(const void* p) {
#if !defined(VT_HIP) && !defined(VT_EMULATE)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// Byte ranges of weights the ops after a launch will read (GpuBackend.op_prefetch's hint,
// passed by value to the kernel that carries it; n[r] = 0: none). The ranges start on
// 256-byte boundaries (a weight's allocation and its scales within it).
#define VT_PF_RANGES 6
struct VtPrefetch {
    const char* p[VT_PF_RANGES];
    long long n[VT_PF_RANGES];
};

// Every thread of the launch brings its share of pf's 128-byte lines into L2: a kernel
// that waits on memory latency (attention at a decode step) leaves DRAM idle, and the next
// ops' weights then come from L2. Call it before vt_grid_wait and any early return.
__device__ __forceinline__ void vt_prefetch_ranges(const VtPrefetch& pf) {
    long long threads = (long long)gridDim.x * gridDim.y * gridDim.z * blockDim.x;
    long long id =
        (((long long)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x +
        threadIdx.x;
#pragma unroll
    for (int r = 0; r < VT_PF_RANGES; ++r)
        for (long long e = id * 128; e < pf.n[r]; e += threads * 128) vt_prefetch_l2(pf.p[r] + e);
}

// 16 bytes from global to shared memory with no register in between (cp.async, sm_80+:
// the copy lands while the thread goes on; vt_copy_wait() waits for this thread's copies).
// Elsewhere (HIP, the emulator, older parts) a plain load and store.
#if !defined(VT_HIP) && !defined(VT_EMULATE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define VT_CP_ASYNC 1
#endif
// KEEP_L1 (the default): .ca, through L1; false: .cg (L2 only), for bytes a launch reads
// once (a weight's codes: the int8 mma kernels' stage), which L1 would keep for nothing.
template <bool KEEP_L1 = true>
__device__ __forceinline__ void vt_copy16_async(void* smem, const void* g) {
#ifdef VT_CP_ASYNC
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    // .ca: every block of a launch copies the same few lines, so an SM's blocks share them;
    // .cg made each block's copies an L2 round trip on those hot lines (run 101:
    // swiglu_psq_gemv2_q 34.8 us a call against swiglu_gemv2_q's ~13).
    if (KEEP_L1)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
    else asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
#else
    vt_u64 a = ((const vt_u64*)g)[0], b = ((const vt_u64*)g)[1];
    ((vt_u64*)smem)[0] = a, ((vt_u64*)smem)[1] = b;
#endif
}
__device__ __forceinline__ void vt_copy_wait() {
#ifdef VT_CP_ASYNC
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// A global load that skips L1 (ld.global.cg): what other blocks of the running kernel wrote
// before a __threadfence is read from L2, never from a line this SM kept. asm volatile:
// kept in program order (callers issue a batch of them before using any).
__device__ __forceinline__ float vt_ld_l2(const float* p) {
#if !defined(VT_HIP) && !defined(VT_EMULATE)
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
#else
    return *(const volatile float*)p;
#endif
}

// Every thread of a block calls it once the block's stores are done: true, in every thread,
// in the last of `total` blocks to arrive on *count (which that block sets back to 0 for the
// next launch). One thread's add, acquire-release at device scope after the block's barrier,
// publishes the block's stores (the barrier orders them before the release) and, in the last
// block, makes every other block's visible to its loads, which must skip L1 (vt_ld_l2).
// Until run 95 every thread ran a sequentially consistent fence instead (__threadfence:
// MEMBAR.SC.GPU and an L1 invalidate in each); the tails it ends still cost 4-7 us a launch
// under ncu either way (run 96: docs/gpu.md). HIP: clang's __hip_atomic_fetch_add with
// __ATOMIC_ACQ_REL and __HIP_MEMORY_SCOPE_AGENT.
__device__ __forceinline__ int vt_add_acq_rel(int* p, int v) {
#if defined(VT_EMULATE)
    return atomicAdd(p, v);  // the emulator's: sequentially consistent
#elif defined(VT_HIP)
    return __hip_atomic_fetch_add(p, v, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
#else
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;"
                 : "=r"(old)
                 : "l"(p), "r"(v)
                 : "memory");
    return old;
#endif
}

__device__ __forceinline__ bool vt_last_block(int* count, int total) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        last = vt_add_acq_rel(count, 1) == total - 1;
        if (last) *count = 0;  // every block has arrived: nothing else touches it this launch
    }
    __syncthreads();
    return last;
}

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

// float to IEEE half, rounded to nearest even (as cvt.rn.f16.f32): overflow to inf,
// subnormals kept, NaN stays NaN. In plain integer arithmetic: no header has __half here.
__device__ __forceinline__ vt_u16 vt_float_to_half(float f) {
    vt_u32 x = __float_as_uint(f);
    vt_u32 sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
    if (mag >= 0x7f800000u) return (vt_u16)(sign | 0x7c00u | (mag > 0x7f800000u ? 0x200u : 0u));
    if (mag >= 0x477ff000u) return (vt_u16)(sign | 0x7c00u);  // rounds to 65520 or more
    if (mag < 0x38800000u) {  // below 2**-14: a subnormal half, round(f * 2**24)
        if (mag < 0x33000000u) return (vt_u16)sign;  // at most 2**-25: rounds to zero
        vt_u32 e = mag >> 23, m = (mag & 0x7fffffu) | 0x800000u;
        vt_u32 shift = 126u - e;  // 14..24
        vt_u32 h = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (h & 1u))) h += 1u;
        return (vt_u16)(sign | h);
    }
    vt_u32 r = mag - 0x38000000u;       // exponent rebiased from 127 to 15
    r += 0xfffu + ((r >> 13) & 1u);     // round the 13 dropped bits to nearest even
    return (vt_u16)(sign | (r >> 13));
}

__device__ __forceinline__ float vt_bf16_to_float(vt_u16 h) {
    return __uint_as_float((vt_u32)h << 16);
}

// IEEE half to float for a weight's scales: the conversion instruction on NVIDIA (exact,
// subnormals included), vt_half_to_float elsewhere.
__device__ __forceinline__ float vt_h2f(vt_u16 h) {
#if !defined(VT_HIP) && !defined(VT_EMULATE)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return vt_half_to_float(h);
#endif
}

struct alignas(8) vt_f2 {
    float x, y;
};

// (scale, offset) of block b of a WT_Q weight whose pairs are at sm, in layout lg.
__device__ __forceinline__ vt_f2 vt_qso(const float* sm, int lg, long long b) {
    lg = VT_QF(lg);
    if (lg & VT_Q_HALF) {
        if (lg & VT_Q_ONE) return {vt_h2f(((const vt_u16*)sm)[b]), 0.0f};
        vt_u32 p = ((const vt_u32*)sm)[b];
        return {vt_h2f((vt_u16)(p & 0xffffu)), vt_h2f((vt_u16)(p >> 16))};
    }
    if (lg & VT_Q_ONE) return {sm[b], 0.0f};
    return *(const vt_f2*)(sm + 2 * b);
}

// A word of four nibbles' codes (the low (hi = 0) or high nibbles of 4 bytes) as four int8
// codes, less 8 each for VT_Q_NIB8 (x = n ^ 8 is n - 8 in 4 bits; its bit 3 spread over the
// byte's high bits sign-extends it, without a carry between bytes).
__device__ __forceinline__ vt_u32 vt_unnib(vt_u32 word, int hi, int lg) {
    lg = VT_QF(lg);
    vt_u32 n = (hi ? word >> 4 : word) & 0x0f0f0f0fu;
    if (lg & VT_Q_NIB8) {
        vt_u32 x = n ^ 0x08080808u;
        n = x | ((x & 0x08080808u) * 0x1eu);
    }
    return n;
}

// One weight element. Quantized: scale * q + offset with two roundings, as numpy does.
template <int WT>
__device__ __forceinline__ float vt_wload(const void* data, const float* sm, int lg_block,
                                          long long idx) {
    if (WT == WT_F32) return ((const float*)data)[idx];
    if (WT == WT_F16) return vt_half_to_float(((const vt_u16*)data)[idx]);
    if (WT == WT_BF16) return vt_bf16_to_float(((const vt_u16*)data)[idx]);
    vt_f2 so = vt_qso(sm, lg_block, idx >> VT_Q_LG(lg_block));
    int code;
    if (VT_QF(lg_block) & VT_Q_NIB) {
        vt_u32 byte = ((const unsigned char*)data)[(idx >> 4) * 8 + (idx & 7)];
        code = (int)(vt_i8)(vt_unnib(byte, (int)(idx >> 3) & 1, lg_block) & 0xffu);
    } else {
        code = ((const vt_i8*)data)[idx];
    }
    return __fadd_rn(__fmul_rn(so.x, (float)code), so.y);
}

// Block-wide reductions over shared scratch of blockDim.x entries (blockDim a power of 2).
// Every thread gets the result. Fixed tree order: deterministic run to run.
template <typename T>  // float, unsigned int (sample), double (logprobs)
__device__ T vt_block_sum(T v, T* red) {
    int t = threadIdx.x;
    red[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) red[t] = red[t] + red[t + s];
        __syncthreads();
    }
    T r = red[0];
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

__device__ __forceinline__ float vt_warp_sum(float v) {
    for (int m = VT_WARP / 2; m > 0; m >>= 1) v += VT_SHFL_XOR(v, m);
    return v;
}

// The block's maximum in two barriers, as vt_block_sum_warps below (same constraints).
__device__ float vt_block_max_warps(float v, float* red) {
    int lane = threadIdx.x % VT_WARP, warp = threadIdx.x / VT_WARP;
    int warps = blockDim.x / VT_WARP;
    for (int m = VT_WARP / 2; m > 0; m >>= 1) v = fmaxf(v, VT_SHFL_XOR(v, m));
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = lane < warps ? red[lane] : -__uint_as_float(0x7f800000u);
    for (int m = VT_WARP / 2; m > 0; m >>= 1) r = fmaxf(r, VT_SHFL_XOR(r, m));
    __syncthreads();  // red[] may be reused by the caller
    return r;
}

// A block-wide sum in two barriers instead of log2(blockDim) (latency-bound kernels of one
// block per row: rms_norm): warps reduce by shuffles, then the first warp sums their
// results (blockDim a multiple of the warp, at most VT_WARP warps; red holds a warp's worth).
// Every thread gets the result; the order is fixed, so it is deterministic run to run.
__device__ float vt_block_sum_warps(float v, float* red) {
    int lane = threadIdx.x % VT_WARP, warp = threadIdx.x / VT_WARP;
    int warps = blockDim.x / VT_WARP;
    v = vt_warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = lane < warps ? red[lane] : 0.0f;
    r = vt_warp_sum(r);
    __syncthreads();  // red[] may be reused by the caller
    return r;
}

// Shared by the weights' kernels and the other module's (attention): the two modules
// compile apart (GpuBackend: each part's kernels build on their own helper thread).
struct alignas(16) vt_f4 {
    float x, y, z, w;
};

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

// One block of 32 values of row r (block bc: columns bc * 32 + lane, a value a lane, the
// whole warp) packed as above: quantize_rows's, quantize_norm_rows' and attention's int8
// hand-off's (attention.cu, GpuBackend.attention_q8a). The max and the sums by shuffles.
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

// RoPE: per-pair inverse frequencies, already divided by the linear factor, in float64
// (the reference computes theta in float64); passed by value so a step uploads nothing.
#define ROPE_MAX_PAIRS 128
struct RopeTable {
    double inv[ROPE_MAX_PAIRS];
};

// The pair (a, b) rotated by the angle whose cosine and sine are c and s, each product and
// sum rounded as the reference's float32 (rope_kv_store, qkv_rope_mma*).
__device__ __forceinline__ void vt_rope_pair(float a, float b, float c, float s, float* ra,
                                             float* rb) {
    *ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    *rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

// Element (pos, slot, layer, kv, head, d) of the position-major cache (vt.KVLayout).
__device__ __forceinline__ long long vt_kv_index(int pos, int slot, int layer, int kv,
                                                 int n_slots, int n_layers, int row) {
    return ((((long long)pos * n_slots + slot) * n_layers + layer) * 2 + kv) * row;
}

// rms_norm's first RN_KEEP values of x a thread, kept in registers for its second pass
// (embedding_norm.cu; quantize_norm_rows too, matmul_int8.cu).
#define RN_KEEP 8
// rms_norm's scale 1 / sqrt(mean(x**2) + eps) of the row xr (dim values), with its values
// t, t + blockDim.x, ... (the first RN_KEEP) read into keep; the sums in rms_norm's order,
// so every kernel that calls it (quantize_norm_rows too) has rms_norm's bits.
__device__ __forceinline__ float vt_rn_scale(const float* xr, int dim, float eps,
                                             float (&keep)[RN_KEEP], float* red) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < RN_KEEP; ++i) {
        int d = threadIdx.x + i * blockDim.x;
        keep[i] = d < dim ? xr[d] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < RN_KEEP; ++i)
        if (threadIdx.x + i * blockDim.x < dim) ss = __fadd_rn(ss, __fmul_rn(keep[i], keep[i]));
    for (int d = threadIdx.x + RN_KEEP * blockDim.x; d < dim; d += blockDim.x)
        ss = __fadd_rn(ss, __fmul_rn(xr[d], xr[d]));
    ss = vt_block_sum_warps(ss, red);
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

// min(v) over the block (every thread gets it); red holds a value per warp.
__device__ __forceinline__ int vt_block_min_int(int v, int* red) {
    for (int m = VT_WARP / 2; m > 0; m >>= 1) v = min(v, (int)VT_SHFL_XOR(v, m));
    if (threadIdx.x % VT_WARP == 0) red[threadIdx.x / VT_WARP] = v;
    __syncthreads();
    int r = red[0];
    for (int w = 1; w < (int)(blockDim.x / VT_WARP); ++w) r = min(r, red[w]);
    __syncthreads();  // red[] is reused by the next reduction
    return r;
}

// Many rows (prefill) go to two kernels, split by tiles of `tile` consecutive rows:
// attention_tiled takes a tile whose valid rows belong to at most two sequences (slots),
// attention_split (+ attention_combine) the rows of every other tile (decode rows of many
// sequences beside a prefill chunk: one tiled block would take them one pass each). Both
// decide from the same device data by this function, so each row is written once. A
// barrier: every thread of the block calls it, and gets the same answer. tile == 0: no
// tiled launch, every row is split's.
__device__ bool vt_tile_is_tiled(const int* slots, const int* positions, int n, int n_slots,
                                 int max_len, int i0, int tile, int* red) {
    if (tile <= 0) return false;
    int lo = 0x7fffffff, hi = 0x7fffffff;  // min slot, -(max slot)
    for (int r = threadIdx.x; r < tile && i0 + r < n; r += blockDim.x) {
        int s = slots[i0 + r], p = positions[i0 + r];
        if (s >= 0 && s < n_slots && p >= 0 && p < max_len) lo = min(lo, s), hi = min(hi, -s);
    }
    lo = vt_block_min_int(lo, red);
    hi = -vt_block_min_int(hi, red);
    int third = 1;  // 0 where a valid row's slot is strictly between the two
    for (int r = threadIdx.x; r < tile && i0 + r < n; r += blockDim.x) {
        int s = slots[i0 + r], p = positions[i0 + r];
        if (s > lo && s < hi && p >= 0 && p < max_len) third = 0;
    }
    return vt_block_min_int(third, red) == 1;
}
