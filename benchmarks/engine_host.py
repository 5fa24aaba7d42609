"""The host's time a decode step costs per request, through the engine and the runner.

    python benchmarks/engine_host.py [--batch 64,256] [--gen-tokens 64] [--repeat 3]

At large batches a GPU step's kernels take less time than the Python around them (run
146, H100: the 135M and 1B shapes both took about 30 us a request a step at batches of
128-256, so the step's pace was the host's). This runs vt's real engine and
``ModelRunner`` on the fake GPU backend of the tests (``tests/fake_gpu.py``: every launch
and graph replay recorded, nothing computed), so all that is measured is that host work:
scheduling, the runner's checks and staging, the graph replay's call, the readback, the
engine's per-token bookkeeping and its outputs. For each batch size B, B greedy requests
of a tiny model run to ``--gen-tokens`` ids, with every output a step (streaming: vt serve
with ``stream``) and ``final_only`` (``LLM.generate``, ``vt bench``, a non-streaming
answer); the best of ``--repeat`` runs, microseconds per request per decode step. Prints
JSON.

On a real backend (``--backend cuda --model PATH``; async scheduling on, as ``vt bench``
starts) the figure is the whole step's, the GPU's time and the host's overlapped, so at
batches where it matches the fake backend's the host sets the pace. ``--profile N`` adds
each setting's N functions of most own time (cProfile over one more run; microseconds a
request a step, so the two settings and the two backends compare line by line): where the
host's time goes, and how long it waits on the GPU (the readback's wait).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def profile_rows(prof: cProfile.Profile, request_steps: int, top: int) -> list[dict]:
    """The ``top`` functions by own time, microseconds a request a step."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "calls": calls,
            "own_us": round(own / request_steps * 1e6, 3),
            "cum_us": round(cum / request_steps * 1e6, 3),
        }
        for (file, line, name), (_, calls, own, cum, _) in rows
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="64,256", help="batch sizes, comma-separated")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--backend", default="fake", help="fake (the tests' fake GPU, the default) or a vt backend"
    )
    ap.add_argument("--model", help="a GGUF file (default: a tiny model written for the run)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="top N functions")
    a = ap.parse_args()
    batches = [int(b) for b in a.batch.split(",")]

    from fake_gpu import make
    from vt.execution.runner import ModelRunner
    from vt.frontends.bench import _batch, bench_prompt
    from vt.frontends.engine import Engine
    from vt.frontends.sampling import SamplingParams
    from vt.management.registry import create_backend
    from vt.model import Tokenizer, load_gguf
    from vt.testing.tiny import write_tiny_gguf

    params = SamplingParams(max_tokens=a.gen_tokens, temperature=0.0, ignore_eos=True)
    results: dict = {
        "backend": a.backend,
        "model": a.model or "tiny",
        "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens,
        "repeat": a.repeat,
        "us_per_request_step": {},
        "profile": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        length = a.prompt_tokens + a.gen_tokens + 16
        path = (
            Path(a.model)
            if a.model
            else write_tiny_gguf(Path(tmp) / "t.gguf", context_length=length)
        )
        for batch in batches:
            backend = make()[0] if a.backend == "fake" else create_backend(a.backend)[0]
            with (
                load_gguf(path) as model,
                ModelRunner(backend, model, max_slots=batch, max_model_len=length) as r,
            ):
                tokenizer = Tokenizer.from_model(model)
                prompt = bench_prompt(tokenizer, a.prompt_tokens)
                engine = Engine(r, tokenizer, prefix_caching=False)
                _batch(engine, batch, prompt, params, 4)  # graphs captured, kernels loaded
                row = {}
                for final_only in (False, True):
                    key = "final_only" if final_only else "every_step"
                    # vt bench's batch run: from the step after which every request has an
                    # id to the last, over the ids generated in it
                    runs = [_batch(engine, batch, prompt, params, final_only=final_only)
                            for _ in range(a.repeat)]  # fmt: skip
                    best = min(r.decode_s / r.decode_tokens for r in runs if r.decode_s)
                    row[key] = round(best * 1e6, 2)
                    if a.profile:
                        prof = cProfile.Profile()
                        prof.enable()
                        t = _batch(engine, batch, prompt, params, final_only=final_only)
                        prof.disable()
                        # every request and step of the run, prefill too: the run's total
                        steps = max(1, t.tokens)
                        results["profile"].setdefault(str(batch), {})[key] = profile_rows(
                            prof, steps, a.profile
                        )
                results["us_per_request_step"][str(batch)] = row
                print(f"batch {batch}: {row}", file=sys.stderr, flush=True)
            backend.close()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    from vt.errors import VtError

    try:
        main()
    except (VtError, OSError, ValueError) as exc:  # a bad --backend or --model: one line
        sys.exit(f"engine_host.py: {exc}")
