"""A liar for vt's tests: VMM segments that alias (the Windows ROCm 7.2 bug), on Linux.

Built as docs/plugins.md says, from ``vt``'s public API and numpy (plus the standard
library's ``ctypes`` for ``mmap``): the example backend's numpy memory and synchronous
streams, the reference ops, and real virtual memory through ``vt.VirtualMemory``. A
reservation is address space (``PROT_NONE``); each mapped segment is shared memory mapped
``MAP_FIXED`` into it. The lie: every segment of a reservation maps the *same* physical
pages (offset 0 of one memfd), while the probe declares ``segments_may_alias=False``. A KV
cache grown segment by segment would overwrite its own beginning (issue 8: a 100-token
answer turned into "slice-slice-slice..."). ``vt run`` must refuse it at open: probe
``vmm-segments-distinct``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import vt
from vt.reference import HostMemory, ReferenceOps

SUPPORTED = sys.platform.startswith("linux") and hasattr(os, "memfd_create")
GRANULARITY = 64 << 10
PROT_NONE, MAP_FIXED, MAP_NORESERVE = 0, 0x10, 0x4000  # Linux; the mmap module lacks them
_RW = mmap.PROT_READ | mmap.PROT_WRITE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)  # fmt: skip
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def _mmap(addr: int | None, nbytes: int, prot: int, flags: int, fd: int = -1) -> int:
    got = _libc.mmap(addr, nbytes, prot, flags, fd, 0)
    if got is None or got == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), f"mmap of {nbytes} bytes failed")
    return int(got)


def _inaccessible(addr: int | None, nbytes: int) -> int:
    """Reserve (or, at ``addr``, give back) address space that commits nothing."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    return _mmap(addr, nbytes, PROT_NONE, flags | (MAP_FIXED if addr else 0))


class _At:
    """``nbytes`` at ``addr`` for numpy (``np.asarray(_At(...))`` keeps ``owner`` alive)."""

    def __init__(self, addr: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__array_interface__ = {"data": (addr, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}  # fmt: skip


@dataclass(eq=False)
class _Reservation:
    base: int
    nbytes: int
    fd: int = -1  # the one memfd every segment maps: THE LIE
    segments: list[vt.Segment] = field(default_factory=list)
    array: np.ndarray | None = None


class LiarVmmAliasBackend(HostMemory, ReferenceOps, vt.HostAddressable, vt.VirtualMemory):
    name = "liar-vmm-alias"
    priority = -20
    description = "numpy memory whose VMM segments alias (a liar, for vt's tests)"

    @classmethod
    def probe(cls) -> vt.Probe:
        if not SUPPORTED:
            return vt.Probe(available=False, reason="needs Linux (memfd_create, MAP_FIXED)")
        facts = vt.Capabilities(
            unified_memory=True,
            device_memory_is_host_addressable=True,
            vmm=vt.VmmCaps(granularity=GRANULARITY, segments_may_alias=False),  # false
        )
        return vt.Probe(available=True, capabilities=facts, device="host numpy, mmap")

    # ---- memory and streams, as in the example backend
    def _alloc(self, nbytes: int) -> vt.Buffer:
        return vt.Buffer(np.zeros(nbytes, np.uint8), nbytes, owner=self.name)

    def _free(self, buf: vt.Buffer) -> None:
        pass

    def _host_view(self, buf: vt.Buffer) -> np.ndarray:
        return buf.handle[buf.offset : buf.offset + buf.nbytes]

    def _create_stream(self, name: str) -> vt.Stream:
        return vt.Stream(None, name)

    def _destroy_stream(self, stream: vt.Stream) -> None:
        pass

    def _synchronize(self, stream: vt.Stream) -> None:
        pass

    # ---- virtual memory
    def _vmm_granularity(self) -> int:
        return GRANULARITY

    def _vmm_reserve(self, nbytes: int) -> vt.VirtualRange:
        if nbytes % GRANULARITY:
            raise vt.VmmError(f"vmm_reserve: {nbytes} is not a multiple of {GRANULARITY}")
        return vt.VirtualRange(_Reservation(_inaccessible(None, nbytes), nbytes), nbytes)

    def _vmm_map(self, vrange: vt.VirtualRange, offset: int, nbytes: int) -> vt.Segment:
        r: _Reservation = vrange.handle
        end = offset + nbytes
        if offset % GRANULARITY or nbytes % GRANULARITY or not nbytes or end > r.nbytes:
            raise vt.VmmError(f"vmm_map: bad segment [{offset}, {end}) of {r.nbytes} bytes")
        if any(s.offset < end and offset < s.offset + s.nbytes for s in r.segments):
            raise vt.VmmError(f"vmm_map: [{offset}, {end}) overlaps a mapped segment")
        if r.fd < 0:
            r.fd = os.memfd_create("liar-vmm-alias", os.MFD_CLOEXEC)
        if os.fstat(r.fd).st_size < nbytes:
            os.ftruncate(r.fd, nbytes)  # never map past the file's end (SIGBUS)
        # Every segment maps the memfd from its offset 0: the segments share pages.
        _mmap(r.base + offset, nbytes, _RW, mmap.MAP_SHARED | MAP_FIXED, r.fd)
        segment = vt.Segment(None, offset, nbytes)
        r.segments.append(segment)
        return segment

    def _vmm_unmap(self, vrange: vt.VirtualRange, segment: vt.Segment) -> None:
        r: _Reservation = vrange.handle
        if segment not in r.segments:
            raise vt.VmmError("vmm_unmap: that segment is not mapped here")
        _inaccessible(r.base + segment.offset, segment.nbytes)
        r.segments.remove(segment)

    def _vmm_release(self, vrange: vt.VirtualRange) -> None:
        r: _Reservation = vrange.handle
        if r.segments:
            raise vt.VmmError(f"vmm_release: {len(r.segments)} segment(s) are still mapped")
        if r.nbytes:
            r.array = None
            _libc.munmap(r.base, r.nbytes)
            r.nbytes = 0
        if r.fd >= 0:
            os.close(r.fd)
            r.fd = -1

    def _vmm_buffer(self, vrange: vt.VirtualRange) -> vt.Buffer:
        r: _Reservation = vrange.handle
        if r.array is None:
            r.array = np.asarray(_At(r.base, r.nbytes, r))
        return vt.Buffer(r.array, vrange.nbytes, owner=self.name)


@vt.hookimpl
def vt_register_backends(register):
    register(LiarVmmAliasBackend)
