"""Decode steps with the cpu backend's graphs replayed as native programs or op by op.

One process, two runners on one backend (``VT_CPU_PROGRAM=1`` and ``0`` while each
captures), alternating rounds; each round prefills a prompt and times ``--steps`` decode
steps. Prints JSON: per setting the best and median milliseconds a step, and how many
replays of the program ran natively.

    python benchmarks/cpu_program.py [--model PATH] [--rounds 12] [--steps 64] [--rows 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from vt.execution.runner import ModelRunner, SeqChunk
from vt.management.trust import open_verified_backend
from vt.model import load_gguf
from vt.model.cache import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: vt's default model)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps a round")
    ap.add_argument("--rows", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    args = ap.parse_args()
    backend, _, _ = open_verified_backend("cpu", verify=None)
    model = load_gguf(resolve_model(args.model))
    prompt = list(range(100, 100 + args.prompt_tokens))
    runners = {
        flag: ModelRunner(
            backend, model, max_slots=args.rows, max_model_len=1024, async_scheduling=False
        )  # fmt: skip
        for flag in ("1", "0")
    }
    ms: dict[str, list[float]] = {"1": [], "0": []}
    for i in range(args.rounds):
        for flag in ("1", "0") if i % 2 == 0 else ("0", "1"):
            os.environ["VT_CPU_PROGRAM"] = flag  # read when a step is captured
            r = runners[flag]
            for s in range(args.rows):
                r.free_slot(s)
            r.execute([SeqChunk(s, 0, prompt) for s in range(args.rows)]).get_output()
            pos = len(prompt)

            def step(r: ModelRunner = r) -> None:
                nonlocal pos
                r.execute(
                    [SeqChunk(s, pos, None, from_previous=True) for s in range(args.rows)]
                ).get_output()
                pos += 1

            for _ in range(4):  # captured on the second, replayed from then on
                step()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            ms[flag].append(1e3 * (time.perf_counter() - t0) / args.steps)
    native = sum(
        getattr(fn, "native_runs", 0)
        for g in runners["1"]._graphs._graphs.values()
        for _, fn, _ in g.handle.ops
    )
    out = {
        "model": str(model.path),
        "rows": args.rows,
        "rounds": args.rounds,
        "steps": args.steps,
        "program": {
            "best_ms": min(ms["1"]),
            "median_ms": statistics.median(ms["1"]),
            "native_replays": native,
            "all_ms": ms["1"],
        },  # fmt: skip
        "op_by_op": {
            "best_ms": min(ms["0"]),
            "median_ms": statistics.median(ms["0"]),
            "all_ms": ms["0"],
        },  # fmt: skip
    }
    out["speedup_median"] = out["op_by_op"]["median_ms"] / out["program"]["median_ms"]
    for r in runners.values():
        r.close()
    backend.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
