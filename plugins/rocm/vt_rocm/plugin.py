"""Entry point of the ROCm plugin. Importing it never imports hip-python: probe() does."""

from __future__ import annotations

from collections.abc import Callable

from vt import hookimpl

from .backend import RocmBackend


@hookimpl
def vt_register_backends(register: Callable[[type], None]) -> None:
    register(RocmBackend)
