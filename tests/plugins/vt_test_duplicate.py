"""A plugin that registers a second backend named 'threads'."""

from __future__ import annotations

import vt


class OtherThreads(vt.Backend):
    name = "threads"


@vt.hookimpl
def vt_register_backends(register):
    register(OtherThreads)
