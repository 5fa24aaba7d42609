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

// Step 1 of the reference, by a block over ids [i0, i1): the argmax (lowest id on ties) and
// whether a NaN or +inf is among them. Each thread walks its ids in increasing order (four at
// a time, one 128-bit load, where the row allows), then a tree over the block; every thread
// gets the block's answer. red and ired: blockDim.x entries each (a power of 2).
struct VtArgmax {
    float best;
    int id;  // 0x7fffffff: every value -inf (or none)
    int bad;
};

__device__ __forceinline__ void vt_argmax_take(VtArgmax& a, float v, int i) {
    if (v > a.best || (v == a.best && i < a.id)) {
        a.best = v;
        a.id = i;
    }
}

__device__ VtArgmax vt_argmax_reduce(VtArgmax a, float* red, int* ired) {
    int t = threadIdx.x;
    red[t] = a.best;
    ired[t] = a.id;
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
    VtArgmax r;
    r.best = red[0];
    r.id = ired[0];
    __syncthreads();
    r.bad = (int)vt_block_sum((float)a.bad, red) > 0;
    return r;
}

__device__ VtArgmax vt_argmax_scan(const float* lg, int i0, int i1, float* red, int* ired) {
    VtArgmax a = {-__uint_as_float(0x7f800000u), 0x7fffffff, 0};
    int t = threadIdx.x;
    // 16-byte loads from i0 (a multiple of 4 where the host asks for them) up to v1.
    bool vec = (i0 & 3) == 0 && (((unsigned long long)(lg + i0)) & 15ull) == 0;
    int v1 = vec ? i0 + ((i1 - i0) & ~3) : i0;
    for (int i4 = i0 + 4 * t; i4 < v1; i4 += 4 * blockDim.x) {
        vt_f4 v4 = *(const vt_f4*)(lg + i4);
        float vs[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float v = vs[j];
            if (v != v || v == __uint_as_float(0x7f800000u)) a.bad = 1;
            vt_argmax_take(a, v, i4 + j);
        }
    }
    for (int i = v1 + t; i < i1; i += blockDim.x) {
        float v = lg[i];
        if (v != v || v == __uint_as_float(0x7f800000u)) a.bad = 1;
        vt_argmax_take(a, v, i);
    }
    return vt_argmax_reduce(a, red, ired);
}

// A long row's step 1 spread over blocks: block b of row r scans ids [b * per, (b + 1) * per)
// and writes its VtArgmax to part[r * gridDim.y + b]; sample then reduces the row's
// gridDim.y entries instead of walking the row in one block (26 us for a vocabulary of
// 128,256 ids in one block on the H200, run 31). per: a multiple of 4.
#define ARGMAX_THREADS 256
extern "C" __global__ void sample_argmax(VtArgmax* part, const float* logits, int vocab,
                                         int per) {
    __shared__ float red[ARGMAX_THREADS];
    __shared__ int ired[ARGMAX_THREADS];
    vt_launch_dependents();
    vt_grid_wait();  // the logits come from the kernel before
    int r = blockIdx.x, b = blockIdx.y;
    int i0 = min(vocab, b * per), i1 = min(vocab, i0 + per);
    VtArgmax a = vt_argmax_scan(logits + (long long)r * vocab, i0, i1, red, ired);
    if (threadIdx.x == 0) part[(long long)r * gridDim.y + b] = a;
}

// parts > 0: step 1 from sample_argmax's parts entries of the row (part), not the logits.
extern "C" __global__ void sample(int* out, const float* logits, const SampleParams* params,
                                  int n, int vocab, const VtArgmax* part, int parts) {
    __shared__ float red[SAMPLE_THREADS];
    __shared__ int ired[SAMPLE_THREADS];
    vt_grid_wait();
    int r = blockIdx.x, t = threadIdx.x;
    const float* lg = logits + (long long)r * vocab;
    SampleParams p = params[r];

    // 1. argmax (lowest id on ties) and the checks the reference makes.
    VtArgmax am;
    if (parts > 0) {
        VtArgmax a = {-__uint_as_float(0x7f800000u), 0x7fffffff, 0};
        for (int k = t; k < parts; k += blockDim.x) {
            VtArgmax o = part[(long long)r * parts + k];
            a.bad |= o.bad;
            vt_argmax_take(a, o.best, o.id);
        }
        am = vt_argmax_reduce(a, red, ired);
    } else {
        am = vt_argmax_scan(lg, 0, vocab, red, ired);
    }
    float best = am.best;
    int best_id = am.id;
    int bad = am.bad;
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
                if (vt_block_sum(c, ured) >= (unsigned int)k) g = cand;
            }
            unsigned int above = 0;
            for (int i = t; i < vocab; i += blockDim.x) above += vt_key(vt_l(R, i)) > g;
            above = vt_block_sum(above, ured);
            unsigned int need = (unsigned int)k - above;  // >= 1 by the choice of g
            int lo = 0, hi = vocab - 1, found = vocab - 1;
            while (lo <= hi) {
                int mid = lo + (hi - lo) / 2;
                unsigned int c = 0;
                for (int i = t; i <= mid; i += blockDim.x) c += vt_key(vt_l(R, i)) == g;
                if (vt_block_sum(c, ured) >= need) {
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
                if (vt_block_sum(c, ured) == 0u) g = cand;
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
