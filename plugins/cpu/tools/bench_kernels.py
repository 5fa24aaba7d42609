"""GB/s of the cpu backend's matrix-vector kernels, per weight format.

    python plugins/cpu/tools/bench_kernels.py [--rows 1536 --cols 768] [--json out.json]

For each block format: one weight of ``rows x cols`` (random values, quantized by the
kit's quantizers) times one activation row, serial and over 2 of numba's threads, timed
in cache (the same matrix again and again: the kernel's own speed) and streaming (one
call over each of enough copies to exceed the caches: what a decode step sees). Bytes are
the weight's bytes in its file format. Best of a few repetitions (noise on a shared
machine only slows runs down).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import vt
from gguf import GGMLQuantizationType
from vt.testing.tiny import quantize_matrix
from vt_cpu import compile as kernels_compile
from vt_cpu import weights

KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def best_seconds(fn, repeat: int, inner: int) -> float:
    """The best time of ``repeat`` rounds of ``inner`` calls, per call."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def weight_copies(
    kind: str, rows: int, cols: int, stream_bytes: int
) -> tuple[np.ndarray, list, np.ndarray, np.ndarray]:
    """A random ``rows x cols`` weight of ``kind`` (its file bytes), enough uploaded copies
    of it to exceed ``stream_bytes``, one activation row and an output row; compiled."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    data = quantize_matrix(values, GGMLQuantizationType[kind]).reshape(-1)
    copies = max(1, stream_bytes // data.nbytes)
    ws = [
        weights.upload(
            vt.WeightTensor("w", int(GGMLQuantizationType[kind]), (rows, cols), data.copy())
        )  # fmt: skip
        for _ in range(copies)
    ]
    x = rng.standard_normal((1, cols)).astype(np.float32)
    out = np.zeros((1, rows), np.float32)
    kernels_compile.ensure_compiled(kind)
    return data, ws, x, out


def measure(kind: str, rows: int, cols: int, stream_bytes: int) -> dict[str, float]:
    data, ws, x, out = weight_copies(kind, rows, cols, stream_bytes)
    copies = len(ws)
    result: dict[str, float] = {"bytes": float(data.nbytes)}
    for label, n in (("serial", 1), ("parallel2", 2)):
        calls = [w.bind(x, out, None) for w in ws]
        serial0, parallel0 = calls[0]
        one = serial0 if n == 1 else (lambda p=parallel0, n=n: p(n))
        result[f"{label}_in_cache_gbs"] = data.nbytes / best_seconds(one, 5, 50) / 1e9

        def sweep(calls=calls, n=n) -> None:
            for serial, parallel in calls:
                if n == 1:
                    serial()
                else:
                    parallel(n)

        result[f"{label}_streaming_gbs"] = data.nbytes * copies / best_seconds(sweep, 3, 1) / 1e9
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1536)
    ap.add_argument("--cols", type=int, default=768)
    ap.add_argument("--stream-mib", type=int, default=256, help="bytes swept when streaming")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    results = {
        "rows": args.rows,
        "cols": args.cols,
        "load_average": os.getloadavg()[0],
        "kinds": {k: measure(k, args.rows, args.cols, args.stream_mib << 20) for k in KINDS},
    }
    print(f"{args.rows}x{args.cols}, one activation row; GB/s of file-format bytes")
    print("format  serial(cache)  serial(stream)  2 threads(cache)  2 threads(stream)")
    for k, r in results["kinds"].items():
        print(
            f"{k:6s}  {r['serial_in_cache_gbs']:13.2f}  {r['serial_streaming_gbs']:14.2f}  "
            f"{r['parallel2_in_cache_gbs']:16.2f}  {r['parallel2_streaming_gbs']:17.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
