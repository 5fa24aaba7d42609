"""The GPU attention kernels run on the CPU (plugins/cuda/tools/emulate_kernels.py: g++, a
thread per GPU thread) against gpu_checks.py's reference: split attention over positions,
by default (VT_FA_WARP: the warp path), on the block path (VT_FA_WARP=0), with one query
head a block (GpuBackend.attention_max_group = 1) and with VT_FA_DIRECT on one split
(every row's positions in its first split, which writes the output); and the one-row gemv
kernels on 16-bit codes of x (GpuBackend.gemv_x16_min_rows); short-context attention
(GpuBackend.short_context): so CI checks kernel source it
cannot run on a GPU. Slow: a compile and a few cases each."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import vt
from vt.testing.kernels_suite import weight_tensor

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
def test_short_context_attention_in_the_emulation() -> None:
    """GpuBackend.short_context: attention_bounded at one row as one launch of 512 threads
    from its own module (-DFA_THREADS=512), at head_dim 64, 128 and 256, contexts 1-512 and
    an invalid slot, within the kit's bound of the reference (gpu_checks.py's cases)."""
    assert shutil.which("g++"), "the kernel emulation needs g++ (C++20)"
    run = subprocess.run(
        [sys.executable, str(EMULATE), "-k", "short-context attention"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "emulation built with FA_THREADS=512" in run.stdout, run.stdout[-3000:]
    assert "8 emulated checks passed" in run.stdout, run.stdout[-3000:]


@pytest.mark.slow
def test_gemv_on_16_bit_codes_in_the_emulation() -> None:
    """The one-row gemv kernels with x as 16-bit codes (``--gemv-x16 1 --gemv-x16-flags 0``:
    every block of every layout) on the CPU: matmul, matmul_add, swiglu and qkv at 1, 2 and
    4 features a block within the kit's bounds and near the float32 warp kernels, the long
    rows, and a NaN or an infinity in x giving NaN (gpu_checks.py's checks, the HIP
    branch's two-way products)."""
    assert shutil.which("g++"), "the kernel emulation needs g++ (C++20)"
    run = subprocess.run(
        [sys.executable, str(EMULATE), "-k", "gemv Q4_1 K=4608|long gemv Q8_0 256|x16",
         "--gemv-x16", "1", "--gemv-x16-flags", "0"],
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
        [sys.executable, str(EMULATE), "-k", "gemv Q8_0 K=4608 gv=1", "--gemv-x16", "2",
         "--gemv-x16-flags", "0"],
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


@pytest.mark.parametrize("flags", ["nib", "0x1", "-0x100"])
def test_emulation_refuses_flags_that_are_not_layout_flags(flags: str) -> None:
    """``--gemv-x16-flags`` takes 0 or the Q_* layout flags: anything else is refused by
    name before any compile."""
    run = subprocess.run(
        [sys.executable, str(EMULATE), f"--gemv-x16-flags={flags}"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"takes 0 or Q_* layout flags (0x100), not {flags}" in run.stderr
    assert "emulated checks passed" not in run.stdout


def test_the_emulation_joins_every_kernel_part_it_emulates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The emulation's parts are the kernel parts but elementwise.cu and logprobs.cu (which
    it does not emulate), each once, common.cu first: a part added or split shows here, not
    as the slow suite's g++ error."""
    from vt.gpu.modules import KERNEL_PARTS  # noqa: PLC0415

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.syspath_prepend(str(EMULATE.parent))
    import emulate_kernels  # noqa: PLC0415

    parts = list(emulate_kernels.PARTS)
    assert parts[0] == "common.cu" and len(set(parts)) == len(parts)
    assert set(KERNEL_PARTS) - set(parts) == {"elementwise.cu", "logprobs.cu"}
    assert set(parts) <= set(KERNEL_PARTS)


def test_emulator_runs_each_launch_on_its_modules_defines(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """emulate_kernels.py builds a library per set of defines the backend compiles a module
    with (VT_WARP and VT_Q_FLAGS left out, the command line's added) and runs each launch
    in its module's: by default a Q4_1 one-row matmul on 16-bit codes of x
    (-DVT_GV_X16=4, its layout's module) and a Q8_0 one on the float path."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # emulated_backend adds the tests' folders
    monkeypatch.syspath_prepend(str(EMULATE.parent))
    import emulate_kernels  # noqa: PLC0415

    assert emulate_kernels.module_defines(
        ("-DVT_WARP=32", "-DVT_NORM_LATE=1", "-DVT_GV_X16=4", "-DVT_Q_FLAGS=0x500")
    ) == ("VT_NORM_LATE=1", "VT_GV_X16=4")
    ran: list[tuple[tuple[str, ...], str]] = []

    class Lib:
        def __init__(self, defines: tuple[str, ...]) -> None:
            self.defines = defines

        def vt_emulate(self, name: bytes, *_: object) -> int:
            ran.append((self.defines, name.decode()))
            return 1

    monkeypatch.setattr(emulate_kernels, "build", lambda folder, defines=(): Lib(defines))
    libs = emulate_kernels.Libraries(tmp_path, ("X=1",))
    backend, _ = emulate_kernels.emulated_backend(libs)
    backend.norm_fold_max_k = 0
    rng = np.random.default_rng(0)
    stream = backend.create_stream()
    x = backend.alloc(4 * 256)
    for wtype in ("Q4_1", "Q8_0", "Q4_1"):
        t, _ = weight_tensor("w", rng.standard_normal((64, 256)).astype(np.float32), wtype)
        w = backend.upload_weight(t)
        out = backend.alloc(4 * 64)
        backend.launch("matmul", stream, out=vt.Tensor.of(out, np.float32, 1, 64),
                       x=vt.Tensor.of(x, np.float32, 1, 256), weight=w)  # fmt: skip
    backend.synchronize(stream)
    x16 = ("X=1", "VT_GV_X16=4")
    assert [d for d, name in ran if name.startswith("matmul")] == [x16, ("X=1",), x16]
    assert sorted(libs.built) == [("X=1",), x16]  # one library a set of defines
    backend.close()
