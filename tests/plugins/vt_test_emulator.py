"""An emulated backend with the highest priority: auto must still never pick it."""

from __future__ import annotations

import vt


class FakeChip(vt.Backend):
    name = "fakechip"
    priority = 500
    emulated = True


@vt.hookimpl
def vt_register_backends(register):
    register(FakeChip)
