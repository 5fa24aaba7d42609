// ------------------------------------------------------------------------ logprobs
//
// vt.reference.sampling.logprobs_op, one block of LP_THREADS per requested row i (the row
// rows[i] of logits): log-softmax of the raw logits in float64, rounded to float32, the
// logprob of the sampled id, and the k (<= LP_MAX_K) most likely ids by (logit desc, id
// asc). Only these few numbers leave the device, never the logits row.
//
// Pass 1: each thread walks its ids (t, t + LP_THREADS, ... ascending) keeping the float64
// maximum and its own k best, sorted, in a small insertion list: an id enters only when it
// beats the list's last (ties keep the lower id, which the thread saw first), so most ids
// cost one comparison. Pass 2: the float64 sum of exp(l - max) (a fixed-order tree, so
// deterministic). Then k rounds merge the per-thread lists: every thread proposes its
// next entry, a block reduction picks the first in (key desc, id asc) order and its owner
// advances. The global top k is the merge of the per-thread top k (an id among the k
// best overall is among the k best of its thread). A row index outside [0, n) yields NaN
// logprobs and id -1; an id outside the vocabulary, a NaN chosen logprob. Rows with NaN
// logits give unspecified (but in-bounds) results: the sampler fails such a row anyway.

#define LP_THREADS 256
#define LP_MAX_K 20

__device__ __forceinline__ bool vt_lp_before(vt_u32 ka, int ia, vt_u32 kb, int ib) {
    return ka > kb || (ka == kb && ia < ib);
}

__device__ double vt_lp_max(double v, double* red) {
    int t = threadIdx.x;
    red[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s && red[t + s] > red[t]) red[t] = red[t + s];
        __syncthreads();
    }
    double r = red[0];
    __syncthreads();
    return r;
}


// The first proposal in (key desc, id asc) order; every thread gets it in *key, *id.
__device__ void vt_lp_first(vt_u32* key, int* id, vt_u32* kred, int* ired) {
    int t = threadIdx.x;
    kred[t] = *key;
    ired[t] = *id;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s && vt_lp_before(kred[t + s], ired[t + s], kred[t], ired[t])) {
            kred[t] = kred[t + s];
            ired[t] = ired[t + s];
        }
        __syncthreads();
    }
    *key = kred[0];
    *id = ired[0];
    __syncthreads();
}

extern "C" __global__ void logprobs(float* chosen, int* top_ids, float* top_lp,
                                    const float* logits, const int* ids, const int* rows,
                                    int m, int k, int n, int vocab) {
    __shared__ double dred[LP_THREADS];
    __shared__ vt_u32 kred[LP_THREADS];
    __shared__ int ired[LP_THREADS];
    int i = blockIdx.x, t = threadIdx.x;
    int r = rows[i];
    long long out0 = (long long)i * k;
    if (r < 0 || r >= n) {  // the whole block takes this branch: no barrier is split
        for (int q = t; q < k; q += blockDim.x) {
            top_ids[out0 + q] = -1;
            top_lp[out0 + q] = vt_nan();
        }
        if (t == 0) chosen[i] = vt_nan();
        return;
    }
    const float* lg = logits + (long long)r * vocab;

    // 1. the maximum, and this thread's k best ids, sorted
    vt_u32 mk[LP_MAX_K];
    int mi[LP_MAX_K];
    int cnt = 0;
    double peak = -(double)__uint_as_float(0x7f800000u);
    for (int j = t; j < vocab; j += blockDim.x) {
        float x = lg[j];
        if ((double)x > peak) peak = (double)x;
        if (k == 0) continue;
        vt_u32 key = vt_key(x);
        if (cnt == k && !(key > mk[k - 1])) continue;
        int p = cnt < k ? cnt : k - 1;
        while (p > 0 && key > mk[p - 1]) {
            mk[p] = mk[p - 1];
            mi[p] = mi[p - 1];
            --p;
        }
        mk[p] = key;
        mi[p] = j;
        if (cnt < k) ++cnt;
    }
    peak = vt_lp_max(peak, dred);

    // 2. log(sum(exp(l - max))) in float64
    double part = 0.0;
    for (int j = t; j < vocab; j += blockDim.x) part += exp((double)lg[j] - peak);
    double ls = log(vt_block_sum(part, dred));

    if (t == 0) {
        int c = ids[r];
        chosen[i] = (c >= 0 && c < vocab) ? (float)(((double)lg[c] - peak) - ls) : vt_nan();
    }

    // 3. merge the per-thread lists, one id per round
    int h = 0;
    for (int q = 0; q < k; ++q) {
        vt_u32 key = h < cnt ? mk[h] : 0u;
        int id = h < cnt ? mi[h] : 0x7fffffff;  // after every real entry
        vt_lp_first(&key, &id, kred, ired);
        if (h < cnt && mi[h] == id) ++h;
        if (t == 0) {
            bool real = id >= 0 && id < vocab;  // always, as k <= vocab: never read past it
            top_ids[out0 + q] = real ? id : -1;
            top_lp[out0 + q] = real ? (float)(((double)lg[id] - peak) - ls) : vt_nan();
        }
    }
}
