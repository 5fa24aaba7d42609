"""Host time of one GPU call, by layer: what a prefill chunk's 457 launches and 210 GEMMs
cost the host (docs/gpu.md, run 34: the 135M shape's prefill is the host's time).

    python plugins/cuda/tools/bench_host.py [--backend cuda] [--calls 400] [--rounds 5]

Per call, enqueue time only (the stream drained before and after each round; the best
round of ``--rounds``), for the 135M shape's q projection at 512 rows (576 x 576):

- ``op silu_mul``: ``backend.launch("silu_mul", ...)``: the core's op dispatch (binding and
  checks), the backend's op and one kernel launch;
- ``kernel silu_mul``: the backend's ``_kernel`` alone (argument array, ``cuLaunchKernel``);
- ``cuLaunchKernel``: cuda-python's call alone, its function, stream and arguments made once;
- ``gemm f32`` / ``gemm f16``: ``runtime.gemm`` (TF32 / half inputs) alone;
- ``op matmul``: ``backend.launch("matmul", ...)`` of a Q8_0 weight at 512 rows: the BLAS
  path with its kept copy (one GEMM; the f32 path for this weight's 331K values);
each of the last three twice: ``lt`` through a cuBLASLt plan (``vt_cuda.blas``, the
default), ``ex`` through cublasGemmEx (``Cublas.use_lt = False``, before run 37).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import vt
from gguf import GGMLQuantizationType
from vt.gpu.backend import I32
from vt.testing.tiny import quantize_matrix


def timed(backend: Any, stream: Any, call: Callable[[], None], calls: int, rounds: int) -> float:
    """Microseconds a call, the best of ``rounds`` rounds of ``calls`` enqueued calls."""
    best = float("inf")
    for _ in range(rounds):
        backend.synchronize(stream)
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, time.perf_counter() - t0)
        backend.synchronize(stream)
    return best / calls * 1e6


def lean_launch(backend: Any, stream: Any, blocks: int, args: tuple[Any, ...]) -> Any:
    """``cuLaunchKernel`` of silu_mul straight through cuda-python, everything made once."""
    from vt.gpu.runtime import kernel_params

    rt = backend.runtime
    launch, fn, handle = rt.cu.cuLaunchKernel, backend._fn("silu_mul"), stream.handle
    params, address = kernel_params(args)

    def call() -> None:
        launch(fn, blocks, 1, 1, 256, 1, 1, 0, handle, address, 0)
        # the array and the arguments it points at alive while the closure is (the array
        # holds their addresses only: freed arguments were garbage pointers, run 37)
        assert params is not None and args is not None

    return call


def measure(backend: Any, calls: int = 400, rounds: int = 5) -> dict[str, float]:
    f32 = np.dtype(np.float32)
    n, m, k = 512, 576, 576
    stream = backend.create_stream()
    x = vt.Tensor.of(backend.alloc(n * k * 4), f32, n, k)
    out = vt.Tensor.of(backend.alloc(n * m * 4), f32, n, m)
    gate = vt.Tensor.of(backend.alloc(n * m * 4), f32, n, m)
    up = vt.Tensor.of(backend.alloc(n * m * 4), f32, n, m)
    for t in (x, out, gate, up):
        backend.memset(t.buffer, 0, stream)
    values = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32) * 0.05
    q8 = GGMLQuantizationType.Q8_0
    raw = np.ascontiguousarray(quantize_matrix(values, q8)).reshape(-1).view(np.uint8)
    weight = w = backend.upload_weight(vt.WeightTensor("w", int(q8), (m, k), raw))
    ptr = backend._ptr
    rt = backend.runtime
    wf, xh, wh = backend.alloc(m * k * 4), backend.alloc(n * k * 2), backend.alloc(m * k * 2)
    for buf in (wf, xh, wh):
        backend.memset(buf, 0, stream)
    xa, oa, wa = ptr(x).value, ptr(out).value, int(wf.handle)
    xha, wha = int(xh.handle), int(wh.handle)
    blocks = -(-(n * m) // 256)
    results = {
        "op silu_mul": lambda: backend.launch("silu_mul", stream, out=out, gate=gate, up=up),
        "kernel silu_mul": lambda: backend._kernel(
            "silu_mul", (blocks, 1, 1), 256, stream, ptr(out), ptr(gate), ptr(up), I32(n * m)
        ),
        # the floor under the adapter: cuda-python's cuLaunchKernel with the function, the
        # stream and the argument array made once (what a launch costs without vt's layers)
        "cuLaunchKernel": lean_launch(
            backend, stream, blocks, (ptr(out), ptr(gate), ptr(up), I32(n * m))
        ),
    }
    h = stream.handle
    for lt in ("lt", "ex"):
        results |= {
            f"gemm f32 {lt}": lambda: rt.gemm(h, n, m, k, xa, wa, oa, False),
            f"gemm f16 {lt}": lambda: rt.gemm(h, n, m, k, xha, wha, oa, False, "f16"),
            f"op matmul {lt}": lambda: backend.launch("matmul", stream, out=out, x=x, weight=w),
        }
    got = {}
    cublas = type(rt._cublas()) if hasattr(rt, "_cublas") and rt._cublas() else None
    for name, call in results.items():
        if cublas is not None:
            cublas.use_lt = not name.endswith(" ex")
        call()  # compile, load, make the kept copy (and the cuBLASLt plan)
        backend.synchronize(stream)
        print(f"{name}: ran", flush=True)
        got[name] = round(timed(backend, stream, call, calls, rounds), 2)
    if cublas is not None:
        cublas.use_lt = True
        blas = rt._cublas()
        made = sum(plan is not None for plan in blas._plans.values())
        print(f"cuBLASLt: {made} plans of {len(blas._plans)} shapes; {blas.lt_reason or 'ok'}")
    backend.free_weight(weight)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from vt.management.registry import create_backend

    backend, _ = create_backend(a.backend)
    try:
        for name, us in measure(backend, a.calls, a.rounds).items():
            print(f"{name:<16} {us:8.2f} us a call (host, enqueue)", flush=True)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
