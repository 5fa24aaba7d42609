"""Compile (or load from numba's disk cache) every kernel once per process, saying so.

Kernels are compiled per weight format, when the first weight of that format is uploaded
(so a Q4_1 model never loads the Q6_K kernels). The first run on a machine compiles them;
later runs load them from the cache (:data:`vt_cpu.kernels.CACHE_DIR`, or the package's
``__pycache__``). When the cache lacks a kernel (or loading takes more than two seconds),
one line goes to stderr first and one when it is done, so a first ``vt run`` does not look
hung.

With the team (``VT_CPU_TEAM``, the default) a format's matmuls run as team jobs and its
numba-pool kernels (``mv*``/``mm*`` and the int8 ``mv*``) never run; once the disk cache
holds them they are not loaded at all (numba would load one on a first call), which keeps
~20 MiB of numba's memory out of a Q4_1 model's process. A first run still compiles them,
so turning the team off later finds them cached. Likewise the numba functions that only
the activation ops' fallbacks call (~11 MiB: every op runs as jobs) and the integer
kernels of the activation width not in use (``VT_CPU_ACT_BITS``). The team's jobs and
entry points themselves are mapped by :mod:`vt_cpu.native` from the object code saved at
their first compile, so a warm process never builds numba's target at all.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import numba
import numpy as np
import vt

from . import kernels
from .kernels import attention as A
from .kernels import jobs as J
from .kernels import layers as L
from .kernels import q8 as Q8
from .kernels import quant as Q
from .kernels import team as K

F32 = np.float32
_lock = threading.Lock()
_done: set[str] = set()
#: Seconds :func:`ensure_compiled` took in this process so far (None before).
seconds: float | None = None
#: numba's threading layer once a parallel kernel ran ("omp", "tbb" or "workqueue").
threading_layer: str | None = None


def _ro(a: np.ndarray) -> np.ndarray:
    a = a.view()
    a.setflags(write=False)
    return a


def _blocks(nbytes: int, n: int) -> np.ndarray:
    return _ro(np.zeros((n, nbytes), np.uint8))


def _warm_kind(kind: str, pool: bool = True) -> None:
    """Call the kernels of one weight format once, with the types the backend passes;
    without ``pool`` only the team's job and the dequantizer (prefill's tiles)."""
    J.address(J.MM_JOB[kind])  # the tile kernels as a team job
    J.address("dq")  # the dequantizers (embedding rows, prefill's BLAS tiles) as a job
    if not pool:
        return
    rows = np.zeros(1, np.int64)
    x = np.zeros((1, 8, 32), F32)  # one activation row of 256 values
    out, res = np.zeros((1, 4), F32), np.zeros((1, 4), F32)
    deq = np.zeros((1, 256), F32)
    if kind == "Q8_0":
        q8 = _blocks(34, 32)
        q8s = _ro(q8.view(np.int8))
        Q.mv_q8_0(q8s, q8, x, out, res, True, 2)
        Q.mv1_q8_0(q8s, q8, x, out, res, True)
        Q.mm_q8_0(q8s, q8, x, out, res, True, 2)
        Q.mm1_q8_0(q8s, q8, x, out, res, True)
        Q.dq_q8_0(q8s, q8, rows, deq)
    elif kind in ("Q4_0", "Q4_1"):
        q4 = _blocks(20, 32)
        Q.mv_q4(q4, x, out, res, True, 2, True)
        Q.mv1_q4(q4, x, out, res, True, True)
        Q.mm_q4(q4, x, out, res, True, 2, True)
        Q.mm1_q4(q4, x, out, res, True, True)
        Q.dq_q4(q4, rows, deq, True)
    elif kind in ("Q4_K", "Q5_K"):
        qk = _blocks(176, 4)
        Q.mv_qk45(qk, x, out, res, True, 2, True)
        Q.mv1_qk45(qk, x, out, res, True, True)
        Q.mm_qk45(qk, x, out, res, True, 2, True)
        Q.mm1_qk45(qk, x, out, res, True, True)
        Q.dq_qk45(qk, rows, deq, True)
    elif kind == "Q6_K":
        q6 = _blocks(210, 4)
        q6s = _ro(q6.view(np.int8))
        Q.mv_q6_k(q6, q6s, x, out, res, True, 2)
        Q.mv1_q6_k(q6, q6s, x, out, res, True)
        Q.mm_q6_k(q6, q6s, x, out, res, True, 2)
        Q.mm1_q6_k(q6, q6s, x, out, res, True)
        Q.dq_q6_k(q6, q6s, rows, deq)


def _warm_int8(pool: bool = True) -> None:
    """The integer activations' jobs; with ``pool`` (or a first compile) both widths and
    numba-pool kernels, else only the width ``VT_CPU_ACT_BITS`` asks for."""
    x = np.zeros((1, 64), F32)
    out = np.zeros((1, 4), F32)
    raw = _blocks(34, 8)
    for bits in (8, 16):
        if pool:
            xq, xd, xi = Q8.scratch(1, 64, bits)
            Q8.mv1(0, raw, x, xq, xd, xi, out, out, True)
            Q8.mv(0, raw, x, xq, xd, xi, out, out, True, 2)
        elif bits != vt.envs.get("VT_CPU_ACT_BITS"):
            continue  # loaded on first use, if ever (~3 MiB each)
        J.address(f"q8_{bits}")
        J.address(f"quant{bits}")


def _warm_layers(fallbacks: bool = True) -> None:
    """The activation ops' jobs and the team's entry points; with ``fallbacks`` also the
    numba functions that only the ops' fallbacks call (arrays a job cannot take, a RoPE
    table too large): ~11 MiB of loaded code that a model's run never needs once they
    are in the disk cache (a first call loads one)."""
    a = np.zeros((1, 8), F32)
    ids = np.zeros(1, np.int32)
    cache = np.zeros((2, 1, 1, 2, 1, 8), F32)
    if fallbacks:
        L.first_bad(ids, 1)
        L.rms_norm(a, _ro(np.ones(8, F32)), 1e-5, a)
        cs = np.ones((1, 4), F32)
        L.rope_kv_store(a, a, a, ids, ids, cache, 0, 1, cs, cs, False)
        L.silu_mul(a, a, a)
        q, out, buf = np.zeros((1, 16), F32), np.zeros((1, 16), F32), np.ones(2, F32)  # 2 heads
        A.packed_size(ids, ids, 2, 1, 1)
        A.scores(q, cache, 0, ids, ids, 2, 1.0, buf, np.zeros(2, F32))
        A.weighted_values(cache, 0, ids, ids, 2, buf, out)
    K.entries()  # the team's C entries
    for job in ("multi", "attn_prep", "attn_scores", "attn_values", "rms_norm", "silu_mul",
                "rope_kv", "gather"):  # fmt: skip
        J.address(job)  # the ops as jobs (team jobs, and the steps of a graph's program)


#: The kernels each group needs (to tell a first compile from a load from the cache).
_GROUPS: dict[str, tuple[Any, ...]] = {
    "layers": (
        L.rms_norm,
        L.first_bad,
        L.rope_kv_store,
        L.silu_mul,
        A.packed_size,
        A.scores,
        A.weighted_values,
    ),
    "Q8_0": (Q.mv_q8_0, Q.mv1_q8_0, Q.mm_q8_0, Q.mm1_q8_0, Q.dq_q8_0),
    "Q4_0": (Q.mv_q4, Q.mv1_q4, Q.mm_q4, Q.mm1_q4, Q.dq_q4),
    "Q4_1": (Q.mv_q4, Q.mv1_q4, Q.mm_q4, Q.mm1_q4, Q.dq_q4),
    "Q4_K": (Q.mv_qk45, Q.mv1_qk45, Q.mm_qk45, Q.mm1_qk45, Q.dq_qk45),
    "Q5_K": (Q.mv_qk45, Q.mv1_qk45, Q.mm_qk45, Q.mm1_qk45, Q.dq_qk45),
    "Q6_K": (Q.mv_q6_k, Q.mv1_q6_k, Q.mm_q6_k, Q.mm1_q6_k, Q.dq_q6_k),
    "int8": (Q8.mv1, Q8.mv),
}


def _cached(kernel: Any) -> bool | None:
    """Whether numba's disk cache has an index for ``kernel`` (None: cannot tell)."""
    try:
        return os.path.exists(kernel._cache._cache_file._index_path)
    except AttributeError:
        return None


def ensure_compiled(kind: str = "layers", quiet: bool = False, pool: bool = True) -> float:
    """Compile or load the kernels of ``kind`` (a weight format, or ``"layers"`` for the
    activation ops) once per process; returns the seconds it took (0 when done before).
    ``pool=False`` (the backend runs its matmuls on the team) loads a format's numba-pool
    kernels only where the disk cache lacks them, to compile them once."""
    global seconds, threading_layer
    team_done = f"{kind} (team)"
    if kind in _done or (not pool and team_done in _done) or kind not in _GROUPS:
        return 0.0  # every weight upload asks: no lock, no look at the disk cache
    with _lock:
        missing = any(_cached(k) is False for k in _GROUPS[kind])
        # (for "layers", pool means the fallbacks' functions: needed with or without team)
        pool = missing if kind == "layers" else pool or missing
        done_as = kind if pool or kind == "layers" else team_done
        if kind in _done or done_as in _done:
            return 0.0
        start = time.perf_counter()
        finished = threading.Event()
        announced = []

        def announce() -> None:
            if not finished.wait(0.0 if missing else 2.0) and not quiet:
                where = numba.config.CACHE_DIR or str(kernels._HERE / "__pycache__")
                print(
                    f"vt cpu: compiling numba kernels for {kind} (first run only; cached in "
                    f"{where})...",
                    file=sys.stderr,
                    flush=True,
                )
                announced.append(True)

        watcher = threading.Thread(target=announce, name="vt-cpu-compile-notice", daemon=True)
        watcher.start()
        try:
            if pool:
                kernels.init_numba_runtime()
            if kind == "layers":
                _warm_layers(pool)
            elif kind == "int8":
                _warm_int8(pool)
            else:
                _warm_kind(kind, pool)
        finally:
            finished.set()
            watcher.join()
        took = time.perf_counter() - start
        seconds = (seconds or 0.0) + took
        if threading_layer is None and kind != "layers" and pool:
            try:
                threading_layer = numba.threading_layer()
            except ValueError:  # pragma: no cover - no parallel kernel ran
                threading_layer = None
        if announced:
            print(f"vt cpu: {kind} kernels ready in {took:.0f} s", file=sys.stderr, flush=True)
        _done.add(done_as)
        return took
