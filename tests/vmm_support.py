"""CPU backends for the VMM arena and KV cache tests: failure injection and aliasing."""

from __future__ import annotations

import errno
import os

import vt
from vt_cpu.backend import CpuBackend

KiB = 1 << 10


class InjectingCpu(CpuBackend):
    """The real CPU backend (memfd segments) with failure injection and bookkeeping."""

    def __init__(self, granularity: int = 4 * KiB, *, declare_alias: bool = False) -> None:
        super().__init__(vmm_granularity=granularity)
        if declare_alias:
            caps = vt.VmmCaps(granularity=granularity, segments_may_alias=True)
            self.capabilities = self.capabilities.model_copy(update={"vmm": caps})
        self.unmapped: list[int] = []  # segment offsets, in unmap order
        self.released_ranges = 0
        self.freed = 0
        self.fail_maps = 0
        self.fail_releases = 0

    def _map_physical(self, addr: int, nbytes: int, fd: int) -> None:
        if self.fail_maps:
            self.fail_maps -= 1
            raise OSError(errno.ENOMEM, "injected: out of physical memory")
        super()._map_physical(addr, nbytes, fd)

    def vmm_unmap(self, vrange: vt.VirtualRange, segment: vt.Segment) -> None:
        super().vmm_unmap(vrange, segment)
        self.unmapped.append(segment.offset)

    def vmm_release(self, vrange: vt.VirtualRange) -> None:
        if self.fail_releases:
            self.fail_releases -= 1
            raise OSError(errno.EBUSY, "injected: address free failed")
        super().vmm_release(vrange)
        self.released_ranges += 1

    def free(self, buf: vt.Buffer) -> None:
        super().free(buf)
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
