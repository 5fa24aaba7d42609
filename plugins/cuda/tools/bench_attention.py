"""GPU time of one attention op, tiled prefill kernel against the split (decode) kernel.

    python plugins/cuda/tools/bench_attention.py [--backend cuda] [--reps 20]

For each model shape (the 1B shape: 32 query heads, 8 KV heads, head_dim 64; the 135M
shape: 9 and 3) and each kind of rows — ``prefill``: one sequence's chunk of N rows at
positions 0..N-1; ``chunk2``: the same at positions 512..512+N-1 (a second chunk);
``decode``: N sequences' single rows at position 511; ``mixed``: a 480-row chunk and 32
decode rows in one step — it captures ``--reps`` launches of the op in a graph, replays it
and prints microseconds per op with ``attention_tiled_min_rows`` forcing each kernel, and
the largest difference between their outputs. That is what picks the default row count
from which the backend takes the tiled kernel.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import vt
from vt.management.registry import Registry

SHAPES = {"1b": (32, 8, 64), "135m": (9, 3, 64)}
ROWS = {
    "prefill": (16, 32, 64, 128, 256, 512),
    "chunk2": (64, 256, 512),
    "decode": (8, 16, 32, 64, 128),
    "mixed": (512,),
}


def rows(kind: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(slots, positions) of ``n`` rows of ``kind``."""
    if kind == "prefill":
        return np.zeros(n, np.int32), np.arange(n, dtype=np.int32)
    if kind == "chunk2":
        return np.zeros(n, np.int32), np.arange(512, 512 + n, dtype=np.int32)
    if kind == "decode":
        return np.arange(n, dtype=np.int32), np.full(n, 511, np.int32)
    slots = np.concatenate([np.zeros(n - 32, np.int32), np.arange(1, 33, dtype=np.int32)])
    pos = np.concatenate([np.arange(n - 32, dtype=np.int32), np.full(32, 700, np.int32)])
    return slots, pos


def timed(be: Any, stream: Any, args: dict[str, Any], out: vt.Tensor, reps: int) -> float:
    """Microseconds per attention op: ``reps`` launches captured in a graph (the first one
    eager, so scratch and function lookups happen outside the capture), replayed 5 times."""
    be.launch("attention", stream, out=out, **args)
    be.synchronize(stream)
    be.begin_capture(stream)
    for _ in range(reps):
        be.launch("attention", stream, out=out, **args)
    graph = be.end_capture(stream)
    be.launch_graph(graph, stream)
    be.synchronize(stream)
    start = time.perf_counter()
    for _ in range(5):
        be.launch_graph(graph, stream)
    be.synchronize(stream)
    seconds = (time.perf_counter() - start) / (5 * reps)
    be.destroy_graph(graph)
    return seconds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    be, _ = Registry(env={}).create_backend(a.backend)
    stream = be.create_stream()
    try:
        for shape, (n_heads, n_kv, hd) in SHAPES.items():
            layout = vt.KVLayout(n_layers=1, n_slots=129, max_len=1024, n_kv_heads=n_kv,
                                 head_dim=hd)  # fmt: skip
            cache = be.alloc(layout.nbytes)
            be.copy_h2d(cache, np.random.default_rng(0).standard_normal(layout.shape, np.float32))
            print(f"{shape}: {n_heads} heads, {n_kv} KV heads, head_dim {hd}")
            print(f"{'rows':>8} {'n':>5} {'split us':>9} {'tiled us':>9} {'split/tiled':>11} "
                  f"{'max |diff|':>10}")  # fmt: skip
            for kind, counts in ROWS.items():
                for n in counts:
                    slots, pos = rows(kind, n)
                    q = np.random.default_rng(n).standard_normal((n, n_heads * hd), np.float32)
                    bufs = [be.alloc(q.nbytes) for _ in range(3)] + [be.alloc(4 * n) for _ in "sp"]
                    for buf, host in ((bufs[0], q), (bufs[3], slots), (bufs[4], pos)):
                        be.copy_h2d(buf, host)
                    args = {
                        "q": vt.Tensor.of(bufs[0], np.float32, *q.shape),
                        "cache": vt.Tensor.of(cache, np.float32, *layout.shape),
                        "slots": vt.Tensor.of(bufs[3], np.int32, n),
                        "positions": vt.Tensor.of(bufs[4], np.int32, n),
                        "layout": layout, "layer": 0, "n_heads": n_heads, "scale": 1 / 8,
                    }  # fmt: skip
                    us, outs = [], []
                    for k, min_rows in enumerate((1 << 30, 1)):  # split, then tiled
                        be.attention_tiled_min_rows = min_rows
                        out = vt.Tensor.of(bufs[1 + k], np.float32, *q.shape)
                        us.append(timed(be, stream, args, out, a.reps))
                        outs.append(np.empty_like(q))
                        be.copy_d2h(outs[-1], bufs[1 + k])
                    diff = float(np.max(np.abs(outs[0] - outs[1])))
                    print(f"{kind:>8} {n:>5} {us[0]:>9.1f} {us[1]:>9.1f} {us[0] / us[1]:>11.2f} "
                          f"{diff:>10.2e}", flush=True)  # fmt: skip
                    for b in bufs:
                        be.free(b)
            be.free(cache)
    finally:
        be.close()


if __name__ == "__main__":
    main()
