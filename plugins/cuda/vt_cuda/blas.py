"""cuBLAS through nvmath-python's low-level bindings, for matmuls of many rows.

``CudaRuntime.gemm`` is ``out[n, m] = x[n, k] @ w[m, k].T`` in float32 row-major, which in
cuBLAS's column-major terms is ``C[m, n] = op_T(W)[m, k] @ X[k, n]``: ``cublasGemmEx`` with
``transa=T``: float32 matrices with ``CUBLAS_COMPUTE_32F_FAST_TF32`` (the tensor cores round
each input to TF32, 10 explicit mantissa bits in float32's range, and accumulate in
float32), or half matrices with ``CUBLAS_COMPUTE_32F`` (the same 10 mantissa bits in half's
range, exact products, float32 sums), which the GPU backend picks for large weights.
The handle is made once, on first use, with a workspace of its own (so a capture never
makes cuBLAS allocate) and set to the caller's stream before each call.

Where nvmath-python also binds cuBLASLt (``nvmath.bindings.cublasLt``), a GEMM is one
``cublasLtMatmul`` over a *plan* made once per shape (n, m, k, inputs, the pointers'
alignment): the operation descriptor, the three matrix layouts and the algorithm
``cublasLtMatmulAlgoGetHeuristic`` picks for them, with the same workspace. The same
products in the same precision (TF32, or half inputs, float32 sums); what it saves is host
time: cublasGemmEx describes the problem and picks its algorithm again on every call (11-23
us of host time a call on the H200's host, docs/gpu.md runs 35-36), and a prefill chunk of
the 135M shape makes 210 of them. A shape whose heuristic finds no algorithm, or whose
plan fails, stays on cublasGemmEx; ``Cublas.use_lt = False`` turns plans off (a tool's
"before").
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

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


def import_cublaslt() -> ModuleType | None:
    """nvmath-python's cuBLASLt bindings, or None (an nvmath without them: cublasGemmEx)."""
    try:
        from nvmath.bindings import cublasLt
    except ImportError:
        return None
    return cublasLt


#: cublasLtMatmulHeuristicResult_t: the algorithm (64 bytes) first, then size_t
#: workspaceSize, cublasStatus_t state, float wavesCount, int reserved[4] (96 bytes; room
#: to spare here).
HEURISTIC_BYTES = 256
#: Plans kept at most; past that they are all destroyed and made again as shapes come
#: (a server's prefill chunks take any row count from blas_min_rows to the chunk size).
MAX_PLANS = 1024


class Plan:
    """One shape's cuBLASLt matmul: descriptor, layouts (A: the weight, B: x, C = D: out)
    and the heuristic's result, whose first bytes are the algorithm."""

    __slots__ = ("desc", "a", "b", "c", "result", "algo")

    def __init__(self, desc: int, a: int, b: int, c: int, result: Any) -> None:
        self.desc, self.a, self.b, self.c = desc, a, b, c
        self.result = result  # keeps the algorithm's bytes alive
        self.algo = int(result.ctypes.data)


class Cublas:
    """One cuBLAS handle for one device's context; ``runtime`` allocates its workspace.
    ``lt``: nvmath's cuBLASLt module (plans per shape, module docstring), or None."""

    #: GEMMs through cuBLASLt plans where ``lt`` is given; False: cublasGemmEx every call.
    use_lt: ClassVar[bool] = True

    def __init__(self, cublas: ModuleType | Any, runtime: Any, lt: ModuleType | Any = None) -> None:
        self.lib = cublas
        self.lt = lt
        self.lt_reason = "" if lt is not None else "no cuBLASLt bindings"
        self._rt = runtime
        self._handle: int | None = None
        self._lt_handle = 0
        self._plans: dict[tuple[int, int, int, str, int], Plan | None] = {}
        self._workspace = 0
        self._stream: Any = None
        self._lt_stream: Any = None
        self._lt_stream_int = 0
        # Host scalars for alpha/beta (cuBLAS's default pointer mode reads them at the call).
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)
        self._one_ptr, self._zero_ptr = int(self._one.ctypes.data), int(self._zero.ctypes.data)

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
        if self.lt is not None and self.use_lt:
            low = (x | w | out) & 255  # the pointers' common alignment, up to 256 bytes
            key = (n, m, k, inputs, low & -low if low else 256)
            plan = self._plans.get(key, False)
            if plan is False:
                plan = self._plan(key)
            if plan is not None:
                if stream is not self._lt_stream:
                    self._lt_stream = stream
                    self._lt_stream_int = 0 if stream is None else int(stream)
                try:
                    self.lt.matmul(
                        self._lt_handle, plan.desc, self._one_ptr, w, plan.a, x, plan.b,
                        self._one_ptr if accumulate else self._zero_ptr, out, plan.c, out,
                        plan.c, plan.algo, self._workspace, WORKSPACE_BYTES, self._lt_stream_int,
                    )  # fmt: skip
                    return
                except Exception as e:  # this shape back on cublasGemmEx (nothing enqueued)
                    self._plans[key] = None
                    self.lt_reason = f"cublasLtMatmul failed for {key}: {e}"
                    self._destroy(plan)
        ab, compute = (
            (CUDA_R_32F, COMPUTE_32F_FAST_TF32) if inputs == "f32" else (CUDA_R_16F, COMPUTE_32F)
        )
        handle = self.handle()
        if stream != self._stream:
            self._call("set_stream", handle, int(stream))
            self._stream = stream
        self._call(
            "gemm_ex", handle, OP_T, OP_N, m, n, k, self._one_ptr, w, ab, k,
            x, ab, k, self._one_ptr if accumulate else self._zero_ptr, out, CUDA_R_32F, m,
            compute, GEMM_DEFAULT,
        )  # fmt: skip

    def _lt_call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.lt, name)(*args)
        except Exception as e:  # nvmath raises cuBLASLtError on failure
            code = int(getattr(e, "status", -1) or -1)
            raise GpuCallError(f"cublasLt.{name}", code, type(e).__name__, str(e)) from e

    def _attribute(self, kind: str, obj: int, attr: Any, value: int) -> None:
        """``matmul_<kind>_set_attribute`` with ``value`` in the attribute's own type."""
        dtype = getattr(self.lt, f"get_matmul_{kind}_attribute_dtype")(attr)
        buf = np.array([value], dtype=dtype)
        self._lt_call(f"matmul_{kind}_set_attribute", obj, attr, buf.ctypes.data, buf.nbytes)

    def _plan(self, key: tuple[int, int, int, str, int]) -> Plan | None:
        """The plan of ``key`` (made now and cached), or None: that shape on cublasGemmEx
        (no algorithm found, or cuBLASLt failed; ``lt_reason`` says which)."""
        lt, (n, m, k, inputs, align) = self.lt, key
        if len(self._plans) >= MAX_PLANS:
            self._drop_plans()
        plan: Plan | None = None
        made: list[tuple[str, int]] = []  # what to destroy if the plan is not kept
        try:
            self.handle()  # the workspace
            if not self._lt_handle:
                try:
                    self._lt_handle = int(self._lt_call("create"))
                except GpuCallError:
                    self.lt = None  # no libcublasLt: cublasGemmEx from now on
                    raise
            ab = CUDA_R_32F if inputs == "f32" else CUDA_R_16F
            compute = COMPUTE_32F_FAST_TF32 if inputs == "f32" else COMPUTE_32F
            desc = int(self._lt_call("matmul_desc_create", compute, CUDA_R_32F))
            made.append(("matmul_desc_destroy", desc))
            self._attribute("desc", desc, lt.MatmulDescAttribute.TRANSA, OP_T)
            self._attribute("desc", desc, lt.MatmulDescAttribute.TRANSB, OP_N)
            # column-major: A = W as k x m (op T: m x k), B = X as k x n, C = D = out, m x n
            layouts = []
            for dtype, rows, cols in ((ab, k, m), (ab, k, n), (CUDA_R_32F, m, n)):
                layout = int(self._lt_call("matrix_layout_create", dtype, rows, cols, rows))
                made.append(("matrix_layout_destroy", layout))
                layouts.append(layout)
            pref = int(self._lt_call("matmul_preference_create"))
            try:
                attrs = lt.MatmulPreferenceAttribute
                self._attribute("preference", pref, attrs.MAX_WORKSPACE_BYTES, WORKSPACE_BYTES)
                for side in "ABCD":
                    self._attribute(
                        "preference", pref, getattr(attrs, f"MIN_ALIGNMENT_{side}_BYTES"), align
                    )
                result = np.zeros(HEURISTIC_BYTES, np.uint8)
                count = np.zeros(1, np.int32)
                a, b, c = layouts
                self._lt_call(
                    "matmul_algo_get_heuristic", self._lt_handle, desc, a, b, c, c, pref, 1,
                    result.ctypes.data, count.ctypes.data,
                )  # fmt: skip
            finally:
                self._lt_call("matmul_preference_destroy", pref)
            if int(count[0]) < 1:
                self.lt_reason = f"no cuBLASLt algorithm for {key}"
            else:
                plan = Plan(desc, a, b, c, result)
                made.clear()
        except Exception as e:  # a failed call, or bindings without an attribute used here
            self.lt_reason = f"cuBLASLt plan for {key} not made: {e}"
        finally:
            for name, handle in reversed(made):
                if self.lt is not None:
                    self._lt_call(name, handle)
        self._plans[key] = plan
        return plan

    def _drop_plans(self) -> None:
        """Destroy every plan (their descriptors live on the host: a captured graph holds
        none of them)."""
        plans, self._plans = self._plans, {}
        for plan in plans.values():
            if plan is not None:
                self._destroy(plan)

    def _destroy(self, plan: Plan) -> None:
        for layout in (plan.a, plan.b, plan.c):
            self._lt_call("matrix_layout_destroy", layout)
        self._lt_call("matmul_desc_destroy", plan.desc)

    def close(self) -> None:
        if self.lt is not None:
            self._drop_plans()
            if self._lt_handle:
                handle, self._lt_handle = self._lt_handle, 0
                self._lt_call("destroy", handle)
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._call("destroy", handle)
            self._rt.free(self._workspace)
            self._workspace = 0
