// Appended to vt's kernel source by bench_gemv.py (it uses vt_codes and vt_gv_load): the
// roofline of a batch-1 weight read. Not part of vt's kernels.

// Every 16 bytes of [p, p + bytes) read once (4 loads a thread in flight), their xor kept
// so that the loads stay.
extern "C" __global__ void read_bw(vt_u32* sink, const vt_i8* p, long long bytes) {
    long long n16 = bytes / 16, stride = (long long)gridDim.x * blockDim.x;
    vt_u32 acc = 0;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        vt_codes<16> a = vt_gv_load(p + 16 * i), b = vt_gv_load(p + 16 * (i + stride));
        vt_codes<16> c = vt_gv_load(p + 16 * (i + 2 * stride));
        vt_codes<16> d = vt_gv_load(p + 16 * (i + 3 * stride));
#pragma unroll
        for (int j = 0; j < 4; ++j) acc ^= a.w[j] ^ b.w[j] ^ c.w[j] ^ d.w[j];
    }
    for (; i < n16; i += stride) {
        vt_codes<16> a = vt_gv_load(p + 16 * i);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc ^= a.w[j];
    }
    if (acc == 0x12345678u) sink[0] = acc;
}
