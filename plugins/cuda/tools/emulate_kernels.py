"""Run some of vt's GPU kernels on the CPU, to check them before spending device time.

    python plugins/cuda/tools/emulate_kernels.py [-k SUBSTRING] [-D NAME=VALUE]

Compiles the attention kernels (``attention_split``, ``attention_combine``,
``attention_tiled_*``), the BLAS path's 16-byte copies (``dequantize16_q``,
``dequantize16_h_q``, ``to_half8``) and the int8 tensor-core kernels (``quantize_rows``,
``quantize_norm_rows``,
``matmul_mma*``, ``swiglu_mma*``, ``qkv_mma*``: their shuffle branch, K split too), the batch-1
gemv kernels (``matmul_gemv*``, ``matmul_norm_gemv*_q``: with the norm epilogue,
``swiglu_gemv*``, ``qkv_gemv*``, ``qkv_rope_gemv_q``; the deferred norm's
``matmul_psq_gemv*_q``, ``swiglu_psq_gemv*_q`` and ``qkv_rope_psq_gemv_q``; the long
rows' ``gemv_long_*`` blocks of 256 threads and ``matmul_psq_gemvu*_q``) and
``rope_kv_store``, ``sample_argmax`` and ``sample`` from
``core/vt/gpu/kernels`` with g++ (C++20), one ``std::thread`` per GPU thread:
``__syncthreads`` is a block barrier, a shuffle goes through memory between two barriers of
its warp, ``__shared__`` is a static. Then it runs ``gpu_checks.py``'s tiled-attention
cases, split attention past one chunk, the short-context attention (``short_context``:
one launch of 512 threads, its own module), the last-block combine and ``qkv_rope_kv_store``
checks (bit-equal to their two-launch forms), bit-exact copy checks, int8 tensor-core
checks (attention's int8 hand-off to the projection after it among them), gemv checks
and the greedy argmax and sampling checks on the fake runtime
(``tests/fake_gpu.py``), those kernels' launches routed to the emulation, each to a library
built with its module's defines as the backend compiles them (by default ``-DVT_GV_X16=4``
in the 4-bit layouts' modules only); ``-k`` keeps
the cases whose name contains SUBSTRING (``A|B``: either). What it cannot see: timing,
the memory model between blocks (blocks run one after another), warp-divergent shuffles
(every shuffle must be reached by the whole warp, as the CUDA code already requires), and
instructions inside ``#ifndef VT_HIP`` (the emulation compiles the HIP branch, e.g. the
integer half rounding instead of ``cvt.rn.f16.f32``, plain two-way products instead of
``dp2a``). Slow: seconds per case of hundreds of rows.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
KERNELS = ROOT / "core" / "vt" / "gpu" / "kernels"

PRELUDE = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
struct vt_dim3 { unsigned x, y, z; };
static thread_local vt_dim3 threadIdx;
static vt_dim3 blockIdx, gridDim, blockDim;
static std::barrier<>* vt_block_barrier;
static std::vector<std::unique_ptr<std::barrier<>>> vt_warp_barriers;
static float vt_lane_f[1024];
static int vt_lane_i[1024];
#define VT_EMULATE 1
#define VT_HIP 1
#define VT_WARP 32
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
inline void __syncthreads() { vt_block_barrier->arrive_and_wait(); }
inline void vt_warp_sync() { vt_warp_barriers[threadIdx.x / VT_WARP]->arrive_and_wait(); }
#define VT_SYNC32() vt_warp_sync()
template <typename T> T vt_shfl(T v, int m, T* lanes) {
    int t = threadIdx.x;
    lanes[t] = v;
    vt_warp_sync();
    T r = lanes[(t / VT_WARP) * VT_WARP + ((t % VT_WARP) ^ m)];
    vt_warp_sync();
    return r;
}
inline float vt_shfl_any(float v, int m) { return vt_shfl(v, m, vt_lane_f); }
inline int vt_shfl_any(int v, int m) { return vt_shfl(v, m, vt_lane_i); }
#define VT_SHFL_XOR(v, m) vt_shfl_any((v), (m))
inline float vt_shfl_idx(float v, int src) {  // lane src of the caller's warp
    int t = threadIdx.x;
    vt_lane_f[t] = v;
    vt_warp_sync();
    float r = vt_lane_f[(t / VT_WARP) * VT_WARP + src];
    vt_warp_sync();
    return r;
}
#define VT_SHFL_IDX(v, src) vt_shfl_idx((v), (src))
inline int vt_shfl32(int v, int src) {  // lane src of the caller's 32 (VT_WARP is 32 here)
    int t = threadIdx.x;
    vt_lane_i[t] = v;
    vt_warp_sync();
    int r = vt_lane_i[(t / 32) * 32 + src];
    vt_warp_sync();
    return r;
}
#define VT_SHFL32(v, src) vt_shfl32((v), (src))
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {  // PTX prmt, default mode
    unsigned long long b = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i)
        r |= (unsigned)((b >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
// blocks run one after another: a fence has nothing to order, an atomic only this block's threads
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
using std::max;
using std::min;
"""

LAUNCH = r"""
template <typename F> static void vt_grid(const int* g, int block, F body) {
    gridDim = {(unsigned)g[0], (unsigned)g[1], (unsigned)g[2]};
    blockDim = {(unsigned)block, 1, 1};
    std::barrier<> b(block);
    vt_block_barrier = &b;
    vt_warp_barriers.clear();
    for (int w = 0; w < block / VT_WARP; ++w)
        vt_warp_barriers.emplace_back(new std::barrier<>(VT_WARP));
    for (int z = 0; z < g[2]; ++z)
        for (int y = 0; y < g[1]; ++y)
            for (int x = 0; x < g[0]; ++x) {
                blockIdx = {(unsigned)x, (unsigned)y, (unsigned)z};
                std::vector<std::thread> ts;
                for (int t = 0; t < block; ++t)
                    ts.emplace_back([=] { threadIdx = {(unsigned)t, 0, 0}; body(); });
                for (auto& th : ts) th.join();
            }
}
#define P(T, i) (*(T*)a[i])
#define TILED(S) if (!std::strcmp(name, "attention_tiled_" #S)) { vt_grid(g, block, [=] {      \
    attention_tiled_##S(P(float*, 0), P(const float*, 1), P(const float*, 2), P(const int*, 3), \
        P(const int*, 4), P(int, 5), P(int, 6), P(int, 7), P(int, 8), P(int, 9), P(int, 10),    \
        P(int, 11), P(int, 12), P(float, 13)); }); return 1; }
// the batch-1 float32 decode matmul and rms_norm
#define SMALL1(S) if (!std::strcmp(name, "matmul_small1_" #S)) { vt_grid(g, block, [=] {       \
    matmul_small1_##S(P(float*, 0), P(const float*, 1), P(const void*, 2), P(const float*, 3),  \
        P(int, 4), P(const float*, 5), P(const float*, 6), P(int, 7), P(int, 8), P(int, 9),      \
        P(int, 10)); }); return 1; }
#define SMALL1SW(S) if (!std::strcmp(name, "swiglu_small1_" #S)) { vt_grid(g, block, [=] {   \
    swiglu_small1_##S(P(float*, 0), P(const float*, 1), P(const void*, 2), P(const float*, 3),  \
        P(int, 4), P(const void*, 5), P(const float*, 6), P(int, 7), P(int, 8), P(int, 9),       \
        P(int, 10), P(int, 11)); }); return 1; }                                                 \
    if (!std::strcmp(name, "qkv_small1_" #S)) { vt_grid(g, block, [=] {                         \
    qkv_small1_##S(P(float*, 0), P(float*, 1), P(float*, 2), P(const float*, 3),                 \
        P(const void*, 4), P(const float*, 5), P(int, 6), P(const float*, 7),                   \
        P(const void*, 8), P(const float*, 9), P(int, 10), P(const float*, 11),                 \
        P(const void*, 12), P(const float*, 13), P(int, 14), P(const float*, 15),               \
        P(int, 16), P(int, 17), P(int, 18), P(int, 19), P(int, 20), P(int, 21)); }); return 1; }
// the decode kernels of several rows (float32 x: suffix q; int8 x: q8a), per features a warp
#define SMALLN(NO, SW, S) if (!std::strcmp(name, "matmul_small" #NO "_" #S)) {                 \
    vt_grid(g, block, [=] { matmul_small##NO##_##S(P(float*, 0), P(const float*, 1),           \
        P(const void*, 2), P(const float*, 3), P(int, 4), P(const float*, 5),                   \
        P(const float*, 6), P(int, 7), P(int, 8), P(int, 9), P(int, 10)); }); return 1; }      \
    if (!std::strcmp(name, "swiglu_small" #SW "_" #S)) { vt_grid(g, block, [=] {              \
    swiglu_small##SW##_##S(P(float*, 0), P(const float*, 1), P(const void*, 2),                 \
        P(const float*, 3), P(int, 4), P(const void*, 5), P(const float*, 6), P(int, 7),        \
        P(int, 8), P(int, 9), P(int, 10), P(int, 11)); }); return 1; }                          \
    if (!std::strcmp(name, "qkv_small" #NO "_" #S)) { vt_grid(g, block, [=] {                 \
    qkv_small##NO##_##S(P(float*, 0), P(float*, 1), P(float*, 2), P(const float*, 3),          \
        P(const void*, 4), P(const float*, 5), P(int, 6), P(const float*, 7),                   \
        P(const void*, 8), P(const float*, 9), P(int, 10), P(const float*, 11),                 \
        P(const void*, 12), P(const float*, 13), P(int, 14), P(const float*, 15),               \
        P(int, 16), P(int, 17), P(int, 18), P(int, 19), P(int, 20), P(int, 21)); }); return 1; }
// the int8 tensor-core kernels (their shuffle branch), per tiles of 8 rows
#define MMA(NO)                                                                       \
    if (!std::strcmp(name, "matmul_mma" #NO "_q8a")) { vt_grid(g, block, [=] {                \
        matmul_mma##NO##_q8a(P(float*, 0), P(const unsigned char*, 1), P(const vt_i8*, 2),    \
            P(const float*, 3), P(int, 4), P(const float*, 5), P(const float*, 6), P(int, 7), \
            P(int, 8), P(int, 9), P(float*, 10), P(int*, 11)); }); return 1; }                \
    if (!std::strcmp(name, "swiglu_mma" #NO "_q8a")) { vt_grid(g, block, [=] {                \
        swiglu_mma##NO##_q8a(P(float*, 0), P(const unsigned char*, 1), P(const vt_i8*, 2),    \
            P(const float*, 3), P(int, 4), P(const vt_i8*, 5), P(const float*, 6), P(int, 7), \
            P(int, 8), P(int, 9), P(int, 10), P(float*, 11), P(int*, 12)); }); return 1; }    \
    if (!std::strcmp(name, "qkv_mma" #NO "_q8a")) { vt_grid(g, block, [=] {                   \
        qkv_mma##NO##_q8a(P(float*, 0), P(float*, 1), P(float*, 2), P(const unsigned char*, 3), \
            P(const vt_i8*, 4), P(const float*, 5), P(int, 6), P(const float*, 7),            \
            P(const vt_i8*, 8), P(const float*, 9), P(int, 10), P(const float*, 11),          \
            P(const vt_i8*, 12), P(const float*, 13), P(int, 14), P(const float*, 15),        \
            P(int, 16), P(int, 17), P(int, 18), P(int, 19), P(int, 20), P(float*, 21),        \
            P(int*, 22)); }); return 1; }                                                      \
    if (!std::strcmp(name, "qkv_rope_mma" #NO "_q8a")) { vt_grid(g, block, [=] {              \
        qkv_rope_mma##NO##_q8a(P(float*, 0), P(float*, 1), P(float*, 2),                      \
            P(const unsigned char*, 3), P(const vt_i8*, 4), P(const float*, 5), P(int, 6),    \
            P(const float*, 7), P(const vt_i8*, 8), P(const float*, 9), P(int, 10),           \
            P(const float*, 11), P(const vt_i8*, 12), P(const float*, 13), P(int, 14),        \
            P(const float*, 15), P(int, 16), P(int, 17), P(int, 18), P(int, 19), P(int, 20),  \
            P(float*, 21), P(int*, 22), P(const int*, 23), P(const int*, 24), P(float*, 25),   \
            P(int, 26), P(int, 27), P(int, 28), P(int, 29), P(int, 30), P(RopeTable, 31));     \
        }); return 1; }
// the batch-1 gemv kernels, per features a block
#define GEMV(GV)                                                                              \
    if (!std::strcmp(name, "matmul_gemv" #GV "_q")) { vt_grid(g, block, [=] {                \
        matmul_gemv##GV##_q(P(float*, 0), P(const float*, 1), P(const void*, 2),              \
            P(const float*, 3), P(int, 4), P(const float*, 5), P(const float*, 6), P(int, 7),  \
            P(int, 8)); }); return 1; }                                                         \
    if (!std::strcmp(name, "matmul_norm_gemv" #GV "_q")) { vt_grid(g, block, [=] {           \
        matmul_norm_gemv##GV##_q(P(float*, 0), P(const float*, 1), P(const void*, 2),         \
            P(const float*, 3), P(int, 4), P(const float*, 5), P(const float*, 6), P(int, 7),  \
            P(int, 8), P(float*, 9), P(const float*, 10), P(float, 11), P(int*, 12)); });      \
        return 1; }                                                                             \
    if (!std::strcmp(name, "matmul_gemvu" #GV "_q")) { vt_grid(g, block, [=] {               \
        matmul_gemvu##GV##_q(P(float*, 0), P(const float*, 1), P(const void*, 2),             \
            P(const float*, 3), P(int, 4), P(const float*, 5), P(const float*, 6), P(int, 7),  \
            P(int, 8)); }); return 1; }                                                         \
    if (!std::strcmp(name, "swiglu_gemv" #GV "_q")) { vt_grid(g, block, [=] {                \
        swiglu_gemv##GV##_q(P(float*, 0), P(const float*, 1), P(const void*, 2),              \
            P(const float*, 3), P(int, 4), P(const void*, 5), P(const float*, 6), P(int, 7),   \
            P(int, 8), P(int, 9)); }); return 1; }                                              \
    if (!std::strcmp(name, "swiglu_norm_gemv" #GV "_q")) { vt_grid(g, block, [=] {           \
        swiglu_norm_gemv##GV##_q(P(float*, 0), P(const float*, 1), P(const void*, 2),         \
            P(const float*, 3), P(int, 4), P(const void*, 5), P(const float*, 6), P(int, 7),   \
            P(int, 8), P(int, 9), P(const float*, 10), P(float, 11)); }); return 1; }          \
    if (!std::strcmp(name, "matmul_psq_gemv" #GV "_q")) { vt_grid(g, block, [=] {            \
        matmul_psq_gemv##GV##_q(P(float*, 0), P(const float*, 1), P(const void*, 2),          \
            P(const float*, 3), P(int, 4), P(const float*, 5), P(const float*, 6), P(int, 7),  \
            P(int, 8), P(float*, 9), P(const float*, 10), P(float*, 11)); }); return 1; }      \
    if (!std::strcmp(name, "matmul_psq_gemvu" #GV "_q")) { vt_grid(g, block, [=] {           \
        matmul_psq_gemvu##GV##_q(P(float*, 0), P(const float*, 1), P(const void*, 2),         \
            P(const float*, 3), P(int, 4), P(const float*, 5), P(const float*, 6), P(int, 7),  \
            P(int, 8), P(float*, 9), P(const float*, 10), P(float*, 11)); }); return 1; }      \
    if (!std::strcmp(name, "swiglu_psq_gemv" #GV "_q")) { vt_grid(g, block, [=] {            \
        swiglu_psq_gemv##GV##_q(P(float*, 0), P(const float*, 1), P(const void*, 2),          \
            P(const float*, 3), P(int, 4), P(const void*, 5), P(const float*, 6), P(int, 7),   \
            P(int, 8), P(int, 9), P(const float*, 10), P(int, 11), P(float, 12)); });          \
        return 1; }                                                                             \
    if (!std::strcmp(name, "qkv_gemv" #GV "_q")) { vt_grid(g, block, [=] {                   \
        qkv_gemv##GV##_q(P(float*, 0), P(float*, 1), P(float*, 2), P(const float*, 3),        \
            P(const void*, 4), P(const float*, 5), P(int, 6), P(const float*, 7),             \
            P(const void*, 8), P(const float*, 9), P(int, 10), P(const float*, 11),           \
            P(const void*, 12), P(const float*, 13), P(int, 14), P(const float*, 15),         \
            P(int, 16), P(int, 17), P(int, 18), P(int, 19)); }); return 1; }
extern "C" int vt_emulate(const char* name, const int* g, int block, void** a) {
    if (!std::strcmp(name, "qkv_rope_gemv_q")) { vt_grid(g, block, [=] {
        qkv_rope_gemv_q(P(float*, 0), P(float*, 1), P(float*, 2), P(const float*, 3),
            P(const void*, 4), P(const float*, 5), P(int, 6), P(const float*, 7),
            P(const void*, 8), P(const float*, 9), P(int, 10), P(const float*, 11),
            P(const void*, 12), P(const float*, 13), P(int, 14), P(const float*, 15),
            P(int, 16), P(int, 17), P(int, 18), P(int, 19), P(int, 20), P(const int*, 21),
            P(const int*, 22), P(float*, 23), P(int, 24), P(int, 25), P(int, 26), P(int, 27),
            P(RopeTable, 28)); }); return 1; }
    if (!std::strcmp(name, "qkv_rope_norm_gemv_q")) { vt_grid(g, block, [=] {
        qkv_rope_norm_gemv_q(P(float*, 0), P(float*, 1), P(float*, 2), P(const float*, 3),
            P(const void*, 4), P(const float*, 5), P(int, 6), P(const float*, 7),
            P(const void*, 8), P(const float*, 9), P(int, 10), P(const float*, 11),
            P(const void*, 12), P(const float*, 13), P(int, 14), P(const float*, 15),
            P(int, 16), P(int, 17), P(int, 18), P(int, 19), P(int, 20), P(const int*, 21),
            P(const int*, 22), P(float*, 23), P(int, 24), P(int, 25), P(int, 26), P(int, 27),
            P(RopeTable, 28), P(const float*, 29), P(float, 30)); }); return 1; }
    if (!std::strcmp(name, "qkv_rope_psq_gemv_q")) { vt_grid(g, block, [=] {
        qkv_rope_psq_gemv_q(P(float*, 0), P(float*, 1), P(float*, 2), P(const float*, 3),
            P(const void*, 4), P(const float*, 5), P(int, 6), P(const float*, 7),
            P(const void*, 8), P(const float*, 9), P(int, 10), P(const float*, 11),
            P(const void*, 12), P(const float*, 13), P(int, 14), P(const float*, 15),
            P(int, 16), P(int, 17), P(int, 18), P(int, 19), P(int, 20), P(const int*, 21),
            P(const int*, 22), P(float*, 23), P(int, 24), P(int, 25), P(int, 26), P(int, 27),
            P(RopeTable, 28), P(const float*, 29), P(int, 30), P(float, 31)); }); return 1; }
    if (!std::strcmp(name, "rope_kv_store")) { vt_grid(g, block, [=] {
        rope_kv_store(P(float*, 0), P(float*, 1), P(const float*, 2), P(const int*, 3),
            P(const int*, 4), P(float*, 5), P(int, 6), P(int, 7), P(int, 8), P(int, 9),
            P(int, 10), P(int, 11), P(int, 12), P(int, 13), P(int, 14), P(RopeTable, 15)); });
        return 1; }
    GEMV(1) GEMV(2) GEMV(4)
    TILED(h64r64) TILED(h64r32) TILED(h64r16) TILED(h128r32) TILED(h128r16) TILED(h256r16)
    if (!std::strcmp(name, "attention_split")) { vt_grid(g, block, [=] {
        attention_split(P(float*, 0), P(float*, 1), P(const float*, 2), P(const float*, 3),
            P(const int*, 4), P(const int*, 5), P(int, 6), P(int, 7), P(int, 8), P(int, 9),
            P(int, 10), P(int, 11), P(int, 12), P(int, 13), P(float, 14), P(int, 15),
            P(int, 16), P(int, 17), P(int, 18), P(int*, 19), P(unsigned char*, 20),
            P(VtPrefetch, 21)); });
        return 1; }
    if (!std::strcmp(name, "attention_combine")) { vt_grid(g, block, [=] {
        attention_combine(P(float*, 0), P(const float*, 1), P(const int*, 2), P(const int*, 3),
            P(int, 4), P(int, 5), P(int, 6), P(int, 7), P(int, 8), P(int, 9), P(int, 10),
            P(int, 11), P(unsigned char*, 12)); });
        return 1; }
    if (!std::strcmp(name, "sample_argmax")) { vt_grid(g, block, [=] {
        sample_argmax(P(VtArgmax*, 0), P(const float*, 1), P(int, 2), P(int, 3)); });
        return 1; }
    if (!std::strcmp(name, "sample")) { vt_grid(g, block, [=] {
        sample(P(int*, 0), P(const float*, 1), P(const SampleParams*, 2), P(int, 3),
            P(int, 4), P(const VtArgmax*, 5), P(int, 6)); }); return 1; }
    if (!std::strcmp(name, "dequantize16_q")) { vt_grid(g, block, [=] {
        dequantize16_q(P(float*, 0), P(const vt_i8*, 1), P(const float*, 2), P(int, 3),
            P(long long, 4)); }); return 1; }
    if (!std::strcmp(name, "dequantize16_h_q")) { vt_grid(g, block, [=] {
        dequantize16_h_q(P(vt_u16*, 0), P(const vt_i8*, 1), P(const float*, 2), P(int, 3),
            P(long long, 4)); }); return 1; }
    if (!std::strcmp(name, "to_half8")) { vt_grid(g, block, [=] {
        to_half8(P(vt_u16*, 0), P(const float*, 1), P(long long, 2)); }); return 1; }
    if (!std::strcmp(name, "quantize_rows")) { vt_grid(g, block, [=] {
        quantize_rows(P(unsigned char*, 0), P(const float*, 1), P(int, 2), P(int, 3)); });
        return 1; }
    if (!std::strcmp(name, "quantize_norm_rows")) { vt_grid(g, block, [=] {
        quantize_norm_rows(P(unsigned char*, 0), P(const float*, 1), P(const float*, 2),
            P(int, 3), P(int, 4), P(float, 5)); }); return 1; }
    MMA(1) MMA(2) MMA(4) MMA(8)
    if (!std::strcmp(name, "swiglu_mma1w_q8a")) { vt_grid(g, block, [=] {
        swiglu_mma1w_q8a(P(float*, 0), P(const unsigned char*, 1), P(const vt_i8*, 2),
            P(const float*, 3), P(int, 4), P(const vt_i8*, 5), P(const float*, 6), P(int, 7),
            P(int, 8), P(int, 9), P(int, 10), P(float*, 11), P(int*, 12)); }); return 1; }
    SMALL1(q) SMALL1(f32) SMALL1SW(q) SMALLN(4, 2, q) SMALLN(4, 2, q8a)
    if (!std::strcmp(name, "embedding_q")) { vt_grid(g, block, [=] {
        embedding_q(P(float*, 0), P(const void*, 1), P(const float*, 2), P(int, 3),
            P(const int*, 4), P(int, 5), P(int, 6), P(int, 7)); }); return 1; }
    if (!std::strcmp(name, "rms_norm")) { vt_grid(g, block, [=] {
        rms_norm(P(float*, 0), P(const float*, 1), P(const float*, 2), P(int, 3), P(int, 4),
            P(float, 5)); }); return 1; }
    return 0;
}
"""

PARTS = (
    "common.cu", "embedding_norm.cu", "matmul.cu", "matmul_small.cu", "matmul_gemv.cu",
    "matmul_int8.cu", "rope_kv.cu", "attention.cu", "attention_tiled.cu", "blas_copies.cu",
    "sample.cu",
)  # fmt: skip


def build(folder: Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The emulation as a shared library in ``folder`` (``defines``: g++'s ``-D`` values)."""
    source = PRELUDE + "".join((KERNELS / part).read_text() for part in PARTS) + LAUNCH
    cpp, lib = folder / "vt_emulated.cpp", folder / "vt_emulated.so"
    cpp.write_text(source)
    subprocess.run(
        ["g++", "-std=c++20", "-O2", "-shared", "-fPIC", "-ffp-contract=off", "-o", str(lib),
         *(f"-D{d}" for d in defines), str(cpp), "-lpthread"],
        check=True,
    )  # fmt: skip
    return ctypes.CDLL(str(lib))


#: A module's compile options the emulation leaves out: the prelude defines VT_WARP, and a
#: layout module's VT_Q_FLAGS becomes the layout read at run time (the same values).
_NOT_EMULATED = ("-DVT_WARP=", "-DVT_Q_FLAGS=")


def module_defines(options: Sequence[str]) -> tuple[str, ...]:
    """The g++ defines of the emulation of a module nvrtc compiles with ``options``."""
    return tuple(o[2:] for o in options if o.startswith("-D") and not o.startswith(_NOT_EMULATED))


class Libraries:
    """The emulation built in ``folder`` once per set of defines a module compiles with
    (``-DVT_GV_X16`` in the 4-bit layouts' modules only, by default), ``extra`` (the
    command line's ``-D``) added to each."""

    def __init__(self, folder: Path, extra: tuple[str, ...] = ()) -> None:
        self.folder, self.extra = folder, extra
        self.built: dict[tuple[str, ...], ctypes.CDLL] = {}

    def __call__(self, defines: tuple[str, ...]) -> ctypes.CDLL:
        key = (*self.extra, *dict.fromkeys(d for d in defines if d not in self.extra))
        lib = self.built.get(key)
        if lib is None:
            sub = self.folder / f"lib{len(self.built)}"
            sub.mkdir()
            print(f"emulation built with {' '.join(key) or 'no defines'}", flush=True)
            lib = self.built[key] = build(sub, key)
        return lib


def emulated_backend(libs: Callable[[tuple[str, ...]], ctypes.CDLL]) -> tuple[Any, Any]:
    """A fake-runtime GpuBackend whose launches of the emulated kernels run on the CPU, each
    in ``libs``' library for the defines its module was compiled with."""
    for folder in (str(ROOT / "plugins" / "cuda" / "tests"), str(ROOT / "tests")):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    from fake_gpu import make

    backend, rt = make(blas="fake BLAS")
    compile_, launch = rt.compile, rt.launch
    defines: dict[str, tuple[str, ...]] = {}

    def compiled(source: str, name: str, options: Sequence[str]) -> Any:
        module = compile_(source, name, options)
        defines[str(module)] = module_defines(options)
        return module

    def run(fn: Any, grid: Any, block: Any, shared: int, stream: Any, args: Any) -> None:
        module, _, name = str(fn).partition(":")
        scalar = (ctypes._SimpleCData, ctypes.Structure)  # a RopeTable travels by value
        values = [a if isinstance(a, scalar) else ctypes.c_void_p(a) for a in args]
        ptrs = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        g = (ctypes.c_int * 3)(*grid)
        if not libs(defines.get(module, ())).vt_emulate(name.encode(), g, block[0], ptrs):
            launch(fn, grid, block, shared, stream, args)

    rt.compile, rt.launch = compiled, run
    return backend, rt


#: Attention cases of same_bits: (positions, KV heads, head_dim, rows, query heads).
BITS_ATTENTION = ((1, 3, 64, 2, 9), (17, 8, 64, 1, 32), (192, 8, 64, 1, 32),
                  (129, 1, 128, 2, 9), (1025, 3, 64, 2, 9), (700, 2, 256, 1, 8),
                  (40, 3, 96, 1, 9))  # fmt: skip


def _bits_outputs(backend: Any) -> list[tuple[str, Any]]:
    """(case, output) of attention (split and combine) and of one-row matmul, swiglu and
    qkv per weight type on ``backend``: what same_bits compares."""
    import numpy as np
    import vt
    from gpu_checks import IO, f32, i32
    from vt.testing.kernels_suite import weight_tensor

    outs: list[tuple[str, Any]] = []
    stream = backend.create_stream()
    for length, n_kv, hd, rows, nh in BITS_ATTENTION:
        layout = vt.KVLayout(n_layers=2, n_slots=4, max_len=3000, n_kv_heads=n_kv, head_dim=hd)
        rng = np.random.default_rng(length)
        cache = rng.standard_normal(layout.shape).astype(np.float32)
        slots = (np.arange(rows, dtype=np.int32) + 1) % 4
        pos = np.array([length - 1, length // 2][:rows], np.int32)
        q = rng.standard_normal((rows, nh * hd)).astype(np.float32)
        io = IO(backend)
        out = io.empty(q.nbytes)
        backend.launch("attention", stream, out=f32(out, *q.shape), q=f32(io.put(q), *q.shape),
                       cache=f32(io.put(cache), *layout.shape), slots=i32(io.put(slots), rows),
                       positions=i32(io.put(pos), rows), layout=layout, layer=1, n_heads=nh,
                       scale=0.125)  # fmt: skip
        backend.synchronize(stream)
        outs.append((f"attention {length} {n_kv}-{hd}-{rows}", io.get(out, np.float32, q.shape)))
        io.close()
    for wtype in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"):
        rng = np.random.default_rng(7)
        k = 4608
        ws = [backend.upload_weight(weight_tensor(f"w{i}", rng.standard_normal((37, k))
                                                  .astype(np.float32), wtype)[0])
              for i in range(3)]  # fmt: skip
        io = IO(backend)
        x = f32(io.put(rng.standard_normal((1, k)).astype(np.float32)), 1, k)
        got = [io.empty(4 * 37) for _ in range(5)]
        t = [f32(b, 1, 37) for b in got]
        backend.launch("matmul", stream, out=t[0], x=x, weight=ws[0])
        backend.launch("swiglu", stream, out=t[1], x=x, gate=ws[0], up=ws[1],
                       scratch_gate=f32(io.empty(4 * 37), 1, 37),
                       scratch_up=f32(io.empty(4 * 37), 1, 37))  # fmt: skip
        backend.launch("qkv", stream, q=t[2], k=t[3], v=t[4], x=x, wq=ws[0], wk=ws[1], wv=ws[2])
        backend.synchronize(stream)
        for name, b in zip(("matmul", "swiglu", "q", "k", "v"), got, strict=True):
            outs.append((f"{name} {wtype} K={k}", io.get(b, np.float32, (1, 37))))
        io.close()
    return outs


def same_bits(define: str, base: tuple[str, ...], settings: dict[str, int] | None = None) -> int:
    """Run _bits_outputs on the emulation as it is and with ``define`` added, and compare
    them bit for bit (a define that claims the same bits, e.g. VT_FA_REG_ACC=1); the
    number of cases that differ. settings: GpuBackend attributes for both."""
    import numpy as np

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        runs = []
        for folder, defines in ((a, base), (b, (*base, define))):
            backend, _ = emulated_backend(Libraries(Path(folder), defines))
            backend.norm_fold_max_k = 0
            for name, value in (settings or {}).items():
                setattr(backend, name, value)
            runs.append(_bits_outputs(backend))
    bad = 0
    for (name, x), (_, y) in zip(*runs, strict=True):
        same = np.array_equal(x.view(np.uint32), y.view(np.uint32))
        bad += not same
        diff = "" if same else f" (max |diff| {float(np.abs(x - y).max()):.3g})"
        print(f"{'same' if same else 'DIFFERENT'}  {name}{diff}", flush=True)
    print(f"{len(runs[0]) - bad} of {len(runs[0])} cases the same bits with {define}")
    return bad


def _layout_flags(text: str) -> int:
    """``--gemv-x16-flags``' value: 0 or Q_* layout flags (vt.gpu.weights), hex allowed."""
    from vt.gpu.weights import Q_FLAGS

    try:
        flags = int(text, 0)
    except ValueError:
        flags = -1
    if flags < 0 or flags & ~Q_FLAGS:
        raise argparse.ArgumentTypeError(f"takes 0 or Q_* layout flags (0x100), not {text}")
    return flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-k", default="",
                    help="only the cases whose name contains this (A|B: either)")  # fmt: skip
    ap.add_argument("--norm-late", action="store_true",
                    help="the norm ops' kernels late-scaled, as GpuBackend.norm_late and "
                         "norm_fold_max_k (on by default) compile them")  # fmt: skip
    ap.add_argument("-D", "--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a define for the kernels, as bench_variant.py --kdefine "
                         "(repeatable; VT_GV_MAGIC=1: the gemvs' permute conversion)")  # fmt: skip
    ap.add_argument("--same-bits", metavar="NAME=VALUE",
                    help="instead of the checks: attention and one-row matmul, swiglu and qkv "
                         "with and without this define, compared bit for bit")  # fmt: skip
    ap.add_argument("--min-split", type=int, metavar="N",
                    help="GpuBackend.attention_min_split for every case (as bench_variant.py "
                         "--min-split: each split at least N positions)")  # fmt: skip
    ap.add_argument("--attention-heads", type=int, metavar="N",
                    help="GpuBackend.attention_max_group and attention_batch_max_group for "
                         "every case (as bench_variant.py --attention-heads and "
                         "--attention-batch-heads: at most N query heads a block)")  # fmt: skip
    ap.add_argument("--splits", type=int, metavar="N",
                    help="GpuBackend.attention_max_splits for every case (as bench_variant.py "
                         "--splits)")  # fmt: skip
    ap.add_argument("--attention-threads", type=int, choices=(128, 256, 512),
                    help="attention's blocks of this many threads: -D FA_THREADS=N and "
                         "GpuBackend.attention_threads (as bench_variant.py "
                         "--attention-threads)")  # fmt: skip
    ap.add_argument("--gemv-x16", type=int, metavar="R",
                    help="one-row gemv blocks of at least R weight rows on 16-bit codes of x "
                         "(GpuBackend.gemv_x16_min_rows, default 4: -D VT_GV_X16=R in the "
                         "modules it compiles into; as bench_variant.py --gemv-x16)")  # fmt: skip
    ap.add_argument("--gemv-x16-flags", type=_layout_flags, metavar="F",
                    help="only in the modules of layouts with every one of the Q_* flags F "
                         "(GpuBackend.gemv_x16_layout_flags, default 0x100: the 4-bit "
                         "layouts; 0: every module)")  # fmt: skip
    a = ap.parse_args()
    if a.gemv_x16 is not None and a.gemv_x16 < 1:
        ap.error(f"--gemv-x16 must be at least 1 (weight rows a block), not {a.gemv_x16}")
    settings: dict[str, int] = {}
    if a.gemv_x16:
        settings["gemv_x16_min_rows"] = a.gemv_x16
    if a.gemv_x16_flags is not None:
        settings["gemv_x16_layout_flags"] = a.gemv_x16_flags
    if a.attention_threads:
        settings["attention_threads"] = a.attention_threads
        a.define.append(f"FA_THREADS={a.attention_threads}")
    for flag, value, attr in (
        ("--min-split", a.min_split, "attention_min_split"),
        ("--attention-heads", a.attention_heads, "attention_max_group"),
        ("--splits", a.splits, "attention_max_splits"),
    ):
        if value is not None and value < 1:
            ap.error(f"{flag} must be at least 1, not {value}")
        if value is not None:
            settings[attr] = value
    if a.attention_heads is not None:  # at every step's rows, one or many
        settings["attention_batch_max_group"] = a.attention_heads
    if a.same_bits:
        sys.exit(1 if same_bits(a.same_bits, tuple(a.define), settings) else 0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = Libraries(Path(tmp), tuple(a.define))
        backend, _ = emulated_backend(libs)
        # Without --norm-late the norm kernels are compiled bit-equal (no VT_NORM_LATE),
        # which the norm checks then compare bit for bit.
        backend.norm_late = a.norm_late
        if not a.norm_late:
            backend.norm_fold_max_k = 0
        for name, value in settings.items():
            setattr(backend, name, value)
        import gpu_checks as checks

        def wanted(label: str) -> bool:
            return any(k in label for k in a.k.split("|"))

        start, ran = time.perf_counter(), 0
        for case in checks.TILED_CASES:
            for invalid in (False, True):
                label = f"tiled attention {case[0]}{', invalid+shuffled' if invalid else ''}"
                if wanted(label):
                    checks.test_tiled_prefill_attention(backend, case, invalid)
                    ran += 1
                    print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for case in checks.SHORT_CASES:
            label = f"short-context attention {case}"
            if wanted(label):
                checks.test_short_context_attention_is_the_reference(backend, case)
                ran += 1
                print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for case in checks.QKV_ROPE_CASES:
            for norm in (False, True):
                label = f"{'rms_norm_' if norm else ''}qkv_rope_kv_store {case[0]}"
                if wanted(label):
                    checks.test_qkv_rope_kv_store_at_one_row(backend, case, norm)
                    ran += 1
                    print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for wtype in ("Q8_0", "Q4_1", "Q4_K", "Q6_K"):
            for k_in in (96, 4608):
                label = f"rms_norm_swiglu {wtype} K={k_in}"
                if wanted(label):
                    checks.test_rms_norm_swiglu_at_one_row(backend, wtype, k_in)
                    ran += 1
                    print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for wtype in ("Q8_0", "Q4_1", "Q4_K", "Q6_K"):
            for out_f, k_in in ((96, 576), (2048, 256), (1000, 4608)):
                label = f"matmul_add_rms_norm {wtype} {out_f}x{k_in}"
                if wanted(label):
                    checks.test_matmul_add_rms_norm_at_one_row(backend, wtype, out_f, k_in)
                    ran += 1
                    print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for then in ("swiglu", "qkv"):
            for wtype in ("Q8_0", "Q4_1", "Q4_K", "Q6_K"):
                for dim in (256, 768):
                    label = f"deferred norm {then} {wtype} {dim}"
                    if wanted(label):
                        checks.test_deferred_norm_at_one_row(backend, wtype, then, dim)
                        ran += 1
                        print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for wtype in ("Q8_0", "Q4_1", "Q4_K", "Q6_K"):
            for threads, unroll in ((256, False), (128, False), (128, True)):
                label = f"long gemv {wtype} {threads} threads{' unrolled' if unroll else ''}"
                if wanted(label):
                    checks.test_long_rows_on_the_long_gemv(backend, wtype, threads, unroll)
                    ran += 1
                    print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for length in (1, 17, 129, 1025):
            for n_kv, hd, rows in ((3, 64, 2), (1, 128, 1)):
                label = f"attention past one chunk {length} {n_kv}-{hd}-{rows}"
                if wanted(label):
                    checks.test_attention_past_one_chunk(backend, length, n_kv, hd, rows)
                    ran += 1
                    print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for case in ((8, 32, 1), (3, 9, 2), (2, 8, 3)):
            label = f"last-block combine {case}"
            if wanted(label):
                checks.test_last_block_combine_equals_the_combine_launch(backend, *case)
                ran += 1
                print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for vocab in (49152, 49155, 128256):
            label = f"greedy argmax over blocks {vocab}"
            if wanted(label):
                checks.test_greedy_argmax_over_blocks(backend, vocab)
                ran += 1
                print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for vocab in (49152, 151936):
            label = f"sampling {vocab}"
            if wanted(label):
                checks.test_sampling_equals_the_reference_on_real_vocabularies(backend, vocab)
                ran += 1
                print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for wtype in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"):
            label = f"blas copies {wtype}"
            if wanted(label):
                checks.test_blas_copies_are_bit_exact(backend, wtype)
                ran += 1
                print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        backend.int8_mma = True  # the tensor-core kernels (their HIP branch) for int8 steps
        for wtype in ("Q8_0", "Q4_1", "Q4_K", "Q6_K"):
            for n in (8, 17, 32, 63):
                label = f"int8 mma {wtype} n={n}"
                if wanted(label):
                    checks.test_int8_activation_decode_kernels(backend, wtype, n, True)
                    ran += 1
                    print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for wtype in ("Q8_0", "Q4_0", "Q6_K"):
            label = f"swiglu mma1 wave {wtype}"
            if wanted(label):
                checks.test_swiglu_mma1_wave_form_gives_the_same_bits(backend, wtype)
                ran += 1
                print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for case in checks.Q8A_CASES:
            label = f"attention int8 hand-off {case}"
            if wanted(label):
                checks.test_attention_hands_its_int8_rows_to_the_projection(backend, case)
                ran += 1
                print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for wtype in ("Q8_0", "Q4_1", "Q4_K", "Q6_K"):
            for n in (8, 33):
                label = f"mma split k {wtype} n={n}"
                if wanted(label):
                    checks.test_mma_split_k_within_the_kits_bound(backend, wtype, n)
                    ran += 1
                    print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for then in ("swiglu", "qkv"):
            for wtype in ("Q8_0", "Q4_1", "Q4_K", "Q6_K"):
                # qkv at 33 rows too: qkv_rope_mma8's epilogue, 8 tiles of x
                for n in (8, 33) if then == "qkv" and wtype == "Q8_0" else (8,):
                    label = f"norm quantize {then} {wtype} n={n}"
                    if wanted(label):
                        checks.test_norm_quantize_at_int8_rows(backend, wtype, then, n)
                        ran += 1
                        print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for wtype in ("Q8_0", "Q4_1", "Q4_K", "Q6_K"):
            for k_in in (96, 4608):
                for gv in (1, 2, 4):
                    label = f"gemv {wtype} K={k_in} gv={gv}"
                    if wanted(label):
                        checks.test_gemv_one_row(backend, wtype, k_in, gv)
                        ran += 1
                        print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        label = "gemv x16 non-finite"
        # the check's Q8_0 matmul runs 4 rows a block; the one backend is both sides
        if a.gemv_x16 is not None and a.gemv_x16 <= 4 and a.gemv_x16_flags == 0 and wanted(label):
            checks.test_gemv_x16_keeps_non_finite(backend, backend)
            ran += 1
            print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        for wtype in ("Q8_0", "Q4_1", "Q4_K", "Q6_K"):
            for k_in in (96, 2560, 8192):
                label = f"gemv unrolled {wtype} K={k_in}"
                if wanted(label):
                    checks.test_gemv_unrolled_gives_the_gemvs_bits(backend, wtype, k_in)
                    ran += 1
                    print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        one_path = None  # gpu_checks.py's cuda_one_path: the same gemv path in every module
        for wtype in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"):
            for case in checks.LAYOUT_PATHS:
                label = f"layouts {wtype} {case[0]}"
                if wanted(label) and case[0] not in ("tiled", "blas"):  # not emulated
                    if one_path is None:
                        one_path, _ = emulated_backend(libs)
                        for name in ("norm_late", "norm_fold_max_k", *settings):
                            setattr(one_path, name, getattr(backend, name))
                        one_path.gemv_x16_layout_flags = 0
                    checks.test_compact_layouts_give_the_wide_layouts_bits(one_path, wtype, case)
                    ran += 1
                    print(f"ok  {label} ({time.perf_counter() - start:.0f} s)", flush=True)
        print(f"{ran} emulated checks passed")


if __name__ == "__main__":
    main()
