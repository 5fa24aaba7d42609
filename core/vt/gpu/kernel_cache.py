"""Compiled kernel binaries kept on disk, so that only a machine's first process compiles.

A runtime adapter's ``compile`` asks its :class:`Binaries` (this process's binaries of one
vendor), which asks :func:`load_or_build` for the binary (a cubin, a HIP code object; its
``prebuild``, :func:`read_or_build`, on any thread) of one identity: its vendor, its
compiler's version, the architecture, the options and the source. A binary
built for that identity before is read from ``$VT_HOME/kernels/<vendor>-<digest>.bin``;
else it is built and written there (atomically: a reader sees a whole file or none). A file
the driver refuses to load (damaged) is built again and replaced. ``VT_KERNEL_CACHE=0``
turns the cache off; a directory that cannot be read or written leaves it off for that
compile (the kernels still run).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from .. import envs
from .runtime import GpuCallError

M = TypeVar("M")
#: A binary's key in a process: (architecture, compiler options, the source's digest).
Key = tuple[str, tuple[str, ...], str]


def cache_path(vendor: str, identity: Sequence[str]) -> Path | None:
    """Where the binary of ``identity`` lives, or None while the cache is off."""
    if not envs.get("VT_KERNEL_CACHE"):
        return None
    digest = hashlib.sha256("\0".join((vendor, *identity)).encode()).hexdigest()
    return envs.get("VT_HOME") / "kernels" / f"{vendor}-{digest}.bin"


def _read(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes() or None
    except OSError:
        return None


def _write(path: Path | None, binary: bytes) -> bool:
    """Whether ``binary`` is now kept at ``path``."""
    if path is None:
        return False
    tmp = ""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(binary)
        os.replace(tmp, path)
        return True
    except OSError:  # a read-only or full disk: compiled again next time
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return False


def load_or_build(
    vendor: str,
    identity: Sequence[str],
    build: Callable[[], bytes],
    load: Callable[[bytes], M],
    *,
    announce: str = "",
    prebuilt: bytes | None = None,
) -> tuple[M, bytes]:
    """``(load(binary), binary)`` for the binary of ``identity``: ``prebuilt`` (what
    :func:`read_or_build` gave, unchecked) or the cached one, where the driver loads it,
    else ``build()``'s, which is then cached. ``announce`` (the module's name): a build
    says so on stderr, before and after, as a machine's first run compiles for tens of
    seconds with nothing else to show."""
    path = cache_path(vendor, identity)
    for binary in (prebuilt, _read(path)):
        if binary is not None:
            try:
                return load(binary), binary
            except GpuCallError:  # refused (a damaged file): built again and replaced below
                pass
    loaded: list[M] = []  # loaded before the binary is kept: a refused one is not
    binary = _build_and_keep(vendor, path, build, lambda b: loaded.append(load(b)), announce)
    return loaded[0], binary


def read_or_build(
    vendor: str, identity: Sequence[str], build: Callable[[], bytes], *, announce: str = ""
) -> bytes:
    """The binary of ``identity`` as :func:`load_or_build` finds or builds it, not loaded:
    no driver call, so any thread may ask (a backend builds its modules in parallel, then
    loads them where it launches). A cached file is returned unchecked; the adapter loads
    it later and, where the driver refuses it, goes through :func:`load_or_build`."""
    path = cache_path(vendor, identity)
    binary = _read(path)
    if binary is not None:
        return binary
    return _build_and_keep(vendor, path, build, lambda b: None, announce)


def _build_and_keep(
    vendor: str,
    path: Path | None,
    build: Callable[[], bytes],
    check: Callable[[bytes], None],
    announce: str,
) -> bytes:
    """``build()``'s binary, ``check``ed, then written to ``path``, announced where asked."""
    start = time.perf_counter()
    if announce:
        why = f"first run only; kept in {path.parent}" if path else "VT_KERNEL_CACHE=0: every run"
        _say(f"vt: compiling {vendor} kernels {announce} ({why})...")
    binary = build()
    check(binary)
    kept = _write(path, binary)
    if announce:
        lost = f" (not kept: {path.parent} could not be written)" if path and not kept else ""
        _say(f"vt: {vendor} kernels {announce} ready in {time.perf_counter() - start:.0f} s{lost}")
    return binary


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Binaries:
    """One vendor's compiled binaries in this process, shared by its runtimes: those loaded
    before (a later ``compile`` loads them again without building) and those
    :meth:`prebuild` made, not yet loaded. An adapter's ``compile`` and ``prebuild`` are
    :meth:`load` and :meth:`prebuild` with its compiler's calls."""

    def __init__(self, vendor: str) -> None:
        self.vendor = vendor
        self.built: dict[Key, bytes] = {}
        self.prebuilt: dict[Key, bytes] = {}

    def clear(self) -> None:
        """Forget every binary (as a new process would start)."""
        self.built.clear()
        self.prebuilt.clear()

    @staticmethod
    def key(arch: str, arch_option: str, source: str, options: Sequence[str]) -> Key:
        """``source``'s key for ``arch``: the compiler's options, ``arch_option`` first."""
        return (arch, (arch_option, *options), hashlib.sha256(source.encode()).hexdigest())

    def load(
        self,
        key: Key,
        compiler: Callable[[], Sequence[str]],
        build: Callable[[Sequence[str]], bytes],
        load: Callable[[bytes], M],
        *,
        announce: str = "",
    ) -> M:
        """The module of ``key``: its binary from this process, a :meth:`prebuild`, the disk
        cache or ``build(options)``, loaded. ``compiler()``: the compiler's name and
        version, for the disk cache's identity."""
        binary = self.built.get(key)
        if binary is not None:
            return load(binary)
        module, self.built[key] = load_or_build(
            self.vendor,
            (*compiler(), *key[1], key[2]),
            lambda: build(key[1]),
            load,
            announce=announce,
            prebuilt=self.prebuilt.pop(key, None),
        )
        return module

    def prebuild(
        self,
        key: Key,
        compiler: Callable[[], Sequence[str]],
        build: Callable[[Sequence[str]], bytes],
        *,
        announce: str = "",
    ) -> None:
        """The compiler's part of :meth:`load` (or the disk cache's file), kept for it, not
        loaded: no driver call, so any thread may run it."""
        if key in self.built or key in self.prebuilt:
            return
        self.prebuilt[key] = read_or_build(
            self.vendor, (*compiler(), *key[1], key[2]), lambda: build(key[1]), announce=announce
        )
