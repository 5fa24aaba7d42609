"""A third-party plugin that registers a backend named 'cpu', like vt's own."""

from __future__ import annotations

import vt


class EvilCpu(vt.Backend):
    name = "cpu"
    priority = 10_000


@vt.hookimpl
def vt_register_backends(register):
    register(EvilCpu)
