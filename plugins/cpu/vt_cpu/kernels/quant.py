"""Matrix-vector kernels over GGML block formats, and row dequantization.

Weights stay in their file's blocks: ``raw`` is the tensor's bytes as a 2-D array of one
block per row (``[rows * blocks_per_row, block_bytes]``, a view of the mmapped file, never
copied), scales included: numba has no float16, so the kernels read a block's float16
scales as two bytes and convert them through a 65536-entry table (:data:`F16_TO_F32`),
and unpack K-quant 6-bit sub-block scales as they go. No copy of any scale is kept
(float32 scale arrays cost 12-40% of a model's size, and were no faster).

``mv_*`` computes ``out[t, r] = sum_k x[t, k] * w[r, k] (+ res[t, r])`` for a few
activation rows ``t`` (decode): each block is dequantized in registers and multiplied in
float32 with float32 activations, accumulated in float32. Four weight rows (two for the
K-quants) run together, sharing each activation load; each row accumulates
``scale * q * x`` in 16 or 32 lanes across all its blocks, in a stack array that LLVM
keeps in vector registers, and sums the
lanes once at the end of the row (a sum per block cost a third of the time); the inner
loops run over contiguous lanes so that LLVM vectorizes them; nibbles are split with float
arithmetic (``hi = floor(q / 16)``, ``lo = q - 16 hi``, exact for bytes), which stays in
32-bit lanes (numba widens integer arithmetic to 64 bits). ``mv1_*`` runs on the calling
thread; ``mv_*`` splits the row pairs over ``nchunk`` of numba's threads (``prange``).

``dq_*`` dequantizes the listed rows into float32 (``embedding`` and the prefill tiles).
Their results equal ``gguf``'s dequantization up to float32 rounding of ``d * q + m``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

F = np.float32
#: Reassociation lets LLVM vectorize the reductions; contraction allows FMA. No
#: finite-math or reciprocal flags: results stay those of a float32 sum in another order.
FM = {"reassoc", "contract"}
_KW = {"cache": True, "nogil": True, "boundscheck": False, "fastmath": FM}


@njit(**_KW)
def _block_sums(x):
    """``xs[t, b] = sum(x[t, b, :])`` for ``x[n, nb, 32]``."""
    n, nb = x.shape[0], x.shape[1]
    xs = np.empty((n, nb), dtype=np.float32)
    for t in range(n):
        for b in range(nb):
            s = F(0.0)
            for j in range(32):
                s += x[t, b, j]
            xs[t, b] = s
    return xs


@intrinsic
def _stack_f32(typingctx, n):
    """A pointer to ``n`` (a literal) float32 on the stack, 64-byte aligned: with constant
    indices after unrolling, LLVM keeps them in vector registers (a heap array is reloaded
    every step), and what it does not keep there never splits a cache line."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = n.literal_value

    def codegen(context, builder, sig, args):
        arr = builder.alloca(ir.ArrayType(ir.FloatType(), size))
        arr.align = 64  # a cache line: a vector of 16 never straddles two
        zero = ir.Constant(ir.IntType(32), 0)
        return builder.gep(arr, [zero, zero])

    return types.CPointer(types.float32)(n), codegen


@intrinsic
def _prefetch(typingctx, arr, offset):
    """Ask the CPU to bring byte ``offset`` of ``arr``'s data into the caches (a hint: no
    fault, no effect on results). Decode streams every weight once per token, and the
    hardware prefetcher alone left the kernels waiting on memory (Q8_0 49152x576 from DRAM:
    6.8 -> 10.8 GB/s with these hints)."""
    sig = types.void(arr, offset)

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(builder.bitcast(ary.data, ir.IntType(8).as_pointer()), [args[1]])
        name = "llvm.prefetch.p0" if str(ptr.type) == "ptr" else "llvm.prefetch.p0i8"
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)
        # read, high temporal locality, data cache
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


#: How far ahead of the rows being multiplied the kernels prefetch, in bytes.
PREFETCH_AHEAD = 6144


@njit(**_KW, inline="always")
def _prefetch_rows(raw, first_block, nblocks):
    """Prefetch the ``nblocks`` blocks that start ``PREFETCH_AHEAD`` bytes after block
    ``first_block`` of ``raw[blocks, block_bytes]`` (clipped to the array)."""
    bb = raw.shape[1]
    total = raw.shape[0] * bb
    start = first_block * bb + PREFETCH_AHEAD
    stop = min(total, start + nblocks * bb)
    for o in range(start, stop, 64):
        _prefetch(raw, o)


#: float16 -> float32 for every bit pattern (256 KiB, shared by all kernels): the block
#: scales stay in the file's bytes (no float32 copies of them), and numba has no float16.
F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(F)


@njit(**_KW, inline="always")
def _f16(raw, i, o):
    """The float16 at bytes ``o, o + 1`` of block ``i`` of ``raw`` (uint8), as float32."""
    return F16_TO_F32[np.int64(raw[i, o]) | (np.int64(raw[i, o + 1]) << 8)]


@njit(**_KW, inline="always")
def _k_scale_min(raw, i, j):
    """Sub-block ``j``'s 6-bit scale and min of a Q4_K/Q5_K block (bytes 4..15), as float32
    (``gguf``'s ``get_scale_min``)."""
    if j < 4:
        sc = np.int64(raw[i, 4 + j]) & 63
        mn = np.int64(raw[i, 8 + j]) & 63
    else:
        sc = (np.int64(raw[i, 8 + j]) & 15) | ((np.int64(raw[i, j]) >> 6) << 4)
        mn = (np.int64(raw[i, 8 + j]) >> 4) | ((np.int64(raw[i, 4 + j]) >> 6) << 4)
    return F(sc), F(mn)


@njit(**_KW, inline="always")
def _put2(out, t, r, a0, a1):
    out[t, r] = a0
    if r + 1 < out.shape[1]:
        out[t, r + 1] = a1


@njit(**_KW, inline="always")
def _put4(out, t, r, a0, a1, a2, a3):
    _put2(out, t, r, a0, a1)
    if r + 2 < out.shape[1]:
        _put2(out, t, r + 2, a2, a3)


@njit(**_KW)
def _target(out, add):
    """Where the rows' products go: ``out``, or a scratch when a residual is added after
    (``out`` may be the residual). Keeping the add out of the row loops kept them fast:
    a residual flag inside cost 25% (11.3 -> 8.5 GB/s for Q4_1)."""
    return np.empty_like(out) if add else out


@njit(**_KW)
def _finish(out, tmp, res, add):
    if add:
        n, rows = out.shape
        for t in range(n):
            for r in range(rows):
                out[t, r] = tmp[t, r] + res[t, r]


# --------------------------------------------------------------------------- Q8_0


@njit(**_KW)
def _rows_q8_0(q, raw, x, out, g0, g1):
    """Rows ``4 g0 .. 4 g1`` (four at a time): lane ``j`` of a row accumulates
    ``d_b q_bj x_bj`` over all blocks ``b`` in a register, summed across lanes once per row."""
    n, nb = x.shape[0], x.shape[1]
    rows = out.shape[1]
    acc = carray(_stack_f32(128), 128)
    for g in range(g0, g1):
        r = g * 4
        i0 = r * nb
        i1 = min(r + 1, rows - 1) * nb
        i2 = min(r + 2, rows - 1) * nb
        i3 = min(r + 3, rows - 1) * nb
        _prefetch_rows(raw, i0, 4 * nb)
        for t in range(n):
            for j in range(128):
                acc[j] = F(0.0)
            for b in range(nb):
                d0 = _f16(raw, i0 + b, 0)
                d1 = _f16(raw, i1 + b, 0)
                d2 = _f16(raw, i2 + b, 0)
                d3 = _f16(raw, i3 + b, 0)
                for j in range(32):
                    xj = x[t, b, j]
                    acc[j] += F(q[i0 + b, 2 + j]) * xj * d0
                    acc[32 + j] += F(q[i1 + b, 2 + j]) * xj * d1
                    acc[64 + j] += F(q[i2 + b, 2 + j]) * xj * d2
                    acc[96 + j] += F(q[i3 + b, 2 + j]) * xj * d3
            a0 = F(0.0)
            a1 = F(0.0)
            a2 = F(0.0)
            a3 = F(0.0)
            for j in range(32):
                a0 += acc[j]
                a1 += acc[32 + j]
                a2 += acc[64 + j]
                a3 += acc[96 + j]
            _put4(out, t, r, a0, a1, a2, a3)


@njit(**_KW, parallel=True)
def mv_q8_0(q, raw, x, out, res, add, nchunk):
    """``q``: int8 view ``[rows * nb, 34]`` of the blocks, ``raw`` the uint8 one."""
    tgt = _target(out, add)
    groups = (out.shape[1] + 3) // 4
    for c in prange(nchunk):
        _rows_q8_0(q, raw, x, tgt, c * groups // nchunk, (c + 1) * groups // nchunk)
    _finish(out, tgt, res, add)


@njit(**_KW)
def mv1_q8_0(q, raw, x, out, res, add):
    tgt = _target(out, add)
    _rows_q8_0(q, raw, x, tgt, 0, (out.shape[1] + 3) // 4)
    _finish(out, tgt, res, add)


@njit(**_KW)
def dq_q8_0(q, raw, rows, out):
    nb = out.shape[1] // 32
    if nb == 0:
        return
    # 32 values a block, as a trip count LLVM cannot see: with a constant 32 it unrolled
    # the loop into scalar code; now it vectorizes it (2.7 -> 7.0 G values/s, same bits)
    per = out.shape[1] // nb
    for k in range(rows.shape[0]):
        i = rows[k] * nb
        for b in range(nb):
            db = _f16(raw, i + b, 0)
            qb = q[i + b, 2:]
            ob = out[k, b * 32 :]
            for j in range(per):
                ob[j] = db * F(qb[j])


# --------------------------------------------------------------------------- Q4_0 / Q4_1


@njit(**_KW, inline="always")
def _nib(byte):
    """(lo, hi) nibbles of a byte, as float32."""
    v = F(byte)
    hi = np.floor(v * F(0.0625))
    return v - F(16.0) * hi, hi


@njit(**_KW)
def _hi_weights(x):
    """``xd[t, b, j] = x[t, b, 16 + j] - 16 x[t, b, j]``: with ``lo = q - 16 hi`` a byte's two
    nibbles contribute ``q x_lo + hi xd``, one operation less per byte than splitting both
    (measured 6.4 -> 8.0 GB/s for Q4_1 in cache)."""
    n, nb = x.shape[0], x.shape[1]
    xd = np.empty((n, nb, 16), dtype=np.float32)
    for t in range(n):
        for b in range(nb):
            for j in range(16):
                xd[t, b, j] = x[t, b, 16 + j] - F(16.0) * x[t, b, j]
    return xd


@njit(**_KW)
def _rows_q4_1(raw, x, xd, xs, out, g0, g1):
    """Q4_1: value ``d * q + m``, block ``[d, m, qs[16]]`` (20 bytes); low nibbles are
    elements 0..15 of a block, high nibbles 16..31. Four rows at a time (2 rows: 8.4 GB/s,
    4 rows: 11.4 in cache), 16 register lanes each; the mins' term ``m_b sum(x_b)`` is a
    scalar per block. (Q4_0 is a copy: a runtime flag in the loop cost 20%.)"""
    n, nb = x.shape[0], x.shape[1]
    rows = out.shape[1]
    acc = carray(_stack_f32(64), 64)
    for g in range(g0, g1):
        r = g * 4
        i0 = r * nb
        i1 = min(r + 1, rows - 1) * nb
        i2 = min(r + 2, rows - 1) * nb
        i3 = min(r + 3, rows - 1) * nb
        _prefetch_rows(raw, i0, 4 * nb)
        for t in range(n):
            for j in range(64):
                acc[j] = F(0.0)
            m0 = F(0.0)
            m1 = F(0.0)
            m2 = F(0.0)
            m3 = F(0.0)
            for b in range(nb):
                d0 = _f16(raw, i0 + b, 0)
                d1 = _f16(raw, i1 + b, 0)
                d2 = _f16(raw, i2 + b, 0)
                d3 = _f16(raw, i3 + b, 0)
                for j in range(16):
                    xl = x[t, b, j]
                    xh = xd[t, b, j]
                    q = F(raw[i0 + b, 4 + j])
                    acc[j] += (q * xl + np.floor(q * F(0.0625)) * xh) * d0
                    q = F(raw[i1 + b, 4 + j])
                    acc[16 + j] += (q * xl + np.floor(q * F(0.0625)) * xh) * d1
                    q = F(raw[i2 + b, 4 + j])
                    acc[32 + j] += (q * xl + np.floor(q * F(0.0625)) * xh) * d2
                    q = F(raw[i3 + b, 4 + j])
                    acc[48 + j] += (q * xl + np.floor(q * F(0.0625)) * xh) * d3
                xb = xs[t, b]
                m0 += _f16(raw, i0 + b, 2) * xb
                m1 += _f16(raw, i1 + b, 2) * xb
                m2 += _f16(raw, i2 + b, 2) * xb
                m3 += _f16(raw, i3 + b, 2) * xb
            a0 = m0
            a1 = m1
            a2 = m2
            a3 = m3
            for j in range(16):
                a0 += acc[j]
                a1 += acc[16 + j]
                a2 += acc[32 + j]
                a3 += acc[48 + j]
            _put4(out, t, r, a0, a1, a2, a3)


@njit(**_KW)
def _rows_q4_0(raw, x, xd, xs, out, g0, g1):
    """Q4_0: value ``d * (q - 8)``, block ``[d, qs[16]]`` (18 bytes)."""
    n, nb = x.shape[0], x.shape[1]
    rows = out.shape[1]
    acc = carray(_stack_f32(64), 64)
    for g in range(g0, g1):
        r = g * 4
        i0 = r * nb
        i1 = min(r + 1, rows - 1) * nb
        i2 = min(r + 2, rows - 1) * nb
        i3 = min(r + 3, rows - 1) * nb
        _prefetch_rows(raw, i0, 4 * nb)
        for t in range(n):
            for j in range(64):
                acc[j] = F(0.0)
            m0 = F(0.0)
            m1 = F(0.0)
            m2 = F(0.0)
            m3 = F(0.0)
            for b in range(nb):
                d0 = _f16(raw, i0 + b, 0)
                d1 = _f16(raw, i1 + b, 0)
                d2 = _f16(raw, i2 + b, 0)
                d3 = _f16(raw, i3 + b, 0)
                for j in range(16):
                    xl = x[t, b, j]
                    xh = xd[t, b, j]
                    q = F(raw[i0 + b, 2 + j])
                    acc[j] += (q * xl + np.floor(q * F(0.0625)) * xh) * d0
                    q = F(raw[i1 + b, 2 + j])
                    acc[16 + j] += (q * xl + np.floor(q * F(0.0625)) * xh) * d1
                    q = F(raw[i2 + b, 2 + j])
                    acc[32 + j] += (q * xl + np.floor(q * F(0.0625)) * xh) * d2
                    q = F(raw[i3 + b, 2 + j])
                    acc[48 + j] += (q * xl + np.floor(q * F(0.0625)) * xh) * d3
                xb = xs[t, b]
                m0 -= F(8.0) * d0 * xb
                m1 -= F(8.0) * d1 * xb
                m2 -= F(8.0) * d2 * xb
                m3 -= F(8.0) * d3 * xb
            a0 = m0
            a1 = m1
            a2 = m2
            a3 = m3
            for j in range(16):
                a0 += acc[j]
                a1 += acc[16 + j]
                a2 += acc[32 + j]
                a3 += acc[48 + j]
            _put4(out, t, r, a0, a1, a2, a3)


@njit(**_KW, parallel=True)
def mv_q4(raw, x, out, res, add, nchunk, has_min):
    tgt = _target(out, add)
    xd, xs = _hi_weights(x), _block_sums(x)
    groups = (out.shape[1] + 3) // 4
    for c in prange(nchunk):
        g0, g1 = c * groups // nchunk, (c + 1) * groups // nchunk
        if has_min:
            _rows_q4_1(raw, x, xd, xs, tgt, g0, g1)
        else:
            _rows_q4_0(raw, x, xd, xs, tgt, g0, g1)
    _finish(out, tgt, res, add)


@njit(**_KW)
def mv1_q4(raw, x, out, res, add, has_min):
    tgt = _target(out, add)
    groups = (out.shape[1] + 3) // 4
    xd, xs = _hi_weights(x), _block_sums(x)
    if has_min:
        _rows_q4_1(raw, x, xd, xs, tgt, 0, groups)
    else:
        _rows_q4_0(raw, x, xd, xs, tgt, 0, groups)
    _finish(out, tgt, res, add)


@njit(**_KW)
def dq_q4(raw, rows, out, has_min):
    nb = out.shape[1] // 32
    if nb == 0:
        return
    half = out.shape[1] // nb // 2  # 16, unseen by LLVM: it vectorizes (see dq_q8_0)
    off = 4 if has_min else 2
    for k in range(rows.shape[0]):
        i = rows[k] * nb
        for b in range(nb):
            db = _f16(raw, i + b, 0)
            mb = _f16(raw, i + b, 2) if has_min else F(-8.0) * db
            qb = raw[i + b, off:]
            ob = out[k, b * 32 :]
            for j in range(half):
                lo, hi = _nib(qb[j])
                ob[j] = db * lo + mb
                ob[half + j] = db * hi + mb


# --------------------------------------------------------------------------- Q4_K / Q5_K
# Block of 256 = 8 sub-blocks of 32: [d, dmin, scales[12], (Q5_K: qh[32]), qs[128]].
# Sub-block s reads qs[32 * (s // 2) + j], low nibble for even s, high for odd;
# value d * sc[s] * q - dmin * mn[s], with q += 16 * bit s of qh[j] for Q5_K.


@njit(**_KW, inline="always")
def _bits2(byte, p0, p1, p2):
    """Bits k and k+1 of a byte as float32 (0 or 1), given ``p_i = 2**-(k + i)``."""
    v = F(byte)
    f0 = np.floor(v * p0)
    f1 = np.floor(v * p1)
    f2 = np.floor(v * p2)
    return f0 - F(2.0) * f1, f1 - F(2.0) * f2


@njit(**_KW, inline="always")
def _pow2s(k):
    return F(0.5**k), F(0.5 ** (k + 1)), F(0.5 ** (k + 2))


@njit(**_KW)
def _rows_q4_k(raw, x, xs, out, g0, g1):
    n, nsub = x.shape[0], x.shape[1]
    nbk = nsub // 8
    rows = out.shape[1]
    acc = carray(_stack_f32(64), 64)
    for g in range(g0, g1):
        r = g * 2
        i0 = r * nbk
        i1 = min(r + 1, rows - 1) * nbk
        _prefetch_rows(raw, i0, 2 * nbk)
        for t in range(n):
            for j in range(64):
                acc[j] = F(0.0)
            m0 = F(0.0)
            m1 = F(0.0)
            for kb in range(nbk):
                d0 = _f16(raw, i0 + kb, 0)
                dm0 = _f16(raw, i0 + kb, 2)
                d1 = _f16(raw, i1 + kb, 0)
                dm1 = _f16(raw, i1 + kb, 2)
                for h in range(4):
                    s = 2 * h
                    sb = kb * 8 + s
                    sa0, ma0 = _k_scale_min(raw, i0 + kb, s)
                    sb0, mb0 = _k_scale_min(raw, i0 + kb, s + 1)
                    sa1, ma1 = _k_scale_min(raw, i1 + kb, s)
                    sb1, mb1 = _k_scale_min(raw, i1 + kb, s + 1)
                    la0 = d0 * sa0
                    ha0 = d0 * sb0
                    la1 = d1 * sa1
                    ha1 = d1 * sb1
                    for j in range(32):
                        xl = x[t, sb, j]
                        xh = x[t, sb + 1, j]
                        lo, hi = _nib(raw[i0 + kb, 16 + 32 * h + j])
                        acc[j] += lo * xl * la0 + hi * xh * ha0
                        lo, hi = _nib(raw[i1 + kb, 16 + 32 * h + j])
                        acc[32 + j] += lo * xl * la1 + hi * xh * ha1
                    xa = xs[t, sb]
                    xb = xs[t, sb + 1]
                    m0 += dm0 * (ma0 * xa + mb0 * xb)
                    m1 += dm1 * (ma1 * xa + mb1 * xb)
            a0 = -m0
            a1 = -m1
            for j in range(32):
                a0 += acc[j]
                a1 += acc[32 + j]
            _put2(out, t, r, a0, a1)


@njit(**_KW)
def _rows_q5_k(raw, x, xs, out, g0, g1):
    n, nsub = x.shape[0], x.shape[1]
    nbk = nsub // 8
    rows = out.shape[1]
    acc = carray(_stack_f32(64), 64)
    for g in range(g0, g1):
        r = g * 2
        i0 = r * nbk
        i1 = min(r + 1, rows - 1) * nbk
        _prefetch_rows(raw, i0, 2 * nbk)
        for t in range(n):
            for j in range(64):
                acc[j] = F(0.0)
            m0 = F(0.0)
            m1 = F(0.0)
            for kb in range(nbk):
                d0 = _f16(raw, i0 + kb, 0)
                dm0 = _f16(raw, i0 + kb, 2)
                d1 = _f16(raw, i1 + kb, 0)
                dm1 = _f16(raw, i1 + kb, 2)
                for h in range(4):
                    s = 2 * h
                    p0, p1, p2 = _pow2s(s)
                    sb = kb * 8 + s
                    sa0, ma0 = _k_scale_min(raw, i0 + kb, s)
                    sb0, mb0 = _k_scale_min(raw, i0 + kb, s + 1)
                    sa1, ma1 = _k_scale_min(raw, i1 + kb, s)
                    sb1, mb1 = _k_scale_min(raw, i1 + kb, s + 1)
                    la0 = d0 * sa0
                    ha0 = d0 * sb0
                    la1 = d1 * sa1
                    ha1 = d1 * sb1
                    for j in range(32):
                        xl = x[t, sb, j]
                        xh = x[t, sb + 1, j]
                        lo, hi = _nib(raw[i0 + kb, 48 + 32 * h + j])
                        b0, c0 = _bits2(raw[i0 + kb, 16 + j], p0, p1, p2)
                        lo += F(16.0) * b0
                        hi += F(16.0) * c0
                        acc[j] += lo * xl * la0 + hi * xh * ha0
                        lo, hi = _nib(raw[i1 + kb, 48 + 32 * h + j])
                        b1, c1 = _bits2(raw[i1 + kb, 16 + j], p0, p1, p2)
                        lo += F(16.0) * b1
                        hi += F(16.0) * c1
                        acc[32 + j] += lo * xl * la1 + hi * xh * ha1
                    xa = xs[t, sb]
                    xb = xs[t, sb + 1]
                    m0 += dm0 * (ma0 * xa + mb0 * xb)
                    m1 += dm1 * (ma1 * xa + mb1 * xb)
            a0 = -m0
            a1 = -m1
            for j in range(32):
                a0 += acc[j]
                a1 += acc[32 + j]
            _put2(out, t, r, a0, a1)


@njit(**_KW, parallel=True)
def mv_qk45(raw, x, out, res, add, nchunk, five):
    """Q4_K (``five`` False, 144-byte blocks) and Q5_K (176-byte blocks)."""
    tgt = _target(out, add)
    xs = _block_sums(x)
    groups = (out.shape[1] + 1) // 2
    for c in prange(nchunk):
        g0, g1 = c * groups // nchunk, (c + 1) * groups // nchunk
        if five:
            _rows_q5_k(raw, x, xs, tgt, g0, g1)
        else:
            _rows_q4_k(raw, x, xs, tgt, g0, g1)
    _finish(out, tgt, res, add)


@njit(**_KW)
def mv1_qk45(raw, x, out, res, add, five):
    tgt = _target(out, add)
    xs = _block_sums(x)
    groups = (out.shape[1] + 1) // 2
    if five:
        _rows_q5_k(raw, x, xs, tgt, 0, groups)
    else:
        _rows_q4_k(raw, x, xs, tgt, 0, groups)
    _finish(out, tgt, res, add)


@njit(**_KW)
def dq_qk45(raw, rows, out, five):
    nbk = out.shape[1] // 256
    qoff = 48 if five else 16
    for k in range(rows.shape[0]):
        i = rows[k] * nbk
        for kb in range(nbk):
            for h in range(4):
                s = 2 * h
                p0, p1, p2 = _pow2s(s)
                sa, ma = _k_scale_min(raw, i + kb, s)
                sb, mb = _k_scale_min(raw, i + kb, s + 1)
                d0 = _f16(raw, i + kb, 0) * sa
                d1 = _f16(raw, i + kb, 0) * sb
                m0 = _f16(raw, i + kb, 2) * ma
                m1 = _f16(raw, i + kb, 2) * mb
                base = kb * 256 + 64 * h
                for j in range(32):
                    lo, hi = _nib(raw[i + kb, qoff + 32 * h + j])
                    if five:
                        b0, b1 = _bits2(raw[i + kb, 16 + j], p0, p1, p2)
                        lo += F(16.0) * b0
                        hi += F(16.0) * b1
                    out[k, base + j] = d0 * lo - m0
                    out[k, base + 32 + j] = d1 * hi - m1


# --------------------------------------------------------------------------- Q6_K
# Block of 256: [ql[128], qh[64], scales[16] (int8), d]. Half h (128 values) reads
# A = ql[64h + j], B = ql[64h + 32 + j], Q = qh[32h + j] for j < 32; its four groups of
# 32 are lo(A), lo(B), hi(A), hi(B), each with 2 bits of Q (bits 0-1, 2-3, 4-5, 6-7)
# on top; value d * scales[16h/... + j // 16] * (q - 32): group g = 4h + k uses scale
# 2g + (j >= 16).


@njit(**_KW, inline="always")
def _q6(a, b, qh):
    """The four 6-bit values (minus 32) of one (A, B, Q) byte triple, as float32."""
    alo, ahi = _nib(a)
    blo, bhi = _nib(b)
    v = F(qh)
    f1 = np.floor(v * F(0.25))
    f2 = np.floor(v * F(0.0625))
    f3 = np.floor(v * F(0.015625))
    e0 = v - F(4.0) * f1
    e1 = f1 - F(4.0) * f2
    e2 = f2 - F(4.0) * f3
    e3 = f3
    return (
        alo + F(16.0) * e0 - F(32.0),
        blo + F(16.0) * e1 - F(32.0),
        ahi + F(16.0) * e2 - F(32.0),
        bhi + F(16.0) * e3 - F(32.0),
    )


@njit(**_KW)
def _rows_q6_k(raw, sc, x, out, r0, r1):
    """``raw``: uint8 ``[rows * nbk, 210]``; ``sc``: its int8 view. One
    row at a time: the four groups of a half already give four independent sums."""
    n, nsub = x.shape[0], x.shape[1]
    nbk = nsub // 8
    for r in range(r0, r1):
        i0 = r * nbk
        _prefetch_rows(raw, i0, nbk)
        for t in range(n):
            a = F(0.0)
            for kb in range(nbk):
                i = i0 + kb
                for h in range(2):
                    sb = kb * 8 + 4 * h
                    for half in range(2):
                        s0 = F(0.0)
                        s1 = F(0.0)
                        s2 = F(0.0)
                        s3 = F(0.0)
                        for jj in range(16):
                            j = 16 * half + jj
                            v0, v1, v2, v3 = _q6(
                                raw[i, 64 * h + j], raw[i, 64 * h + 32 + j],
                                raw[i, 128 + 32 * h + j],
                            )  # fmt: skip
                            s0 += v0 * x[t, sb, j]
                            s1 += v1 * x[t, sb + 1, j]
                            s2 += v2 * x[t, sb + 2, j]
                            s3 += v3 * x[t, sb + 3, j]
                        gs = 192 + 8 * h + half
                        a += _f16(raw, i, 208) * (
                            F(sc[i, gs]) * s0 + F(sc[i, gs + 2]) * s1
                            + F(sc[i, gs + 4]) * s2 + F(sc[i, gs + 6]) * s3
                        )  # fmt: skip
            out[t, r] = a


@njit(**_KW, parallel=True)
def mv_q6_k(raw, sc, x, out, res, add, nchunk):
    tgt = _target(out, add)
    rows = out.shape[1]
    for c in prange(nchunk):
        _rows_q6_k(raw, sc, x, tgt, c * rows // nchunk, (c + 1) * rows // nchunk)
    _finish(out, tgt, res, add)


@njit(**_KW)
def mv1_q6_k(raw, sc, x, out, res, add):
    tgt = _target(out, add)
    _rows_q6_k(raw, sc, x, tgt, 0, out.shape[1])
    _finish(out, tgt, res, add)


@njit(**_KW)
def dq_q6_k(raw, sc, rows, out):
    # The scales are read once per 16 values, outside the loop over them (with them inside,
    # and a division per value, LLVM kept the loop scalar: 0.7 -> 6.0 G values/s, same bits).
    nbk = out.shape[1] // 256
    for k in range(rows.shape[0]):
        i0 = rows[k] * nbk
        o = out[k]
        for kb in range(nbk):
            i = i0 + kb
            blk = raw[i]
            di = _f16(raw, i, 208)
            for h in range(2):
                base = kb * 256 + 128 * h
                ob = o[base : base + 128]
                for half in range(2):
                    gs = 192 + 8 * h + half
                    s0, s1 = di * F(sc[i, gs]), di * F(sc[i, gs + 2])
                    s2, s3 = di * F(sc[i, gs + 4]), di * F(sc[i, gs + 6])
                    for jj in range(16):
                        j = 16 * half + jj
                        v0, v1, v2, v3 = _q6(blk[64 * h + j], blk[64 * h + 32 + j],
                                             blk[128 + 32 * h + j])  # fmt: skip
                        ob[j] = s0 * v0
                        ob[32 + j] = s1 * v1
                        ob[64 + j] = s2 * v2
                        ob[96 + j] = s3 * v3


# --------------------------------------------------------------------------- batched decode
# ``mm_*`` computes the same product as ``mv_*`` for several activation rows (a decode
# step of several sequences): a tile of 4 weight rows x 4 activation rows. Each value of
# the 4 weight rows is dequantized once per tile, in registers, and multiplied with the 4
# activation rows, accumulating in 16 lanes per (activation row, weight row) pair: 256
# float32 in ``acc`` (16 AVX-512 registers), lane ``j`` of pair ``(k, rr)`` at
# ``acc[64 k + 16 rr + j]``, summed across lanes once per tile. The blocks of a group of
# weight rows (a few KiB) stay in L1 while the activation rows pass by 4 at a time, so a
# block comes from memory once per step and is dequantized once per 4 activation rows
# (``mv_*`` dequantizes it once per row). A last group of fewer than 4 activation rows
# repeats its last row (computed, not stored). ``mm1_*`` runs on the calling thread,
# ``mm_*`` splits the weight row groups over ``nchunk`` of numba's threads.


@njit(**_KW, inline="always")
def _acc4(acc, lane, w0, b0, j0, w1, b1, j1, x, ta, tb, tc, td):
    """Add two dequantized values of one weight row, ``w0`` (element ``j0`` of sub-block
    ``b0``) and ``w1``, times the 4 activation rows ``ta..td`` to lane ``lane`` of the row's
    4 pairs."""
    acc[lane] += w0 * x[ta, b0, j0] + w1 * x[ta, b1, j1]
    acc[lane + 64] += w0 * x[tb, b0, j0] + w1 * x[tb, b1, j1]
    acc[lane + 128] += w0 * x[tc, b0, j0] + w1 * x[tc, b1, j1]
    acc[lane + 192] += w0 * x[td, b0, j0] + w1 * x[td, b1, j1]


@njit(**_KW, inline="always")
def _tile_rows(t0, n):
    """The 4 activation rows of the tile at ``t0``, the last repeated past ``n``."""
    return t0, min(t0 + 1, n - 1), min(t0 + 2, n - 1), min(t0 + 3, n - 1)


@njit(**_KW, inline="always")
def _row_blocks(r, rows, nb):
    """First blocks of weight rows ``r .. r + 3`` (the last repeated past ``rows``)."""
    return (r * nb, min(r + 1, rows - 1) * nb, min(r + 2, rows - 1) * nb,
            min(r + 3, rows - 1) * nb)  # fmt: skip


@njit(**_KW, inline="always")
def _store_tile(acc, out, t0, r):
    n, rows = out.shape
    for k in range(4):
        t = t0 + k
        for rr in range(4):
            s = F(0.0)
            for j in range(16):
                s += acc[64 * k + 16 * rr + j]
            if t < n and r + rr < rows:
                out[t, r + rr] = s


#: Activation rows from which the tile kernels take tiles of 2 weight rows x 8 activation
#: rows (16 pairs of 16 lanes again, but each dequantized block serves 8 rows: for Q4_1 46
#: vector operations per 32 FMAs instead of 60; one thread, 16 rows: Q4_1 1536x576 0.42 ->
#: 0.34 ms, Q4_K 1536x768 0.88 -> 0.69, Q5_K 1.20 -> 0.85, Q6_K 1.24 -> 1.11); fewer rows
#: keep the 4 x 4 tiles (a half-empty 2 x 8 tile costs more).
MM8_MIN_ROWS = 8


@njit(**_KW, inline="always")
def _acc8(acc, lane, w0, b0, j0, w1, b1, j1, x, ts):
    """``_acc4`` for 8 activation rows ``ts``: pair ``k`` of the weight row at
    ``acc[lane + 32 k]``."""
    ta, tb, tc, td, te, tf, tg, th = ts
    acc[lane] += w0 * x[ta, b0, j0] + w1 * x[ta, b1, j1]
    acc[lane + 32] += w0 * x[tb, b0, j0] + w1 * x[tb, b1, j1]
    acc[lane + 64] += w0 * x[tc, b0, j0] + w1 * x[tc, b1, j1]
    acc[lane + 96] += w0 * x[td, b0, j0] + w1 * x[td, b1, j1]
    acc[lane + 128] += w0 * x[te, b0, j0] + w1 * x[te, b1, j1]
    acc[lane + 160] += w0 * x[tf, b0, j0] + w1 * x[tf, b1, j1]
    acc[lane + 192] += w0 * x[tg, b0, j0] + w1 * x[tg, b1, j1]
    acc[lane + 224] += w0 * x[th, b0, j0] + w1 * x[th, b1, j1]


@njit(**_KW, inline="always")
def _tile8_rows(t0, n):
    """The 8 activation rows of the tile at ``t0``, the last repeated past ``n``."""
    ta, tb, tc, td = _tile_rows(t0, n)
    te, tf, tg, th = _tile_rows(t0 + 4, n)
    return ta, tb, tc, td, min(te, n - 1), tf, tg, th


@njit(**_KW, inline="always")
def _store_tile8(acc, out, t0, r):
    """Lane sums: activation row ``t0 + k``, weight row ``r + rr`` at ``acc[32 k + 16 rr]``."""
    n, rows = out.shape
    for k in range(8):
        t = t0 + k
        for rr in range(2):
            s = F(0.0)
            for j in range(16):
                s += acc[32 * k + 16 * rr + j]
            if t < n and r + rr < rows:
                out[t, r + rr] = s


@njit(**_KW)
def _tile_q8_0(q, raw, x, out, g0, g1):
    n, nb = x.shape[0], x.shape[1]
    rows = out.shape[1]
    acc = carray(_stack_f32(256), 256)
    for g in range(g0, g1):
        r = g * 4
        i0, i1, i2, i3 = _row_blocks(r, rows, nb)
        _prefetch_rows(raw, i0, 4 * nb)
        for t0 in range(0, n, 4):
            ta, tb, tc, td = _tile_rows(t0, n)
            for j in range(256):
                acc[j] = F(0.0)
            for b in range(nb):
                d0 = _f16(raw, i0 + b, 0)
                d1 = _f16(raw, i1 + b, 0)
                d2 = _f16(raw, i2 + b, 0)
                d3 = _f16(raw, i3 + b, 0)
                for j in range(16):
                    w0, w1 = d0 * F(q[i0 + b, 2 + j]), d0 * F(q[i0 + b, 18 + j])
                    _acc4(acc, j, w0, b, j, w1, b, 16 + j, x, ta, tb, tc, td)
                    w0, w1 = d1 * F(q[i1 + b, 2 + j]), d1 * F(q[i1 + b, 18 + j])
                    _acc4(acc, 16 + j, w0, b, j, w1, b, 16 + j, x, ta, tb, tc, td)
                    w0, w1 = d2 * F(q[i2 + b, 2 + j]), d2 * F(q[i2 + b, 18 + j])
                    _acc4(acc, 32 + j, w0, b, j, w1, b, 16 + j, x, ta, tb, tc, td)
                    w0, w1 = d3 * F(q[i3 + b, 2 + j]), d3 * F(q[i3 + b, 18 + j])
                    _acc4(acc, 48 + j, w0, b, j, w1, b, 16 + j, x, ta, tb, tc, td)
            _store_tile(acc, out, t0, r)


@njit(**_KW)
def _tile8_q8_0(q, raw, x, out, g0, g1):
    """Weight rows ``2 g0 .. 2 g1``, 8 activation rows at a time."""
    n, nb = x.shape[0], x.shape[1]
    rows = out.shape[1]
    acc = carray(_stack_f32(256), 256)
    for g in range(g0, g1):
        r = g * 2
        i0, i1 = r * nb, min(r + 1, rows - 1) * nb
        _prefetch_rows(raw, i0, 2 * nb)
        for t0 in range(0, n, 8):
            ts = _tile8_rows(t0, n)
            for j in range(256):
                acc[j] = F(0.0)
            for b in range(nb):
                d0 = _f16(raw, i0 + b, 0)
                d1 = _f16(raw, i1 + b, 0)
                for j in range(16):
                    w0, w1 = d0 * F(q[i0 + b, 2 + j]), d0 * F(q[i0 + b, 18 + j])
                    _acc8(acc, j, w0, b, j, w1, b, 16 + j, x, ts)
                    w0, w1 = d1 * F(q[i1 + b, 2 + j]), d1 * F(q[i1 + b, 18 + j])
                    _acc8(acc, 16 + j, w0, b, j, w1, b, 16 + j, x, ts)
            _store_tile8(acc, out, t0, r)


@njit(**_KW, parallel=True)
def mm_q8_0(q, raw, x, out, res, add, nchunk):
    tgt = _target(out, add)
    if x.shape[0] >= MM8_MIN_ROWS:
        pairs = (out.shape[1] + 1) // 2
        for c in prange(nchunk):
            _tile8_q8_0(q, raw, x, tgt, c * pairs // nchunk, (c + 1) * pairs // nchunk)
    else:
        groups = (out.shape[1] + 3) // 4
        for c in prange(nchunk):
            _tile_q8_0(q, raw, x, tgt, c * groups // nchunk, (c + 1) * groups // nchunk)
    _finish(out, tgt, res, add)


@njit(**_KW)
def mm1_q8_0(q, raw, x, out, res, add):
    tgt = _target(out, add)
    if x.shape[0] >= MM8_MIN_ROWS:
        _tile8_q8_0(q, raw, x, tgt, 0, (out.shape[1] + 1) // 2)
    else:
        _tile_q8_0(q, raw, x, tgt, 0, (out.shape[1] + 3) // 4)
    _finish(out, tgt, res, add)


@njit(**_KW, inline="always")
def _q4_scales(raw, i, has_min):
    """A Q4_0/Q4_1 block's ``(d, m)``: its value is ``d q + m`` (Q4_0: ``m = -8 d``)."""
    d = _f16(raw, i, 0)
    return d, (_f16(raw, i, 2) if has_min else F(-8.0) * d)


@njit(**_KW, inline="always")
def _q4_pair(raw, i, off, j, d, m):
    lo, hi = _nib(raw[i, off + j])
    return d * lo + m, d * hi + m


@njit(**_KW)
def _tile_q4(raw, x, out, g0, g1, has_min):
    """Q4_0 and Q4_1 (the flag only changes a block's scales and the quants' offset)."""
    n, nb = x.shape[0], x.shape[1]
    rows = out.shape[1]
    off = 4 if has_min else 2
    acc = carray(_stack_f32(256), 256)
    for g in range(g0, g1):
        r = g * 4
        i0, i1, i2, i3 = _row_blocks(r, rows, nb)
        _prefetch_rows(raw, i0, 4 * nb)
        for t0 in range(0, n, 4):
            ta, tb, tc, td = _tile_rows(t0, n)
            for j in range(256):
                acc[j] = F(0.0)
            for b in range(nb):
                d0, m0 = _q4_scales(raw, i0 + b, has_min)
                d1, m1 = _q4_scales(raw, i1 + b, has_min)
                d2, m2 = _q4_scales(raw, i2 + b, has_min)
                d3, m3 = _q4_scales(raw, i3 + b, has_min)
                for j in range(16):
                    w0, w1 = _q4_pair(raw, i0 + b, off, j, d0, m0)
                    _acc4(acc, j, w0, b, j, w1, b, 16 + j, x, ta, tb, tc, td)
                    w0, w1 = _q4_pair(raw, i1 + b, off, j, d1, m1)
                    _acc4(acc, 16 + j, w0, b, j, w1, b, 16 + j, x, ta, tb, tc, td)
                    w0, w1 = _q4_pair(raw, i2 + b, off, j, d2, m2)
                    _acc4(acc, 32 + j, w0, b, j, w1, b, 16 + j, x, ta, tb, tc, td)
                    w0, w1 = _q4_pair(raw, i3 + b, off, j, d3, m3)
                    _acc4(acc, 48 + j, w0, b, j, w1, b, 16 + j, x, ta, tb, tc, td)
            _store_tile(acc, out, t0, r)


@njit(**_KW)
def _tile8_q4(raw, x, out, g0, g1, has_min):
    """Weight rows ``2 g0 .. 2 g1``, 8 activation rows at a time."""
    n, nb = x.shape[0], x.shape[1]
    rows = out.shape[1]
    off = 4 if has_min else 2
    acc = carray(_stack_f32(256), 256)
    for g in range(g0, g1):
        r = g * 2
        i0, i1 = r * nb, min(r + 1, rows - 1) * nb
        _prefetch_rows(raw, i0, 2 * nb)
        for t0 in range(0, n, 8):
            ts = _tile8_rows(t0, n)
            for j in range(256):
                acc[j] = F(0.0)
            for b in range(nb):
                d0, m0 = _q4_scales(raw, i0 + b, has_min)
                d1, m1 = _q4_scales(raw, i1 + b, has_min)
                for j in range(16):
                    w0, w1 = _q4_pair(raw, i0 + b, off, j, d0, m0)
                    _acc8(acc, j, w0, b, j, w1, b, 16 + j, x, ts)
                    w0, w1 = _q4_pair(raw, i1 + b, off, j, d1, m1)
                    _acc8(acc, 16 + j, w0, b, j, w1, b, 16 + j, x, ts)
            _store_tile8(acc, out, t0, r)


@njit(**_KW, parallel=True)
def mm_q4(raw, x, out, res, add, nchunk, has_min):
    tgt = _target(out, add)
    if x.shape[0] >= MM8_MIN_ROWS:
        pairs = (out.shape[1] + 1) // 2
        for c in prange(nchunk):
            _tile8_q4(raw, x, tgt, c * pairs // nchunk, (c + 1) * pairs // nchunk, has_min)
    else:
        groups = (out.shape[1] + 3) // 4
        for c in prange(nchunk):
            _tile_q4(raw, x, tgt, c * groups // nchunk, (c + 1) * groups // nchunk, has_min)
    _finish(out, tgt, res, add)


@njit(**_KW)
def mm1_q4(raw, x, out, res, add, has_min):
    tgt = _target(out, add)
    if x.shape[0] >= MM8_MIN_ROWS:
        _tile8_q4(raw, x, tgt, 0, (out.shape[1] + 1) // 2, has_min)
    else:
        _tile_q4(raw, x, tgt, 0, (out.shape[1] + 3) // 4, has_min)
    _finish(out, tgt, res, add)


@njit(**_KW, inline="always")
def _qk_scales(raw, i, s):
    """Sub-blocks ``s, s + 1`` of a Q4_K/Q5_K block: ``(d sc_s, dmin mn_s, d sc_s+1,
    dmin mn_s+1)``; a value is ``d sc q - dmin mn``."""
    d, dm = _f16(raw, i, 0), _f16(raw, i, 2)
    sa, ma = _k_scale_min(raw, i, s)
    sb, mb = _k_scale_min(raw, i, s + 1)
    return d * sa, dm * ma, d * sb, dm * mb


@njit(**_KW, inline="always")
def _qk_pair(raw, i, h, j, p0, p1, p2, five, la, ma, lb, mb):
    """Element ``j`` of sub-blocks ``2h`` and ``2h + 1`` of a Q4_K/Q5_K block."""
    if five:
        lo, hi = _nib(raw[i, 48 + 32 * h + j])
        e0, e1 = _bits2(raw[i, 16 + j], p0, p1, p2)
        lo += F(16.0) * e0
        hi += F(16.0) * e1
    else:
        lo, hi = _nib(raw[i, 16 + 32 * h + j])
    return la * lo - ma, lb * hi - mb


@njit(**_KW)
def _tile_qk45(raw, x, out, g0, g1, five):
    """Q4_K (``five`` False) and Q5_K: per block, the 4 weight rows' sub-block pairs
    ``(2h, 2h + 1)``, elements ``j`` and ``16 + j`` in lane ``j``."""
    n, nsub = x.shape[0], x.shape[1]
    nbk = nsub // 8
    rows = out.shape[1]
    acc = carray(_stack_f32(256), 256)
    for g in range(g0, g1):
        r = g * 4
        i0, i1, i2, i3 = _row_blocks(r, rows, nbk)
        _prefetch_rows(raw, i0, 4 * nbk)
        for t0 in range(0, n, 4):
            ta, tb, tc, td = _tile_rows(t0, n)
            for j in range(256):
                acc[j] = F(0.0)
            for kb in range(nbk):
                for h in range(4):
                    s = 2 * h
                    sb = kb * 8 + s
                    p0, p1, p2 = _pow2s(s)
                    la0, ma0, lb0, mb0 = _qk_scales(raw, i0 + kb, s)
                    la1, ma1, lb1, mb1 = _qk_scales(raw, i1 + kb, s)
                    la2, ma2, lb2, mb2 = _qk_scales(raw, i2 + kb, s)
                    la3, ma3, lb3, mb3 = _qk_scales(raw, i3 + kb, s)
                    for half in range(2):
                        for jj in range(16):
                            j = 16 * half + jj
                            w0, w1 = _qk_pair(raw, i0 + kb, h, j, p0, p1, p2, five,
                                              la0, ma0, lb0, mb0)  # fmt: skip
                            _acc4(acc, jj, w0, sb, j, w1, sb + 1, j, x, ta, tb, tc, td)
                            w0, w1 = _qk_pair(raw, i1 + kb, h, j, p0, p1, p2, five,
                                              la1, ma1, lb1, mb1)  # fmt: skip
                            _acc4(acc, 16 + jj, w0, sb, j, w1, sb + 1, j, x, ta, tb, tc, td)
                            w0, w1 = _qk_pair(raw, i2 + kb, h, j, p0, p1, p2, five,
                                              la2, ma2, lb2, mb2)  # fmt: skip
                            _acc4(acc, 32 + jj, w0, sb, j, w1, sb + 1, j, x, ta, tb, tc, td)
                            w0, w1 = _qk_pair(raw, i3 + kb, h, j, p0, p1, p2, five,
                                              la3, ma3, lb3, mb3)  # fmt: skip
                            _acc4(acc, 48 + jj, w0, sb, j, w1, sb + 1, j, x, ta, tb, tc, td)
            _store_tile(acc, out, t0, r)


@njit(**_KW)
def _tile8_qk45(raw, x, out, g0, g1, five):
    """Weight rows ``2 g0 .. 2 g1``, 8 activation rows at a time."""
    n, nsub = x.shape[0], x.shape[1]
    nbk = nsub // 8
    rows = out.shape[1]
    acc = carray(_stack_f32(256), 256)
    for g in range(g0, g1):
        r = g * 2
        i0, i1 = r * nbk, min(r + 1, rows - 1) * nbk
        _prefetch_rows(raw, i0, 2 * nbk)
        for t0 in range(0, n, 8):
            ts = _tile8_rows(t0, n)
            for j in range(256):
                acc[j] = F(0.0)
            for kb in range(nbk):
                for h in range(4):
                    s = 2 * h
                    sb = kb * 8 + s
                    p0, p1, p2 = _pow2s(s)
                    la0, ma0, lb0, mb0 = _qk_scales(raw, i0 + kb, s)
                    la1, ma1, lb1, mb1 = _qk_scales(raw, i1 + kb, s)
                    for half in range(2):
                        for jj in range(16):
                            j = 16 * half + jj
                            w0, w1 = _qk_pair(raw, i0 + kb, h, j, p0, p1, p2, five,
                                              la0, ma0, lb0, mb0)  # fmt: skip
                            _acc8(acc, jj, w0, sb, j, w1, sb + 1, j, x, ts)
                            w0, w1 = _qk_pair(raw, i1 + kb, h, j, p0, p1, p2, five,
                                              la1, ma1, lb1, mb1)  # fmt: skip
                            _acc8(acc, 16 + jj, w0, sb, j, w1, sb + 1, j, x, ts)
            _store_tile8(acc, out, t0, r)


@njit(**_KW, parallel=True)
def mm_qk45(raw, x, out, res, add, nchunk, five):
    tgt = _target(out, add)
    if x.shape[0] >= MM8_MIN_ROWS:
        pairs = (out.shape[1] + 1) // 2
        for c in prange(nchunk):
            _tile8_qk45(raw, x, tgt, c * pairs // nchunk, (c + 1) * pairs // nchunk, five)
    else:
        groups = (out.shape[1] + 3) // 4
        for c in prange(nchunk):
            _tile_qk45(raw, x, tgt, c * groups // nchunk, (c + 1) * groups // nchunk, five)
    _finish(out, tgt, res, add)


@njit(**_KW)
def mm1_qk45(raw, x, out, res, add, five):
    tgt = _target(out, add)
    if x.shape[0] >= MM8_MIN_ROWS:
        _tile8_qk45(raw, x, tgt, 0, (out.shape[1] + 1) // 2, five)
    else:
        _tile_qk45(raw, x, tgt, 0, (out.shape[1] + 3) // 4, five)
    _finish(out, tgt, res, add)


@njit(**_KW, inline="always")
def _q6_quad(raw, sc, i, h, j, d):
    """Element ``j`` of the 4 sub-blocks of half ``h`` of a Q6_K block, dequantized."""
    v0, v1, v2, v3 = _q6(raw[i, 64 * h + j], raw[i, 64 * h + 32 + j], raw[i, 128 + 32 * h + j])
    gs = 192 + 8 * h + j // 16
    return (d * F(sc[i, gs]) * v0, d * F(sc[i, gs + 2]) * v1, d * F(sc[i, gs + 4]) * v2,
            d * F(sc[i, gs + 6]) * v3)  # fmt: skip


@njit(**_KW)
def _tile_q6_k(raw, sc, x, out, g0, g1):
    """Q6_K: per half of a block, element ``j`` of its 4 sub-blocks in lane ``j % 16``."""
    n, nsub = x.shape[0], x.shape[1]
    nbk = nsub // 8
    rows = out.shape[1]
    acc = carray(_stack_f32(256), 256)
    for g in range(g0, g1):
        r = g * 4
        i0, i1, i2, i3 = _row_blocks(r, rows, nbk)
        _prefetch_rows(raw, i0, 4 * nbk)
        for t0 in range(0, n, 4):
            ta, tb, tc, td = _tile_rows(t0, n)
            for j in range(256):
                acc[j] = F(0.0)
            for kb in range(nbk):
                d0 = _f16(raw, i0 + kb, 208)
                d1 = _f16(raw, i1 + kb, 208)
                d2 = _f16(raw, i2 + kb, 208)
                d3 = _f16(raw, i3 + kb, 208)
                for h in range(2):
                    sb = kb * 8 + 4 * h
                    for half in range(2):
                        for jj in range(16):
                            j = 16 * half + jj
                            v0, v1, v2, v3 = _q6_quad(raw, sc, i0 + kb, h, j, d0)
                            _acc4(acc, jj, v0, sb, j, v1, sb + 1, j, x, ta, tb, tc, td)
                            _acc4(acc, jj, v2, sb + 2, j, v3, sb + 3, j, x, ta, tb, tc, td)
                            v0, v1, v2, v3 = _q6_quad(raw, sc, i1 + kb, h, j, d1)
                            _acc4(acc, 16 + jj, v0, sb, j, v1, sb + 1, j, x, ta, tb, tc, td)
                            _acc4(acc, 16 + jj, v2, sb + 2, j, v3, sb + 3, j, x, ta, tb, tc, td)
                            v0, v1, v2, v3 = _q6_quad(raw, sc, i2 + kb, h, j, d2)
                            _acc4(acc, 32 + jj, v0, sb, j, v1, sb + 1, j, x, ta, tb, tc, td)
                            _acc4(acc, 32 + jj, v2, sb + 2, j, v3, sb + 3, j, x, ta, tb, tc, td)
                            v0, v1, v2, v3 = _q6_quad(raw, sc, i3 + kb, h, j, d3)
                            _acc4(acc, 48 + jj, v0, sb, j, v1, sb + 1, j, x, ta, tb, tc, td)
                            _acc4(acc, 48 + jj, v2, sb + 2, j, v3, sb + 3, j, x, ta, tb, tc, td)
            _store_tile(acc, out, t0, r)


@njit(**_KW)
def _tile8_q6_k(raw, sc, x, out, g0, g1):
    """Weight rows ``2 g0 .. 2 g1``, 8 activation rows at a time."""
    n, nsub = x.shape[0], x.shape[1]
    nbk = nsub // 8
    rows = out.shape[1]
    acc = carray(_stack_f32(256), 256)
    for g in range(g0, g1):
        r = g * 2
        i0, i1 = r * nbk, min(r + 1, rows - 1) * nbk
        _prefetch_rows(raw, i0, 2 * nbk)
        for t0 in range(0, n, 8):
            ts = _tile8_rows(t0, n)
            for j in range(256):
                acc[j] = F(0.0)
            for kb in range(nbk):
                d0 = _f16(raw, i0 + kb, 208)
                d1 = _f16(raw, i1 + kb, 208)
                for h in range(2):
                    sb = kb * 8 + 4 * h
                    for half in range(2):
                        for jj in range(16):
                            j = 16 * half + jj
                            v0, v1, v2, v3 = _q6_quad(raw, sc, i0 + kb, h, j, d0)
                            _acc8(acc, jj, v0, sb, j, v1, sb + 1, j, x, ts)
                            _acc8(acc, jj, v2, sb + 2, j, v3, sb + 3, j, x, ts)
                            v0, v1, v2, v3 = _q6_quad(raw, sc, i1 + kb, h, j, d1)
                            _acc8(acc, 16 + jj, v0, sb, j, v1, sb + 1, j, x, ts)
                            _acc8(acc, 16 + jj, v2, sb + 2, j, v3, sb + 3, j, x, ts)
            _store_tile8(acc, out, t0, r)


@njit(**_KW, parallel=True)
def mm_q6_k(raw, sc, x, out, res, add, nchunk):
    tgt = _target(out, add)
    if x.shape[0] >= MM8_MIN_ROWS:
        pairs = (out.shape[1] + 1) // 2
        for c in prange(nchunk):
            _tile8_q6_k(raw, sc, x, tgt, c * pairs // nchunk, (c + 1) * pairs // nchunk)
    else:
        groups = (out.shape[1] + 3) // 4
        for c in prange(nchunk):
            _tile_q6_k(raw, sc, x, tgt, c * groups // nchunk, (c + 1) * groups // nchunk)
    _finish(out, tgt, res, add)


@njit(**_KW)
def mm1_q6_k(raw, sc, x, out, res, add):
    tgt = _target(out, add)
    if x.shape[0] >= MM8_MIN_ROWS:
        _tile8_q6_k(raw, sc, x, tgt, 0, (out.shape[1] + 1) // 2)
    else:
        _tile_q6_k(raw, sc, x, tgt, 0, (out.shape[1] + 3) // 4)
    _finish(out, tgt, res, add)
