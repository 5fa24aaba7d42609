"""Thin libc wrappers for real virtual memory on Linux: reserve, commit, decommit, release.

A reservation is address space only (``PROT_NONE``, ``MAP_NORESERVE``): nothing is committed.
Physical memory is a memfd mapped ``MAP_SHARED | MAP_FIXED`` over part of the reservation,
so committed memory grows only with what is mapped (and, lazily, what is touched).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

PROT_NONE, PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
MAP_SHARED, MAP_PRIVATE, MAP_ANONYMOUS = mmap.MAP_SHARED, mmap.MAP_PRIVATE, mmap.MAP_ANONYMOUS
MAP_FIXED, MAP_NORESERVE = 0x10, 0x4000  # Linux values (not exported by the mmap module)
PAGE_SIZE = mmap.PAGESIZE

#: Real VMM needs memfd_create and Linux mmap flags.
SUPPORTED = sys.platform.startswith("linux") and hasattr(os, "memfd_create")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
for _fn in (_libc.munmap, _libc.mlock, _libc.munlock):
    _fn.restype = ctypes.c_int
    _fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def _mmap(addr: int | None, nbytes: int, prot: int, flags: int, fd: int = -1) -> int:
    got = _libc.mmap(addr, nbytes, prot, flags, fd, 0)
    if got is None or got == _MAP_FAILED:
        raise _os_error(f"mmap of {nbytes} bytes")
    return int(got)


def reserve(nbytes: int) -> int:
    """Reserve ``nbytes`` of address space, committing nothing; returns the base address."""
    return _mmap(None, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)


def map_fd(addr: int, nbytes: int, fd: int) -> None:
    """Map the first ``nbytes`` of ``fd`` read-write at exactly ``addr`` (inside a reservation)."""
    if _mmap(addr, nbytes, PROT_RW, MAP_SHARED | MAP_FIXED, fd) != addr:
        raise OSError(f"mmap MAP_FIXED did not land at {addr:#x}")


def decommit(addr: int, nbytes: int) -> None:
    """Put inaccessible, uncommitted address space back over ``[addr, addr + nbytes)``."""
    flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED
    if _mmap(addr, nbytes, PROT_NONE, flags) != addr:
        raise OSError(f"mmap MAP_FIXED did not land at {addr:#x}")


def release(addr: int, nbytes: int) -> None:
    """Give the address range back to the system."""
    if _libc.munmap(addr, nbytes) != 0:
        raise _os_error(f"munmap of {nbytes} bytes at {addr:#x}")


def lock(addr: int, nbytes: int) -> bool:
    """Try to page-lock ``[addr, addr + nbytes)``; False when RLIMIT_MEMLOCK refuses."""
    return nbytes > 0 and _libc.mlock(addr, nbytes) == 0


def unlock(addr: int, nbytes: int) -> None:
    _libc.munlock(addr, nbytes)


class AddressArray:
    """Exposes ``nbytes`` at ``addr`` to numpy (``np.asarray(AddressArray(...))``).

    The resulting array keeps this object (and whatever it references) alive.
    """

    def __init__(self, addr: int, nbytes: int, owner: object = None) -> None:
        self.owner = owner
        self.__array_interface__ = {
            "data": (addr, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
