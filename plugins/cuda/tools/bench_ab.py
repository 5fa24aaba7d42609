"""pp512 of one model, alternating variants in fresh processes, to see a change through the
host's noise (the 135M shape's prefill is host-bound; one variant's figure moves by up to
80% between repeats: docs/gpu.md runs 34-36).

    python plugins/cuda/tools/bench_ab.py /tmp/smol.gguf --rounds 3 --prev .whl/prev \
        [--out ab.json]

Variants, in this order every round: ``prev`` (the tree in ``--prev``: its ``core`` and
``plugins/cuda`` ahead on PYTHONPATH, its own bench_variant.py; left out without
``--prev``), then this tree through ``bench_variant.py`` with each of ``--variant`` (default
``lt0="--blas-lt 0"`` and ``lt1="--blas-lt 1"``; a leading ``NAME=VALUE`` word of a variant
sets that environment variable, as h200_checks.sh's ``pgraph`` step does). Each run is ``vt
bench --prompt-tokens 512 --gen-tokens 16 --repeat N --max-model-len 1024 --json`` (N:
``--repeat``, 3; its prefill_tok_s: the best of N, async on and off, and each repeat's in
the JSON); printed a line a run, then the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
BENCH = [
    "bench", "--backend", "cuda", "--prompt-tokens", "512", "--gen-tokens", "16",
    "--max-model-len", "1024", "--json",
]  # fmt: skip


def run(
    script: Path, flags: list[str], model: str, env: dict[str, str], repeat: int
) -> tuple[list[float], list[list[float]]]:
    """prefill_tok_s figures one bench_variant.py run prints (async on, off), and each
    run's per-repeat rates."""
    cmd = [sys.executable, str(script), *flags, *BENCH, "--repeat", str(repeat), "--model", model]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    figures = [float(v) for v in re.findall(r'"prefill_tok_s":\s*([0-9.]+)', done.stdout)]
    if done.returncode or not figures:
        print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
    try:
        each = [r.get("prefill_tok_s_each", []) for r in json.loads(done.stdout)["runs"]]
    except (ValueError, KeyError):
        each = []
    return figures, each


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prev", help="an older tree (core/ and plugins/cuda/)")
    ap.add_argument("--variant", action="append", help="NAME=bench_variant.py flags")
    ap.add_argument("--out", help="append the runs and medians to this JSON file")
    ap.add_argument("--repeat", type=int, default=3, help="prefills a run (best of them)")
    a = ap.parse_args()
    variants: list[tuple[str, Path, list[str], dict[str, str]]] = []
    if a.prev:
        prev = Path(a.prev).resolve()
        path = f"{prev / 'core'}:{prev / 'plugins' / 'cuda'}:{os.environ.get('PYTHONPATH', '')}"
        script = prev / "plugins" / "cuda" / "tools" / "bench_variant.py"
        variants.append(("prev", script, [], {**os.environ, "PYTHONPATH": path}))
    for spec in a.variant or ["lt0=--blas-lt 0", "lt1=--blas-lt 1"]:
        name, _, rest = spec.partition("=")
        words, env = rest.split(), dict(os.environ)
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        variants.append((name, TOOLS / "bench_variant.py", words, env))
    runs: dict[str, list[list[float]]] = {name: [] for name, *_ in variants}
    repeats: dict[str, list[list[list[float]]]] = {name: [] for name, *_ in variants}
    for i in range(a.rounds):
        for name, script, flags, env in variants:
            figures, each = run(script, flags, a.model, env, a.repeat)
            runs[name].append(figures)
            repeats[name].append(each)
            shown = " / ".join(f"{v:,.0f}" for v in figures)
            per = " | ".join(", ".join(f"{v:,.0f}" for v in r if v) for r in each)
            print(f"round {i + 1} {name:>5}: {shown}  (each repeat: {per})", flush=True)
    medians = {
        name: statistics.median([v for r in rs for v in r]) if any(rs) else None
        for name, rs in runs.items()
    }
    for name, med in medians.items():
        print(f"median {name:>5}: {med:,.0f}" if med else f"median {name:>5}: none")
    if a.out:
        path = Path(a.out)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[Path(a.model).stem] = {
            "runs": runs, "repeats": repeats, "medians": medians,
            "bench": [*BENCH, "--repeat", str(a.repeat)],
        }  # fmt: skip
        path.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
