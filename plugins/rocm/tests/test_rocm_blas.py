"""hipBLAS through hip-python (``vt_rocm.blas``), against a fake ``hipblas`` module."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import vt_rocm.adapter as adapter
from vt.gpu import GpuCallError
from vt_rocm.blas import HIPBLAS_OP_N, HIPBLAS_OP_T, Hipblas


class FakeHipblas:
    """hip-python's shape: every call returns ``(status, *outputs)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail = ""

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            status = 7 if name == self.fail else 0
            return (status, "handle") if name == "hipblasCreate" else (status,)

        return call


def scalar(address: int) -> float:
    return ctypes.c_float.from_address(address).value


def test_a_gemm_is_sgemm_transposing_the_weight() -> None:
    lib = FakeHipblas()
    blas = Hipblas(lib)
    blas.gemm("s", 5, 40, 64, 0x1000, 0x2000, 0x3000, True)
    assert [name for name, _ in lib.calls] == ["hipblasCreate", "hipblasSetStream", "hipblasSgemm"]
    args = lib.calls[2][1]
    assert args[:6] == ("handle", HIPBLAS_OP_T, HIPBLAS_OP_N, 40, 5, 64)
    assert args[7:11] == (0x2000, 64, 0x1000, 64) and args[12:] == (0x3000, 40)
    assert scalar(args[6]) == 1.0 and scalar(args[11]) == 1.0
    blas.close()
    assert lib.calls[-1] == ("hipblasDestroy", ("handle",))


def test_a_failed_hipblas_call_names_itself() -> None:
    lib = FakeHipblas()
    lib.fail = "hipblasSgemm"
    with pytest.raises(GpuCallError, match=r"hipblasSgemm failed: hipblasStatus 7"):
        Hipblas(lib).gemm("s", 1, 2, 3, 1, 2, 3, False)


def test_without_hipblas_the_runtime_has_no_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> Any:
        raise ImportError("no hipblas")

    monkeypatch.setattr(adapter, "import_hipblas", missing)
    rt = adapter.HipRuntime(object())
    assert rt.blas() is None
    with pytest.raises(NotImplementedError, match="hipblas"):
        rt.gemm("s", 1, 2, 3, 1, 2, 3, False)
    monkeypatch.setattr(adapter, "import_hipblas", FakeHipblas)
    rt = adapter.HipRuntime(object())
    assert "hipBLAS" in (rt.blas() or "")
