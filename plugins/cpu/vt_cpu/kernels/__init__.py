"""numba kernels of the CPU backend, compiled once and cached on disk.

Importing this package configures numba before any kernel is defined: the on-disk cache
goes to the package's ``__pycache__`` when it is writable, else to ``numba-cache`` in vt's
cache directory (unless ``NUMBA_CACHE_DIR`` says otherwise), and the threading layer is a
thread-safe one (OpenMP or TBB) when the user did not pick one, so several streams may
launch parallel kernels at once.
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

if numba.config.THREADING_LAYER == "default":  # NUMBA_THREADING_LAYER unset
    # omp or tbb: safe to call from several threads at once (workqueue is not).
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
