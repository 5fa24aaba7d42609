"""cuBLAS through nvmath-python's low-level bindings, for matmuls of many rows.

``CudaRuntime.gemm`` is ``out[n, m] = x[n, k] @ w[m, k].T`` in float32 row-major, which in
cuBLAS's column-major terms is ``C[m, n] = op_T(W)[m, k] @ X[k, n]``: ``cublasGemmEx`` with
``transa=T``: float32 matrices with ``CUBLAS_COMPUTE_32F_FAST_TF32`` (the tensor cores round
each input to TF32, 10 explicit mantissa bits in float32's range, and accumulate in
float32), or half matrices with ``CUBLAS_COMPUTE_32F`` (the same 10 mantissa bits in half's
range, exact products, float32 sums), which the GPU backend picks for large weights.
The handle is made once, on first use, with a workspace of its own (so a capture never
makes cuBLAS allocate) and set to the caller's stream before each call.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
from vt.gpu import GpuCallError

#: cuBLAS's enums (cublas_api.h, library_types.h): stable across CUDA 11-13.
OP_N, OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F = 0, 2
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20
PRECISION = (
    "cuBLAS tensor cores, inputs rounded to 10 mantissa bits (TF32; half for weights of 1M "
    "values or more), float32 sums"
)
INSTALL_HINT = "pip install nvmath-python nvidia-cublas (or vt-cuda[cu13])"


def import_cublas() -> ModuleType:
    """nvmath-python's cuBLAS bindings (ImportError when not installed)."""
    from nvmath.bindings import cublas

    return cublas


class Cublas:
    """One cuBLAS handle for one device's context; ``runtime`` allocates its workspace."""

    def __init__(self, cublas: ModuleType | Any, runtime: Any) -> None:
        self.lib = cublas
        self._rt = runtime
        self._handle: int | None = None
        self._workspace = 0
        self._stream: Any = None
        # Host scalars for alpha/beta (cuBLAS's default pointer mode reads them at the call).
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.lib, name)(*args)
        except Exception as e:  # nvmath raises cuBLASError (or a loader error) on failure
            code = int(getattr(e, "status", -1) or -1)
            raise GpuCallError(f"cublas.{name}", code, type(e).__name__, str(e)) from e

    def handle(self) -> int:
        if self._handle is None:
            handle = int(self._call("create"))
            try:
                self._workspace = int(self._rt.malloc(WORKSPACE_BYTES))
                self._call("set_workspace", handle, self._workspace, WORKSPACE_BYTES)
            except Exception:
                self._call("destroy", handle)
                raise
            self._handle = handle
        return self._handle

    def gemm(
        self, stream: Any, n: int, m: int, k: int, x: int, w: int, out: int, accumulate: bool,
        inputs: str = "f32",
    ) -> None:  # fmt: skip
        """float32 inputs on TF32 tensor cores; half inputs (exact products) summed in
        float32 (``CUBLAS_COMPUTE_32F``)."""
        if inputs not in ("f32", "f16"):
            raise ValueError(f"gemm: inputs must be 'f32' or 'f16', got {inputs!r}")
        ab, compute = (
            (CUDA_R_32F, COMPUTE_32F_FAST_TF32) if inputs == "f32" else (CUDA_R_16F, COMPUTE_32F)
        )
        handle = self.handle()
        if stream != self._stream:
            self._call("set_stream", handle, int(stream))
            self._stream = stream
        beta = self._one if accumulate else self._zero
        self._call(
            "gemm_ex", handle, OP_T, OP_N, m, n, k, self._one.ctypes.data, w, ab, k,
            x, ab, k, beta.ctypes.data, out, CUDA_R_32F, m, compute, GEMM_DEFAULT,
        )  # fmt: skip

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._call("destroy", handle)
            self._rt.free(self._workspace)
            self._workspace = 0
