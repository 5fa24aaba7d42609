// ------------------------------------------------------------------------ elementwise

// silu(g) * u = g * u / (1 + exp(-g)), rounded as the reference rounds it.
extern "C" __global__ void silu_mul(float* out, const float* gate, const float* up, int n) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
        float g = gate[e];
        float denom = __fadd_rn(expf(-g), 1.0f);
        out[e] = __fdiv_rn(__fmul_rn(g, up[e]), denom);
    }
}

extern "C" __global__ void add(float* out, const float* a, const float* b, int n) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x)
        out[e] = __fadd_rn(a[e], b[e]);
}

// out[i] = x[rows[i]]; a row outside [0, m) yields NaNs.
extern "C" __global__ void gather_rows(float* out, const float* x, const int* rows, int n,
                                       int dim, int m) {
    int i = blockIdx.x;
    int r = rows[i];
    bool ok = r >= 0 && r < m;
    for (int d = threadIdx.x; d < dim; d += blockDim.x)
        out[(long long)i * dim + d] = ok ? x[(long long)r * dim + d] : vt_nan();
}

