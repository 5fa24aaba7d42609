"""Entry point of the Tenstorrent stub plugin (entry-point group ``vt``)."""

from __future__ import annotations

from collections.abc import Callable

from vt import hookimpl

from .backend import TtStubBackend


@hookimpl
def vt_register_backends(register: Callable[[type], None]) -> None:
    register(TtStubBackend)
