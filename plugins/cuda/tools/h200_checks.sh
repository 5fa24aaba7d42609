#!/usr/bin/env bash
# Everything docs/gpu.md reports from an NVIDIA GPU, in one go (one device call).
#
#   bash plugins/cuda/tools/h200_checks.sh [STEP...]     # from the repository root
#
# Steps (default: all but baseline, in this order): setup backends verify audit kit checks
# bench profile, and baseline: the bench and profile on an older vt copied into .whl/old
# (core/ and plugins/ of, say, `git worktree add /tmp/old 79b67e1`), same machine.
# Issue 9's steps (not in the default): cpuhead (plugins/cpu from .whl/cpu_head: a fixed cpu
# backend to compare with, whatever the working tree holds; runs 7-8 used 4bf0636's, the
# reference ops, plus an empty vt_cpu/kernels package for pyproject's list), models (random-weight GGUFs of
# SmolLM2-135M Q4_1 and Llama-3.2-1B Q8_0 shapes, write_shape.py), batch MODEL (vt bench
# --batch 1,8,32: as is, with the fused ops decomposed, and, for smol, with VT_GRAPHS=0;
# batch1:MODEL only as is),
# batch_old MODEL (the same on .whl/old), kprofile MODEL (profile_decode.py at batch 1 and
# 32 with a per-kernel table; kprofile1 MODEL: batch 1 only); MODEL is smol or 1b, as in
# `batch:smol`. checksk:EXPR: gpu_checks.py -k EXPR (+ for " or "). Prefill: attn (the
# attention op alone, tiled vs split, bench_attention.py), pp:1b,smol (pp512 variants in one
# process and per-kernel profiles of the PROFILE variants, bench_prefill.py; VARIANTS and
# PROFILE override its lists, PROFILE= profiles none). inv:MODEL: same-prompt requests of one
# batch, their greedy ids and the step shapes that computed them (gpu_batch_invariance.py).
# keep:MODELS: pp512 with and without the BLAS path's kept weight copies; pprof:MODEL: a
# 512-token prefill's wall time and kernels; host: bench_host.py (host time of a call);
# hostprev: the same from the tree in .whl/prev (core/ and plugins/cuda/ of an older commit);
# ab:MODELS: pp512 alternating that tree, this one on cublasGemmEx and this one on cuBLASLt
# plans, AB_ROUNDS (3) rounds (bench_ab.py; $OUT/ab.json). pgraph:MODELS: pp512 with prefill
# steps replayed as graphs and eager, alternating (bench_ab.py; $OUT/pgraph.json).
# kitvar: the conformance kit with the bench_variant.py flags in KITVARS (kit_variant.py).
# enghost:MODEL: benchmarks/engine_host.py on cuda, profiled (EHBATCH batches).
# model_q4km: /tmp/1b-q4km.gguf (the 1B shape in Q4_K_M) for kvars:1b-q4km.
# checksvar: the kit and gpu_checks.py (CHECKK: a -k expression, + for " or ") with the
# flags in CHECKVARS, in one process. ncu:MODEL: Nsight Compute's time, throughputs and stall reasons of the
# kernels NCUK names (default: attention's decode pair) at NCUBATCH rows (1) (ncu_table.py). nsys:MODEL:
# Nsight Systems' trace of a batch-1 bench, each kernel's share of a replayed step (nsys_steps.py);
# trace:MODEL: the same through PyTorch's profiler (torch_trace.py), where nsys is missing.
# cmd: the shell command in $CMD, limited to CMDLIMIT seconds (300), with the environment
# every step has (the carried wheels on PYTHONPATH, VT_HOME): a probe written on the spot
# (two of run 134's commands ran the image's Python without the wheels and failed).
# Logs go to $OUT (default /tmp/vt-gpu-out): log.txt (everything), summary.txt (one line
# per step: status, seconds), cuda-matrix.md, profile.json, bench-*.json. pydantic and gguf
# (missing from the device image) travel as cp312 wheels in .whl (docs/gpu.md).
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/vt-gpu-out}
mkdir -p "$OUT"
ROOT=$PWD
export PYTHONUNBUFFERED=1 VT_HOME=${VT_HOME:-/tmp/vt-home} VT_GPU_CHECKS_OUT=$OUT
STEPS=${*:-setup backends verify audit kit checks bench profile}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # where setup puts the wheels

step() {  # step NAME SECONDS CMD...: run CMD with a time limit, log it, note its status
    local name=$1 limit=$2
    shift 2
    echo "===== $name: $*" | tee -a "$OUT/log.txt"
    local t0=$SECONDS
    timeout "$limit" bash -c "$*" 2>&1 | tee -a "$OUT/log.txt"
    local rc=${PIPESTATUS[0]}
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
}

for s in $STEPS; do
    case $s in
    setup)
        if [ -d .whl ]; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --upgrade --target /tmp/site .whl/*.whl
        fi
        step install 300 "python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/cuda \
            && nvidia-smi -L && python3 -m pip list 2>/dev/null | grep -i -E '^(cuda|nvidia-cuda-nvrtc|numpy|pydantic |gguf|nvmath)' \
            && { python3 -c 'import nvmath.bindings.cublas' 2>/dev/null \
                 || echo 'WARNING: no nvmath-python here: prefill runs on vt'\''s own kernels, not cuBLAS (carry its wheel in .whl; run 86)'; }"
        ;;
    backends)
        step backends 120 "vt backends && vt backends --json > $OUT/backends.json"
        ;;
    verify)  # the cost of vt.management.trust's verification: fresh, then from the cache
        step verify 300 "rm -rf $VT_HOME/verified; python3 - <<'EOF'
import time
from vt.management import registry, trust
t0 = time.perf_counter()
backend, _ = registry.create_backend('cuda')
backend.close()
print(f'create_backend(cuda) without verification: {time.perf_counter() - t0:.3f} s')
for _ in range(2):
    t0 = time.perf_counter()
    opened = trust.open_verified_backend('cuda')
    total = time.perf_counter() - t0
    v = opened.verification
    print(f'open_verified_backend(cuda): {v.summary()}, {total:.3f} s in all')
    for c in v.record.checks:
        print(f'  {c.result:4} {c.id}: {c.detail}')
    opened.backend.close()
EOF"
        ;;
    audit)
        step audit 300 "vt audit --backend cuda"
        ;;
    kit)  # the conformance kit as a plugin author runs it: from an empty directory
        step kit 400 "cd \$(mktemp -d) && python3 -m pytest -q -p no:cacheprovider -rfE \
            --vt-backend cuda --vt-matrix $OUT/cuda-matrix.md"
        ;;
    kitvar)  # the kit with the bench_variant.py flags in KITVARS set in its process
        step kitvar 400 "cd \$(mktemp -d) && python3 $ROOT/plugins/cuda/tools/kit_variant.py ${KITVARS:-}"
        ;;
    checksvar)  # the kit and gpu_checks.py (-k CHECKK, if set) in one process with the
        # bench_variant.py flags in CHECKVARS set: a variant's whole check before it becomes
        # a default (CHECKVARS='--kdefine VT_GV_SKIP_ZERO=1': compact_layouts is its bits)
        step checksvar 600 "cd \$(mktemp -d) && python3 $ROOT/plugins/cuda/tools/kit_variant.py ${CHECKVARS:-} \
            -- -o addopts='' -s ${CHECKK:+-k '${CHECKK//+/ or }'} $ROOT/plugins/cuda/tests/gpu_checks.py"
        ;;
    checksx)  # gpu_checks.py -k "$CHECKX" verbatim (spaces, not and parentheses kept), the
        # step's limit CHECKLIMIT seconds (default 570): a half of the whole in a call
        step gpu_checks-x ${CHECKLIMIT:-570} "python3 -m pytest -q -p no:cacheprovider -o addopts='' -s -rfE \
            plugins/cuda/tests/gpu_checks.py -k \"\$CHECKX\""
        ;;
    cmd)
        step cmd "${CMDLIMIT:-300}" "${CMD:?cmd: set CMD to the command}"
        ;;
    checks)
        step gpu_checks 570 "python3 -m pytest -q -p no:cacheprovider -o addopts='' -s -rfE \
            plugins/cuda/tests/gpu_checks.py"
        ;;
    bench)
        step bench 500 "python3 plugins/cuda/tools/write_smollm2_shape.py /tmp/smol.gguf \
            && VT_GRAPHS=1 vt bench --backend cuda --model /tmp/smol.gguf \
            && VT_GRAPHS=0 vt bench --backend cuda --model /tmp/smol.gguf \
            && VT_GRAPHS=1 vt bench --backend cuda --json --model /tmp/smol.gguf > $OUT/bench-graphs.json \
            && VT_GRAPHS=0 vt bench --backend cuda --json --model /tmp/smol.gguf > $OUT/bench-eager.json"
        ;;
    profile)  # host time per decode step, graphs on and off, and a cProfile of eager steps
        step profile 300 "test -f /tmp/smol.gguf || python3 plugins/cuda/tools/write_smollm2_shape.py /tmp/smol.gguf; \
            python3 plugins/cuda/tools/profile_decode.py /tmp/smol.gguf --steps 128"
        ;;
    baseline)  # the same bench and profile on an older vt tree, if one travels in .whl/old
        O=$ROOT/.whl/old
        OLDPATH=$O/core:$O/plugins/cuda:$O/plugins/cpu:$O/plugins/tt_stub:$O/plugins/rocm:/tmp/site
        step baseline 400 "test -d $O && test -f /tmp/smol.gguf \
            && PYTHONPATH=$OLDPATH python3 plugins/cuda/tools/profile_decode.py /tmp/smol.gguf --steps 128 --top 12 \
            && for g in 1 0; do VT_GRAPHS=\$g PYTHONPATH=$OLDPATH python3 -c 'import sys, vt.frontends.cli; sys.argv[0] = \"vt\"; vt.frontends.cli.main()' \
                bench --backend cuda --model /tmp/smol.gguf; done"
        ;;
    cpuhead)
        if [ -d .whl/cpu_head/plugins/cpu ]; then
            rm -rf plugins/cpu && cp -r .whl/cpu_head/plugins/cpu plugins/cpu
        fi
        ;;
    models)
        step models 200 "python3 plugins/cuda/tools/write_shape.py /tmp/smol.gguf --shape 135m --weight-type Q4_1 \
            && python3 plugins/cuda/tools/write_shape.py /tmp/1b.gguf --shape 1b --weight-type Q8_0"
        ;;
    enghost:*)  # the engine's time a request a decode step at EHBATCH (32,64,128,256), every
        # step's output and final-only, with each setting's top functions (engine_host.py
        # --profile): whether the host sets the pace at large batches, and where it goes
        m=${s#enghost:}
        step "enghost-$m" 300 "python3 benchmarks/engine_host.py --backend cuda --model /tmp/$m.gguf \
            --batch ${EHBATCH:-32,64,128,256} --prompt-tokens 128 --gen-tokens 128 --repeat 2 \
            --profile 30 > $OUT/enghost-$m.json && tail -c 300 $OUT/enghost-$m.json"
        ;;
    model_q4km)  # the 1B shape in Q4_K_M as gpu_vs_llama_cpp.py writes it (kvars:1b-q4km)
        step model_q4km 200 "python3 plugins/cuda/tools/write_shape.py /tmp/1b-q4km.gguf --shape 1b --weight-type Q4_K_M"
        ;;
    batch:*)
        m=${s#batch:}
        B="bench --backend cuda --model /tmp/$m.gguf --batch 1,8,32 --prompt-tokens 128 --gen-tokens 128 --repeat 2"
        step "batch-$m" 400 "python3 plugins/cuda/tools/bench_variant.py $B --json > $OUT/batch-$m.json \
            && python3 plugins/cuda/tools/bench_variant.py --no-fused $B --json > $OUT/batch-$m-nofused.json \
            && if [ $m = smol ]; then VT_GRAPHS=0 python3 plugins/cuda/tools/bench_variant.py $B --json > $OUT/batch-$m-eager.json; fi; \
            python3 $ROOT/plugins/cuda/tools/batch_table.py $OUT/batch-$m*.json"
        ;;
    batch1:*)  # only the tree as it is
        m=${s#batch1:}
        B="bench --backend cuda --model /tmp/$m.gguf --batch 1,8,32 --prompt-tokens 128 --gen-tokens 128 --repeat 2"
        step "batch1-$m" 300 "python3 plugins/cuda/tools/bench_variant.py $B --json > $OUT/batch-$m.json; \
            python3 $ROOT/plugins/cuda/tools/batch_table.py $OUT/batch-$m.json"
        ;;
    batch_old:*)
        m=${s#batch_old:}
        O=$ROOT/.whl/old
        OLDPATH=$O/core:$O/plugins/cuda:$O/plugins/cpu:$O/plugins/tt_stub:$O/plugins/rocm:/tmp/site
        step "batch-old-$m" 400 "test -d $O && PYTHONPATH=$OLDPATH python3 -c 'import sys, vt.frontends.cli; sys.argv[0] = \"vt\"; vt.frontends.cli.main()' \
            bench --backend cuda --model /tmp/$m.gguf --batch 1,8,32 --prompt-tokens 128 --gen-tokens 128 --repeat 2 --json > $OUT/batch-$m-old.json; \
            python3 $ROOT/plugins/cuda/tools/batch_table.py $OUT/batch-$m-old.json"
        ;;
    prefill:*)  # pp512 through vt bench: cuBLAS (TF32) against the own tiled kernel
        m=${s#prefill:}
        B="bench --backend cuda --model /tmp/$m.gguf --prompt-tokens 512 --gen-tokens 16 --repeat 3 --max-model-len 1024"
        step "prefill-$m" 300 "python3 plugins/cuda/tools/bench_variant.py $B --json > $OUT/prefill-$m.json \
            && python3 plugins/cuda/tools/bench_variant.py --blas-min-rows 1000000000 $B --json > $OUT/prefill-$m-own.json; \
            grep -h -o '\"prefill_tok_s\": *[0-9.]*' $OUT/prefill-$m*.json"
        ;;
    pchunk:*)  # pp512 in one chunk of 512 (TF32, half inputs) against two of 256, and a kernel profile
        m=${s#pchunk:}
        V="python3 plugins/cuda/tools/bench_variant.py"
        B="bench --backend cuda --model /tmp/$m.gguf --prompt-tokens 512 --gen-tokens 16 --repeat 3 --max-model-len 1024 --json"
        step "pchunk-$m" 300 "$V $B > /tmp/pchunk-$m-256.json; $V $B --max-batch-tokens 512 > /tmp/pchunk-$m-512.json; \
            $V --blas-f16 $B --max-batch-tokens 512 > /tmp/pchunk-$m-512f16.json; \
            grep -o '\"prefill_tok_s\": *[0-9.]*' /tmp/pchunk-$m-*.json; \
            python3 plugins/cuda/tools/profile_decode.py /tmp/$m.gguf --prefill 512"
        ;;
    blasbatch:*)  # decode batches from 32 rows on cuBLAS too (is the dequantized copy worth it?)
        m=${s#blasbatch:}
        B="bench --backend cuda --model /tmp/$m.gguf --batch 8,32 --prompt-tokens 128 --gen-tokens 128 --repeat 2"
        step "blasbatch-$m" 300 "python3 plugins/cuda/tools/bench_variant.py --blas-min-rows 8 $B --json > $OUT/batch-$m-blas8.json; \
            python3 $ROOT/plugins/cuda/tools/batch_table.py $OUT/batch-$m-blas8.json"
        ;;
    llama_bg)  # build llama.cpp (CUDA) in the background, in its own session (outlives the call);
        # LLAMA_SERVER=1: llama-server too, after the benches (for servellama)
        setsid nohup python3 benchmarks/gpu_vs_llama_cpp.py --llama-src .llama/llama-src.tar.xz \
            --build-only ${LLAMA_SERVER:+--server} > /tmp/llama-build.log 2>&1 < /dev/null &
        echo "llama.cpp build started in the background: /tmp/llama-build.log" | tee -a "$OUT/log.txt"
        ;;
    vsllama:*)  # wait (at most N s) for that build, then vt and llama.cpp side by side
        # (VSMODELS=smol,1b,1b-q4km picks the shapes; default smol,1b)
        w=${s#vsllama:}
        step vsllama 560 "for i in \$(seq $w); do test -x /tmp/llama-build/bin/llama-bench && test -x /tmp/llama-build/bin/llama-batched-bench && break; sleep 1; done; \
            tail -3 /tmp/llama-build.log; python3 benchmarks/gpu_vs_llama_cpp.py --no-build ${VSMODELS:+--models $VSMODELS} --out $OUT/gpu_vs_llama_cpp.json"
        ;;
    firstload:*)  # a machine's first run (no kernel cache): model load and first token with
        # the modules built one after another and on helper threads, twice each (first_load.py)
        m=${s#firstload:}
        step "firstload-$m" 400 "test -f /tmp/$m.gguf || python3 plugins/cuda/tools/write_shape.py /tmp/$m.gguf --shape 135m --weight-type Q4_1; \
            python3 plugins/cuda/tools/first_load.py /tmp/$m.gguf --rounds 2 > $OUT/first_load-$m.json; tail -5 $OUT/first_load-$m.json"
        ;;
    servellama:*)  # wait (at most N s) for llama-server (llama_bg with LLAMA_SERVER=1), then
        # vt serve --backend cuda against llama-server -ngl 99 on the 135M shape, 1, 4, 16 and
        # 64 chat clients (SERVECLIENTS), 64 slots each (benchmarks/serve_vs_llama_server.py)
        w=${s#servellama:}
        step servellama 560 "for i in \$(seq $w); do test -x /tmp/llama-build/bin/llama-server && break; sleep 1; done; \
            tail -3 /tmp/llama-build.log; test -f /tmp/smol.gguf || python3 plugins/cuda/tools/write_shape.py /tmp/smol.gguf --shape 135m --weight-type Q4_1; \
            python3 benchmarks/serve_vs_llama_server.py --backend cuda --llama-args='-ngl 99' \
            --llama-server /tmp/llama-build/bin/llama-server --model /tmp/smol.gguf \
            --clients ${SERVECLIENTS:-1,4,16,64} --slots 64 --threads 8 --rounds 2 --quiet-wait-s 20 \
            --time-limit-s 60 --out $OUT/serve_vs_llama_server.json"
        ;;
    int8:*)  # decode batches of 8 and 32 on int8 activations from 8 rows (the default since run 23)
        m=${s#int8:}
        B="bench --backend cuda --model /tmp/$m.gguf --batch 8,32 --prompt-tokens 128 --gen-tokens 128 --repeat 2 --json"
        step "int8-$m" 300 "python3 plugins/cuda/tools/bench_variant.py --int8-rows 8 $B > /tmp/int8-$m.json; \
            python3 plugins/cuda/tools/batch_table.py /tmp/int8-$m.json"
        ;;
    dp4a:*)  # decode batches of 8 and 32 on int8 activations with the dp4a kernels, not mma
        m=${s#dp4a:}
        B="bench --backend cuda --model /tmp/$m.gguf --batch 8,32 --prompt-tokens 128 --gen-tokens 128 --repeat 2 --json"
        step "dp4a-$m" 300 "python3 plugins/cuda/tools/bench_variant.py --int8-mma 0 $B > $OUT/dp4a-$m.json; \
            python3 plugins/cuda/tools/batch_table.py $OUT/dp4a-$m.json"
        ;;
    int8all:*)  # decode batches of 8 and 32 with int8 activations for every quantized weight
        m=${s#int8all:}
        B="bench --backend cuda --model /tmp/$m.gguf --batch 8,32 --prompt-tokens 128 --gen-tokens 128 --repeat 2 --json"
        step "int8all-$m" 300 "python3 plugins/cuda/tools/bench_variant.py --int8-values 0 $B > $OUT/int8all-$m.json; \
            python3 plugins/cuda/tools/batch_table.py $OUT/int8all-$m.json"
        ;;
    kvar:*)  # decode batches of 8 and 32 with the bench_variant.py flags in KFLAGS (e.g. --kdefine)
        m=${s#kvar:}
        B="bench --backend cuda --model /tmp/$m.gguf --batch 8,32 --prompt-tokens 128 --gen-tokens 128 --repeat 2 --json"
        step "kvar-$m" 300 "python3 plugins/cuda/tools/bench_variant.py ${KFLAGS:-} $B > $OUT/kvar-$m.json; \
            python3 plugins/cuda/tools/batch_table.py $OUT/kvar-$m.json"
        ;;
    kvars:*)  # decode batches KBATCH (default 1,8,32) per variant of bench_variant.py flags in
        # KVARS ('|' between variants; the table goes to the log, each JSON into
        # $OUT/kvars.tar as kvars-MODEL-pPROMPT-N.json: one file, where the device returns
        # about 8 a call); prompts of KPROMPT tokens (default 128: a long context is e.g.
        # KPROMPT=2048); KTAG: a word in the step and file names, so a second kvars step of
        # one model in a call keeps its own files (kvars-MODEL-pPROMPT-TAG-N.json)
        m=${s#kvars:}
        t=$m${KTAG:+-$KTAG}
        B="bench --backend cuda --model /tmp/$m.gguf --batch ${KBATCH:-1,8,32} --prompt-tokens ${KPROMPT:-128} --gen-tokens 128 --repeat 2 --json"
        # the '|' appended keeps a trailing empty variant (the tree) that read would drop
        # (run 176 lost one so); no KVARS: the tree as it is (run 55 ran nothing)
        IFS='|' read -ra VS <<< "${KVARS:-}|"
        i=0
        for v in "${VS[@]}"; do
            i=$((i + 1))
            step "kvars-$t-$i" 300 "echo 'variant $i: $v'; python3 plugins/cuda/tools/bench_variant.py $v $B > /tmp/kvars-$t-$i.json \
                && python3 plugins/cuda/tools/batch_table.py /tmp/kvars-$t-$i.json"  # rc: the bench's (run 124)
            j=kvars-$m-p${KPROMPT:-128}${KTAG:+-$KTAG}-$i.json
            cp /tmp/kvars-$t-$i.json /tmp/$j 2>/dev/null && tar -rf "$OUT/kvars.tar" -C /tmp "$j"
        done
        ;;
    splits:*)  # decode at batch 1 and 8 with attention split over at most 1, 4, 8, 16, 32 blocks
        m=${s#splits:}
        B="bench --backend cuda --model /tmp/$m.gguf --batch 1,8 --prompt-tokens 512 --gen-tokens 128 --repeat 2 --max-model-len 1024 --json"
        step "splits-$m" 300 "for n in 1 4 8 16 32; do python3 plugins/cuda/tools/bench_variant.py --splits \$n $B > /tmp/splits-$m-\$n.json; \
            echo splits=\$n; python3 plugins/cuda/tools/batch_table.py /tmp/splits-$m-\$n.json | grep async=on; done"
        ;;
    attn)  # the attention op alone: tiled prefill kernel vs split, by rows (bench_attention.py)
        step attn 200 "python3 plugins/cuda/tools/bench_attention.py"
        ;;
    pp:*)  # pp512 of the models (1b,smol) in one process: chunks of 256 and 512, attention
        # split vs tiled, cuBLAS TF32 vs half inputs, then per-kernel profiles of one chunk
        ms=${s#pp:}
        files=$(for m in ${ms//,/ }; do printf '/tmp/%s.gguf ' "$m"; done)
        step "pp-$ms" 400 "python3 plugins/cuda/tools/bench_prefill.py $files --chunks 256,512 \
            --variants ${VARIANTS:-split-tf32-narrow,tiled-tf32-narrow,tiled-tf32,tiled-f16-narrow,tiled-f16} \
            --profile '${PROFILE-tiled-tf32,tiled-f16}'"
        ;;
    inv:*)  # batch invariance: do same-prompt requests of batches 8 and 32 generate the same
        # greedy ids, with the default tokens per step and with every prompt in one step,
        # and where they part, what differed (benchmarks/gpu_batch_invariance.py)
        m=${s#inv:}
        step "inv-$m" 200 "python3 benchmarks/gpu_batch_invariance.py /tmp/$m.gguf --batch ${IBATCH:-8,32} \
            --schedules ${ISCHED:-default,one} --out $OUT/inv-$m.json"
        ;;
    keep:*)  # pp512 with the BLAS path's kept weight copies (0.125, the default) and without
        # (0: a copy every matmul), alternating, twice, per model: keep:smol,1b
        ms=${s#keep:}
        B="bench --backend cuda --prompt-tokens 512 --gen-tokens 16 --repeat 3 --max-model-len 1024 --json"
        for m in ${ms//,/ }; do
            step "keep-$m" 300 "for i in 1 2; do for v in 0.125 0; do echo \"$m --blas-keep \$v\"; \
                python3 plugins/cuda/tools/bench_variant.py --blas-keep \$v $B --model /tmp/$m.gguf \
                | grep -o '\"prefill_tok_s\": *[0-9.]*'; done; done"
        done
        ;;
    host)  # host time of one call by layer: op dispatch, a kernel launch, a cuBLAS GEMM
        step host 120 "python3 plugins/cuda/tools/bench_host.py"
        ;;
    hostprev)  # the same on the older tree in .whl/prev
        P=$ROOT/.whl/prev
        step hostprev 120 "test -d $P && PYTHONPATH=$P/core:$P/plugins/cuda:/tmp/site \
            python3 $P/plugins/cuda/tools/bench_host.py"
        ;;
    ab:*)  # pp512: .whl/prev's tree, this one on cublasGemmEx, this one on cuBLASLt plans
        ms=${s#ab:}
        for m in ${ms//,/ }; do
            step "ab-$m" 400 "python3 plugins/cuda/tools/bench_ab.py /tmp/$m.gguf --rounds ${AB_ROUNDS:-3} \
                --prev $ROOT/.whl/prev --out $OUT/ab.json"
        done
        ;;
    pgraph:*)  # pp512 with prefill steps replayed as graphs (VT_PREFILL_GRAPHS=1, cuda's
        # default) and eager (0), alternating in fresh processes, AB_ROUNDS (2) rounds of
        # 4 repeats (the first eager, the second captured): pgraph:smol,1b
        ms=${s#pgraph:}
        for m in ${ms//,/ }; do
            step "pgraph-$m" 300 "python3 plugins/cuda/tools/bench_ab.py /tmp/$m.gguf --rounds ${AB_ROUNDS:-2} \
                --repeat 4 --variant pg1=VT_PREFILL_GRAPHS=1 --variant pg0=VT_PREFILL_GRAPHS=0 --out $OUT/pgraph.json"
        done
        ;;
    pprof:*)  # wall and GPU time of a 512-token prefill in one chunk, per kernel (the defaults)
        m=${s#pprof:}
        step "pprof-$m" 200 "python3 plugins/cuda/tools/profile_decode.py /tmp/$m.gguf --prefill 512"
        ;;
    kprofile1:*)  # the same at batch 1 only, per variant of bench_variant.py flags in KPVARS
        # ('|' between variants; default: the tree as it is)
        m=${s#kprofile1:}
        IFS='|' read -ra VS <<< "${KPVARS:-}|"  # as kvars: a trailing empty variant kept
        for v in "${VS[@]}"; do
            step "kprofile1-$m" 300 "echo 'variant: $v'; python3 plugins/cuda/tools/profile_decode.py $v /tmp/$m.gguf --steps 64 --batch 1 --kernels --no-cprofile"
        done
        ;;
    ncu:*)  # Nsight Compute on NCUK's kernels (a regex; default attention's decode pair) in a
        # vt bench at NCUBATCH rows (1) with the bench_variant.py flags in NCUVARS: NCUCOUNT launches
        # (8) after NCUSKIP (96: past the prefill); time, throughputs and the warps' stall
        # reasons a launch (ncu_table.py); the raw CSV in $OUT/ncu-MODEL.csv. NCUCACHE: ncu's
        # --cache-control (none: caches as the previous launch left them, as in a replayed
        # step; all: flushed first, as ncu does by default: run 84's imc_miss stalls)
        m=${s#ncu:}
        step "ncu-$m" 500 "/usr/local/cuda/bin/ncu --csv --page raw --kernel-name 'regex:${NCUK:-^attention_(split|combine)\$}' \
            --cache-control ${NCUCACHE:-none} --clock-control none \
            --launch-skip ${NCUSKIP:-96} --launch-count ${NCUCOUNT:-8} --section SpeedOfLight --section WarpStateStats \
            --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis python3 plugins/cuda/tools/bench_variant.py ${NCUVARS:-} bench \
            --backend cuda --model /tmp/$m.gguf --batch ${NCUBATCH:-1} --prompt-tokens 128 --gen-tokens 32 --repeat 1 > $OUT/ncu-$m.csv; \
            python3 plugins/cuda/tools/ncu_table.py $OUT/ncu-$m.csv"
        ;;
    nsys:*)  # Nsight Systems on a batch-1 vt bench (graphs replayed as in use, NSYSVARS:
        # bench_variant.py flags): each kernel's increment in a replayed step, how much later
        # the step ends because of it, overlapped launches included (nsys_steps.py)
        m=${s#nsys:}
        step "nsys-$m" 300 "NSYS=\$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1); \
            test -n \"\$NSYS\" || { echo 'no nsys on this machine'; exit 1; }; \
            \$NSYS profile -q -t cuda --cuda-graph-trace=node --force-overwrite true -o /tmp/nsys-$m \
            python3 plugins/cuda/tools/bench_variant.py ${NSYSVARS:-} bench --backend cuda --model /tmp/$m.gguf \
            --batch 1 --prompt-tokens 128 --gen-tokens 64 --repeat 1 > /dev/null \
            && \$NSYS stats -q --force-export true --report cuda_gpu_trace --format csv \
            --output /tmp/nsys-$m /tmp/nsys-$m.nsys-rep \
            && python3 plugins/cuda/tools/nsys_steps.py /tmp/nsys-${m}_cuda_gpu_trace.csv --json $OUT/nsys-$m.json"
        ;;
    trace:*)  # the same increments through PyTorch's profiler where nsys is missing (the
        # H200 image): torch_trace.py runs the bench in its process under CUPTI, nsys_steps.py
        # reads the kernels it wrote (TRACEVARS: bench_variant.py flags)
        m=${s#trace:}
        step "trace-$m" 300 "python3 plugins/cuda/tools/torch_trace.py /tmp/trace-$m.csv ${TRACEVARS:-} \
            bench --backend cuda --model /tmp/$m.gguf --batch 1 --prompt-tokens 128 --gen-tokens 64 \
            --repeat 1 > /dev/null && python3 plugins/cuda/tools/nsys_steps.py /tmp/trace-$m.csv \
            --json $OUT/trace-$m.json"
        ;;
    kcache)  # the disk kernel cache (vt.gpu.kernel_cache): a backend's compiles and a 1B
        # model's load, from an empty cache and again from the files it left
        step kcache 300 "rm -rf $VT_HOME/kernels; for i in 1 2; do python3 - <<'EOF'
import time
t0 = time.perf_counter()
from vt.management.registry import Registry
from vt.model import load_gguf
from vt.execution.runner import ModelRunner
backend, _ = Registry(env={}).create_backend('cuda')
t1 = time.perf_counter()
with load_gguf('/tmp/1b.gguf') as model, ModelRunner(backend, model, max_slots=1, max_model_len=64):
    t2 = time.perf_counter()
backend.close()
print(f'backend {t1 - t0:.2f} s, 1B model loaded {t2 - t1:.2f} s')
EOF
done; ls -la $VT_HOME/kernels"
        ;;
    checksk:*)  # gpu_checks.py's tests whose names match the pytest -k expression after the
        # colon, each + read as " or " (steps are split at spaces): checksk:gemv+tiled_matmul
        k=${s#checksk:}
        step "gpu_checks-k" 400 "python3 -m pytest -q -p no:cacheprovider -o addopts='' -rfE \
            plugins/cuda/tests/gpu_checks.py -k '${k//+/ or }'"
        ;;
    kprofile:*)  # at batch 1 and 32 (KPBATCH), per variant in KPVARS as kprofile1
        m=${s#kprofile:}
        IFS='|' read -ra VS <<< "${KPVARS:-}|"  # as kvars: a trailing empty variant kept
        for v in "${VS[@]}"; do
            step "kprofile-$m" 400 "echo 'variant: $v'; for b in ${KPBATCH:-1 32}; do python3 plugins/cuda/tools/profile_decode.py $v /tmp/$m.gguf --steps 64 --batch \$b --kernels --no-cprofile; done"
        done
        ;;
    *)
        echo "unknown step $s" | tee -a "$OUT/summary.txt"
        ;;
    esac
done
cd "$ROOT" && cat "$OUT/summary.txt"
