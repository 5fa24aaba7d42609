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

F32, I32 = np.dtype(np.float32), np.dtype(np.int32)


class OffByOneNormBackend(CpuBackend):
    """rms_norm's mean of squares leaves out the last element of each row."""

    name = "offbyone-norm"
    priority = -100
    description = "cpu with an off-by-one rms_norm (kit fault)"

    def rms_norm(
        self, out: vt.Buffer, x: vt.Buffer, weight: vt.Weight, n: int, dim: int, eps: float,
        stream: vt.Stream,
    ) -> None:  # fmt: skip
        w = self._weight(weight)
        xv = self._array(x, F32, (n, dim), "rms_norm x")
        o = self._array(out, F32, (n, dim), "rms_norm out")

        def run() -> None:
            head = xv[:, : dim - 1]  # the bug: range(dim - 1)
            ms = np.einsum("ij,ij->i", head, head) / np.float32(dim)
            scale = (1.0 / np.sqrt(ms + np.float32(eps))).astype(F32)
            np.multiply(xv, scale[:, None], out=o)
            np.multiply(o, w, out=o)

        self._launch(stream, "rms_norm", run)


class OffByOneAttentionBackend(CpuBackend):
    """attention stops one position short: a row never attends to its own position."""

    name = "offbyone-attention"
    priority = -100
    description = "cpu whose attention drops the last position (kit fault)"

    def attention(
        self, out: vt.Buffer, q: vt.Buffer, cache: vt.Buffer, layout: vt.KVLayout, layer: int,
        slots: vt.Buffer, positions: vt.Buffer, n: int, n_heads: int, scale: float,
        stream: vt.Stream,
    ) -> None:  # fmt: skip
        row = (n, n_heads * layout.head_dim)
        qv = self._array(q, F32, row, "attention q")
        o = self._array(out, F32, row, "attention out")
        c = self._array(cache, F32, layout.shape, "attention cache")
        s = self._array(slots, I32, (n,), "attention slots")
        p = self._array(positions, I32, (n,), "attention positions")

        def run() -> None:
            short = np.maximum(p - 1, 0)  # the bug: attends to 0..pos-1
            K.attention(qv, c, layout, layer, s, short, n_heads, scale, out=o)

        self._launch(stream, "attention", run)


class NoopEventsBackend(CpuBackend):
    """Declares events (inherited), but every event is complete the moment it exists."""

    name = "noop-events"
    priority = -100
    description = "cpu whose events are no-ops while it declares them (kit fault)"

    def create_event(self) -> vt.Event:
        return vt.Event("noop")

    def destroy_event(self, event: vt.Event) -> None:
        pass

    def record_event(self, event: vt.Event, stream: vt.Stream) -> None:
        pass

    def query_event(self, event: vt.Event) -> bool:
        return True

    def synchronize_event(self, event: vt.Event) -> None:
        pass

    def stream_wait_event(self, stream: vt.Stream, event: vt.Event) -> None:
        pass


class AliasPinnedBackend(CpuBackend):
    """Pinned memory is a device allocation, handed back to the device pool at once, so
    the next device allocation that fits gets the same memory."""

    name = "alias-pinned"
    priority = -100
    description = "cpu whose pinned memory is (and aliases) device memory (kit fault)"

    def __init__(self, vmm_granularity: int | None = None) -> None:
        super().__init__(vmm_granularity)
        self._pool: list[vt.Buffer] = []

    def alloc(self, nbytes: int) -> vt.Buffer:
        for i, buf in enumerate(self._pool):
            if buf.nbytes >= nbytes:
                del self._pool[i]
                return vt.Buffer(buf.handle, nbytes, buf.offset, self.name)
        return super().alloc(nbytes)

    def alloc_pinned(self, nbytes: int) -> vt.HostBuffer:
        buf = super().alloc(nbytes)
        self._pool.append(buf)  # the bug: released while still in use as pinned memory
        return vt.HostBuffer(self.host_view(buf), handle=buf, pinned=True)

    def free_pinned(self, buf: vt.HostBuffer) -> None:
        pass


class OutOfBoundsAddBackend(CpuBackend):
    """add writes one float past the end of its output (a loop bound of n + 1)."""

    name = "oob-add"
    priority = -100
    description = "cpu whose add writes past its output (kit fault)"

    def add(self, out: vt.Buffer, a: vt.Buffer, b: vt.Buffer, n: int, stream: vt.Stream) -> None:
        av = self._array(a, F32, (n,), "add a")
        bv = self._array(b, F32, (n,), "add b")
        # the bug: the raw allocation, n + 1 elements, bypassing the size check
        o = self._mem(out)[out.offset : out.offset + 4 * (n + 1)].view(F32)

        def run() -> None:
            np.add(av, bv, out=o[:n])
            o[n] = o[n - 1]

        self._launch(stream, "add", run)


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
