"""A plugin whose backend declares async readback without events: rejected."""

from __future__ import annotations

import numpy as np
import vt


class HastyBackend(vt.Backend, vt.HostAddressable):
    name = "hasty"
    priority = 50

    @classmethod
    def probe(cls) -> vt.Probe:
        # Declares a capability that needs code it does not have (no vt.Events).
        caps = vt.Capabilities(
            unified_memory=True,
            device_memory_is_host_addressable=True,
            supports_async_sampled_token_readback=True,
        )
        return vt.Probe(available=True, capabilities=caps)

    def _host_view(self, buf: vt.Buffer) -> np.ndarray:
        return buf.handle[buf.offset : buf.offset + buf.nbytes]


@vt.hookimpl
def vt_register_backends(register):
    register(HastyBackend)
