"""The decode matmuls as team jobs (:mod:`vt_cpu.kernels.team`): C functions over a range
of units, their operands given as addresses and shapes in an int64 argument block.

- ``q8_16`` / ``q8_8``: :func:`vt_cpu.kernels.q8._rows` (one activation row, integer
  activations of 16 or 8 bits; the caller quantized them), a unit being 4 weight rows;
- ``mm_q8_0``, ``mm_q4``, ``mm_qk45``, ``mm_q6_k``: the tile kernels of
  :mod:`vt_cpu.kernels.quant` (several activation rows), a unit being 4 weight rows (2 with
  8 activation rows or more); with a residual, a chunk adds it to its own rows;
- ``multi``: several of these one after the other (:func:`multi_job`);
- ``attn_scores`` / ``attn_values``: decode attention's two passes
  (:func:`vt_cpu.kernels.attention.scores_units`, ``values_units``), a unit being one
  row's KV head with its query heads (:class:`AttentionJobs`); ``attn_prep`` checks the
  rows' positions and slots and lays out the packed scores (one unit);
- ``quant8`` / ``quant16``: the activations' quantization of the ``q8_*`` jobs
  (:func:`vt_cpu.kernels.q8.quantize_range`; per 256 values for the K-quants,
  :func:`vt_cpu.kernels.q8.quantize_range_k`), a unit being a row;
- ``rms_norm``, ``silu_mul``, ``rope_kv``: the activation ops of
  :mod:`vt_cpu.kernels.layers` over rows (``rope_kv`` writes a bad row's code to a status
  word instead of returning it); ``gather``: the op ``gather_rows``.

A backend op is one or more of these jobs (run alone or shared, the same compiled code
either way), so a captured graph can run as a program of jobs (:mod:`vt_cpu.program`)
without returning to Python between ops.

The argument blocks are built by :func:`q8_args` and :func:`mm_args`, which also return
the number of units; the arrays they point into must outlive every run of the job (the
backend's closures hold them). Each job is compiled (or loaded from numba's cache) the
first time :func:`address` is asked for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import carray, cfunc, njit, types

from .. import native
from . import attention as A
from . import init_numba_runtime
from . import layers as L
from . import q8 as Q8
from . import quant as Q
from .team import call_job, ptr_f32, ptr_i8, ptr_i32, ptr_i64, ptr_u8

SIGNATURE = types.void(types.int64, types.int64, types.int64)
_KW = {"cache": True, "boundscheck": False, "fastmath": {"reassoc", "contract"}}
_EXACT = {"cache": True, "boundscheck": False}  # the layers' kernels that equal numpy
Q8_ARGS, MM_ARGS = 15, 13
_INLINE = {**_KW, "inline": "always"}


@njit(**_INLINE)
def _q8(a, u0, u1, xq):  # noqa: ANN001, ANN202 - numba only
    n = a[5]
    raw = carray(ptr_u8(a[1]), (a[2], a[3]))
    xd = carray(ptr_f32(a[7]), (n, a[8]))
    xi = carray(ptr_i32(a[9]), (n, a[10]))
    out = carray(ptr_f32(a[11]), (n, a[12]))
    res = carray(ptr_f32(a[13]), (n, a[12]))
    Q8._rows(a[0], raw, xq, xd, xi, out, res, a[14] != 0, u0, u1)


def q8_16(args, u0, u1):  # noqa: ANN001, ANN201
    a = carray(ptr_i64(args), Q8_ARGS)
    _q8(a, u0, u1, carray(ptr_u8(a[4]), (a[5], a[6])))


def q8_8(args, u0, u1):  # noqa: ANN001, ANN201
    a = carray(ptr_i64(args), Q8_ARGS)
    _q8(a, u0, u1, carray(ptr_i8(a[4]), (a[5], a[6])))


@njit(**_INLINE)
def _mm_finish(a, out_rows, tgt, u0, u1):  # noqa: ANN001, ANN202
    """With a residual: ``out = tgt + res`` on this chunk's weight rows."""
    if a[11] == 0:
        return
    n = a[5]
    per = 2 if a[12] != 0 else 4
    res = carray(ptr_f32(a[9]), (n, out_rows))
    out = carray(ptr_f32(a[10]), (n, out_rows))
    for t in range(n):
        for r in range(per * u0, min(out_rows, per * u1)):
            out[t, r] = tgt[t, r] + res[t, r]


@njit(**_INLINE)
def _mm_views(a):  # noqa: ANN001, ANN202
    raw = carray(ptr_u8(a[1]), (a[2], a[3]))
    x = carray(ptr_f32(a[4]), (a[5], a[6], 32))
    tgt = carray(ptr_f32(a[7]), (a[5], a[8]))
    return raw, x, tgt


def mm_q8_0(args, u0, u1):  # noqa: ANN001, ANN201
    a = carray(ptr_i64(args), MM_ARGS)
    raw, x, tgt = _mm_views(a)
    q = carray(ptr_i8(a[1]), (a[2], a[3]))
    if a[12] != 0:
        Q._tile8_q8_0(q, raw, x, tgt, u0, u1)
    else:
        Q._tile_q8_0(q, raw, x, tgt, u0, u1)
    _mm_finish(a, a[8], tgt, u0, u1)


def mm_q4(args, u0, u1):  # noqa: ANN001, ANN201
    a = carray(ptr_i64(args), MM_ARGS)
    raw, x, tgt = _mm_views(a)
    if a[12] != 0:
        Q._tile8_q4(raw, x, tgt, u0, u1, a[0] != 0)
    else:
        Q._tile_q4(raw, x, tgt, u0, u1, a[0] != 0)
    _mm_finish(a, a[8], tgt, u0, u1)


def mm_qk45(args, u0, u1):  # noqa: ANN001, ANN201
    a = carray(ptr_i64(args), MM_ARGS)
    raw, x, tgt = _mm_views(a)
    if a[12] != 0:
        Q._tile8_qk45(raw, x, tgt, u0, u1, a[0] != 0)
    else:
        Q._tile_qk45(raw, x, tgt, u0, u1, a[0] != 0)
    _mm_finish(a, a[8], tgt, u0, u1)


def mm_q6_k(args, u0, u1):  # noqa: ANN001, ANN201
    a = carray(ptr_i64(args), MM_ARGS)
    raw, x, tgt = _mm_views(a)
    sc = carray(ptr_i8(a[1]), (a[2], a[3]))
    if a[12] != 0:
        Q._tile8_q6_k(raw, sc, x, tgt, u0, u1)
    else:
        Q._tile_q6_k(raw, sc, x, tgt, u0, u1)
    _mm_finish(a, a[8], tgt, u0, u1)


def multi(args, u0, u1):  # noqa: ANN001, ANN201
    count = carray(ptr_i64(args), 1)[0]
    a = carray(ptr_i64(args), 1 + 3 * count)
    base = 0
    for i in range(count):
        fn, part, units = a[1 + 3 * i], a[2 + 3 * i], a[3 + 3 * i]
        lo, hi = max(u0, base), min(u1, base + units)
        if lo < hi:
            call_job(fn, part, lo - base, hi - base)
        base += units


#: The attention jobs' argument block: [n, width, q, cache, max_len, n_slots, n_layers,
#: n_kv, head_dim, slots, positions, buf, buf size, maxes, maxes size, starts, scale (a
#: float32's address), layer, n_heads, out, status]; ``buf`` holds room for the longest
#: context (:class:`AttentionJobs`).
ATTN_ARGS = 21
BUF, BUF_SIZE, ATTN_STATUS = 11, 12, 20


@njit(**_INLINE)
def _attn_views(a):  # noqa: ANN001, ANN202
    n, width = a[0], a[1]
    q = carray(ptr_f32(a[2]), (n, width))
    cache = carray(ptr_f32(a[3]), (a[4], a[5], a[6], 2, a[7], a[8]))
    slots = carray(ptr_i32(a[9]), n)
    positions = carray(ptr_i32(a[10]), n)
    buf = carray(ptr_f32(a[11]), a[12])
    starts = carray(ptr_i64(a[15]), n + 1)
    return q, cache, slots, positions, buf, starts


def attn_scores(args, u0, u1):  # noqa: ANN001, ANN201
    a = carray(ptr_i64(args), ATTN_ARGS)
    q, cache, slots, positions, buf, starts = _attn_views(a)
    maxes = carray(ptr_f32(a[13]), a[14])
    scale = carray(ptr_f32(a[16]), 1)[0]
    A.scores_units(q, cache, a[17], slots, positions, a[18], scale, buf, maxes, starts, u0, u1)


def attn_values(args, u0, u1):  # noqa: ANN001, ANN201
    a = carray(ptr_i64(args), ATTN_ARGS)
    q, cache, slots, positions, buf, starts = _attn_views(a)
    out = carray(ptr_f32(a[19]), (a[0], a[1]))
    A.values_units(cache, a[17], slots, positions, a[18], buf, out, starts, u0, u1)


def attn_prep(args, u0, u1):  # noqa: ANN001, ANN201
    """Check the rows (a bad position or slot: its code from ``packed_size`` in the status
    word) and lay out the packed scores (``starts``; ``starts[n]`` is their size)."""
    a = carray(ptr_i64(args), ATTN_ARGS)
    n = a[0]
    slots = carray(ptr_i32(a[9]), n)
    positions = carray(ptr_i32(a[10]), n)
    total = A.packed_size(slots, positions, a[18], a[4], a[5])
    status = carray(ptr_i64(a[ATTN_STATUS]), 1)
    if total < 0:
        status[0] = total
    elif total > a[BUF_SIZE]:  # cannot happen: the buffer holds n_heads * max_len a row
        status[0] = 1
    else:
        A.offsets(positions, a[18], carray(ptr_i64(a[15]), n + 1))


#: The activations' quantization: [x, n, k, xq, xq columns, xd, blocks, xi, xi columns,
#: layout (:func:`vt_cpu.kernels.q8.layout`: 0 blocks of 32, 1 the nibble formats' order,
#: 2 per 256)].
QUANT_ARGS = 10


@njit(**_INLINE)
def _quant_views(a):  # noqa: ANN001, ANN202
    n = a[1]
    x = carray(ptr_f32(a[0]), (n, a[2]))
    xd = carray(ptr_f32(a[5]), (n, a[6]))
    xi = carray(ptr_i32(a[7]), (n, a[8]))
    return x, xd, xi


@njit(**_INLINE)
def _quant(a, xq, u0, u1):  # noqa: ANN001, ANN202 - numba only
    x, xd, xi = _quant_views(a)
    if a[9] == 2:
        Q8.quantize_range_k(x, xq, xd, xi, u0, u1)
    else:
        Q8.quantize_range(x, xq, xd, xi, a[9] != 0, u0, u1)


def quant16(args, u0, u1):  # noqa: ANN001, ANN201
    a = carray(ptr_i64(args), QUANT_ARGS)
    _quant(a, carray(ptr_u8(a[3]), (a[1], a[4])), u0, u1)


def quant8(args, u0, u1):  # noqa: ANN001, ANN201
    a = carray(ptr_i64(args), QUANT_ARGS)
    _quant(a, carray(ptr_i8(a[3]), (a[1], a[4])), u0, u1)


def rms_norm(args, u0, u1):  # noqa: ANN001, ANN201
    """[x, n, dim, w, eps (a float32's address), out]."""
    a = carray(ptr_i64(args), 6)
    n, dim = a[1], a[2]
    x = carray(ptr_f32(a[0]), (n, dim))
    out = carray(ptr_f32(a[5]), (n, dim))
    eps = carray(ptr_f32(a[4]), 1)[0]
    L.rms_norm_rows(x, carray(ptr_f32(a[3]), dim), eps, out, u0, u1)


def silu_mul(args, u0, u1):  # noqa: ANN001, ANN201
    """[gate, up, out, n, dim]."""
    a = carray(ptr_i64(args), 5)
    n, dim = a[3], a[4]
    gate = carray(ptr_f32(a[0]), (n, dim))
    up = carray(ptr_f32(a[1]), (n, dim))
    L.silu_mul_rows(gate, up, carray(ptr_f32(a[2]), (n, dim)), u0, u1)


#: RoPE and the KV store: [q, n, q width, k, kv width, v, positions, slots, cache, max_len,
#: n_slots, n_layers, n_kv, head_dim, layer, n_heads, cos, sin, neox, status].
ROPE_ARGS = 20


def rope_kv(args, u0, u1):  # noqa: ANN001, ANN201
    a = carray(ptr_i64(args), ROPE_ARGS)
    n, kw = a[1], a[4]
    q = carray(ptr_f32(a[0]), (n, a[2]))
    k = carray(ptr_f32(a[3]), (n, kw))
    v = carray(ptr_f32(a[5]), (n, kw))
    positions = carray(ptr_i32(a[6]), n)
    slots = carray(ptr_i32(a[7]), n)
    cache = carray(ptr_f32(a[8]), (a[9], a[10], a[11], 2, a[12], a[13]))
    half = a[13] // 2
    cos = carray(ptr_f32(a[16]), (a[9], half))
    sin = carray(ptr_f32(a[17]), (a[9], half))
    code = L.rope_kv_rows(q, k, v, positions, slots, cache, a[14], a[15], cos, sin, a[18] != 0,
                          u0, u1)  # fmt: skip
    if code != -1:
        carray(ptr_i64(a[19]), 1)[0] = code


def gather(args, u0, u1):  # noqa: ANN001, ANN201
    """[x, x rows, dim, rows, out, status]: ``out[i] = x[rows[i]]``; a row out of range
    leaves ``1 + i`` of the first in the status word and copies nothing."""
    a = carray(ptr_i64(args), 6)
    m, dim = a[1], a[2]
    rows = carray(ptr_i32(a[3]), u1)
    for i in range(u0, u1):
        if rows[i] < 0 or rows[i] >= m:
            carray(ptr_i64(a[5]), 1)[0] = 1 + i
            return
    x = carray(ptr_f32(a[0]), (m, dim))
    out = carray(ptr_f32(a[4]), (u1, dim))
    for i in range(u0, u1):
        out[i, :] = x[rows[i], :]


#: :func:`dq`'s format codes.
DQ_FORMAT = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 1, "Q4_K": 2, "Q5_K": 2, "Q6_K": 3}


def dq(args, u0, u1):  # noqa: ANN001, ANN201
    """[format (:data:`DQ_FORMAT`), blocks, their rows, bytes a row, flag (Q4_1's minimum,
    Q5_K's fifth bit), rows (int64), out, out's columns]: ``out[i]`` = weight row
    ``rows[i]`` as float32 (the dequantizers of :mod:`vt_cpu.kernels.quant`)."""
    a = carray(ptr_i64(args), 8)
    raw = carray(ptr_u8(a[1]), (a[2], a[3]))
    signed = carray(ptr_i8(a[1]), (a[2], a[3]))
    rows = carray(ptr_i64(a[5]), u1)[u0:]
    out = carray(ptr_f32(a[6]), (u1, a[7]))[u0:]
    f = a[0]
    if f == 0:
        Q.dq_q8_0(signed, raw, rows, out)
    elif f == 1:
        Q.dq_q4(raw, rows, out, a[4] != 0)
    elif f == 2:
        Q.dq_qk45(raw, rows, out, a[4] != 0)
    else:
        Q.dq_q6_k(raw, signed, rows, out)


_JOBS: dict[str, Callable[..., Any]] = {
    "dq": dq,
    "attn_prep": attn_prep,
    "gather": gather,
    "attn_scores": attn_scores,
    "attn_values": attn_values,
    "quant8": quant8, "quant16": quant16, "rms_norm": rms_norm, "silu_mul": silu_mul,
    "rope_kv": rope_kv,
    "multi": multi,
    "q8_16": q8_16, "q8_8": q8_8, "mm_q8_0": mm_q8_0, "mm_q4": mm_q4, "mm_qk45": mm_qk45,
    "mm_q6_k": mm_q6_k,
}  # fmt: skip
#: The tile job of each weight format.
MM_JOB = {"Q8_0": "mm_q8_0", "Q4_0": "mm_q4", "Q4_1": "mm_q4", "Q4_K": "mm_qk45",
          "Q5_K": "mm_qk45", "Q6_K": "mm_q6_k"}  # fmt: skip
_compiled: dict[str, int] = {}
_numba_jobs: dict[str, Any] = {}  # what numba compiled, kept alive for its code
_lock = threading.Lock()


def address(name: str) -> int:
    """The C address of job ``name``: mapped from its saved object code
    (:mod:`vt_cpu.native`), else compiled (or loaded) by numba on first use and saved."""
    got = _compiled.get(name)
    if got is None:
        with _lock:
            got = _compiled.get(name)
            if got is None:
                got = _compiled[name] = native.load(name) or _numba_job(name)
    return got


def _numba_job(name: str) -> int:
    # The numba-level helpers are compiled inline into each job, with the job's
    # fast-math flags: none where the kernel rounds as numpy does.
    kw = _EXACT if name in ("rope_kv", "silu_mul") else _KW
    init_numba_runtime()
    # numba's cache knows a job by this file alone, so after a change to the kernels it
    # inlines (q8.py, quant.py, ...) it would load the old code; vt's saved objects are
    # keyed by every kernel source, so where they are used a missing one is compiled anew.
    kw = {**kw, "cache": not native.supported()}
    compiled = _numba_jobs[name] = cfunc(SIGNATURE, **kw)(_JOBS[name])
    native.save(name, compiled)
    return int(compiled.address)


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def q8_args(fmt_id: int, raw: np.ndarray, xq: np.ndarray, xd: np.ndarray, xi: np.ndarray,
            out: np.ndarray, res: np.ndarray | None) -> tuple[np.ndarray, int]:  # fmt: skip
    """The argument block of a ``q8_*`` job and its units (groups of 4 weight rows)."""
    n, rows = out.shape
    r = out if res is None else res
    for arr in (raw, xq, xd, xi, out, r):
        assert arr.flags.c_contiguous, "a job's arrays are C-contiguous"
    a = np.array(
        [fmt_id, _addr(raw), raw.shape[0], raw.shape[1], _addr(xq), n, xq.shape[1], _addr(xd),
         xd.shape[1], _addr(xi), xi.shape[1], _addr(out), rows, _addr(r), res is not None],
        np.int64,
    )  # fmt: skip
    return a, (rows + 3) // 4


def mm_args(kind: str, raw: np.ndarray, xb: np.ndarray, tgt: np.ndarray, out: np.ndarray,
            res: np.ndarray | None) -> tuple[np.ndarray, int]:  # fmt: skip
    """The argument block of the tile job of format ``kind`` and its units. ``xb`` is the
    activations as ``[n, k / 32, 32]``; ``tgt`` is where the products go (``out`` without
    a residual, else a scratch of ``out``'s shape)."""
    n, rows = out.shape
    r = out if res is None else res
    for arr in (raw, xb, tgt, out, r):
        assert arr.flags.c_contiguous, "a job's arrays are C-contiguous"
    tile8 = n >= Q.MM8_MIN_ROWS
    flag = kind in ("Q4_1", "Q5_K")
    a = np.array(
        [flag, _addr(raw), raw.shape[0], raw.shape[1], _addr(xb), n, xb.shape[1], _addr(tgt),
         rows, _addr(r), _addr(out), res is not None, tile8],
        np.int64,
    )  # fmt: skip
    return a, (rows + 1) // 2 if tile8 else (rows + 3) // 4


class Job:
    """A bound job: job ``name`` over ``units`` with its argument block ``args``, after
    the jobs of ``pre`` (each run alone, in order, first: the activations' quantization).
    ``status``: a word the job sets to a nonzero code on bad input (or None)."""

    __slots__ = ("pre", "name", "args", "units", "status", "_keep")

    def __init__(self, pre: tuple[Job, ...], name: str, args: np.ndarray, units: int,
                 keep: tuple[Any, ...], status: np.ndarray | None = None) -> None:  # fmt: skip
        self.pre = pre
        self.name = name
        self.args = args
        self.units = units
        self.status = status
        self._keep = keep  # the arrays args points into

    @property
    def address(self) -> int:
        return address(self.name)


def quant_job(x: np.ndarray, xq: np.ndarray, xd: np.ndarray, xi: np.ndarray,
              layout: int) -> Job:  # fmt: skip
    """:func:`vt_cpu.kernels.q8.quantize_rows` of ``x`` into ``(xq, xd, xi)`` as a job
    (``layout`` 2: :func:`vt_cpu.kernels.q8.quantize_rows_k`)."""
    for arr in (x, xq, xd, xi):
        assert arr.flags.c_contiguous, "a job's arrays are C-contiguous"
    n, k = x.shape
    args = np.array(
        [_addr(x), n, k, _addr(xq), xq.shape[1], _addr(xd), xd.shape[1], _addr(xi),
         xi.shape[1], layout],
        np.int64,
    )  # fmt: skip
    name = "quant16" if xq.dtype == np.uint8 else "quant8"
    return Job((), name, args, n, (x, xq, xd, xi))


def q8_job(weight: Any, x: np.ndarray, out: np.ndarray, res: np.ndarray | None, bits: int,
           shared: dict[int, tuple[np.ndarray, ...]] | None = None) -> Job:  # fmt: skip
    """``out = x @ w.T (+ res)`` with ``bits``-bit activations (8 or 16) as a job, for a
    :class:`vt_cpu.weights.BlockWeight` of a format with :mod:`vt_cpu.kernels.q8` kernels.
    Jobs over the same ``x`` given the same ``shared`` dict quantize it once: the first of
    each activation layout (the nibble formats interleave it, the K-quants take it per 256
    values) has the quantization as its ``pre``, the others reuse its result."""
    n, k = x.shape
    raw = weight.arrays[0] if weight.kind == "Q6_K" else weight.arrays[-1]
    fid = Q8.FMT_ID[weight.kind]
    lay = Q8.layout(fid)
    pre: tuple[Job, ...] = ()
    if shared is not None and lay in shared:
        xq, xd, xi = shared[lay]
    else:
        xq, xd, xi = Q8.scratch(n, k, bits, lay == 2)
        if shared is not None:
            shared[lay] = (xq, xd, xi)
        pre = (quant_job(x, xq, xd, xi, lay),)
    args, units = q8_args(fid, raw, xq, xd, xi, out, res)
    return Job(pre, "q8_16" if bits == 16 else "q8_8", args, units, (x, xq, xd, xi, out))


def multi_job(parts: list[Job]) -> Job:
    """Several jobs as one (``multi``): their units one after the other, so the team posts
    and waits once (Q, K and V; gate and up). Each part's ``pre`` runs first, in order."""
    if len(parts) == 1:
        return parts[0]
    args = np.array([len(parts)] + [v for p in parts for v in (p.address, int(p.args.ctypes.data),
                                                               p.units)], np.int64)  # fmt: skip
    pre = tuple(j for p in parts for j in p.pre)
    return Job(pre, "multi", args, sum(p.units for p in parts), tuple(parts))


def rms_norm_job(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> Job:
    """``out = rms_norm(x) * w`` (:func:`vt_cpu.kernels.layers.rms_norm`) as a job."""
    n, dim = x.shape
    e = np.array([eps], np.float32)
    args = np.array([_addr(x), n, dim, _addr(w), _addr(e), _addr(out)], np.int64)
    return Job((), "rms_norm", args, n, (x, w, e, out))


def silu_mul_job(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> Job:
    """``out = silu(gate) * up`` (:func:`vt_cpu.kernels.layers.silu_mul`) as a job."""
    n, dim = gate.shape
    args = np.array([_addr(gate), _addr(up), _addr(out), n, dim], np.int64)
    return Job((), "silu_mul", args, n, (gate, up, out))


def gather_job(x: np.ndarray, rows: np.ndarray, out: np.ndarray) -> Job:
    """``out[i] = x[rows[i]]`` as a job; a row out of range leaves ``1 + i`` in ``status``."""
    status = np.zeros(1, np.int64)
    args = np.array([_addr(x), x.shape[0], x.shape[1], _addr(rows), _addr(out), _addr(status)],
                    np.int64)  # fmt: skip
    return Job((), "gather", args, rows.shape[0], (x, rows, out), status)


def rope_job(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
             slots: np.ndarray, cache: np.ndarray, layer: int, n_heads: int, cos: np.ndarray,
             sin: np.ndarray, neox: bool) -> Job:  # fmt: skip
    """RoPE of ``q`` and ``k`` by the tables ``cos``, ``sin`` (``[max_len, head_dim / 2]``)
    and the KV store (:func:`vt_cpu.kernels.layers.rope_kv_rows`) as a job; a bad position
    or slot leaves its code in ``status``."""
    n = q.shape[0]
    status = np.zeros(1, np.int64)
    args = np.array(
        [_addr(q), n, q.shape[1], _addr(k), k.shape[1], _addr(v), _addr(positions),
         _addr(slots), _addr(cache), *cache.shape[:3], cache.shape[4], cache.shape[5], layer,
         n_heads, _addr(cos), _addr(sin), neox, _addr(status)],
        np.int64,
    )  # fmt: skip
    keep = (q, k, v, positions, slots, cache, cos, sin)
    return Job((), "rope_kv", args, n, keep, status)


def mm_job(kind: str, raw: np.ndarray, x: np.ndarray, out: np.ndarray,
           res: np.ndarray | None) -> Job:  # fmt: skip
    """``out = x @ w.T (+ res)`` on the tile kernels of format ``kind`` (blocks ``raw``, the
    uint8 view) as a job; ``x`` C-contiguous, of as many rows as the tile kernels take."""
    xb = x.reshape(x.shape[0], -1, 32)
    tgt = out if res is None else np.empty_like(out)
    args, units = mm_args(kind, raw, xb, tgt, out, res)
    keep = (xb, tgt, out) if res is None else (xb, tgt, out, res)
    return Job((), MM_JOB[kind], args, units, keep)


class AttentionJobs:
    """Decode attention for fixed rows as three jobs over the packed scores in ``buf``
    (room for ``n_heads * max_len`` scores a row): ``attn_prep`` (one unit), then the scores
    and the values over ``n * n_kv`` units; a bad position or slot leaves its code in
    ``status``, and ``starts[n]`` holds the scores' size once ``attn_prep`` ran."""

    def __init__(self, q: np.ndarray, cache: np.ndarray, layer: int, slots: np.ndarray,
                 positions: np.ndarray, n_heads: int, scale: float, maxes: np.ndarray,
                 out: np.ndarray, buf: np.ndarray) -> None:  # fmt: skip
        n, width = q.shape
        self.starts = np.zeros(n + 1, np.int64)
        self.scale = np.array([scale], np.float32)
        self.status = np.zeros(1, np.int64)
        for arr in (q, cache, slots, positions, maxes, out, buf):
            assert arr.flags.c_contiguous, "a job's arrays are C-contiguous"
        assert buf.size >= n * n_heads * cache.shape[0], "room for the longest context"
        self.args = np.array(
            [n, width, _addr(q), _addr(cache), *cache.shape[:3], cache.shape[4],
             cache.shape[5], _addr(slots), _addr(positions), _addr(buf), buf.size, _addr(maxes),
             maxes.size, _addr(self.starts), _addr(self.scale), layer, n_heads, _addr(out),
             _addr(self.status)],
            np.int64,
        )  # fmt: skip
        self.units = n * int(cache.shape[4])
        self._keep = (q, cache, slots, positions, maxes, out, buf)

    @property
    def size_address(self) -> int:
        """The address of ``starts[n]``: the scores' size (after ``attn_prep``)."""
        return _addr(self.starts) + 8 * (self.starts.size - 1)

    def jobs(self) -> tuple[Job, Job, Job]:
        keep = (self.starts, self.scale, self.status, self._keep)
        return (Job((), "attn_prep", self.args, 1, keep, self.status),
                Job((), "attn_scores", self.args, self.units, keep),
                Job((), "attn_values", self.args, self.units, keep))  # fmt: skip
