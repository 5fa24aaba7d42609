"""numba kernels of the CPU backend, compiled once and cached on disk.

Importing this package configures numba before any kernel is defined: the on-disk cache
goes to the package's ``__pycache__`` when it is writable, else to ``numba-cache`` in vt's
cache directory (unless ``NUMBA_CACHE_DIR`` says otherwise); the threading layer is a
thread-safe one (OpenMP or TBB) when the user did not pick one, so several streams may
launch parallel kernels at once; and on a CPU with AVX-512, LLVM may use 512-bit vectors
(unless ``NUMBA_CPU_FEATURES`` is set). numba's settings are the process's: numba code
compiled after this import gets the same.
"""

from __future__ import annotations

import os
from pathlib import Path

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
