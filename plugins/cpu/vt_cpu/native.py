"""The cpu backend's compiled C functions, mapped by vt from numba's object code.

numba loads a cached function by building its whole CPU target first (typing registries,
its runtime compiled through LLVM) and then linking the object with LLVM: ~40 MiB of a
process for the target and ~26 MiB of libllvmlite's pages for the linking, for about 20
functions that need neither once compiled. So when numba has compiled (or loaded) one of
the backend's C functions (a job of :mod:`vt_cpu.kernels.jobs`, an entry point of the
team), vt saves its object code (x86-64 ELF, large code model) to :func:`cache_dir`; a
later process maps it itself (:class:`Image`): its sections in one anonymous mapping, its
relocations applied, its undefined symbols taken from the process (CPython's API, libc,
libm) and from numba's two C extensions (the helpers numba registers with LLVM), the code
then made read-only and executable. numba's target is then never built on the decode
path.

A saved object is keyed by the kernels' source, the numba, llvmlite and Python versions
and the CPU's name and features (:func:`key`) and carries its sha256; anything that does
not match, cannot be read or fails to map is compiled by numba as before (and saved
again).
``VT_CPU_NATIVE=0`` always uses numba's loader. x86-64 Linux only.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import platform
import struct
import sys
import threading
from pathlib import Path
from typing import Any

import vt

_HERE = Path(__file__).resolve().parent
_MAGIC = b"VTNATIVE1\n"

SHF_WRITE, SHF_ALLOC, SHF_EXECINSTR = 0x1, 0x2, 0x4
SHT_SYMTAB, SHT_RELA, SHT_NOBITS = 2, 4, 8
SHN_UNDEF, SHN_ABS, SHN_COMMON = 0, 0xFFF1, 0xFFF2
R_NONE, R_64, R_PC32, R_PLT32, R_PC64 = 0, 1, 2, 4, 24
_EHDR, _SHDR, _SYM, _RELA = "<16sHHIQQQIHHHHHH", "<IIQQQQIIQQ", "<IBBHQQ", "<QQq"


class NativeError(Exception):
    """An object vt cannot map (its caller falls back to numba)."""


def platform_ok() -> bool:
    """Whether vt can map numba's objects here at all: x86-64 Linux."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def supported() -> bool:
    """Whether this process maps saved objects (:func:`platform_ok`, not turned off by
    ``VT_CPU_NATIVE=0``)."""
    return platform_ok() and bool(vt.envs.get("VT_CPU_NATIVE"))


# --------------------------------------------------------------------------- symbols

_libc = ctypes.CDLL(None, use_errno=True)
_dlsym = _libc.dlsym
_dlsym.restype, _dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
_mprotect = _libc.mprotect
_mprotect.restype = ctypes.c_int
_mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_helpers: dict[str, int] | None = None


def _numba_helpers() -> dict[str, int]:
    """The C functions numba registers with LLVM by name (``numba_*``, ``NRT_*``)."""
    global _helpers
    if _helpers is None:
        from numba import _helperlib
        from numba.core.runtime import _nrt_python

        found = {f"numba_{k}": int(v) for k, v in _helperlib.c_helpers.items()}
        for k, v in _nrt_python.c_helpers.items():
            found[k if k.startswith("_") else f"NRT_{k}"] = int(v)
        _helpers = found
    return _helpers


def resolve(name: str) -> int:
    """The address of an undefined symbol of a saved object."""
    addr = _numba_helpers().get(name)
    if addr is None:
        addr = _dlsym(None, name.encode())  # RTLD_DEFAULT: python, libc, libm
    if not addr:
        raise NativeError(f"undefined symbol {name!r}")
    return int(addr)


# --------------------------------------------------------------------------- the image


def _align(n: int, a: int) -> int:
    return -(-n // max(a, 1)) * max(a, 1)


class Image:
    """One ELF relocatable object mapped into this process; :attr:`symbols` holds the
    addresses of its global definitions. Code and constants are read-only and executable,
    writable sections (and common symbols) on pages of their own. Kept alive by its
    owner: the code is unmapped with it."""

    def __init__(self, data: bytes) -> None:
        try:
            self._map(data)
        except (struct.error, IndexError, ValueError, KeyError, StopIteration) as e:
            raise NativeError(f"not an object vt can map: {e!r}") from e

    def _map(self, data: bytes) -> None:
        eh = struct.unpack_from(_EHDR, data, 0)
        if eh[0][:4] != b"\x7fELF" or eh[0][4] != 2 or eh[0][5] != 1 or eh[1] != 1 or eh[2] != 62:
            raise NativeError("not an x86-64 little-endian relocatable ELF object")
        secs = [struct.unpack_from(_SHDR, data, eh[6] + i * eh[11]) for i in range(eh[12])]
        if any(s[2] & SHF_WRITE and s[2] & SHF_EXECINSTR for s in secs):
            raise NativeError("a section is both writable and executable")
        symtab = next(s for s in secs if s[1] == SHT_SYMTAB)
        strtab = secs[symtab[6]]
        syms = [struct.unpack_from(_SYM, data, symtab[4] + 24 * k) for k in range(symtab[5] // 24)]
        # Read-only sections first, then (from a page boundary) the writable ones.
        place: dict[int, int] = {}
        end = 0
        for writable in (False, True):
            if writable:
                end = _align(end, mmap.PAGESIZE)
                self._ro_end = end
            for i, s in enumerate(secs):
                if s[2] & SHF_ALLOC and s[5] and bool(s[2] & SHF_WRITE) == writable:
                    place[i] = end = _align(end, s[8])
                    end += s[5]
        commons: dict[int, int] = {}
        for k, sym in enumerate(syms):
            if sym[3] == SHN_COMMON:
                commons[k] = end = _align(end, sym[4])
                end += sym[5]
        self.size = _align(max(end, 1), mmap.PAGESIZE)
        self._mem = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE)  # anonymous
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._mem))
        for i, off in place.items():
            s = secs[i]
            if s[1] != SHT_NOBITS:
                self._mem[off : off + s[5]] = data[s[4] : s[4] + s[5]]

        def name(k: int) -> str:
            o = strtab[4] + syms[k][0]
            return data[o : data.index(b"\0", o)].decode()

        def address(k: int) -> int:
            shndx, value = syms[k][3], syms[k][4]
            if shndx == SHN_UNDEF:
                return resolve(name(k))
            if shndx == SHN_COMMON:
                return base + commons[k]
            if shndx == SHN_ABS:
                return value
            if shndx not in place:
                raise NativeError(f"symbol {name(k)!r} is in a section that is not loaded")
            return base + place[shndx] + value

        for s in secs:
            if s[1] != SHT_RELA or s[7] not in place:
                continue
            at = place[s[7]]
            for r in range(s[5] // 24):
                off, info, addend = struct.unpack_from(_RELA, data, s[4] + 24 * r)
                kind, k = info & 0xFFFFFFFF, info >> 32
                target = (address(k) if k else 0) + addend
                where = base + at + off
                if kind == R_64:
                    struct.pack_into("<Q", self._mem, at + off, target & 0xFFFFFFFFFFFFFFFF)
                elif kind == R_PC64:
                    struct.pack_into("<q", self._mem, at + off, target - where)
                elif kind in (R_PC32, R_PLT32):
                    if not -(1 << 31) <= target - where < 1 << 31:
                        raise NativeError("a 32-bit relative relocation is out of range")
                    struct.pack_into("<i", self._mem, at + off, target - where)
                elif kind != R_NONE:
                    raise NativeError(f"relocation type {kind} is not supported")
        self.symbols = {
            name(k): address(k)
            for k, sym in enumerate(syms)
            if sym[1] >> 4 == 1 and sym[3] != SHN_UNDEF  # global definitions
        }
        if self._ro_end and _mprotect(
            ctypes.addressof(ctypes.c_char.from_buffer(self._mem)),
            self._ro_end,
            mmap.PROT_READ | mmap.PROT_EXEC,
        ):
            raise NativeError(f"mprotect failed: {os.strerror(ctypes.get_errno())}")


# --------------------------------------------------------------------------- the cache

_key: str | None = None
_lock = threading.Lock()
_images: dict[str, Image] = {}


def cache_dir() -> Path:
    """Where saved objects go: ``vt-native`` in numba's cache of the kernels (the
    package's ``__pycache__``, vt's cache directory, or ``NUMBA_CACHE_DIR``)."""
    import numba

    from . import kernels

    where = numba.config.CACHE_DIR or kernels.CACHE_DIR or kernels._HERE / "__pycache__"
    return Path(where) / "vt-native"


def key() -> str:
    """What a saved object must have been compiled with: the kernels' sources, the numba,
    llvmlite and Python versions, numba's target CPU and features."""
    global _key
    if _key is None:
        import llvmlite
        import numba

        h = hashlib.sha256()
        for path in sorted((_HERE / "kernels").glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        cpu = numba.config.CPU_NAME or "host"
        features = numba.config.CPU_FEATURES or ""
        if cpu == "host" or not features:
            import llvmlite.binding as llvm

            cpu = llvm.get_host_cpu_name() if cpu == "host" else cpu
            features = features or llvm.get_host_cpu_features().flatten()
        for part in (numba.__version__, llvmlite.__version__, sys.version, cpu, features):
            h.update(str(part).encode() + b"\0")
        _key = h.hexdigest()[:20]
    return _key


def _path(name: str) -> Path:
    return cache_dir() / f"{name}-{key()}.o"


def load(name: str) -> int | None:
    """The address of saved function ``name`` mapped into this process (once), or None
    where there is none to map (not saved, another key, not supported, a bad file)."""
    if not supported():
        return None
    with _lock:
        image = _images.get(name)
        if image is None:
            try:
                raw = _path(name).read_bytes()
            except OSError:
                return None
            head, sep, rest = raw.partition(b"\n\n")
            if not head.startswith(_MAGIC) or not sep:
                return None
            digest, _, symbol_bytes = head[len(_MAGIC) :].partition(b" ")
            if digest.decode(errors="replace") != hashlib.sha256(rest).hexdigest():
                return None  # damaged: never map code that is not what was saved
            symbol = symbol_bytes.decode(errors="replace")
            try:
                image = Image(rest)
            except NativeError:
                return None
            if symbol not in image.symbols:
                return None
            image.entry = image.symbols[symbol]  # type: ignore[attr-defined]
            _images[name] = image
        return int(image.entry)  # type: ignore[attr-defined]


def _object_code(compiled: Any) -> bytes:
    """A numba cfunc's object code: kept by its library after a compile; after a load from
    numba's cache (which hands the object to LLVM and drops it), read again from there."""
    obj = compiled._library._compiled_object
    if obj is None:
        cache = compiled._cache
        key = cache._index_key(compiled._sig, compiled._targetdescr.target_context.codegen())
        obj = cache._cache_file.load(key)[0][2][0]  # (name, "object", (object, bitcode))
    return bytes(obj)


def save(name: str, compiled: Any) -> None:
    """Save the object code of numba's cfunc ``compiled`` as function ``name`` (best
    effort: an unwritable cache only means numba loads it next time too)."""
    if not supported():
        return
    try:
        obj = _object_code(compiled)
        symbol = compiled._wrapper_name
    except Exception:  # noqa: BLE001 - a numba without these internals: nothing to save
        return
    path = _path(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        digest = hashlib.sha256(obj).hexdigest().encode()
        tmp.write_bytes(_MAGIC + digest + b" " + symbol.encode() + b"\n\n" + obj)
        os.replace(tmp, path)
    except OSError:
        pass


_compiled: dict[str, Any] = {}  # what numba compiled, kept alive for its code


def address(name: str, compile_it: Any) -> int:
    """The address of C function ``name``: mapped from its saved object code, else
    ``compile_it()`` (a numba cfunc, kept alive here) and saved for the next process."""
    got = load(name)
    if got is None:
        with _lock:
            compiled = _compiled.get(name)
            if compiled is None:
                compiled = _compiled[name] = compile_it()
        save(name, compiled)
        got = int(compiled.address)
    return got


def loaded() -> list[str]:
    """The functions mapped by vt in this process."""
    return sorted(_images)
