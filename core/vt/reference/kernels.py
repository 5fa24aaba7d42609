"""Reference kernels: float32 activations, int32 ids and positions, row-major.

Each function returns its result; those the backends run per step also accept ``out=`` so a
backend can write into its own buffers without allocating a result array.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..protocol.handles import KVLayout, RopeParams, RopeStyle

F32 = np.float32


def _out(out: np.ndarray | None, shape: tuple[int, ...], what: str) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=F32)
    if out.shape != shape:
        if out.size != int(np.prod(shape)):
            raise ValueError(f"{what}: out has {out.size} elements, expected shape {shape}")
        out = out.reshape(shape)
    return out


def embedding(table: np.ndarray, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``table[ids]``: one row of the ``[vocab, dim]`` table per id."""
    ids = np.asarray(ids, dtype=np.int32).reshape(-1)
    _check_ids(ids, table.shape[0], "embedding", "token id")
    o = _out(out, (ids.shape[0], table.shape[1]), "embedding")
    return np.take(table, ids, axis=0, out=o)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """``x / sqrt(mean(x**2, axis=-1) + eps) * w`` over the rows of ``x[n, dim]``."""
    dim = w.shape[-1]
    x2 = x.reshape(-1, dim)
    o = _out(out, x2.shape, "rms_norm")
    ms = np.einsum("ij,ij->i", x2, x2) / F32(dim)
    scale = (F32(1.0) / np.sqrt(ms + F32(eps))).astype(F32, copy=False)
    np.multiply(x2, scale[:, None], out=o)
    o *= w
    return o


def matmul(
    x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, out: np.ndarray | None = None
) -> np.ndarray:
    """``x[n, in] @ w.T (+ bias)`` for ``w`` of shape ``(out, in)``."""
    x2 = x.reshape(-1, w.shape[1])
    o = _out(out, (x2.shape[0], w.shape[0]), "matmul")
    if x2.shape[0] == 1:  # decode: a plain gemv over row-major w is BLAS's fastest path
        np.matmul(w, x2[0], out=o[0])
    else:
        np.matmul(x2, w.T, out=o)
    if bias is not None:
        o += bias
    return o


@lru_cache(maxsize=64)
def _inv_freq(params: RopeParams) -> np.ndarray:
    half = params.head_dim // 2
    if params.inv_freq is not None:
        if len(params.inv_freq) != half:
            raise ValueError(
                f"rope: inv_freq has {len(params.inv_freq)} entries, head_dim "
                f"{params.head_dim} needs {half}"
            )
        inv = np.asarray(params.inv_freq, dtype=np.float64)
    else:
        inv = float(params.base) ** (-2.0 * np.arange(half, dtype=np.float64) / params.head_dim)
    inv = inv / float(params.linear_factor)
    inv.setflags(write=False)
    return inv


def rope_cos_sin(positions: np.ndarray, params: RopeParams) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of ``theta[n, head_dim/2]``.

    ``theta[r, i] = positions[r] / linear_factor * base**(-2i / head_dim)`` (or
    ``inv_freq[i]`` in place of the power), computed in float64 and rounded to float32.
    """
    if params.head_dim <= 0 or params.head_dim % 2:
        raise ValueError(f"rope: head_dim must be a positive even number, got {params.head_dim}")
    if params.linear_factor <= 0:
        raise ValueError(f"rope: linear_factor must be positive, got {params.linear_factor}")
    theta = np.asarray(positions, dtype=np.float64).reshape(-1, 1) * _inv_freq(params)
    return np.cos(theta).astype(F32), np.sin(theta).astype(F32)


def rope(
    x: np.ndarray,
    positions: np.ndarray,
    n_heads: int,
    params: RopeParams,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Rotate ``x[n, n_heads * head_dim]`` by each row's position; returns a rotated copy.

    ``normal`` style rotates adjacent pairs ``(x[2i], x[2i+1])`` (llama GGUFs), ``neox``
    rotates ``(x[i], x[i + d/2])`` (qwen2/3), both by ``theta[i]`` of :func:`rope_cos_sin`:
    ``(a, b) -> (a cos - b sin, a sin + b cos)``. ``out`` may be ``x`` (in place).
    """
    positions = np.asarray(positions).reshape(-1)
    n, d = positions.shape[0], params.head_dim
    if x.size != n * n_heads * d:
        raise ValueError(
            f"rope: x has {x.size} elements, expected n={n} x n_heads={n_heads} x head_dim={d}"
        )
    cos, sin = rope_cos_sin(positions, params)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x3 = x.reshape(n, n_heads, d)
    if params.style == RopeStyle.normal:
        a, b = x3[..., 0::2], x3[..., 1::2]
    elif params.style == RopeStyle.neox:
        a, b = x3[..., : d // 2], x3[..., d // 2 :]
    else:  # pragma: no cover - RopeStyle is closed
        raise ValueError(f"rope: unknown style {params.style!r}")
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    o = _out(out, x.shape, "rope")
    o3 = o.reshape(n, n_heads, d)
    if params.style == RopeStyle.normal:
        o3[..., 0::2], o3[..., 1::2] = ra, rb
    else:
        o3[..., : d // 2], o3[..., d // 2 :] = ra, rb
    return o


def _check_ids(values: np.ndarray, limit: int, kernel: str, what: str) -> None:
    if values.size and (values.min() < 0 or values.max() >= limit):
        bad = values[(values < 0) | (values >= limit)][0]
        raise ValueError(f"{kernel}: {what} {int(bad)} is out of range [0, {limit})")


def _check_cache(cache: np.ndarray, layout: KVLayout | None, layer: int, kernel: str) -> None:
    if cache.ndim != 6:
        raise ValueError(f"{kernel}: cache must have the 6-d KVLayout shape, got {cache.shape}")
    if layout is not None and cache.shape != layout.shape:
        raise ValueError(f"{kernel}: cache shape {cache.shape} != layout shape {layout.shape}")
    if not 0 <= layer < cache.shape[2]:
        raise ValueError(f"{kernel}: layer {layer} is out of range [0, {cache.shape[2]})")


def kv_store(
    cache: np.ndarray,
    layer: int,
    k: np.ndarray,
    v: np.ndarray,
    slots: np.ndarray,
    positions: np.ndarray,
) -> None:
    """Write ``k[i]``, ``v[i]`` at ``cache[positions[i], slots[i], layer]`` (in place).

    ``cache`` has the shape of :attr:`vt.KVLayout.shape`; ``k`` and ``v`` hold
    ``n_kv_heads * head_dim`` floats per row.
    """
    _check_cache(cache, None, layer, "kv_store")
    max_len, n_slots, _, _, n_kv, hd = cache.shape
    slots = np.asarray(slots).reshape(-1)
    positions = np.asarray(positions).reshape(-1)
    n = positions.shape[0]
    if slots.shape[0] != n:
        raise ValueError(f"kv_store: {slots.shape[0]} slots for {n} positions")
    _check_ids(slots, n_slots, "kv_store", "slot")
    _check_ids(positions, max_len, "kv_store", "position")
    cache[positions, slots, layer, 0] = k.reshape(n, n_kv, hd)
    cache[positions, slots, layer, 1] = v.reshape(n, n_kv, hd)


def attention(
    q: np.ndarray,
    cache: np.ndarray,
    layout: KVLayout,
    layer: int,
    slots: np.ndarray,
    positions: np.ndarray,
    n_heads: int,
    scale: float,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Causal attention of ``q[n, n_heads * head_dim]`` over the KV cache.

    Row ``i`` attends to positions ``0..positions[i]`` of slot ``slots[i]``; query head
    ``h`` reads KV head ``h // (n_heads // n_kv_heads)``. Softmax in float32 with the row
    maximum subtracted. Rows of one slot are computed together as batched matmuls.
    """
    _check_cache(cache, layout, layer, "attention")
    n_kv, hd = layout.n_kv_heads, layout.head_dim
    if n_heads <= 0 or n_heads % n_kv:
        raise ValueError(f"attention: n_heads {n_heads} is not a multiple of n_kv_heads {n_kv}")
    g = n_heads // n_kv
    slots = np.asarray(slots).reshape(-1)
    positions = np.asarray(positions).reshape(-1)
    n = positions.shape[0]
    if slots.shape[0] != n:
        raise ValueError(f"attention: {slots.shape[0]} slots for {n} positions")
    if q.size != n * n_heads * hd:
        raise ValueError(
            f"attention: q has {q.size} elements, expected n={n} x n_heads={n_heads} "
            f"x head_dim={hd}"
        )
    _check_ids(slots, layout.n_slots, "attention", "slot")
    _check_ids(positions, layout.max_len, "attention", "position")
    q3 = q.reshape(n, n_heads, hd)
    o3 = _out(out, (n, n_heads * hd), "attention").reshape(n, n_heads, hd)
    for slot in np.unique(slots) if n > 1 else slots:
        rows = np.flatnonzero(slots == slot) if n > 1 else np.zeros(1, dtype=np.intp)
        pos = positions[rows]
        m, length = rows.shape[0], int(pos.max()) + 1
        k = cache[:length, slot, layer, 0].transpose(1, 2, 0)  # [n_kv, hd, L]
        v = cache[:length, slot, layer, 1].transpose(1, 0, 2)  # [n_kv, L, hd]
        # [m, n_kv, g, hd] -> [n_kv, m*g, hd]: every query row of a KV head in one matmul.
        qs = q3[rows].reshape(m, n_kv, g, hd).transpose(1, 0, 2, 3).reshape(n_kv, m * g, hd)
        s = np.matmul(qs, k)
        s *= F32(scale)
        if m > 1 and int(pos.min()) < length - 1:
            future = np.arange(length)[None, :] > pos[:, None]  # [m, L]
            s[:, np.repeat(future, g, axis=0)] = -np.inf
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        o = np.matmul(s, v)  # [n_kv, m*g, hd]
        o3[rows] = o.reshape(n_kv, m, g, hd).transpose(1, 0, 2, 3).reshape(m, n_heads, hd)
    return o3.reshape(n, n_heads * hd)


def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``silu(gate) * up`` where ``silu(x) = x / (1 + exp(-x))``; ``out`` may alias either."""
    o = _out(out, gate.shape, "silu_mul")
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x << 0: silu -> -0
        denom = np.exp(-gate)
    denom += F32(1.0)
    np.multiply(gate, up, out=o)
    o /= denom
    return o


def add(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a + b`` (``out`` may be ``a``)."""
    return np.add(a, b, out=_out(out, a.shape, "add"))


def gather_rows(x: np.ndarray, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x[rows]`` for ``x[m, dim]``."""
    rows = np.asarray(rows).reshape(-1)
    _check_ids(rows, x.shape[0], "gather_rows", "row")
    o = _out(out, (rows.shape[0], x.shape[1]), "gather_rows")
    return np.take(x, rows, axis=0, out=o)
