"""Decode on the cpu backend with two values of a setting, alternating in one process.

    python benchmarks/cpu_decode_ab.py --model 1b.gguf --set vt_cpu.kernels.q8.NAME=0,1
    python benchmarks/cpu_decode_ab.py --model 1b.gguf --set env:VT_CPU_ACT_BITS=16,8

One process and one backend; a runner per value, built (and its decode step captured) with
the value set, which is set again before each of its turns (ops bind their kernels when a
step is captured, so a module value read then takes effect). Each round prefills the same
prompt and decodes ``--gen`` tokens greedily with each runner, the order flipping every
round; the best and median tok/s of each and their ids are printed as JSON (the same ids
in both, or the setting changed the numerics). The sixth session's per-32 against per-256
K-quant comparison was this loop over a module flag that chose the kernels (since gone).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
from typing import Any

from vt.execution.runner import ModelRunner, SeqChunk
from vt.management.trust import open_verified_backend
from vt.model import load_gguf
from vt.model.cache import resolve_model


def _setter(target: str) -> Any:  # noqa: ANN401
    """A function setting ``MODULE.NAME`` (an int) or ``env:NAME`` (a string) to a value."""
    if target.startswith("env:"):
        name = target[4:]
        return lambda v: os.environ.__setitem__(name, str(v))
    module_name, name = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise SystemExit(f"--set {target}: {module_name} has no {name}")
    return lambda v: setattr(module, name, type(getattr(module, name))(v))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: vt's default model)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=16, help="decoded tokens a turn")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--set", required=True, metavar="MODULE.NAME=A,B or env:NAME=A,B")
    args = ap.parse_args()
    target, _, values_text = args.set.partition("=")
    values = values_text.split(",")
    if len(values) != 2:
        raise SystemExit("--set: give two values, A,B")
    put = _setter(target)
    backend, _, _ = open_verified_backend("cpu", verify=None)
    model = load_gguf(resolve_model(args.model))
    prompt = [100 + i % 1000 for i in range(args.prompt)]
    runners = {}
    for v in values:
        put(v)
        runners[v] = ModelRunner(backend, model, max_slots=1,
                                 max_model_len=args.prompt + args.gen + 8,
                                 max_batch_tokens=max(256, args.prompt),
                                 async_scheduling=False)  # fmt: skip

    def decode(v: str) -> tuple[float, list[int]]:
        put(v)
        r = runners[v]
        r.free_slot(0)
        tok = r.execute([SeqChunk(0, 0, prompt)]).get_output()[0]
        ids = [tok]
        t0 = time.perf_counter()
        for j in range(args.gen):
            tok = r.execute([SeqChunk(0, args.prompt + j, [tok])]).get_output()[0]
            ids.append(tok)
        return args.gen / (time.perf_counter() - t0), ids

    try:
        for v in values:
            decode(v)  # compile, capture
        rates: dict[str, list[float]] = {v: [] for v in values}
        ids: dict[str, list[int]] = {}
        for i in range(args.rounds):
            for v in values if i % 2 == 0 else values[::-1]:
                rate, ids[v] = decode(v)
                rates[v].append(rate)
            print(i, {v: round(rates[v][-1], 2) for v in values},
                  f"load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    finally:
        for r in runners.values():
            r.close()
        backend.close()
    out: dict[str, Any] = {"model": str(model.path), "set": args.set, "gen": args.gen}
    for v in values:
        out[v] = {"best_tok_s": max(rates[v]), "median_tok_s": statistics.median(rates[v]),
                  "rounds": [round(x, 2) for x in rates[v]], "ids": ids[v]}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
