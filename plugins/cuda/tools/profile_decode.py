"""Host time of a decode step on a GPU backend, with graph replay on and off.

    python plugins/cuda/tools/profile_decode.py MODEL.gguf [--backend cuda] [--steps 128]

Runs ``ModelRunner(max_slots=1)`` on MODEL: a 128-token prompt, 8 warm-up decode steps,
then ``--steps`` decode steps, each enqueued one ahead of reading the previous one's id
(async readback), and prints decode tokens/s and milliseconds per step with graphs on and
off, then a ``cProfile`` of the eager steps (the functions with the most own time). Eager
decode is bound by the host: each step launches every kernel from Python.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from vt.execution.runner import ModelRunner, SeqChunk
from vt.management.registry import Registry
from vt.model import load_gguf


def decode(runner: ModelRunner, steps: int, prompt: int = 128) -> tuple[float, list[int]]:
    """Seconds per decode step over ``steps`` steps after 8 warm-up ones, and the ids."""
    ids = [runner.execute([SeqChunk(0, 0, list(range(1, prompt + 1)))]).get_output()[0]]
    pos = prompt

    def step() -> object:
        nonlocal pos
        out = runner.execute([SeqChunk(0, pos, None, from_previous=True)])
        pos += 1
        return out

    pending = step()
    for _ in range(8):
        nxt = step()
        ids.append(pending.get_output()[0])  # type: ignore[attr-defined]
        pending = nxt
    start = time.perf_counter()
    for _ in range(steps):
        nxt = step()
        ids.append(pending.get_output()[0])  # type: ignore[attr-defined]
        pending = nxt
    seconds = (time.perf_counter() - start) / steps
    ids.append(pending.get_output()[0])  # type: ignore[attr-defined]
    return seconds, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    backend, _ = Registry(env={}).create_backend(a.backend)
    ids = {}
    try:
        with load_gguf(a.model) as model:
            for graphs in (True, False):
                with ModelRunner(
                    backend, model, max_slots=1, max_model_len=512, graphs=graphs
                ) as runner:
                    s, ids[graphs] = decode(runner, a.steps)
                    print(
                        f"graphs={'on ' if graphs else 'off'} readback={runner.readback}: "
                        f"{1 / s:.1f} tok/s, {s * 1e3:.2f} ms/step, {runner.graph_stats}"
                    )
            with ModelRunner(backend, model, max_slots=1, max_model_len=512, graphs=False) as r:
                prof = cProfile.Profile()
                prof.enable()
                s, _ = decode(r, a.steps)
                prof.disable()
        print(f"same ids with graphs on and off: {ids[True] == ids[False]}")
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(a.top)
        print(f"cProfile of {a.steps} eager decode steps ({s * 1e3:.2f} ms/step under it):")
        print(text.getvalue())
    finally:
        backend.close()


if __name__ == "__main__":
    main()
