"""Plugin hooks. A backend distribution exposes a module in entry-point group ``vt``.

The module implements :func:`vt_register_backends` (simonw/llm's register-callback
pattern)::

    from vt import hookimpl

    @hookimpl
    def vt_register_backends(register):
        register(MyBackend)
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

PROJECT = "vt"
ENTRY_POINT_GROUP = "vt"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class VtHookSpecs:
    """The hooks a vt plugin may implement."""

    @hookspec
    def vt_register_backends(self, register: Callable[[type], None]) -> None:
        """Call ``register(BackendClass)`` once for each backend this plugin provides."""
