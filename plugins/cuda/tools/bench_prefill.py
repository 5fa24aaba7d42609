"""Prefill throughput of GPU backend variants in one process (the kernels compile once).

    python plugins/cuda/tools/bench_prefill.py MODEL.gguf [MODEL.gguf ...] [--tokens 512]
        [--chunks 256,512] [--variants split-tf32,tiled-tf32,tiled-f16] [--reps 5]
        [--profile VARIANT,...]

For each model and chunk size (``max_batch_tokens``): a ``--tokens``-token prompt prefilled
in chunks of that size, as the engine cuts it (each chunk one step, the last one's sampled
id read back), 2 warm-up prefills, then the best wall time of ``--reps``, as tok/s, for each
variant: ``split`` or ``tiled`` attention (``GpuBackend.attention_tiled_min_rows`` 1e9 or
the default), ``tf32``, ``f16`` or ``auto`` cuBLAS inputs (``GpuBackend.blas_inputs``), and with
``-narrow`` the weight copies a value a thread (``GpuBackend.blas_wide_copies``). Prints
whether every variant sampled the same first id. ``--profile VARIANT,...``: afterwards, per
variant, the per-kernel GPU time of a prefill in one chunk of ``--tokens`` (torch's CUPTI
profiler, as ``profile_decode.py --prefill``).
"""

from __future__ import annotations

import argparse
import time

from vt.execution.runner import ModelRunner, SeqChunk
from vt.gpu import GpuBackend
from vt.management.registry import Registry
from vt.model import load_gguf


def apply(backend: GpuBackend, variant: str) -> None:
    """Set the backend's attributes for ``variant``: ``split|tiled``-``tf32|f16``, and
    ``-narrow`` for the BLAS path's copies a value a thread (``blas_wide_copies`` off)."""
    attention, inputs, *rest = variant.split("-")
    backend.attention_tiled_min_rows = (
        type(backend).attention_tiled_min_rows if attention == "tiled" else 1 << 30
    )
    backend.blas_inputs = inputs
    backend.blas_wide_copies = rest != ["narrow"]


def prefill(runner: ModelRunner, tokens: list[int], chunk: int) -> int:
    """One prompt prefilled in chunks of ``chunk``; the sampled id after its last token."""
    out = None
    for start in range(0, len(tokens), chunk):
        out = runner.execute([SeqChunk(0, start, tokens[start : start + chunk])])
    first = out.get_output()[0]
    runner.free_slot(0)
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunks", default="256,512")
    ap.add_argument("--variants", default="split-tf32,tiled-tf32,tiled-f16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", default="")
    a = ap.parse_args()
    backend, _ = Registry(env={}).create_backend(a.backend)
    toks = [(7 * i) % 1000 + 1 for i in range(a.tokens)]
    try:
        for path in a.models:
            with load_gguf(path) as model:
                for chunk in (int(c) for c in a.chunks.split(",")):
                    with ModelRunner(backend, model, max_slots=1, max_model_len=a.tokens + 16,
                                     max_batch_tokens=chunk) as r:  # fmt: skip
                        ids = {}
                        for variant in a.variants.split(","):
                            apply(backend, variant)
                            for _ in range(2):
                                ids[variant] = prefill(r, toks, chunk)
                            best = float("inf")
                            for _ in range(a.reps):
                                start = time.perf_counter()
                                prefill(r, toks, chunk)
                                best = min(best, time.perf_counter() - start)
                            print(f"{path} pp{a.tokens} chunk {chunk} {variant}: "
                                  f"{a.tokens / best:,.0f} tok/s ({best * 1e3:.2f} ms)",
                                  flush=True)  # fmt: skip
                        print(f"{path} chunk {chunk}: first ids {ids}, "
                              f"same: {len(set(ids.values())) == 1}", flush=True)  # fmt: skip
                for variant in filter(None, a.profile.split(",")):
                    from profile_decode import prefill_table

                    apply(backend, variant)
                    with ModelRunner(backend, model, max_slots=1, max_model_len=a.tokens + 16,
                                     max_batch_tokens=a.tokens) as r:  # fmt: skip
                        print(f"{path}, {variant}: {prefill_table(r, a.tokens)}", flush=True)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
