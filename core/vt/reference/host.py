"""Mixins that give a backend the reference implementation over host numpy memory.

- :class:`ReferenceOps`: every op of :data:`vt.protocol.ops.OPS` (or the ones named in
  ``reference_ops``) runs its :mod:`vt.reference` implementation, and weights are
  dequantized to float32 at upload. A host-addressable backend takes it as it is (arrays
  come from ``host_view``); another backend overrides ``_bytes`` to say where a buffer's
  bytes live.
- :class:`HostMemory`: the copies and memsets of a backend whose memory is numpy arrays.

Both enqueue their numpy work with :meth:`vt.Backend.enqueue_host`, so it runs in stream
order; arguments were already checked by the core when the work is enqueued.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import numpy as np

from ..protocol.backend import Backend
from ..protocol.handles import Buffer, HostBuffer, Stream, Tensor, Weight, WeightTensor
from ..protocol.ops import OPS, get_op
from .quant import dequantize


class HostMemory(Backend):
    """Copies and memsets over numpy memory. Hooks: ``_bytes`` and ``_before_sync``."""

    def _bytes(self, buf: Buffer) -> np.ndarray:
        """The uint8 numpy array of exactly ``buf``'s bytes."""
        return self.host_view(buf)

    def _before_sync(self) -> None:
        """Called before a synchronous copy or memset touches memory (wait for streams)."""

    def _memset(self, buf: Buffer, value: int, stream: Stream | None) -> None:
        mem = self._bytes(buf)
        if stream is None:
            self._before_sync()
            mem.fill(value)
        else:
            self.enqueue_host(stream, "memset", partial(mem.fill, value))

    def _copy_h2d(self, dst: Buffer, src: np.ndarray) -> None:
        view = self._bytes(dst)[: src.nbytes]
        self._before_sync()
        view[...] = src

    def _copy_d2h(self, dst: np.ndarray, src: Buffer) -> None:
        view = self._bytes(src)[: dst.nbytes]
        self._before_sync()
        dst[...] = view

    def _copy_h2d_async(self, dst: Buffer, src: np.ndarray, stream: Stream) -> None:
        view = self._bytes(dst)[: src.nbytes]
        self.enqueue_host(stream, "copy_h2d_async", partial(np.copyto, view, src))

    def _copy_d2h_async(self, dst: HostBuffer, src: Buffer, stream: Stream) -> None:
        data = dst.array.reshape(-1).view(np.uint8)
        view = self._bytes(src)[: data.nbytes]
        self.enqueue_host(stream, "copy_d2h_async", partial(np.copyto, data, view))

    def _copy_d2d(self, dst: Buffer, src: Buffer, nbytes: int, stream: Stream) -> None:
        d, s = self._bytes(dst)[:nbytes], self._bytes(src)[:nbytes]
        self.enqueue_host(stream, "copy_d2d", partial(np.copyto, d, s))


class ReferenceOps(Backend):
    """The reference implementation of the ops, on numpy views of the backend's memory.

    ``reference_ops`` names the ops taken from the reference (all of them by default);
    an ``op_<name>`` method of the class wins over the reference. Weights are dequantized
    once to float32 at upload (exact and simple; 4 bytes per parameter).
    """

    reference_ops: ClassVar[tuple[str, ...]] = tuple(OPS)

    # ---- hooks
    def _bytes(self, buf: Buffer) -> np.ndarray:
        """The uint8 numpy array of exactly ``buf``'s bytes (``host_view`` by default)."""
        return self.host_view(buf)

    def _wrap_weight(self, array: np.ndarray) -> Any:
        """The :attr:`vt.Weight.handle` for a dequantized float32 array."""
        return array

    def _weight_array(self, weight: Weight) -> np.ndarray:
        """The float32 array behind a weight handle."""
        return weight.handle

    # ---- weights
    def _upload_weight(self, tensor: WeightTensor) -> Weight:
        array = dequantize(tensor)
        array.setflags(write=False)
        return Weight(tensor.name, tuple(array.shape), self._wrap_weight(array), tensor.ggml_type)

    # ---- ops
    @classmethod
    def op_names(cls) -> tuple[str, ...]:
        own = set(super().op_names())
        return tuple(n for n in OPS if n in own or n in cls.reference_ops)

    def supports(self, op: str, dtype: str | None = None) -> bool:
        get_op(op)
        return op in self.reference_ops or super().supports(op, dtype)

    def __getattr__(self, attr: str) -> Callable[..., None]:
        # op_<name> for the reference ops the class does not implement itself.
        if attr.startswith("op_") and attr[3:] in type(self).reference_ops:
            return partial(self._run_reference, attr[3:])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")

    def _array(self, t: Tensor) -> np.ndarray:
        return self._bytes(t.buffer)[: t.nbytes].view(t.dtype).reshape(t.shape)

    def _run_reference(self, op: str, stream: Stream, **args: Any) -> None:
        arrays: dict[str, Any] = {}
        for key, value in args.items():
            if isinstance(value, Tensor):
                arrays[key] = self._array(value)
            elif isinstance(value, Weight):
                arrays[key] = self._weight_array(value)
            else:
                arrays[key] = value
        self.enqueue_host(stream, op, partial(OPS[op].reference, arrays))
