"""hipBLAS through hip-python (``hip.hipblas``), for matmuls of many rows.

``HipRuntime.gemm`` is ``out[n, m] = x[n, k] @ w[m, k].T`` in float32 row-major, which in
hipBLAS's column-major terms is ``C[m, n] = op_T(W)[m, k] @ X[k, n]``: ``hipblasSgemm`` with
``transa=T``, float32 in and out (rocBLAS has no TF32 compute type, so none is asked for).
The handle is made once, on first use, and set to the caller's stream before each call.
Written from hipBLAS's documentation; no AMD GPU has run it (docs/rocm.md).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
from vt.gpu import GpuCallError

HIPBLAS_OP_N, HIPBLAS_OP_T = 111, 112  # hipblasOperation_t
PRECISION = "hipBLAS sgemm, float32 inputs and sums"


def import_hipblas() -> ModuleType:
    """hip-python's hipBLAS module (ImportError when hip-python lacks it)."""
    from hip import hipblas

    return hipblas


class Hipblas:
    """One hipBLAS handle; hip-python returns ``(status, *outputs)`` tuples."""

    def __init__(self, hipblas: ModuleType | Any) -> None:
        self.lib = hipblas
        self._handle: Any = None
        self._stream: Any = None
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)

    def _call(self, name: str, *args: Any) -> Any:
        result = getattr(self.lib, name)(*args)
        status, outputs = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        if int(status) != 0:  # HIPBLAS_STATUS_SUCCESS
            label = getattr(status, "name", f"hipblasStatus {int(status)}")
            raise GpuCallError(name, int(status), label, "hipBLAS call failed")
        return outputs[0] if len(outputs) == 1 else None

    def gemm(
        self, stream: Any, n: int, m: int, k: int, x: int, w: int, out: int, accumulate: bool
    ) -> None:
        if self._handle is None:
            self._handle = self._call("hipblasCreate")
        if stream != self._stream:
            self._call("hipblasSetStream", self._handle, stream)
            self._stream = stream
        beta = self._one if accumulate else self._zero
        self._call(
            "hipblasSgemm", self._handle, HIPBLAS_OP_T, HIPBLAS_OP_N, m, n, k,
            self._one.ctypes.data, w, k, x, k, beta.ctypes.data, out, m,
        )  # fmt: skip

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._call("hipblasDestroy", handle)
