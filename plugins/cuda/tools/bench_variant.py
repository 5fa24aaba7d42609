"""Run ``vt`` with a GPU backend variant, to measure what one optimisation buys.

    python plugins/cuda/tools/bench_variant.py --no-fused bench --backend cuda --batch 1,8,32

``--blas-min-rows N``: matmuls of N rows or more go to the vendor BLAS (a huge N: never, so
the backend's own tiled kernel runs prefill); ``--blas-f16`` / ``--blas-tf32``: its inputs
in half precision / TF32 for every weight (``GpuBackend.blas_inputs``; the default "auto"
picks by the weight's size); ``--splits N``: attention splits a row's positions over at
most N blocks (``GpuBackend.attention_max_splits``); ``--min-split N``: each split at least
N positions long (``GpuBackend.attention_min_split``); ``--int8-rows N``: decode batches of N
rows or more on int8 activations (``GpuBackend.int8_min_rows``; a huge N: float32
activations everywhere); ``--int8-values N``: int8 activations only where the op's largest
weight has N values or more (``GpuBackend.int8_min_values``; 0: every quantized weight);
``--int8-mma 0|1``: int8 steps on the dp4a kernels (0) or the tensor-core ones (1;
``GpuBackend.int8_mma``, by default where the device has them); ``--kdefine NAME=VALUE``:
``#define NAME VALUE`` before the kernel source (e.g. ``VT_MMA_U4=4``: the int8 mma
kernels' K blocks a warp loads in one go);
``--tiled-rows N``: attention
of N rows or more on the tiled prefill kernel (``GpuBackend.attention_tiled_min_rows``; a
huge N: every step on ``attention_split``, as before it). ``--no-fused``:
``GpuBackend.native_fused`` is emptied, so ``matmul_add``, ``swiglu``, ``rope_kv_store`` and
``qkv`` run as their decompositions (the launches of before the fused kernels); graphs
on/off is ``VT_GRAPHS``.
Everything after the options is ``vt``'s command line.
"""

from __future__ import annotations

import sys

from vt.frontends import cli
from vt.gpu import GpuBackend
from vt.gpu import backend as backend_module


def _define(name: str, value: str) -> None:
    """``#define name value`` ahead of the kernel source the backend compiles."""
    source = backend_module.kernel_source
    text = f"#define {name} {value}\n" + source()
    backend_module.kernel_source = lambda: text  # type: ignore[assignment]


def main() -> None:
    args = sys.argv[1:]
    while args[:1] in (
        ["--no-fused"],
        ["--blas-min-rows"],
        ["--blas-f16"],
        ["--blas-tf32"],
        ["--splits"],
        ["--min-split"],
        ["--int8-rows"],
        ["--int8-values"],
        ["--int8-mma"],
        ["--kdefine"],
        ["--tiled-rows"],
    ):
        if args[0] == "--no-fused":
            GpuBackend.native_fused = frozenset()
            args = args[1:]
        elif args[0] == "--int8-rows":
            GpuBackend.int8_min_rows = int(args[1])
            args = args[2:]
        elif args[0] == "--kdefine":
            name, _, value = args[1].partition("=")
            _define(name, value)
            args = args[2:]
        elif args[0] == "--int8-mma":
            GpuBackend.int8_mma = bool(int(args[1]))
            args = args[2:]
        elif args[0] == "--int8-values":
            GpuBackend.int8_min_values = int(args[1])
            args = args[2:]
        elif args[0] == "--tiled-rows":
            GpuBackend.attention_tiled_min_rows = int(args[1])
            args = args[2:]
        elif args[0] == "--min-split":
            GpuBackend.attention_min_split = int(args[1])
            args = args[2:]
        elif args[0] == "--splits":
            GpuBackend.attention_max_splits = int(args[1])
            args = args[2:]
        elif args[0] in ("--blas-f16", "--blas-tf32"):
            GpuBackend.blas_inputs = args[0].removeprefix("--blas-")
            args = args[1:]
        else:
            GpuBackend.blas_min_rows = int(args[1])
            args = args[2:]
    sys.argv = ["vt", *args]
    cli.main()


if __name__ == "__main__":
    main()
