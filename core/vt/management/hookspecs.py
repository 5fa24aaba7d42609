"""The hooks a vt plugin may implement (simonw/llm's ``hookspecs.py``).

A backend distribution exposes a module in entry-point group ``vt`` that implements
:func:`vt_register_backends`, llm's register-callback pattern::

    from vt import hookimpl

    @hookimpl
    def vt_register_backends(register):
        register(MyBackend)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pluggy import HookimplMarker, HookspecMarker

if TYPE_CHECKING:
    from collections.abc import Callable

#: The pluggy project name, and the entry-point group plugins are found in.
PROJECT = "vt"
ENTRY_POINT_GROUP = "vt"

hookspec = HookspecMarker(PROJECT)
hookimpl = HookimplMarker(PROJECT)


@hookspec
def vt_register_backends(register: Callable[[type], None]) -> None:
    """Call ``register(BackendClass)`` once for each backend this plugin provides."""
