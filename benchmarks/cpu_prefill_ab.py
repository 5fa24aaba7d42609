"""One prefill on the cpu backend with the code's settings against a variant, alternating.

A variant sets module-level tuning values of ``vt_cpu`` for its turns, e.g.::

    python benchmarks/cpu_prefill_ab.py --tokens 128 --set vt_cpu.weights.TILE_ELEMENTS=131072
    python benchmarks/cpu_prefill_ab.py --model 1b.gguf --tokens 64 \\
        --set "vt_cpu.ops.KERNEL_MAX_ROWS[Q4_K]=32" --set vt_cpu.ops.ATTENTION_KERNEL_MAX_ROWS=32

One process, one runner; each round prefills the same prompt once per setting (the order
flips every round) and the best and median milliseconds of each are printed as JSON with
the prompt's greedy next id (the same in both, or the variant changed the numerics).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import statistics
import time
from typing import Any

from vt.execution.runner import ModelRunner, SeqChunk
from vt.management.trust import open_verified_backend
from vt.model import load_gguf
from vt.model.cache import resolve_model

_SET = re.compile(r"^(?P<module>[\w.]+)\.(?P<name>\w+)(\[(?P<key>[\w]+)\])?=(?P<value>-?\d+)$")


def _setting(text: str) -> tuple[Any, str, str | None, int]:
    m = _SET.match(text)
    if m is None:
        raise SystemExit(f"--set {text!r}: expected MODULE.NAME=INT or MODULE.NAME[KEY]=INT")
    module = importlib.import_module(m["module"])
    if not hasattr(module, m["name"]):
        raise SystemExit(f"--set {text!r}: {m['module']} has no {m['name']}")
    return module, m["name"], m["key"], int(m["value"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: vt's default model)")
    ap.add_argument("--tokens", type=int, default=128, help="prompt tokens (one chunk)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME[KEY]=INT",
                    help="the variant's value (repeatable)")  # fmt: skip
    args = ap.parse_args()
    if not args.set:
        raise SystemExit("give the variant with --set")
    settings = [_setting(t) for t in args.set]

    def apply(variant: bool, saved: list[Any]) -> None:
        for (module, name, key, value), old in zip(settings, saved, strict=True):
            v = value if variant else old
            if key is None:
                setattr(module, name, v)
            else:
                getattr(module, name)[key] = v

    saved = [getattr(m, n) if k is None else getattr(m, n)[k] for m, n, k, _ in settings]
    backend, _, _ = open_verified_backend("cpu", verify=None)
    model = load_gguf(resolve_model(args.model))
    runner = ModelRunner(
        backend,
        model,
        max_slots=1,
        max_model_len=max(1024, args.tokens + 1),
        max_batch_tokens=max(256, args.tokens),
        async_scheduling=False,
    )
    prompt = [100 + i % 1000 for i in range(args.tokens)]
    ms: dict[str, list[float]] = {"code": [], "variant": []}
    ids: dict[str, int] = {}
    try:
        for i in range(args.rounds):
            for name in ("code", "variant") if i % 2 == 0 else ("variant", "code"):
                apply(name == "variant", saved)
                runner.free_slot(0)
                t0 = time.perf_counter()
                ids[name] = runner.execute([SeqChunk(0, 0, prompt)]).get_output()[0]
                ms[name].append(1e3 * (time.perf_counter() - t0))
    finally:
        apply(False, saved)
        runner.close()
        backend.close()
    out: dict[str, Any] = {"model": str(model.path), "tokens": args.tokens, "set": args.set}
    for name, values in ms.items():
        best = min(values)
        out[name] = {"best_ms": best, "median_ms": statistics.median(values),
                     "best_tok_s": args.tokens / best * 1e3, "next_id": ids[name]}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
