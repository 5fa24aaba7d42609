"""A machine's first run on a GPU: how long loading a model and its first token take with
nothing in the kernel cache, the modules built one after another or on helper threads.

    python plugins/cuda/tools/first_load.py MODEL.gguf [--backend cuda] [--rounds 2]

Each round runs two fresh processes, ``GpuBackend.parallel_compile`` off then on (the
order flipped every other round), each with ``VT_KERNEL_CACHE=0`` (every module built,
none read from ``VT_HOME/kernels``): ``vt.LLM(MODEL, verify=False)`` (the weights
upload; the kernels build) and one greedy token of a short prompt (where any module still
building is waited for and loaded). Prints one JSON object: per process the seconds of
both parts and their sum, and the mean of each setting's sums.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import vt
from vt.gpu import GpuBackend
GpuBackend.parallel_compile = bool(int(sys.argv[1]))
t1 = time.perf_counter()
llm = vt.LLM(sys.argv[2], backend=sys.argv[3], max_slots=1, verify=False)
t2 = time.perf_counter()
llm.generate(["Why is the sky blue?"], vt.SamplingParams(temperature=0.0, max_tokens=1))
t3 = time.perf_counter()
llm.close()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t2}))
"""


def child(code: str, *args: str) -> dict[str, Any]:
    """The JSON object a fresh Python running ``code`` with ``args`` prints last, with the
    kernel cache off and an empty CUDA compute cache (every module built: NVRTC 13 keeps
    what it compiled in ``~/.nv/ComputeCache`` and answers a second compile in 0.3 s), and
    ``modules_s``: each module's compile seconds, as its stderr announced them."""
    with tempfile.TemporaryDirectory(prefix="vt-nv-") as nv:
        done = subprocess.run(  # the child alone without either cache
            ["env", "VT_KERNEL_CACHE=0", f"CUDA_CACHE_PATH={nv}", sys.executable, "-c", code,
             *args],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    out = {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}
    # each module's compile, as vt.gpu.kernel_cache announces it (whole seconds)
    out["modules_s"] = {m: int(t) for m, t in _READY.findall(done.stderr)}
    return out


#: vt.gpu.kernel_cache's line after a module's build.
_READY = re.compile(r"^vt: \w+ kernels (\S+) ready in (\d+) s", re.M)


def alternate(
    rounds: int, run: Callable[[bool], dict[str, Any]], key: str
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """``run(parallel_compile)`` off then on each round (the order flipped every other
    round): every run, and the mean of ``key`` per setting."""
    if rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {rounds}")
    runs = []
    for r in range(rounds):
        for parallel in (False, True) if r % 2 == 0 else (True, False):
            out = {**run(parallel), "parallel_compile": parallel}
            print(json.dumps(out), file=sys.stderr, flush=True)
            runs.append(out)
    mean = {
        str(p): round(sum(float(x[key]) for x in runs if x["parallel_compile"] is p) / rounds, 2)
        for p in (False, True)
    }
    return runs, mean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    def run(parallel: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        out = child(CHILD, str(int(parallel)), args.model, args.backend)
        out["load_and_first_token_s"] = round(out["load_s"] + out["first_token_s"], 2)
        out["process_s"] = round(time.perf_counter() - t0, 2)
        return out

    runs, mean = alternate(args.rounds, run, "load_and_first_token_s")
    print(json.dumps({"cpus": os.cpu_count(), "runs": runs, "mean_s": mean}, indent=1))


if __name__ == "__main__":
    main()
