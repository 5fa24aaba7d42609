"""The batch-1 gemv kernels alone against a plain read of the same bytes: GB/s per matrix.

    python plugins/cuda/tools/bench_gemv.py [--shapes 1b,smol] [--json OUT]

Needs cupy and an NVIDIA GPU. Compiles vt's kernel source with ``bench_gemv_read.cu``
appended (nvrtc through cupy), fills int8 codes and (scale, offset) pairs of each matrix of
a layer (WT_Q's wide layout, blocks of 32: ``lg`` 5 without layout flags) with random
values, and times
``matmul_gemv2_q`` / ``swiglu_gemv2_q`` (the backend's grid and threads) and ``read_bw`` (the
codes and pairs read by a plain kernel: what the memory gives a kernel of that size) over
copies of the weights that together exceed the L2 cache, each call a node of one CUDA graph
(so every byte comes from memory and no host launch time counts). Prints one JSON object per
(matrix, kernel): microseconds a call and GB/s of weight bytes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import numpy as np

#: (name, N, K, swiglu) per model shape: the projections of one layer and the output one.
SHAPES: dict[str, list[tuple[str, int, int, bool]]] = {
    "1b": [("qkv", 3072, 2048, False), ("o", 2048, 2048, False), ("gate_up", 8192, 2048, True),
           ("down", 2048, 8192, False), ("output", 128256, 2048, False)],
    "smol": [("qkv", 960, 576, False), ("o", 576, 576, False), ("gate_up", 1536, 576, True),
             ("down", 576, 1536, False), ("output", 49152, 576, False)],
}  # fmt: skip
L2_BYTES = 200 << 20  # copies of a weight until they exceed this: 4x the H200's L2
CALLS = 40  # kernel launches in the timed graph


def timed(cp: Any, stream: Any, launch: Any) -> float:
    """Microseconds a call: CALLS launches (``launch(i)``) captured as one graph, best of 5."""
    with stream:
        stream.begin_capture()
        for i in range(CALLS):
            launch(i)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        best = float("inf")
        for _ in range(5):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            graph.launch(stream)
            b.record(stream)
            b.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(a, b) * 1e3 / CALLS)
    return best


def bench_matrix(cp: Any, mod: Any, stream: Any, name: str, n: int, k: int,
                 swiglu: bool) -> list[dict]:  # fmt: skip
    """vt's gemv kernel and read_bw on one matrix (gate and up for swiglu)."""
    rng = np.random.default_rng(0)
    mats = 2 if swiglu else 1
    per = n * k + n * (k // 32) * 8  # bytes of one weight: codes + pairs
    copies = max(2, -(-L2_BYTES // (per * mats)))
    codes = cp.asarray(rng.integers(-127, 128, (copies * mats, n * k), dtype=np.int8))
    shape = (copies * mats, n * k // 32)
    pairs = cp.asarray(np.stack([rng.uniform(1e-3, 1e-2, shape), rng.uniform(-1e-3, 1e-3, shape)],
                                axis=-1).astype(np.float32).reshape(copies * mats, -1))  # fmt: skip
    x = cp.asarray(rng.standard_normal(k).astype(np.float32))
    outs = cp.zeros((CALLS, n), dtype=cp.float32)
    sink = cp.zeros(4, dtype=cp.uint32)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    i32, lg = np.int32, np.int32(5)

    def weights(i: int) -> tuple:
        c = (i % copies) * mats
        one = (codes[c], pairs[c], lg)
        return (*one, codes[c + 1], pairs[c + 1], lg) if swiglu else one

    read = mod.get_function("read_bw")
    gemv = "swiglu_gemv2_q" if swiglu else "matmul_gemv2_q"
    kernel = mod.get_function(gemv)
    threads, grid = (64 if k <= 1024 else 128), (-(-n // 2),)
    tail = (i32(n), i32(k)) if swiglu else (0, 0, i32(n), i32(k))
    runs = {
        "read_bw": lambda i: read((sms * 8,), (256,), (
            sink, codes[(i % copies) * mats], np.int64(per * mats))),
        gemv: lambda i: kernel(grid, (threads,), (outs[i], x, *weights(i), *tail)),
    }  # fmt: skip
    rows = []
    for label, launch in runs.items():
        us = timed(cp, stream, launch)
        row = {"matrix": name, "N": n, "K": k, "kernel": label, "us": round(us, 3),
               "GBps": round(per * mats / us / 1e3, 1)}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    import cupy as cp
    from vt.gpu.modules import kernel_source

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1b,smol", help="comma-separated: 1b, smol")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    here = pathlib.Path(__file__).parent
    src = kernel_source() + (here / "bench_gemv_read.cu").read_text(encoding="utf-8")
    mod = cp.RawModule(code=src, options=("-DVT_WARP=32", "-std=c++17"), backend="nvrtc")
    stream = cp.cuda.Stream(non_blocking=True)
    results = []
    for shape in args.shapes.split(","):
        for name, n, k, swiglu in SHAPES[shape]:
            rows = bench_matrix(cp, mod, stream, name, n, k, swiglu)
            results += [{"shape": shape, **r} for r in rows]
            cp.get_default_memory_pool().free_all_blocks()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
