"""Run ``vt`` with a GPU backend variant, to measure what one optimisation buys.

    python plugins/cuda/tools/bench_variant.py --no-fused bench --backend cuda --batch 1,8,32

``--blas-min-rows N``: matmuls of N rows or more go to the vendor BLAS (a huge N: never, so
the backend's own tiled kernel runs prefill); ``--blas-f16`` / ``--blas-tf32``: its inputs
in half precision / TF32 for every weight (``GpuBackend.blas_inputs``; the default "auto"
picks by the weight's size); ``--splits N``: attention splits a row's positions over at
most N blocks (``GpuBackend.attention_max_splits``); ``--min-split N``: each split at least
N positions long (``GpuBackend.attention_min_split``); ``--attention-heads N``: a split
block takes at most N query heads of a KV head at one row (``GpuBackend.attention_max_group``);
``--attention-batch-heads N``: the same at steps of more rows
(``GpuBackend.attention_batch_max_group``, 3 by default);
``--short-context N``: a step whose rows all end within N positions is a context class
of its own (the runner's graphs keyed by it, ``attention_bounded`` launched), and at one
row, where attention is not overlapped, runs it as one launch of
``--short-context-threads`` (512) threads a (row, KV group), no splits
(``GpuBackend.short_context``, 0: off, the default; ``short_context_threads``);
``--deferred-norm-features N``: the deferred norm's projection blocks take N output
features (1, 2, 4; ``GpuBackend.deferred_norm_features``), so N times fewer partial sums
for its consumer's every block to read;
``--attention-threads N``: attention's split and combine blocks of N threads (128, 256 or
512; ``GpuBackend.attention_threads``; with ``--splits 1`` a short context is one launch a
layer on 16 warps at 512);
``--int8-rows N``: decode batches of N
rows or more on int8 activations (``GpuBackend.int8_min_rows``; a huge N: float32
activations everywhere); ``--int8-values N``: int8 activations only where the op's largest
weight has N values or more (``GpuBackend.int8_min_values``; 0: every quantized weight);
``--int8-mma 0|1``: int8 steps on the dp4a kernels (0) or the tensor-core ones (1;
``GpuBackend.int8_mma``, by default where the device has them); ``--int8-mma-first
0|1``: int8 steps of 64 rows on the BLAS or tiled path (0) or the mma kernels (1;
``GpuBackend.int8_mma_first``, by default the mma kernels only without a BLAS);
``--kdefine NAME=VALUE``:
``#define NAME VALUE`` before the kernel source (e.g. ``VT_MMA_U4=4``: the int8 mma
kernels' K blocks a warp loads in one go);
``--blas-keep F``: the BLAS path keeps its weight copies within fraction F of the
device's memory (``GpuBackend.blas_keep_fraction``, and ``CudaBackend``'s, 0.125 by
default; 0: a copy every matmul, as before run 33);
``--blas-lt 0|1``: the CUDA plugin's GEMMs through cublasGemmEx (0, before run 37) or
cuBLASLt plans cached per shape (1, the default; ``vt_cuda.blas.Cublas.use_lt``);
``--gemv N``: one-row steps on the gemv kernels with N (1, 2, 4) features a block
(``GpuBackend.gemv_features``; 0: a warp per feature, the kernels before them);
``--overlap 0|1``: every launch plain (0) or the gemv kernels and rms_norm launched
overlapped with their predecessor (1, the default; ``GpuBackend.overlap_launches``);
``--overlap-attention 0|1``: attention's split and combine kernels launched overlapped
too (the split kernel's K and V rows prefetched into L2 before its wait;
``GpuBackend.overlap_attention``, off by default: every shape);
``--overlap-attention-min-q N``: the same at decode steps where a query row has at least N
values (``GpuBackend.overlap_attention_min_q``, 2048 by default; 0: never);
``--overlap-attention-rows N``: that rule at steps of up to N rows
(``GpuBackend.overlap_attention_max_rows``, 63 by default; 1: one row only);
``--overlap-combine 0|1``: ``attention_combine`` alone launched overlapped
(``GpuBackend.overlap_combine``, off by default);
``--overlap-mma 0|1``: the int8 batch kernels (``quantize_rows``, ``quantize_norm_rows``,
``*_mma*_q8a``) launched overlapped too (``GpuBackend.overlap_mma``, on since run 119);
``--gemv-unroll-k K``: one-row matmuls with K or more inputs on ``matmul_gemvu*_q``
(two passes' loads in flight a thread; ``GpuBackend.gemv_unroll_min_k``, 0: never);
``--gemv-threads N`` / ``--gemv-swiglu-threads N``: threads a gemv block (swiglu's) where
K > 1024 (``GpuBackend.gemv_threads``, ``gemv_swiglu_threads``: 128, 64);
``--gemv-swiglu-features F``: swiglu's gemv blocks take F (1, 2, 4) output features
(``GpuBackend.gemv_swiglu_features``; 0, the default: ``gemv_features``);
``--gemv-wide-rows R``, ``--gemv-wide-features F``, ``--gemv-wide-threads N``: one-row
matmuls of R or more output features (the output projection) on F features a block of N
threads (``GpuBackend.gemv_wide_*``: 32768, 4, 64; R 0: as every gemv);
``--gemv-long-k K``, ``--gemv-long-features F``, ``--gemv-long-threads N``: one-row
gemvs (matmul, swiglu, qkv; the deferred norm's producer too) with K or more inputs (of the
default shapes only the 1B shape's down projection at 4096) on F features a block of N
threads, up to 256 (``GpuBackend.gemv_long_*``: 4096, 4, 256; K 0: never); with
``--gemv-unroll-k`` two passes' loads in flight a thread as well;
``--gemv-x16 R``: one-row gemv blocks of at least R weight rows take x as 16-bit codes
with integer dot products (``GpuBackend.gemv_x16_min_rows``, compiled in as
``-DVT_GV_X16=R``; 0: never; 4, the default since run 125: swiglu's, the long rows' and
the output projection's blocks); ``--gemv-x16-flags F``: only in the modules of layouts
with every one of the ``Q_*`` flags F (``GpuBackend.gemv_x16_layout_flags``; 0x100, the
default: the 4-bit layouts; 0: every layout);
``--norm-late 0|1``: with ``--add-fused`` of the norm ops, their kernels scale the sums at
the end instead of normalising x first (``GpuBackend.norm_late``);
``--norm-quantize 0|1``: at steps on the int8 mma kernels the norm ops normalise and
quantize x in one launch, ``quantize_norm_rows`` (``GpuBackend.norm_quantize``, on since
run 108); ``--norm-quantize-values N``: its blocks pack N values each, a row over K // N
blocks (``GpuBackend.norm_quantize_values``, 256 since run 119; 0: a row a block);
``--mma-rope 0|1``: there, qkv's RoPE and KV store in the epilogue of its mma launch
(``qkv_rope_mma*_q8a``, ``GpuBackend.mma_rope``, on since the thirty-third session) or in
``rope_kv_store`` after it (0);
``--attention-q8a 0|1``: at int8 rows the attention kernel that writes a row also packs it
for the int8 projection after it, which then launches no ``quantize_rows``
(``GpuBackend.attention_q8a``, on) or that projection packs x itself (0);
``--target-blocks N``: attention splits a row's positions (and the 2-7-row kernels their
rows) while the grid has fewer than N blocks (``GpuBackend.target_blocks``, 256);
``--prefetch-bytes B``: the graph hints each layer's o, gate and up weights before its
attention, whose split kernel brings up to B bytes of them into L2 before it waits
(``GpuBackend.prefetch_bytes``; 0, the default: no hint);
``--mma-stage 0|1``: the int8 mma kernels copy their weight codes through shared memory
and load their scales 4 K blocks a lane (GpuBackend.mma_stage, on: ``-DVT_MMA_STAGE=1``,
the same bits) or load both a lane's own (0);
``--mma-sw1-wave B``: 8-row swiglu launches of at least B blocks take
``swiglu_mma1w_q8a``, held to 4 blocks an SM (``GpuBackend.mma_sw1_wave_blocks``, 400
since the thirty-eighth session; 0: never);
``--mma-split B``, ``--mma-split-k K``: int8 mma launches of fewer 16-feature blocks than
B split K over slices of at least K values, the last block of each adding their sums
(``GpuBackend.mma_split_blocks``, 512 since run 119, 0: never; ``mma_split_min_k``, 1024);
``--norm-fold-k K``: at one row the norm ops fold the norm into their gemv kernels,
late-scaled, where the row has at most K values (``GpuBackend.norm_fold_max_k``, 0: never;
1024 by default);
``--drop-fused OP``: that one fused op runs as its decomposition (``qkv_rope_kv_store``:
``qkv`` and ``rope_kv_store``, two launches at batch 1 where the fused op is one);
``--add-fused OP``: that one fused op runs natively (``rms_norm_swiglu``,
``rms_norm_qkv_rope_kv_store``: the norm inside the gemv kernels at batch 1;
``matmul_add_rms_norm``: the next norm in the o and down projections' last block, the
graph's consumers then on the normalised rows; ``matmul_add_rms_norm_swiglu`` and
``matmul_add_rms_norm_qkv_rope_kv_store``, both for the whole effect: the deferred norm,
each projection and the op after its norm as one op, no ``rms_norm`` launch but the first
layer's and the output norm's);
``--attention-cluster 0|1``: at decode on sm_90, attention's split kernel combines its 8
splits in the same launch, a thread-block cluster a (row, group)
(``GpuBackend.attention_cluster``, off by default);
``--last-block-combine 0|1``: attention's split partials combined by a second launch (0,
the default) or by each group's last split block (1;
``GpuBackend.attention_last_block_combine``);
``--compact 0|1``: quantized weights in the wide layout (0: int8 codes and float32 pairs,
as before run 47) or their compact one (1, the default; ``GpuBackend.compact_weights``);
``--layout TYPE=FLAGS``: quantized weights of that GGML type in the layout of those
``vt.gpu.weights`` Q_* flags (``Q8_0=0x800``: int8 codes with float32 scales;
``GpuBackend.layout_overrides``);
``--layout-kernels 0|1``: every launch on the kernels that read a weight's layout at run
time (0) or, where a launch's weights share one, on kernels compiled for it (1, the
default; ``GpuBackend.layout_kernels``);
``--argmax-slice N``: ``sample`` finds a long row's argmax over blocks of N ids
(``sample_argmax``; ``GpuBackend.sample_argmax_slice``, 2048 by default; 0: one block walks
the row, as before run 52);
``--skip-kernel PREFIX`` (a diagnostic, repeatable): the backend launches no kernel whose
name starts with PREFIX, so what that kernel costs in a replayed step shows as the time it
leaves (its outputs are then whatever the buffers held: the tokens are not the model's);
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
from typing import Any

from vt.frontends import cli
from vt.gpu import GpuBackend
from vt.gpu import modules as gpu_modules


def _define(name: str, value: str) -> None:
    """``#define name value`` ahead of the kernel sources the backend compiles."""
    source = gpu_modules.kernel_source

    def defined(parts: tuple[str, ...] = gpu_modules.KERNEL_PARTS) -> str:
        return f"#define {name} {value}\n" + source(parts)

    gpu_modules.kernel_source = defined  # type: ignore[assignment]


def _skip(prefix: str) -> None:
    """No launch of a kernel whose name starts with ``prefix`` (``--skip-kernel``)."""
    launch = GpuBackend._kernel

    def kernel(self: GpuBackend, name: str, *args: Any, **kwargs: Any) -> None:
        if not name.startswith(prefix):
            launch(self, name, *args, **kwargs)

    GpuBackend._kernel = kernel  # type: ignore[method-assign]


def _backend_classes() -> list[type[GpuBackend]]:
    """GpuBackend and the installed plugins' subclasses that set their own defaults."""
    classes: list[type[GpuBackend]] = [GpuBackend]
    try:
        from vt_cuda.backend import CudaBackend
    except ImportError:
        return classes
    return [*classes, CudaBackend]


#: Options taking an integer, and the ``GpuBackend`` attribute each sets.
_NUMBERS = {
    "--blas-min-rows": "blas_min_rows",
    "--blas-f16-values": "blas_f16_min_values",
    "--splits": "attention_max_splits",
    "--target-blocks": "target_blocks",
    "--min-split": "attention_min_split",
    "--attention-heads": "attention_max_group",
    "--attention-batch-heads": "attention_batch_max_group",
    "--attention-threads": "attention_threads",
    "--short-context": "short_context",
    "--short-context-threads": "short_context_threads",
    "--deferred-norm-features": "deferred_norm_features",
    "--int8-rows": "int8_min_rows",
    "--int8-values": "int8_min_values",
    "--tiled-rows": "attention_tiled_min_rows",
    "--gemv": "gemv_features",
    "--overlap": "overlap_launches",
    "--compact": "compact_weights",
    "--layout-kernels": "layout_kernels",
    "--argmax-slice": "sample_argmax_slice",
    "--overlap-attention": "overlap_attention",
    "--overlap-attention-min-q": "overlap_attention_min_q",
    "--overlap-attention-rows": "overlap_attention_max_rows",
    "--overlap-combine": "overlap_combine",
    "--overlap-mma": "overlap_mma",
    "--norm-late": "norm_late",
    "--norm-quantize": "norm_quantize",
    "--mma-rope": "mma_rope",
    "--attention-q8a": "attention_q8a",
    "--mma-split": "mma_split_blocks",
    "--mma-stage": "mma_stage",
    "--mma-sw1-wave": "mma_sw1_wave_blocks",
    "--prefetch-bytes": "prefetch_bytes",
    "--norm-quantize-values": "norm_quantize_values",
    "--mma-split-k": "mma_split_min_k",
    "--gemv-unroll-k": "gemv_unroll_min_k",
    "--norm-fold-k": "norm_fold_max_k",
    "--gemv-threads": "gemv_threads",
    "--gemv-swiglu-threads": "gemv_swiglu_threads",
    "--gemv-swiglu-features": "gemv_swiglu_features",
    "--gemv-wide-rows": "gemv_wide_min_rows",
    "--gemv-wide-features": "gemv_wide_features",
    "--gemv-wide-threads": "gemv_wide_threads",
    "--gemv-long-k": "gemv_long_min_k",
    "--gemv-long-features": "gemv_long_features",
    "--gemv-long-threads": "gemv_long_threads",
    "--gemv-x16": "gemv_x16_min_rows",
}
#: Options whose value may be written in hex (``0x100``).
_FLAGS = {"--gemv-x16-flags": "gemv_x16_layout_flags"}


def apply(args: list[str]) -> list[str]:
    """Set the variant the leading options name; returns the rest (``vt``'s command line)."""
    valued = (*_NUMBERS, *_FLAGS, "--blas-keep", "--blas-lt", "--int8-mma", "--kdefine",
             "--skip-kernel", "--layout", "--drop-fused", "--add-fused", "--last-block-combine",
             "--attention-cluster", "--int8-mma-first")  # fmt: skip
    while args:
        flag = args[0]
        if flag in valued and len(args) < 2:
            raise SystemExit(f"bench_variant: {flag} needs a value")
        threads = ("--attention-threads", "--short-context-threads")
        if flag in threads and args[1] not in map(str, gpu_modules.ATTENTION_THREADS):
            raise SystemExit(
                f"bench_variant: {flag} takes one of {gpu_modules.ATTENTION_THREADS}, not {args[1]}"
            )
        if flag in _NUMBERS:
            setattr(GpuBackend, _NUMBERS[flag], int(args[1]))
        elif flag in _FLAGS:
            try:
                setattr(GpuBackend, _FLAGS[flag], int(args[1], 0))
            except ValueError:
                why = f"bench_variant: {flag} takes flags (0x100), not {args[1]}"
                raise SystemExit(why) from None
        elif flag == "--blas-keep":  # CudaBackend says its own default (0.125)
            for cls in _backend_classes():
                cls.blas_keep_fraction = float(args[1])
        elif flag == "--blas-lt":
            from vt_cuda.blas import Cublas

            Cublas.use_lt = bool(int(args[1]))
        elif flag == "--int8-mma":
            GpuBackend.int8_mma = bool(int(args[1]))
        elif flag == "--int8-mma-first":
            GpuBackend.int8_mma_first = bool(int(args[1]))
        elif flag == "--kdefine":
            name, _, value = args[1].partition("=")
            _define(name, value)
        elif flag == "--skip-kernel":
            _skip(args[1])
        elif flag == "--layout":
            name, _, flags = args[1].partition("=")
            GpuBackend.layout_overrides = (*GpuBackend.layout_overrides, (name, int(flags, 0)))
        elif flag == "--no-fused":
            GpuBackend.native_fused = frozenset()
        elif flag == "--drop-fused":
            GpuBackend.native_fused = GpuBackend.native_fused - {args[1]}
        elif flag == "--add-fused":
            GpuBackend.native_fused = GpuBackend.native_fused | {args[1]}
        elif flag == "--last-block-combine":
            GpuBackend.attention_last_block_combine = bool(int(args[1]))
        elif flag == "--attention-cluster":
            GpuBackend.attention_cluster = bool(int(args[1]))
        elif flag in ("--blas-f16", "--blas-tf32"):
            GpuBackend.blas_inputs = flag.removeprefix("--blas-")
        else:
            return args
        args = args[1 if flag in ("--no-fused", "--blas-f16", "--blas-tf32") else 2 :]
    return args


def main() -> None:
    sys.argv = ["vt", *apply(sys.argv[1:])]
    cli.main()


if __name__ == "__main__":
    main()
