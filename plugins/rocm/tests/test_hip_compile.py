"""The one kernel source's HIP branch through a real HIP compiler.

No AMD GPU is here, so hiprtc never runs; but Debian's ROCm 5.2 ``hipcc`` (clang 15) compiles
what the ROCm plugin hands hiprtc: the same source and options, the device's target swapped
for one that ROCm has device libraries for (gfx90a, a wave64 Instinct; gfx1030, a wave32
Radeon), and ``hip/hip_runtime.h`` included as hiprtc includes it implicitly. Slow (about a
minute on 2 cores); CI installs the compiler (``apt-get install hipcc libamdhip64-dev
rocm-device-libs``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fake_hip import APU, FakeHip, FakeHiprtc
from vt.gpu.modules import MODULE_GROUPS, WEIGHT_GROUPS, kernel_source
from vt.gpu.weights import LAYOUTS
from vt_rocm.adapter import HipRuntime
from vt_rocm.backend import RocmBackend

HIPCC, READELF = shutil.which("hipcc"), shutil.which("readelf")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        HIPCC is None or READELF is None,
        reason="needs hipcc and readelf (Debian: apt-get install hipcc libamdhip64-dev "
        "rocm-device-libs binutils)",
    ),
]

#: A target of each wave size that Debian's ROCm 5.2 has device libraries for.
TARGETS = {64: "gfx90a", 32: "gfx1030"}
#: Kernels only the CUDA branch defines (thread-block clusters).
CUDA_ONLY = {"attention_split_cluster"}
#: What a decode step of the default shapes launches (docs/gpu.md's profiles), at batch 1
#: and 32, and prefill's tiled attention: present on both wave sizes.
STEP_KERNELS = {
    "embedding_q", "rms_norm", "qkv_rope_gemv_q", "qkv_rope_norm_gemv_q", "attention_split",
    "attention_combine", "matmul_gemv2_q", "matmul_gemv4_q", "swiglu_gemv2_q",
    "swiglu_norm_gemv2_q", "matmul_norm_gemv2_q", "sample", "sample_argmax", "gather_rows",
    "quantize_rows", "rope_kv_store", "matmul_mma4_q8a", "swiglu_mma4_q8a", "qkv_mma4_q8a",
    "attention_tiled_h64r16",
}  # fmt: skip


def _programs(warp: int, layouts: bool, x16: int | None = None) -> list[tuple[str, str, list[str]]]:
    """(source, name, options) of every hiprtc compile the plugin asks for: every group's
    module of every layout and, with ``layouts``, the weights' groups' per quantized-weight
    layout (``x16``:
    ``GpuBackend.gemv_x16_min_rows`` in every module; None: the defaults, 16-bit codes of
    x in the 4-bit layouts' modules)."""
    HipRuntime.binaries.clear()
    fake, rtc = FakeHip(APU.model_copy(update={"warp_size": warp})), FakeHiprtc()
    backend = RocmBackend(HipRuntime(fake, hiprtc=rtc), platform=APU.platform)
    if x16 is not None:
        backend.gemv_x16_min_rows, backend.gemv_x16_layout_flags = x16, 0
    try:
        backend.prepare()
        if layouts:
            for layout in sorted(set(LAYOUTS.values())):
                for group in WEIGHT_GROUPS:
                    backend._module((group, layout))
    finally:
        backend.close()
        HipRuntime.binaries.clear()
    sources = [args for name, args in rtc.calls if name == "hiprtcCreateProgram"]
    options = [args[2] for name, args in rtc.calls if name == "hiprtcCompileProgram"]
    per_layout = len(WEIGHT_GROUPS) * len(set(LAYOUTS.values())) if layouts else 0
    assert len(sources) == len(options) == len(MODULE_GROUPS) + per_layout
    return [
        (src.decode(), name.decode(), [o.decode() for o in opts])
        for (src, name, *_), opts in zip(sources, options, strict=True)
    ]


def _hipcc(tmp: Path, warp: int, program: tuple[str, str, list[str]]) -> set[str]:
    """Compile one program for TARGETS[warp]; the kernels its code object holds."""
    source, name, options = program
    path = tmp / f"w{warp}-{name}".replace(".cu", ".hip")
    path.write_text(source)
    out = path.with_suffix(".co")
    opts = [o for o in options if not o.startswith("--offload-arch=")]
    assert f"-DVT_WARP={warp}" in opts, opts
    cmd = [
        str(HIPCC), "-x", "hip", "-include", "hip/hip_runtime.h",
        f"--offload-arch={TARGETS[warp]}", *opts, "-O2", "--cuda-device-only",
        "--no-gpu-bundle-output", "-c", "-o", str(out), str(path),
    ]  # fmt: skip
    # hipcc picks NVIDIA's platform where it finds nvcc (some machines have both); AMD's
    # is the one this checks.
    env = {**os.environ, "HIP_PLATFORM": "amd"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr[-6000:]}"
    assert "error" not in done.stderr, done.stderr[-6000:]
    table = subprocess.run(
        [str(READELF), "-Ws", str(out)], capture_output=True, text=True, check=True
    ).stdout
    fields = [line.split() for line in table.splitlines()]
    return {f[7] for f in fields if len(f) > 7 and f[3] == "FUNC" and not f[7].endswith(".kd")}


def test_every_kernel_compiles_for_wave64_and_wave32(tmp_path: Path) -> None:
    """Every group's module of every layout, each alone as the plugin asks hiprtc for it,
    compiles for a wave64 and a wave32 target, and together they hold the same kernels on
    both: every ``__global__`` the source names outright (the CUDA-only
    cluster kernel aside) and what a decode step launches."""
    jobs = [(warp, program) for warp in TARGETS for program in _programs(warp, layouts=False)]
    n = len(MODULE_GROUPS)
    assert [p[1] for _, p in jobs] == [f"vt_{group}.cu" for group in MODULE_GROUPS] * 2
    with ThreadPoolExecutor(2) as pool:
        found = list(pool.map(lambda job: _hipcc(tmp_path, *job), jobs))
    kernels = {warp: set().union(*found[n * i : n * (i + 1)]) for i, warp in enumerate(TARGETS)}
    assert kernels[64] == kernels[32]
    named = set(re.findall(r"__global__\s+void\s+(?:__cluster_dims__\([^)]*\)\s+)?(\w+)\s*\(",
                           kernel_source()))  # fmt: skip
    assert named - CUDA_ONLY <= kernels[64], sorted(named - CUDA_ONLY - kernels[64])
    assert STEP_KERNELS <= kernels[64], sorted(STEP_KERNELS - kernels[64])
    assert not CUDA_ONLY & kernels[64]


def test_every_weight_layout_module_compiles(tmp_path: Path) -> None:
    """The quantized-weight kernels compiled per layout (``-DVT_Q_FLAGS``: Q8_0, Q4_0,
    Q4_1, Q4_K, Q5_K, Q6_K's layouts) as the defaults ask (the 4-bit layouts with 16-bit
    codes of x, ``-DVT_GV_X16``) compile for the wave64 target, each holding the one-row
    gemv kernels the decode step launches (its gemv group's module)."""
    programs = [p for p in _programs(64, layouts=True) if p[1].startswith("vt_gemv_q")]
    assert {p[1] for p in programs} == {f"vt_gemv_q{v:x}.cu" for v in LAYOUTS.values()}
    x16 = {p[1] for p in programs if "-DVT_GV_X16=4" in p[2]}
    nibbles = ("Q4_0", "Q4_1", "Q4_K")  # the layouts with Q_NIB
    assert x16 == {f"vt_gemv_q{LAYOUTS[t]:x}.cu" for t in LAYOUTS if t.name in nibbles}
    with ThreadPoolExecutor(2) as pool:
        found = list(pool.map(lambda p: _hipcc(tmp_path, 64, p), programs))
    for (_, name, _), kernels in zip(programs, found, strict=True):
        assert {"matmul_gemv2_q", "swiglu_gemv2_q", "qkv_rope_gemv_q"} <= kernels, name


def test_the_gemvs_on_16_bit_codes_compile(tmp_path: Path) -> None:
    """With ``gemv_x16_min_rows`` set (``-DVT_GV_X16``: x as 16-bit codes, the HIP branch's
    plain two-way products) the Q8_0 layout's module compiles for wave64 and wave32 with
    the one-row gemv kernels."""
    q8 = f"vt_gemv_q{next(v for t, v in LAYOUTS.items() if t.name == 'Q8_0'):x}.cu"
    jobs = []
    for warp in TARGETS:
        program = next(p for p in _programs(warp, layouts=True, x16=1) if p[1] == q8)
        assert "-DVT_GV_X16=1" in program[2], program[2]
        jobs.append((warp, program))
    with ThreadPoolExecutor(2) as pool:
        found = list(pool.map(lambda job: _hipcc(tmp_path, *job), jobs))
    for kernels in found:
        assert {"matmul_gemv4_q", "swiglu_gemv2_q", "matmul_psq_gemv4_q"} <= kernels
