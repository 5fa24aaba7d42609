"""Entry point of the CUDA plugin. Importing it never imports cuda-python: probe() does."""

from __future__ import annotations

from collections.abc import Callable

from vt import hookimpl

from .backend import CudaBackend


@hookimpl
def vt_register_backends(register: Callable[[type], None]) -> None:
    register(CudaBackend)
