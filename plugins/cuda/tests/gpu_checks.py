"""Checks that need a real NVIDIA GPU: run them explicitly on one.

    python -m pytest plugins/cuda/tests/gpu_checks.py

(The file name is outside pytest's ``test_*.py`` pattern, so the default suite, which runs
where there is no GPU, never collects it.) Beyond the conformance kit (``--vt-backend
cuda``): the tiled matmul path, contexts longer than one attention chunk, sampling over
real vocabulary sizes, the runner on cuda against cpu on every readback path and with a VMM
KV cache, decode, prefill and mixed steps replayed as CUDA graphs against eager ones, and
the device's capability facts, and greedy ids equal to cpu's on tiny models of every weight
type with graphs and async readback each on and off.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import vt
from vt import reference as R
from vt.execution.runner import ModelRunner, SeqChunk
from vt.management import rules
from vt.management.registry import Registry
from vt.model import load_gguf
from vt.testing.kernels_suite import sample_params, weight_tensor
from vt.testing.tiny import write_tiny_gguf
from vt.testing.tolerances import kernel_tolerance, nmse
from vt_cuda.backend import CudaBackend

OUT = Path(os.environ.get("VT_GPU_CHECKS_OUT", "")) if os.environ.get("VT_GPU_CHECKS_OUT") else None
#: NMSE between a one-row gemv on 16-bit codes of x (GpuBackend.gemv_x16_min_rows) and the
#: float32 warp kernels: each value rounded to at least 15 bits of its 16's largest.
_X16_NMSE = 1e-8


def make(name: str) -> vt.Backend:
    backend, _ = Registry(env={}).create_backend(name)
    return backend


@pytest.fixture(scope="module")
def cuda() -> Any:
    backend = make("cuda")
    yield backend
    backend.close()


def f32(buf: vt.Buffer, *shape: int) -> vt.Tensor:
    return vt.Tensor.of(buf, np.float32, *shape)


def i32(buf: vt.Buffer, *shape: int) -> vt.Tensor:
    return vt.Tensor.of(buf, np.int32, *shape)


class IO:
    """Buffers for one check, freed at the end."""

    def __init__(self, be: vt.Backend) -> None:
        self.be, self.bufs = be, []

    def put(self, array: np.ndarray) -> vt.Buffer:
        buf = self.be.alloc(max(array.nbytes, 4))
        self.be.copy_h2d(buf, np.ascontiguousarray(array))
        self.bufs.append(buf)
        return buf

    def empty(self, nbytes: int) -> vt.Buffer:
        buf = self.be.alloc(nbytes)
        self.be.memset(buf, 0xFF)
        self.bufs.append(buf)
        return buf

    def get(self, buf: vt.Buffer, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self.be.copy_d2h(out, buf)
        return out

    def close(self) -> None:
        for b in self.bufs:
            self.be.free(b)


@contextlib.contextmanager
def recording(cuda: Any, names: list[str]) -> Iterator[None]:
    """The kernels ``cuda`` launches inside the block, by name, appended to ``names``."""
    kernel = cuda._kernel
    cuda._kernel = lambda name, *a, **kw: (names.append(name), kernel(name, *a, **kw))
    try:
        yield
    finally:
        del cuda._kernel


def test_capabilities_are_the_discrete_device_facts(cuda: Any) -> None:
    caps, profile = cuda.capabilities, cuda.profile
    if OUT is not None:
        (OUT / "profile.json").write_text(json.dumps(profile.model_dump(), indent=1))
    assert not profile.integrated  # this check is for discrete data-centre parts
    assert not caps.unified_memory and not caps.device_memory_is_host_addressable
    assert caps.supports_async_sampled_token_readback and caps.async_d2h_copy
    assert caps.vmm is not None and not caps.vmm.segments_may_alias
    assert caps.vmm.granularity == profile.vmm_granularity > 0
    assert caps.graphs
    assert rules.check(CudaBackend, caps) == []
    with pytest.raises(vt.HostAccessError):
        cuda.host_view(cuda.alloc(16))


def test_the_device_run_has_cublas(cuda: Any) -> None:
    """The device run carries nvmath-python, so the BLAS path below is really taken."""
    assert "TF32" in (cuda.runtime.blas() or "")


@pytest.mark.parametrize("inputs", ["f32", "f16"])
@pytest.mark.parametrize(
    ("n", "m", "k", "shift"),
    [(64, 131, 96, 0), (300, 131, 67, 0), (512, 576, 576, 0), (70, 131, 96, 4), (128, 40, 64, 16)],
)
def test_cublaslt_plans_equal_gemm_ex(
    cuda: Any, inputs: str, n: int, m: int, k: int, shift: int
) -> None:
    """``runtime.gemm`` through a cuBLASLt plan and through cublasGemmEx
    (``Cublas.use_lt = False``): both within TF32 (half inputs: float32 sums) rounding of
    numpy's float64, overwriting and accumulating, with pointers 256-byte aligned or
    shifted off it (a plan of their own)."""
    from vt_cuda.blas import Cublas

    rt = cuda.runtime
    rng = np.random.default_rng(n + k)
    dtype = np.float32 if inputs == "f32" else np.float16
    x = rng.standard_normal((n, k)).astype(dtype)
    w = rng.standard_normal((m, k)).astype(dtype)
    base = rng.standard_normal((n, m)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    io = IO(cuda)
    bufs = [io.empty(a.nbytes + shift) for a in (x, w, base)]
    ptrs = [int(b.handle) + shift for b in bufs]
    for buf, a in zip(bufs, (x, w, base), strict=True):
        cuda.copy_h2d(buf.view(shift, a.nbytes), np.ascontiguousarray(a).view(np.uint8))
    stream = cuda.create_stream()
    got = {}
    try:
        for lt in (True, False):
            Cublas.use_lt = lt
            for accumulate in (False, True):
                cuda.copy_h2d(bufs[2].view(shift, base.nbytes), base.view(np.uint8))
                rt.gemm(stream.handle, n, m, k, ptrs[0], ptrs[1], ptrs[2], accumulate, inputs)
                cuda.synchronize(stream)
                out = np.empty((n, m), np.float32)
                cuda.copy_d2h(out, bufs[2].view(shift, base.nbytes))
                ref = want + base if accumulate else want
                tol = 1e-5 if inputs == "f32" else 1e-7
                assert nmse(out, ref) <= tol, (lt, accumulate)
                got[lt, accumulate] = out
    finally:
        Cublas.use_lt = True
    for accumulate in (False, True):
        assert nmse(got[True, accumulate], got[False, accumulate]) <= 1e-5
    blas = rt._cublas()
    plans = {key: plan for key, plan in blas._plans.items() if key[:4] == (n, m, k, inputs)}
    assert plans, "no cuBLASLt plan was looked for"
    if shift == 0 and inputs == "f32" and k % 4 == 0:
        assert any(plan is not None for plan in plans.values()), blas.lt_reason


def test_kept_blas_copies_look_at_free_memory(cuda: Any) -> None:
    """cuMemGetInfo answers on the device; with a margin larger than the device no copy is
    kept (the matmul runs on its scratch copy, right all the same), and freeing the
    weight lets copies be kept again."""
    free, total = cuda.runtime.memory_info()
    assert 0 < free <= total == cuda.profile.total_memory
    rng = np.random.default_rng(5)
    tensor, ref = weight_tensor("w", rng.standard_normal((131, 96)).astype(np.float32), "Q8_0")
    x = rng.standard_normal((70, 96)).astype(np.float32)
    io = IO(cuda)
    saved = cuda.blas_min_rows, cuda.blas_keep_min_free_bytes
    cuda.blas_min_rows, cuda.blas_keep_min_free_bytes = 64, total
    w = cuda.upload_weight(tensor)
    try:
        out = io.empty(70 * 131 * 4)
        stream = cuda.create_stream()
        for _ in range(2):
            cuda.launch("matmul", stream, out=f32(out, 70, 131), x=f32(io.put(x), 70, 96),
                        weight=w)  # fmt: skip
            cuda.synchronize(stream)
            got = io.get(out, np.float32, (70, 131))
            assert nmse(got, R.matmul(x, ref, None)) <= kernel_tolerance("matmul", "Q8_0")
        assert not any(key[0] == w.handle.data for key in cuda._kept)
        assert cuda._keep_full
    finally:
        cuda.free_weight(w)
        cuda.blas_min_rows, cuda.blas_keep_min_free_bytes = saved
        io.close()
    assert not cuda._keep_full


@pytest.fixture(params=["own", "blas", "blas-f16"])
def path(request: pytest.FixtureRequest, cuda: Any) -> Any:
    """The backend's own tiled kernel, or cuBLAS from blas_min_rows rows (TF32, or half
    inputs: blas_inputs="f16")."""
    saved = cuda.blas_min_rows, cuda.blas_inputs
    cuda.blas_min_rows = 1 << 30 if request.param == "own" else 64
    cuda.blas_inputs = "f16" if request.param == "blas-f16" else "tf32"
    yield request.param
    cuda.blas_min_rows, cuda.blas_inputs = saved


@pytest.mark.parametrize("wtype", ["F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("n", [16, 70, 300])
def test_tiled_matmul_path(cuda: Any, wtype: str, n: int, path: str) -> None:
    in_f = 512 if wtype.endswith("_K") else 96 if wtype.startswith("Q") else 67
    rng = np.random.default_rng(n)
    tensor, ref = weight_tensor("w", rng.standard_normal((131, in_f)).astype(np.float32), wtype)
    x = rng.standard_normal((n, in_f)).astype(np.float32)
    b_tensor, b_ref = weight_tensor("b", rng.standard_normal(131).astype(np.float32), "F32")
    io = IO(cuda)
    w, b = cuda.upload_weight(tensor), cuda.upload_weight(b_tensor)
    try:
        out = io.empty(n * 131 * 4)
        stream = cuda.create_stream()
        cuda.launch("matmul", stream, out=f32(out, n, 131), x=f32(io.put(x), n, in_f), weight=w,
                    bias=b)  # fmt: skip
        cuda.synchronize(stream)
        got = io.get(out, np.float32, (n, 131))
        assert nmse(got, R.matmul(x, ref, b_ref)) <= kernel_tolerance("matmul", wtype)
    finally:
        cuda.free_weight(w)
        cuda.free_weight(b)
        io.close()


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_blas_copies_are_bit_exact(cuda: Any, wtype: str) -> None:
    """dequantize16_q equals the one-value kernels' values (``PackedWeight.values``: the
    reference's dequantization, bit for bit but for the sign of some zeros), dequantize16_h_q
    those rounded to half (numpy's nearest even), to_half8 numpy's float16 cast (overflow to
    inf, subnormals), over more values than the grid covers in one pass."""
    from vt.gpu.backend import I64, P, _blocks
    from vt.gpu.weights import pack

    cols = 512 if wtype.endswith("_K") else 96
    rows = 4099  # 4099 x 96 / 16 = 24,594 threads: a grid-stride loop of 3 passes below
    rng = np.random.default_rng(7)
    tensor, ref = weight_tensor("w", rng.standard_normal((rows, cols)).astype(np.float32), wtype)
    x = (rng.standard_normal(8 * 5000) * 3000).astype(np.float32)
    x[:6] = [70000.0, -65520.0, 65519.0, 6e-8, -3e-8, 1e-30]
    io = IO(cuda)
    w = cuda.upload_weight(tensor)
    try:
        gw = w.handle
        total = rows * cols
        out, outh, xh = io.empty(total * 4), io.empty(total * 2), io.empty(x.size * 2)
        stream = cuda.create_stream()
        args = (P(gw.data), P(gw.scales), ctypes.c_int32(gw.qarg), I64(total))
        cuda._kernel("dequantize16_q", (32, 1, 1), 256, stream, P(out.handle), *args)
        cuda._kernel("dequantize16_h_q", (32, 1, 1), 256, stream, P(outh.handle), *args)
        cuda._kernel("to_half8", (_blocks(x.size // 8), 1, 1), 256, stream, P(xh.handle),
                     P(io.put(x).handle), I64(x.size))  # fmt: skip
        cuda.synchronize(stream)
        got = io.get(out, np.float32, (rows, cols))
        values = pack(tensor).values()  # vt_wload's values: the reference's, and zeros' signs
        assert np.array_equal(got, ref) and np.array_equal(
            got.view(np.uint32), values.view(np.uint32)
        )
        want_h = values.astype(np.float16).view(np.uint16)
        assert np.array_equal(io.get(outh, np.uint16, (rows, cols)), want_h)
        with np.errstate(over="ignore"):
            want_x = x.astype(np.float16).view(np.uint16)
        assert np.array_equal(io.get(xh, np.uint16, x.shape), want_x)
    finally:
        cuda.free_weight(w)
        io.close()


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("n", [8, 17, 32, 63, 64])
@pytest.mark.parametrize("mma", [True, False])
def test_int8_activation_decode_kernels(cuda: Any, wtype: str, n: int, mma: bool) -> None:
    """Int8 activations (GpuBackend.int8_min_rows, int8_min_values; lowered here to take
    these small weights), on the tensor cores (int8_mma) or dp4a: matmul (with the
    residual), swiglu and qkv of decode batches, within the kit's bounds. Features 80, 80
    and 72: whole tiles of 16 and a partial one (qkv's v, the third matmul). 64 rows: the
    mma kernels' 8 full tiles (int8_mma_first; dp4a leaves them to the BLAS path)."""
    k_in = 512 if wtype.endswith("_K") else 96
    rows = (80, 80, 72)
    rng = np.random.default_rng(n)
    mats = [weight_tensor(f"w{i}", rng.standard_normal((r, k_in)).astype(np.float32), wtype)
            for i, r in enumerate(rows)]  # fmt: skip
    x = rng.standard_normal((n, k_in)).astype(np.float32)
    saved = cuda.int8_min_rows, cuda.int8_min_values, cuda.int8_mma, cuda.int8_mma_first
    cuda.int8_min_rows, cuda.int8_min_values, cuda.int8_mma_first = 8, 0, True
    cuda.int8_mma = mma  # forced on, the kernels' shuffle branch runs where sm_80 is missing
    io = IO(cuda)
    ws = [cuda.upload_weight(t) for t, _ in mats]
    refs = [ref for _, ref in mats]
    try:
        stream = cuda.create_stream()
        xb = f32(io.put(x), n, k_in)
        out = [f32(io.empty(n * r * 4), n, r) for r in rows]
        scratch = [f32(io.empty(n * 80 * 4), n, 80) for _ in range(2)]
        for i in (0, 2):
            res = rng.standard_normal((n, rows[i])).astype(np.float32)
            cuda.launch("matmul_add", stream, out=out[i], x=xb, weight=ws[i],
                        residual=f32(io.put(res), n, rows[i]),
                        scratch=f32(scratch[0].buffer, n, rows[i]))  # fmt: skip
            cuda.synchronize(stream)
            got = io.get(out[i].buffer, np.float32, (n, rows[i]))
            want = R.matmul(x, refs[i]) + res
            assert nmse(got, want) <= kernel_tolerance("matmul_add", wtype), i
        cuda.launch("swiglu", stream, out=out[1], x=xb, gate=ws[0], up=ws[1],
                    scratch_gate=scratch[0], scratch_up=scratch[1])  # fmt: skip
        cuda.synchronize(stream)
        want = R.silu_mul(R.matmul(x, refs[0]), R.matmul(x, refs[1]))
        got = io.get(out[1].buffer, np.float32, (n, 80))
        assert nmse(got, want) <= kernel_tolerance("swiglu", wtype)
        cuda.launch("qkv", stream, q=out[0], k=out[1], v=out[2], x=xb, wq=ws[0], wk=ws[1],
                    wv=ws[2])  # fmt: skip
        cuda.synchronize(stream)
        for o, ref, r in zip(out, refs, rows, strict=True):
            got = io.get(o.buffer, np.float32, (n, r))
            assert nmse(got, R.matmul(x, ref)) <= kernel_tolerance("qkv", wtype)
    finally:
        cuda.int8_min_rows, cuda.int8_min_values, cuda.int8_mma, cuda.int8_mma_first = saved
        for w in ws:
            cuda.free_weight(w)
        io.close()


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("n", [8, 33])
def test_mma_split_k_within_the_kits_bound(cuda: Any, wtype: str, n: int) -> None:
    """mma_split_blocks: matmul_add, swiglu and qkv at int8 mma rows with K = 1,024 split
    over 4 slices (a block of 16 features a slice, the last of its blocks adding their sums
    and running the epilogue) agree with the unsplit launches to float32 rounding, stay
    within the kit's bound of the reference, give the same bits run twice, and leave
    their counters zero for the next launch (a replayed graph's)."""
    k_in, rows = 1024, (48, 48, 32)
    rng = np.random.default_rng(n + len(wtype))
    mats = [weight_tensor(f"w{i}", rng.standard_normal((r, k_in)).astype(np.float32), wtype)
            for i, r in enumerate(rows)]  # fmt: skip
    x = rng.standard_normal((n, k_in)).astype(np.float32)
    res = rng.standard_normal((n, rows[0])).astype(np.float32)
    saved = (cuda.int8_min_rows, cuda.int8_min_values, cuda.int8_mma, cuda.mma_split_blocks,
             cuda.mma_split_min_k)  # fmt: skip
    cuda.int8_min_rows, cuda.int8_min_values, cuda.int8_mma = 8, 0, True
    io = IO(cuda)
    ws = [cuda.upload_weight(t) for t, _ in mats]
    refs = [ref for _, ref in mats]
    got: dict[int, list[np.ndarray]] = {}
    try:
        stream = cuda.create_stream()
        xb = f32(io.put(x), n, k_in)
        for blocks in (0, 3 * 4 * 4, 3 * 4 * 4):  # unsplit; 4 slices of 256 values, twice
            cuda.mma_split_blocks, cuda.mma_split_min_k = blocks, 256
            out = [f32(io.empty(4 * n * r), n, r) for r in rows]
            names: list[str] = []
            with recording(cuda, names):
                cuda.launch("matmul_add", stream, out=out[0], x=xb, weight=ws[0],
                            residual=f32(io.put(res), n, rows[0]),
                            scratch=f32(io.empty(4 * n * rows[0]), n, rows[0]))  # fmt: skip
                cuda.launch("swiglu", stream, out=out[1], x=xb, gate=ws[0], up=ws[1],
                            scratch_gate=f32(io.empty(4 * n * 48), n, 48),
                            scratch_up=f32(io.empty(4 * n * 48), n, 48))  # fmt: skip
                qkv = [f32(io.empty(4 * n * r), n, r) for r in rows]
                cuda.launch("qkv", stream, q=qkv[0], k=qkv[1], v=qkv[2], x=xb, wq=ws[0],
                            wk=ws[1], wv=ws[2])  # fmt: skip
            cuda.synchronize(stream)
            assert sum("_mma" in name for name in names) == 3, names
            values = [io.get(out[0].buffer, np.float32, (n, rows[0])),
                      io.get(out[1].buffer, np.float32, (n, 48)),
                      *(io.get(t.buffer, np.float32, (n, r))
                        for t, r in zip(qkv, rows, strict=True))]  # fmt: skip
            if blocks and blocks in got:
                for a, b in zip(values, got[blocks], strict=True):
                    np.testing.assert_array_equal(a, b)  # the same bits, run again
            got[blocks] = values
        counts = [buf for slot, buf in cuda._scratch if slot == "mma split counts"]
        assert counts and not io.get(counts[-1], np.int32, (counts[-1].nbytes // 4,)).any()
        want = [R.matmul(x, refs[0]) + res,
                R.silu_mul(R.matmul(x, refs[0]), R.matmul(x, refs[1])),
                *(R.matmul(x, ref) for ref in refs)]  # fmt: skip
        ops = ["matmul_add", "swiglu", "qkv", "qkv", "qkv"]
        for i, (split, whole) in enumerate(zip(got[48], got[0], strict=True)):
            assert nmse(split, whole) <= 1e-10, i  # float32 sums in another order
            assert nmse(split, want[i]) <= kernel_tolerance(ops[i], wtype), i
    finally:
        (cuda.int8_min_rows, cuda.int8_min_values, cuda.int8_mma, cuda.mma_split_blocks,
         cuda.mma_split_min_k) = saved  # fmt: skip
        for w in ws:
            cuda.free_weight(w)
        io.close()


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("then", ["swiglu", "qkv"])
@pytest.mark.parametrize("n", [8, 33])
def test_norm_quantize_at_int8_rows(cuda: Any, wtype: str, then: str, n: int) -> None:
    """norm_quantize: rms_norm_swiglu and rms_norm_qkv_rope_kv_store at int8 mma rows with
    x normalised and packed in one launch (quantize_norm_rows) leave the bits of rms_norm,
    quantize_rows and the mma kernel (act; q, k, v and the cache), within the kit's bound
    of the reference; so does a row packed over 8 blocks (norm_quantize_values 64), and
    qkv's RoPE and KV store in the mma launch (mma_rope, the default) or apart
    (rope_kv_store). K = 512 (two of rms_norm's values a thread), rows of x scaled apart."""
    k_in = 512
    rng = np.random.default_rng(n + len(then))

    def mk(name: str, rows: int) -> tuple[vt.WeightTensor, np.ndarray]:
        return weight_tensor(name, rng.standard_normal((rows, k_in)).astype(np.float32), wtype)

    op = f"rms_norm_{'swiglu' if then == 'swiglu' else 'qkv_rope_kv_store'}"
    norm_t, norm_ref = weight_tensor(
        "n", (1 + 0.1 * rng.standard_normal(k_in)).astype(np.float32), "F32"
    )
    x = (rng.standard_normal((n, k_in)) * rng.uniform(0.1, 30, (n, 1))).astype(np.float32)
    layout = vt.KVLayout(n_layers=2, n_slots=n, max_len=8, n_kv_heads=2, head_dim=64)
    if then == "swiglu":
        mats = {"gate": mk("g", 96), "up": mk("u", 96)}
        outs = {"out": (n, 96)}
    else:
        mats = {"wq": mk("q", 256), "wk": mk("k", 128), "wv": mk("v", 128)}
        outs = {"q": (n, 256), "k": (n, 128), "v": (n, 128)}
    cache0 = rng.standard_normal(layout.shape).astype(np.float32)
    positions = rng.integers(0, 8, n).astype(np.int32)
    saved = (cuda.int8_min_rows, cuda.int8_min_values, cuda.int8_mma, cuda.norm_quantize,
             cuda.norm_quantize_values, cuda.mma_rope)  # fmt: skip
    cuda.int8_min_rows, cuda.int8_min_values, cuda.int8_mma = 8, 0, True
    io = IO(cuda)
    ws = {k: cuda.upload_weight(t) for k, (t, _) in mats.items()}
    nw = cuda.upload_weight(norm_t)
    # (norm_quantize, norm_quantize_values, mma_rope): off; a row a block; 64 values a
    # block; RoPE and the KV store in their own launch
    settings = {"off": (False, 0, True), "row": (True, 0, True), "64": (True, 64, True),
                "rope apart": (True, 0, False)}  # fmt: skip
    launched: dict[str, list[str]] = {key: [] for key in settings}
    got: dict[str, dict[str, np.ndarray]] = {}
    try:
        stream = cuda.create_stream()
        for on, setting in settings.items():
            cuda.norm_quantize, cuda.norm_quantize_values, cuda.mma_rope = setting
            args: dict[str, Any] = {k: f32(io.empty(4 * s[0] * s[1]), *s) for k, s in outs.items()}
            if then == "swiglu":
                args |= {
                    k: f32(io.empty(4 * n * 96), n, 96) for k in ("scratch_gate", "scratch_up")
                }
            else:
                args |= {"cache": vt.Tensor(io.put(cache0), np.float32, layout.shape),
                         "positions": i32(io.put(positions), n),
                         "slots": i32(io.put(np.arange(n, dtype=np.int32)), n),
                         "layout": layout, "layer": 1, "n_heads": 4,
                         "params": vt.RopeParams(64)}  # fmt: skip
            with recording(cuda, launched[on]):
                cuda.launch(op, stream, x=f32(io.put(x), n, k_in), norm=nw, eps=1e-5,
                            scratch=f32(io.empty(4 * n * k_in), n, k_in), **ws, **args)  # fmt: skip
            cuda.synchronize(stream)
            got[on] = {k: io.get(args[k].buffer, np.float32, s) for k, s in outs.items()}
            if then != "swiglu":
                got[on]["cache"] = io.get(args["cache"].buffer, np.float32, layout.shape)
        assert launched["off"][:2] == ["rms_norm", "quantize_rows"]
        assert launched["row"] == launched["64"]
        assert launched["row"][0] == launched["rope apart"][0] == "quantize_norm_rows"
        assert launched["rope apart"][1:] == launched["off"][2:]
        mma = launched["off"][2]
        if then == "qkv":
            assert launched["off"][3:] == ["rope_kv_store"]
            assert launched["row"][1:] == [mma.replace("qkv_", "qkv_rope_")]
        else:
            assert launched["row"][1:] == [mma]
        for on in ("row", "64", "rope apart"):
            for name, value in got[on].items():
                np.testing.assert_array_equal(value, got["off"][name], err_msg=f"{name} {on}")
        want = {k: np.zeros(s, np.float32) for k, s in outs.items()}
        refs: dict[str, Any] = {k: ref for k, (_, ref) in mats.items()}
        if then != "swiglu":
            want["cache"] = cache0.copy()
            refs |= {"positions": positions, "slots": np.arange(n, dtype=np.int32),
                     "layout": layout, "layer": 1, "n_heads": 4,
                     "params": vt.RopeParams(64)}  # fmt: skip
        vt.OPS[op].reference({**want, "x": x, "norm": norm_ref, "eps": 1e-5, **refs})
        bound = kernel_tolerance(op, wtype)
        for name, value in got["row"].items():
            assert nmse(value, want[name]) <= bound, name
    finally:
        (cuda.int8_min_rows, cuda.int8_min_values, cuda.int8_mma, cuda.norm_quantize,
         cuda.norm_quantize_values, cuda.mma_rope) = saved  # fmt: skip
        for weight in (*ws.values(), nw):
            cuda.free_weight(weight)
        io.close()


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k_in", [96, 4608])
@pytest.mark.parametrize("gv", [1, 2, 4])
def test_gemv_one_row(cuda: Any, wtype: str, k_in: int, gv: int) -> None:
    """One row on the gemv kernels (GpuBackend.gemv_features = gv; a block of 64 threads for
    K = 96, 128 for K = 4608: several passes): matmul with bias, with the residual, swiglu
    and qkv within the kit's bounds, and close to the warp kernels (gemv_features 0): the
    same float32 numerics, summed in another order. Features 37, 37, 13: partial blocks.
    gv 4 also on the wide gemv (gemv_wide_min_rows 1: every op's weights count as an output
    projection's, 4 features a block of gemv_wide_threads = 64, so K = 4608 is several
    passes), gv 2 with swiglu on 128 threads and on 64 (gemv_swiglu_threads, 64 by
    default)."""
    if wtype.endswith("_K") and k_in % 256:
        k_in = 512
    rows = (37, 37, 13)
    rng = np.random.default_rng(k_in + gv)
    mats = [weight_tensor(f"w{i}", rng.standard_normal((r, k_in)).astype(np.float32), wtype)
            for i, r in enumerate(rows)]  # fmt: skip
    b_tensor, b_ref = weight_tensor("b", rng.standard_normal(37).astype(np.float32), "F32")
    x = rng.standard_normal((1, k_in)).astype(np.float32)
    res = rng.standard_normal((1, 37)).astype(np.float32)
    saved = cuda.gemv_features, cuda.gemv_wide_min_rows, cuda.gemv_swiglu_threads
    configs = {"gemv": (gv, 0, 128), "warp": (0, 0, 128)}
    if gv == 4:
        configs["wide"] = (gv, 1, 128)
    if gv == 2:
        configs["swiglu64"] = (gv, 0, 64)
    io = IO(cuda)
    ws = [cuda.upload_weight(t) for t, _ in mats]
    bias = cuda.upload_weight(b_tensor)
    refs = [ref for _, ref in mats]
    try:
        stream = cuda.create_stream()
        xb = f32(io.put(x), 1, k_in)
        got: dict[str, list[np.ndarray]] = {}
        block_rows: dict[str, dict[str, int]] = {}  # weight rows a gemv block, by op
        for name, (features, wide, sw) in configs.items():
            cuda.gemv_features, cuda.gemv_wide_min_rows = features, wide
            cuda.gemv_swiglu_threads = sw
            # as the backend picks a block's features (the wide gemv's, the long rows' at
            # K >= gemv_long_min_k: run 117 found a hand-kept copy of this rule blind to them)
            gws = [cuda._gpu_weight(w, "w") for w in ws]
            block_rows[name] = {
                "matmul": cuda._gemv(xb, gws[0])[0], "matmul_add": cuda._gemv(xb, gws[1])[0],
                "swiglu": 2 * cuda._gemv(xb, gws[0], gws[1], **cuda._swiglu_gemv)[0],
                "qkv": cuda._gemv(xb, *gws)[0],
            }  # fmt: skip
            outs = [f32(io.empty(4 * r), 1, r) for r in (37, 37, 37, 37, 37, 13)]
            scratch = [f32(io.empty(4 * 37), 1, 37) for _ in range(2)]
            cuda.launch("matmul", stream, out=outs[0], x=xb, weight=ws[0], bias=bias)
            cuda.launch("matmul_add", stream, out=outs[1], x=xb, weight=ws[1],
                        residual=f32(io.put(res), 1, 37), scratch=scratch[0])  # fmt: skip
            cuda.launch("swiglu", stream, out=outs[2], x=xb, gate=ws[0], up=ws[1],
                        scratch_gate=scratch[0], scratch_up=scratch[1])  # fmt: skip
            cuda.launch("qkv", stream, q=outs[3], k=outs[4], v=outs[5], x=xb, wq=ws[0],
                        wk=ws[1], wv=ws[2])  # fmt: skip
            cuda.synchronize(stream)
            got[name] = [io.get(o.buffer, np.float32, (1, o.shape[1])) for o in outs]
        want = [
            R.matmul(x, refs[0], b_ref), R.matmul(x, refs[1]) + res,
            R.silu_mul(R.matmul(x, refs[0]), R.matmul(x, refs[1])), R.matmul(x, refs[0]),
            R.matmul(x, refs[1]), R.matmul(x, refs[2]),
        ]  # fmt: skip
        ops = ("matmul", "matmul_add", "swiglu", "qkv", "qkv", "qkv")
        for name in configs.keys() - {"warp"}:
            for i, (op, w) in enumerate(zip(ops, want, strict=True)):
                assert nmse(got[name][i], w) <= kernel_tolerance(op, wtype), (name, op, i)
                # float32 sums in another order; x in 16-bit codes where a block's rows
                # take them (gemv_x16_min_rows, in the modules gemv_x16_layout_flags
                # names): about 2^-30 a value's square
                x16 = 0 < cuda.gemv_x16_rows(*gws) <= block_rows[name][op]
                bound = _X16_NMSE if x16 else 1e-10
                assert nmse(got[name][i], got["warp"][i]) <= bound, (name, op, i)
    finally:
        cuda.gemv_features, cuda.gemv_wide_min_rows, cuda.gemv_swiglu_threads = saved
        for w in ws:
            cuda.free_weight(w)
        cuda.free_weight(bias)
        io.close()


@pytest.fixture(scope="module")
def cuda_unstaged() -> Any:
    """A cuda backend whose int8 mma kernels load their weight codes and scales straight
    into registers (GpuBackend.mma_stage off, set before its kernels compile)."""
    backend = make("cuda")
    backend.mma_stage = False
    yield backend
    backend.close()


def _int8_mma_outputs(
    be: Any, wtype: str, n: int, k_in: int, split: int, wave: bool = False
) -> list[np.ndarray]:
    """matmul_add, swiglu and q, k, v of ``n`` rows at int8 mma rows on ``be`` (K split over
    ``split`` slices where above 1): whole 16-feature tiles and a partial one (72 rows);
    ``wave``: swiglu at one tile on its 4-an-SM form (mma_sw1_wave_blocks 1), else never."""
    rows = (80, 80, 72)
    rng = np.random.default_rng(n * 7 + k_in + len(wtype))
    mats = [weight_tensor(f"w{i}", rng.standard_normal((r, k_in)).astype(np.float32), wtype)
            for i, r in enumerate(rows)]  # fmt: skip
    x = rng.standard_normal((n, k_in)).astype(np.float32)
    res = rng.standard_normal((n, rows[0])).astype(np.float32)
    saved = (be.int8_min_rows, be.int8_min_values, be.int8_mma, be.int8_mma_first,
             be.mma_split_blocks, be.mma_split_min_k, be.mma_sw1_wave_blocks)  # fmt: skip
    be.int8_min_rows, be.int8_min_values, be.int8_mma, be.int8_mma_first = 8, 0, True, True
    be.mma_sw1_wave_blocks = 1 if wave else 0
    be.mma_split_blocks = 3 * 5 * split if split > 1 else 0
    be.mma_split_min_k = k_in // split
    io = IO(be)
    ws = [be.upload_weight(t) for t, _ in mats]
    try:
        stream = be.create_stream()
        xb = f32(io.put(x), n, k_in)
        out = [f32(io.empty(4 * n * r), n, r) for r in rows]
        names: list[str] = []
        with recording(be, names):
            be.launch("matmul_add", stream, out=out[0], x=xb, weight=ws[0],
                      residual=f32(io.put(res), n, rows[0]),
                      scratch=f32(io.empty(4 * n * rows[0]), n, rows[0]))  # fmt: skip
            sw = f32(io.empty(4 * n * 80), n, 80)
            be.launch("swiglu", stream, out=sw, x=xb, gate=ws[0], up=ws[1],
                      scratch_gate=f32(io.empty(4 * n * 80), n, 80),
                      scratch_up=f32(io.empty(4 * n * 80), n, 80))  # fmt: skip
            be.launch("qkv", stream, q=out[0], k=out[1], v=out[2], x=xb, wq=ws[0], wk=ws[1],
                      wv=ws[2])  # fmt: skip
        be.synchronize(stream)
        assert sum("_mma" in name for name in names) == 3, names
        assert ("swiglu_mma1w_q8a" in names) == (wave and n <= 8), names
        return [
            io.get(sw.buffer, np.float32, (n, 80)),
            *(io.get(o.buffer, np.float32, (n, r)) for o, r in zip(out, rows, strict=True)),
        ]
    finally:
        (be.int8_min_rows, be.int8_min_values, be.int8_mma, be.int8_mma_first,
         be.mma_split_blocks, be.mma_split_min_k, be.mma_sw1_wave_blocks) = saved  # fmt: skip
        for w in ws:
            be.free_weight(w)
        io.close()


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("n", [8, 17, 33, 63])
def test_mma_stage_gives_the_same_bits(cuda: Any, cuda_unstaged: Any, wtype: str, n: int) -> None:
    """GpuBackend.mma_stage (on by default): the int8 mma kernels with their weight codes
    copied through shared memory and their scales handed round by shuffles give the bits
    of the loads straight to registers (off), for every tile count
    (1, 3, 5 and 8 tiles of 8 rows), unsplit and with K split (the copies clamped at a
    slice's end; K = 544 leaves a warp a short last round), on every layout family (int8
    codes, nibbles, blocks of 16)."""
    k_in = 1024 if wtype.endswith("_K") else 544
    for split in (1, 4):
        assert cuda.mma_stage and not cuda_unstaged.mma_stage
        whole = _int8_mma_outputs(cuda_unstaged, wtype, n, k_in, split)
        staged = _int8_mma_outputs(cuda, wtype, n, k_in, split)
        for i, (a, b) in enumerate(zip(staged, whole, strict=True)):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=str(i))


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0", "Q6_K"])
def test_swiglu_mma1_wave_form_gives_the_same_bits(cuda: Any, wtype: str) -> None:
    """GpuBackend.mma_sw1_wave_blocks: swiglu at 8 rows on swiglu_mma1w_q8a (the plain
    kernel's code held to 4 blocks an SM by its launch bounds) gives swiglu_mma1_q8a's
    bits, unsplit and with K split, in each layout of scales alone (the only ones that
    take it: int8 codes, nibbles, blocks of 16)."""
    k_in = 1024 if wtype.endswith("_K") else 544
    for split in (1, 4):
        plain = _int8_mma_outputs(cuda, wtype, 8, k_in, split)
        wave = _int8_mma_outputs(cuda, wtype, 8, k_in, split, wave=True)
        np.testing.assert_array_equal(wave[0].view(np.uint32), plain[0].view(np.uint32))


@pytest.fixture(scope="module")
def cuda_x16() -> Any:
    """A cuda backend whose one-row gemvs take x as 16-bit codes in every block of every
    layout (gemv_x16_min_rows 1, gemv_x16_layout_flags 0, set before its kernels compile)."""
    backend = make("cuda")
    backend.gemv_x16_min_rows, backend.gemv_x16_layout_flags = 1, 0
    yield backend
    backend.close()


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("gv", [1, 2, 4])
def test_gemv_x16_one_row(cuda_x16: Any, wtype: str, gv: int) -> None:
    """test_gemv_one_row with x in 16-bit codes (GpuBackend.gemv_x16_min_rows): within the
    kit's bounds and within _X16_NMSE of the float32 warp kernels, at one pass (K = 96)
    and several (K = 4608)."""
    for k_in in (96, 4608):
        test_gemv_one_row(cuda_x16, wtype, k_in, gv)


def test_gemv_x16_keeps_non_finite(cuda: Any, cuda_x16: Any) -> None:
    """A NaN or an infinity in x makes every output of a one-row matmul non-finite on 16-bit
    codes of x (NaN), as on the float32 path (inf * w, NaN * w); without one the outputs
    are finite and within _X16_NMSE of the float32 path's."""
    rng = np.random.default_rng(16)
    k_in, rows = 4608, 37
    t, _ = weight_tensor("w", rng.standard_normal((rows, k_in)).astype(np.float32), "Q8_0")
    x = rng.standard_normal((1, k_in)).astype(np.float32)
    got: dict[tuple[bool, str], np.ndarray] = {}
    for x16, backend in ((False, cuda), (True, cuda_x16)):
        saved = backend.gemv_features
        backend.gemv_features = 4
        io = IO(backend)
        w = backend.upload_weight(t)
        try:
            stream = backend.create_stream()
            for bad in ("none", "nan", "inf"):
                xv = x.copy()
                xv[0, 1234] = {"none": xv[0, 1234], "nan": np.nan, "inf": np.inf}[bad]
                out = f32(io.empty(4 * rows), 1, rows)
                backend.launch("matmul", stream, out=out, x=f32(io.put(xv), 1, k_in), weight=w)
                backend.synchronize(stream)
                got[x16, bad] = io.get(out.buffer, np.float32, (1, rows))
        finally:
            backend.gemv_features = saved
            backend.free_weight(w)
            io.close()
    for x16 in (False, True):
        assert np.isfinite(got[x16, "none"]).all(), x16
        for bad in ("nan", "inf"):
            assert not np.isfinite(got[x16, bad]).any(), (x16, bad)
    assert np.isnan(got[True, "inf"]).all()
    assert nmse(got[True, "none"], got[False, "none"]) <= _X16_NMSE


#: (label, rows of x, GpuBackend attributes): every kernel family that reads WT_Q weights.
LAYOUT_PATHS = [
    ("gemv", 1, {}),
    ("warp", 1, {"gemv_features": 0}),
    ("float32-x", 3, {"int8_min_rows": 1 << 30}),
    ("dp4a", 9, {"int8_min_rows": 2, "int8_min_values": 0, "int8_mma": False}),
    ("mma", 9, {"int8_min_rows": 2, "int8_min_values": 0, "int8_mma": True}),
    ("tiled", 70, {"blas_min_rows": 1 << 30}),
    ("blas", 70, {}),
]


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("k_in", [96, 2560, 8192])
def test_gemv_unrolled_gives_the_gemvs_bits(cuda: Any, wtype: str, k_in: int) -> None:
    """matmul_gemvu2_q (two passes' loads in flight a thread; gemv_unroll_min_k) adds each
    thread's passes in the same order as matmul_gemv2_q: the same bits, with the residual,
    for K of one pass (96), an odd number of passes (2560 = 5 of 128 threads: the last
    pair's second load past K) and four (8192, the 1B shape's down projection)."""
    if wtype.endswith("_K") and k_in % 256:
        k_in = 512
    rng = np.random.default_rng(k_in)
    w_t, ref = weight_tensor("w", rng.standard_normal((37, k_in)).astype(np.float32), wtype)
    x = rng.standard_normal((1, k_in)).astype(np.float32)
    res = rng.standard_normal((1, 37)).astype(np.float32)
    io = IO(cuda)
    w = cuda.upload_weight(w_t)
    saved = cuda.gemv_unroll_min_k
    try:
        stream = cuda.create_stream()
        got, names = {}, []
        for unroll in (16, 0):
            cuda.gemv_unroll_min_k = unroll
            out = f32(io.empty(4 * 37), 1, 37)
            with recording(cuda, names):
                cuda.launch("matmul_add", stream, out=out, x=f32(io.put(x), 1, k_in), weight=w,
                            residual=f32(io.put(res), 1, 37),
                            scratch=f32(io.empty(4 * 37), 1, 37))  # fmt: skip
            cuda.synchronize(stream)
            got[unroll] = io.get(out.buffer, np.float32, (1, 37))
        gv = cuda._gemv(f32(io.empty(4 * k_in), 1, k_in), cuda._gpu_weight(w, "matmul"))[0]
        assert names == [f"matmul_gemvu{gv}_q", f"matmul_gemv{gv}_q"]
        np.testing.assert_array_equal(got[16], got[0])
        want = R.matmul(x, ref) + res
        assert nmse(got[16], want) <= kernel_tolerance("matmul_add", wtype)
    finally:
        cuda.gemv_unroll_min_k = saved
        cuda.free_weight(w)
        io.close()


@pytest.fixture(scope="module")
def cuda_one_path() -> Any:
    """A cuda backend whose one-row gemvs take the same path in every layout's module
    (gemv_x16_layout_flags 0, set before its kernels compile): by default the 4-bit layouts
    take x as 16-bit codes and the wide layouts of the same weights the float32 path."""
    backend = make("cuda")
    backend.gemv_x16_layout_flags = 0
    yield backend
    backend.close()


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("case", LAYOUT_PATHS, ids=[c[0] for c in LAYOUT_PATHS])
def test_compact_layouts_give_the_wide_layouts_bits(
    cuda_one_path: Any, wtype: str, case: tuple
) -> None:
    """The same weights uploaded compact (nibbles, half scales: GpuBackend.compact_weights)
    and wide (int8 codes, float32 pairs): embedding, matmul with bias, swiglu and qkv give
    bit-equal outputs on every kernel path (``case``), on the kernels compiled for each
    layout and on those reading the layout at run time (layout_kernels off), since every
    layout yields the same values and, with the one-row path the same in every module, the
    kernels' arithmetic does not depend on it."""
    cuda = cuda_one_path
    label, n, attrs = case
    k_in = 512 if wtype.endswith("_K") else 96
    rows = (80, 80, 72)
    rng = np.random.default_rng(n + k_in)
    mats = [weight_tensor(f"w{i}", rng.standard_normal((r, k_in)).astype(np.float32), wtype)[0]
            for i, r in enumerate(rows)]  # fmt: skip
    b_tensor, _ = weight_tensor("b", rng.standard_normal(80).astype(np.float32), "F32")
    x = rng.standard_normal((n, k_in)).astype(np.float32)
    ids = rng.integers(0, 80, n).astype(np.int32)
    saved = {name: getattr(cuda, name) for name in (*attrs, "compact_weights", "layout_kernels")}
    io = IO(cuda)
    uploaded: dict[bool, list[vt.Weight]] = {}
    try:
        for compact in (True, False):
            cuda.compact_weights = compact
            uploaded[compact] = [cuda.upload_weight(t) for t in mats]
        cuda.compact_weights = saved["compact_weights"]
        bias = cuda.upload_weight(b_tensor)
        for name, value in attrs.items():
            setattr(cuda, name, value)
        stream = cuda.create_stream()
        xb, idb = f32(io.put(x), n, k_in), i32(io.put(ids), n)
        got: dict[tuple[bool, bool], list[np.ndarray]] = {}
        for compact, own in ((True, True), (False, True), (True, False)):
            cuda.layout_kernels = own
            ws = uploaded[compact]
            outs = [f32(io.empty(n * r * 4), n, r) for r in (k_in, 80, 80, 80, 80, 72)]
            scratch = [f32(io.empty(n * 80 * 4), n, 80) for _ in range(2)]
            cuda.launch("embedding", stream, out=outs[0], ids=idb, table=ws[0])
            cuda.launch("matmul", stream, out=outs[1], x=xb, weight=ws[0], bias=bias)
            cuda.launch("swiglu", stream, out=outs[2], x=xb, gate=ws[0], up=ws[1],
                        scratch_gate=scratch[0], scratch_up=scratch[1])  # fmt: skip
            cuda.launch("qkv", stream, q=outs[3], k=outs[4], v=outs[5], x=xb, wq=ws[0],
                        wk=ws[1], wv=ws[2])  # fmt: skip
            cuda.synchronize(stream)
            got[compact, own] = [io.get(o.buffer, np.uint32, (n, o.shape[1])) for o in outs]
        ops = ("embedding", "matmul", "swiglu", "q", "k", "v")
        for variant in ((False, True), (True, False)):
            for op, a, b in zip(ops, got[True, True], got[variant], strict=True):
                assert np.array_equal(a, b), (label, variant, op, int((a != b).sum()))
        assert not np.isnan(got[True, True][1].view(np.float32)).any()  # every output written
        cuda.free_weight(bias)
    finally:
        for name, value in saved.items():
            setattr(cuda, name, value)
        for ws in uploaded.values():
            for w in ws:
                cuda.free_weight(w)
        io.close()


QKV_ROPE_CASES = [
    # (label, weight types of wq, wk, wv, K, n_heads, n_kv, head_dim, style, bias, slot)
    ("Q8_0,normal", ("Q8_0",) * 3, 2048, 8, 2, 64, "normal", False, 1),
    ("Q4_K+Q6_K,neox,bias", ("Q4_K", "Q4_K", "Q6_K"), 512, 4, 2, 32, "neox", True, 0),
    ("Q4_1,normal,hd128,bad slot", ("Q4_1",) * 3, 96, 2, 1, 128, "normal", False, 7),
]


@pytest.mark.parametrize("norm", [False, True], ids=["", "rms_norm"])
@pytest.mark.parametrize("case", QKV_ROPE_CASES, ids=[c[0] for c in QKV_ROPE_CASES])
def test_qkv_rope_kv_store_at_one_row(cuda: Any, case: tuple, norm: bool) -> None:
    """qkv_rope_kv_store of one row in one launch (qkv_rope_gemv_q) leaves q, k, v and the
    cache bit for bit as its decomposition (qkv on the gemv kernels, then rope_kv_store)
    does, within the kit's bounds of the reference; both RoPE styles, biases, a K-quant v
    of another block size; an out-of-range slot stores nothing. ``norm``: the same of
    rms_norm_qkv_rope_kv_store native (qkv_rope_norm_gemv_q) against rms_norm's launch
    and qkv_rope_gemv_q's."""
    _, wtypes, k_in, n_heads, n_kv, hd, style, with_bias, slot = case
    op = "rms_norm_qkv_rope_kv_store" if norm else "qkv_rope_kv_store"
    layout = vt.KVLayout(n_layers=2, n_slots=4, max_len=64, n_kv_heads=n_kv, head_dim=hd)
    params = vt.RopeParams(head_dim=hd, style=vt.RopeStyle(style), base=10000.0)
    rows = (n_heads * hd, n_kv * hd, n_kv * hd)
    rng = np.random.default_rng(k_in)
    mats = [weight_tensor(f"w{i}", rng.standard_normal((r, k_in)).astype(np.float32), wt)
            for i, (r, wt) in enumerate(zip(rows, wtypes, strict=True))]  # fmt: skip
    biases = [weight_tensor(f"b{i}", rng.standard_normal(r).astype(np.float32), "F32")
              for i, r in enumerate(rows)] if with_bias else []  # fmt: skip
    x = rng.standard_normal((1, k_in)).astype(np.float32)
    norm_t, norm_ref = weight_tensor(
        "n", (1 + 0.1 * rng.standard_normal(k_in)).astype(np.float32), "F32"
    )
    if norm:
        x *= np.float32(7.5)
    cache0 = rng.standard_normal(layout.shape).astype(np.float32)
    pos, slots = np.array([37], np.int32), np.array([slot], np.int32)
    io = IO(cuda)
    ws = [cuda.upload_weight(t) for t, _ in mats]
    bs = [cuda.upload_weight(t) for t, _ in biases]
    nw = cuda.upload_weight(norm_t)
    saved, saved_fold = cuda.native_fused, cuda.norm_fold_max_k
    late = cuda.norm_late or saved_fold > 0  # how the norm kernels were compiled
    cuda.norm_fold_max_k = 0  # native_fused alone says which path runs
    launched: dict[bool, list[str]] = {True: [], False: []}
    try:
        stream = cuda.create_stream()
        got = {}
        for fused in (True, False):
            cuda.native_fused = (saved | {op}) if fused else saved - {op}
            outs = [f32(io.empty(4 * r), 1, r) for r in rows]
            cache = f32(io.put(cache0), *layout.shape)
            names: dict[str, Any] = dict(zip(("bq", "bk", "bv"), bs, strict=False))
            if norm:
                names |= {"norm": nw, "eps": 1e-5, "scratch": f32(io.empty(4 * k_in), 1, k_in)}
            with recording(cuda, launched[fused]):
                cuda.launch(
                    op, stream, q=outs[0], k=outs[1], v=outs[2],
                    x=f32(io.put(x), 1, k_in), wq=ws[0], wk=ws[1], wv=ws[2], **names,
                    positions=i32(io.put(pos), 1), slots=i32(io.put(slots), 1), cache=cache,
                    layout=layout, layer=1, n_heads=n_heads, params=params,
                )  # fmt: skip
            cuda.synchronize(stream)
            got[fused] = [io.get(o.buffer, np.float32, (1, o.shape[1])) for o in outs]
            got[fused].append(io.get(cache.buffer, np.float32, layout.shape))
        if norm:
            want_launched = {True: ["qkv_rope_norm_gemv_q"], False: ["rms_norm", "qkv_rope_gemv_q"]}
        else:
            want_launched = {True: ["qkv_rope_gemv_q"], False: ["qkv_gemv2_q", "rope_kv_store"]}
        assert launched == want_launched
        if not (norm and late):  # the scale applied after the sums rounds otherwise
            for a, b in zip(got[True], got[False], strict=True):
                np.testing.assert_array_equal(a, b)
        want = {n: np.zeros((1, r), np.float32) for n, r in zip("qkv", rows, strict=True)}
        want_cache = cache0.copy()
        ref_args = {f"w{n}": ref for n, (_, ref) in zip("qkv", mats, strict=True)}
        ref_args.update({f"b{n}": ref for n, (_, ref) in zip("qkv", biases, strict=False)})
        if norm:
            ref_args |= {"norm": norm_ref, "eps": 1e-5}
        if slot < layout.n_slots:
            vt.OPS[op].reference(
                {**want, "x": x, **ref_args, "positions": pos, "slots": slots,
                 "cache": want_cache, "layout": layout, "layer": 1, "n_heads": n_heads,
                 "params": params}
            )  # fmt: skip
            for i, n in enumerate("qkv"):
                assert nmse(got[True][i], want[n]) <= kernel_tolerance("qkv", wtypes[i]), n
            assert nmse(got[True][3], want_cache) <= kernel_tolerance("qkv", wtypes[0])
        else:  # the cache is untouched
            np.testing.assert_array_equal(got[True][3], cache0)
    finally:
        cuda.native_fused, cuda.norm_fold_max_k = saved, saved_fold
        for w in [*ws, *bs, nw]:
            cuda.free_weight(w)
        io.close()


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("k_in", [96, 4608])
def test_rms_norm_swiglu_at_one_row(cuda: Any, wtype: str, k_in: int) -> None:
    """rms_norm_swiglu of one row native (swiglu_norm_gemv2_q: the block normalises x as
    rms_norm does) gives the bits of rms_norm's launch followed by swiglu_gemv2_q's, within
    the kit's bound of the reference; K = 96 (a block of 64 threads, each four of
    rms_norm's 256) and 4608 (128 threads, several passes). Features 37: a partial block.
    With ``norm_late`` (the sums scaled at the end) only the bound holds."""
    if wtype.endswith("_K") and k_in % 256:
        k_in = 512
    rng = np.random.default_rng(k_in + 1)
    mats = [weight_tensor(f"w{i}", rng.standard_normal((37, k_in)).astype(np.float32), wtype)
            for i in range(2)]  # fmt: skip
    norm_t, norm_ref = weight_tensor(
        "n", (1 + 0.1 * rng.standard_normal(k_in)).astype(np.float32), "F32"
    )
    x = (rng.standard_normal((1, k_in)) * 30).astype(np.float32)
    io = IO(cuda)
    ws = [cuda.upload_weight(t) for t, _ in mats]
    nw = cuda.upload_weight(norm_t)
    saved, saved_fold = cuda.native_fused, cuda.norm_fold_max_k
    late = cuda.norm_late or saved_fold > 0  # how the norm kernels were compiled
    cuda.norm_fold_max_k = 0  # native_fused alone says which path runs
    launched: dict[bool, list[str]] = {True: [], False: []}
    try:
        stream = cuda.create_stream()
        got = {}
        for fused in (True, False):
            cuda.native_fused = (saved | {"rms_norm_swiglu"}) if fused else saved
            out = f32(io.empty(4 * 37), 1, 37)
            with recording(cuda, launched[fused]):
                cuda.launch(
                    "rms_norm_swiglu", stream, out=out, x=f32(io.put(x), 1, k_in), norm=nw,
                    eps=1e-5, gate=ws[0], up=ws[1], scratch=f32(io.empty(4 * k_in), 1, k_in),
                    scratch_gate=f32(io.empty(4 * 37), 1, 37),
                    scratch_up=f32(io.empty(4 * 37), 1, 37),
                )  # fmt: skip
            cuda.synchronize(stream)
            got[fused] = io.get(out.buffer, np.float32, (1, 37))
        gws = [cuda._gpu_weight(w, "swiglu") for w in ws]
        sv = cuda._gemv(f32(io.empty(4 * k_in), 1, k_in), *gws, **cuda._swiglu_gemv)[0]
        assert launched == {True: [f"swiglu_norm_gemv{sv}_q"],
                            False: ["rms_norm", f"swiglu_gemv{sv}_q"]}  # fmt: skip
        if not late:  # the scale applied after the sums rounds otherwise
            np.testing.assert_array_equal(got[True], got[False])
        want = {"out": np.zeros((1, 37), np.float32)}
        vt.OPS["rms_norm_swiglu"].reference(
            {**want, "x": x, "norm": norm_ref, "eps": 1e-5, "gate": mats[0][1], "up": mats[1][1]}
        )
        assert nmse(got[True], want["out"]) <= kernel_tolerance("rms_norm_swiglu", wtype)
    finally:
        cuda.native_fused, cuda.norm_fold_max_k = saved, saved_fold
        for w in [*ws, nw]:
            cuda.free_weight(w)
        io.close()


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize(("out_f", "k_in"), [(96, 576), (2048, 256), (1000, 4608)])
def test_matmul_add_rms_norm_at_one_row(cuda: Any, wtype: str, out_f: int, k_in: int) -> None:
    """matmul_add_rms_norm of one row native (matmul_norm_gemv2_q: the grid's last block
    normalises the row) gives the bits of matmul_add's launch followed by rms_norm's, out
    in place of the residual as the graph runs it, within the kit's bound of the reference;
    rows of 96 to 2,048 values (a partial last block at 1,000), blocks of 64 and 128
    threads. Run twice: the device-wide count starts from zero again."""
    if wtype.endswith("_K") and k_in % 256:
        k_in = 512
    rng = np.random.default_rng(out_f + k_in)
    mat = weight_tensor("w", rng.standard_normal((out_f, k_in)).astype(np.float32), wtype)
    norm_t, norm_ref = weight_tensor(
        "n", (1 + 0.1 * rng.standard_normal(out_f)).astype(np.float32), "F32"
    )
    x = rng.standard_normal((1, k_in)).astype(np.float32)
    res = (rng.standard_normal((1, out_f)) * 3).astype(np.float32)
    io = IO(cuda)
    w, nw = cuda.upload_weight(mat[0]), cuda.upload_weight(norm_t)
    saved, op = cuda.native_fused, "matmul_add_rms_norm"
    launched: dict[bool, list[str]] = {True: [], False: []}
    try:
        stream = cuda.create_stream()
        got = {}
        for fused in (True, True, False):
            # (saved may hold it already: kit_variant.py --add-fused matmul_add_rms_norm)
            cuda.native_fused = (saved | {op}) if fused else (saved - {op})
            x_t, r_t = f32(io.put(x), 1, k_in), f32(io.put(res), 1, out_f)
            normed = f32(io.empty(4 * out_f), 1, out_f)
            launched[fused].clear()
            with recording(cuda, launched[fused]):
                cuda.launch(
                    "matmul_add_rms_norm", stream, out=r_t, normed=normed, x=x_t, weight=w,
                    residual=r_t, norm=nw, eps=1e-5, scratch=f32(io.empty(4 * out_f), 1, out_f),
                )  # fmt: skip
            cuda.synchronize(stream)
            now = (io.get(r_t.buffer, np.float32, (1, out_f)),
                   io.get(normed.buffer, np.float32, (1, out_f)))  # fmt: skip
            if fused in got:  # the second run: the count started from zero again
                np.testing.assert_array_equal(now[1], got[fused][1])
            got[fused] = now
        gv = cuda._gemv(f32(io.empty(4 * k_in), 1, k_in), cuda._gpu_weight(w, op))[0]
        want_names = {True: [f"matmul_norm_gemv{gv}_q"], False: [f"matmul_gemv{gv}_q", "rms_norm"]}
        assert launched == want_names
        np.testing.assert_array_equal(got[True][0], got[False][0])
        np.testing.assert_array_equal(got[True][1], got[False][1])
        want = {"out": np.zeros((1, out_f), np.float32), "normed": np.zeros((1, out_f), np.float32)}
        vt.OPS["matmul_add_rms_norm"].reference(
            {**want, "x": x, "weight": mat[1], "residual": res, "norm": norm_ref, "eps": 1e-5}
        )
        for name, value in zip(("out", "normed"), got[True], strict=True):
            assert nmse(value, want[name]) <= kernel_tolerance("matmul_add_rms_norm", wtype)
    finally:
        cuda.native_fused = saved
        for weight in (w, nw):
            cuda.free_weight(weight)
        io.close()


DEFERRED = {"swiglu": "matmul_add_rms_norm_swiglu", "qkv": "matmul_add_rms_norm_qkv_rope_kv_store"}


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("then", ["swiglu", "qkv"])
@pytest.mark.parametrize("dim", [256, 768, 2048])
def test_deferred_norm_at_one_row(cuda: Any, wtype: str, then: str, dim: int) -> None:
    """matmul_add_rms_norm_swiglu and matmul_add_rms_norm_qkv_rope_kv_store of one row
    native (the deferred norm: matmul_psq_gemv2_q, then swiglu_psq_gemv2_q or
    qkv_rope_psq_gemv_q by default; the kernels of the backend's settings) against their
    decompositions (matmul_gemv2_q, rms_norm, then the plain consumer): out (the
    residual's update, in place) bit for bit, what follows the norm within the kit's bound
    of the reference; 128 to 1,024 partial sums, blocks of 64 and 128 threads."""
    op = DEFERRED[then]
    rng = np.random.default_rng(dim + len(then))

    def mk(name: str, rows: int, cols: int) -> tuple[vt.WeightTensor, np.ndarray]:
        return weight_tensor(name, rng.standard_normal((rows, cols)).astype(np.float32), wtype)

    wo = mk("wo", dim, dim)
    norm_t, norm_ref = weight_tensor(
        "n", (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32), "F32"
    )
    x = (rng.standard_normal((1, dim)) * 0.3).astype(np.float32)
    res = (rng.standard_normal((1, dim)) * 3).astype(np.float32)
    if then == "swiglu":
        mats = {"gate": mk("g", 96, dim), "up": mk("u", 96, dim)}
        outs = {"act": (1, 96)}
        layout = None
    else:
        layout = vt.KVLayout(n_layers=2, n_slots=2, max_len=32, n_kv_heads=2, head_dim=64)
        mats = {"wq": mk("q", 256, dim), "wk": mk("k", 128, dim), "wv": mk("v", 128, dim)}
        outs = {"q": (1, 256), "k": (1, 128), "v": (1, 128)}
    io = IO(cuda)
    ws = {k: cuda.upload_weight(t) for k, (t, _) in mats.items()}
    w, nw = cuda.upload_weight(wo[0]), cuda.upload_weight(norm_t)
    saved, saved_fold = cuda.native_fused, cuda.norm_fold_max_k
    cuda.norm_fold_max_k = 0  # decomposed: rms_norm, then the plain consumer
    cache0 = rng.standard_normal(layout.shape).astype(np.float32) if layout else None
    launched: dict[bool, list[str]] = {True: [], False: []}
    got: dict[bool, dict[str, np.ndarray]] = {}
    try:
        stream = cuda.create_stream()
        for fused in (True, False):
            cuda.native_fused = (saved | {op}) if fused else (saved - {op})
            r_t = f32(io.put(res), 1, dim)
            args: dict[str, Any] = {k: f32(io.empty(4 * s[1]), *s) for k, s in outs.items()}
            if layout is not None:
                args |= {"cache": vt.Tensor(io.put(cache0), np.float32, layout.shape),
                         "positions": vt.Tensor(io.put(np.array([5], np.int32)), np.int32, (1,)),
                         "slots": vt.Tensor(io.put(np.array([1], np.int32)), np.int32, (1,)),
                         "layout": layout, "layer": 1, "n_heads": 4,
                         "params": vt.RopeParams(64)}  # fmt: skip
            else:
                args |= {k: f32(io.empty(4 * 96), 1, 96) for k in ("scratch_gate", "scratch_up")}
            with recording(cuda, launched[fused]):
                cuda.launch(
                    op, stream, out=r_t, x=f32(io.put(x), 1, dim), weight=w, residual=r_t,
                    norm=nw, eps=1e-5, scratch=f32(io.empty(4 * dim), 1, dim),
                    scratch_norm=f32(io.empty(4 * dim), 1, dim), **ws, **args,
                )  # fmt: skip
            cuda.synchronize(stream)
            got[fused] = {"out": io.get(r_t.buffer, np.float32, (1, dim))}
            got[fused] |= {k: io.get(args[k].buffer, np.float32, s) for k, s in outs.items()}
            if layout is not None:
                got[fused]["cache"] = io.get(args["cache"].buffer, np.float32, layout.shape)
        # the kernels of the backend's gemv choice (a variant's settings: kit_variant.py)
        x_t = f32(io.empty(4 * dim), 1, dim)
        gw = [cuda._gpu_weight(ws[k], op) for k in mats]
        fv = cuda._gemv(x_t, cuda._gpu_weight(w, op))[0]
        sv = cuda._gemv(x_t, *gw, **cuda._swiglu_gemv)[0] if then == "swiglu" else 0
        consumer = f"swiglu_psq_gemv{sv}_q" if then == "swiglu" else "qkv_rope_psq_gemv_q"
        plain = f"swiglu_gemv{sv}_q" if then == "swiglu" else "qkv_rope_gemv_q"
        producer = f"matmul_psq_gemv{cuda.deferred_norm_features or fv}_q"
        assert launched == {True: [producer, consumer],
                            False: [f"matmul_gemv{fv}_q", "rms_norm", plain]}  # fmt: skip
        np.testing.assert_array_equal(got[True]["out"], got[False]["out"])
        want = {"out": np.zeros((1, dim), np.float32)}
        want |= {k: np.zeros(s, np.float32) for k, s in outs.items()}
        refs = {k: ref for k, (_, ref) in mats.items()}
        if layout is not None:
            want["cache"] = cache0.copy()
            refs |= {"positions": np.array([5], np.int32), "slots": np.array([1], np.int32),
                     "layout": layout, "layer": 1, "n_heads": 4,
                     "params": vt.RopeParams(64)}  # fmt: skip
        vt.OPS[op].reference({**want, "x": x, "weight": wo[1], "residual": res,
                              "norm": norm_ref, "eps": 1e-5, **refs})  # fmt: skip
        bound = kernel_tolerance(op, wtype)
        for name, value in got[True].items():
            assert nmse(value, want[name]) <= bound, name
            assert nmse(got[False][name], want[name]) <= bound, name
    finally:
        cuda.native_fused, cuda.norm_fold_max_k = saved, saved_fold
        for weight in (*ws.values(), w, nw):
            cuda.free_weight(weight)
        io.close()


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize(("threads", "unroll"), [(256, False), (128, False), (128, True)])
def test_long_rows_on_the_long_gemv(cuda: Any, wtype: str, threads: int, unroll: bool) -> None:
    """gemv_long_*: a one-row matmul_add with K = 8,192 (the 1B shape's down projection) on
    4 features a block of 256 threads (two passes a thread), of 128 (four passes), or of 128
    with the unrolled kernels (four passes, two in flight), within the kit's bound of the
    reference; the deferred norm's producer over the same weight (matmul_psq_gemv*4_q)
    leaves the same out bit for bit, and its consumer's act within the bound of
    matmul_add_rms_norm_swiglu's reference."""
    k_in, dim, ffn = 8192, 256, 64
    rng = np.random.default_rng(threads + unroll)

    def mk(name: str, rows: int, cols: int) -> tuple[vt.WeightTensor, np.ndarray]:
        return weight_tensor(name, rng.standard_normal((rows, cols)).astype(np.float32), wtype)

    wd, wg, wu = mk("d", dim, k_in), mk("g", ffn, dim), mk("u", ffn, dim)
    norm_t, norm_ref = weight_tensor(
        "n", (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32), "F32"
    )
    x = (rng.standard_normal((1, k_in)) * 0.3).astype(np.float32)
    res = (rng.standard_normal((1, dim)) * 3).astype(np.float32)
    io = IO(cuda)
    w, g, u, nw = (cuda.upload_weight(t) for t in (wd[0], wg[0], wu[0], norm_t))
    names = ("gemv_long_min_k", "gemv_long_features", "gemv_long_threads",
             "gemv_unroll_min_k", "norm_fold_max_k", "native_fused")  # fmt: skip
    saved = {n: getattr(cuda, n) for n in names}
    cuda.gemv_long_min_k, cuda.gemv_long_features, cuda.gemv_long_threads = 4096, 4, threads
    cuda.gemv_unroll_min_k = 4096 if unroll else 0
    cuda.norm_fold_max_k = 0  # a 256-value norm row deferred, not folded
    cuda.native_fused = saved["native_fused"] | {"matmul_add_rms_norm_swiglu"}
    launched: list[str] = []
    try:
        stream = cuda.create_stream()
        plain = f32(io.empty(4 * dim), 1, dim)
        xt = f32(io.put(x), 1, k_in)
        r_t = f32(io.put(res), 1, dim)
        act = f32(io.empty(4 * ffn), 1, ffn)
        with recording(cuda, launched):
            cuda.launch("matmul_add", stream, out=plain, x=xt, weight=w, residual=r_t,
                        scratch=f32(io.empty(4 * dim), 1, dim))  # fmt: skip
            cuda.launch(
                "matmul_add_rms_norm_swiglu", stream, out=r_t, x=xt, weight=w, residual=r_t,
                norm=nw, eps=1e-5, scratch=f32(io.empty(4 * dim), 1, dim),
                scratch_norm=f32(io.empty(4 * dim), 1, dim), gate=g, up=u, act=act,
                scratch_gate=f32(io.empty(4 * ffn), 1, ffn),
                scratch_up=f32(io.empty(4 * ffn), 1, ffn),
            )  # fmt: skip
        cuda.synchronize(stream)
        v = "u" if unroll else ""
        gws = [cuda._gpu_weight(t, "swiglu") for t in (g, u)]
        sv = cuda._gemv(f32(io.empty(4 * dim), 1, dim), *gws, **cuda._swiglu_gemv)[0]
        assert launched == [f"matmul_gemv{v}4_q", f"matmul_psq_gemv{v}4_q",
                            f"swiglu_psq_gemv{sv}_q"]  # fmt: skip
        got_plain = io.get(plain.buffer, np.float32, (1, dim))
        np.testing.assert_array_equal(io.get(r_t.buffer, np.float32, (1, dim)), got_plain)
        want_plain = R.matmul(x, wd[1]) + res
        assert nmse(got_plain, want_plain) <= kernel_tolerance("matmul_add", wtype)
        want = {"out": np.zeros((1, dim), np.float32), "act": np.zeros((1, ffn), np.float32)}
        vt.OPS["matmul_add_rms_norm_swiglu"].reference(
            {**want, "x": x, "weight": wd[1], "residual": res, "norm": norm_ref, "eps": 1e-5,
             "gate": wg[1], "up": wu[1]}
        )  # fmt: skip
        got_act = io.get(act.buffer, np.float32, (1, ffn))
        assert nmse(got_act, want["act"]) <= kernel_tolerance("matmul_add_rms_norm_swiglu", wtype)
    finally:
        for n, value in saved.items():
            setattr(cuda, n, value)
        for weight in (w, g, u, nw):
            cuda.free_weight(weight)
        io.close()


@pytest.mark.parametrize("length", [1, 17, 127, 129, 1024, 1025, 3000])
@pytest.mark.parametrize(
    ("n_kv", "hd", "rows"), [(3, 64, 2), (1, 128, 1), (2, 256, 3), (8, 64, 70)]
)
def test_attention_past_one_chunk(cuda: Any, length: int, n_kv: int, hd: int, rows: int) -> None:
    """Split over positions (few rows) or not (70 rows), GQA groups of 3, 9, 4 and 1 heads,
    head_dim 64 to 256; the second row's context is half the first's."""
    n_heads = 9 if n_kv in (1, 3) else 8
    layout = vt.KVLayout(n_layers=2, n_slots=4, max_len=3000, n_kv_heads=n_kv, head_dim=hd)
    rng = np.random.default_rng(length)
    cache = rng.standard_normal(layout.shape).astype(np.float32)
    slots = (np.arange(rows, dtype=np.int32) + 1) % 4
    pos = np.array([length - 1, length // 2, 0][:rows] + [length - 1] * (rows - 3), np.int32)
    q = rng.standard_normal((rows, n_heads * hd)).astype(np.float32)
    want = R.attention(q, cache, layout, 1, slots, pos, n_heads, 0.125)
    io = IO(cuda)
    try:
        out = io.empty(q.nbytes)
        stream = cuda.create_stream()
        cuda.launch(
            "attention", stream, out=f32(out, *q.shape), q=f32(io.put(q), *q.shape),
            cache=f32(io.put(cache), *layout.shape), slots=i32(io.put(slots), rows),
            positions=i32(io.put(pos), rows), layout=layout, layer=1, n_heads=n_heads,
            scale=0.125,
        )  # fmt: skip
        cuda.synchronize(stream)
        got = io.get(out, np.float32, q.shape)
        assert nmse(got, want) <= kernel_tolerance("attention", "F32")
    finally:
        io.close()


def _attention_checked(
    cuda: Any, io: IO, stream: Any, q: np.ndarray, cache: np.ndarray, layout: vt.KVLayout,
    slots: np.ndarray, pos: np.ndarray, context: int = 0,
) -> np.ndarray:  # fmt: skip
    """The attention op's output for q's rows (layer 1, scale 0.125), within the kit's bound
    of the reference on the rows of a valid slot and NaN on the others; ``context``: the
    attention_bounded op with that bound instead."""
    rows, n_heads = q.shape[0], q.shape[1] // layout.head_dim
    out = io.empty(q.nbytes)
    bound = {"context": context} if context else {}
    cuda.launch(
        "attention_bounded" if context else "attention", stream, out=f32(out, *q.shape),
        q=f32(io.put(q), *q.shape), cache=f32(io.put(cache), *layout.shape),
        slots=i32(io.put(slots), rows), positions=i32(io.put(pos), rows), layout=layout,
        layer=1, n_heads=n_heads, scale=0.125, **bound,
    )  # fmt: skip
    cuda.synchronize(stream)
    got = io.get(out, np.float32, q.shape)
    ok = slots < layout.n_slots
    want = R.attention(q[ok], cache, layout, 1, slots[ok], pos[ok], n_heads, 0.125)
    assert nmse(got[ok], want) <= kernel_tolerance("attention", "F32")
    assert np.isnan(got[~ok]).all()
    return got


@pytest.mark.parametrize("rows", [1, 8])
def test_prefetch_hint_changes_no_attention_bit(cuda: Any, rows: int) -> None:
    """GpuBackend.prefetch_bytes: attention after the op prefetch (the 1B shape's o, gate
    and up weights: its split kernel's blocks bring 24 MiB of them into L2 before they
    wait) gives the bits of attention without it, and the weights still read right."""
    layout = vt.KVLayout(n_layers=2, n_slots=4, max_len=512, n_kv_heads=8, head_dim=64)
    rng = np.random.default_rng(rows)
    cache = rng.standard_normal(layout.shape).astype(np.float32)
    slots = np.arange(rows, dtype=np.int32) % 4
    pos = np.array([300 - 7 * i for i in range(rows)], np.int32)
    q = rng.standard_normal((rows, 32 * 64)).astype(np.float32)
    shapes = (("o", (2048, 2048)), ("g", (8192, 2048)), ("u", (8192, 2048)))
    mats = {n: rng.standard_normal(s).astype(np.float32) * 0.02 for n, s in shapes}
    ws = {n: cuda.upload_weight(weight_tensor(n, m, "Q8_0")[0]) for n, m in mats.items()}
    saved = cuda.prefetch_bytes
    io = IO(cuda)
    try:
        stream = cuda.create_stream()
        plain = _attention_checked(cuda, io, stream, q, cache, layout, slots, pos)
        cuda.prefetch_bytes = 24 << 20
        assert cuda.supports("prefetch")
        cuda.launch("prefetch", stream, weight=ws["o"])
        cuda.launch("prefetch", stream, weight=ws["g"], paired=ws["u"])
        hinted = _attention_checked(cuda, io, stream, q, cache, layout, slots, pos)
        np.testing.assert_array_equal(hinted.view(np.uint32), plain.view(np.uint32))
        x = rng.standard_normal((1, 2048)).astype(np.float32)
        out = io.empty(4 * 2048)
        cuda.launch("matmul", stream, out=f32(out, 1, 2048), x=f32(io.put(x), 1, 2048),
                    weight=ws["o"])  # fmt: skip
        cuda.synchronize(stream)
        want = R.matmul(x, weight_tensor("o", mats["o"], "Q8_0")[1])
        assert nmse(io.get(out, np.float32, (1, 2048)), want) <= kernel_tolerance("matmul", "Q8_0")
    finally:
        cuda.prefetch_bytes = saved
        for w in ws.values():
            cuda.free_weight(w)
        io.close()


#: Short-context cases: (positions, KV heads, query heads, head_dim, slot); slot 9 is
#: invalid (its row NaN). The 135M shape's 9 / 3 heads of 64 first; every query row is
#: narrower than overlap_attention_min_q (2,048 values), so each takes the short path.
SHORT_CASES = ((1, 3, 9, 64, 1), (17, 3, 9, 64, 2), (128, 3, 9, 64, 1), (256, 3, 9, 64, 3),
               (512, 3, 9, 64, 1), (200, 1, 9, 128, 2), (300, 2, 4, 256, 1),
               (100, 3, 9, 64, 9))  # fmt: skip


@pytest.mark.parametrize("case", SHORT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_short_context_attention_is_the_reference(cuda: Any, case: tuple) -> None:
    """GpuBackend.short_context 512: attention_bounded at one row within it, one launch of
    short_context_threads (512) threads a (row, KV group), no splits, from its own module,
    within the kit's bound of the reference (NaN for an invalid slot), at contexts from 1
    to the bound."""
    length, n_kv, n_heads, hd, slot = case
    layout = vt.KVLayout(n_layers=2, n_slots=4, max_len=600, n_kv_heads=n_kv, head_dim=hd)
    rng = np.random.default_rng(length)
    cache = rng.standard_normal(layout.shape).astype(np.float32)
    q = rng.standard_normal((1, n_heads * hd)).astype(np.float32)
    slots, pos = np.array([slot], np.int32), np.array([length - 1], np.int32)
    io = IO(cuda)
    saved = cuda.short_context
    try:
        cuda.short_context = 512
        stream = cuda.create_stream()
        _attention_checked(cuda, io, stream, q, cache, layout, slots, pos, context=512)
    finally:
        cuda.short_context = saved
        io.close()


@pytest.mark.parametrize(("n_kv", "n_heads", "rows"), [(8, 32, 1), (3, 9, 2), (2, 8, 3)])
def test_last_block_combine_equals_the_combine_launch(
    cuda: Any, n_kv: int, n_heads: int, rows: int
) -> None:
    """attention_split's last block of each (row, group) combining the partials gives the
    output of the separate attention_combine launch bit for bit, launch after launch (its
    counters left zero: three launches, a shorter context between), a row with an invalid
    slot NaN in both."""
    layout = vt.KVLayout(n_layers=2, n_slots=4, max_len=600, n_kv_heads=n_kv, head_dim=64)
    rng = np.random.default_rng(rows)
    cache = rng.standard_normal(layout.shape).astype(np.float32)
    slots = np.array([1, 9, 2][:rows], np.int32)  # row 1: an invalid slot
    q = rng.standard_normal((rows, n_heads * 64)).astype(np.float32)
    io = IO(cuda)
    saved = cuda.attention_last_block_combine
    try:
        outs: dict[bool, list[np.ndarray]] = {}
        stream = cuda.create_stream()
        for fused in (True, False):
            cuda.attention_last_block_combine = fused
            outs[fused] = []
            for length in (517, 40, 517):
                pos = np.array([length - 1, length // 2, 7][:rows], np.int32)
                outs[fused].append(
                    _attention_checked(cuda, io, stream, q, cache, layout, slots, pos)
                )
        for a, b in zip(outs[True], outs[False], strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        cuda.attention_last_block_combine = saved
        io.close()


#: attention_q8a's cases: (rows, KV heads, query heads, head_dim, most splits, last-block
#: combine). Several splits and the combine launch (the 1B shape's batch 8: 2 heads a
#: block), one split (the split kernel writes the rows: batch 32), the last-block combine,
#: 8 tiles of x (33 rows), head_dim 128 and 96 (not 64 or 128: the block path, not the
#: warp path).
Q8A_CASES = ((8, 8, 32, 64, 32, False), (8, 8, 32, 64, 1, False), (8, 2, 4, 64, 32, True),
             (33, 3, 9, 64, 32, False), (8, 2, 4, 128, 32, False), (33, 2, 8, 96, 1, False),
             (8, 2, 8, 96, 32, False))  # fmt: skip


@pytest.mark.parametrize("case", Q8A_CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention_hands_its_int8_rows_to_the_projection(cuda: Any, case: tuple) -> None:
    """attention_q8a: at int8 rows the attention kernel that writes a row also packs it as
    quantize_rows would, and matmul_add of attention's output (a Q8_0 weight, the int8 mma
    kernels) launches no quantize_rows: attention's output and the projection's are bit
    for bit those of the setting off (quantize_rows launched), a row of an invalid slot
    NaN in both; with an op between the two the projection packs x itself, the same bits."""
    rows, n_kv, n_heads, hd, splits, last = case
    layout = vt.KVLayout(n_layers=2, n_slots=rows, max_len=300, n_kv_heads=n_kv, head_dim=hd)
    rng = np.random.default_rng(rows + hd + splits)
    cache = rng.standard_normal(layout.shape).astype(np.float32)
    slots = np.arange(rows, dtype=np.int32)
    slots[1] = rows + 5  # an invalid slot: its row NaN
    pos = rng.integers(0, 300, rows).astype(np.int32)
    q = rng.standard_normal((rows, n_heads * hd)).astype(np.float32)
    wo, _ = weight_tensor("wo", rng.standard_normal((96, n_heads * hd)).astype(np.float32), "Q8_0")
    res = rng.standard_normal((rows, 96)).astype(np.float32)
    io = IO(cuda)
    saved = (cuda.attention_q8a, cuda.attention_max_splits, cuda.attention_last_block_combine,
             cuda.int8_min_rows, cuda.int8_min_values, cuda.int8_mma)  # fmt: skip
    cuda.attention_max_splits, cuda.attention_last_block_combine = splits, last
    cuda.int8_min_rows, cuda.int8_min_values, cuda.int8_mma = 8, 0, True
    launched: dict[str, list[str]] = {}
    got: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    try:
        w = cuda.upload_weight(wo)
        stream = cuda.create_stream()
        for way in ("off", "on", "between"):
            cuda.attention_q8a = way != "off"
            # every buffer first: a memset or copy between the two drops the hand-off
            out, y, sy, other = io.empty(q.nbytes), io.put(res), io.empty(res.nbytes), None
            qb, cb = io.put(q), io.put(cache)
            sb, pb = io.put(slots), io.put(pos)
            if way == "between":
                other = io.empty(q.nbytes)
            launched[way] = []
            with recording(cuda, launched[way]):
                cuda.launch(
                    "attention", stream, out=f32(out, *q.shape), q=f32(qb, *q.shape),
                    cache=f32(cb, *layout.shape), slots=i32(sb, rows), positions=i32(pb, rows),
                    layout=layout, layer=1, n_heads=n_heads, scale=0.125,
                )  # fmt: skip
                if other is not None:
                    cuda.launch("add", stream, out=f32(other, *q.shape), a=f32(out, *q.shape),
                                b=f32(out, *q.shape))  # fmt: skip
                cuda.launch("matmul_add", stream, out=f32(y, rows, 96), x=f32(out, *q.shape),
                            weight=w, residual=f32(y, rows, 96),
                            scratch=f32(sy, rows, 96))  # fmt: skip
            cuda.synchronize(stream)
            got[way] = (io.get(out, np.float32, q.shape), io.get(y, np.float32, res.shape))
        assert "quantize_rows" in launched["off"] and "quantize_rows" in launched["between"]
        assert "quantize_rows" not in launched["on"], launched["on"]
        for way in ("on", "between"):
            for a, b, what in zip(got[way], got["off"], ("attention", "projection"), strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{what} {way}")
        attn = got["on"][0]
        ok = slots < layout.n_slots
        want = R.attention(q[ok], cache, layout, 1, slots[ok], pos[ok], n_heads, 0.125)
        assert nmse(attn[ok], want) <= kernel_tolerance("attention", "F32")
        assert np.isnan(attn[~ok]).all()
    finally:
        (cuda.attention_q8a, cuda.attention_max_splits, cuda.attention_last_block_combine,
         cuda.int8_min_rows, cuda.int8_min_values, cuda.int8_mma) = saved  # fmt: skip
        io.close()


@pytest.mark.parametrize(("n_kv", "n_heads", "rows"), [(8, 32, 1), (3, 9, 2), (2, 8, 3)])
def test_cluster_attention_equals_eight_splits_and_the_combine_launch(
    cuda: Any, n_kv: int, n_heads: int, rows: int
) -> None:
    """attention_cluster (sm_90 and later): attention_split_cluster, each (row, group)'s 8
    splits one thread-block cluster whose first block combines them, gives what 8 splits
    and the attention_combine launch give, bit for bit, launch after launch (a short
    context between, where most splits have no position, and 3,000 positions, where each
    has hundreds); a row with an invalid slot NaN in both."""
    if cuda._sm() < 90:
        pytest.skip(f"thread-block clusters need sm_90 or later, not {cuda.runtime.arch()}")
    layout = vt.KVLayout(n_layers=2, n_slots=4, max_len=3000, n_kv_heads=n_kv, head_dim=64)
    rng = np.random.default_rng(rows + 10)
    cache = rng.standard_normal(layout.shape).astype(np.float32)
    slots = np.array([1, 9, 2][:rows], np.int32)  # row 1: an invalid slot
    q = rng.standard_normal((rows, n_heads * 64)).astype(np.float32)
    io = IO(cuda)
    saved = cuda.attention_cluster, cuda.attention_max_splits, cuda.attention_last_block_combine
    launched: dict[bool, list[str]] = {True: [], False: []}
    try:
        outs: dict[bool, list[np.ndarray]] = {}
        stream = cuda.create_stream()
        cuda.attention_max_splits = 8  # the cluster's: the same partials either way
        # the other leg is the combine launch, also where a variant set the last-block
        # combine (kit_variant.py --last-block-combine 1: run 95)
        cuda.attention_last_block_combine = False
        for cluster in (True, False):
            cuda.attention_cluster = cluster
            outs[cluster] = []
            for length in (517, 40, 3000):
                pos = np.array([length - 1, length // 2, 7][:rows], np.int32)
                with recording(cuda, launched[cluster]):
                    got = _attention_checked(cuda, io, stream, q, cache, layout, slots, pos)
                outs[cluster].append(got)
        assert launched[True] == ["attention_split_cluster"] * 3
        assert launched[False] == ["attention_split", "attention_combine"] * 3
        for a, b in zip(outs[True], outs[False], strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        cuda.attention_cluster, cuda.attention_max_splits, cuda.attention_last_block_combine = saved
        io.close()


def _loud_cache(layout: vt.KVLayout, slots: np.ndarray, pos: np.ndarray, seed: int) -> np.ndarray:
    """A random cache whose positions past each slot's last row are loud (K x8, V +50), so
    a kernel that reads past a row's position fails the comparison (as the kit's cache)."""
    cache = np.random.default_rng(seed).standard_normal(layout.shape).astype(np.float32)
    ok = (slots >= 0) & (slots < layout.n_slots) & (pos >= 0) & (pos < layout.max_len)
    for s in range(layout.n_slots):
        seen = pos[ok & (slots == s)]
        end = int(seen.max()) + 1 if seen.size else 0
        cache[end:, s, :, 0] *= 8.0
        cache[end:, s, :, 1] += 50.0
    return cache


def _chunks(*parts: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Rows (slot, start, count) after one another: a step's prefill chunks; count 1 is a
    decode row."""
    slots = np.concatenate([np.full(c, s, np.int32) for s, _, c in parts])
    pos = np.concatenate([np.arange(p, p + c, dtype=np.int32) for _, p, c in parts])
    return slots, pos


#: (label, n_kv, n_heads, head_dim, slots, positions): rows for the tiled prefill kernel.
TILED_CASES = [
    ("1-row", 2, 8, 64, *_chunks((1, 0, 1))),
    ("17-rows,gqa-9", 1, 9, 64, *_chunks((0, 0, 17))),
    ("64-rows,gqa-4", 8, 32, 64, *_chunks((2, 0, 64))),
    ("130-rows,gqa-3,second-chunk", 3, 9, 64, *_chunks((1, 256, 130))),
    ("600-rows,gqa-4", 2, 8, 64, *_chunks((3, 0, 600))),
    ("512-rows,no-gqa,hd-80", 2, 2, 80, *_chunks((0, 512, 512))),
    ("200-rows,gqa-5,hd-128", 1, 5, 128, *_chunks((2, 90, 200))),
    ("300-rows,gqa-2,hd-256", 2, 4, 256, *_chunks((1, 0, 300))),
    ("97-rows,gqa-7,hd-200", 1, 7, 200, *_chunks((0, 33, 97))),
    (
        "3-seqs+decode,gqa-6",
        1,
        6,
        64,
        *_chunks((2, 0, 150), (0, 700, 90), (3, 0, 40), (1, 999, 1), (0, 790, 1)),
    ),
    ("2-seqs,hd-128", 2, 16, 128, *_chunks((1, 300, 100), (2, 0, 77))),
    ("decode-rows,gqa-8", 1, 8, 64, *_chunks(*((s % 4, 50 + 13 * s, 1) for s in range(70)))),
    ("chunk+32-decode", 2, 8, 64, *_chunks((0, 0, 480), *((s, 300 + s, 1) for s in range(1, 33)))),
    (
        "decode+chunk,hd-128",
        1,
        4,
        128,
        *_chunks(*((s, 9 * s, 1) for s in range(1, 21)), (0, 64, 200)),
    ),
]


def _invalid(
    slots: np.ndarray, pos: np.ndarray, n_slots: int, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Every 23rd row made invalid (slot -1, slot past n_slots, position past max_len or
    negative, in turn) and the rows shuffled: positions in no order, sequences interleaved."""
    slots, pos = slots.copy(), pos.copy()
    for k, i in enumerate(range(5, len(pos), 23)):
        if k % 4 == 0:
            slots[i] = -1
        elif k % 4 == 1:
            slots[i] = n_slots
        elif k % 4 == 2:
            pos[i] = max_len
        else:
            pos[i] = -3
    order = np.random.default_rng(len(pos)).permutation(len(pos))
    return slots[order], pos[order]


def _attend(
    cuda: Any, q: np.ndarray, cache: np.ndarray, layout: vt.KVLayout, slots: np.ndarray,
    pos: np.ndarray, n_heads: int, scale: float, tiled_min_rows: int | None = None,
) -> tuple[np.ndarray, list[str]]:  # fmt: skip
    """The attention op on layer 1 (``attention_tiled_min_rows`` set for the call if
    given): its output and the kernels it launched."""
    launched: list[str] = []
    kernel, saved = cuda._kernel, cuda.attention_tiled_min_rows

    def record(name: str, *args: Any, **kw: Any) -> None:
        launched.append(name)
        kernel(name, *args, **kw)

    cuda._kernel = record
    if tiled_min_rows is not None:
        cuda.attention_tiled_min_rows = tiled_min_rows
    n = len(pos)
    io = IO(cuda)
    try:
        out = io.empty(q.nbytes)
        stream = cuda.create_stream()
        cuda.launch(
            "attention", stream, out=f32(out, *q.shape), q=f32(io.put(q), *q.shape),
            cache=f32(io.put(cache), *layout.shape), slots=i32(io.put(slots), n),
            positions=i32(io.put(pos), n), layout=layout, layer=1, n_heads=n_heads,
            scale=scale,
        )  # fmt: skip
        cuda.synchronize(stream)
        return io.get(out, np.float32, q.shape), launched
    finally:
        del cuda._kernel
        cuda.attention_tiled_min_rows = saved
        io.close()


@pytest.mark.parametrize("invalid", [False, True], ids=["valid", "invalid+shuffled"])
@pytest.mark.parametrize("case", TILED_CASES, ids=[c[0] for c in TILED_CASES])
def test_tiled_prefill_attention(cuda: Any, case: tuple, invalid: bool) -> None:
    """Attention from 1 row on the tiled path (attention_tiled_* forced, with
    attention_split for the tiles of three or more sequences) against the reference: 1-600
    rows, GQA groups of 1-9 heads, head_dim 64-256, chunks that start past 0, rows of 2-3
    sequences, a chunk beside decode rows; and the same rows with invalid ones (NaN, as
    attention_split gives them) and in shuffled order (tiles mixing many sequences,
    positions in no order)."""
    _, n_kv, n_heads, hd, slots, pos = case
    n_slots = max(4, int(slots.max()) + 1)
    layout = vt.KVLayout(n_layers=2, n_slots=n_slots, max_len=1200, n_kv_heads=n_kv,
                         head_dim=hd)  # fmt: skip
    if invalid:
        slots, pos = _invalid(slots, pos, n_slots, layout.max_len)
    n = len(pos)
    ok = (slots >= 0) & (slots < n_slots) & (pos >= 0) & (pos < layout.max_len)
    cache = _loud_cache(layout, slots, pos, n)
    q = np.random.default_rng(n + 1).standard_normal((n, n_heads * hd)).astype(np.float32)
    scale = 1.0 / float(np.sqrt(hd))
    got, launched = _attend(cuda, q, cache, layout, slots, pos, n_heads, scale, 1)
    assert launched[0].startswith("attention_tiled_h") and launched[1] == "attention_split"
    assert np.isnan(got[~ok]).all()
    assert not np.isnan(got[ok]).any()
    if ok.any():
        want = R.attention(q[ok], cache, layout, 1, slots[ok], pos[ok], n_heads, scale)
        assert nmse(got[ok], want) <= kernel_tolerance("attention", "F32")


@pytest.mark.parametrize("rows", ["prefill-512", "decode-32"])
def test_attention_rows_pick_their_kernel(cuda: Any, rows: str) -> None:
    """By default a 512-row chunk runs tiled (attention_split launched beside it, for
    tiles of many sequences: none here) and a 32-row decode batch split alone: both equal
    the reference."""
    layout = vt.KVLayout(n_layers=2, n_slots=33, max_len=600, n_kv_heads=8, head_dim=64)
    if rows == "prefill-512":
        slots, pos = _chunks((0, 0, 512))
    else:
        slots, pos = _chunks(*((s, 500, 1) for s in range(32)))
    n = len(pos)
    cache = _loud_cache(layout, slots, pos, n)
    q = np.random.default_rng(n).standard_normal((n, 32 * 64)).astype(np.float32)
    got, launched = _attend(cuda, q, cache, layout, slots, pos, 32, 0.125)
    assert launched[0] == ("attention_tiled_h64r64" if n == 512 else "attention_split")
    want = R.attention(q, cache, layout, 1, slots, pos, 32, 0.125)
    assert nmse(got, want) <= kernel_tolerance("attention", "F32")


def _peaked(vocab: int, row: tuple[float, float, int, int]) -> np.ndarray:
    """Logits with 24 peaks over a masked, noisy background, drawn until the kit can pick a
    counter whose draw (and top-p cut) is clear of rounding: a flat distribution over a real
    vocabulary puts every u within rounding of some CDF step."""
    for seed in range(100):
        rng = np.random.default_rng((vocab, row[3], seed))
        logits = rng.standard_normal(vocab).astype(np.float32)
        logits[::7] = -np.inf  # masked tokens, as a grammar would leave them
        peaks = rng.choice(vocab, 24, replace=False)
        logits[peaks] = rng.uniform(40.0, 60.0, 24).astype(np.float32)
        try:
            sample_params(logits[None], [row])
        except ValueError:
            continue
        return logits
    raise AssertionError("no usable logits")


@pytest.mark.parametrize("vocab", [49152, 151936])
def test_sampling_equals_the_reference_on_real_vocabularies(cuda: Any, vocab: int) -> None:
    rows = [
        (0.0, 1.0, 0, 0),
        (0.7, 1.0, 0, 1),
        (1.0, 0.9, 0, 2),
        (0.8, 0.95, 40, 3),
        (1.3, 1.0, 1, 4),
        (1.0, 0.5, 200, 5),
        (0.6, 1.0, vocab - 1, 6),
        (2.0, 0.99, 0, 2**32 - 1),
    ]
    logits = np.stack([_peaked(vocab, row) for row in rows])
    params = sample_params(logits, rows)
    want = R.sample(logits, params)
    io = IO(cuda)
    try:
        out = io.empty(len(rows) * 4)
        stream = cuda.create_stream()
        cuda.launch(
            "sample", stream, out=i32(out, len(rows)), logits=f32(io.put(logits), *logits.shape),
            params=vt.Tensor.of(io.put(params), vt.SAMPLE_PARAMS_DTYPE, len(rows)),
        )  # fmt: skip
        cuda.synchronize(stream)
        assert io.get(out, np.int32, (len(rows),)).tolist() == want.tolist()
    finally:
        io.close()


@pytest.mark.parametrize("vocab", [49152, 49155, 128256])
def test_greedy_argmax_over_blocks(cuda: Any, vocab: int) -> None:
    """sample_argmax's blocks, then sample over their results, give numpy's argmax (the
    lowest id on ties, across blocks too), -1 for a row with a NaN or +inf, 0 for a row all
    -inf; rows of 49,155 ids start off 16-byte boundaries. And the same ids as one block
    walking each row (sample_argmax_slice = 0)."""
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((6, vocab)).astype(np.float32)
    logits[1, [5, vocab - 3, 40000]] = 9.0  # a tie in three blocks: the lowest id wins
    logits[2, 30000] = np.nan
    logits[3, vocab - 1] = np.inf
    logits[4] = -np.inf
    logits[5, vocab - 1] = 20.0  # the last id, in the last (short) block
    want = [int(np.argmax(logits[0])), 5, -1, -1, 0, vocab - 1]
    params = np.zeros(6, vt.SAMPLE_PARAMS_DTYPE)
    params["top_p"] = 1.0  # temperature 0: greedy
    io = IO(cuda)
    saved = cuda.sample_argmax_slice
    try:
        got = {}
        for slice_ in (2048, 0):
            cuda.sample_argmax_slice = slice_
            out = io.empty(6 * 4)
            stream = cuda.create_stream()
            names: list[str] = []
            with recording(cuda, names):
                cuda.launch(
                    "sample", stream, out=i32(out, 6), logits=f32(io.put(logits), *logits.shape),
                    params=vt.Tensor.of(io.put(params), vt.SAMPLE_PARAMS_DTYPE, 6),
                )  # fmt: skip
            cuda.synchronize(stream)
            assert names == (["sample_argmax", "sample"] if slice_ else ["sample"])
            got[slice_] = io.get(out, np.int32, (6,)).tolist()
        assert got[2048] == got[0] == want
    finally:
        cuda.sample_argmax_slice = saved
        io.close()


def greedy(runner: ModelRunner, prompts: dict[int, list[int]], n_new: int) -> dict[int, list]:
    out = {s: [] for s in prompts}
    got = runner.execute(
        [SeqChunk(slot=s, start_pos=0, token_ids=p) for s, p in prompts.items()]
    ).get_output()
    for s, t in got.items():
        out[s].append(t)
    pos = {s: len(p) for s, p in prompts.items()}
    for _ in range(n_new - 1):
        step = runner.execute(
            [SeqChunk(slot=s, start_pos=pos[s], token_ids=None, from_previous=True) for s in out]
        )
        for s, t in step.get_output().items():
            out[s].append(t)
            pos[s] += 1
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("tiny") / "llama-q8.gguf"
    write_tiny_gguf(path, arch="llama", weight_type="Q8_0", n_layers=2)
    with load_gguf(path) as model:
        yield model


def test_runner_ids_equal_cpu_on_every_path(tiny: Any) -> None:
    prompts = {0: [3, 17, 42, 5, 9, 60, 1, 33, 21] * 2, 1: [8, 2, 50]}  # 18 rows: tiled matmul
    results = {}
    for name, kw in {
        "cpu": {},
        "cuda/async": {},
        "cuda/sync": {"async_scheduling": False},
        "cuda/vmm": {"kv_cache": "vmm"},
        "cuda/contiguous": {"kv_cache": "contiguous"},
        "cuda/overlap-attention": {},
        "cuda/argmax-blocks": {},
    }.items():
        backend = make(name.split("/")[0])
        if name == "cuda/overlap-attention":  # attention's kernels launched overlapped
            backend.overlap_attention = True  # type: ignore[attr-defined]
        if name == "cuda/argmax-blocks":  # the 300 ids' argmax over 19 blocks
            backend.sample_argmax_slice = 16  # type: ignore[attr-defined]
        try:
            with ModelRunner(backend, tiny, max_slots=2, max_model_len=64, **kw) as r:
                if name == "cuda/async":
                    assert r.readback == "async_d2h"
                if name == "cuda/vmm":
                    assert r.kv.kind == "vmm"  # type: ignore[union-attr]
                results[name] = greedy(r, prompts, 12)
        finally:
            backend.close()
    for name, ids in results.items():
        assert ids == results["cpu"], name


#: (architecture, projection weight type) of the tiny models whose greedy ids cuda must
#: give exactly as cpu does; K-quants need widths that are multiples of 256.
GREEDY_MODELS = [
    ("llama", "F32"),
    ("llama", "F16"),
    ("qwen2", "BF16"),
    ("llama", "Q4_0"),
    ("qwen2", "Q4_1"),
    ("qwen3", "Q8_0"),
    ("llama", "Q4_K"),
    ("qwen3", "Q5_K"),
    ("qwen2", "Q6_K"),
]


@pytest.mark.parametrize(("arch", "wtype"), GREEDY_MODELS)
def test_greedy_ids_equal_cpu_with_graphs_and_async_on_and_off(
    tmp_path: Path, arch: str, wtype: str
) -> None:
    kw: dict[str, Any] = {"dim": 256, "ffn": 512, "n_heads": 4} if wtype.endswith("_K") else {}
    path = write_tiny_gguf(tmp_path / f"{arch}-{wtype}.gguf", arch=arch, weight_type=wtype,
                           n_layers=2, **kw)  # fmt: skip
    # 22 rows (tiled kernel), then 90 (cuBLAS): the second prefill is a step of its own
    prompts = {0: [3, 17, 42, 5, 9, 60, 1, 33, 21] * 2, 1: [8, 2, 50], 2: [7]}
    long_prompt = {3: [(7 * i + 3) % 60 + 1 for i in range(90)]}
    results, stats = {}, {}
    with load_gguf(path) as model:
        for name in ("cpu", "cuda/graphs/async", "cuda/graphs/sync", "cuda/eager/async",
                     "cuda/eager/sync"):  # fmt: skip
            backend = make(name.split("/")[0])
            kwargs: dict[str, Any] = {}
            if name != "cpu":
                kwargs = {"graphs": "/graphs/" in name, "async_scheduling": name.endswith("async")}
            try:
                with ModelRunner(backend, model, max_slots=4, max_model_len=128, **kwargs) as r:
                    if name != "cpu":
                        assert r.graphs is kwargs["graphs"], r.graphs_reason
                        want = "async_d2h" if kwargs["async_scheduling"] else "sync"
                        assert r.readback == want, r.readback_reason
                    results[name] = greedy(r, prompts, 12), greedy(r, long_prompt, 6)
                    stats[name] = r.graph_stats
            finally:
                backend.close()
    for name, ids in results.items():
        assert ids == results["cpu"], f"{name}: {ids} != cpu's {results['cpu']}"
    for name in ("cuda/graphs/async", "cuda/graphs/sync"):
        assert stats[name]["replays"] >= 8, (name, stats[name])
    assert stats["cuda/eager/async"]["replays"] == 0


def test_overlap_mma_gives_the_ids_of_plain_launches(tmp_path: Path) -> None:
    """overlap_mma: a batch of 12 decoding on the int8 mma kernels (int8_min_values 0 so the
    tiny model's weights take them), replayed from graphs, gives the ids of the same
    kernels launched plain; with the K split too, the ids of the split launches plain (the
    same kernels, the same bits: a kernel reading its predecessor's output early would
    show)."""
    path = write_tiny_gguf(tmp_path / "llama-q8.gguf", arch="llama", weight_type="Q8_0",
                           n_layers=2, dim=256, ffn=1024, n_heads=4)  # fmt: skip
    prompts = {s: [(5 * s + 7 * i) % 60 + 1 for i in range(9 + s)] for s in range(12)}
    results: dict[tuple[bool, int], Any] = {}
    with load_gguf(path) as model:
        for overlap, split in ((False, 0), (True, 0), (False, 64), (True, 64)):
            backend = make("cuda")
            backend.int8_min_values, backend.overlap_mma = 0, overlap  # type: ignore[attr-defined]
            backend.mma_split_blocks, backend.mma_split_min_k = split, 128  # type: ignore[attr-defined]
            try:
                with ModelRunner(backend, model, max_slots=12, max_model_len=64,
                                 graphs=True) as r:  # fmt: skip
                    results[overlap, split] = greedy(r, prompts, 10)
            finally:
                backend.close()
    assert results[True, 0] == results[False, 0]
    assert results[True, 64] == results[False, 64]


def _graph_script(runner: ModelRunner) -> list[dict[int, int]]:
    """Batches of 3, 2 (a gap in the previous step's rows) and 1; slot 1 samples with
    temperature; slot 0 decodes past the vmm cache's first 2 MiB chunk (64 positions)."""
    prompts = {0: [3, 17, 42, 5, 9, 60, 1, 33, 21] * 6, 1: [8, 2, 50], 2: [5, 5, 5, 5]}
    outs = [
        runner.execute(
            [SeqChunk(slot=s, start_pos=0, token_ids=p) for s, p in prompts.items()]
        ).get_output()
    ]
    pos = {s: len(p) for s, p in prompts.items()}
    counter = 0
    for slots in ([0, 1, 2], [0, 2], [0]):
        for _ in range(8):
            counter += 1
            chunks = [
                SeqChunk(slot=s, start_pos=pos[s], token_ids=None, from_previous=True)
                if s != 1
                else SeqChunk(
                    slot=1,
                    start_pos=pos[1],
                    token_ids=None,
                    from_previous=True,
                    temperature=0.9,
                    top_k=8,
                    seed=5,
                    counter=counter,
                )  # fmt: skip
                for s in slots
            ]
            outs.append(runner.execute(chunks).get_output())
            for s in slots:
                pos[s] += 1
    return outs


def test_graph_replay_gives_the_ids_of_eager_steps(tiny: Any) -> None:
    results, stats = {}, {}
    for graphs in (False, True):
        backend = make("cuda")
        try:
            with ModelRunner(
                backend, tiny, max_slots=64, max_model_len=256, kv_cache="vmm", graphs=graphs
            ) as r:
                assert r.graphs is graphs, r.graphs_reason
                results[graphs] = _graph_script(r)
                assert r.kv.stats().segments >= 2  # type: ignore[union-attr]
                stats[graphs] = r.graph_stats
        finally:
            backend.close()
    print(f"graph stats on cuda: {stats[True]}")
    assert results[True] == results[False]
    assert stats[True]["captures"] == 3 and stats[True]["replays"] == 3 * (8 - 1)
    assert stats[False]["replays"] == 0


def _prefill_script(r: ModelRunner) -> list[dict[int, int]]:
    """Prompts sharing token buckets on the cuBLAS path (90, 95 -> 96 rows) and the tiled
    one (19, 20 -> 20), mixed steps (a decode row beside a prompt: 71, 72 -> 72), and a
    prompt ending at max_model_len beside another (133 -> 144 rows, padded in the other's
    slot), each followed by decode steps."""
    long = [(7 * i + 3) % 60 + 1 for i in range(256)]
    outs: list[dict[int, int]] = []
    for length in (90, 95, 90, 19, 20, 19):
        r.free_slot(0)
        outs.append(r.execute([SeqChunk(0, 0, long[:length])]).get_output())
        for j in range(3):
            chunk = SeqChunk(0, length + j, None, from_previous=True)
            outs.append(r.execute([chunk]).get_output())
    pos = 22
    for length in (70, 71, 70):
        r.free_slot(1)
        step = [SeqChunk(0, pos, None, from_previous=True), SeqChunk(1, 0, long[5 : 5 + length])]
        outs.append(r.execute(step).get_output())
        pos += 1
    r.free_slot(1)
    step = [SeqChunk(1, 0, long[:5]), SeqChunk(2, 0, long[:128])]
    outs.append(r.execute(step).get_output())
    for j in range(4):
        outs.append(r.execute([SeqChunk(1, 5 + j, None, from_previous=True)]).get_output())
    return outs


@pytest.mark.parametrize("wtype", ["Q8_0", "Q4_K"])
def test_prefill_graph_replay_gives_cpus_ids(tmp_path: Path, wtype: str) -> None:
    """Prefill and mixed steps padded to token buckets and replayed on cuda: cpu's ids."""
    kw: dict[str, Any] = {"dim": 256, "ffn": 512, "n_heads": 4} if wtype.endswith("_K") else {}
    path = write_tiny_gguf(tmp_path / f"llama-{wtype}.gguf", arch="llama", weight_type=wtype,
                           n_layers=2, **kw)  # fmt: skip
    results, stats = {}, {}
    with load_gguf(path) as model:
        for name in ("cpu", "cuda/eager", "cuda/prefill-graphs"):
            backend = make(name.split("/")[0])
            on = name == "cuda/prefill-graphs"
            try:
                with ModelRunner(backend, model, max_slots=3, max_model_len=128, graphs=on,
                                 prefill_graphs=on) as r:  # fmt: skip
                    assert r.prefill_graphs is on, r.prefill_graphs_reason
                    results[name] = _prefill_script(r)
                    stats[name] = r.graph_stats
            finally:
                backend.close()
    print(f"prefill graph stats on cuda ({wtype}): {stats['cuda/prefill-graphs']}")
    for name, ids in results.items():
        assert ids == results["cpu"], name
    got = stats["cuda/prefill-graphs"]
    # (96, 1), (20, 1) and (72, 2): eager, captured and replayed, replayed; (144, 2) eager;
    # decode (1, 1): eager once, then 21 replays
    assert got["captures"] == 4 and got["replays"] == 27, got


# --------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("vocab", [49152, 128256, 151936])
def test_logprobs_op_equals_the_reference_on_real_vocabularies(cuda: Any, vocab: int) -> None:
    """The logprobs kernel against vt.reference.sampling.logprobs_op: ids exact (ties at
    the top and across the 20th place, masked logits, a failed draw), values in float64."""
    from vt.reference.sampling import logprobs_op

    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((6, vocab)) * 4.0).astype(np.float32)
    logits[1, ::7] = -np.inf
    logits[2, [9, 4, vocab - 1, 100]] = logits[2].max() + 1.0  # ties at the top
    logits[3, rng.choice(vocab, 30, replace=False)] = 30.0  # 30 equal: the 20 lowest ids
    ids = rng.integers(0, vocab, 6).astype(np.int32)
    ids[4] = -1  # a failed draw: chosen is NaN
    rows = np.array([5, 0, 3, 2, 4, 1], dtype=np.int32)
    m, k = len(rows), 20
    want = {"chosen": np.zeros(m, np.float32), "top_ids": np.zeros((m, k), np.int32),
            "top_logprobs": np.zeros((m, k), np.float32)}  # fmt: skip
    logprobs_op({**want, "logits": logits, "ids": ids, "rows": rows})
    io = IO(cuda)
    try:
        chosen, top_ids, top_lp = io.empty(m * 4), io.empty(m * k * 4), io.empty(m * k * 4)
        stream = cuda.create_stream()
        cuda.launch(
            "logprobs", stream, chosen=f32(chosen, m), top_ids=i32(top_ids, m, k),
            top_logprobs=f32(top_lp, m, k), logits=f32(io.put(logits), *logits.shape),
            ids=i32(io.put(ids), 6), rows=i32(io.put(rows), m),
        )  # fmt: skip
        cuda.synchronize(stream)
        got_c = io.get(chosen, np.float32, (m,))
        assert np.array_equal(np.isnan(got_c), np.isnan(want["chosen"]))
        tol = kernel_tolerance("logprobs", "F32")
        fin = np.isfinite(want["chosen"])  # a chosen id on a masked logit is -inf on both
        assert np.array_equal(got_c[~fin], want["chosen"][~fin], equal_nan=True)
        assert nmse(got_c[fin], want["chosen"][fin]) <= tol
        assert io.get(top_ids, np.int32, (m, k)).tolist() == want["top_ids"].tolist()
        assert nmse(io.get(top_lp, np.float32, (m, k)), want["top_logprobs"]) <= tol
    finally:
        io.close()


def test_runner_logprobs_on_the_device_equal_cpu(tiny: Any) -> None:
    """Greedy decode asking for 5 alternatives on every row: cuda (the op, async readback,
    graphs) against cpu; only m * (1 + 2k) values per step come back, never logits."""
    prompts = {0: [3, 17, 42, 5, 9], 1: [8, 2, 50]}
    results = {}
    for name in ("cpu", "cuda"):
        backend = make(name)
        try:
            with ModelRunner(backend, tiny, max_slots=2, max_model_len=64) as r:
                r.enable_logprobs(5)
                assert r.logprobs_on_device
                out = r.execute(
                    [SeqChunk(slot=s, start_pos=0, token_ids=p, logprobs=5)
                     for s, p in prompts.items()]
                )  # fmt: skip
                steps = [(out.get_output(), out.get_logprobs())]
                pos = {s: len(p) for s, p in prompts.items()}
                for _ in range(8):
                    out = r.execute(
                        [SeqChunk(slot=s, start_pos=pos[s], token_ids=None, from_previous=True,
                                  logprobs=5) for s in prompts]
                    )  # fmt: skip
                    steps.append((out.get_output(), out.get_logprobs()))
                    pos = {s: p + 1 for s, p in pos.items()}
                if name == "cuda":
                    assert r.readback == "async_d2h" and r.graph_stats["replays"] > 0
                    assert r._pool.lp_bytes_read == 9 * 4 * 2 * (1 + 2 * 5)
                results[name] = steps
        finally:
            backend.close()
    for (ids_c, lp_c), (ids_g, lp_g) in zip(results["cpu"], results["cuda"], strict=True):
        assert ids_g == ids_c
        for s, (chosen, top) in lp_g.items():
            assert top[0][0] == ids_g[s]  # greedy: the sampled id is the most likely
            assert chosen == pytest.approx(lp_c[s][0], abs=1e-4)
            assert [v for _, v in top] == pytest.approx([v for _, v in lp_c[s][1]], abs=1e-4)


@pytest.mark.parametrize("kv", ["vmm", "contiguous"])
def test_prefix_caching_reuses_and_copies_kv_on_the_device(tmp_path: Path, kv: str) -> None:
    """The engine's prefix caching on cuda (graphs, async readback): a prompt sharing a
    short prefix with a slot that holds more gets that prefix copied into another slot
    (``ModelRunner.copy_prefix``, copy_d2d on the KV cache); a conversation's next turn
    reuses its own slot in place. The ids are cpu's without prefix caching."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="llama", weight_type="Q8_0",
                           n_layers=2, tied=False)  # fmt: skip
    params = vt.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = [3, 17, 42, 5, 9, 60, 1, 33, 21] * 2

    def conversation(backend: str, caching: bool) -> list[tuple[list[int], int]]:
        with vt.LLM(model=path, backend=backend, max_slots=3, max_model_len=128,
                    kv_cache=kv if backend == "cuda" else "auto", prefix_caching=caching,
                    verify=False) as llm:  # fmt: skip
            out_a = llm.generate({"prompt_token_ids": a}, params)[0]
            b = a[:6] + [8, 2, 50]
            out_b = llm.generate({"prompt_token_ids": b}, params)[0]
            c = a + out_a.ids + [7]
            out_c = llm.generate({"prompt_token_ids": c}, params)[0]
            d = b + out_b.ids + [11]
            out_d = llm.generate({"prompt_token_ids": d}, params)[0]
            return [(o.ids, o.num_cached_tokens) for o in (out_a, out_b, out_c, out_d)]

    want = conversation("cpu", False)
    got = conversation("cuda", True)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert [n for _, n in got] == [0, 6, len(a) + 7, 9 + 7]
