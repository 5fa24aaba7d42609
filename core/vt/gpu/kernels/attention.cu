// Causal attention, one block per (row i, query head h), ATT_THREADS threads (>= head_dim).
// Positions 0..positions[i] of slot slots[i] in chunks of ATT_CHUNK with an online softmax
// (running max and sum), so any context length works with fixed shared memory.
#define ATT_THREADS 256
#define ATT_CHUNK 1024
extern "C" __global__ void attention(float* out, const float* q, const float* cache,
                                     const int* slots, const int* positions, int n, int n_heads,
                                     int n_kv, int head_dim, int n_slots, int n_layers,
                                     int max_len, int layer, float scale) {
    __shared__ float qs[256];
    __shared__ float sc[ATT_CHUNK];
    __shared__ float red[ATT_THREADS];
    int i = blockIdx.x, h = blockIdx.y, t = threadIdx.x;
    int row = n_kv * head_dim;
    int kvh = h / (n_heads / n_kv);
    int slot = slots[i], pos = positions[i];
    bool ok = slot >= 0 && slot < n_slots && pos >= 0 && pos < max_len;
    int length = ok ? pos + 1 : 0;
    const float* qi = q + ((long long)i * n_heads + h) * head_dim;
    for (int d = t; d < head_dim; d += blockDim.x) qs[d] = qi[d];
    __syncthreads();
    long long pos_stride = (long long)n_slots * n_layers * 2 * row;
    long long kbase = ok ? vt_kv_index(0, slot, layer, 0, n_slots, n_layers, row) + kvh * head_dim
                         : 0;
    long long vbase = kbase + row;
    float m = -__uint_as_float(0x7f800000u);  // -inf
    float l = 0.0f, acc = 0.0f;
    for (int c0 = 0; c0 < length; c0 += ATT_CHUNK) {
        int cn = min(ATT_CHUNK, length - c0);
        float cmax = -__uint_as_float(0x7f800000u);
        for (int j = t; j < cn; j += blockDim.x) {
            const float* kp = cache + kbase + (long long)(c0 + j) * pos_stride;
            float s = 0.0f;
            for (int d = 0; d < head_dim; ++d) s += qs[d] * kp[d];
            s = s * scale;
            sc[j] = s;
            cmax = fmaxf(cmax, s);
        }
        cmax = vt_block_max(cmax, red);
        float new_m = fmaxf(m, cmax);
        float part = 0.0f;
        for (int j = t; j < cn; j += blockDim.x) {
            float p = expf(sc[j] - new_m);
            sc[j] = p;
            part += p;
        }
        part = vt_block_sum(part, red);  // its barriers also publish sc[]
        float corr = expf(m - new_m);    // 0 on the first chunk (m = -inf)
        l = l * corr + part;
        if (t < head_dim) {  // four partial sums: four value rows in flight
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            const float* vp = cache + vbase + t;
            int j = 0;
            for (; j + 3 < cn; j += 4) {
                const float* p = vp + (long long)(c0 + j) * pos_stride;
                a0 += sc[j] * p[0];
                a1 += sc[j + 1] * p[pos_stride];
                a2 += sc[j + 2] * p[2 * pos_stride];
                a3 += sc[j + 3] * p[3 * pos_stride];
            }
            for (; j < cn; ++j) a0 += sc[j] * vp[(long long)(c0 + j) * pos_stride];
            acc = acc * corr + ((a0 + a1) + (a2 + a3));
        }
        m = new_m;
        __syncthreads();  // sc[] is rewritten by the next chunk
    }
    if (t < head_dim) out[((long long)i * n_heads + h) * head_dim + t] = ok ? acc / l : vt_nan();
}

