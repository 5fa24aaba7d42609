"""Decode matrix-vector kernels with integer activations and integer dot products.

What llama.cpp's CPU path does for quantized weights: each activation row is quantized
once per op to blocks of 32 int8 values with one float32 scale (``d = amax / 127``,
``q = rint(x / d)``) and the block's integer sum; each weight block is then multiplied
with its activation block in integers (32 products accumulated in int32), and only the
block's result is scaled, once, by ``d_w * d_x`` in float32:

- Q8_0 ``w = d q`` (``q`` int8): ``d_w d_x sum(q x)``;
- Q4_0 ``w = d (q - 8)``: ``d_w d_x (sum(q x) - 8 sum(x))``, in int32;
- Q4_1 ``w = d q + m``: ``d_w d_x sum(q x) + m d_x sum(x)``;
- Q4_K, per sub-block ``s`` of 32 (6-bit scale ``sc`` and min ``mn`` under the block's
  ``d``, ``dmin``): ``d sc_s d_x sum(q x) - dmin mn_s d_x sum(x)``; Q5_K the same with
  a fifth bit per value;
- Q6_K, per 16 values (int8 scale ``sc`` under the block's ``d``, 6-bit ``q``):
  ``d sc d_x (sum(q x) - 32 sum(x))``, both sums in int32.

The same with 16-bit activations (``d = amax / 32767``): 256 times finer, and greedy ids
stay those of a float64 forward where 8 bits (and llama.cpp) part from them at near-ties
(``docs/benchmarks.md``). A 16-bit value is kept as its signed high byte and unsigned low
byte, ``q = 256 h + l``, and a block's dot product is ``256 (w . h) + (w . l)``: two byte
dot products, cheaper than one of 16-bit lanes (twice as many per instruction).

The inner loops are LLVM IR written here (numba widens integer arithmetic to 64 bits and
LLVM did not vectorize the int8 products of plain loops into packed dot products): per
block one load of the weight's bytes (nibbles split with a shift and a mask, in the order
of activations interleaved to match), one of the activations, ``vpdpbusd`` (AVX-512 VNNI
or AVX-VNNI: 32 unsigned x signed byte products summed four by four into eight int32
lanes; a Q8_0 weight is made unsigned by adding 128, taken back with the activations'
sum), the lanes converted to float32 and multiplied by the block's scales into eight
float32 accumulators per row, four rows sharing each activation load. Without VNNI the
same IR multiplies widened vectors (LLVM picks ``vpmaddwd`` or the target's equivalent):
the same integers, so the same results, on any CPU LLVM targets. The float16 block scales
are read as LLVM ``half`` (``vcvtph2ps``).

:func:`mv1` runs on the calling thread, :func:`mv` splits the rows over ``nchunk`` of
numba's threads; both quantize the activation rows (:func:`quantize_rows`) and compute
``out[t, r] = sum_k x[t, k] w[r, k] (+ res[t, r])``. :func:`bind` is the backend's entry.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

F = np.float32
FM = {"reassoc", "contract"}
_KW = {"cache": True, "nogil": True, "boundscheck": False, "fastmath": FM}

#: (block bytes, offset of the quants, quants are nibbles, has a min) per format.
FORMATS: dict[str, tuple[int, int, bool, bool]] = {
    "Q8_0": (34, 2, False, False),
    "Q4_0": (18, 2, True, False),
    "Q4_1": (20, 4, True, True),
}
#: Weight rows multiplied per pass (sharing each activation block's loads).
ROWS = 4


def _features() -> set[str]:
    """The CPU features numba compiles for: ``NUMBA_CPU_FEATURES``; none for a CPU named
    by ``NUMBA_CPU_NAME`` (e.g. ``generic``) without them; else the host's."""
    feats = numba.config.CPU_FEATURES
    if not feats:
        if numba.config.CPU_NAME is not None:
            feats = ""
        else:
            try:
                feats = llvm.get_host_cpu_features().flatten()
            except RuntimeError:  # pragma: no cover - an LLVM that cannot tell
                feats = ""
    return {f[1:] for f in feats.split(",") if f.startswith("+")}


def _vnni() -> bool:
    f = _features()
    return ("avx512vnni" in f and "avx512vl" in f) or "avxvnni" in f


#: Whether the kernels use ``vpdpbusd`` (decided when they are compiled; numba's disk
#: cache keys compiled code by the CPU's features, so a cached kernel matches its CPU).
VNNI = _vnni()

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
FLT, HALF = ir.FloatType(), ir.HalfType()

#: Whether LLVM converts float16 in instructions here (x86 needs F16C; without it LLVM
#: calls ``__extendhfsf2``, which numba's JIT cannot link): else the bits are converted.
NATIVE_F16 = "f16c" in _features() or not llvm.get_default_triple().startswith(("x86", "i686"))


def _f16(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value) -> ir.Value:
    """The float16 at byte ``offset`` of ``base``, as float32 (exact, inf and nan kept)."""
    if NATIVE_F16:
        return builder.fpext(_load(builder, base, offset, HALF), FLT)
    h = builder.zext(_load(builder, base, offset, I16), I32)
    # the magnitude's bits moved to float32's places and scaled by 2**112 (re-biases the
    # exponent; exact for normal and subnormal values); exponent 31 (inf, nan) set to 255
    bits = builder.shl(builder.and_(h, I32(0x7FFF)), I32(13))
    scaled = builder.bitcast(builder.fmul(builder.bitcast(bits, FLT), FLT(2.0**112)), I32)
    special = builder.icmp_unsigned("==", builder.and_(h, I32(0x7C00)), I32(0x7C00))
    mag = builder.select(special, builder.or_(bits, I32(0x7F800000)), scaled)
    sign = builder.shl(builder.and_(h, I32(0x8000)), I32(16))
    return builder.bitcast(builder.or_(mag, sign), FLT)


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _splat(builder: ir.IRBuilder, value: ir.Value, n: int) -> ir.Value:
    v = builder.insert_element(ir.Constant(_vec(value.type, n), None), value, I32(0))
    return builder.shuffle_vector(v, v, ir.Constant(_vec(I32, n), [0] * n))


def _load(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value, ty: ir.Type) -> ir.Value:
    ptr = builder.gep(base, [offset])
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=1)


def _intrinsic_fn(builder: ir.IRBuilder, name: str, fnty: ir.FunctionType) -> ir.Function:
    fn = builder.module.globals.get(name)
    return fn if fn is not None else ir.Function(builder.module, fnty, name)


def _dot8(builder: ir.IRBuilder, acc: ir.Value, w: ir.Value, x: ir.Value) -> ir.Value:
    """``acc[i] + sum_{k<4} w[4i+k] x[4i+k]`` for 32 bytes (``w`` unsigned, ``x`` signed)."""
    v8i32 = _vec(I32, 8)
    if VNNI:
        fnty = ir.FunctionType(v8i32, [v8i32, v8i32, v8i32])
        fn = _intrinsic_fn(builder, "llvm.x86.avx512.vpdpbusd.256", fnty)
        return builder.call(fn, [acc, builder.bitcast(w, v8i32), builder.bitcast(x, v8i32)])
    wide = builder.mul(builder.zext(w, _vec(I32, 32)), builder.sext(x, _vec(I32, 32)))
    for k in range(4):
        lanes = ir.Constant(_vec(I32, 8), [4 * i + k for i in range(8)])
        acc = builder.add(acc, builder.shuffle_vector(wide, wide, lanes))
    return acc


def _loop_rows(builder: ir.IRBuilder, nrows: int, nblocks: ir.Value, body) -> list[ir.Value]:  # noqa: ANN001
    """``for b in range(nblocks)`` in IR with, per row, eight float32 lanes and a scalar
    accumulated across blocks: ``body(b, accs, mins)`` returns their next values. Returns
    each row's lanes summed plus its scalar."""
    vf = _vec(FLT, 8)
    flags = ("reassoc", "contract")
    entry = builder.block
    loop = builder.append_basic_block("q8.loop")
    done = builder.append_basic_block("q8.done")
    zero_f = ir.Constant(vf, None)
    builder.cbranch(builder.icmp_signed(">", nblocks, I64(0)), loop, done)
    builder.position_at_end(loop)
    b = builder.phi(I64)
    b.add_incoming(I64(0), entry)
    accs, mins = [], []
    for _ in range(nrows):
        acc = builder.phi(vf)
        acc.add_incoming(zero_f, entry)
        accs.append(acc)
        m = builder.phi(FLT)
        m.add_incoming(FLT(0.0), entry)
        mins.append(m)
    new_accs, new_mins = body(b, accs, mins)
    nxt = builder.add(b, I64(1))
    body_end = builder.block
    b.add_incoming(nxt, body_end)
    for k in range(nrows):
        accs[k].add_incoming(new_accs[k], body_end)
        mins[k].add_incoming(new_mins[k], body_end)
    builder.cbranch(builder.icmp_signed("<", nxt, nblocks), loop, done)
    builder.position_at_end(done)
    finals, final_mins = [], []
    for k in range(nrows):  # every phi first, at the top of the block
        acc = builder.phi(vf)
        acc.add_incoming(zero_f, entry)
        acc.add_incoming(new_accs[k], body_end)
        finals.append(acc)
        mn = builder.phi(FLT)
        mn.add_incoming(FLT(0.0), entry)
        mn.add_incoming(new_mins[k], body_end)
        final_mins.append(mn)
    results = []
    for k in range(nrows):
        v, width = finals[k], 8
        while width > 1:  # lanes summed pairwise
            half = width // 2
            lo = builder.shuffle_vector(v, v, ir.Constant(_vec(I32, half), list(range(half))))
            hi = builder.shuffle_vector(
                v, v, ir.Constant(_vec(I32, half), list(range(half, width)))
            )
            v = builder.fadd(lo, hi, flags=flags)
            width = half
        results.append(builder.fadd(builder.extract_element(v, I32(0)), final_mins[k]))
    return results


def _activations(builder: ir.IRBuilder, arrays, ab: ir.Value, split: bool):  # noqa: ANN001, ANN202
    """Activation block ``ab``: its bytes (high, low or None), scale, sum and high sum."""
    xbase, xd_data, xi_data = arrays
    if split:  # block ab: 32 high bytes, then 32 low bytes; sums: all, high
        off = builder.mul(ab, I64(64))
        xh = _load(builder, xbase, off, _vec(I8, 32))
        xl = _load(builder, xbase, builder.add(off, I64(32)), _vec(I8, 32))
        isum = builder.load(builder.gep(xi_data, [builder.mul(ab, I64(2))]))
        isum_h = builder.load(builder.gep(xi_data, [builder.add(builder.mul(ab, I64(2)), I64(1))]))
    else:
        xh = _load(builder, xbase, builder.mul(ab, I64(32)), _vec(I8, 32))
        xl = None
        isum = isum_h = builder.load(builder.gep(xi_data, [ab]))
    dx = builder.load(builder.gep(xd_data, [ab]))
    return xh, xl, dx, isum, isum_h


def _dot_block(builder: ir.IRBuilder, init: ir.Value, wu: ir.Value, w: ir.Value, xh: ir.Value,
               xl: ir.Value | None, corr: ir.Value | None = None) -> ir.Value:  # fmt: skip
    """A block's integer dot product: ``wu . xh`` (8 bits), or with 16-bit activations
    ``256 (wu . h) + (l . w)`` (``wu`` the unsigned bytes, ``w`` the same weights as
    signed bytes; ``corr`` added in int32 after the shift)."""
    dot = _dot8(builder, init, wu, xh)
    if xl is None:
        return dot
    acc2 = builder.shl(dot, ir.Constant(_vec(I32, 8), [8] * 8))
    if corr is not None:
        acc2 = builder.add(acc2, corr)
    return _dot8(builder, acc2, xl, w)


def _intrinsic_args(context, builder, sig, args):  # noqa: ANN001, ANN202
    raw_a = context.make_array(sig.args[0])(context, builder, args[0])
    st_a = context.make_array(sig.args[1])(context, builder, args[1])
    xq_a = context.make_array(sig.args[2])(context, builder, args[2])
    xd_a = context.make_array(sig.args[3])(context, builder, args[3])
    xi_a = context.make_array(sig.args[4])(context, builder, args[4])
    wbase = builder.bitcast(raw_a.data, I8.as_pointer())
    xbase = builder.bitcast(xq_a.data, I8.as_pointer())
    return wbase, st_a.data, (xbase, xd_a.data, xi_a.data)


def _block_rows(fmt: str, nrows: int, bits: int):  # noqa: ANN202 - an intrinsic
    """An intrinsic: the dot products of ``nrows`` weight rows (their first blocks'
    indices in ``starts``) with one activation row quantized to ``bits`` (8 or 16), as a
    tuple of float32."""
    block_bytes, qoff, nibbles, has_min = FORMATS[fmt]
    split = bits == 16  # 16-bit activations as a signed high and an unsigned low byte
    flags = ("reassoc", "contract")

    def impl(typingctx, raw, starts, xq, xd, xi, nb):
        sig = types.UniTuple(types.float32, nrows)(raw, starts, xq, xd, xi, nb)

        def codegen(context, builder, sig, args):
            wbase, st_data, xarrays = _intrinsic_args(context, builder, sig, args)
            vf, vi = _vec(FLT, 8), _vec(I32, 8)
            row_off = []
            for k in range(nrows):
                blk = builder.load(builder.gep(st_data, [I64(k)]))
                row_off.append(builder.mul(blk, I64(block_bytes)))

            def body(b, accs, mins):  # noqa: ANN001, ANN202
                xh, xl, dx, isum, isum_h = _activations(builder, xarrays, b, split)
                # integer offsets go into lane 0 of an accumulator: exact, in int32
                zero_i = ir.Constant(vi, None)
                init, corr = zero_i, None
                if fmt == "Q8_0":  # weights made unsigned (+ 128), taken back
                    init = builder.insert_element(zero_i, builder.mul(isum_h, I32(-128)), I32(0))
                elif fmt == "Q4_0":
                    corr = builder.insert_element(zero_i, builder.mul(isum, I32(-8)), I32(0))
                    if not split:
                        init, corr = corr, None
                sx = builder.fmul(dx, builder.sitofp(isum, FLT))
                dxv = _splat(builder, dx, 8)
                new_accs, new_mins = [], []
                for k in range(nrows):
                    p = builder.add(row_off[k], builder.mul(b, I64(block_bytes)))
                    # the scale widened as a vector (vcvtph2ps of a broadcast half)
                    if NATIVE_F16:
                        d = builder.fpext(_splat(builder, _load(builder, wbase, p, HALF), 8), vf)
                    else:
                        d = _splat(builder, _f16(builder, wbase, p), 8)
                    qp = builder.add(p, I64(qoff))
                    if nibbles:
                        # byte j of the block holds elements j (low nibble) and 16 + j
                        # (high); the activations are interleaved to match (x_j, x_16+j,
                        # ...): widen each byte to a 16-bit lane, copy it shifted into the
                        # upper byte, mask (vpmovzxbw, a shift, vpternlog).
                        q16 = _load(builder, wbase, qp, _vec(I8, 16))
                        pair = _vec(I16, 16)
                        z = builder.zext(q16, pair)
                        both = builder.or_(z, builder.shl(z, ir.Constant(pair, [4] * 16)))
                        masked = builder.and_(both, ir.Constant(pair, [0x0F0F] * 16))
                        w = wu = builder.bitcast(masked, _vec(I8, 32))
                    else:
                        w = _load(builder, wbase, qp, _vec(I8, 32))
                        wu = builder.xor(w, ir.Constant(_vec(I8, 32), [-128] * 32))
                    dot = _dot_block(builder, init, wu, w, xh, xl, corr)
                    prod = builder.fmul(builder.sitofp(dot, vf), dxv, flags=flags)
                    new_accs.append(builder.fadd(accs[k], builder.fmul(prod, d, flags=flags),
                                                 flags=flags))  # fmt: skip
                    if has_min:
                        m = builder.fmul(_f16(builder, wbase, builder.add(p, I64(2))), sx)
                        new_mins.append(builder.fadd(mins[k], m, flags=flags))
                    else:
                        new_mins.append(mins[k])
                return new_accs, new_mins

            results = _loop_rows(builder, nrows, args[5], body)
            return context.make_tuple(builder, sig.return_type, results)

        return sig, codegen

    impl.__name__ = f"_dot_{fmt.lower()}_x{nrows}_i{bits}"
    return intrinsic(impl)


def _block_rows_q4_k(nrows: int, bits: int, five: bool = False):  # noqa: ANN202 - an intrinsic
    """:func:`_block_rows` for Q4_K: ``nb`` counts blocks of 256 (144 bytes: ``d``,
    ``dmin``, 12 bytes of 6-bit scales and mins, 128 of nibbles); sub-block ``s`` (32
    values, activation block ``8 b + s``) is ``d sc_s q - dmin mn_s`` with ``q`` the low
    nibbles of bytes ``32 (s // 2) ..`` for even ``s``, the high ones for odd. ``five``:
    Q5_K (176 bytes: 32 bytes ``qh`` before the nibbles; bit ``s`` of ``qh[j]`` is bit 4 of
    sub-block ``s``'s value ``j``)."""
    split = bits == 16
    block_bytes, qoff = (176, 48) if five else (144, 16)
    flags = ("reassoc", "contract")

    def impl(typingctx, raw, starts, xq, xd, xi, nb):
        sig = types.UniTuple(types.float32, nrows)(raw, starts, xq, xd, xi, nb)

        def codegen(context, builder, sig, args):
            wbase, st_data, xarrays = _intrinsic_args(context, builder, sig, args)
            vf, vi = _vec(FLT, 8), _vec(I32, 8)
            row_off = []
            for k in range(nrows):
                blk = builder.load(builder.gep(st_data, [I64(k)]))
                row_off.append(builder.mul(blk, I64(block_bytes)))

            def byte(p, o):  # noqa: ANN001, ANN202
                return builder.zext(builder.load(builder.gep(wbase, [builder.add(p, I64(o))])), I32)

            def body(b, accs, mins):  # noqa: ANN001, ANN202
                accs, mins = list(accs), list(mins)
                ps = [
                    builder.add(row_off[k], builder.mul(b, I64(block_bytes))) for k in range(nrows)
                ]
                if five:
                    qh = [_load(builder, wbase, builder.add(p, I64(16)), _vec(I8, 32)) for p in ps]
                ds = [_f16(builder, wbase, p) for p in ps]
                dms = [_f16(builder, wbase, builder.add(p, I64(2))) for p in ps]
                sc = [[byte(p, 4 + i) for i in range(12)] for p in ps]
                qs = [None] * nrows
                zero_i = ir.Constant(vi, None)
                for s in range(8):
                    ab = builder.add(builder.mul(b, I64(8)), I64(s))
                    xh, xl, dx, isum, _ = _activations(builder, xarrays, ab, split)
                    sx = builder.fmul(dx, builder.sitofp(isum, FLT))
                    dxv = _splat(builder, dx, 8)
                    for k in range(nrows):
                        c = sc[k]
                        if s < 4:
                            scale = builder.and_(c[s], I32(63))
                            mn = builder.and_(c[s + 4], I32(63))
                        else:
                            top_s = builder.shl(builder.lshr(c[s - 4], I32(6)), I32(4))
                            top_m = builder.shl(builder.lshr(c[s], I32(6)), I32(4))
                            scale = builder.or_(builder.and_(c[s + 4], I32(15)), top_s)
                            mn = builder.or_(builder.lshr(c[s + 4], I32(4)), top_m)
                        if s % 2 == 0:
                            qp = builder.add(ps[k], I64(qoff + 16 * s))
                            qs[k] = _load(builder, wbase, qp, _vec(I8, 32))
                            w = builder.and_(qs[k], ir.Constant(_vec(I8, 32), [15] * 32))
                        else:
                            w = builder.lshr(qs[k], ir.Constant(_vec(I8, 32), [4] * 32))
                        if five:
                            hb = builder.lshr(qh[k], ir.Constant(_vec(I8, 32), [s] * 32))
                            hb = builder.and_(hb, ir.Constant(_vec(I8, 32), [1] * 32))
                            w = builder.or_(w, builder.shl(hb, ir.Constant(_vec(I8, 32), [4] * 32)))
                        dot = _dot_block(builder, zero_i, w, w, xh, xl)
                        f = builder.fmul(ds[k], builder.sitofp(scale, FLT))
                        prod = builder.fmul(builder.sitofp(dot, vf), dxv, flags=flags)
                        prod = builder.fmul(prod, _splat(builder, f, 8), flags=flags)
                        accs[k] = builder.fadd(accs[k], prod, flags=flags)
                        m = builder.fmul(builder.fmul(dms[k], builder.sitofp(mn, FLT)), sx)
                        mins[k] = builder.fsub(mins[k], m, flags=flags)
                return accs, mins

            results = _loop_rows(builder, nrows, args[5], body)
            return context.make_tuple(builder, sig.return_type, results)

        return sig, codegen

    impl.__name__ = f"_dot_q{5 if five else 4}_k_x{nrows}_i{bits}"
    return intrinsic(impl)


def _block_rows_q6_k(nrows: int, bits: int):  # noqa: ANN202 - an intrinsic
    """:func:`_block_rows` for Q6_K: ``nb`` counts blocks of 256 (210 bytes: ``ql`` 128,
    ``qh`` 64, 16 int8 scales, ``d``). Half ``h`` reads ``A = ql[64 h + j]``, ``B = ql[64 h
    + 32 + j]``, ``Q = qh[32 h + j]`` (``j < 32``); its sub-blocks ``s = 4 h + k`` (32
    values, activation block ``8 b + s``) are lo(A), lo(B), hi(A), hi(B), each with two bits
    of ``Q`` (bits ``2k, 2k + 1``) as bits 4-5: ``q`` in 0..63, the value ``d sc (q - 32)``
    with ``sc`` scale ``2 s`` for ``j < 16`` and ``2 s + 1`` after. ``q`` is multiplied
    unsigned with the (high) activation bytes and ``32 x`` (``32 h``: four-value sums per
    int32 lane, once per activation block for all rows) taken back in int32; the low bytes
    multiply ``q - 32`` as signed bytes. The eight lanes of a block's dot product are ``j <
    16`` (lanes 0-3) and ``j >= 16`` (4-7), so the two scales are one float32 vector."""
    split = bits == 16
    block_bytes = 210
    flags = ("reassoc", "contract")

    def impl(typingctx, raw, starts, xq, xd, xi, nb):
        sig = types.UniTuple(types.float32, nrows)(raw, starts, xq, xd, xi, nb)

        def codegen(context, builder, sig, args):
            wbase, st_data, xarrays = _intrinsic_args(context, builder, sig, args)
            vf, vi, vb = _vec(FLT, 8), _vec(I32, 8), _vec(I8, 32)
            row_off = []
            for k in range(nrows):
                blk = builder.load(builder.gep(st_data, [I64(k)]))
                row_off.append(builder.mul(blk, I64(block_bytes)))

            def bytes_(v):  # noqa: ANN001, ANN202
                return ir.Constant(vb, [v] * 32)

            def body(b, accs, mins):  # noqa: ANN001, ANN202
                accs = list(accs)
                ps = [
                    builder.add(row_off[k], builder.mul(b, I64(block_bytes))) for k in range(nrows)
                ]
                scales = []  # per row: d * the 16 scales, as float32
                for p in ps:
                    sc = _load(builder, wbase, builder.add(p, I64(192)), _vec(I8, 16))
                    d = _splat(builder, _f16(builder, wbase, builder.add(p, I64(208))), 16)
                    scales.append(builder.fmul(builder.sitofp(sc, _vec(FLT, 16)), d, flags=flags))
                zero_i = ir.Constant(vi, None)
                abq: list = [None] * nrows
                for s in range(8):
                    h, k4 = divmod(s, 4)
                    ab = builder.add(builder.mul(b, I64(8)), I64(s))
                    xh, xl, dx, _, _ = _activations(builder, xarrays, ab, split)
                    # - 32 x (16 bits: its high bytes) per lane, sums of four, shared by
                    # the rows: q's products taken back to (q - 32)'s
                    init = builder.sub(zero_i, _dot8(builder, zero_i, bytes_(32), xh))
                    dxv = _splat(builder, dx, 8)
                    lanes = ir.Constant(_vec(I32, 8), [2 * s] * 4 + [2 * s + 1] * 4)
                    for k in range(nrows):
                        if k4 == 0:
                            base = builder.add(ps[k], I64(64 * h))
                            abq[k] = (
                                _load(builder, wbase, base, vb),
                                _load(builder, wbase, builder.add(base, I64(32)), vb),
                                _load(builder, wbase, builder.add(ps[k], I64(128 + 32 * h)), vb),
                            )
                        a, bb, qh = abq[k]
                        if k4 == 0:
                            lo = builder.and_(a, bytes_(15))
                            hi = builder.shl(qh, bytes_(4))
                        elif k4 == 1:
                            lo = builder.and_(bb, bytes_(15))
                            hi = builder.shl(qh, bytes_(2))
                        elif k4 == 2:
                            lo = builder.lshr(a, bytes_(4))
                            hi = qh
                        else:
                            lo = builder.lshr(bb, bytes_(4))
                            hi = builder.lshr(qh, bytes_(2))
                        w = builder.or_(lo, builder.and_(hi, bytes_(0x30)))
                        ws = builder.sub(w, bytes_(32)) if split else w
                        dot = _dot_block(builder, init, w, ws, xh, xl)
                        f = builder.shuffle_vector(scales[k], scales[k], lanes)
                        prod = builder.fmul(builder.sitofp(dot, vf), dxv, flags=flags)
                        prod = builder.fmul(prod, f, flags=flags)
                        accs[k] = builder.fadd(accs[k], prod, flags=flags)
                return accs, list(mins)

            results = _loop_rows(builder, nrows, args[5], body)
            return context.make_tuple(builder, sig.return_type, results)

        return sig, codegen

    impl.__name__ = f"_dot_q6_k_x{nrows}_i{bits}"
    return intrinsic(impl)


_dot4_q8_0, _dot4_q4_0, _dot4_q4_1 = (_block_rows(f, ROWS, 8) for f in ("Q8_0", "Q4_0", "Q4_1"))
_dot4_q8_0w, _dot4_q4_0w, _dot4_q4_1w = (_block_rows(f, ROWS, 16) for f in ("Q8_0", "Q4_0", "Q4_1"))
_dot4_q4_k, _dot4_q4_kw = _block_rows_q4_k(ROWS, 8), _block_rows_q4_k(ROWS, 16)
_dot4_q5_k, _dot4_q5_kw = _block_rows_q4_k(ROWS, 8, True), _block_rows_q4_k(ROWS, 16, True)
_dot4_q6_k, _dot4_q6_kw = _block_rows_q6_k(ROWS, 8), _block_rows_q6_k(ROWS, 16)


def _dot4(fmt_id, raw, starts, xq, xd, xi, nb):  # noqa: ANN001, ANN202 - numba only
    """Four rows' dot products; ``xq`` int8: 8-bit activations, uint8: 16-bit ones split
    into bytes."""


@overload(_dot4, inline="always")
def _dot4_impl(fmt_id, raw, starts, xq, xd, xi, nb):  # noqa: ANN001, ANN202
    if xq.dtype == types.uint8:
        d8_0, d4_0, d4_1, d4_k, d5_k, d6_k = (
            _dot4_q8_0w,
            _dot4_q4_0w,
            _dot4_q4_1w,
            _dot4_q4_kw,
            _dot4_q5_kw,
            _dot4_q6_kw,
        )
    else:
        d8_0, d4_0, d4_1, d4_k, d5_k, d6_k = (
            _dot4_q8_0,
            _dot4_q4_0,
            _dot4_q4_1,
            _dot4_q4_k,
            _dot4_q5_k,
            _dot4_q6_k,
        )

    def impl(fmt_id, raw, starts, xq, xd, xi, nb):  # noqa: ANN001, ANN202
        if fmt_id == 0:
            return d8_0(raw, starts, xq, xd, xi, nb)
        if fmt_id == 1:
            return d4_0(raw, starts, xq, xd, xi, nb)
        if fmt_id == 2:
            return d4_1(raw, starts, xq, xd, xi, nb)
        if fmt_id == 3:
            return d4_k(raw, starts, xq, xd, xi, nb)
        if fmt_id == 4:
            return d5_k(raw, starts, xq, xd, xi, nb)
        return d6_k(raw, starts, xq, xd, xi, nb)

    return impl


# --------------------------------------------------------------------------- activations


def _qmax(xq):  # noqa: ANN001, ANN202 - numba only
    """The largest quant of ``xq``'s type, as float32."""


@overload(_qmax, inline="always")
def _qmax_impl(xq):  # noqa: ANN001, ANN202
    q = F(32767.0) if xq.dtype == types.uint8 else F(127.0)
    return lambda xq: q


@njit(**_KW)
def quantize_rows(x, xq, xd, xi, pairs):
    """``x[n, nb * 32]`` (float32) quantized to blocks of 32 with a float32 scale each
    (``xd[n, nb]``, ``amax / qmax``), values rounded to nearest, ties to even (llama.cpp's
    AVX path):

    - ``xq`` int8 ``[n, nb * 32]``: 8 bits (``qmax`` 127); ``xi[n, nb]`` the blocks' sums;
    - ``xq`` uint8 ``[n, nb * 64]``: 16 bits (``qmax`` 32767), ``q = 256 h + l``, block b's
      32 high bytes ``h`` (signed) at ``64 b``, its 32 low bytes ``l`` (unsigned) after;
      ``xi[n, 2 nb]``: the block's sum of ``q`` at ``2 b``, of ``h`` at ``2 b + 1``.

    ``pairs``: the nibble formats' order, element j at 2j and element 16 + j at 2j + 1."""
    quantize_range(x, xq, xd, xi, pairs, 0, x.shape[0])


@njit(**_KW, inline="always")
def quantize_range(x, xq, xd, xi, pairs, u0, u1):
    """:func:`quantize_rows` of rows ``u0 .. u1`` (the job of :mod:`vt_cpu.kernels.jobs`)."""
    qmax = _qmax(xq)
    split = xq.shape[1] != x.shape[1]
    nb = x.shape[1] // 32
    for t in range(u0, u1):
        for b in range(nb):
            amax = F(0.0)
            for j in range(32):
                amax = max(amax, abs(x[t, b * 32 + j]))
            d = amax / qmax
            inv = qmax / amax if amax > F(0.0) else F(0.0)
            s = np.int32(0)
            sh = np.int32(0)
            for j in range(32):
                q = np.int32(np.rint(x[t, b * 32 + j] * inv))
                o = (2 * j if j < 16 else 2 * j - 31) if pairs else j
                s += q
                if split:
                    h = q >> 8
                    sh += h
                    xq[t, b * 64 + o] = h & 255
                    xq[t, b * 64 + 32 + o] = q & 255
                else:
                    xq[t, b * 32 + o] = q
            xd[t, b] = d
            if split:
                xi[t, 2 * b] = s
                xi[t, 2 * b + 1] = sh
            else:
                xi[t, b] = s


# --------------------------------------------------------------------------- matrix-vector


@intrinsic
def _prefetch(typingctx, arr, offset):
    """Hint the CPU to bring byte ``offset`` of ``arr``'s data into the caches (no fault,
    no effect on results): decode streams each weight once per token."""
    sig = types.void(arr, offset)

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(builder.bitcast(ary.data, I8.as_pointer()), [args[1]])
        name = "llvm.prefetch.p0" if str(ptr.type) == "ptr" else "llvm.prefetch.p0i8"
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, I32, I32, I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)
        builder.call(fn, [ptr, I32(0), I32(3), I32(1)])  # read, keep, data
        return context.get_dummy_value()

    return sig, codegen


#: How far ahead of the rows being multiplied the kernels prefetch, in bytes.
PREFETCH_AHEAD = 6144


@njit(**_KW, inline="always")
def _prefetch_rows(raw, first_block, nblocks):
    bb = raw.shape[1]
    total = raw.shape[0] * bb
    start = first_block * bb + PREFETCH_AHEAD
    stop = min(total, start + nblocks * bb)
    for o in range(start, stop, 64):
        _prefetch(raw, o)


@njit(**_KW, inline="always")
def _starts(starts, r, rows, nb):
    for k in range(4):
        starts[k] = min(r + k, rows - 1) * nb


@njit(**_KW, inline="always")
def _put(out, res, add, t, r, a):
    if r < out.shape[1]:
        out[t, r] = a + res[t, r] if add else a


@njit(**_KW)
def _rows(fmt_id, raw, xq, xd, xi, out, res, add, g0, g1):
    """Rows ``4 g0 .. 4 g1`` of ``out`` (``+ res`` when ``add``; ``res`` may be ``out``:
    each element is read before it is written)."""
    n = xd.shape[0]
    nb = raw.shape[0] // out.shape[1]  # weight blocks per row (of 256 values for Q4_K)
    rows = out.shape[1]
    starts = np.empty(4, np.int64)
    for g in range(g0, g1):
        r = g * 4
        _starts(starts, r, rows, nb)
        _prefetch_rows(raw, starts[0], 4 * nb)
        for t in range(n):
            a0, a1, a2, a3 = _dot4(fmt_id, raw, starts, xq[t], xd[t], xi[t], nb)
            _put(out, res, add, t, r, a0)
            _put(out, res, add, t, r + 1, a1)
            _put(out, res, add, t, r + 2, a2)
            _put(out, res, add, t, r + 3, a3)


#: ``fmt_id`` of the kernels per weight format.
FMT_ID = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}


@njit(**_KW)
def mv1(fmt_id, raw, x, xq, xd, xi, out, res, add):
    """``out = x @ w.T (+ res)`` on the calling thread; ``xq, xd, xi`` are scratch for
    :func:`quantize_rows` of ``x``."""
    quantize_rows(x, xq, xd, xi, fmt_id in (1, 2))
    _rows(fmt_id, raw, xq, xd, xi, out, res, add, 0, (out.shape[1] + 3) // 4)


@njit(**_KW, parallel=True)
def mv(fmt_id, raw, x, xq, xd, xi, out, res, add, nchunk):
    """:func:`mv1` with the rows split over ``nchunk`` of numba's threads."""
    quantize_rows(x, xq, xd, xi, fmt_id in (1, 2))
    groups = (out.shape[1] + 3) // 4
    for c in prange(nchunk):
        g0, g1 = c * groups // nchunk, (c + 1) * groups // nchunk
        _rows(fmt_id, raw, xq, xd, xi, out, res, add, g0, g1)


def scratch(n: int, k: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(xq, xd, xi)`` for :func:`quantize_rows` of ``n`` rows of ``k`` values to
    ``bits`` (8 or 16)."""
    nb = k // 32
    if bits == 8:
        return np.empty((n, k), np.int8), np.empty((n, nb), F), np.empty((n, nb), np.int32)
    return np.empty((n, 2 * k), np.uint8), np.empty((n, nb), F), np.empty((n, 2 * nb), np.int32)


def supports(kind: str) -> bool:
    """Whether ``kind`` (a weight format's name) has int8 kernels here."""
    return kind in FMT_ID


def bind(weight, x: np.ndarray, out: np.ndarray, res: np.ndarray | None, bits: int = 8):  # noqa: ANN001, ANN201
    """``(serial, parallel)`` computing ``out = x @ w.T (+ res)`` for a
    :class:`vt_cpu.weights.BlockWeight` ``weight`` of a format :func:`supports` takes, as
    ``BlockWeight.bind`` does: ``serial()`` on the calling thread, ``parallel(n)`` over n of
    numba's threads. The activations' int8 scratch is allocated here, once."""
    n, k = x.shape
    # the uint8 blocks (Q8_0 keeps an int8 view first, Q6_K one after)
    raw = weight.arrays[0] if weight.kind == "Q6_K" else weight.arrays[-1]
    xq, xd, xi = scratch(n, k, bits)
    add = res is not None
    r = res if res is not None else out
    fid = FMT_ID[weight.kind]

    def serial() -> None:
        mv1(fid, raw, x, xq, xd, xi, out, r, add)

    def parallel(nchunk: int) -> None:
        mv(fid, raw, x, xq, xd, xi, out, r, add, nchunk)

    return serial, parallel
