"""vt's Tenstorrent stub: an emulated discrete device running on the host."""

from __future__ import annotations

from .backend import TtStubBackend

__all__ = ["TtStubBackend"]
