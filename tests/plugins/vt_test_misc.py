"""Backends whose probe raises or reports the hardware missing."""

from __future__ import annotations

import vt


class FlakyBackend(vt.Backend):
    name = "flaky"

    @classmethod
    def probe(cls) -> vt.Probe:
        raise OSError("device node /dev/flaky0 vanished")


class AbsentBackend(vt.Backend):
    name = "absent"
    priority = 1000

    @classmethod
    def probe(cls) -> vt.Probe:
        return vt.Probe(available=False, reason="no absent device found (driver not loaded)")


@vt.hookimpl
def vt_register_backends(register):
    register(FlakyBackend)
    register(AbsentBackend)
