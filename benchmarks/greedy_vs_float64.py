"""Do greedy ids follow a float64 forward? vt's cpu backend (float32 or int8 activations)
and llama.cpp's fixture ids, checked against the argmax of an exact forward pass.

    python benchmarks/greedy_vs_float64.py [MODEL.gguf] [--fixture FIXTURE.json]
        [--variants float,int8,int16] [--out results.json]

For each prompt of the oracle fixture (``tests/fixtures/llama_cpp_greedy.json``, llama.cpp's
greedy ids) each vt variant generates the same number of greedy ids on the cpu backend
(``VT_CPU_ACT_BITS`` 32, 8 or 16, one runner each, in this process). The float64 forward of
``tests/model_support.py`` (whole sequence, no cache, weights dequantized to float64) then
runs over the prompt and each engine's ids: an engine *follows* float64 for as many steps as
its id equals float64's argmax given the same prefix. At the first step where it does not,
the record keeps float64's margin of its own choice over the engine's (how near a tie it
was). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import model_support  # noqa: E402
from model_support import make_backend, numpy_forward  # noqa: E402
from vt.execution.runner import ModelRunner, SeqChunk  # noqa: E402
from vt.model import load_gguf  # noqa: E402
from vt.model.cache import resolve_model  # noqa: E402


def vt_greedy(model, prompts: list[list[int]], n: int, bits: int) -> list[list[int]]:  # noqa: ANN001
    os.environ["VT_CPU_ACT_BITS"] = str(bits)
    out = []
    with ModelRunner(make_backend("cpu"), model, max_slots=1, max_model_len=128) as r:
        for prompt in prompts:
            r.free_slot(0)
            logits = r.compute_logits([SeqChunk(slot=0, start_pos=0, token_ids=prompt)])[0]
            ids = []
            for j in range(n):
                tok = int(np.argmax(logits))
                ids.append(tok)
                if j + 1 < n:
                    chunk = SeqChunk(slot=0, start_pos=len(prompt) + j, token_ids=[tok])
                    logits = r.compute_logits([chunk])[0]
            out.append(ids)
    return out


def follow(model, prompt: list[int], ids: list[int]) -> dict:  # noqa: ANN001
    """How many of ``ids`` equal the float64 argmax given the same prefix."""
    logits = numpy_forward(model, prompt + ids[:-1])[len(prompt) - 1 :]
    for j, tok in enumerate(ids):
        best = int(np.argmax(logits[j]))
        if best != tok:
            margin = float(logits[j, best] - logits[j, tok])
            return {"followed": j, "float64_margin": round(margin, 4)}
    return {"followed": len(ids), "float64_margin": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--fixture", default=str(ROOT / "tests/fixtures/llama_cpp_greedy.json"))
    ap.add_argument("--variants", default="float,int8,int16")
    ap.add_argument("--out")
    args = ap.parse_args()
    path = args.model or str(resolve_model("default", progress=False))
    model = load_gguf(path)
    # one float64 copy of each weight for the whole run
    model_support._f64 = functools.lru_cache(maxsize=None)(model_support._f64)
    fixture = json.loads(Path(args.fixture).read_text())
    records = fixture["records"]
    prompts = [rec["prompt_ids"] for rec in records]
    n = fixture["n_tokens"]
    engines: dict[str, list[list[int]]] = {"llama.cpp": [rec["ids"] for rec in records]}
    seconds = {}
    for v in args.variants.split(","):
        t0 = time.perf_counter()
        engines[f"vt-{v}"] = vt_greedy(model, prompts, n, {"float": 32}.get(v) or int(v[3:]))
        seconds[f"vt-{v}"] = round(time.perf_counter() - t0, 1)
    result: dict = {"model": path, "prompts": len(prompts), "tokens": n, "seconds": seconds}
    for name, all_ids in engines.items():
        per = [follow(model, p, ids) for p, ids in zip(prompts, all_ids, strict=True)]
        result[name] = {
            "prompts_fully_followed": sum(r["followed"] == n for r in per),
            "tokens_followed": sum(r["followed"] for r in per),
            "per_prompt": per,
        }
        print(name, result[name]["prompts_fully_followed"], result[name]["tokens_followed"],
              file=sys.stderr, flush=True)  # fmt: skip
    base = engines.get("vt-float")
    for name, all_ids in engines.items():
        if base and name.startswith("vt-int"):
            same = [x == y for x, y in zip(base, all_ids, strict=True)]
            result[f"{name}_prompts_equal_to_vt_float"] = sum(same)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
