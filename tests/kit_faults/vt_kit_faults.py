"""Backends with planted faults that vt's conformance kit must catch (vt's own tests).

Each is the cpu backend with one realistic bug. As a plugin module (entry point in group
``vt``) it registers all of them; their priority is negative so ``auto`` never picks one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import vt
from vt.reference import kernels as K
from vt_cpu.backend import CpuBackend

F32 = np.dtype(np.float32)


class OffByOneNormBackend(CpuBackend):
    """rms_norm's mean of squares leaves out the last element of each row."""

    name = "offbyone-norm"
    priority = -100
    description = "cpu with an off-by-one rms_norm (kit fault)"

    def op_rms_norm(
        self, stream: vt.Stream, out: vt.Tensor, x: vt.Tensor, weight: vt.Weight, eps: float
    ) -> None:
        w, xv, o = self._weight_array(weight), self._array(x), self._array(out)
        dim = xv.shape[1]

        def run() -> None:
            head = xv[:, : dim - 1]  # the bug: range(dim - 1)
            ms = np.einsum("ij,ij->i", head, head) / np.float32(dim)
            scale = (1.0 / np.sqrt(ms + np.float32(eps))).astype(F32)
            np.multiply(xv, scale[:, None], out=o)
            np.multiply(o, w, out=o)

        self.enqueue_host(stream, "rms_norm", run)


class OffByOneAttentionBackend(CpuBackend):
    """attention stops one position short: a row never attends to its own position."""

    name = "offbyone-attention"
    priority = -100
    description = "cpu whose attention drops the last position (kit fault)"

    def op_attention(
        self, stream: vt.Stream, out: vt.Tensor, q: vt.Tensor, cache: vt.Tensor,
        slots: vt.Tensor, positions: vt.Tensor, layout: vt.KVLayout, layer: int, n_heads: int,
        scale: float,
    ) -> None:  # fmt: skip
        qv, o, c = self._array(q), self._array(out), self._array(cache)
        s, p = self._array(slots), self._array(positions)

        def run() -> None:
            short = np.maximum(p - 1, 0)  # the bug: attends to 0..pos-1
            K.attention(qv, c, layout, layer, s, short, n_heads, scale, out=o)

        self.enqueue_host(stream, "attention", run)


class NoopEventsBackend(CpuBackend):
    """Implements the events hooks (so it has events), but every event is complete the
    moment it exists."""

    name = "noop-events"
    priority = -100
    description = "cpu whose events are no-ops while it declares them (kit fault)"

    def _create_event(self) -> vt.Event:
        return vt.Event("noop")

    def _destroy_event(self, event: vt.Event) -> None:
        pass

    def _record_event(self, event: vt.Event, stream: vt.Stream) -> None:
        pass

    def _query_event(self, event: vt.Event) -> bool:
        return True

    def _synchronize_event(self, event: vt.Event) -> None:
        pass

    def _stream_wait_event(self, stream: vt.Stream, event: vt.Event) -> None:
        pass


class AliasPinnedBackend(CpuBackend):
    """Pinned memory is a device allocation, handed back to the device pool at once, so
    the next device allocation that fits gets the same memory."""

    name = "alias-pinned"
    priority = -100
    description = "cpu whose pinned memory is (and aliases) device memory (kit fault)"

    def __init__(self) -> None:
        super().__init__()
        self._pool: list[vt.Buffer] = []

    def _alloc(self, nbytes: int) -> vt.Buffer:
        for i, buf in enumerate(self._pool):
            if buf.nbytes >= nbytes:
                del self._pool[i]
                return vt.Buffer(buf.handle, nbytes, buf.offset, self.name)
        return super()._alloc(nbytes)

    def _alloc_pinned(self, nbytes: int) -> vt.HostBuffer:
        buf = super()._alloc(nbytes)
        self._pool.append(buf)  # the bug: released while still in use as pinned memory
        return vt.HostBuffer(self._host_view(buf), handle=buf, pinned=True)

    def _free_pinned(self, buf: vt.HostBuffer) -> None:
        pass


class OutOfBoundsAddBackend(CpuBackend):
    """add writes one float past the end of its output (a loop bound of n + 1)."""

    name = "oob-add"
    priority = -100
    description = "cpu whose add writes past its output (kit fault)"

    def op_add(self, stream: vt.Stream, out: vt.Tensor, a: vt.Tensor, b: vt.Tensor) -> None:
        av, bv = self._array(a), self._array(b)
        n = out.size
        # the bug: the raw allocation, n + 1 elements, past the tensor's own bytes
        buf = out.buffer
        o = self._mem(buf)[buf.offset : buf.offset + 4 * (n + 1)].view(F32)

        def run() -> None:
            np.add(av, bv, out=o[:n].reshape(out.shape))
            o[n] = o[n - 1]

        self.enqueue_host(stream, "add", run)


FAULTS: tuple[type[vt.Backend], ...] = (
    OffByOneNormBackend,
    OffByOneAttentionBackend,
    NoopEventsBackend,
    AliasPinnedBackend,
    OutOfBoundsAddBackend,
)


@vt.hookimpl
def vt_register_backends(register: Callable[[type], None]) -> None:
    for cls in FAULTS:
        register(cls)
