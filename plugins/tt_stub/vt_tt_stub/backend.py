"""A Tenstorrent stand-in that runs on the host but keeps discrete-device semantics.

Its memory is opaque (buffers and weights hide their host arrays), ``host_view`` raises,
data moves only by explicit copies, and it declares no events, no pinned memory, no async
readback and no VMM: the opposite corner of the capability space from the CPU backend, so
the runner's synchronous path stays honest. Work runs synchronously, in call order. It
implements only the primitive ops, so every fused op runs as its decomposition here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import vt
from vt.reference import HostMemory, ReferenceOps


class _DeviceMemory:
    """An allocation on the emulated device; the host array behind it is private."""

    __slots__ = ("_array",)

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __repr__(self) -> str:
        return f"<tt_stub device memory, {self._array.nbytes} bytes>"


class _DeviceWeight(_DeviceMemory):
    def __repr__(self) -> str:
        return f"<tt_stub device weight {self._array.shape}>"


class _TtStream:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class TtStubBackend(HostMemory, ReferenceOps):
    """Emulated Tenstorrent device: discrete, synchronous, no host access."""

    name = "tt_stub"
    priority = 0
    emulated = True  # auto never picks it: only `--backend tt_stub`
    description = "emulated Tenstorrent stub on the host: discrete memory, no host access"
    reference_ops = vt.PRIMITIVE_OPS

    @classmethod
    def probe(cls) -> vt.Probe:
        # Physical facts: discrete memory, nothing host-addressable, no VMM (all defaults).
        return vt.Probe(
            available=True,
            reason="emulated stub: no Tenstorrent hardware is used; kernels run on the host "
            "with numpy behind discrete-device semantics",
            capabilities=vt.Capabilities(),
            device="emulated Tenstorrent stub (host numpy)",
        )

    # ---- memory: opaque handles
    def _alloc(self, nbytes: int) -> vt.Buffer:
        return vt.Buffer(_DeviceMemory(np.zeros(nbytes, dtype=np.uint8)), nbytes, 0, self.name)

    def _free(self, buf: vt.Buffer) -> None:
        self._bytes(buf)

    def _bytes(self, buf: vt.Buffer) -> np.ndarray:
        if type(buf.handle) is not _DeviceMemory:
            raise ValueError(f"buffer of backend {buf.owner!r} is not tt_stub device memory")
        return buf.handle._array[buf.offset : buf.offset + buf.nbytes]

    def _wrap_weight(self, array: np.ndarray) -> Any:
        return _DeviceWeight(array)

    def _weight_array(self, weight: vt.Weight) -> np.ndarray:
        if not isinstance(weight.handle, _DeviceWeight):
            raise ValueError(f"weight {weight.name!r} was not uploaded to tt_stub")
        return weight.handle._array

    def _free_weight(self, weight: vt.Weight) -> None:
        self._weight_array(weight)  # refuses a weight of another backend

    # ---- streams: in-order, synchronous
    def enqueue_host(self, stream: vt.Stream, name: str, fn: Callable[[], Any]) -> None:
        if not isinstance(stream.handle, _TtStream):
            raise ValueError(f"stream {stream.name!r} is not a tt_stub stream")
        fn()

    def _create_stream(self, name: str) -> vt.Stream:
        return vt.Stream(_TtStream(name), name)

    def _destroy_stream(self, stream: vt.Stream) -> None:
        pass

    def _synchronize(self, stream: vt.Stream) -> None:
        pass  # work ran when it was enqueued
