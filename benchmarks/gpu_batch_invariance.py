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
by the grid it fills, the output projection over the sampled rows; in a step of 64+ rows,
a tile of rows of three or more sequences on ``attention_split``, the others on the tiled
kernel). A request's *history* up to its generated token i is the shapes of the steps that
computed its prompt and tokens 0..i, with its own rows' count in each, and how many of
them took ``attention_split``. Printed per (B, schedule), and as JSON:

- ``groups``: how many distinct id sequences, and how many distinct histories;
- ``deterministic``: requests whose histories are equal generated equal ids (False would be
  a bug: the same computation giving different results);
- ``explained``: every request whose ids part from request 0's at token i has a history
  that differs from request 0's at or before token i;
- per request that parts from request 0: the token, and the first step shape that differed;
- ``repeats_equal``: ``--repeat`` runs of the same batch and schedule (a new runner each)
  generated the same ids, request by request.

The recording wraps ``ModelRunner._enqueue`` (a private method: a diagnostic tool, not API).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

#: (forward rows, sampled rows, this request's rows, of them on attention_split)
Shape = tuple[int, int, int, int]


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

    split = split_rows_of(be, model_file.config)

    def recording(chunks: list[Any]) -> Any:
        out, plan = enqueue(chunks)
        n = plan.rows or plan.n_tokens
        slots = [c.slot for c in plan.chunks]
        on_split = split(n, slots, plan.row0, [c.n_tokens for c in plan.chunks])
        rows = [
            (c.slot, c.n_tokens, c.sample, k) for c, k in zip(plan.chunks, on_split, strict=True)
        ]
        steps.append((n, len(plan.sampled), rows))
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
            for s, n, samples, on_split in chunks:
                if s == slot[r]:
                    events.append((rows, sampled, n, on_split))
                    if samples:
                        per_token.append(tuple(events))
        histories.append(per_token[: len(ids[r])])
    seqs = [ids[r] for r in rids]
    return analyse(batch, tokens_per_step or max_rows, seqs, histories, steps, seconds)


def split_rows_of(be: Any, config: Any) -> Any:
    """``split(rows, slots, row0, counts)``: per chunk of a step, how many of its rows take
    ``attention_split`` rather than the tiled prefill kernel, by the GPU backend's rule (a
    step of ``attention_tiled_min_rows`` rows or more: tiles of rows of at most two
    sequences on the tiled kernel; every row of a smaller step on the split kernel). A
    backend without that rule: -1 per chunk."""
    tiled = getattr(be, "_tiled_attention_kernel", None)
    min_rows = getattr(be, "attention_tiled_min_rows", None)

    def split(n: int, slots: list[int], row0: list[int], counts: list[int]) -> list[int]:
        if tiled is None or min_rows is None:
            return [-1] * len(slots)
        if n < min_rows:
            return list(counts)
        _, tile = tiled(n, config.n_heads, config.head_dim)
        owner = [-1] * n
        for s, r0, k in zip(slots, row0, counts, strict=True):
            owner[r0 : r0 + k] = [s] * k
        many = {t for t in range(-(-n // tile))
                if len({o for o in owner[t * tile : (t + 1) * tile] if o >= 0}) > 2}  # fmt: skip
        return [sum(1 for i in range(r0, r0 + k) if i // tile in many)
                for r0, k in zip(row0, counts, strict=True)]  # fmt: skip

    return split


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
        "ids": seqs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--batch", default="8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--schedules", default="default,one", help="default, one, or N tokens a step")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each batch and schedule")
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
                    runs = [
                        run_batch(be, model_file, tokenizer, b, prompt, args.gen_tokens, per_step)
                        for _ in range(args.repeat)
                    ]
                    res = runs[0]
                    res["schedule"] = sched
                    # the same batch and schedule again: the same ids (a new runner each time)
                    res["repeats_equal"] = all(r["ids"] == res["ids"] for r in runs)
                    results.append(res)
                    long = ("parted", "step_shapes", "ids")
                    short = {k: v for k, v in res.items() if k not in long}
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
