"""GpuTuning: the settings that choose GpuBackend's kernels and paths, with the measurements
that set each default.

A base class of :class:`vt.gpu.backend.GpuBackend`, attributes only: a tool sets them on
``GpuBackend`` (``plugins/cuda/tools/bench_variant.py``) or on an instance before its
first launch. Each comment says what the setting does and which run in ``docs/gpu.md``
decided its default.
"""

from __future__ import annotations

#: Threads a block of attention_split and attention_combine (FA_THREADS in attention.cu).
_FA_THREADS = 128


class GpuTuning:
    """Kernel and path choices of the GPU backend (class attributes; see the module)."""

    #: A model's kernel modules (``vt.gpu.modules``: each group's of every layout, the
    #: weights' groups' per layout) are built on helper threads while its weights upload,
    #: where the runtime can (``GpuRuntime.prebuild``), not one after another at upload: a
    #: machine's first run (nothing in the kernel cache) waits for the longest build, not
    #: their sum (run 134, an H100's machine: the 135M shape 54.1 s -> 27.8 s; run 136, the
    #: kernels in two groups: 57.1 s -> 21.1 s). Loaded on the launching thread, at a first
    #: launch or before a graph capture.
    parallel_compile: bool = True
    #: Batches of at least this many rows use the tiled matmul, smaller ones the warp one
    #: (every decode batch up to 32 rows reads each weight once through the warp kernels).
    tiled_min_rows: int = 64
    #: Batches of at least this many rows go to the vendor BLAS when the runtime has one
    #: (``GpuRuntime.blas``): the tensor cores, over a float32 copy of the weight.
    blas_min_rows: int = 64
    #: What the BLAS path feeds the tensor cores for a non-F32 weight: "tf32" (float32
    #: copies, TF32 products), "f16" (IEEE half copies of the weight and of x: twice the
    #: tensor-core rate, half the bytes; |x| above 65504 becomes inf, as in llama.cpp's
    #: cuBLAS path), or "auto": f16 for weights of at least ``blas_f16_min_values`` values,
    #: TF32 below. 128K values since the thirty-second session (1M before, where the half
    #: copy of x, a launch a matmul, cost an eager prefill's host more than it saved: runs
    #: 17-18): with steps replayed as graphs, the 135M shape's projections (331K-885K
    #: values) in half ran its decode batch of 64 at +12% and its pp512 at +2.5% (run 151,
    #: H100); a float64 forward of the default model with every matmul's x and weight in
    #: half keeps its greedy ids (benchmarks/act_quant_vs_float64.py --floats: 192 of 192).
    #: The tiny test models' weights (at most 77K values) stay TF32.
    blas_inputs: str = "auto"
    blas_f16_min_values: int = 1 << 17
    #: The BLAS path keeps its float32 or half copy of a weight for later matmuls instead of
    #: making it again each time (a launch and a pass over the weight per matmul per
    #: prefill chunk: 210 launches of a 512-token chunk of the 135M shape, whose prefill is
    #: bound by the host's launches), while all kept copies fit this fraction of
    #: ``device_memory()`` (the 1B shape's half copies: 1.9 GB; an H200's eighth: 17.6 GB);
    #: 0, or a plugin that does not say its memory: none kept. 0 here; vt_cuda's backend
    #: sets 0.125 (the kit and gpu_checks.py passed with it on the H200, run 33); HIP has
    #: never run on hardware here, so vt_rocm keeps 0.
    blas_keep_fraction: float = 0.0
    #: A copy is kept only while the device's free memory (``GpuRuntime.memory_info``)
    #: after it still holds a margin for later steps: the larger of these bytes and this
    #: fraction of the device, plus the bytes VMM reservations (the KV cache) have yet to
    #: map, plus room for one more copy of the same size in scratch (where a weight's copy
    #: goes once keeping stops). A runtime that cannot say its free memory keeps none; a
    #: kept copy's allocation that runs out of memory anyway (another process took it)
    #: goes to scratch instead. Either way that matmul, and every later one, runs the path
    #: of ``blas_keep_fraction = 0`` (a copy in scratch each time: the same numerics).
    blas_keep_min_free_bytes: int = 1 << 30
    blas_keep_min_free_fraction: float = 1 / 16
    #: The BLAS path's quantized-weight and x copies 16 (8) values a thread with 128-bit
    #: loads and stores (blas_copies.cu); False: a value a thread (a tool's "before").
    blas_wide_copies: bool = True
    #: Steps of at least ``int8_min_rows`` rows against quantized weights of which the op's
    #: largest has at least ``int8_min_values`` values use int8 activations (x quantized once
    #: per op to blocks of 32, integer products on the tensor cores or dp4a/sdot4), as
    #: llama.cpp does at every batch size; smaller weights keep float32 activations, as the
    #: BLAS path keeps TF32 below ``blas_f16_min_values``. 256K values: every projection of
    #: the 135M shape (the smallest op's largest weight, q, has 331K; +39-49% at batches
    #: 8/32) and the 1B shape (+35-48%) gains (docs/gpu.md run 23), while the tiny test
    #: models (at most 77K values a weight) keep cpu's numerics and greedy ids (run 21).
    int8_min_rows: int = 8
    int8_min_values: int = 1 << 18
    #: Int8 steps of up to 64 rows on the tensor cores (``*_mma{1,2,4,8}_q8a``: mma.sync
    #: with s8 inputs, every weight byte read once for all rows) instead of dp4a
    #: (``*_small*_q8a``). None: where the device has them (NVIDIA sm_80 and later).
    int8_mma: bool | None = None
    #: Int8 steps of ``blas_min_rows`` or ``tiled_min_rows`` rows and more, up to the mma
    #: kernels' 64 (8 tiles: a decode batch of 33-64 requests, padded to its bucket of 64),
    #: stay on the mma kernels: True always; None only where the runtime has no BLAS (the
    #: tiled kernel took those steps: run 146, H100, the 1B shape at batch 64 1,108 tok/s
    #: against 14,172 at batch 32); False never (steps of 64 rows on the BLAS or tiled path).
    int8_mma_first: bool | None = None
    #: The norm ops (``rms_norm_swiglu``, ``rms_norm_qkv_rope_kv_store``) at steps that take
    #: the int8 mma kernels normalise and quantize x in one launch (``quantize_norm_rows``:
    #: the bytes ``rms_norm`` then ``quantize_rows`` leave) instead of two: a launch less a
    #: norm (two a layer, 32 of the 1B shape's step at batch 8 and 32, 60 of the 135M
    #: shape's); the normed float32 row is not written (only the int8 kernels read it).
    #: On, the norm ops are native (as ``norm_fold_max_k`` makes them) to take that path.
    #: Run 108 (H100): the 135M shape +4.1% to +4.5% at batches 8 and 32, the 1B shape
    #: within 0.3%, the same bits; ``bench_variant.py --norm-quantize 0`` turns it off.
    norm_quantize: bool = True
    #: At int8 mma rows, ``rms_norm_qkv_rope_kv_store``'s projections, RoPE and KV store in
    #: one launch (``qkv_rope_mma*_q8a``: rope_kv_store's work in the mma kernel's epilogue,
    #: its bits) where the rotated pairs are (2i, 2i + 1) (Llama's GGUF order; NeoX's pairs
    #: span two of the kernel's 16-feature blocks); False:
    #: ``qkv_mma*_q8a`` then ``rope_kv_store``. One launch fewer a layer at batches 8-64:
    #: run 157 (H100), batch 8 +2.7% and +4.1% on the 1B and 135M shapes, batch 32 +1.5%
    #: and +2.0% (``bench_variant.py --mma-rope 0|1``).
    mma_rope: bool = True
    #: At int8 rows (``int8_min_rows`` up to ``attention_tiled_min_rows``), the attention
    #: kernel that writes a row's output (``attention_split`` at one split,
    #: ``attention_combine``) also writes it packed as ``quantize_rows`` packs x (the
    #: same function on the same floats: the same bytes), and the op after attention, where
    #: its int8 kernels take that output as x, launches no ``quantize_rows``: a launch
    #: fewer a layer at batches 8-63 (the output projection's). Unused, the packing costs
    #: the attention kernel its shuffles and stores. Run 162 (H100): the 135M shape +1.7%,
    #: +2.0% and +2.9% at batches 8, 16 and 32, the 1B shape within noise (-0.9% to +0.6%)
    #: (``bench_variant.py --attention-q8a 0|1``).
    attention_q8a: bool = True
    #: Values a block of ``quantize_norm_rows`` packs: a row's blocks of 32 spread over
    #: K // this many blocks, each computing the row's scale itself (the same bits); 0: a
    #: block a row. Run 113: 4.4 us a call at K = 2,048 against ``rms_norm``'s 2.6, the
    #: quantization's shuffles 8 blocks of 32 deep a warp (``--norm-quantize-values N``).
    #: 256 since run 119, with ``mma_split_blocks`` and ``overlap_mma`` (their note).
    norm_quantize_values: int = 256
    #: Int8 mma launches of fewer 16-feature blocks than this split K over S slices (a
    #: power of two: the most with blocks * S at most this and slices of at least
    #: ``mma_split_min_k`` values), block (b, s) summing slice s and the last of b's
    #: blocks adding the slices' sums in order and running the epilogue: more blocks and
    #: loads in flight where a batch step's o, down and qkv projections have 128-192 blocks
    #: (run 113: 0.4-0.6 TB/s of the H100's 3.35 at batch 32). Not the unsplit kernel's
    #: bits; within the kit's bounds. 0: never (``bench_variant.py --mma-split N``).
    #: Runs 116-120 (H100; docs/gpu.md, twenty-fourth session): 512 with
    #: ``norm_quantize_values`` 256, ``overlap_mma`` and ``VT_MMA_SKIP_ZERO`` (kernels/
    #: matmul_int8.cu), the four on by default together: batches 8 and 32 +15% and +7.5% on the
    #: 1B shape, +17% and +8.5% on the 135M shape; ``mma_split_min_k`` 256 took the 1B
    #: shape's batch 8 to +20% but cost the 135M shape's batch 32 15% (its K = 576 split).
    mma_split_blocks: int = 512
    mma_split_min_k: int = 1024
    #: ``swiglu_mma1_q8a`` launches (8 rows) of at least this many blocks, in a layout of
    #: scales alone (``Q_ONE``: Q8_0, Q4_0, Q6_K, each in its own module), take
    #: ``swiglu_mma1w_q8a``: the same code held to 64 registers, so 4 blocks an SM where
    #: its 72 fit 3 (the H100's and H200's 132 SMs: 396 places, and the 1B shape's 512
    #: blocks ran a second wave of 116). The same bits. Layouts with offsets spill at 64
    #: registers (``sass_count.py``: Q4_1, Q4_K, Q5_K and the module of every layout) and
    #: keep the plain kernel. 0: never. Runs 170-173 (H100; docs/gpu.md, thirty-eighth
    #: session): the 1B Q8_0 shape's batch 8 +3.5%, +4.3% and +6.8% (run 174, this form
    #: against 0: +5.2%); the 135M shape's 96
    #: blocks (one wave either way) -0.3% to -3.4% on the bounded form, so it keeps the
    #: plain one.
    mma_sw1_wave_blocks: int = 400
    #: The int8 mma kernels copy each warp's weight codes through shared memory in 16-byte
    #: pieces, 8 lanes a 128-byte line (``-DVT_MMA_STAGE=1``: kernels/matmul_int8.cu), instead
    #: of each lane loading its 8 bytes of 8 rows: a request to L2 carries a whole line,
    #: not a 32-byte sector; and load their scales 4 K blocks a row a load, handed round by
    #: shuffles. The same fragments and scales, so the same bits (``gpu_checks.py``). On
    #: since runs 168-169 (H100; docs/gpu.md, thirty-sixth session): the 1B shape +6.0%,
    #: +7.0% and +16.9% at batches 8, 16 and 32 (the output projection 137 -> 106 us at
    #: batch 8, 258 -> 198 at 32), the 135M shape +2.9%, +4.0% and 0.0% (run 169; run 168's
    #: -0.5%, -5.1%, -0.4% there within that shape's spread). The codes alone (without the
    #: scales' loads, the thirty-sixth session's setting 1) lost to both at batch 32 and are
    #: gone since the thirty-seventh.
    mma_stage: bool = True
    #: Bytes of the weights the ops after attention read (the op ``prefetch``'s hint: the
    #: output projection's weight whole, then the same leading share of each of gate and
    #: up, their first rows) that attention's split kernel brings into L2 before it waits
    #: (``vt_prefetch_ranges``): attention waits on memory latency with DRAM idle (run 166,
    #: H100: 9 us a layer at batch 1, 16% of the 1B step). 0: the backend does not declare
    #: ``prefetch``, so the graph launches none. Built in the thirty-seventh session.
    prefetch_bytes: int = 0
    #: The decode kernels split rows over more blocks while the grid has fewer than this.
    target_blocks: int = 256
    #: Steps of one row against quantized weights (K a multiple of 16, 16-byte aligned)
    #: run on the gemv kernels (``*_gemv{1,2,4}_q``: a block of 64-128 threads per this
    #: many output features, K split over the whole block) instead of a warp per feature
    #: (``*_small1_q``); 0: the warp kernels (a tool's "before").
    gemv_features: int = 2
    #: Threads a block of those gemv kernels where K > 1024 (64 where K <= 1024). Run 77:
    #: 64 made ``swiglu_gemv2_q`` faster (13.9 -> 12.8 us) but the o, down and qkv kernels
    #: slower, -4% in all on the 1B shape.
    gemv_threads: int = 128
    #: The same for swiglu's gemv kernels (gate and up: twice the weight rows a block):
    #: 64 on the 1B shape +1.1% to +3.2% at batch 1 against 128, in three calls (runs
    #: 78-79, docs/gpu.md); the two-row kernels stay on ``gemv_threads``.
    gemv_swiglu_threads: int = 64
    #: Output features a block of swiglu's gemv kernels (gate and up: twice the weight rows),
    #: 1, 2 or 4; 0: ``gemv_features``. Its 4,096 two-feature blocks on the 1B shape are
    #: about two waves, and it runs at 2.8 TB/s where the output projection's long launch of
    #: the same blocks reaches 3.69 (docs/gpu.md run 85): the setting measures the waves.
    gemv_swiglu_features: int = 0
    #: One-row matmuls whose K is at least this run ``matmul_gemvu*_q``: each thread's
    #: loads of two passes in flight together (a long row, as the 1B shape's down
    #: projection: four passes of 128 threads); 0: never. Run 57 (``bench_variant.py
    #: --gemv-unroll-k 4096``): 1,192.8 against 1,186.4 tok/s on the 1B shape, within noise.
    gemv_unroll_min_k: int = 0
    #: One-row matmuls with at least this many output features (the output projection:
    #: 49,152 or 128,256 rows, tens of thousands of blocks) take ``gemv_wide_features``
    #: features and ``gemv_wide_threads`` threads a block instead: fewer, longer blocks where
    #: the block's own fixed work (its addresses, the sums' shuffles and barrier) is a large
    #: share of a one-pass block (ncu, run 75: SM 76%, DRAM 40%). Runs 76-77: the 1B shape's
    #: output projection 117.9 -> 75.8 us, +6% tok/s at batch 1; 0: as every gemv.
    gemv_wide_min_rows: int = 32768
    gemv_wide_features: int = 4
    gemv_wide_threads: int = 64
    #: One-row gemvs (matmul, swiglu, qkv and their fused forms) with at least this many
    #: inputs (the 1B shape's down projection, K = 8,192: four passes of 128 threads, 1,024
    #: single-wave blocks at 2.3 TB/s, run 85; nothing else of the default shapes) take
    #: ``gemv_long_features`` features and ``gemv_long_threads`` threads a block instead
    #: (up to 256; qkv_rope's kernels at most ``_QKV_ROPE_MAX_THREADS``), the deferred
    #: norm's producer too: fewer passes a thread and more weight rows in flight a pass in
    #: the same one wave; 0: never (``bench_variant.py --gemv-long-k``). Run 106 (H100):
    #: the 1B shape +1.9% at batch 1 (1,348.5 and 1,345.8 against 1,322.6 tok/s twice).
    gemv_long_min_k: int = 4096
    gemv_long_features: int = 4
    gemv_long_threads: int = 256
    #: One-row gemv blocks of at least this many weight rows (swiglu's two features:
    #: four; the long rows and the output projection: four) take x as 16-bit integer codes
    #: with integer dot products (``VT_GV_X16`` in kernels/matmul_gemv.cu, compiled in): each
    #: thread rounds its 16 values of a pass once, under a power-of-two scale, for all its
    #: rows, so a weight value costs about two instructions where the exact dequantization
    #: costs four to five (sass_count.py: ``matmul_gemv4_q``'s pass 127 against 273).
    #: Not the float32 path's roundings: the activations' rounding of vt_cpu's default
    #: integer decode (greedy ids those of an exact forward,
    #: ``benchmarks/act_quant_vs_float64.py``), within the kit's bounds. 0: never. Run 115
    #: (H100, ``bench_variant.py --gemv-x16 R``): the 135M Q4_1 shape +2.7% (R = 4) and
    #: +3.3% (R = 2), the 1B Q8_0 shape -0.3% and -3.2% (its kit and gpu_checks.py passed
    #: at R = 2 in runs 117-118). 4 since run 125, in the layouts ``gemv_x16_layout_flags``
    #: names (see there).
    gemv_x16_min_rows: int = 4
    #: With ``gemv_x16_min_rows`` set, only the layout modules whose layout has every one of
    #: these ``Q_*`` flags (vt.gpu.weights) compile the 16-bit path; 0: every module. 0x100
    #: (``Q_NIB``): the 4-bit layouts on codes and the rest (Q8_0, Q5_K, Q6_K) on the float
    #: path, the form run 115's split asks for (the 135M shape's Q4_1 gained, the 1B shape's
    #: Q8_0 lost). The weights' module of every layout (run-time layouts) then keeps the
    #: float path.
    #: Run 117 (H100, with 0x100): the 135M shape +1.4% (R = 2) and +2.0% (R = 4); runs
    #: 123-124 (H100, R = 4): +2.6% and +3.2%, the 1B Q8_0 shape 0.0%. Run 125 (H200, R =
    #: 4, ``next_calls.sh 4``): the 1B Q4_K_M shape (Q4_K on this path) +8.3%, the 135M
    #: shape +2.4%, the 1B Q8_0 shape 0.0% (every layout, flags 0: +1.0% there, -1.3% on
    #: the H100 in run 123); run 126: its gemv and greedy-id checks on the H200.
    gemv_x16_layout_flags: int = 0x100
    #: The norm ops' gemv kernels (where ``native_fused`` has them) sum x's squares beside
    #: their products and scale the sums at the end (``VT_NORM_LATE``, kernels/matmul_gemv.cu)
    #: rather than normalising x first as ``rms_norm`` rounds it: no serial phase in the
    #: block, not bit-equal to the two launches (within the kit's tolerances). Set before
    #: the first launch. Run 57 (with both norm ops native, ``bench_variant.py --norm-late
    #: 1``): -8.8% on the 1B shape, +4.5% on the 135M shape at batch 1; so off.
    norm_late: bool = False
    #: At one row, the norm ops (``rms_norm_swiglu``, ``rms_norm_qkv_rope_kv_store``) fold
    #: the norm into their gemv kernels, late-scaled (``norm_late``'s kernels), where the
    #: row has at most this many values, and run as ``rms_norm`` then the gemv elsewhere;
    #: 0: only as ``native_fused`` says. The 135M shape (K 576) gains +4.5-8.8% at batch 1
    #: with it, the 1B shape (K 2,048) would lose 8.8% (docs/gpu.md runs 57, 61, 62), and
    #: the kit passed with it on an H200 (run 62), so 1,024 splits the two.
    norm_fold_max_k: int = 1024
    #: Fused ops run natively (the others of vt.FUSED_OPS run as their decomposition);
    #: a tool clears it to measure what the fusion buys. Not yet by default:
    #: ``rms_norm_qkv_rope_kv_store`` and ``rms_norm_swiglu`` (the norm inside the gemv
    #: kernels, bit-equal to the two launches; ``bench_variant.py --add-fused OP``: -13% at
    #: batch 1 on both shapes in run 52, every block waiting on its sum of squares).
    #: ``matmul_add_rms_norm`` neither (its one-row kernel's last block normalises the row;
    #: run 91: -23% and -26% at batch 1 in its first form, docs/gpu.md): natively, the graph
    #: moves every layer's norms into the projections' epilogues.
    #: ``matmul_add_rms_norm_swiglu`` and ``matmul_add_rms_norm_qkv_rope_kv_store`` (the
    #: deferred norm) by default since run 103: at one row where the norm's row is wider
    #: than ``norm_fold_max_k`` (the 1B shape +1.8% to +2.0% at batch 1 on an H100; the
    #: 135M shape's 576 fold instead: -15% deferred), their decomposition elsewhere.
    #: ``attention_bounded`` runs natively (op_attention where no rule of
    #: ``short_context`` applies); the graph launches it only where ``short_context`` is set.
    native_fused: frozenset[str] = frozenset(
        {"matmul_add", "swiglu", "rope_kv_store", "qkv", "qkv_rope_kv_store",
         "matmul_add_rms_norm_swiglu", "matmul_add_rms_norm_qkv_rope_kv_store",
         "attention_bounded"}
    )  # fmt: skip
    #: Attention splits a row's positions over at most this many blocks (flash-decoding)
    #: while the grid has fewer than ``target_blocks``, each split at least this long
    #: (at most FA_MAX_SPLITS = 128 splits, kernels/attention.cu).
    attention_max_splits: int = 32
    attention_min_split: int = 16
    #: Threads a block of attention's split and combine kernels (FA_THREADS, compiled in;
    #: set before the first launch): 128, or 256 / 512 to try more warps a split block, so
    #: that with ``attention_max_splits`` = 1 a short context is one round of the warp path
    #: and one launch a layer (``bench_variant.py --attention-threads 512 --splits 1``).
    #: Runs 100-101 (H100): +6.9% on the 135M shape at 128 positions, -1.5% on the 1B shape;
    #: at 2,048 positions -43% and -25% (-19% and -7% with ``--min-split 128``), and a graph
    #: is replayed at every length: 128 stays.
    attention_threads: int = _FA_THREADS
    #: Short contexts on their own attention (a context class: ``Backend.context_classes``
    #: is ``(short_context,)``). A step whose every row ends within this many positions
    #: launches ``attention_bounded``, and the runner keys its graphs by the class, so such
    #: a graph is never replayed past the bound; at one row, where attention is not
    #: launched overlapped (a query row narrower than ``overlap_attention_min_q``), it runs
    #: as one launch of ``short_context_threads`` threads a (row, KV group): no splits, no
    #: combine (``attention_split`` from a module of its own, ``-DFA_THREADS``). Built for
    #: what runs 100-101 measured for every length (above): +6.9% at 128-256 positions on
    #: the 135M shape. In this form (run 127, H100, 512 positions) it lost: -1.7% at 128-256
    #: positions, -14.5% at 384-512. 0: off, one class (``bench_variant.py --short-context N``).
    short_context: int = 0
    short_context_threads: int = 512
    #: Output features a block of the deferred norm's projection (``matmul_psq_gemv*_q``:
    #: 1, 2 or 4; 0: ``gemv_features``): each block leaves one partial sum of squares, which
    #: every block of the consumer reads (``bench_variant.py --deferred-norm-features N``).
    deferred_norm_features: int = 0
    #: A split block takes at most this many of a KV head's query heads (the largest
    #: divisor of the group up to it, and up to FA_MAXG = 8): fewer heads a block is more
    #: blocks, each with a shorter chain of work a position (``bench_variant.py
    #: --attention-heads N``). 2 since runs 90-91 (batch 1: +1.2% to +5.4% over 8, every
    #: head of a group in one block as before; 1: -3.8% on the 1B shape at 2,048 positions).
    attention_max_group: int = 2
    #: The same at steps of more than one row. 3 since the thirty-ninth session: the 135M
    #: shape's groups of 3 heads go in one block at batches (each K and V row read once for
    #: the group, not three times; runs 176-177, H100: batch 16 +4.8% and +4.6%, batch 32
    #: +0.8% and +0.7%, batch 8 +6.1% and -2.5%, that cell's noise), while the 1B
    #: shape's groups of 4 keep two blocks of 2 (4 heads a block lost 2.0-3.3% at batches
    #: 8-32, run 176). Measured at batches 8, 16 and 32 only (``bench_variant.py
    #: --attention-batch-heads N``).
    attention_batch_max_group: int = 3
    #: Where attention splits a row, the last split block of each (row, KV group) to
    #: finish combines the partials itself (``attention_split`` with its counters) instead
    #: of a second launch (``attention_combine``). Off: measured 2-11% slower at batch 1 on
    #: the H200 (runs 43-46, docs/gpu.md: a serial tail after the slowest split).
    attention_last_block_combine: bool = False
    #: At decode (no tiled rows) on NVIDIA sm_90 and later: attention's split kernel with its
    #: combine in the same launch (``attention_split_cluster``): each (row, KV group)'s
    #: splits, ``FA_CLUSTER`` = 8 of them, are one thread-block cluster whose first block
    #: combines the partials after the cluster's barrier; no ``attention_combine``, no
    #: device-wide counter. The same outputs as 8 splits and the second launch
    #: (``gpu_checks.py``, run 62). Off: within noise on the 1B shape and +5% on the 135M
    #: shape at 128 positions, but -20% and -32% at 2,048, where the default's up to 32
    #: splits spread a row over more blocks (docs/gpu.md run 62).
    attention_cluster: bool = False
    #: Attention of at least this many rows runs on the tiled prefill kernel
    #: (``attention_tiled_*``: a block per tile of consecutive rows and query head, K/V
    #: staged in shared memory) for tiles of rows of at most two sequences, and on
    #: ``attention_split`` for the other tiles' rows (decided on the device); fewer rows
    #: (decode batches) on ``attention_split`` alone. Measured in docs/gpu.md (runs 16-17).
    attention_tiled_min_rows: int = 64
    #: ``sample`` finds a row's argmax over blocks of at least this many ids
    #: (``sample_argmax``, then the sample kernel reduces their results) where the row has
    #: more; 0: one block walks the whole row (a tool's "before").
    sample_argmax_slice: int = 2048
    #: Launch the kernels that wait for their predecessor themselves (``_OVERLAP``: the
    #: gemv kernels and rms_norm, kernels/common.cu) overlapped
    #: (``GpuRuntime.launch_overlapped``: on CUDA sm_90+, programmatic dependent launch), so
    #: their blocks start, and the gemv kernels' first weight loads go out, while the
    #: previous kernel finishes; False: every launch plain (a tool's "before").
    overlap_launches: bool = True
    #: With ``overlap_launches``, attention's split and combine kernels too (the split
    #: kernel's K and V rows prefetched into L2 before its wait), at every shape.
    overlap_attention: bool = False
    #: With ``overlap_launches``, attention's kernels overlapped at decode steps (up to
    #: ``overlap_attention_max_rows`` rows) where a query row has at least this many values
    #: (``n_heads * head_dim``); 0: only where ``overlap_attention`` says. Measured at batch
    #: 1 (docs/gpu.md runs 40, 52-53, 80, 98): the 1B shape (2,048 values) +1.5% to +5%,
    #: the 135M shape (576) -6% to -13%.
    overlap_attention_min_q: int = 2048
    #: That rule at steps of up to this many rows too (and fewer than
    #: ``attention_tiled_min_rows``: decode batches); 1: one row only, the rule before the
    #: thirty-ninth session. Runs 176-177 (H100, ``--overlap-attention 1`` on the 1B shape,
    #: whose 2,048-value rows the rule takes): batch 8 +0.4% and +4.7%, batch 16 +2.1% and
    #: +4.9%, batch 32 +3.9% and +6.2%; the 135M shape's 576-value rows stay plain (that
    #: switch cost them 6.9% and 3.1% at batches 16 and 32, run 176)
    #: (``bench_variant.py --overlap-attention-rows N``).
    overlap_attention_max_rows: int = 63
    #: With ``overlap_launches``, the int8 batch kernels too (``quantize_rows``,
    #: ``quantize_norm_rows``, ``*_mma*_q8a``): each starts while the kernel before it
    #: finishes, an mma warp's first weights loaded before its wait. Batch steps launch
    #: 7-10 of them a layer (run 113), each paying a launch's latency now
    #: (``bench_variant.py --overlap-mma 0``). On since run 119: alone, the 135M shape
    #: +7% to +14% at batches 8 and 32, the 1B shape within 0.5% (run 116).
    overlap_mma: bool = True
    #: With ``overlap_launches``, ``attention_combine`` alone (its few blocks wait for the
    #: split kernel's partials on the device, so its launch is not on the chain).
    overlap_combine: bool = False
    #: Quantized weights in their compact layouts (vt.gpu.weights.LAYOUTS: about the file's
    #: bytes a value) rather than the wide one (int8 codes, float32 pairs: 1.25-1.5 bytes a
    #: value; a tool's "before"). The same values either way; set before loading a model.
    compact_weights: bool = True
    #: A benchmark's variant: (type name, Q_* flags) pairs that replace those types'
    #: ``LAYOUTS`` entries (``bench_variant.py --layout Q8_0=0x800``: Q8_0 with float32
    #: scales); the same values, another layout.
    layout_overrides: tuple[tuple[str, int], ...] = ()
    #: Launches whose quantized weights share one layout run kernels compiled for it
    #: (``WEIGHT_GROUPS``' parts with ``-DVT_Q_FLAGS``: the layout's branches resolved by
    #: the compiler), modules per layout, compiled when its first weight is uploaded; others
    #: (weights of two layouts, e.g. Q4_K_M's q and v) read the flags at run time. False:
    #: every launch on the run-time kernels (a tool's "before"; docs/gpu.md run 49: they
    #: cost 3-10%).
    layout_kernels: bool = True
