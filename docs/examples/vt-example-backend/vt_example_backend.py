"""A minimal vt backend: device memory is numpy memory, and every stream is synchronous.

It imports only ``vt`` (and numpy). It declares exactly what it implements: unified,
host-addressable memory. No events, so the runner synchronizes streams instead; no pinned
memory, no async copies, no VMM. ``vt audit --backend example`` proves that.
"""

from __future__ import annotations

import numpy as np
import vt


class ExampleBackend(vt.Backend):
    name = "example"
    priority = -10  # never preferred by `auto` over a real backend
    description = "numpy memory, synchronous streams (vt-example-backend)"
    capabilities = vt.Capabilities(unified_memory=True, device_memory_is_host_addressable=True)

    @classmethod
    def probe(cls) -> vt.Probe:
        return vt.Probe(available=True, capabilities=cls.capabilities, device="host numpy")

    # ---- memory: a Buffer's handle is a uint8 numpy array
    def alloc(self, nbytes: int) -> vt.Buffer:
        return vt.Buffer(np.zeros(nbytes, np.uint8), nbytes, owner=self.name)

    def free(self, buf: vt.Buffer) -> None:
        pass  # numpy frees it

    def host_view(self, buf: vt.Buffer) -> np.ndarray:
        return buf.handle[buf.offset : buf.offset + buf.nbytes]

    def memset(self, buf: vt.Buffer, value: int, stream: vt.Stream | None = None) -> None:
        self.host_view(buf).fill(value)

    def copy_h2d(self, dst: vt.Buffer, src: np.ndarray) -> None:
        raw = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        self.host_view(dst)[: raw.size] = raw

    def copy_d2h(self, dst: np.ndarray, src: vt.Buffer) -> None:
        dst.reshape(-1).view(np.uint8)[:] = self.host_view(src)[: dst.nbytes]

    def copy_h2d_async(self, dst: vt.Buffer, src, stream: vt.Stream) -> None:
        self.copy_h2d(dst, src.array if isinstance(src, vt.HostBuffer) else src)

    def copy_d2d(self, dst: vt.Buffer, src: vt.Buffer, nbytes: int, stream: vt.Stream) -> None:
        self.host_view(dst)[:nbytes] = self.host_view(src)[:nbytes]

    # ---- streams: work runs when it is enqueued, so there is nothing to wait for
    def create_stream(self, name: str = "") -> vt.Stream:
        return vt.Stream(None, name)

    def destroy_stream(self, stream: vt.Stream) -> None:
        pass

    def synchronize(self, stream: vt.Stream) -> None:
        pass


@vt.hookimpl
def vt_register_backends(register):
    register(ExampleBackend)
