#!/usr/bin/env bash
# What a device call carries and the device cannot fetch (it reaches no registry), made
# here on a fresh machine in one go; each part is skipped when it is already there.
#
#   bash plugins/cuda/tools/device_files.sh [OLD_COMMIT]     # from anywhere in the repo
#
# .whl/*.whl     cp312 wheels the device image lacks: pydantic (and its needs), gguf,
#                nvmath-python (without it prefill runs on vt's own kernels, run 86);
#                vt serve's needs and the openai client (the servellama step)
# .whl/old       core/ and plugins/ of OLD_COMMIT, for h200_checks.sh's baseline and
#                batch_old steps (only when OLD_COMMIT is given)
# .llama/llama-src.tar.xz
#                llama.cpp's sources from the llama-cpp-python 0.3.36 sdist's vendored
#                tree, for benchmarks/gpu_vs_llama_cpp.py (h200_checks.sh llama_bg)
#
# Both folders are kept out of git by .git/info/exclude, which this script writes. Carry
# them with the device call: carry [".whl"] or [".whl", ".llama"] (64 MiB at most a call).
set -eu
cd "$(git rev-parse --show-toplevel)"
OLD=${1:-}

mkdir -p .git/info .whl .llama
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    plats+=(--platform "$p")
done
for p in /.whl/ /.llama/; do
    grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude
done

if ! ls .whl/nvmath_python-*.whl > /dev/null 2>&1; then
    echo "== device wheels -> .whl"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plats[@]}" -d .whl \
        pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
        typing-inspection==0.4.2 typing-extensions==4.16.0 gguf==0.19.0 nvmath-python==1.0.0
fi

if ! ls .whl/openai-*.whl > /dev/null 2>&1; then
    # vt serve's needs and the official openai client, for h200_checks.sh's servellama step
    # (the versions this machine's tests run; the image has click and numpy)
    echo "== serving wheels -> .whl"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plats[@]}" -d .whl \
        starlette==1.10.0 uvicorn==0.55.0 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 \
        idna==3.21 psutil==7.2.2 prometheus-client==0.26.0 threadpoolctl==3.8.0 \
        tqdm==4.70.1 openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 jiter==0.19.0 \
        certifi==2026.5.20 truststore==0.10.5
fi

if [ -n "$OLD" ]; then
    echo "== $OLD's core and plugins -> .whl/old"
    rm -rf .whl/old /tmp/vt-old-tree
    git worktree prune  # a run cut short leaves its worktree registered
    git worktree add -q --detach /tmp/vt-old-tree "$OLD"
    mkdir -p .whl/old
    cp -r /tmp/vt-old-tree/core /tmp/vt-old-tree/plugins .whl/old/
    git worktree remove --force /tmp/vt-old-tree
fi

# (a tar without scripts/ui-assets.cmake predates llama-server's build: made again)
if ! tar -tJf .llama/llama-src.tar.xz scripts/ui-assets.cmake > /dev/null 2>&1; then
    echo "== llama.cpp's sources -> .llama/llama-src.tar.xz"
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-binary :all: --no-deps -d "$tmp" llama-cpp-python==0.3.36
    tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
    (cd "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp && tar -cJf "$OLDPWD/.llama/llama-src.tar.xz" \
        CMakeLists.txt CMakePresets.json cmake ggml src include common tools vendor app LICENSE licenses \
        scripts/ui-assets.cmake)
    rm -rf "$tmp"
fi

du -sh .whl .llama
