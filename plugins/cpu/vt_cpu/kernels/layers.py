"""numba kernels for the activation ops: RMS norm and RoPE + KV store.

Float32 in and out. The fused ops equal their decomposition into the reference's parts
bit for bit (tests/test_graph.py compares the logits), so RoPE angles come from
``vt.reference.rope_cos_sin`` (a table over every position, whose rows equal the
function's for those positions) and the swiglu epilogue is this module's ``silu_mul``,
which is also the backend's ``silu_mul`` op. Each kernel has a ``*_rows`` form over a
range of rows, which :mod:`vt_cpu.kernels.jobs` binds as a job.
Decode attention is :mod:`vt_cpu.kernels.attention` (prefill keeps the reference's
batched BLAS matmuls). A kernel that
indexes with ids read from device memory checks them first and returns the first bad row
(``-1`` when all are in range), so the op raises the reference's message instead of
writing out of bounds.
"""

from __future__ import annotations

import numpy as np
from numba import njit

F = np.float32
FM = {"reassoc", "contract"}
_KW = {"cache": True, "nogil": True, "boundscheck": False}


@njit(**_KW, fastmath=FM)
def rms_norm(x, w, eps, out):
    """``out[i] = x[i] / sqrt(mean(x[i]**2) + eps) * w`` for ``x[n, dim]``."""
    rms_norm_rows(x, w, eps, out, 0, x.shape[0])


@njit(**_KW, fastmath=FM, inline="always")
def rms_norm_rows(x, w, eps, out, u0, u1):
    """:func:`rms_norm` of rows ``u0 .. u1``."""
    dim = x.shape[1]
    for i in range(u0, u1):
        s = F(0.0)
        for j in range(dim):
            s += x[i, j] * x[i, j]
        scale = F(1.0) / np.sqrt(s / F(dim) + F(eps))
        for j in range(dim):
            out[i, j] = x[i, j] * scale * w[j]


@njit(**_KW)
def first_bad(values, limit):
    """Index of the first entry outside ``[0, limit)``, or -1."""
    for i in range(values.shape[0]):
        if values[i] < 0 or values[i] >= limit:
            return i
    return -1


@njit(**_KW, inline="always")
def _rotate(x, t, n_heads, hd, cos, sin, neox):
    half = hd // 2
    for h in range(n_heads):
        base = h * hd
        for i in range(half):
            if neox:
                ia, ib = base + i, base + half + i
            else:
                ia, ib = base + 2 * i, base + 2 * i + 1
            a = x[t, ia]
            b = x[t, ib]
            x[t, ia] = a * cos[i] - b * sin[i]
            x[t, ib] = a * sin[i] + b * cos[i]


@njit(**_KW, inline="always")
def rope_kv_rows(q, k, v, positions, slots, cache, layer, n_heads, cos, sin, neox, u0, u1):
    """:func:`rope_kv_store` of rows ``u0 .. u1`` with ``cos``, ``sin`` tables over every
    position (``[max_len, head_dim / 2]``): row ``t`` takes ``cos[positions[t]]``. Returns
    -1, or the first bad row's code as :func:`rope_kv_store` does (``n`` = ``q``'s rows)."""
    n = q.shape[0]
    max_len, n_slots, n_kv, hd = cache.shape[0], cache.shape[1], cache.shape[4], cache.shape[5]
    for i in range(u0, u1):
        if positions[i] < 0 or positions[i] >= max_len:
            return -(2 + i)
        if slots[i] < 0 or slots[i] >= n_slots:
            return n + i
    for t in range(u0, u1):
        pos, slot = positions[t], slots[t]
        _rotate(q, t, n_heads, hd, cos[pos], sin[pos], neox)
        _rotate(k, t, n_kv, hd, cos[pos], sin[pos], neox)
        for h in range(n_kv):
            for e in range(hd):
                cache[pos, slot, layer, 0, h, e] = k[t, h * hd + e]
                cache[pos, slot, layer, 1, h, e] = v[t, h * hd + e]
    return -1


@njit(**_KW)
def rope_kv_store(q, k, v, positions, slots, cache, layer, n_heads, cos, sin, neox):
    """RoPE of ``q`` and ``k`` in place (``cos``, ``sin``: ``[n, head_dim / 2]`` from
    ``vt.reference.rope_cos_sin``), then ``cache[pos, slot, layer] = (k, v)``. No
    contraction: ``a cos - b sin`` rounds as numpy does, so this equals the reference.

    Returns -1, or ``-(2 + i)`` for a bad position at row ``i``, ``n + i`` for a bad slot.
    """
    n = q.shape[0]
    max_len, n_slots, n_kv, hd = cache.shape[0], cache.shape[1], cache.shape[4], cache.shape[5]
    for i in range(n):
        if positions[i] < 0 or positions[i] >= max_len:
            return -(2 + i)
        if slots[i] < 0 or slots[i] >= n_slots:
            return n + i
    for t in range(n):
        _rotate(q, t, n_heads, hd, cos[t], sin[t], neox)
        _rotate(k, t, n_kv, hd, cos[t], sin[t], neox)
        pos, slot = positions[t], slots[t]
        for h in range(n_kv):
            for e in range(hd):
                cache[pos, slot, layer, 0, h, e] = k[t, h * hd + e]
                cache[pos, slot, layer, 1, h, e] = v[t, h * hd + e]
    return -1


@njit(**_KW)
def silu_mul(gate, up, out):
    """``out = gate * up / (1 + exp(-gate))``, the reference's formula (``exp`` overflows to
    inf for very negative gates: the result is -0 there too); ``out`` may alias either."""
    silu_mul_rows(gate, up, out, 0, gate.shape[0])


@njit(**_KW, inline="always")
def silu_mul_rows(gate, up, out, u0, u1):
    """:func:`silu_mul` of rows ``u0 .. u1``."""
    dim = gate.shape[1]
    for i in range(u0, u1):
        for j in range(dim):
            g = gate[i, j]
            out[i, j] = g * up[i, j] / (np.exp(-g) + F(1.0))
