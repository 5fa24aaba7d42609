"""The :class:`vt.Backend` memory and kernel methods over host numpy memory.

A backend whose memory is numpy arrays (the CPU backend, the TT stub) subclasses
:class:`HostKernels` and supplies three hooks: where a buffer's bytes live (``_mem``), how
work is enqueued on a stream (``_launch``), and what a synchronous copy waits for first
(``_before_sync``). Views and size checks happen on the host at enqueue time, so a bad
argument raises at the call site; the numpy work itself runs when the stream reaches it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ..backend import (
    SAMPLE_PARAMS_DTYPE,
    Backend,
    Buffer,
    HostBuffer,
    KVLayout,
    RopeParams,
    Stream,
    Weight,
    WeightTensor,
)
from . import kernels as K
from .quant import dequantize
from .sampling import sample as _sample

U8, I32, F32 = np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.float32)


def _host_bytes(src: np.ndarray | HostBuffer, what: str) -> np.ndarray:
    arr = src.array if isinstance(src, HostBuffer) else np.asarray(src)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: host array must be C-contiguous")
    return arr.reshape(-1).view(np.uint8)


class HostKernels(Backend):
    """Protocol copies and kernels that run :mod:`vt.reference` on host numpy memory.

    Weights are dequantized once to float32 at upload (simple and exact; it costs 4 bytes
    per parameter, e.g. about 540 MB for a 135M-parameter model).
    """

    # ---- hooks a subclass provides
    def _mem(self, buf: Buffer) -> np.ndarray:
        """The uint8 numpy array of the whole allocation behind ``buf``."""
        raise NotImplementedError

    def _launch(self, stream: Stream, op: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` in order on ``stream`` (``op`` names it in errors)."""
        raise NotImplementedError

    def _before_sync(self) -> None:
        """Called before a synchronous copy or memset touches memory."""

    def _wrap_weight(self, array: np.ndarray) -> Any:
        """The :attr:`Weight.handle` for a dequantized float32 array."""
        return array

    def _weight(self, weight: Weight) -> np.ndarray:
        """The float32 array behind a weight handle."""
        if weight.handle is None:
            raise ValueError(f"weight {weight.name!r} was freed")
        return weight.handle

    # ---- helpers
    def _array(self, buf: Buffer, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
        """A ``dtype`` view of ``shape`` at the start of ``buf``; checks that it fits."""
        nbytes = dtype.itemsize * math.prod(shape)
        if nbytes > buf.nbytes:
            raise ValueError(
                f"{self.name} {what}: needs {nbytes} bytes for shape {shape} of {dtype}, "
                f"the buffer has {buf.nbytes}"
            )
        return self._mem(buf)[buf.offset : buf.offset + nbytes].view(dtype).reshape(shape)

    # ---- memory
    def memset(self, buf: Buffer, value: int, stream: Stream | None = None) -> None:
        if not 0 <= value <= 255:
            raise ValueError(f"memset: value {value} is not a byte")
        mem = self._array(buf, U8, (buf.nbytes,), "memset")
        if stream is None:
            self._before_sync()
            mem.fill(value)
        else:
            self._launch(stream, "memset", partial(mem.fill, value))

    def copy_h2d(self, dst: Buffer, src: np.ndarray) -> None:
        data = _host_bytes(src, "copy_h2d")
        view = self._array(dst, U8, (data.shape[0],), "copy_h2d dst")
        self._before_sync()
        view[...] = data

    def copy_d2h(self, dst: np.ndarray, src: Buffer) -> None:
        if not dst.flags.writeable:
            raise ValueError("copy_d2h: destination array is read-only")
        data = _host_bytes(dst, "copy_d2h")
        view = self._array(src, U8, (data.shape[0],), "copy_d2h src")
        self._before_sync()
        data[...] = view

    def copy_h2d_async(self, dst: Buffer, src: HostBuffer | np.ndarray, stream: Stream) -> None:
        data = _host_bytes(src, "copy_h2d_async")
        view = self._array(dst, U8, (data.shape[0],), "copy_h2d_async dst")
        self._launch(stream, "copy_h2d_async", partial(np.copyto, view, data))

    def copy_d2h_async(self, dst: HostBuffer, src: Buffer, stream: Stream) -> None:
        data = _host_bytes(dst, "copy_d2h_async")
        view = self._array(src, U8, (data.shape[0],), "copy_d2h_async src")
        self._launch(stream, "copy_d2h_async", partial(np.copyto, data, view))

    def copy_d2d(self, dst: Buffer, src: Buffer, nbytes: int, stream: Stream) -> None:
        d = self._array(dst, U8, (nbytes,), "copy_d2d dst")
        s = self._array(src, U8, (nbytes,), "copy_d2d src")
        self._launch(stream, "copy_d2d", partial(np.copyto, d, s))

    # ---- kernels
    def upload_weight(self, tensor: WeightTensor) -> Weight:
        array = dequantize(tensor)
        array.setflags(write=False)
        return Weight(tensor.name, tuple(array.shape), self._wrap_weight(array), tensor.ggml_type)

    def free_weight(self, weight: Weight) -> None:
        """Let go of the weight's array (idempotent).

        The handle is cleared because the :class:`Weight` object itself often outlives the
        free (a closed runner still holds its graph): keeping the handle would keep the
        dequantized float32 copy alive with it.
        """
        if weight.handle is not None:
            self._weight(weight)  # refuses a weight of another backend
            weight.handle = None

    def embedding(self, out: Buffer, table: Weight, ids: Buffer, n: int, stream: Stream) -> None:
        t = self._weight(table)
        i = self._array(ids, I32, (n,), "embedding ids")
        o = self._array(out, F32, (n, t.shape[1]), "embedding out")
        self._launch(stream, "embedding", partial(K.embedding, t, i, out=o))

    def rms_norm(
        self, out: Buffer, x: Buffer, weight: Weight, n: int, dim: int, eps: float, stream: Stream
    ) -> None:
        w = self._weight(weight)
        if w.shape != (dim,):
            raise ValueError(f"rms_norm: weight {weight.name!r} has shape {w.shape}, not ({dim},)")
        xv = self._array(x, F32, (n, dim), "rms_norm x")
        o = self._array(out, F32, (n, dim), "rms_norm out")
        self._launch(stream, "rms_norm", partial(K.rms_norm, xv, w, eps, out=o))

    def matmul(
        self,
        out: Buffer,
        x: Buffer,
        weight: Weight,
        n: int,
        stream: Stream,
        bias: Weight | None = None,
    ) -> None:
        w = self._weight(weight)
        out_f, in_f = w.shape
        b = None if bias is None else self._weight(bias)
        if b is not None and b.shape != (out_f,):
            raise ValueError(f"matmul: bias {bias.name!r} has shape {b.shape}, not ({out_f},)")
        xv = self._array(x, F32, (n, in_f), "matmul x")
        o = self._array(out, F32, (n, out_f), "matmul out")
        self._launch(stream, "matmul", partial(K.matmul, xv, w, b, out=o))

    def rope(
        self,
        x: Buffer,
        positions: Buffer,
        n: int,
        n_heads: int,
        params: RopeParams,
        stream: Stream,
    ) -> None:
        xv = self._array(x, F32, (n, n_heads * params.head_dim), "rope x")
        pos = self._array(positions, I32, (n,), "rope positions")
        self._launch(stream, "rope", partial(K.rope, xv, pos, n_heads, params, out=xv))

    def kv_store(
        self,
        cache: Buffer,
        layout: KVLayout,
        layer: int,
        k: Buffer,
        v: Buffer,
        slots: Buffer,
        positions: Buffer,
        n: int,
        stream: Stream,
    ) -> None:
        c = self._array(cache, F32, layout.shape, "kv_store cache")
        row = (n, layout.n_kv_heads * layout.head_dim)
        kv = self._array(k, F32, row, "kv_store k"), self._array(v, F32, row, "kv_store v")
        s = self._array(slots, I32, (n,), "kv_store slots")
        p = self._array(positions, I32, (n,), "kv_store positions")
        self._launch(stream, "kv_store", partial(K.kv_store, c, layer, *kv, s, p))

    def attention(
        self,
        out: Buffer,
        q: Buffer,
        cache: Buffer,
        layout: KVLayout,
        layer: int,
        slots: Buffer,
        positions: Buffer,
        n: int,
        n_heads: int,
        scale: float,
        stream: Stream,
    ) -> None:
        row = (n, n_heads * layout.head_dim)
        qv = self._array(q, F32, row, "attention q")
        o = self._array(out, F32, row, "attention out")
        c = self._array(cache, F32, layout.shape, "attention cache")
        s = self._array(slots, I32, (n,), "attention slots")
        p = self._array(positions, I32, (n,), "attention positions")
        fn = partial(K.attention, qv, c, layout, layer, s, p, n_heads, scale, out=o)
        self._launch(stream, "attention", fn)

    def silu_mul(self, out: Buffer, gate: Buffer, up: Buffer, n: int, stream: Stream) -> None:
        g = self._array(gate, F32, (n,), "silu_mul gate")
        u = self._array(up, F32, (n,), "silu_mul up")
        o = self._array(out, F32, (n,), "silu_mul out")
        self._launch(stream, "silu_mul", partial(K.silu_mul, g, u, out=o))

    def add(self, out: Buffer, a: Buffer, b: Buffer, n: int, stream: Stream) -> None:
        av = self._array(a, F32, (n,), "add a")
        bv = self._array(b, F32, (n,), "add b")
        o = self._array(out, F32, (n,), "add out")
        self._launch(stream, "add", partial(K.add, av, bv, out=o))

    def gather_rows(
        self, out: Buffer, x: Buffer, rows: Buffer, n: int, dim: int, stream: Stream
    ) -> None:
        if dim <= 0:
            raise ValueError(f"gather_rows: dim must be positive, got {dim}")
        xv = self._array(x, F32, (x.nbytes // (4 * dim), dim), "gather_rows x")
        r = self._array(rows, I32, (n,), "gather_rows rows")
        o = self._array(out, F32, (n, dim), "gather_rows out")
        self._launch(stream, "gather_rows", partial(K.gather_rows, xv, r, out=o))

    def sample(
        self,
        out_ids: Buffer,
        logits: Buffer,
        params: Buffer,
        n: int,
        vocab: int,
        stream: Stream,
    ) -> None:
        lv = self._array(logits, F32, (n, vocab), "sample logits")
        pv = self._array(params, SAMPLE_PARAMS_DTYPE, (n,), "sample params")
        o = self._array(out_ids, I32, (n,), "sample out_ids")
        self._launch(stream, "sample", partial(_sample, lv, pv, out=o))
