"""A liar for vt's tests: ``host_view`` returns a stale copy.

Built as docs/plugins.md says, from ``vt``'s public API and numpy: the example backend
(numpy memory, synchronous streams, the reference ops), except that its own copies and ops
reach the memory through the ``_bytes`` hook, while ``_host_view`` hands out a snapshot
taken the first time a range was viewed. The probe still declares host-addressable
memory, so the runner would read sampled ids and write inputs through a copy: writes lost,
later results unseen. ``vt run`` must refuse it at open: probe ``host-view-roundtrip``.
"""

from __future__ import annotations

import numpy as np
import vt
from vt.reference import HostMemory, ReferenceOps


class LiarStaleViewBackend(HostMemory, ReferenceOps, vt.HostAddressable):
    name = "liar-stale-view"
    priority = -20
    description = "numpy memory whose host_view is a stale copy (a liar, for vt's tests)"

    @classmethod
    def probe(cls) -> vt.Probe:
        facts = vt.Capabilities(unified_memory=True, device_memory_is_host_addressable=True)
        return vt.Probe(available=True, capabilities=facts, device="host numpy")

    def __init__(self) -> None:
        self._snapshots: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _alloc(self, nbytes: int) -> vt.Buffer:
        return vt.Buffer(np.zeros(nbytes, np.uint8), nbytes, owner=self.name)

    def _free(self, buf: vt.Buffer) -> None:
        pass

    def _bytes(self, buf: vt.Buffer) -> np.ndarray:
        # The real memory, for the copies, memsets and ops of vt.reference's mixins.
        return buf.handle[buf.offset : buf.offset + buf.nbytes]

    def _host_view(self, buf: vt.Buffer) -> np.ndarray:
        # THE LIE: a copy, taken once per range and handed out again ever after.
        key = (id(buf.handle), buf.offset, buf.nbytes)
        if key not in self._snapshots:  # the memory is kept alive with its snapshot
            self._snapshots[key] = (buf.handle, self._bytes(buf).copy())
        return self._snapshots[key][1]

    def _create_stream(self, name: str) -> vt.Stream:
        return vt.Stream(None, name)

    def _destroy_stream(self, stream: vt.Stream) -> None:
        pass

    def _synchronize(self, stream: vt.Stream) -> None:
        pass


@vt.hookimpl
def vt_register_backends(register):
    register(LiarStaleViewBackend)
