"""Time of a decode step on a GPU backend, with graph replay on and off, per kernel too.

    python plugins/cuda/tools/profile_decode.py [VARIANT...] MODEL.gguf [--backend cuda]
        [--steps 128] [--batch 1] [--kernels] [--no-cprofile] [--prefill N]

VARIANT: ``bench_variant.py``'s options (e.g. ``--overlap 0``: every launch plain, so the
kernels' times add up to the step's).

Runs ``ModelRunner(max_slots=B)`` on MODEL: a 128-token prompt per sequence, 8 warm-up
decode steps of all B sequences, then ``--steps`` decode steps, each enqueued one ahead of
reading the previous one's ids (async readback), and prints decode steps/s, tokens/s and
milliseconds per step with graphs on and off; then (unless ``--no-cprofile``) a ``cProfile``
of the eager steps (the functions with the most own time). ``--kernels``: the GPU time of
each kernel over 16 steps with graphs on, from torch's CUPTI profiler (torch is not a vt
dependency: only where it is installed), as a table per kernel and a sum per step, then
per launch shape (kernel and grid, with registers a thread and achieved occupancy).
``--prefill N`` instead: the wall time of an N-token prefill in one chunk, its kernels, and
(unless ``--no-cprofile``) a ``cProfile`` of 10 such prefills.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from typing import Any

import bench_variant  # this folder's: a GpuBackend variant's leading flags
from vt.execution.runner import ModelRunner, SeqChunk
from vt.management.registry import Registry
from vt.model import load_gguf


class Decoder:
    """B sequences of a 128-token prompt, then decode steps of all of them."""

    def __init__(self, runner: ModelRunner, batch: int, prompt: int = 128) -> None:
        self.runner, self.batch = runner, batch
        toks = list(range(1, prompt + 1))
        first = {}
        for s in range(batch):  # one prefill step per sequence (max_batch_tokens)
            first[s] = runner.execute([SeqChunk(s, 0, toks)]).get_output()[s]
        self.pos = prompt
        # the first decode step takes each id from the host, the others from the device
        self.pending = runner.execute([SeqChunk(s, prompt, [first[s]]) for s in range(batch)])
        self.pos += 1
        self.ids = [first]

    def step(self) -> None:
        chunks = [SeqChunk(s, self.pos, None, from_previous=True) for s in range(self.batch)]
        nxt = self.runner.execute(chunks)
        self.pos += 1
        self.ids.append(self.pending.get_output())
        self.pending = nxt

    def run(self, steps: int) -> float:
        """Seconds per step over ``steps`` steps (after 8 warm-up ones)."""
        for _ in range(8):
            self.step()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - start) / steps

    def finish(self) -> list[dict[int, int]]:
        self.ids.append(self.pending.get_output())
        return self.ids


def kernel_table(runner: ModelRunner, batch: int, steps: int = 16) -> str:
    """GPU time per kernel over ``steps`` replayed decode steps (torch's CUPTI profiler)."""
    d = Decoder(runner, batch)
    d.run(4)
    runner.synchronize()
    table = profiled(lambda: [d.step() for _ in range(steps)], runner, steps, "decode steps")
    d.finish()
    return f"{table.splitlines()[0]}, batch {batch}\n" + "\n".join(table.splitlines()[1:])


def prefill_table(runner: ModelRunner, tokens: int, reps: int = 3) -> str:
    """Wall time and GPU time per kernel of a ``tokens``-token prefill in one chunk."""
    toks = [(7 * i) % 1000 + 1 for i in range(tokens)]

    def prefill() -> None:
        runner.execute([SeqChunk(0, 0, toks)]).get_output()

    for _ in range(2):
        prefill()
    start = time.perf_counter()
    for _ in range(reps):
        prefill()
    wall = (time.perf_counter() - start) / reps
    table = profiled(lambda: [prefill() for _ in range(reps)], runner, reps, "prefills")
    return (
        f"prefill of {tokens} tokens: {wall * 1e3:.2f} ms wall, {tokens / wall:.0f} tok/s\n" + table
    )


def prefill_cprofile(runner: ModelRunner, tokens: int, top: int, reps: int = 10) -> str:
    """``cProfile`` of ``reps`` prefills of ``tokens`` tokens in one chunk: where the host's
    time goes (a small model's prefill is bound by its launches)."""
    toks = [(7 * i) % 1000 + 1 for i in range(tokens)]
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(reps):
        runner.execute([SeqChunk(0, 0, toks)]).get_output()
    prof.disable()
    wall = (time.perf_counter() - start) / reps
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return f"cProfile of {reps} prefills ({wall * 1e3:.2f} ms each under it):\n" + text.getvalue()


def by_grid(trace: dict[str, Any], steps: int) -> list[str]:
    """Lines of a table of a Chrome trace's kernels per (name, grid): what each launch shape
    costs (o, down and the output projection share a kernel), the mean of its faster and of
    its slower half of calls (where two projections share a shape, as o and down do, about
    each one's), its registers a thread and CUPTI's estimate of its achieved occupancy."""
    durs: dict[tuple[str, tuple[int, ...]], list[float]] = {}
    meta: dict[tuple[str, tuple[int, ...]], tuple[float, float]] = {}
    for e in trace.get("traceEvents", []):
        args = e.get("args") or {}
        if e.get("cat") != "kernel" or "grid" not in args:
            continue
        key = (str(e.get("name", "?")), tuple(args["grid"]))
        durs.setdefault(key, []).append(float(e.get("dur", 0.0)))
        meta[key] = (float(args.get("registers per thread", 0)),
                     float(args.get("est. achieved occupancy %", 0.0)))  # fmt: skip
    lines = [f"{'kernel':<28} {'grid':>16} {'per step':>8} {'us/step':>9} {'us each':>8} "
             f"{'fast half':>9} {'slow half':>9} {'regs':>5} {'occ%':>5}"]  # fmt: skip
    for (name, grid), ds in sorted(durs.items(), key=lambda r: -sum(r[1]))[:40]:
        n, us, (regs, occ) = len(ds), sum(ds), meta[name, grid]
        ds = sorted(ds)
        fast, slow = ds[: max(n // 2, 1)], ds[n // 2 :]
        g = "x".join(str(v) for v in grid)
        lines.append(f"{name[:28]:<28} {g:>16} {n / steps:>8.1f} {us / steps:>9.1f} "
                     f"{us / n:>8.2f} {sum(fast) / len(fast):>9.2f} {sum(slow) / len(slow):>9.2f} "
                     f"{regs:>5.0f} {occ:>5.0f}")  # fmt: skip
    return lines


def profiled(work: Any, runner: ModelRunner, steps: int, what: str) -> str:
    """GPU time per kernel of ``work()`` (``steps`` steps), from torch's CUPTI profiler;
    then the same per launch shape (:func:`by_grid`)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        runner.synchronize()
    rows: list[tuple[str, int, float]] = []
    for e in prof.key_averages():
        us = float(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0))
        if us > 0 and e.count:
            rows.append((e.key, e.count, us))
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    lines = [
        f"kernels over {steps} {what}: {total / steps:.1f} us of GPU "
        f"time per step; {sum(r[1] for r in rows) / steps:.0f} launches per step",
        f"{'kernel':<28} {'per step':>8} {'us/step':>9} {'us each':>8} {'share':>6}",
    ]
    for name, count, us in rows[:30]:
        lines.append(
            f"{name[:28]:<28} {count / steps:>8.1f} {us / steps:>9.1f} {us / count:>8.2f} "
            f"{100 * us / total:>5.1f}%"
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            lines += ["per launch shape:", *by_grid(json.load(f), steps)]
    return "\n".join(lines)


def main() -> None:
    sys.argv[1:] = bench_variant.apply(sys.argv[1:])  # a variant's flags, then ours
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--no-cprofile", action="store_true")
    ap.add_argument("--prefill", type=int, default=0, help="profile a prefill of N tokens")
    a = ap.parse_args()
    backend, _ = Registry(env={}).create_backend(a.backend)
    if a.prefill:
        try:
            with load_gguf(a.model) as model, ModelRunner(
                backend, model, max_slots=1, max_model_len=a.prefill + 16,
                max_batch_tokens=a.prefill,
            ) as r:  # fmt: skip
                print(prefill_table(r, a.prefill), flush=True)
                if not a.no_cprofile:
                    print(prefill_cprofile(r, a.prefill, a.top), flush=True)
        finally:
            backend.close()
        return
    ids: dict[bool, Any] = {}
    b = a.batch

    def runner(graphs: bool) -> ModelRunner:
        n = min(512, model.config.context_length)
        return ModelRunner(backend, model, max_slots=b, max_model_len=n, graphs=graphs)

    try:
        with load_gguf(a.model) as model:
            for graphs in (True, False):
                with runner(graphs) as r:
                    d = Decoder(r, b)
                    s = d.run(a.steps)
                    ids[graphs] = d.finish()
                    print(
                        f"batch {b} graphs={'on ' if graphs else 'off'} readback={r.readback}: "
                        f"{1 / s:.1f} steps/s, {b / s:.1f} tok/s, {s * 1e3:.3f} ms/step, "
                        f"{r.graph_stats}",
                        flush=True,
                    )
            print(f"same ids with graphs on and off: {ids[True] == ids[False]}", flush=True)
            if a.kernels:
                try:
                    with runner(True) as r:
                        print(kernel_table(r, b), flush=True)
                except Exception as exc:  # noqa: BLE001 - torch missing or CUPTI refused
                    print(f"no kernel profile: {type(exc).__name__}: {exc}", flush=True)
            if not a.no_cprofile:
                with runner(False) as r:
                    d = Decoder(r, b)
                    prof = cProfile.Profile()
                    prof.enable()
                    s = d.run(a.steps)
                    prof.disable()
                    d.finish()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(a.top)
                print(f"cProfile of {a.steps} eager decode steps ({s * 1e3:.2f} ms/step under it):")
                print(text.getvalue())
    finally:
        backend.close()


if __name__ == "__main__":
    main()
