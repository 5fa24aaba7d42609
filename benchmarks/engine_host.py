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
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="64,256", help="batch sizes, comma-separated")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    batches = [int(b) for b in a.batch.split(",")]

    from fake_gpu import make
    from vt.execution.runner import ModelRunner
    from vt.frontends.bench import _batch
    from vt.frontends.engine import Engine
    from vt.frontends.sampling import SamplingParams
    from vt.model import Tokenizer, load_gguf
    from vt.testing.tiny import write_tiny_gguf

    params = SamplingParams(max_tokens=a.gen_tokens, temperature=0.0, ignore_eos=True)
    results: dict = {"gen_tokens": a.gen_tokens, "repeat": a.repeat, "us_per_request_step": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_gguf(Path(tmp) / "tiny.gguf", context_length=a.gen_tokens + 16)
        for batch in batches:
            backend, _ = make()
            with load_gguf(path) as model, ModelRunner(backend, model, max_slots=batch) as r:
                engine = Engine(r, Tokenizer.from_model(model), prefix_caching=False)
                row = {}
                for final_only in (False, True):
                    # vt bench's batch run: from the step after which every request has an
                    # id to the last, over the ids generated in it
                    runs = [_batch(engine, batch, [1, 2, 3, 4], params, final_only=final_only)
                            for _ in range(a.repeat)]  # fmt: skip
                    best = min(r.decode_s / r.decode_tokens for r in runs if r.decode_s)
                    row["final_only" if final_only else "every_step"] = round(best * 1e6, 2)
                results["us_per_request_step"][str(batch)] = row
                print(f"batch {batch}: {row}", file=sys.stderr, flush=True)
            backend.close()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
