"""Do requests with the same prompt generate the same greedy ids in one batch, and if not,
where do they part and what differed in the steps that computed them?

    python benchmarks/gpu_batch_invariance.py MODEL.gguf [--backend cuda] [--batch 8,32]
        [--prompt-tokens 128] [--gen-tokens 128] [--schedules default,one] [--out FILE]

For each batch B and each schedule, B requests of ``vt bench``'s prompt are added at once to
an engine without prefix caching (as ``vt bench --batch`` runs them, async scheduling on)
and stepped to the end. ``default``: the backend's tokens per step (on a GPU 512, so B
prompts of 128 tokens are prefilled over several steps, some mixed with the first decode
rows, and requests finish on different steps); ``one``: ``B * prompt`` tokens per step, so
every prompt is prefilled in one step and every request sees the same steps; a number: that
many tokens per step.

Each step's shape is recorded (the rows its forward pass ran, decode steps padded to
their bucket, and its sampled rows: the GPU backend picks its kernels by these: gemv for 1
row, float32 warp kernels for 2-7, int8 activations from 8, cuBLAS from 64, attention split
by the grid it fills, the output projection over the sampled rows). A request's *history*
up to its generated token i is the shapes of the steps that computed its prompt and
tokens 0..i, with its own rows' count in each. Printed per (B, schedule), and as JSON:

- ``groups``: how many distinct id sequences, and how many distinct histories;
- ``deterministic``: requests whose histories are equal generated equal ids (False would be
  a bug: the same computation giving different results);
- ``explained``: every request whose ids part from request 0's at token i has a history
  that differs from request 0's at or before token i;
- per request that parts from request 0: the token, and the first step shape that differed.

The recording wraps ``ModelRunner._enqueue`` (a private method: a diagnostic tool, not API).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

Shape = tuple[int, int, int]  # (forward rows, sampled rows, this request's rows)


def run_batch(
    be: Any, model_file: Any, tokenizer: Any, batch: int, prompt: list[int], gen: int,
    tokens_per_step: int | None,
) -> dict[str, Any]:  # fmt: skip
    from vt.execution.runner import DEFAULT_MAX_MODEL_LEN, ModelRunner, batch_tokens
    from vt.frontends.engine import Engine
    from vt.frontends.sampling import SamplingParams

    runner = ModelRunner(
        be, model_file, max_slots=batch,  # max_model_len as vt bench's
        max_model_len=min(model_file.config.context_length, DEFAULT_MAX_MODEL_LEN),
        max_batch_tokens=batch_tokens(be, tokens_per_step), async_scheduling=True,
    )  # fmt: skip
    steps: list[tuple[int, int, list[tuple[int, int, bool]]]] = []
    enqueue = runner._enqueue

    def recording(chunks: list[Any]) -> Any:
        out, plan = enqueue(chunks)
        rows = [(c.slot, c.n_tokens, c.sample) for c in plan.chunks]
        steps.append((plan.rows or plan.n_tokens, len(plan.sampled), rows))
        return out, plan

    runner._enqueue = recording  # type: ignore[method-assign]
    try:
        engine = Engine(runner, tokenizer, prefix_caching=False)
        params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for _ in range(batch):  # compile and capture outside the recorded run
            engine.add_request(prompt[:8], warm)
        while engine.has_unfinished():
            engine.step()
        steps.clear()
        t0 = time.perf_counter()
        rids = [engine.add_request(prompt, params) for _ in range(batch)]
        slot: dict[str, int] = {}
        ids: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    ids[out.request_id] = list(out.ids)
            for r in rids:
                req = engine._requests.get(r)
                if r not in slot and req is not None and req.slot is not None:
                    slot[r] = req.slot
        seconds = time.perf_counter() - t0
        max_rows = runner.max_batch_tokens
    finally:
        runner.close()
    # A request's history: per generated token, the shapes of the steps up to its sampling.
    histories: list[list[tuple[Shape, ...]]] = []
    for r in rids:
        events: list[Shape] = []
        per_token: list[tuple[Shape, ...]] = []
        for rows, sampled, chunks in steps:
            for s, n, samples in chunks:
                if s == slot[r]:
                    events.append((rows, sampled, n))
                    if samples:
                        per_token.append(tuple(events))
        histories.append(per_token[: len(ids[r])])
    seqs = [ids[r] for r in rids]
    return analyse(batch, tokens_per_step or max_rows, seqs, histories, steps, seconds)


def first_difference(a: list[Any], b: list[Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def analyse(
    batch: int, tokens_per_step: int, seqs: list[list[int]],
    histories: list[list[tuple[Shape, ...]]], steps: list[Any], seconds: float,
) -> dict[str, Any]:  # fmt: skip
    full = [h[-1] if h else () for h in histories]
    by_history: dict[tuple[Shape, ...], set[tuple[int, ...]]] = {}
    for h, s in zip(full, seqs, strict=True):
        by_history.setdefault(h, set()).add(tuple(s))
    deterministic = all(len(v) == 1 for v in by_history.values())
    parted = []
    explained = True
    for r in range(1, batch):
        tok = first_difference(seqs[r], seqs[0])
        if tok is None:
            continue
        # the first token whose history differs from request 0's
        hist = next(
            (i for i in range(min(len(histories[r]), len(histories[0])))
             if histories[r][i] != histories[0][i]),
            None,
        )  # fmt: skip
        ok = hist is not None and hist <= tok
        explained &= ok
        where = None
        if hist is not None:
            a, b = histories[r][hist], histories[0][hist]
            e = first_difference(list(a), list(b))
            where = {
                "event": e,
                "request": a[e] if e is not None and e < len(a) else None,
                "request0": b[e] if e is not None and e < len(b) else None,
            }
        parted.append({"request": r, "token": tok, "history_differs_at_token": hist,
                       "first_shape_difference": where, "explained": ok})  # fmt: skip
    shapes = sorted({(rows, sampled) for rows, sampled, _ in steps})
    return {
        "batch": batch,
        "tokens_per_step": tokens_per_step,
        "steps": len(steps),
        "seconds": round(seconds, 3),
        "distinct_ids": len({tuple(s) for s in seqs}),
        "distinct_histories": len(by_history),
        "same_ids": len({tuple(s) for s in seqs}) == 1,
        "deterministic": deterministic,
        "explained": explained,
        "parted": parted,
        "step_shapes": shapes,  # (forward rows, sampled rows) of every step seen
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--batch", default="8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--schedules", default="default,one", help="default, one, or N tokens a step")
    ap.add_argument("--out")
    args = ap.parse_args()
    from vt.frontends.bench import bench_prompt
    from vt.management import registry
    from vt.model import Tokenizer, load_gguf

    be, _ = registry.create_backend(args.backend)
    results = []
    try:
        with load_gguf(args.model) as model_file:
            tokenizer = Tokenizer.from_model(model_file)
            prompt = bench_prompt(tokenizer, args.prompt_tokens)
            for b in (int(x) for x in args.batch.split(",")):
                for sched in args.schedules.split(","):
                    per_step = {"default": None, "one": b * len(prompt)}.get(sched)
                    per_step = int(sched) if per_step is None and sched.isdigit() else per_step
                    res = run_batch(be, model_file, tokenizer, b, prompt, args.gen_tokens, per_step)
                    res["schedule"] = sched
                    results.append(res)
                    short = {k: v for k, v in res.items() if k not in ("parted", "step_shapes")}
                    print(json.dumps(short), flush=True)
                    for p in res["parted"]:
                        print("   ", json.dumps(p), flush=True)
                    print("    step shapes (rows, sampled):", res["step_shapes"], flush=True)
    finally:
        be.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(0)


if __name__ == "__main__":
    main()
