"""Weights in their file's block formats, and the matmuls and row gathers over them.

:func:`upload` keeps a matrix as it is stored: its blocks, scales included, stay where
they are (a read-only view of the tensor's bytes, for a model file the mmapped file
itself; the kernels decode the float16 scales as they read them). Float matrices stay in
their type (F16 and BF16 are widened tile by tile when used). Vectors (norms, biases) are
float32 arrays.

A :class:`BlockWeight` runs ``out = x @ w.T (+ res)`` two ways:

- :meth:`BlockWeight.matvec`: the numba kernels of :mod:`vt_cpu.kernels.quant`, reading
  each block once for all rows of ``x`` (decode: one row per sequence), the row kernels
  for one row and the tile kernels (a block dequantized once per 4 rows) for several;
- :meth:`BlockWeight.tiled`: dequantize a tile of weight rows to float32 and multiply it
  with BLAS (prefill: many rows of ``x``), tile by tile, so the matrix is never expanded
  as a whole.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import vt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from vt.reference import dequantize

from .kernels import jobs as J
from .kernels import quant as Q
from .kernels.team import entries

F32 = np.float32
T = GGMLQuantizationType

#: Weight types kept in blocks (matrices); anything else is refused by the reference's
#: dequantize with its message.
BLOCK_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"})
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})

#: Activation rows from which :meth:`BlockWeight.bind` runs the tile kernels (``mm_*``:
#: each block dequantized once per 4 activation rows) instead of the row kernels
#: (``mv_*``: once per row). Measured, one thread, 1536x768 (``docs/benchmarks.md``).
MM_MIN_ROWS: dict[str, int] = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 2, "Q4_K": 3, "Q5_K": 2, "Q6_K": 2}

#: Weights dequantized per BLAS tile in :meth:`BlockWeight.tiled` (at most; a matrix has
#: at least :data:`TILES_MIN` tiles, so two threads share it). A tile of 2^17 had 16 rows
#: of a 1B model's down projection (8192 columns), too few for BLAS to run well: 2^19 with
#: at least four tiles a matrix measured prefill +9% on SmolLM2-135M and +16% on the 1B
#: shape (Q4_K) against 2^17 (docs/benchmarks.md).
TILE_ELEMENTS = 1 << 19
TILES_MIN = 4


_local = threading.local()


def _dq_block() -> tuple[np.ndarray, int]:
    """The calling thread's argument block for the ``dq`` job, and its address."""
    got = getattr(_local, "dq", None)
    if got is None:
        block = np.zeros(8, np.int64)
        got = _local.dq = (block, block.ctypes.data)
    return got


#: ``0, 1, ..., m - 1`` (int64) and its address; the arrays it replaced (a thread may
#: still read one: they are never freed; each at most half the next).
_numbers: tuple[np.ndarray, int] = (np.zeros(0, np.int64), 0)
_replaced: list[np.ndarray] = []
_numbers_lock = threading.Lock()


def _row_numbers(n: int) -> int:
    """The address of ``0, 1, ..., m - 1`` for some ``m >= n``: every tile's row numbers
    (``address + 8 * r0``), from one array that grows to the largest matrix's rows."""
    global _numbers
    if _numbers[0].shape[0] < n:
        with _numbers_lock:
            if _numbers[0].shape[0] < n:
                arange = np.arange(max(n, 2 * _numbers[0].shape[0]), dtype=np.int64)
                _replaced.append(_numbers[0])
                _numbers = (arange, arange.ctypes.data)
    return _numbers[1]


@dataclass(eq=False)
class BlockWeight:
    """A ``[rows, cols]`` matrix in format ``kind``; ``arrays`` are the kernel's operands."""

    kind: str
    rows: int
    cols: int
    arrays: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays if isinstance(a, np.ndarray))

    # ---- decode: numba matrix-vector kernels
    def bind(
        self, x: np.ndarray, out: np.ndarray, res: np.ndarray | None
    ) -> tuple[Callable[[], Any], Callable[[int], Any]]:
        """``(serial, parallel)`` computing ``out = x @ w.T`` (``+ res`` when given; ``res``
        may be ``out``): ``serial()`` on the calling thread alone, ``parallel(n)`` over n of
        numba's threads. The views and the kernel are bound once (a captured graph replays
        the same closures), so a call is one numba dispatch."""
        add = res is not None
        r = res if res is not None else out
        a, k = self.arrays, self.kind
        if k in FLOAT_TYPES:
            run = partial(self.tiled, x, out, res)
            return run, lambda _n: run()
        xb = x.reshape(x.shape[0], -1, 32)
        args: tuple[Any, ...] = (*a, xb, out, r, add)
        one, par, tail = self.kernels(x.shape[0])
        return partial(one, *args, *tail), lambda n: par(*args, n, *tail)

    def job(self, x: np.ndarray, out: np.ndarray, res: np.ndarray | None) -> J.Job | None:
        """:meth:`bind`'s work as a team job (:mod:`vt_cpu.kernels.jobs`) where it runs the
        tile kernels; None for the row kernels and float weights (they keep numba's pool)."""
        k = self.kind
        if k not in J.MM_JOB or x.shape[0] < MM_MIN_ROWS[k] or not x.flags.c_contiguous:
            return None
        raw = self.arrays[0] if k == "Q6_K" else self.arrays[-1]
        return J.mm_job(k, raw, x, out, res)

    def kernels(self, n: int) -> tuple[Callable[..., Any], Callable[..., Any], tuple[Any, ...]]:
        """``(serial, parallel, flags)``: the kernels for ``n`` activation rows — the row
        kernels (``mv_*``) below :data:`MM_MIN_ROWS`, else the tile kernels (``mm_*``)."""
        k = self.kind
        tile = n >= MM_MIN_ROWS[k]
        if k == "Q8_0":
            return (Q.mm1_q8_0, Q.mm_q8_0, ()) if tile else (Q.mv1_q8_0, Q.mv_q8_0, ())
        if k in ("Q4_0", "Q4_1"):
            flags = (k == "Q4_1",)
            return (Q.mm1_q4, Q.mm_q4, flags) if tile else (Q.mv1_q4, Q.mv_q4, flags)
        if k in ("Q4_K", "Q5_K"):
            flags = (k == "Q5_K",)
            return (Q.mm1_qk45, Q.mm_qk45, flags) if tile else (Q.mv1_qk45, Q.mv_qk45, flags)
        return (Q.mm1_q6_k, Q.mm_q6_k, ()) if tile else (Q.mv1_q6_k, Q.mv_q6_k, ())

    def matvec(
        self, x: np.ndarray, out: np.ndarray, res: np.ndarray | None, nchunk: int = 1
    ) -> None:
        """``out = x @ w.T (+ res)`` now, on ``nchunk`` threads (1: no thread pool)."""
        serial, parallel = self.bind(x, out, res)
        if nchunk <= 1:
            serial()
        else:
            parallel(nchunk)

    # ---- rows as float32
    def dequantize_rows(self, rows: np.ndarray, out: np.ndarray) -> None:
        """``out[i] = w[rows[i]]`` as float32 (``rows`` int64, in range)."""
        a, k = self.arrays, self.kind
        if k in J.DQ_FORMAT and rows.flags.c_contiguous and out.flags.c_contiguous:
            self._dq(rows.ctypes.data, rows.shape[0], out)
            return
        if k == "F32":
            np.take(a[0], rows, axis=0, out=out)
        elif k == "F16":
            out[...] = a[0][rows]
        elif k == "BF16":
            out.view(np.uint32)[...] = a[0][rows].astype(np.uint32) << 16
        elif k == "Q8_0":
            Q.dq_q8_0(a[0], a[1], rows, out)
        elif k in ("Q4_0", "Q4_1"):
            Q.dq_q4(a[0], rows, out, k == "Q4_1")
        elif k in ("Q4_K", "Q5_K"):
            Q.dq_qk45(a[0], rows, out, k == "Q5_K")
        else:
            Q.dq_q6_k(a[0], a[1], rows, out)

    def _dq(self, rows_at: int, n: int, out: np.ndarray) -> None:
        """The ``dq`` job over ``n`` rows (int64, at ``rows_at``) into ``out``: a C function
        that never builds numba's target (:mod:`vt_cpu.native`), its argument block the
        calling thread's own."""
        head = self.__dict__.get("_dq_head")
        if head is None:
            raw = self.arrays[1] if self.kind == "Q8_0" else self.arrays[0]  # uint8 blocks
            flag = self.kind in ("Q4_1", "Q5_K")
            head = (J.DQ_FORMAT[self.kind], raw.ctypes.data, *raw.shape, flag)
            self.__dict__["_dq_head"] = head
        args, at = _dq_block()
        args[:5] = head
        args[5], args[6], args[7] = rows_at, out.ctypes.data, out.shape[1]
        entries().run_alone(J.address("dq"), at, n)

    def tile_rows(self) -> int:
        per = min(TILE_ELEMENTS // max(1, self.cols), -(-self.rows // TILES_MIN))
        return max(16, min(self.rows, per))

    def tile(self, r0: int, r1: int, scratch: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[r0, r1)`` as float32 (a view for F32)."""
        if self.kind == "F32":
            return self.arrays[0][r0:r1]
        out = scratch[: r1 - r0] if scratch is not None else np.empty((r1 - r0, self.cols), F32)
        if self.kind not in J.DQ_FORMAT:
            self.dequantize_rows(np.arange(r0, r1, dtype=np.int64), out)
            return out
        self._dq(_row_numbers(r1) + 8 * r0, r1 - r0, out)
        return out

    # ---- prefill: BLAS on dequantized tiles
    def tiled(
        self,
        x: np.ndarray,
        out: np.ndarray,
        res: np.ndarray | None,
        tiles: Callable[[int, Callable[[int, int], None]], None] | None = None,
    ) -> None:
        """``out = x @ w.T (+ res)`` tile by tile; ``tiles(n_rows_per_tile, fn)`` may run
        ``fn(r0, r1)`` for the tiles on several threads (default: in order, here)."""
        step = self.tile_rows()

        def run(r0: int, r1: int) -> None:
            w = self.tile(r0, r1)
            part = x @ w.T
            if res is not None:
                part += res[:, r0:r1]
            out[:, r0:r1] = part

        if tiles is None:
            for r0 in range(0, self.rows, step):
                run(r0, min(self.rows, r0 + step))
        else:
            tiles(step, run)


def upload(tensor: vt.WeightTensor) -> BlockWeight | np.ndarray:
    """A matrix as a :class:`BlockWeight` over the tensor's own bytes; a vector (or a
    tensor of another rank) as a float32 array."""
    shape = tuple(int(s) for s in tensor.shape)
    try:
        kind = T(tensor.ggml_type).name
    except ValueError:
        kind = ""
    if len(shape) != 2 or kind not in BLOCK_TYPES | FLOAT_TYPES:
        array = dequantize(tensor)  # refuses an unsupported type by name
        array.setflags(write=False)
        return array
    rows, cols = shape
    block, block_bytes = GGML_QUANT_SIZES[T(tensor.ggml_type)]
    data = np.asarray(tensor.data)
    if data.dtype != np.uint8 or not data.flags.c_contiguous:
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    need = rows * (cols // block) * block_bytes
    if cols % block or data.nbytes != need:
        dequantize(tensor)  # raises the reference's ModelError, naming the tensor
        raise vt.ModelError(f"tensor {tensor.name!r}: {kind} of shape {shape} has bad size")
    raw = data.reshape(-1).view()
    raw.setflags(write=False)  # one numba signature, whatever the source
    if kind in FLOAT_TYPES:
        dtype = {"F32": F32, "F16": np.float16, "BF16": np.uint16}[kind]
        return BlockWeight(kind, rows, cols, (raw.view(dtype).reshape(rows, cols),))
    blocks = raw.reshape(rows * (cols // block), block_bytes)
    if kind == "Q8_0":  # the int8 quants and the uint8 bytes of the scales: one memory
        arrays: tuple[Any, ...] = (blocks.view(np.int8), blocks)
    elif kind == "Q6_K":  # [ql 128, qh 64, scales 16 (int8), d]
        arrays = (blocks, blocks.view(np.int8))
    else:
        arrays = (blocks,)
    return BlockWeight(kind, rows, cols, arrays)
