"""Transition shim: the hookspecs moved to :mod:`vt.hookspecs`. Delete this module once
``vt.registry`` reads ``from . import hookspecs`` and ``add_hookspecs(hookspecs)``."""

from __future__ import annotations

from . import hookspecs as VtHookSpecs  # noqa: N812 - pluggy takes the module as the spec
from .hookspecs import ENTRY_POINT_GROUP, PROJECT, hookimpl, hookspec

__all__ = ["ENTRY_POINT_GROUP", "PROJECT", "VtHookSpecs", "hookimpl", "hookspec"]
