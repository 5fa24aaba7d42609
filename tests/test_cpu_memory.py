"""The cpu backend's buffers and memory: what a process keeps resident (issue 10)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import vt_cpu.backend as cpu_backend
from vt_cpu import anon

_REUSE = """
import gc
import numpy as np
import vt_cpu.backend as B

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

np.ones(30 << 20, np.uint8)  # freed at once: glibc's mmap threshold rises to 30 MiB
be = B.CpuBackend()
before = rss()
buf = be.alloc(16 << 20)
lazy = rss() - before
be.memset(buf, 1)
touched = rss() - before
be.free(buf)
del buf
gc.collect()
print(lazy >> 20, touched >> 20, (rss() - before) >> 20)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/statm")
def test_a_large_buffer_is_resident_only_once_touched_and_returned_when_freed() -> None:
    # From malloc (np.zeros), a freed 16 MiB buffer stayed in the heap once glibc's mmap
    # threshold had risen, and a reused chunk was zeroed whole at the next allocation: a
    # second runner's activations sat beside the first's (vt bench on a 1B model: +13 MiB).
    done = subprocess.run(
        [sys.executable, "-c", _REUSE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lazy, touched, after_free = map(int, done.stdout.split())
    assert lazy <= 1 and touched >= 15 and after_free <= 1


def test_large_and_small_buffers_are_zeroed_writable_and_private() -> None:
    be = cpu_backend.CpuBackend()
    try:
        for n in (16, anon.MMAP_MIN_BYTES - 1, anon.MMAP_MIN_BYTES, 3 << 20):
            buf = be.alloc(n)
            view = be.host_view(buf)
            assert view.nbytes == n and not view.any()
            view[-1] = 7
            out = np.empty(n, np.uint8)
            be.copy_d2h(out, buf)
            assert out[-1] == 7 and int(out.sum()) == 7
            be.free(buf)
    finally:
        be.close()


_EXTRAS = """
import os, sys
import numba
import numpy as np
from vt_cpu import compile as C
from vt_cpu.kernels import init_numba_runtime
from vt_cpu.kernels import layers as L

C.ensure_compiled("layers", quiet=True)
init_numba_runtime()  # numba's target, as its first compile or load in a process builds it
L.first_bad(np.zeros(1, np.int32), 1)
loaded = [m for m in ("scipy.linalg", "cffi") if m in sys.modules]
print("loaded", ",".join(loaded) or "-")
print("opt", int(numba.config.OPT))

@numba.njit
def dot(a):
    return np.dot(a, a)

try:
    print("dot", dot(np.ones(3)))
except Exception as e:
    print("dot error", type(e).__name__, str(e).splitlines()[0])
try:
    import scipy.linalg  # the user's own import is never refused
except ImportError:
    print("no scipy")
else:
    print("dot after import", dot(np.ones(3)))
"""


def _extras(env_value: str | None) -> list[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "VT_CPU_NUMBA_EXTRAS"}
    if env_value is not None:
        env["VT_CPU_NUMBA_EXTRAS"] = env_value
    done = subprocess.run(
        [sys.executable, "-c", _EXTRAS], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_numba_loads_neither_scipy_linalg_nor_cffi_for_the_kernels() -> None:
    out = _extras(None)
    # numba's target imports both only for np.dot/np.linalg and cffi calls in jitted code.
    assert out[0] == "loaded -"
    assert out[1] == "opt 3"  # the runtime's helpers compiled without LLVM's pipeline only
    assert out[2] == "dot error ImportError scipy 0.16+ is required for linear algebra"
    assert out[3] in ("dot after import 3.0", "no scipy")


def test_vt_cpu_numba_extras_lets_numba_load_them() -> None:
    import importlib.util

    out = _extras("1")
    wanted = [m for m in ("scipy", "cffi") if importlib.util.find_spec(m) is not None]
    loaded = out[0].removeprefix("loaded ").split(",")
    # whichever of them is installed, numba loaded (without scipy, np.dot cannot compile)
    assert [m.split(".")[0] for m in loaded if m != "-"] == wanted
    no_blas = "dot error ImportError scipy 0.16+ is required for linear algebra"
    assert out[2] == ("dot 3.0" if "scipy" in wanted else no_blas)
