"""cuBLAS through nvmath-python (``vt_cuda.blas``), against a fake ``cublas`` module: which
calls a GEMM makes, with which arguments, and what happens without nvmath-python."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import vt_cuda.adapter as adapter
from fake_cuda import FakeDriver, FakeNvrtc
from vt.gpu import GpuCallError
from vt_cuda.adapter import CudaRuntime
from vt_cuda.blas import (
    COMPUTE_32F,
    COMPUTE_32F_FAST_TF32,
    CUDA_R_16F,
    CUDA_R_32F,
    WORKSPACE_BYTES,
    Cublas,
)


class FakeCublas:
    """Records calls; ``fail`` names a function that raises (as nvmath's cuBLASError)."""

    class cuBLASError(Exception):  # noqa: N801 - nvmath's name
        def __init__(self, status: int) -> None:
            self.status = status
            super().__init__(f"CUBLAS_STATUS {status}")

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail = ""

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            if name == self.fail:
                raise FakeCublas.cuBLASError(13)
            return 777 if name == "create" else None

        return call


def scalar(address: int) -> float:
    return ctypes.c_float.from_address(address).value


def test_a_gemm_is_gemm_ex_transposing_the_weight_with_tf32_compute() -> None:
    lib, rt = FakeCublas(), CudaRuntime(FakeDriver(), FakeNvrtc())
    blas = Cublas(lib, rt)
    blas.gemm(0x51, 5, 40, 64, 0x1000, 0x2000, 0x3000, False)
    blas.gemm(0x51, 5, 40, 64, 0x1000, 0x2000, 0x3000, True)
    names = [name for name, _ in lib.calls]
    # one handle with its own workspace; the stream set once; two GEMMs
    assert names == ["create", "set_workspace", "set_stream", "gemm_ex", "gemm_ex"]
    assert lib.calls[1][1][0] == 777 and lib.calls[1][1][2] == WORKSPACE_BYTES
    first, second = lib.calls[3][1], lib.calls[4][1]
    # C[m, n] = W^T X in column-major terms: transa=T, m=40, n=5, k=64, lda=ldb=k, ldc=m
    assert first[:6] == (777, 1, 0, 40, 5, 64)
    assert first[7:13] == (0x2000, 0, 64, 0x1000, 0, 64)
    assert first[14:] == (0x3000, 0, 40, COMPUTE_32F_FAST_TF32, -1)
    assert scalar(first[6]) == 1.0 and scalar(first[13]) == 0.0 and scalar(second[13]) == 1.0
    blas.gemm(0x52, 5, 40, 64, 0x1000, 0x2000, 0x3000, False)
    assert [name for name, _ in lib.calls[5:]] == ["set_stream", "gemm_ex"]
    blas.close()
    assert lib.calls[-1] == ("destroy", (777,))
    blas.close()  # idempotent
    assert lib.calls[-1] == ("destroy", (777,))


def test_half_inputs_are_16f_matrices_summed_in_float32() -> None:
    lib, rt = FakeCublas(), CudaRuntime(FakeDriver(), FakeNvrtc())
    blas = Cublas(lib, rt)
    blas.gemm(0x51, 5, 40, 64, 0x1000, 0x2000, 0x3000, False, "f16")
    args = lib.calls[-1][1]
    assert args[8] == CUDA_R_16F and args[11] == CUDA_R_16F and args[15] == CUDA_R_32F
    assert args[17] == COMPUTE_32F
    with pytest.raises(ValueError, match="inputs must be 'f32' or 'f16', got 'bf16'"):
        blas.gemm(0x51, 5, 40, 64, 0x1000, 0x2000, 0x3000, False, "bf16")


def test_a_failed_cublas_call_names_itself() -> None:
    lib, rt = FakeCublas(), CudaRuntime(FakeDriver(), FakeNvrtc())
    lib.fail = "gemm_ex"
    with pytest.raises(GpuCallError, match=r"cublas.gemm_ex failed: cuBLASError \(13\)"):
        Cublas(lib, rt).gemm(None, 1, 2, 3, 1, 2, 3, False)


def test_without_nvmath_the_runtime_has_no_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> Any:
        raise ImportError("No module named 'nvmath'")

    monkeypatch.setattr(adapter, "import_cublas", missing)
    rt = CudaRuntime(FakeDriver(), FakeNvrtc())
    assert rt.blas() is None
    with pytest.raises(NotImplementedError, match="nvmath-python"):
        rt.gemm(None, 1, 2, 3, 1, 2, 3, False)


def test_with_nvmath_the_runtime_names_its_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = FakeCublas()
    monkeypatch.setattr(adapter, "import_cublas", lambda: lib)
    rt = CudaRuntime(FakeDriver(), FakeNvrtc())
    assert "TF32" in (rt.blas() or "")
    rt.gemm(None, 1, 2, 3, 1, 2, 3, False)
    rt.close()
    assert [name for name, _ in lib.calls][-1] == "destroy"


def test_without_a_loadable_cublas_matmuls_stay_on_vts_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nvmath-python present, libcublas not: no BLAS (the reason kept), nothing raised
    until someone calls gemm anyway."""
    lib = FakeCublas()
    lib.fail = "create"
    monkeypatch.setattr(adapter, "import_cublas", lambda: lib)
    rt = CudaRuntime(FakeDriver(), FakeNvrtc())
    assert rt.blas() is None and rt.blas() is None  # looked for once
    assert [name for name, _ in lib.calls] == ["create"]
    assert "cuBLAS could not be used: cublas.create failed" in rt.blas_reason
    with pytest.raises(NotImplementedError, match="cuBLAS could not be used"):
        rt.gemm(None, 1, 2, 3, 1, 2, 3, False)


@pytest.mark.parametrize("installed", [True, False])
def test_vt_backends_says_whether_prefill_runs_on_cublas(
    monkeypatch: pytest.MonkeyPatch, installed: bool
) -> None:
    import importlib.util

    from vt_cuda.backend import CudaBackend

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            (real("json") if installed else None) if name == "nvmath" else real(name, *a)
        ),
    )
    probe = CudaBackend.probe_modules(FakeDriver(), FakeNvrtc())
    assert probe.available
    if installed:
        assert probe.reason == "" and probe.details["blas"] == "cuBLAS (nvmath-python)"
    else:
        assert probe.reason.startswith("prefill matmuls run on vt's own kernel: pip install")
        assert probe.details["blas"] == "none"
