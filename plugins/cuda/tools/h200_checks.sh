#!/usr/bin/env bash
# Everything docs/gpu.md reports from an NVIDIA GPU, in one go (one device call).
#
#   bash plugins/cuda/tools/h200_checks.sh [STEP...]     # from the repository root
#
# Steps (default: all but baseline, in this order): setup backends verify audit kit checks
# bench profile, and baseline: the bench and profile on an older vt copied into .whl/old
# (core/ and plugins/ of, say, `git worktree add /tmp/old 79b67e1`), same machine.
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
            && nvidia-smi -L && python3 -m pip list 2>/dev/null | grep -i -E '^(cuda|nvidia-cuda-nvrtc|numpy|pydantic |gguf)'"
        ;;
    backends)
        step backends 120 "vt backends && vt backends --json > $OUT/backends.json"
        ;;
    verify)  # the cost of vt.management.trust's verification: fresh, then from the cache
        step verify 300 "rm -rf $VT_HOME/verified; python3 - <<'EOF'
import time
from vt import registry, trust
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
    checks)
        step gpu_checks 500 "python3 -m pytest -q -p no:cacheprovider -o addopts='' -s -rfE \
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
    *)
        echo "unknown step $s" | tee -a "$OUT/summary.txt"
        ;;
    esac
done
cd "$ROOT" && cat "$OUT/summary.txt"
