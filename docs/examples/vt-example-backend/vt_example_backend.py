"""A minimal vt backend that runs models: device memory is numpy memory, streams are
synchronous, and every op comes from vt's reference implementation.

It imports only ``vt`` (and numpy). Its probe declares the physical facts: unified,
host-addressable memory. It implements no events, pinned memory, async copies or VMM, so
vt derives those as absent and the runner synchronizes streams instead.
``vt audit --backend example`` proves that; ``vt run --backend example`` runs a model.
"""

from __future__ import annotations

import numpy as np
import vt
from vt.reference import HostMemory, ReferenceOps


class ExampleBackend(HostMemory, ReferenceOps, vt.HostAddressable):
    name = "example"
    priority = -10  # never preferred by `auto` over a real backend
    description = "numpy memory, synchronous streams, reference ops (vt-example-backend)"

    @classmethod
    def probe(cls) -> vt.Probe:
        facts = vt.Capabilities(unified_memory=True, device_memory_is_host_addressable=True)
        return vt.Probe(available=True, capabilities=facts, device="host numpy")

    # ---- memory: a Buffer's handle is a uint8 numpy array (vt checked the arguments)
    def _alloc(self, nbytes: int) -> vt.Buffer:
        return vt.Buffer(np.zeros(nbytes, np.uint8), nbytes, owner=self.name)

    def _free(self, buf: vt.Buffer) -> None:
        pass  # numpy frees it

    def _host_view(self, buf: vt.Buffer) -> np.ndarray:
        return buf.handle[buf.offset : buf.offset + buf.nbytes]

    # ---- streams: work runs when it is enqueued, so there is nothing to wait for
    def _create_stream(self, name: str) -> vt.Stream:
        return vt.Stream(None, name)

    def _destroy_stream(self, stream: vt.Stream) -> None:
        pass

    def _synchronize(self, stream: vt.Stream) -> None:
        pass


@vt.hookimpl
def vt_register_backends(register):
    register(ExampleBackend)
