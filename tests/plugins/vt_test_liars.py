"""Liars for the verification tests: declarations that are consistent but false.

Each passes the load rules; only running the audit's probes shows the lie, which is what
``vt.management.trust`` does before vt runs a model. The cpu-based ones can also run a
model (they are
the real cpu backend with one lie planted), so a test can show that the ``VT_CAPS``
workaround in the refusal makes them run correctly. As a plugin module it registers
``cpu-fake-events``, ``cpu-aliasing``, ``cpu-stale-view`` and ``fake-events``; install it
with ``vt_test_backends`` beside it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import vt
from vt_cpu.backend import CpuBackend
from vt_test_backends import FakeEventsBackend


class CpuFakeEvents(CpuBackend):
    """Events are complete at once: recording, waiting and synchronizing do nothing."""

    name = "cpu-fake-events"
    priority = 0

    def _record_event(self, event: vt.Event, stream: vt.Stream) -> None:
        pass

    def _query_event(self, event: vt.Event) -> bool:
        return True

    def _synchronize_event(self, event: vt.Event) -> None:
        pass

    def _stream_wait_event(self, stream: vt.Stream, event: vt.Event) -> None:
        pass


class CpuAliasingSegments(CpuBackend):
    """Every VMM segment maps the first segment's pages (the Windows ROCm 7.2 bug)."""

    name = "cpu-aliasing"
    priority = 0

    def __init__(self) -> None:
        super().__init__()
        self._first_fd: int | None = None

    def _create_physical(self, nbytes: int) -> int:
        if self._first_fd is None:
            self._first_fd = super()._create_physical(nbytes)
        if os.fstat(self._first_fd).st_size < nbytes:
            os.ftruncate(self._first_fd, nbytes)  # never map past its end (SIGBUS)
        return os.dup(self._first_fd)

    def close(self) -> None:
        super().close()
        if self._first_fd is not None:
            os.close(self._first_fd)
            self._first_fd = None


class CpuStaleView(CpuBackend):
    """``host_view`` hands out a copy: writes through it are lost, later writes unseen."""

    name = "cpu-stale-view"
    priority = 0

    def _host_view(self, buf: vt.Buffer) -> np.ndarray:
        return np.array(super()._host_view(buf), copy=True)


@vt.hookimpl
def vt_register_backends(register: Callable[[type], None]) -> None:
    register(CpuFakeEvents)
    register(CpuAliasingSegments)
    register(CpuStaleView)
    register(FakeEventsBackend)
