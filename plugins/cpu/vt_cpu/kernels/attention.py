"""numba attention over the position-major KV cache, for decode rows.

``cache[pos, slot, layer, 0 | 1, kv_head, :]`` holds K and V; row ``t`` attends to
positions ``0 .. positions[t]`` of slot ``slots[t]``. Three calls for all rows of a step:

1. :func:`scores`: ``s = scale q K^T`` per row and head (K of a position read once for
   the KV head's query heads), minus the row's maximum, into one packed float32 buffer;
2. :func:`weighted_values`: ``e = exp(s)`` in place (:func:`expf`, a polynomial that LLVM
   vectorizes: numba's own ``exp`` is a scalar libm call per value), then
   ``out = (sum_p e_p V_p) / sum_p e_p`` per row and head.

The reference's order of operations (softmax in float32 with the maximum subtracted,
normalized before the weighted sum of V), summed in another order. Rows are independent,
so a decode step of several sequences is one pass (the reference's batched matmuls run
slot by slot, ~15 numpy calls each). Inner loops index 1-D views (``q[t, a:b]``,
``cache[p, slot, layer, 0, h]``) with the loop variable alone: a computed index such as
``qo + e`` may be negative as far as numba knows, and its wraparound select turned the
loads into gathers (4x slower).
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

from .quant import _prefetch, _stack_f32

F = np.float32
_KW = {
    "cache": True,
    "nogil": True,
    "boundscheck": False,
    "fastmath": {"reassoc", "contract"},
    "error_model": "numpy",  # a division by zero gives inf/nan, as numpy does
}


@intrinsic
def _pow2(typingctx, n):  # noqa: ANN001, ANN202
    """``2.0 ** n`` as float32 for an int32 ``n`` in ``[-126, 127]`` (the exponent's bits)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, sig, args):
        bits = builder.shl(builder.add(args[0], context.get_constant(types.int32, 127)),
                           context.get_constant(types.int32, 23))  # fmt: skip
        return builder.bitcast(bits, context.get_value_type(types.float32))

    return sig, codegen


@njit(cache=True, nogil=True)  # no fast-math: reassociation would undo the ln 2 split
def expf(x):
    """``exp(x)`` in float32 for ``x <= 0`` (scores minus their maximum), within about 2 ulp
    of the exact value (Cephes' ``expf``: ``x = n ln 2 + r``, a degree-6 polynomial in ``r``,
    times ``2**n``); 0 below -87 (where float32's exp is denormal: weights under 1e-38 next
    to the maximum's 1). Branch-free, so a loop of it vectorizes."""
    small = x < F(-87.0)
    x = max(x, F(-87.0))
    n = np.floor(x * F(1.44269504088896341) + F(0.5))
    r = x - n * F(0.693359375)
    r = r - n * F(-2.12194440e-4)
    p = F(1.9875691500e-4)
    p = p * r + F(1.3981999507e-3)
    p = p * r + F(8.3334519073e-3)
    p = p * r + F(4.1665795894e-2)
    p = p * r + F(1.6666665459e-1)
    p = p * r + F(5.0000001201e-1)
    y = (p * r * r + r + F(1.0)) * _pow2(np.int32(n))
    return F(0.0) if small else y


@njit(**_KW)
def packed_size(slots, positions, n_heads, max_len, n_slots):
    """Floats of the scores buffer for these rows; or ``-(2 + t)`` for a bad position at
    row ``t``, ``-(2 + n + t)`` for a bad slot."""
    n = positions.shape[0]
    total = 0
    for t in range(n):
        if positions[t] < 0 or positions[t] >= max_len:
            return -(2 + t)
        if slots[t] < 0 or slots[t] >= n_slots:
            return -(2 + n + t)
        total += n_heads * (positions[t] + 1)
    return total


#: Positions ahead of the one being read that the kernels prefetch: a position's K and V of
#: one slot and layer are 2 n_kv_heads head_dim floats, and the next position's are a whole
#: position of the cache away (``n_slots * n_layers`` of them), on another page, where the
#: hardware prefetcher does not follow.
AHEAD = 4


@njit(**_KW, inline="always")
def _prefetch_position(cache, p, slot, layer, kv, length, start, nbytes):
    """Prefetch bytes ``[start, start + nbytes)`` of K (``kv`` 0) or V at position
    ``p + AHEAD`` of ``slot`` and ``layer``."""
    if p + AHEAD < length:
        s = cache.strides
        base = (p + AHEAD) * s[0] + slot * s[1] + layer * s[2] + kv * s[3] + start
        for o in range(0, nbytes, 64):
            _prefetch(cache, base + o)


@njit(**_KW)
def offsets(positions, n_heads, out):
    """``out[t]``: where row ``t``'s scores start in the packed buffer (``out[n]``: its
    size)."""
    o = 0
    for t in range(positions.shape[0]):
        out[t] = o
        o += n_heads * (positions[t] + 1)
    out[positions.shape[0]] = o


@njit(**_KW)
def scores_units(q, cache, layer, slots, positions, n_heads, scale, buf, maxes, starts, u0,
                 u1):  # fmt: skip
    """Units ``u0 .. u1`` of :func:`scores`, a unit being one row's one KV head (its group of
    query heads): ``u = t * n_kv + h``. ``maxes[t * n_heads + head]`` gets each head's
    maximum; ``starts`` are :func:`offsets`."""
    n_kv, hd = cache.shape[4], cache.shape[5]
    group = n_heads // n_kv
    f_scale = F(scale)
    for u in range(u0, u1):
        t, h = u // n_kv, u % n_kv
        o = starts[t]
        length = positions[t] + 1
        slot = slots[t]
        m0 = t * n_heads + h * group
        for gi in range(group):
            maxes[m0 + gi] = F(-np.inf)
        for p in range(length):
            _prefetch_position(cache, p, slot, layer, 0, length, h * hd * 4, hd * 4)
            kh = cache[p, slot, layer, 0, h]
            for gi in range(group):
                head = h * group + gi
                qh = q[t, head * hd : (head + 1) * hd]
                acc = F(0.0)
                for e in range(hd):
                    acc += qh[e] * kh[e]
                acc *= f_scale
                buf[o + head * length + p] = acc
                maxes[m0 + gi] = max(maxes[m0 + gi], acc)
        for gi in range(group):
            head = h * group + gi
            bh = buf[o + head * length : o + (head + 1) * length]
            m = maxes[m0 + gi]
            for p in range(length):
                bh[p] -= m


@njit(**_KW)
def scores(q, cache, layer, slots, positions, n_heads, scale, buf, maxes):
    """``buf`` (packed: row by row, head by head, ``positions[t] + 1`` each) gets
    ``scale q K^T`` minus each head's maximum; ``maxes``: float32 scratch of ``n * n_heads``
    (:func:`scores_units` over every unit)."""
    n = q.shape[0]
    starts = np.empty(n + 1, np.int64)
    offsets(positions, n_heads, starts)
    scores_units(q, cache, layer, slots, positions, n_heads, scale, buf, maxes, starts, 0,
                 n * cache.shape[4])  # fmt: skip


#: Largest ``n_heads * head_dim`` of :func:`weighted_values` (its accumulators live on
#: the stack, 16 KiB).
MAX_WIDTH = 4096


@njit(**_KW)
def values_units(cache, layer, slots, positions, n_heads, buf, out, starts, u0, u1):
    """Units ``u0 .. u1`` of :func:`weighted_values` (a row's KV head, as
    :func:`scores_units`)."""
    n_kv, hd = cache.shape[4], cache.shape[5]
    group = n_heads // n_kv
    acc = carray(_stack_f32(MAX_WIDTH), MAX_WIDTH)
    for u in range(u0, u1):
        t, h = u // n_kv, u % n_kv
        o = starts[t]
        length = positions[t] + 1
        slot = slots[t]
        for gi in range(group):  # exp, then normalize first, as the reference does
            head = h * group + gi
            bh = buf[o + head * length : o + (head + 1) * length]
            total = F(0.0)
            for p in range(length):
                e = expf(bh[p])
                bh[p] = e
                total += e
            for p in range(length):
                bh[p] /= total
        width = group * hd
        for e in range(width):
            acc[e] = F(0.0)
        for p in range(length):
            _prefetch_position(cache, p, slot, layer, 1, length, h * hd * 4, hd * 4)
            vh = cache[p, slot, layer, 1, h]
            for gi in range(group):
                head = h * group + gi
                ah = acc[gi * hd : (gi + 1) * hd]
                w = buf[o + head * length + p]
                for e in range(hd):
                    ah[e] += w * vh[e]
        base = h * group * hd
        for e in range(width):
            out[t, base + e] = acc[e]


@njit(**_KW)
def weighted_values(cache, layer, slots, positions, n_heads, buf, out):
    """``out[t, head] = sum_p w_p V_p`` with ``w = e / sum e``, ``e = exp(s - max)`` for
    ``buf`` holding ``s - max`` (:func:`scores`; ``buf`` gets ``w`` in place;
    ``n_heads * head_dim <= MAX_WIDTH``). The
    weights are divided before the loop over V: inside it, reassociation moved the division
    into the innermost loop (a vector division per element of V)."""
    n = out.shape[0]
    starts = np.empty(n + 1, np.int64)
    offsets(positions, n_heads, starts)
    values_units(cache, layer, slots, positions, n_heads, buf, out, starts, 0,
                 n * cache.shape[4])  # fmt: skip
