#!/usr/bin/env bash
# The device calls that docs/gpu.md's latest "Next" names, by number, so a session runs
# them as written there (from the repository root, after device_files.sh):
#
#   bash plugins/cuda/tools/next_calls.sh 1     # carry [".whl"], about 500 s (.whl/old: 5f1e184)
#   bash plugins/cuda/tools/next_calls.sh 2     # carry [".whl", ".llama"], about 550 s, an H200
#   bash plugins/cuda/tools/next_calls.sh 3     # carry [".whl"], about 450 s, an H200
#   bash plugins/cuda/tools/next_calls.sh auto  # carry [".whl"]: 3 on an H200, else 1
#
# Output goes to $OUT as h200_checks.sh writes it (summary.txt, log.txt, bench-*.json).
set -u
cd "$(dirname "$0")/../../.."
T=plugins/cuda/tools/h200_checks.sh
nvidia-smi -L || true
N=${1:-}
if [ "$N" = auto ]; then
    # H200s come rarely: a call that gets one spends it on what only an H200 can answer
    if nvidia-smi -L 2>/dev/null | grep -q H200; then N=3; else N=1; fi
    echo "next_calls.sh auto: call $N"
fi
case $N in
1)  # the four int8 batch variants at batches 8 and 32, their checks, the tree before them
    V='--mma-split 512 --mma-split-k 256'
    Q='--norm-quantize-values 256'
    O='--overlap-mma 1'
    Z='--kdefine VT_MMA_SKIP_ZERO=1'
    A="$V $Q $O $Z"
    KBATCH=8,32 KVARS="--splits 32|--mma-split 512|$V|$Q|$O|$Z|$A|--splits 32|--mma-split 512|$V|$Q|$O|$Z|$A" \
        CHECKVARS="$A" CHECKK='mma_split+int8_activation+norm_quantize+overlap_mma+compact_layouts' \
        bash $T setup models kvars:1b kvars:smol checksvar batch_old:1b
    ;;
2)  # on an H200 only: the side by side with llama.cpp (the goal's open figure)
    VSMODELS=smol,1b,1b-q4km bash $T setup llama_bg models vsllama:300
    ;;
3)  # on an H200: batch 1 on 16-bit codes of x (run 115 measured it on an H100 only), each
    # twice beside the tree, then the kit and gpu_checks.py with R = 2 (before any default)
    X='--gemv-x16 4|--gemv-x16 2'
    KBATCH=1 KVARS="--splits 32|$X|--splits 32|$X" CHECKVARS='--gemv-x16 2' \
        bash $T setup models kvars:1b kvars:smol checksvar
    ;;
*)
    echo "usage: $0 1|2|3|auto (docs/gpu.md, the latest Next)" >&2
    exit 2
    ;;
esac
