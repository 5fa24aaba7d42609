// ------------------------------------------------------------------------ rope

// RopeTable and vt_rope_pair: common.cu (the int8 group's qkv_rope_mma kernels rotate too).

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
        vt_rope_pair(v[ia], v[ib], c, s, &v[ia], &v[ib]);
    }
}

// ------------------------------------------------------------------------ KV cache

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
        float ra, rb;
        vt_rope_pair(vec[ia], vec[ib], c, s, &ra, &rb);
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


// qkv then rope_kv_store for one row (the qkv_rope_kv_store op at batch 1), on the gemv
// kernels' block (vt_gv_rows, matmul_gemv.cu; the host's checks as for qkv_gemv*_q): a block per
// rotated pair of q or k features ((2i, 2i + 1), neox (i, i + head_dim / 2), of one head)
// or per two consecutive v features. Thread 0 adds the biases, rotates the pair as
// rope_kv_store does (the same roundings) and stores it into q, k or v and, for k and v,
// into the cache (skipped for an out-of-range slot or position, as kv_store). So q, k, v
// and the cache hold what qkv_gemv2_q and rope_kv_store would leave, in one launch, and
// the pair's rotation needs no second pass over q and k. Launched overlapped (common.cu).
template <bool NORM, bool PSQ = false>
__device__ void vt_qkv_rope_gemv(
    float* q, float* k, float* v, const float* x, const void* wq, const float* sq, int lgq,
    const float* bq, const void* wk, const float* sk, int lgk, const float* bk,
    const void* wv, const float* sv, int lgv, const float* bv, int n_heads, int n_kv,
    int head_dim, int K, int neox, const int* positions, const int* slots, float* cache,
    int n_slots, int n_layers, int max_len, int layer, const RopeTable& table,
    const float* nw, float eps, int np = 0) {
    int half = head_dim / 2, pq = n_heads * half, pk = n_kv * half;
    int b = blockIdx.x;
    int kind = b < pq ? 0 : b < pq + pk ? 1 : 2;  // q, k, v: the same for the whole block
    int e = kind == 0 ? b : kind == 1 ? b - pq : 2 * (b - pq - pk);
    int head = kind < 2 ? e / half : e / head_dim, i = kind < 2 ? e % half : e % head_dim;
    int fa = head * head_dim + (kind == 2 ? i : neox ? i : 2 * i);
    int fb = kind == 2 ? fa + 1 : head * head_dim + (neox ? i + half : 2 * i + 1);
    const void* data = kind == 0 ? wq : kind == 1 ? wk : wv;
    const float* sm = kind == 0 ? sq : kind == 1 ? sk : sv;
    const float* bias = kind == 0 ? bq : kind == 1 ? bk : bv;
    float* out = kind == 0 ? q : kind == 1 ? k : v;
    int lg = kind == 0 ? lgq : kind == 1 ? lgk : lgv;
    VtRow w[2] = {{data, sm, lg, (long long)fa * K}, {data, sm, lg, (long long)fb * K}};
    // The step's inputs (copied before its first kernel), the biases (weights) and the
    // rotation's angle: all before the wait, so nothing after the sums waits on a load.
    int pos = positions[0], slot = slots[0];
    float ba = 0.0f, bb = 0.0f, cs = 1.0f, sn = 0.0f;
    if (threadIdx.x == 0) {
        if (bias) ba = bias[fa], bb = bias[fb];
        if (kind < 2) {
            double theta = (double)pos * table.inv[i];
            cs = (float)cos(theta), sn = (float)sin(theta);
        }
    }
    float s[2];
    // waits for the previous kernel (x) first
    vt_gv_rows<2, NORM, VtNoop, VT_GV_UNROLL, PSQ>(w, x, K, s, nw, eps, VtNoop(), np);
    if (threadIdx.x != 0) return;
    float a = bias ? s[0] + ba : s[0], c = bias ? s[1] + bb : s[1];
    if (kind < 2) vt_rope_pair(a, c, cs, sn, &a, &c);
    out[fa] = a;
    out[fb] = c;
    if (kind == 0 || slot < 0 || slot >= n_slots || pos < 0 || pos >= max_len) return;
    long long base = vt_kv_index(pos, slot, layer, kind - 1, n_slots, n_layers, n_kv * head_dim);
    cache[base + fa] = a;
    cache[base + fb] = c;
}

extern "C" __global__ void qkv_rope_gemv_q(
    float* q, float* k, float* v, const float* x, const void* wq, const float* sq, int lgq,
    const float* bq, const void* wk, const float* sk, int lgk, const float* bk,
    const void* wv, const float* sv, int lgv, const float* bv, int n_heads, int n_kv,
    int head_dim, int K, int neox, const int* positions, const int* slots, float* cache,
    int n_slots, int n_layers, int max_len, int layer, RopeTable table) {
    vt_launch_dependents();
    vt_qkv_rope_gemv<false>(q, k, v, x, wq, sq, lgq, bq, wk, sk, lgk, bk, wv, sv, lgv, bv,
                            n_heads, n_kv, head_dim, K, neox, positions, slots, cache, n_slots,
                            n_layers, max_len, layer, table, nullptr, 0.0f);
}

// The same of rms_norm(x) (weight nw, eps; vt_gv_rows): the rms_norm_qkv_rope_kv_store op.
extern "C" __global__ void qkv_rope_norm_gemv_q(
    float* q, float* k, float* v, const float* x, const void* wq, const float* sq, int lgq,
    const float* bq, const void* wk, const float* sk, int lgk, const float* bk,
    const void* wv, const float* sv, int lgv, const float* bv, int n_heads, int n_kv,
    int head_dim, int K, int neox, const int* positions, const int* slots, float* cache,
    int n_slots, int n_layers, int max_len, int layer, RopeTable table, const float* nw,
    float eps) {
    vt_launch_dependents();
    vt_qkv_rope_gemv<true>(q, k, v, x, wq, sq, lgq, bq, wk, sk, lgk, bk, wv, sv, lgv, bv,
                           n_heads, n_kv, head_dim, K, neox, positions, slots, cache, n_slots,
                           n_layers, max_len, layer, table, nw, eps);
}

// In a weight layout's module (VT_Q_FLAGS), at most 40 registers a thread, as
// qkv_rope_gemv_q takes by itself there (sass_count.py -D VT_Q_FLAGS=0xc00: 48 without the
// bound; with it the same 3 LDL / 2 STL as qkv_rope_gemv_q): the 1B shape's 1,536 blocks
// of 128 threads stay one wave on 132 multiprocessors (12 a multiprocessor); run 79 saw
// qkv_rope_gemv_q 29% slower at 48. Not in the module of every layout (64 registers
// either way; bounded, it spills). NVIDIA only: HIP's second argument means waves per
// execution unit.
#ifndef VT_QKV_PSQ_BOUNDS
#if defined(VT_Q_FLAGS) && !defined(VT_HIP)
#define VT_QKV_PSQ_BOUNDS __launch_bounds__(128, 12)
#else
#define VT_QKV_PSQ_BOUNDS
#endif
#endif
// The same of the deferred norm (vt_gv_rows' PSQ): x is x * nw as matmul_psq_gemv*_q left
// it, psq its np partial sums of squares: the matmul_add_rms_norm_qkv_rope_kv_store op.
extern "C" __global__ void VT_QKV_PSQ_BOUNDS qkv_rope_psq_gemv_q(
    float* q, float* k, float* v, const float* x, const void* wq, const float* sq, int lgq,
    const float* bq, const void* wk, const float* sk, int lgk, const float* bk,
    const void* wv, const float* sv, int lgv, const float* bv, int n_heads, int n_kv,
    int head_dim, int K, int neox, const int* positions, const int* slots, float* cache,
    int n_slots, int n_layers, int max_len, int layer, RopeTable table, const float* psq,
    int np, float eps) {
    vt_launch_dependents();
    vt_qkv_rope_gemv<false, true>(q, k, v, x, wq, sq, lgq, bq, wk, sk, lgk, bk, wv, sv, lgv,
                                  bv, n_heads, n_kv, head_dim, K, neox, positions, slots,
                                  cache, n_slots, n_layers, max_len, layer, table, psq, eps,
                                  np);
}
