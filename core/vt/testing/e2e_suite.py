"""End to end: a tiny GGUF per architecture and weight type, through vt's ModelRunner.

Each model is written by the kit (:func:`vt.testing.tiny.write_tiny_gguf`), run by
:class:`vt.execution.runner.ModelRunner` on the backend under test (several KV slots, a chunked
prefill, decode steps that take their input id device-side) and compared with
:class:`~vt.testing.numpy_model.NumpyModel`: logits within the weight type's tolerance,
greedy ids equal. A greedy id may differ only at a near-tie, where the backend's pick is
within its allowed logit error of the reference maximum. The model needs the ops its
architecture declares (``vt.model.graph.ARCHITECTURE_OPS``); a fused one the backend lacks
runs as its decomposition (the case's detail names them), a primitive one it lacks fails
the case with the runner's refusal naming the ops.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from ..execution.runner import ModelRunner, SeqChunk
from ..model import load_gguf
from ..model.graph import ARCHITECTURE_OPS, SUPPORTED_ARCHITECTURES
from ..protocol.ops import closure
from .kit import KitCase, KitContext, KitFailure
from .numpy_model import NumpyModel
from .tiny import write_tiny_gguf
from .tolerances import WEIGHT_TYPES, model_tolerance, nmse

#: Prompts per KV slot (slot 1 stays empty: slots need not be dense).
PROMPTS: dict[int, list[int]] = {0: [3, 17, 42, 5, 9, 60, 1, 33, 21], 2: [8, 2, 50]}
PREFILL_CHUNK = 4  # slot 0's first chunk, prefilled without sampling


def _tiny(ctx: KitContext, arch: str, wtype: str) -> tuple[Any, NumpyModel]:
    """The model file (written once per run) and its reference."""

    def make() -> tuple[Any, NumpyModel]:
        path = ctx.shared.root / f"tiny-{arch}-{wtype}.gguf"
        shape: dict[str, int] = {}
        if wtype.endswith("_K"):  # K-quant rows are 256 values
            shape = {"dim": 256, "ffn": 256, "n_heads": 4, "n_kv_heads": 2}
        write_tiny_gguf(path, arch=arch, weight_type=wtype, **shape)
        model = load_gguf(path)
        return model, NumpyModel(model)

    return ctx.shared.memo(("model", arch, wtype), make)


class _Check:
    """Logit and greedy-id comparisons of one model run."""

    def __init__(self, ctx: KitContext, title: str, ref: NumpyModel, wtype: str) -> None:
        self.ctx, self.title, self.ref = ctx, title, ref
        self.tol = model_tolerance(wtype)
        self.wtype = wtype
        self._memo: dict[tuple[int, ...], np.ndarray] = {}

    def ref_last(self, tokens: list[int]) -> np.ndarray:
        key = tuple(tokens)
        if key not in self._memo:
            self._memo[key] = self.ref.logits(tokens)[-1]
        return self._memo[key]

    def logits(self, got: np.ndarray, tokens: list[int], where: str) -> None:
        want = self.ref_last(tokens)
        if not np.isfinite(got).all():
            raise KitFailure(f"{self.title}: {where}: the logits hold NaN or inf")
        err = nmse(got, want)
        if not err <= self.tol:
            raise KitFailure(
                f"{self.title}: {where}: logits differ from the numpy forward: normalized MSE "
                f"{err:.3g} exceeds the {self.wtype} tolerance {self.tol:g}"
            )
        self.ctx.count()

    def greedy(self, got: int, tokens: list[int], where: str) -> None:
        want = self.ref_last(tokens)
        best = int(np.argmax(want))
        # A pick within the allowed logit error of the maximum is a near-tie, not a bug.
        slack = 2.0 * np.sqrt(self.tol) * float(np.sqrt(np.mean(want * want)))
        if got != best and not (0 <= got < want.size and want[best] - want[got] <= slack):
            shown = f"{want[got]:.4f}" if 0 <= got < want.size else "out of range"
            raise KitFailure(
                f"{self.title}: {where}: greedy id {got} differs from the reference's {best} "
                f"(reference logits {shown} vs {want[best]:.4f})"
            )
        self.ctx.count()


def _run_model(ctx: KitContext, title: str, arch: str, wtype: str) -> str:
    model, ref = _tiny(ctx, arch, wtype)
    check = _Check(ctx, title, ref, wtype)
    seqs = {s: list(p) for s, p in PROMPTS.items()}
    with ModelRunner(
        ctx.backend, model, max_slots=3, max_model_len=32, max_batch_tokens=16
    ) as runner:
        # 1. slot 0's first prompt chunk, not sampled
        head = seqs[0][:PREFILL_CHUNK]
        out = runner.execute([SeqChunk(slot=0, start_pos=0, token_ids=head, sample=False)])
        if out.get_output() != {}:
            raise KitFailure(f"{title}: a prefill chunk with sample=False returned ids")
        # 2. the rest of slot 0's prompt and all of slot 2's, batched: logits
        chunks = [
            SeqChunk(slot=0, start_pos=PREFILL_CHUNK, token_ids=seqs[0][PREFILL_CHUNK:]),
            SeqChunk(slot=2, start_pos=0, token_ids=seqs[2]),
        ]
        logits = runner.compute_logits(chunks)
        for row, slot in enumerate((0, 2)):
            check.logits(logits[row], seqs[slot], f"prefill logits of slot {slot}")
            pick = int(np.argmax(logits[row]))
            check.greedy(pick, seqs[slot], f"argmax of slot {slot}'s prefill logits")
            seqs[slot].append(pick)
        # 3. decode with host-given ids: greedy ids sampled on the device
        ids = runner.execute(
            [SeqChunk(slot=s, start_pos=len(seqs[s]) - 1, token_ids=[seqs[s][-1]]) for s in (0, 2)]
        ).get_output()
        for s in (0, 2):
            check.greedy(ids.get(s, -1), seqs[s], f"decode step 1 of slot {s}")
            seqs[s].append(ids[s])
        # 4. decode taking the input id device-side from the previous step
        ids = runner.execute(
            [
                SeqChunk(slot=s, start_pos=len(seqs[s]) - 1, token_ids=None, from_previous=True)
                for s in (2, 0)
            ]
        ).get_output()
        for s in (0, 2):
            check.greedy(ids.get(s, -1), seqs[s], f"decode step 2 (from_previous) of slot {s}")
            seqs[s].append(ids[s])
        # 5. logits after the KV cache has been read across steps
        logits = runner.compute_logits(
            [SeqChunk(slot=s, start_pos=len(seqs[s]) - 1, token_ids=[seqs[s][-1]]) for s in (0, 2)]
        )
        for row, slot in enumerate((0, 2)):
            check.logits(logits[row], seqs[slot], f"decode logits of slot {slot}")
        readback = runner.readback
    n = sum(len(s) for s in seqs.values())
    native, _ = closure(ARCHITECTURE_OPS[arch], ctx.backend.supports)
    decomposed = [op for op in ARCHITECTURE_OPS[arch] if op not in native]
    return (
        f"logits within nmse {check.tol:g} and greedy ids equal over {n} positions in 2 slots "
        f"(readback path {readback}"
        + (f"; decomposed: {', '.join(decomposed)})" if decomposed else ")")
    )


def model_cases() -> list[KitCase]:
    """One case per supported architecture and weight type."""
    return [
        KitCase(
            "model",
            f"{arch}-{wt}",
            "",
            wt,
            partial(_bound, f"model {arch}-{wt}", arch, wt),
        )
        for arch in SUPPORTED_ARCHITECTURES
        for wt in WEIGHT_TYPES
    ]


def _bound(title: str, arch: str, wtype: str, ctx: KitContext) -> str:
    return _run_model(ctx, title, arch, wtype)
