#!/usr/bin/env bash
# The device calls that docs/gpu.md's latest "Next" names, by number, so a session runs
# them as written there (from the repository root, after device_files.sh):
#
#   bash plugins/cuda/tools/next_calls.sh 1     # carry [".whl"], about 450 s, any card
#   bash plugins/cuda/tools/next_calls.sh 2     # carry [".whl", ".llama"], about 550 s
#   bash plugins/cuda/tools/next_calls.sh 3     # carry [".whl"], about 350 s
#   bash plugins/cuda/tools/next_calls.sh 4     # carry [".whl", ".llama"], about 400 s
#   bash plugins/cuda/tools/next_calls.sh 5     # carry [".whl"], about 500 s, any card
#   bash plugins/cuda/tools/next_calls.sh 6     # carry [".whl"], about 500 s, any card
#   bash plugins/cuda/tools/next_calls.sh 7     # carry [".whl"], about 250 s, any card
#   bash plugins/cuda/tools/next_calls.sh 8     # carry [".whl"], about 560 s, any card
#   bash plugins/cuda/tools/next_calls.sh 9     # carry [".whl"], about 150 s, any card
#   bash plugins/cuda/tools/next_calls.sh 10    # carry [".whl"], about 400 s, any card
#   bash plugins/cuda/tools/next_calls.sh 11    # carry [".whl"], about 450 s, any card
#   bash plugins/cuda/tools/next_calls.sh 12    # carry [".whl", ".llama"], about 550 s, any card
#   bash plugins/cuda/tools/next_calls.sh 13    # carry [".whl"], about 150 s, any card
#   bash plugins/cuda/tools/next_calls.sh 14    # carry [".whl"], 13 then 10's checks, any card
#   bash plugins/cuda/tools/next_calls.sh 15    # carry [".whl"], about 380 s, any card
#   bash plugins/cuda/tools/next_calls.sh 16    # carry [".whl"], about 330 s, any card
#   bash plugins/cuda/tools/next_calls.sh 17    # carry [".whl"], about 250 s, any card
#   bash plugins/cuda/tools/next_calls.sh 18    # carry [".whl"], about 200 s, any card
#   bash plugins/cuda/tools/next_calls.sh 19    # carry [".whl"], about 200 s, any card
#   bash plugins/cuda/tools/next_calls.sh 20    # carry [".whl"], about 250 s, any card
#   bash plugins/cuda/tools/next_calls.sh 21    # carry [".whl"], about 450 s, any card
#   bash plugins/cuda/tools/next_calls.sh 24    # carry [".whl"], about 350 s, any card
#   bash plugins/cuda/tools/next_calls.sh 25    # carry [".whl"], about 350 s, any card
#   bash plugins/cuda/tools/next_calls.sh 26    # carry [".whl"], about 500 s, any card
#   bash plugins/cuda/tools/next_calls.sh 27    # carry [".whl"], about 330 s, any card
#   bash plugins/cuda/tools/next_calls.sh 28    # carry [".whl"], about 420 s, any card
#   bash plugins/cuda/tools/next_calls.sh 29    # carry [".whl"], about 120 s, any card
#   bash plugins/cuda/tools/next_calls.sh 30    # carry [".whl"], about 150 s, any card
#   bash plugins/cuda/tools/next_calls.sh 31    # carry [".whl", ".llama"], about 480 s, any card
#   bash plugins/cuda/tools/next_calls.sh 32    # carry [".whl"], about 350 s, any card
#   bash plugins/cuda/tools/next_calls.sh 33    # carry [".whl"], about 250 s, any card
#   bash plugins/cuda/tools/next_calls.sh h200  # carry [".whl", ".llama"]: 31 on an H200;
#                                               # elsewhere exits 3 within seconds
#   bash plugins/cuda/tools/next_calls.sh auto  # carry [".whl"]: call 33
#
# Output goes to $OUT as h200_checks.sh writes it (summary.txt, log.txt, bench-*.json).
set -u
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/../../.."
T=plugins/cuda/tools/h200_checks.sh
nvidia-smi -L || true
N=${1:-}
if [ "$N" = auto ]; then
    # for the fortieth session: call 33 (the thirty-ninth session's attention batch rules:
    # their gpu_checks.py attention tests and batches 8-32 beside the rules before; about
    # 250 s). Calls 31 and 32 ran as runs 175 and 176
    echo "next_calls.sh auto: call 33"
    bash "$SELF" 33
    exit
fi
#: gpu_checks.py's last 20 tests (calls 10 and 11 split the file at them)
OWED='equal_cpu or overlap_mma_gives or graph_replay_gives or prefill_graph_replay'
OWED="$OWED or logprobs_op or prefix_caching"
case $N in
1)  # the whole kit and gpu_checks.py with the defaults of run 119 (mma split, overlapped
    # int8 kernels, the packed norm over K / 256 blocks, VT_MMA_SKIP_ZERO)
    bash $T setup kit checks
    ;;
2)  # the side by side with llama.cpp (on an H200: the goal's open batch-1 figure)
    VSMODELS=smol,1b,1b-q4km bash $T setup llama_bg models vsllama:300
    ;;
3)  # slices of at least 512 values for the int8 split (the 1B shape's K = 2,048 in four,
    # the 135M shape's 576 unsplit), twice beside the tree; then batch 1 on 16-bit codes of x
    # (every layout at R = 4 and 2, the 4-bit layouts alone at R = 4), twice beside the tree
    # (one kvars step: a second would reuse its file names; every variant at batches 1-32)
    X='--mma-split-k 512|--gemv-x16 4|--gemv-x16 2|--gemv-x16 4 --gemv-x16-flags 0x100'
    KBATCH=1,8,32 KVARS="--splits 32|$X|--splits 32|$X" bash $T setup models kvars:1b kvars:smol
    ;;
4)  # the 16-bit path in the 4-bit layouts (--gemv-x16 4 --gemv-x16-flags 0x100: run 123's
    # 135M shape +2.6% at batch 1, the 1B Q8_0 shape untouched) on the 1B Q4_K_M shape too,
    # twice beside the tree at batch 1, then its gemv and greedy-id checks. On an H200 the
    # side by side first instead of the checks (the goal's open figure). Run 125 (an H200);
    # X has been the default since: the tree runs it now (--gemv-x16 0: the float path).
    X='--gemv-x16 4 --gemv-x16-flags 0x100'
    if nvidia-smi -L 2>/dev/null | grep -q H200; then
        VSMODELS=smol,1b,1b-q4km bash $T setup llama_bg models vsllama:300
        A='--gemv-x16-flags 0'  # every layout (run 125: --gemv-x16 4 before the default)
        KBATCH=1 KVARS="--splits 32|$X|$A|--splits 32|$X|$A" \
            bash $T kvars:1b kvars:1b-q4km kvars:smol
    else
        bash $T setup models model_q4km
        KBATCH=1 KVARS="--splits 32|$X|--splits 32|$X" bash $T kvars:1b-q4km kvars:smol
        # run 117 passed the whole kit and checks at R = 2 on every layout, a superset of
        # the blocks this takes the path in; here the gemv and greedy-id tests with it
        CHECKVARS="$X" CHECKK='gemv+greedy' bash $T checksvar
    fi
    ;;
5)  # the whole gpu_checks.py with the 16-bit path in the 4-bit layouts by default
    # (gemv_x16_min_rows 4, gemv_x16_layout_flags 0x100; run 125), among them the compact
    # layouts' bit checks on their one-path backend (run 126 failed them by design). The
    # kit passed whole on these defaults in run 128, whose gpu_checks.py was cut at the
    # call's limit after 396 passed (its GPU part now takes about 370 s, then the cpu
    # comparisons compile numba's kernels): it gets the call to itself
    bash $T setup checks
    ;;
6)  # Run 127 (call 8 on an H100) measured it: the 135M shape -1.7% at 128 prompt
    # tokens, -14.5% at 384, so short_context stays 0. As first written:
    # short contexts as a context class (GpuBackend.short_context, built in the
    # twenty-seventh session, off): at one row within 512 positions the 135M shape's
    # attention as one launch of 512 threads a (row, KV group), graphs keyed by the class
    # (run 100, an H100, that attention for every length: +6.9% at 128 positions, -43% at
    # 2,048). Its first device run: the kit's and gpu_checks' attention cases with it (the
    # kit's attention_bounded cases take the short path), then twice beside the tree at 128
    # and 384 prompt tokens (contexts to 256 and 512); the 1B shape (attention overlapped:
    # the class only keys its graphs) once, as a control
    X='--short-context 512'
    CHECKVARS="$X" CHECKK='attention' bash $T setup models checksvar
    KBATCH=1 KVARS="--splits 32|$X|--splits 32|$X" bash $T kvars:smol
    KBATCH=1 KVARS="--splits 32|$X" bash $T kvars:1b
    KBATCH=1 KPROMPT=384 KVARS="--splits 32|$X|--splits 32|$X" bash $T kvars:smol
    ;;
7)  # Run 127 (call 8 on an H100) measured it: the 135M shape -1.7% at 128 prompt
    # tokens, -14.5% at 384, so short_context stays 0. As first written:
    # call 6 in about 250 s, for a session with little device time left: the short path's
    # own checks, then the 135M shape at 128 prompt tokens, twice beside the tree
    X='--short-context 512'
    CHECKVARS="$X" CHECKK='short_context+attention_bounded' bash $T setup models checksvar
    KBATCH=1 KVARS="--splits 32|$X|--splits 32|$X" bash $T kvars:smol
    ;;
8)  # Run 127 (call 8 on an H100) measured it: the 135M shape -1.7% at 128 prompt
    # tokens, -14.5% at 384, so short_context stays 0. As first written:
    # calls 6 and 5 in one lease's worth of time (the twenty-eighth session: three
    # requests in a row found no machine): the 135M shape at batch 1 with short contexts
    # as a context class twice beside the tree at 128 prompt tokens (contexts to 256),
    # once at 384 (contexts to 512, the class's edge); then the whole kit and gpu_checks.py
    # with it on the tree's defaults (a superset of call 5: the plain attention op and
    # attention_bounded's other rows keep the default path). If the 135M shape gains and
    # every check passes, short_context 512 becomes the default.
    X='--short-context 512'
    KBATCH=1 KVARS="--splits 32|$X|--splits 32|$X" bash $T setup models kvars:smol
    KBATCH=1 KPROMPT=384 KVARS="--splits 32|$X" bash $T kvars:smol
    CHECKVARS="$X" bash $T checksvar
    ;;
9)  # why run 127's short path (-1.7% at 128 prompt tokens) is not run 100's (+6.9%): the
    # tree, run 100's form (the module of every kernel at 512 threads, one split at every
    # length) and the short path, twice each, alternating, on the 135M shape at batch 1
    A='--attention-threads 512 --splits 1'
    X='--short-context 512'
    KBATCH=1 KVARS="--splits 32|$A|$X|--splits 32|$A|$X" bash $T setup models kvars:smol
    ;;
10) # gpu_checks.py in two calls (runs 127-128 cut it at its limit after 396 of 416 passed):
    # first the 20 tests it never reached on the tree's defaults, the runner on cuda
    # against cpu (greedy ids, prefill graphs, logprobs) and prefix caching, about 250 s,
    # the kernels built on helper threads (parallel_compile, the twenty-ninth session);
    # then a first run's load with and without it (about 150 s)
    CHECKX="$OWED" bash $T setup checksx firstload:smol
    ;;
11) # ... then the other 396 (call 10's complement; about 400 s on an H100)
    CHECKX="not ($OWED)" bash $T setup checksx
    ;;
12) # vt serve on the GPU against llama-server on it (-ngl 99), the 135M shape, 1 to 64
    # chat clients (benchmarks/serve_vs_llama_server.py --backend cuda): docs/gpu.md's "Not
    # proven" has a server's many step shapes through the graph cache never measured on a
    # device; llama-server built here first (about 5 minutes on 16 cores)
    LLAMA_SERVER=1 bash $T setup llama_bg servellama:420
    ;;
13) # the conformance kit alone on the tree's defaults (run 128: 217 passed in 88 s), every
    # op and weight type through the kernels built on helper threads (about 150 s)
    bash $T setup kit
    ;;
14) # calls 13 then 10's checks in what a session's last few minutes leave (the
    # twenty-ninth session: eight requests found no machine): the kit, then the 20
    # gpu_checks.py tests runs 127-128 never reached, cut by the call's limit where it falls
    bash $T setup kit
    CHECKX="$OWED" bash $T checksx
    ;;
15) # the kernels in two modules (the weights' and the other kernels', the thirtieth
    # session): a machine's first run of the 135M shape cold (an empty CUDA compute
    # cache: NVRTC 13 answers repeats from it, run 134), both ways, twice, with each
    # module's compile seconds (run 134: 54.1 s and 27.8 s with the one module of every
    # kernel); then the kit on them again (run 135 passed it, 217 tests)
    bash $T setup firstload:smol kit
    ;;
16) # the kernels in five groups of parts (vt.gpu.modules.MODULE_GROUPS, the thirty-first
    # session; every kernel's machine code as in runs 136-138's two modules, sass_same.py):
    # a machine's first run of the 135M shape cold, both ways, twice, with each module's
    # compile seconds (run 136, two groups: 57.1 s and 21.1 s, waiting on the 19-21 s of the
    # weights' module of every layout), then the kit on them
    bash $T setup firstload:smol kit
    ;;
18) # decode batches 1-256 on the three shapes (run 146's table, before: the engine built an
    # output for every request every step, about 30 us of host a request at 64-256 rows;
    # the 135M shape's weights went to cuBLAS in TF32), one process a shape
    KBATCH=1,8,16,32,64,128,256 bash $T setup models model_q4km kvars:1b kvars:smol \
        kvars:1b-q4km
    # the same 128 and 256 requests prefilled in steps of 8,192 tokens, not 512: with 512
    # the last of 256 requests gets its first id 64 steps after the first, so the timed
    # window's last 64 steps run fewer rows (llama-batched-bench prefills every prompt first)
    O=${OUT:-/tmp/vt-gpu-out}
    for m in 1b smol; do
        CMD="vt bench --backend cuda --model /tmp/$m.gguf --batch 128,256 --prompt-tokens 128 \
            --gen-tokens 128 --repeat 2 --max-batch-tokens 8192 --json > /tmp/mbt-$m.json \
            && python3 plugins/cuda/tools/batch_table.py /tmp/mbt-$m.json \
            && tar -rf $O/kvars.tar -C /tmp mbt-$m.json" bash $T cmd
    done
    ;;
19) # steps of 33-64 rows on the int8 mma kernels' 8 tiles against cuBLAS (run 147: the mma
    # kernels the slower, 14,280 against 22,644 tok/s on the 1B shape at batch 64); two K
    # blocks a warp loads at once (VT_MMA_U8 2, the default since run 159: +16-18% on the
    # 1B shape there) against one
    X='--int8-mma-first 1'
    KBATCH=32,48,64 KVARS="|$X|$X --kdefine VT_MMA_U8=1" bash $T setup models kvars:1b kvars:smol
    ;;
21) # the thirty-third session's qkv_rope_mma (GpuBackend.mma_rope: qkv's RoPE and KV store
    # in the int8 mma launch's epilogue, one launch fewer a layer at batches 8-64): its
    # bits against qkv_mma then rope_kv_store on the GPU (8 and 33 rows, four layouts, and
    # the int8 and split checks beside it), then decode batches 8-64 with it on, off, on
    bash $T setup models checksk:norm_quantize+int8_activation+mma_split
    KBATCH=8,16,32,64 KVARS='--mma-rope 1|--mma-rope 0|--mma-rope 1' bash $T kvars:smol kvars:1b
    ;;
20) # the engine's time a request a step at batches 32-256 on both shapes, every step's
    # output against final-only, profiled (engine_host.py --profile): run 146 had the
    # 135M and 1B steps take the same time at 64-256 rows, about 30-44 us a request
    bash $T setup models enghost:smol enghost:1b
    ;;
17) # gpu_checks.py's greedy ids on cuda against cpu, prefill graphs, logprobs and prefix
    # caching on the five groups (call 10's checks; then call 11 for the other 396)
    CHECKX="$OWED" bash $T setup checksx
    ;;
24) # the thirty-fifth session: the int8 mma kernels at batches 8-32. Steps of the 1B shape
    # at batches 1, 8 and 32 with every launch plain (--overlap 0: each kernel's own time;
    # run 163's table counts an overlapped kernel from its early start), then twice beside
    # the tree:
    # K blocks a warp loads at once for 1-2 tiles (VT_MMA_U1 8 and 6; 4 now) and the K
    # split up to 1,024 and 2,048 blocks (512 now: swiglu's 512 blocks stay unsplit)
    # (on an H200 first the goal's open figure, vt alone: the 1B shape at batch 1, twice;
    # 127-token prompts keep its files apart from the kvars below)
    bash $T setup models
    if nvidia-smi -L 2>/dev/null | grep -q H200; then
        KPROMPT=127 KBATCH=1 KVARS='||' bash $T kvars:1b
    fi
    KPBATCH='1 8 32' KPVARS='--overlap 0' bash $T kprofile:1b
    X='--kdefine VT_MMA_U1=8|--kdefine VT_MMA_U1=6|--mma-split 1024|--mma-split 2048'
    KBATCH=8,16,32 KVARS="|$X||$X" bash $T kvars:1b kvars:smol
    ;;
25) # the thirty-sixth session: the int8 mma kernels' weight codes through shared memory
    # (GpuBackend.mma_stage; run 167's ncu: the loads of 8 rows' 32-byte sectors a request
    # held the batch-8 output projection to 2.1 TB/s), 2: the scales too in 4 times fewer
    # loads: their bits against the tree's, the plain kernel tables with 2 at batches 8 and
    # 32 (run 166 has the tree's), then both twice beside the tree at batches 8-32 (about
    # 350 s)
    bash $T setup models checksk:mma_stage_gives_the_same_bits
    KPBATCH='8 32' KPVARS='--overlap 0 --mma-stage 2' bash $T kprofile:1b
    X='--mma-stage 1|--mma-stage 2'
    KBATCH=8,16,32 KVARS="|$X||$X" bash $T kvars:1b kvars:smol
    ;;
26) # the thirty-sixth session, after run 168: mma_stage 2 by default; the 135M shape (run
    # 168: -0.5%, -5.1%, -0.4%) and the 1B shape three times beside --mma-stage 0 at batches
    # 8-32, then gpu_checks.py whole on the new defaults (about 500 s)
    bash $T setup models
    KBATCH=8,16,32 KVARS='--mma-stage 0||--mma-stage 0||--mma-stage 0|' bash $T kvars:smol kvars:1b
    CHECKX="not ($OWED)" CHECKLIMIT=240 bash $T checksx
    CHECKX="$OWED" CHECKLIMIT=200 bash $T checksx
    ;;
27) # for the thirty-seventh session: swiglu_mma1's wave at batch 8 (the 1B shape's 512
    # blocks, 3 an SM at mma_stage 2's 72 registers: 396 places, a second wave of 116; run
    # 168: 20.9 us a call, 1.7 TB/s): VT_MMA_SW1_BLOCKS=4 (__launch_bounds__: 64 registers,
    # no spills by sass_count.py), VT_MMA_U1=2 (56 registers, half the shared memory, twice
    # the rounds) and --mma-split 1024; and attention at batch 8 (run 168: 13.1 us a layer
    # against batch 1's 6.3, 2 splits of a row's positions at target_blocks 256) with 4 and
    # 8 splits (--target-blocks 512, 1024); twice beside the tree at batches 8-32; the plain
    # batch-8 table with the first (about 330 s). VT_MMA_U1=8 no longer compiles with
    # mma_stage (72 KB of shared memory a block)
    bash $T setup models
    X='--kdefine VT_MMA_SW1_BLOCKS=4|--kdefine VT_MMA_U1=2|--mma-split 1024'
    X="$X|--target-blocks 512|--target-blocks 1024"
    KBATCH=8,16,32 KVARS="|$X||$X" bash $T kvars:1b kvars:smol
    KPBATCH=8 KPVARS='--overlap 0 --kdefine VT_MMA_SW1_BLOCKS=4' bash $T kprofile:1b
    # the thirty-seventh session's mma_stage as a bool (its old setting 2; the same machine
    # code by sass_count.py): the bit check against an unstaged backend (20 cases)
    bash $T checksk:mma_stage_gives_the_same_bits
    ;;
28) # the thirty-seventh session's: GpuBackend.prefetch_bytes (the op prefetch: attention's
    # split kernel brings the o, gate and up weights the ops after it read into L2 before it
    # waits; off by default) at 16 and 32 MiB, twice beside the tree at batch 1; then at
    # batches 8-32 beside three of call 27's settings (swiglu_mma1's wave: VT_MMA_SW1_BLOCKS=4,
    # VT_MMA_U1=2; attention's splits: --target-blocks 512); then the bit checks of the
    # stage as a bool (against an unstaged backend) and of the hint (about 420 s)
    bash $T setup models
    P='--prefetch-bytes 16777216|--prefetch-bytes 33554432'
    KBATCH=1 KTAG=b1 KVARS="|$P||$P" bash $T kvars:1b kvars:smol
    X='--kdefine VT_MMA_SW1_BLOCKS=4|--kdefine VT_MMA_U1=2|--target-blocks 512'
    X="$X|--prefetch-bytes 16777216"
    KBATCH=8,16,32 KVARS="|$X||$X" bash $T kvars:1b kvars:smol
    bash $T checksk:mma_stage_gives_the_same_bits+prefetch_hint_changes_no_attention_bit
    ;;
29) # after run 170 (the prefetch hint at batch 1 on the 1B shape: 16 MiB -2.9%, 32 MiB
    # -4.2%): the hint issued after attention's wait (VT_PF_LATE=1, so its lines do not queue
    # beside qkv's loads) at 16 MiB, twice beside the tree at batch 1; then
    # VT_MMA_SW1_BLOCKS=4 (run 170: +3.5% on the 1B shape at batch 8, 0 elsewhere) twice
    # beside the tree at batches 8 and 16 (about 120 s: the session had 400 s left)
    bash $T setup models
    L='--kdefine VT_PF_LATE=1 --prefetch-bytes 16777216'
    KBATCH=1 KTAG=b1 KVARS="|$L||$L" bash $T kvars:1b
    S='--kdefine VT_MMA_SW1_BLOCKS=4'
    KBATCH=8,16 KVARS="|$S||$S" bash $T kvars:1b
    ;;
30) # after runs 170-173 (VT_MMA_SW1_BLOCKS=4 at the 1B shape's batch 8: +3.5%, +4.3%,
    # +6.8%): its default form, swiglu_mma1w_q8a where an 8-row launch has 400+ blocks in a
    # layout of scales alone (mma_sw1_wave_blocks). Its bit checks against the plain kernel
    # (Q8_0, Q4_0, Q6_K; unsplit and split), then the 1B shape at batch 8 twice beside
    # --mma-sw1-wave 0 (about 150 s)
    bash $T setup models
    CHECKX='swiglu_mma1_wave' bash $T checksx
    KBATCH=8 KTAG=b8 KVARS="|--mma-sw1-wave 0||--mma-sw1-wave 0" bash $T kvars:1b
    ;;
31) # the ratio table refilled from one call on the current defaults (the side by side on
    # the three shapes: runs 122 and 125 were the last, before mma_stage, mma_rope,
    # attention_q8a and the wave form moved batches 8-32), then the 1B step's kernels plain
    # at batches 1 and 8 (about 480 s, any card; on an H200 it is also the goal's open
    # batch-1 figure)
    VSMODELS=smol,1b,1b-q4km bash $T setup llama_bg models vsllama:300
    KPBATCH="1 8" KPVARS='--overlap 0' bash $T kprofile:1b
    ;;
32) # attention at batches 8-32 (run 175's plain batch-8 table, H100: attention_split 13.41
    # us a layer, 17% of the 1B step, where batch 1's takes 6.71): four query heads a split
    # block (each K and V row read once for the group, not twice), the split kernels
    # launched overlapped with their K and V rows brought into L2 before the wait (measured
    # at one row only so far), and two position groups of a warp's loads in flight a round,
    # beside the tree twice (about 350 s, any card)
    bash $T setup models
    KBATCH=8,16,32 KVARS="|--attention-heads 4|--overlap-attention 1|--kdefine VT_FA_WARP_GROUPS=2|" \
        bash $T kvars:1b kvars:smol
    ;;
33) # attention's batch defaults of the thirty-ninth session (overlap_attention_max_rows 63:
    # the 1B shape's wide rows launched overlapped at batches too; attention_batch_max_group
    # 3: the 135M shape's groups of 3 heads one block at batches): gpu_checks.py's attention
    # tests on them, then batches 8-32 twice beside the rules before (about 250 s, any card)
    bash $T setup models
    CHECKX='attention' bash $T checksx
    OLD='--overlap-attention-rows 1 --attention-batch-heads 2'
    KBATCH=8,16,32 KVARS="|$OLD||$OLD" bash $T kvars:1b kvars:smol
    ;;
h200)  # call 31 where the card is an H200 (the goal's one open figure: the 1B shape at
    # batch 1 side by side with llama.cpp; run 125 measured 1,452.6 tok/s there)
    if ! nvidia-smi -L 2>/dev/null | grep -q H200; then
        echo "next_calls.sh h200: no H200 here; nothing run" >&2
        exit 3
    fi
    bash "$SELF" 31
    ;;
*)
    echo "usage: $0 1|2|...|33|h200|auto (docs/gpu.md, the latest Next)" >&2
    exit 2
    ;;
esac
