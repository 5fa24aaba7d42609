"""The GPU attention kernels run on the CPU (plugins/cuda/tools/emulate_kernels.py: g++, a
thread per GPU thread) against gpu_checks.py's reference: split attention over positions,
by default (VT_FA_WARP: the warp path), on the block path (VT_FA_WARP=0), with one query
head a block (GpuBackend.attention_max_group = 1) and with VT_FA_DIRECT on one split
(every row's positions in its first split, which writes the output); and the one-row gemv
kernels on 16-bit codes of x (GpuBackend.gemv_x16_min_rows): so CI checks kernel source it
cannot run on a GPU. Slow: a compile and a few cases each."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EMULATE = ROOT / "plugins/cuda/tools/emulate_kernels.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    "defines",
    [
        (),
        ("-D", "VT_FA_WARP=0"),
        ("--attention-heads", "1"),
        ("-D", "VT_FA_DIRECT=1", "--min-split", "4096"),
    ],
    ids=["warp", "block", "warp-one-head-a-block", "warp-direct-one-split"],
)
def test_split_attention_in_the_emulation(defines: tuple[str, ...]) -> None:
    assert shutil.which("g++"), "the kernel emulation needs g++ (C++20)"
    run = subprocess.run(
        [sys.executable, str(EMULATE), "-k", "past one chunk", *defines],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "8 emulated checks passed" in run.stdout, run.stdout[-3000:]


@pytest.mark.slow
def test_gemv_on_16_bit_codes_in_the_emulation() -> None:
    """The one-row gemv kernels with x as 16-bit codes (``--gemv-x16 1``: every block) on
    the CPU: matmul, matmul_add, swiglu and qkv at 1, 2 and 4 features a block within the
    kit's bounds and near the float32 warp kernels, the long rows, and a NaN or an
    infinity in x giving NaN (gpu_checks.py's checks, the HIP branch's two-way products)."""
    assert shutil.which("g++"), "the kernel emulation needs g++ (C++20)"
    run = subprocess.run(
        [sys.executable, str(EMULATE), "-k", "gemv Q4_1 K=4608|long gemv Q8_0 256|x16",
         "--gemv-x16", "1"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "5 emulated checks passed" in run.stdout, run.stdout[-3000:]


@pytest.mark.slow
def test_gemv_x16_at_two_rows_takes_the_long_rows_blocks_as_the_backend_does() -> None:
    """``--gemv-x16 2`` with one feature a block (gv 1) at K = 4,608: the long rows take 4
    features a block (gemv_long_min_k), so x goes as 16-bit codes and gpu_checks.py must
    hold it to the 16-bit bound; run 117 (H100) failed here while the check counted gv's
    rows itself, not the backend's."""
    assert shutil.which("g++"), "the kernel emulation needs g++ (C++20)"
    run = subprocess.run(
        [sys.executable, str(EMULATE), "-k", "gemv Q8_0 K=4608 gv=1", "--gemv-x16", "2"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 emulated checks passed" in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize("rows", ["0", "-2"])
def test_emulation_refuses_gemv_x16_below_one_row(rows: str) -> None:
    """``--gemv-x16`` counts weight rows a block: below 1 is refused by name before any
    compile (0 is the backend's "never", which the emulation runs without the flag)."""
    run = subprocess.run(
        [sys.executable, str(EMULATE), "--gemv-x16", rows],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"--gemv-x16 must be at least 1 (weight rows a block), not {rows}" in run.stderr
    assert "emulated checks passed" not in run.stdout
