"""Decode matrix-vector kernels with integer activations and integer dot products.

What llama.cpp's CPU path does for quantized weights: each activation row is quantized
once per op to blocks of 32 int8 values with one float32 scale (``d = amax / 127``,
``q = rint(x / d)``) and the block's integer sum; each weight block is then multiplied
with its activation block in integers (32 products accumulated in int32), and only the
block's result is scaled, once, by ``d_w * d_x`` in float32:

- Q8_0 ``w = d q`` (``q`` int8): ``d_w d_x sum(q x)``;
- Q4_0 ``w = d (q - 8)``: ``d_w d_x (sum(q x) - 8 sum(x))``, in int32;
- Q4_1 ``w = d q + m``: ``d_w d_x sum(q x) + m d_x sum(x)``.

The K-quants (Q4_K, Q5_K, Q6_K: blocks of 256 values with integer scales per 32 or 16)
take their activations per 256 values instead (:func:`quantize_rows_k`, llama.cpp's
``q8_K``): one float32 scale a super-block, so a weight block's sub-block products times
their 6- or 8-bit scales sum in int32 over the whole block and only the block's result is
scaled, ``d d_x sum_s sc_s sum(q x) - dmin d_x sum_s mn_s sum_s(x)`` (Q4_K/Q5_K) or ``d
d_x sum_g sc_g (sum(q x) - 32 sum_g(x))`` (Q6_K); :func:`_block_rows_k`.

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
float32 accumulators per row, four rows sharing each activation load (the K-quants:
``vpmaddubsw`` and ``vpdpwssd`` with the sub-block's scale, two sub-blocks a 512-bit
instruction). Without VNNI the same IR multiplies widened vectors (LLVM picks
``vpmaddwd`` or the target's equivalent): the same integers, so the same results, on any
CPU LLVM targets. The float16 block scales are read as LLVM ``half`` (``vcvtph2ps``).

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


def _lanes_sum(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """A float32 vector's lanes summed pairwise (a scalar as it is)."""
    if not isinstance(v.type, ir.VectorType):
        return v
    width = v.type.count
    while width > 1:
        half = width // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(_vec(I32, half), list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(_vec(I32, half), list(range(half, width))))
        v = builder.fadd(lo, hi, flags=("reassoc", "contract"))
        width = half
    return builder.extract_element(v, I32(0))


def _loop_rows(builder: ir.IRBuilder, nrows: int, nblocks: ir.Value, body, lanes: int = 8,
               min_lanes: int = 0) -> list[ir.Value]:  # noqa: ANN001 # fmt: skip
    """``for b in range(nblocks)`` in IR with, per row, ``lanes`` float32 lanes and a
    scalar (or ``min_lanes`` lanes) accumulated across blocks: ``body(b, accs, mins)``
    returns their next values. Returns each row's lanes summed plus its scalar's."""
    vf = _vec(FLT, lanes)
    flags = ("reassoc", "contract")
    entry = builder.block
    loop = builder.append_basic_block("q8.loop")
    done = builder.append_basic_block("q8.done")
    zero_f = ir.Constant(vf, None)
    mt = _vec(FLT, min_lanes) if min_lanes else FLT
    zero_m = ir.Constant(mt, None)
    builder.cbranch(builder.icmp_signed(">", nblocks, I64(0)), loop, done)
    builder.position_at_end(loop)
    b = builder.phi(I64)
    b.add_incoming(I64(0), entry)
    accs, mins = [], []
    for _ in range(nrows):
        acc = builder.phi(vf)
        acc.add_incoming(zero_f, entry)
        accs.append(acc)
        m = builder.phi(mt)
        m.add_incoming(zero_m, entry)
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
        mn = builder.phi(mt)
        mn.add_incoming(zero_m, entry)
        mn.add_incoming(new_mins[k], body_end)
        final_mins.append(mn)
    return [
        builder.fadd(
            _lanes_sum(builder, finals[k]), _lanes_sum(builder, final_mins[k]), flags=flags
        )  # fmt: skip
        for k in range(nrows)
    ]


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


# --------------------------------------------------------------- K-quants, per 256 values

#: int32 per super-block of 256 activations in the per-256 layout's sums (``xi``): the 8
#: sums of each 32 values' quants, then the 16 sums of each 16 values' quants (8 bits) or
#: high bytes (16 bits).
KS = 24
X86 = llvm.get_default_triple().startswith(("x86", "i686"))
#: Whether the per-256 kernels use 512-bit vectors (two sub-blocks of 32 per instruction):
#: with AVX-512 BW and VNNI.
WIDE = {"avx512bw", "avx512vnni"} <= _features()
#: Whether LLVM can assemble inline assembly here (numba does not set up the parser).
ASM = False
if WIDE and X86:
    try:
        llvm.initialize_native_asmparser()
        ASM = True
    except Exception:  # pragma: no cover - an llvmlite without it: the intrinsic then
        pass


def _maddubs(builder: ir.IRBuilder, u: ir.Value, s: ir.Value) -> ir.Value:
    """``u[2i] s[2i] + u[2i+1] s[2i+1]`` for 32 or 64 bytes (``u`` unsigned, ``s``
    signed) as int16 lanes (``vpmaddubsw``; the kernels' sums stay far from its
    saturation)."""
    n = u.type.count
    v16 = _vec(I16, n // 2)
    feats = _features()
    name = {32: "llvm.x86.avx2.pmadd.ub.sw", 64: "llvm.x86.avx512.pmaddubs.w.512"}[n]
    if X86 and ("avx2" if n == 32 else "avx512bw") in feats:
        fnty = ir.FunctionType(v16, [_vec(I8, n), _vec(I8, n)])
        return builder.call(_intrinsic_fn(builder, name, fnty), [u, s])
    wide = builder.mul(builder.zext(u, _vec(I16, n)), builder.sext(s, _vec(I16, n)))
    even = builder.shuffle_vector(wide, wide, ir.Constant(_vec(I32, n // 2), list(range(0, n, 2))))
    odd = builder.shuffle_vector(wide, wide, ir.Constant(_vec(I32, n // 2), list(range(1, n, 2))))
    return builder.add(even, odd)


def _dot16(builder: ir.IRBuilder, acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
    """``acc[i] + a[2i] b[2i] + a[2i+1] b[2i+1]`` for 16 or 32 int16 lanes (``vpdpwssd``
    with VNNI, else widened products that LLVM lowers to ``vpmaddwd`` or its equivalent)."""
    n = a.type.count
    vacc = _vec(I32, n // 2)
    if VNNI and n == 32 and ASM:
        # as inline assembly: LLVM's machine combiner splits a chain of vpdpwssd into
        # vpmaddwd + vpaddd (shorter latency, one more uop each), and these loops are
        # bound by the vector ports' uops, not by that latency
        fnty = ir.FunctionType(vacc, [vacc, vacc, vacc])
        ops = [builder.bitcast(a, vacc), builder.bitcast(b, vacc), acc]
        return builder.asm(fnty, "vpdpwssd $2, $1, $0", "=v,v,v,0", ops, False)
    if VNNI and (n == 16 or "avx512vnni" in _features()):
        fnty = ir.FunctionType(vacc, [vacc, vacc, vacc])
        fn = _intrinsic_fn(builder, f"llvm.x86.avx512.vpdpwssd.{16 * n}", fnty)
        return builder.call(fn, [acc, builder.bitcast(a, vacc), builder.bitcast(b, vacc)])
    wide = builder.mul(builder.sext(a, _vec(I32, n)), builder.sext(b, _vec(I32, n)))
    even = builder.shuffle_vector(wide, wide, ir.Constant(_vec(I32, n // 2), list(range(0, n, 2))))
    odd = builder.shuffle_vector(wide, wide, ir.Constant(_vec(I32, n // 2), list(range(1, n, 2))))
    return builder.add(acc, builder.add(even, odd))


def _load_i32s(builder: ir.IRBuilder, base: ir.Value, index: ir.Value, n: int) -> ir.Value:
    """``n`` int32 from ``base[index]`` (an int32 pointer) as a vector."""
    ptr = builder.bitcast(builder.gep(base, [index]), _vec(I32, n).as_pointer())
    return builder.load(ptr, align=4)


def _concat(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(_vec(I32, 2 * n), list(range(2 * n))))


def _halves_sum(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """A 16-lane int32 vector's halves added (8 lanes); 8 lanes as they are."""
    n = v.type.count
    if n == 8:
        return v
    lo = builder.shuffle_vector(v, v, ir.Constant(_vec(I32, n // 2), list(range(n // 2))))
    hi = builder.shuffle_vector(v, v, ir.Constant(_vec(I32, n // 2), list(range(n // 2, n))))
    return builder.add(lo, hi)


def _prefetch_ir(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value) -> None:
    """Hint the CPU to bring byte ``offset`` of ``base`` into the caches (no fault)."""
    ptr = builder.gep(base, [offset])
    name = "llvm.prefetch.p0" if str(ptr.type) == "ptr" else "llvm.prefetch.p0i8"
    fnty = ir.FunctionType(ir.VoidType(), [ptr.type, I32, I32, I32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, name)
    builder.call(fn, [ptr, I32(0), I32(3), I32(1)])  # read, keep, data


def _prefetch_group(builder: ir.IRBuilder, wbase: ir.Value, ahead: ir.Value, b: ir.Value,
                    step: int) -> None:  # fmt: skip
    """Prefetch bytes ``ahead + b step .. ahead + (b + 1) step`` (the next group's block
    ``b`` of each row): one line a 64 bytes, and one for the line the last may straddle."""
    nxt = builder.add(ahead, builder.mul(b, I64(step)))
    for line in range(0, step + (63 if step % 64 else 0), 64):
        _prefetch_ir(builder, wbase, builder.add(nxt, I64(min(line, step - 1))))


def _block_rows_k(fmt: str, nrows: int, bits: int, wide: bool | None = None):  # noqa: ANN202
    """:func:`_block_rows` for Q4_K, Q5_K and Q6_K with activations quantized per 256
    values (:func:`quantize_rows_k`: one scale a super-block, llama.cpp's ``q8_K``): a
    weight block's sub-block products are multiplied by their integer scales and summed
    in int32 over the whole block, and scaled in float once per block and row.

    Per sub-block ``s`` of 32 values and row: ``vpmaddubsw`` of the weight's codes
    (unsigned) with the activation bytes (pairs of products in int16), then ``vpdpwssd``
    of those with the sub-block's scale (int16, splat) into int32 lanes; with ``wide``
    (default :data:`WIDE`) two sub-blocks a 512-bit instruction. With 16-bit activations
    (``q = 256 h + l``) the high bytes ``h`` go to one accumulator ``H`` and the low bytes
    ``l`` (unsigned, multiplied by the codes as signed bytes) to another, ``L``; the
    block's float is ``d dx (256 H + L)``, converted separately (``256 H`` can pass 2^31).

    - Q4_K/Q5_K (``d sc_s q - dmin mn_s``): the min term ``dmin dx sum_s mn_s X_s`` with
      ``X_s`` the 32 quants' sum (int32: |sum| < 2^20, times 63 times 8 < 2^29);
    - Q6_K (``d sc_g (q - 32)``, ``g`` per 16 values): ``q`` (0..63) multiplies ``h`` (or
      the int8 ``x``) and ``32 sum_g sc_g Y_g`` (``Y_g``: the 16 values' sum of ``h`` or
      ``x``) is taken back from ``H``; the low bytes multiply ``q - 32``.

    Bounds (int32 lanes, 32 values each over a block): Q4_K ``32 * 15 * 128 * 63`` (4e6),
    Q5_K 31 (8e6), Q6_K ``32 * 63 * 128 * 128`` (3.3e7), low bytes at most twice these."""
    split = bits == 16
    six = fmt == "Q6_K"
    five = fmt == "Q5_K"
    block_bytes, qoff = {"Q4_K": (144, 16), "Q5_K": (176, 48), "Q6_K": (210, 0)}[fmt]
    flags = ("reassoc", "contract")
    per = 2 if (WIDE if wide is None else wide) else 1  # sub-blocks per instruction
    nv = 32 * per  # bytes per vector

    def impl(typingctx, raw, starts, xq, xd, xi, nb):
        sig = types.UniTuple(types.float32, nrows)(raw, starts, xq, xd, xi, nb)

        def codegen(context, builder, sig, args):
            wbase, st_data, (xbase, xd_data, xi_data) = _intrinsic_args(context, builder, sig, args)
            vf, vi, vb = _vec(FLT, 8), _vec(I32, 8), _vec(I8, nv)
            vacc = _vec(I32, 8 * per)
            row_off = []
            for k in range(nrows):
                blk = builder.load(builder.gep(st_data, [I64(k)]))
                row_off.append(builder.mul(blk, I64(block_bytes)))

            def bytes_(v, n=nv):  # noqa: ANN001, ANN202
                return ir.Constant(_vec(I8, n), [v] * n)

            def word(p, o):  # noqa: ANN001, ANN202
                return _load(builder, wbase, builder.add(p, I64(o)), I32)

            v4 = _vec(I32, 4)

            def c4(*vals):  # noqa: ANN002, ANN202
                return ir.Constant(v4, list(vals) * (4 // len(vals)))

            def shift16(v, counts, left):  # noqa: ANN001, ANN202 - int16 lanes, per half
                n = v.type.count // 2
                c = ir.Constant(_vec(I16, n), [counts[i * len(counts) // n] for i in range(n)])
                w = builder.bitcast(v, _vec(I16, n))
                w = builder.shl(w, c) if left else builder.lshr(w, c)
                return builder.bitcast(w, v.type)

            # a later group of rows (they follow these), at least PREFETCH_GROUP_BYTES on,
            # a block of each row per block here: its fetch overlaps this group's arithmetic
            group = builder.mul(args[5], I64(nrows * block_bytes))
            groups = builder.udiv(builder.add(group, I64(PREFETCH_GROUP_BYTES - 1)), group)
            ahead = builder.add(row_off[0], builder.mul(group, groups))

            def body(b, accs, mins):  # noqa: ANN001, ANN202
                accs = list(accs)
                ps = [
                    builder.add(row_off[k], builder.mul(b, I64(block_bytes))) for k in range(nrows)
                ]
                _prefetch_group(builder, wbase, ahead, b, nrows * block_bytes)
                dx = builder.load(builder.gep(xd_data, [b]))
                sums_at = builder.mul(b, I64(KS))
                zero = ir.Constant(vacc, None)
                acc_h = [zero] * nrows
                acc_l = [zero] * nrows
                scales, extra, ds = [], [], []
                for p in ps:
                    if six:
                        sc = _load(builder, wbase, builder.add(p, I64(192)), _vec(I8, 16))
                        scales.append(builder.sext(sc, _vec(I16, 16)))
                        ds.append(_f16(builder, wbase, builder.add(p, I64(208))))
                        continue
                    # the 6-bit scales and mins, unpacked as llama.cpp does (words u0, u1,
                    # u2 of bytes 4..15) in one vector: [sc 0-3, sc 4-7, mn 0-3, mn 4-7]
                    a = _load(builder, wbase, builder.add(p, I64(4)), v4)  # u0 u1 u2 (u3)
                    u2 = _splat(builder, word(p, 12), 4)
                    lo = builder.and_(a, c4(0x3F3F3F3F))  # sc 0-3, mn 0-3
                    top = builder.and_(builder.lshr(a, c4(2)), c4(0x30303030))
                    low4 = builder.and_(builder.lshr(u2, c4(0, 4)), c4(0x0F0F0F0F))
                    hi = builder.or_(low4, top)  # sc 4-7, mn 4-7
                    r = builder.shuffle_vector(lo, hi, ir.Constant(v4, [0, 4, 1, 5]))
                    rb = builder.bitcast(r, _vec(I8, 16))
                    sc = builder.shuffle_vector(rb, rb, ir.Constant(vi, list(range(8))))
                    mn = builder.shuffle_vector(rb, rb, ir.Constant(vi, list(range(8, 16))))
                    scales.append(builder.zext(sc, _vec(I16, 8)))
                    extra.append(builder.zext(mn, vi))
                    ds.append(_f16(builder, wbase, p))
                if five:
                    qh = [_load(builder, wbase, builder.add(p, I64(16)), _vec(I8, 32)) for p in ps]
                    if per == 2:
                        qh = [_concat(builder, v, v) for v in qh]
                held: list = [None] * nrows
                for s in range(0, 8, per):  # sub-blocks s .. s + per - 1
                    # 16 bits: per pair of sub-blocks 64 high bytes, then 64 low bytes
                    off = builder.add(
                        builder.mul(b, I64(512 if split else 256)),
                        I64(128 * (s // 2) + 32 * (s % 2) if split else 32 * s),
                    )
                    xh = _load(builder, xbase, off, vb)
                    xl = _load(builder, xbase, builder.add(off, I64(64)), vb) if split else None
                    if six:
                        lanes = [g for t in range(2 * s, 2 * (s + per)) for g in [t] * 8]
                    else:
                        lanes = [g for t in range(s, s + per) for g in [t] * 16]
                    mask = ir.Constant(_vec(I32, 16 * per), lanes)
                    for k in range(nrows):
                        if six:
                            h, k4 = divmod(s, 4)
                            if k4 == 0:
                                base = builder.add(ps[k], I64(64 * h))
                                qq = _load(builder, wbase, builder.add(ps[k], I64(128 + 32 * h)),
                                           _vec(I8, 32))  # fmt: skip
                                if per == 2:
                                    held[k] = (_load(builder, wbase, base, vb), None,
                                               _concat(builder, qq, qq))  # fmt: skip
                                else:
                                    held[k] = (
                                        _load(builder, wbase, base, vb),
                                        _load(builder, wbase, builder.add(base, I64(32)), vb),
                                        qq,
                                    )
                            a, bb, q6h = held[k]
                            if per == 2:  # a: ql's 64 bytes of this half
                                if k4 == 0:
                                    lo = builder.and_(a, bytes_(15))
                                    hi = shift16(q6h, (4, 2), True)
                                else:
                                    lo = builder.lshr(a, bytes_(4))
                                    hi = shift16(q6h, (0, 2), False)
                            elif k4 == 0:
                                lo, hi = builder.and_(a, bytes_(15)), builder.shl(q6h, bytes_(4))
                            elif k4 == 1:
                                lo, hi = builder.and_(bb, bytes_(15)), builder.shl(q6h, bytes_(2))
                            elif k4 == 2:
                                lo, hi = builder.lshr(a, bytes_(4)), q6h
                            else:
                                lo, hi = builder.lshr(bb, bytes_(4)), builder.lshr(q6h, bytes_(2))
                            w = builder.or_(lo, builder.and_(hi, bytes_(0x30)))
                            ws = builder.sub(w, bytes_(32))
                        else:
                            if per == 2 or s % 2 == 0:
                                held[k] = _load(builder, wbase, builder.add(ps[k],
                                                I64(qoff + 16 * s)), _vec(I8, 32))  # fmt: skip
                            q = held[k]
                            if per == 2:  # the 32 bytes in both halves (a broadcast load)
                                w = builder.and_(shift16(_concat(builder, q, q), (0, 4), False),
                                                 bytes_(15))  # fmt: skip
                            elif s % 2 == 0:
                                w = builder.and_(q, bytes_(15))
                            else:
                                w = builder.lshr(q, bytes_(4))
                            if five:
                                if per == 2:
                                    hb = shift16(qh[k], (s, s + 1), False)
                                else:
                                    hb = builder.lshr(qh[k], bytes_(s))
                                hb = builder.and_(hb, bytes_(1))
                                w = builder.or_(w, builder.shl(hb, bytes_(4)))
                            ws = w
                        scv = builder.shuffle_vector(scales[k], scales[k], mask)
                        acc_h[k] = _dot16(builder, acc_h[k], _maddubs(builder, w, xh), scv)
                        if split:
                            acc_l[k] = _dot16(builder, acc_l[k], _maddubs(builder, xl, ws), scv)
                if six:
                    ys = _load_i32s(builder, xi_data, builder.add(sums_at, I64(8)), 16)
                else:
                    xs = _load_i32s(builder, xi_data, sums_at, 8)
                    dms = [_f16(builder, wbase, builder.add(p, I64(2))) for p in ps]
                mins = list(mins)
                lf = _vec(FLT, 8 * per)
                for k in range(nrows):
                    f = builder.fmul(ds[k], dx)
                    hk = acc_h[k]
                    if six:  # 32 sum_g sc_g Y_g, taken back from H (16 lanes)
                        prod = builder.mul(builder.sext(scales[k], _vec(I32, 16)), ys)
                        corr = builder.shl(prod, ir.Constant(_vec(I32, 16), [5] * 16))
                        if per == 1:
                            corr = _halves_sum(builder, corr)
                        hk = builder.sub(hk, corr)
                    v = builder.sitofp(hk, lf)
                    if split:  # 256 H + L
                        c256 = ir.Constant(lf, [256.0] * (8 * per))
                        v = builder.fadd(builder.fmul(v, c256, flags=flags),
                                         builder.sitofp(acc_l[k], lf), flags=flags)  # fmt: skip
                    v = builder.fmul(v, _splat(builder, f, 8 * per), flags=flags)
                    accs[k] = builder.fadd(accs[k], v, flags=flags)
                    if not six:
                        m = builder.sitofp(builder.mul(extra[k], xs), vf)
                        fm = _splat(builder, builder.fmul(dms[k], dx), 8)
                        mins[k] = builder.fsub(mins[k], builder.fmul(m, fm, flags=flags),
                                               flags=flags)  # fmt: skip
                return accs, mins

            results = _loop_rows(builder, nrows, args[5], body, 8 * per, 0 if six else 8)
            return context.make_tuple(builder, sig.return_type, results)

        return sig, codegen

    impl.__name__ = f"_dot_{fmt.lower()}_256_x{nrows}_i{bits}_w{per}"
    return intrinsic(impl)


_dot4_q8_0, _dot4_q4_0, _dot4_q4_1 = (_block_rows(f, ROWS, 8) for f in ("Q8_0", "Q4_0", "Q4_1"))
_dot4_q8_0w, _dot4_q4_0w, _dot4_q4_1w = (_block_rows(f, ROWS, 16) for f in ("Q8_0", "Q4_0", "Q4_1"))
_dot4_q4_k, _dot4_q4_kw = _block_rows_k("Q4_K", ROWS, 8), _block_rows_k("Q4_K", ROWS, 16)
_dot4_q5_k, _dot4_q5_kw = _block_rows_k("Q5_K", ROWS, 8), _block_rows_k("Q5_K", ROWS, 16)
_dot4_q6_k, _dot4_q6_kw = _block_rows_k("Q6_K", ROWS, 8), _block_rows_k("Q6_K", ROWS, 16)


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


@njit(**_KW, inline="always")
def _block_scale(x, t, k0, width, qmax):
    """``(d, 1 / d)`` of row ``t``'s values ``k0 .. k0 + width``: ``amax / qmax``, and 0 for
    an all-zero block (its quants are then 0)."""
    amax = F(0.0)
    for j in range(width):
        amax = max(amax, abs(x[t, k0 + j]))
    return amax / qmax, qmax / amax if amax > F(0.0) else F(0.0)


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
            d, inv = _block_scale(x, t, b * 32, 32, qmax)
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


@njit(**_KW)
def quantize_rows_k(x, xq, xd, xi):
    """``x[n, nb * 256]`` (float32) quantized per 256 values (llama.cpp's ``q8_K``, with
    16 bits too): one float32 scale a super-block (``xd[n, nb]``, ``amax / qmax``), values
    rounded to nearest, ties to even, in their natural order; ``xq`` as for
    :func:`quantize_rows` (8 bits: int8 ``[n, nb * 256]``; 16 bits: uint8 ``[n, nb * 512]``,
    each 64 values' high bytes then low bytes). ``xi[n, nb * KS]``: per super-block the
    sums of each 32 values' quants (8), then of each 16 values' quants (8 bits) or high
    bytes (16 bits) (16)."""
    quantize_range_k(x, xq, xd, xi, 0, x.shape[0])


@njit(**_KW, inline="always")
def quantize_range_k(x, xq, xd, xi, u0, u1):
    """:func:`quantize_rows_k` of rows ``u0 .. u1`` (the job of :mod:`vt_cpu.kernels.jobs`)."""
    qmax = _qmax(xq)
    split = xq.shape[1] != x.shape[1]
    nb = x.shape[1] // 256
    for t in range(u0, u1):
        for b in range(nb):
            d, inv = _block_scale(x, t, b * 256, 256, qmax)
            for g in range(16):
                s = np.int32(0)
                sh = np.int32(0)
                for j in range(16):
                    i = b * 256 + g * 16 + j
                    q = np.int32(np.rint(x[t, i] * inv))
                    s += q
                    if split:
                        h = q >> 8
                        sh += h
                        o = b * 512 + (g // 4) * 128 + (g % 4) * 16 + j
                        xq[t, o] = h & 255
                        xq[t, o + 64] = q & 255
                    else:
                        xq[t, i] = q
                        sh += q
                xi[t, b * KS + 8 + g] = sh
                if g % 2 == 0:
                    xi[t, b * KS + g // 2] = s
                else:
                    xi[t, b * KS + g // 2] += s
            xd[t, b] = d


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
#: The per-256 kernels prefetch as they go instead: block ``b`` of each row of the group of
#: rows at least this many bytes on, while they multiply block ``b`` of their own group
#: (one group of a 1B model's down projection, three of its other projections): its
#: streaming 14-16 -> 16-17 GB/s over two threads (Q4_K), against the group at once.
PREFETCH_GROUP_BYTES = 12288


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
        if fmt_id < 3:  # (the K-quants' kernels prefetch as they go)
            _prefetch_rows(raw, starts[0], 4 * nb)
        for t in range(n):
            a0, a1, a2, a3 = _dot4(fmt_id, raw, starts, xq[t], xd[t], xi[t], nb)
            _put(out, res, add, t, r, a0)
            _put(out, res, add, t, r + 1, a1)
            _put(out, res, add, t, r + 2, a2)
            _put(out, res, add, t, r + 3, a3)


#: ``fmt_id`` of the kernels per weight format.
FMT_ID = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}


def layout(fid: int) -> int:
    """The activations' layout of kernel ``fid``: 0 blocks of 32 (:func:`quantize_rows`),
    1 the same in the nibble formats' order, 2 per 256 (:func:`quantize_rows_k`)."""
    return 2 if fid >= 3 else 1 if fid in (1, 2) else 0


@njit(**_KW)
def mv1(fmt_id, raw, x, xq, xd, xi, out, res, add):
    """``out = x @ w.T (+ res)`` on the calling thread; ``xq, xd, xi`` are scratch for
    :func:`quantize_rows` of ``x``."""
    if fmt_id >= 3:
        quantize_rows_k(x, xq, xd, xi)
    else:
        quantize_rows(x, xq, xd, xi, fmt_id in (1, 2))
    _rows(fmt_id, raw, xq, xd, xi, out, res, add, 0, (out.shape[1] + 3) // 4)


@njit(**_KW, parallel=True)
def mv(fmt_id, raw, x, xq, xd, xi, out, res, add, nchunk):
    """:func:`mv1` with the rows split over ``nchunk`` of numba's threads."""
    if fmt_id >= 3:
        quantize_rows_k(x, xq, xd, xi)
    else:
        quantize_rows(x, xq, xd, xi, fmt_id in (1, 2))
    groups = (out.shape[1] + 3) // 4
    for c in prange(nchunk):
        g0, g1 = c * groups // nchunk, (c + 1) * groups // nchunk
        _rows(fmt_id, raw, xq, xd, xi, out, res, add, g0, g1)


def scratch(n: int, k: int, bits: int, per256: bool = False) -> tuple[np.ndarray, ...]:
    """``(xq, xd, xi)`` for :func:`quantize_rows` (or with ``per256``
    :func:`quantize_rows_k`) of ``n`` rows of ``k`` values to ``bits`` (8 or 16)."""
    if per256:
        nb = k // 256
        xq = np.empty((n, k), np.int8) if bits == 8 else np.empty((n, 2 * k), np.uint8)
        return xq, np.empty((n, nb), F), np.empty((n, nb * KS), np.int32)
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
    fid = FMT_ID[weight.kind]
    xq, xd, xi = scratch(n, k, bits, layout(fid) == 2)
    add = res is not None
    r = res if res is not None else out

    def serial() -> None:
        mv1(fid, raw, x, xq, xd, xi, out, r, add)

    def parallel(nchunk: int) -> None:
        mv(fid, raw, x, xq, xd, xi, out, r, add, nchunk)

    return serial, parallel
