"""GB/s of the int8-activation decode kernels (vt_cpu.kernels.q8) against the float ones.

    python plugins/cpu/tools/bench_q8.py [--shapes 1536x768,49152x576] [--rounds 3]
        [--threads 1,2] [--json out.json]

For each format with an int8 path and each shape: one weight (random values quantized by
the kit's quantizers) times one activation row, the float32 kernel (``BlockWeight.bind``,
vt_cpu.kernels.quant) and the int8 one (activation quantization included: a decode op pays
it), timed in cache (the same matrix again and again) and streaming (one call over each of
enough copies to exceed 256 MiB: what a decode step sees). The variants alternate within
each round, and each cell keeps the best of its rounds (noise on a shared machine only
slows runs down); the ratio is int8 over float. Bytes are the weight's bytes in its file
format.
"""

from __future__ import annotations

import argparse
import json
import os

from bench_kernels import best_seconds, weight_copies  # the tool beside this one
from vt_cpu.kernels import q8

KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")  # every format with a q8 path


def measure(kind: str, rows: int, cols: int, stream_bytes: int, rounds: int,
            threads: tuple[int, ...]) -> dict[str, float]:  # fmt: skip
    data, ws, x, out = weight_copies(kind, rows, cols, stream_bytes)
    inner = max(1, int(2e7 // data.nbytes))
    variants = {}
    for n in threads:
        fl = [w.bind(x, out, None) for w in ws]
        variants[f"float_t{n}"] = [(s if n == 1 else (lambda p=p, n=n: p(n))) for s, p in fl]
        for bits in (8, 16):
            qs = [q8.bind(w, x, out, None, bits) for w in ws]
            variants[f"int{bits}_t{n}"] = [
                (s if n == 1 else (lambda p=p, n=n: p(n))) for s, p in qs
            ]
    for calls in variants.values():
        calls[0]()  # compile
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, calls in variants.items():
            t_cache = best_seconds(calls[0], 3, inner)

            def sweep(calls=calls) -> None:
                for c in calls:
                    c()

            t_stream = best_seconds(sweep, 2, 1) / len(calls)
            for key, t in ((f"{name}_cache", t_cache), (f"{name}_stream", t_stream)):
                best[key] = min(best.get(key, float("inf")), t)
    result = {"bytes": float(data.nbytes)}
    for key, t in best.items():
        result[f"{key}_gbs"] = data.nbytes / t / 1e9
    for n in threads:
        for where in ("cache", "stream"):
            for bits in (8, 16):
                result[f"ratio{bits}_t{n}_{where}"] = (
                    result[f"int{bits}_t{n}_{where}_gbs"] / result[f"float_t{n}_{where}_gbs"]
                )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1536x768,49152x576")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream-mib", type=int, default=256, help="bytes swept when streaming")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    threads = tuple(int(t) for t in args.threads.split(","))
    results: dict = {"vnni": q8.VNNI, "load_average": os.getloadavg()[0], "shapes": {}}
    for shape in args.shapes.split(","):
        rows, cols = (int(v) for v in shape.split("x"))
        per = results["shapes"][shape] = {}
        for k in args.kinds.split(","):
            per[k] = measure(k, rows, cols, args.stream_mib << 20, args.rounds, threads)
            r = per[k]
            cells = "  ".join(
                f"t{n} {where}: float {r[f'float_t{n}_{where}_gbs']:5.1f} int8 "
                f"{r[f'int8_t{n}_{where}_gbs']:5.1f} int16 {r[f'int16_t{n}_{where}_gbs']:5.1f}"
                for n in threads
                for where in ("cache", "stream")
            )
            print(f"{shape} {k}: {cells}", flush=True)
    results["load_average_after"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
