"""Decode tok/s of a model on the cpu backend per ``VT_CPU_ACT_BITS``, alternating in one
process (the fair comparison on a shared machine: every setting sees the same minutes).

    python benchmarks/cpu_act_bits.py [MODEL.gguf] [--bits 32,16,8] [--rounds 4]
        [--tokens 64] [--json out.json]

Each round runs every setting once, in a rotated order: a fresh runner (so the setting is
read when the decode step is captured), a 32-token prompt, ``--tokens`` greedy decode
steps timed (the first step's capture excluded). Reports the best tok/s of each setting,
the per-round rates, and how often the thread owner let kernels split over two threads
(``/proc/loadavg`` said a core was idle). ``NUMBA_NUM_THREADS=1`` keeps every kernel on
one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from vt.execution.runner import ModelRunner, SeqChunk
from vt.management.registry import Registry
from vt.model import load_gguf
from vt.model.cache import resolve_model
from vt_cpu import threads


def decode_rate(model, bits: int, tokens: int) -> tuple[float, float]:  # noqa: ANN001
    os.environ["VT_CPU_ACT_BITS"] = str(bits)
    backend, _ = Registry(env={}).create_backend("cpu")
    idle = [0, 0]
    real = threads.Idle.__call__

    def counting(self) -> bool:  # noqa: ANN001
        got = real(self)
        idle[got] += 1
        return got

    threads.Idle.__call__ = counting
    try:
        with ModelRunner(backend, model, max_slots=1, max_model_len=256) as r:
            prompt = [int(t) for t in np.arange(100, 132)]
            logits = r.compute_logits([SeqChunk(slot=0, start_pos=0, token_ids=prompt)])[0]
            pos = len(prompt)
            tok = int(np.argmax(logits))
            logits = r.compute_logits([SeqChunk(slot=0, start_pos=pos, token_ids=[tok])])[0]
            t0 = time.perf_counter()
            for j in range(1, tokens + 1):
                tok = int(np.argmax(logits))
                chunk = SeqChunk(slot=0, start_pos=pos + j, token_ids=[tok])
                logits = r.compute_logits([chunk])[0]
            rate = tokens / (time.perf_counter() - t0)
    finally:
        threads.Idle.__call__ = real
    return rate, idle[1] / max(1, sum(idle))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--bits", default="32,16,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    path = args.model or str(resolve_model("default", progress=False))
    model = load_gguf(path)
    settings = [int(b) for b in args.bits.split(",")]
    rates: dict[int, list[float]] = {b: [] for b in settings}
    split: dict[int, list[float]] = {b: [] for b in settings}
    decode_rate(model, settings[0], 8)  # compile / page in
    for rnd in range(args.rounds):
        order = settings[rnd % len(settings) :] + settings[: rnd % len(settings)]
        for b in order:
            rate, share = decode_rate(model, b, args.tokens)
            rates[b].append(round(rate, 1))
            split[b].append(round(share, 3))
        print(f"round {rnd}: " + "  ".join(f"{b}: {rates[b][-1]:.1f}" for b in settings),
              flush=True)  # fmt: skip
    best = {b: max(v) for b, v in rates.items()}
    base = best.get(32)
    result = {
        "model": path,
        "numba_threads": os.environ.get("NUMBA_NUM_THREADS"),
        "load_average": os.getloadavg(),
        "best_tok_s": best,
        "vs_float32": {b: round(v / base, 3) for b, v in best.items()} if base else None,
        "rounds": rates,
        "share_of_kernel_calls_with_a_core_idle": split,
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
