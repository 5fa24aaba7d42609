"""CPU backends for the VMM arena and KV cache tests: failure injection and aliasing.

They override the protocol's hooks (``_map_physical``, ``_vmm_unmap``, ...), never the
public methods, so the core's argument checks still run first.
"""

from __future__ import annotations

import errno
import os

import vt
from vt_cpu.backend import CpuBackend

KiB = 1 << 10


class InjectingCpu(CpuBackend):
    """The real CPU backend (memfd segments) with failure injection and bookkeeping.

    ``granularity`` is this instance's VMM granularity, declared and used (the plain
    backend reads ``VT_CPU_VMM_GRANULARITY``; these helpers need one per instance).
    """

    def __init__(self, granularity: int = 4 * KiB, *, declare_alias: bool = False) -> None:
        super().__init__()
        self.granularity = granularity
        caps = vt.VmmCaps(granularity=granularity, segments_may_alias=declare_alias)
        self.capabilities = self.capabilities.with_value(
            "vmm", caps, vt.Source.declared, f"test backend: granularity {granularity}"
        )
        self.unmapped: list[int] = []  # segment offsets, in unmap order
        self.released_ranges = 0
        self.freed = 0
        self.fail_maps = 0
        self.fail_releases = 0

    def _vmm_granularity(self) -> int:
        super()._vmm_granularity()  # refuses where the OS has no memfd_create
        return self.granularity

    def _map_physical(self, addr: int, nbytes: int, fd: int) -> None:
        if self.fail_maps:
            self.fail_maps -= 1
            raise OSError(errno.ENOMEM, "injected: out of physical memory")
        super()._map_physical(addr, nbytes, fd)

    def _vmm_unmap(self, vrange: vt.VirtualRange, segment: vt.Segment) -> None:
        super()._vmm_unmap(vrange, segment)
        self.unmapped.append(segment.offset)

    def _vmm_release(self, vrange: vt.VirtualRange) -> None:
        if self.fail_releases:
            self.fail_releases -= 1
            raise OSError(errno.EBUSY, "injected: address free failed")
        super()._vmm_release(vrange)
        self.released_ranges += 1

    def _free(self, buf: vt.Buffer) -> None:
        super()._free(buf)
        self.freed += 1


class AliasingCpu(InjectingCpu):
    """Every new segment maps the first segment's physical memory (the Windows ROCm bug)."""

    def __init__(self, granularity: int = 4 * KiB, **kwargs: bool) -> None:
        super().__init__(granularity, **kwargs)
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
