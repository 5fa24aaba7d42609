"""cuBLAS through nvmath-python (``vt_cuda.blas``), against a fake ``cublas`` module: which
calls a GEMM makes, with which arguments, and what happens without nvmath-python."""

from __future__ import annotations

import ctypes
import enum
from typing import Any

import numpy as np
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
    MAX_PLANS,
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


class FakeCublasLt:
    """nvmath's ``cublasLt`` bindings, recorded: handles are numbered, attributes read back
    from the buffers they are given, ``algos`` algorithms found per heuristic query, and
    ``fail`` names a function that raises (as nvmath's cuBLASLtError)."""

    class MatmulDescAttribute(enum.IntEnum):
        TRANSA = 3
        TRANSB = 4

    class MatmulPreferenceAttribute(enum.IntEnum):
        MAX_WORKSPACE_BYTES = 1
        MIN_ALIGNMENT_A_BYTES = 5
        MIN_ALIGNMENT_B_BYTES = 6
        MIN_ALIGNMENT_C_BYTES = 7
        MIN_ALIGNMENT_D_BYTES = 8

    class cuBLASLtError(Exception):  # noqa: N801 - nvmath's name
        def __init__(self, status: int) -> None:
            self.status = status
            super().__init__(f"CUBLAS_STATUS {status}")

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.attributes: dict[int, dict[int, int]] = {}  # object -> attribute -> value
        self.live: set[int] = set()  # descriptors, layouts, preferences, handles not destroyed
        self.fail = ""
        self.algos = 1
        self._next = 100

    @staticmethod
    def get_matmul_desc_attribute_dtype(attr: int) -> Any:
        return np.int32

    @staticmethod
    def get_matmul_preference_attribute_dtype(attr: int) -> Any:
        return np.uint64 if attr == 1 else np.uint32

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            if name == self.fail:
                raise FakeCublasLt.cuBLASLtError(15)
            if name in ("create", "matmul_desc_create", "matrix_layout_create",
                        "matmul_preference_create"):  # fmt: skip
                self._next += 1
                self.live.add(self._next)
                return self._next
            if name.endswith("_destroy") or name == "destroy":
                self.live.remove(args[0])
            if name.endswith("_set_attribute"):
                obj, attr, buf, size = args
                kind = ctypes.c_uint64 if size == 8 else ctypes.c_int32
                self.attributes.setdefault(obj, {})[int(attr)] = kind.from_address(buf).value
            if name == "matmul_algo_get_heuristic":
                ctypes.c_int32.from_address(args[-1]).value = self.algos
            return None

        return call


def lt_blas() -> tuple[FakeCublas, FakeCublasLt, Cublas]:
    lib, lt = FakeCublas(), FakeCublasLt()
    return lib, lt, Cublas(lib, CudaRuntime(FakeDriver(), FakeNvrtc()), lt)


def test_a_gemm_is_one_cublaslt_matmul_over_a_plan_made_once_per_shape() -> None:
    """The first GEMM of a shape makes its plan (descriptor: TF32 compute, float32 scale,
    A transposed; layouts: W k x m, X k x n, out m x n, column-major; the heuristic asked
    for one algorithm within the workspace and the pointers' alignment), every GEMM of it
    is one cublasLtMatmul on the caller's stream with out as C and D."""
    lib, lt, blas = lt_blas()
    blas.gemm(0x51, 5, 40, 64, 0x1000, 0x2000, 0x3000, False)
    names = lt.names()
    assert names[:2] == ["create", "matmul_desc_create"]
    assert names[-3:] == ["matmul_algo_get_heuristic", "matmul_preference_destroy", "matmul"]
    assert lt.calls[1][1] == (COMPUTE_32F_FAST_TF32, CUDA_R_32F)
    desc = 102
    assert lt.attributes[desc] == {3: 1, 4: 0}  # TRANSA = T, TRANSB = N
    layouts = [args for name, args in lt.calls if name == "matrix_layout_create"]
    assert layouts == [(CUDA_R_32F, 64, 40, 64), (CUDA_R_32F, 64, 5, 64), (CUDA_R_32F, 40, 5, 40)]
    pref = next(args[6] for name, args in lt.calls if name == "matmul_algo_get_heuristic")
    assert lt.attributes[pref] == {1: WORKSPACE_BYTES, 5: 256, 6: 256, 7: 256, 8: 256}
    heuristic = lt.calls[names.index("matmul_algo_get_heuristic")][1]
    assert heuristic[:8] == (101, desc, 103, 104, 105, 105, pref, 1)  # one algorithm asked
    matmul = lt.calls[-1][1]
    assert matmul[:2] == (101, desc) and scalar(matmul[2]) == 1.0 and scalar(matmul[7]) == 0.0
    assert matmul[3:7] == (0x2000, 103, 0x1000, 104)  # A = the weight, B = x
    assert matmul[8:12] == (0x3000, 105, 0x3000, 105)  # C = D = out
    assert matmul[12] == heuristic[8] and matmul[13:] == (blas._workspace, WORKSPACE_BYTES, 0x51)
    # the same shape again: one call, the residual accumulated (beta 1)
    lt.calls.clear()
    blas.gemm(0x52, 5, 40, 64, 0x1100, 0x2000, 0x3000, True)
    assert lt.names() == ["matmul"] and scalar(lt.calls[0][1][7]) == 1.0
    assert lt.calls[0][1][-1] == 0x52
    assert "gemm_ex" not in [name for name, _ in lib.calls]
    blas.close()
    assert not lt.live  # plans, layouts and the handle destroyed
    assert lib.calls[-1] == ("destroy", (777,))


def test_cublaslt_plans_by_inputs_and_alignment() -> None:
    """Half inputs: 16F layouts for W and x, float32 compute; pointers aligned to less
    than 256 bytes: a plan of their own whose heuristic knows it."""
    _, lt, blas = lt_blas()
    blas.gemm(0x51, 5, 40, 64, 0x1000, 0x2000, 0x3000, False, "f16")
    assert lt.calls[1][1] == (COMPUTE_32F, CUDA_R_32F)
    layouts = [args[0] for name, args in lt.calls if name == "matrix_layout_create"]
    assert layouts == [CUDA_R_16F, CUDA_R_16F, CUDA_R_32F]
    blas.gemm(0x51, 5, 40, 64, 0x1010, 0x2000, 0x3000, False, "f16")  # x 16-byte aligned
    pref = [args[6] for name, args in lt.calls if name == "matmul_algo_get_heuristic"]
    assert len(pref) == 2 and lt.attributes[pref[1]][5] == 16
    assert len(blas._plans) == 2


def test_a_shape_without_a_cublaslt_algorithm_stays_on_gemm_ex() -> None:
    lib, lt, blas = lt_blas()
    lt.algos = 0
    for _ in range(2):
        blas.gemm(0x51, 5, 40, 64, 0x1000, 0x2000, 0x3000, False)
    assert lt.names().count("matmul_algo_get_heuristic") == 1  # asked once
    assert "matmul" not in lt.names() and "no cuBLASLt algorithm" in blas.lt_reason
    assert [name for name, _ in lib.calls].count("gemm_ex") == 2
    assert len(lt.live) == 1  # only the handle: the unused plan's objects destroyed


@pytest.mark.parametrize("fail", ["create", "matrix_layout_create", "matmul"])
def test_a_failing_cublaslt_falls_back_to_gemm_ex(fail: str) -> None:
    """No libcublasLt (create fails: GemmEx from then on), a plan that cannot be made, or
    a matmul that fails: that GEMM and that shape's later ones run on cublasGemmEx."""
    lib, lt, blas = lt_blas()
    lt.fail = fail
    blas.gemm(0x51, 5, 40, 64, 0x1000, 0x2000, 0x3000, False)
    blas.gemm(0x51, 5, 40, 64, 0x1000, 0x2000, 0x3000, False)
    assert [name for name, _ in lib.calls].count("gemm_ex") == 2
    said = "cublasLtMatmul failed" if fail == "matmul" else f"cublasLt.{fail} failed"
    assert said in blas.lt_reason
    assert (blas.lt is None) is (fail == "create")
    assert lt.names().count("matmul") == (1 if fail == "matmul" else 0)
    blas.close()
    assert not lt.live


def test_use_lt_false_is_gemm_ex_and_plans_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    lib, lt, blas = lt_blas()
    monkeypatch.setattr(Cublas, "use_lt", False)
    blas.gemm(0x51, 5, 40, 64, 0x1000, 0x2000, 0x3000, False)
    assert lt.calls == [] and [name for name, _ in lib.calls][-1] == "gemm_ex"
    monkeypatch.setattr(Cublas, "use_lt", True)
    for n in range(MAX_PLANS + 1):
        blas.gemm(0x51, 64 + n, 40, 64, 0x1000, 0x2000, 0x3000, False)
    assert len(blas._plans) == 1  # all dropped at MAX_PLANS, the newest made again
    assert len(lt.live) == 1 + 4  # the handle and one plan's descriptor and layouts


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
    monkeypatch.setattr(adapter, "import_cublaslt", lambda: None)  # cublasGemmEx
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
    monkeypatch.setattr(adapter, "import_cublaslt", lambda: FakeCublasLt())
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
