"""numba kernels of the CPU backend, compiled once and cached on disk.

Importing this package configures numba before any kernel is defined: the on-disk cache
goes to the package's ``__pycache__`` when it is writable, else to ``numba-cache`` in vt's
cache directory (unless ``NUMBA_CACHE_DIR`` says otherwise); the threading layer is a
thread-safe one (OpenMP or TBB) when the user did not pick one, so several streams may
launch parallel kernels at once; and on a CPU with AVX-512, LLVM may use 512-bit vectors
(unless ``NUMBA_CPU_FEATURES`` is set). numba's settings are the process's: numba code
compiled after this import gets the same.

It also keeps numba from importing ``scipy.linalg`` and ``cffi`` for itself (unless
``VT_CPU_NUMBA_EXTRAS=1``): numba's CPU target imports them, when it first compiles or
loads a function, only to offer ``np.dot``/``np.linalg`` and cffi calls inside jitted code,
which no vt kernel makes; ``scipy.linalg`` brings scipy's own OpenBLAS, ~17 MiB of a
process that runs the default model in ~300.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from pathlib import Path
from typing import Any

import numba
import vt

_HERE = Path(__file__).resolve().parent
_HOME = "VT" + "_HOME"  # read through vt.envs


def _cache_dir() -> str | None:
    """Where numba caches this package's kernels (None: numba's default, the package)."""
    if numba.config.CACHE_DIR:  # NUMBA_CACHE_DIR
        return None
    pycache = _HERE / "__pycache__"
    try:
        pycache.mkdir(exist_ok=True)
        probe = pycache / f".vt-write-probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
        return None
    except OSError:
        return str(Path(os.path.expanduser(str(vt.envs.get(_HOME)))) / "numba-cache")


#: What numba imports for features no vt kernel uses, by the numba module that imports it:
#: scipy's linear algebra (``np.dot``/``np.linalg`` in jitted code: all of
#: ``scipy.linalg`` and scipy's own OpenBLAS, ~17 MiB) and cffi (cffi functions called
#: from jitted code: cffi and pycparser, ~1.6 MiB).
_NUMBA_EXTRAS = {"numba.np.linalg": "scipy.linalg", "numba.core.typing.cffi_utils": "cffi"}


class _NumbaExtrasRefused(importlib.abc.MetaPathFinder):
    """Refuses the packages of :data:`_NUMBA_EXTRAS` to the numba modules named there only
    (numba then treats them as not installed: jitted code calling ``np.dot`` fails to
    compile with "scipy 0.16+ is required for linear algebra"); any other importer, or one
    after the package is loaded, gets it as usual."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        package = next(
            (p for p in _NUMBA_EXTRAS.values() if (name + ".").startswith(p + ".")), None
        )
        if package is None or package in sys.modules:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("importlib"):
            frame = frame.f_back
        if frame is not None and _NUMBA_EXTRAS.get(frame.f_globals.get("__name__")) == package:
            raise ImportError(f"vt_cpu: {name} is not loaded for numba (VT_CPU_NUMBA_EXTRAS=1)")
        return None


if not vt.envs.get("VT_CPU_NUMBA_EXTRAS") and not any(
    isinstance(f, _NumbaExtrasRefused) for f in sys.meta_path
):
    sys.meta_path.insert(0, _NumbaExtrasRefused())

CACHE_DIR = _cache_dir()
if CACHE_DIR is not None:
    os.makedirs(CACHE_DIR, exist_ok=True)
    numba.config.CACHE_DIR = CACHE_DIR


def _cpu_features() -> str | None:
    """The host's CPU features for numba's code generation, without LLVM's preference for
    256-bit vectors where the CPU has AVX-512 (the block kernels run 1.3-1.4x faster with
    512-bit vectors); None keeps numba's own choice (set by ``NUMBA_CPU_FEATURES``, or a CPU
    without AVX-512)."""
    if numba.config.CPU_FEATURES is not None:
        return None
    import llvmlite.binding as llvm

    try:
        features = llvm.get_host_cpu_features().flatten()
    except RuntimeError:  # pragma: no cover - an LLVM that cannot tell
        return None
    return features + ",-prefer-256-bit" if "+avx512f" in features.split(",") else None


CPU_FEATURES = _cpu_features()
if CPU_FEATURES is not None:
    numba.config.CPU_FEATURES = CPU_FEATURES

if numba.config.THREADING_LAYER == "default":  # NUMBA_THREADING_LAYER unset
    # omp or tbb: safe to call from several threads at once (workqueue is not).
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


def init_numba_runtime() -> None:
    """Initialize numba's CPU target, compiling its runtime's (NRT's) few helper functions
    without LLVM's optimization pipeline.

    numba compiles them when it first loads or compiles any function, at ``NUMBA_OPT`` (3),
    which runs LLVM's whole pipeline once and so brings ~5 MiB more of ``libllvmlite``'s
    code into memory. They are reference-count helpers whose kernels carry their own
    inlined copies, so their optimization changes nothing measurable; every kernel is still
    compiled at ``NUMBA_OPT`` (the target machine is made before and keeps its level).
    Called before vt's first compile or load through numba (a process whose functions are
    all mapped by :mod:`vt_cpu.native` never calls it). A numba without these internals is
    left to initialize itself."""
    try:
        from numba.core.compiler_lock import global_compiler_lock
        from numba.core.registry import cpu_target
        from numba.core.runtime import rtsys
    except ImportError:  # pragma: no cover - another numba layout
        return
    with global_compiler_lock:  # no other thread compiles while OPT is 0
        ctx = cpu_target.target_context  # the code generator, at the configured level
        if getattr(rtsys, "_init", True):
            return
        level = numba.config.OPT
        numba.config.OPT = 0
        try:
            rtsys.initialize(ctx)
        finally:
            numba.config.OPT = level
