"""The cpu backend's integer decode kernels (vt_cpu.kernels.q8) against vt.reference.

Activations quantized to 8 bits (llama.cpp's numerics) or 16 bits, multiplied with the
weight blocks as they are in the file: within the conformance kit's matmul bound for
quantized types (8-bit activation quantization allowed), and the 16-bit path within a
bound a thousand times tighter. The IR without VNNI (any CPU LLVM targets) computes the
same integers, so the same results, as the VNNI one.
"""

from __future__ import annotations

from collections.abc import Iterator

import numba
import numpy as np
import pytest
import vt
from gguf import GGMLQuantizationType
from vt.testing.tiny import quantize_matrix
from vt.testing.tolerances import kernel_tolerance, nmse
from vt_cpu import CpuBackend, weights
from vt_cpu import ops as cpu_ops
from vt_cpu.kernels import jobs, q8

F32 = np.dtype(np.float32)
KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def cols_for(kind: str, blocks: int) -> int:
    """Columns of ``blocks`` weight blocks (256 values for the K-quants, else 32)."""
    return blocks * (256 if kind.endswith("_K") else 32)


def weight(
    kind: str, rows: int, cols: int, seed: int = 0
) -> tuple[weights.BlockWeight, np.ndarray]:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    data = quantize_matrix(values, qtype).view(np.uint8).reshape(-1)
    t = vt.WeightTensor(f"w.{kind}", int(qtype), (rows, cols), data)
    w = weights.upload(t)
    assert isinstance(w, weights.BlockWeight)
    return w, vt.reference.dequantize(t)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("n", [1, 3])
def test_integer_matvec_matches_the_reference(kind: str, bits: int, n: int) -> None:
    w, ref = weight(kind, 37, cols_for(kind, 5), seed=1)  # 37 rows: groups of 4 and one
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n, w.cols)).astype(np.float32)
    x[0, :32] = 0.0  # a block of zeros: scale 0, no division by it
    x[-1, 32:64] *= 1e4  # blocks of very different magnitudes
    res = rng.standard_normal((n, w.rows)).astype(np.float32)
    want = x.astype(np.float64) @ ref.T.astype(np.float64)
    bound = kernel_tolerance("matmul", kind) if bits == 8 else 1e-6
    for nchunk in (1, 2, 5):
        for residual in (False, True):
            out = res.copy() if residual else np.full((n, w.rows), np.nan, np.float32)
            serial, parallel = q8.bind(w, x, out, out if residual else None, bits)
            serial() if nchunk == 1 else parallel(nchunk)
            expect = want + res if residual else want
            err = nmse(out, expect)
            assert err <= bound, (kind, bits, n, nchunk, residual, err)


def scratch(n: int, k: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quantize_rows``'s outputs for ``bits`` (16: high and low bytes, two sums)."""
    if bits == 8:
        return (
            np.empty((n, k), np.int8),
            np.empty((n, k // 32), F32),
            np.empty((n, k // 32), np.int32),
        )
    return (
        np.empty((n, 2 * k), np.uint8),
        np.empty((n, k // 32), F32),
        np.empty((n, k // 16), np.int32),
    )


def quants(xq: np.ndarray, xi: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The integer values ``[n, nb, 32]`` and their block sums ``[n, nb]`` of a quantized row
    (16 bits: ``256 * high + low``, and checks the sums of the high bytes)."""
    n = xq.shape[0]
    if bits == 8:
        return xq.reshape(n, -1, 32).astype(np.int64), xi.astype(np.int64)
    b = xq.reshape(n, -1, 2, 32)
    high, low = b[:, :, 0].view(np.int8).astype(np.int64), b[:, :, 1].astype(np.int64)
    assert np.array_equal(xi[:, 1::2], high.sum(-1))
    return 256 * high + low, xi[:, 0::2].astype(np.int64)


@pytest.mark.parametrize("bits", [8, 16])
def test_activations_round_to_blocks_of_32_with_their_sums(bits: int) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 96)).astype(np.float32)
    x[1, 32:64] = 0.0
    qmax = 127 if bits == 8 else 32767
    xq, xd, xi = scratch(2, 96, bits)
    q8.quantize_rows(x, xq, xd, xi, False)
    q, sums = quants(xq, xi, bits)
    blocks = x.reshape(2, 3, 32)
    amax = np.abs(blocks).max(axis=-1)
    assert np.allclose(xd, amax / qmax, rtol=1e-6)
    inv = np.where(amax > 0, np.float32(qmax) / np.where(amax > 0, amax, 1), 0)
    want = np.rint(blocks * inv[..., None].astype(np.float32)).astype(np.int64)
    assert np.abs(q - want).max() <= 1  # float32 rounding of x / d
    assert np.abs(q).max() <= qmax
    assert np.array_equal(sums, q.sum(-1))
    assert xd[1, 1] == 0 and not q[1, 1].any()
    # the nibble formats' order: element j at 2j, element 16 + j at 2j + 1
    pairs, _, _ = scratch(2, 96, bits)
    q8.quantize_rows(x, pairs, xd, xi, True)
    p = quants(pairs, xi, bits)[0].reshape(2, 3, 16, 2)
    assert np.array_equal(p[..., 0], q[..., :16])
    assert np.array_equal(p[..., 1], q[..., 16:])


@pytest.mark.parametrize("bits", [8, 16])
def test_the_portable_ir_computes_what_vnni_computes(monkeypatch: pytest.MonkeyPatch,
                                                     bits: int) -> None:  # fmt: skip
    """Without VNNI the kernels multiply widened vectors: the same int32 sums."""
    if not q8.VNNI:
        pytest.skip(
            "this CPU has no VNNI: nothing to compare the portable IR with (the kernels run "
            "the portable IR here, checked against vt.reference by the other tests)"
        )
    kernels = {}
    for vnni in (True, False):
        monkeypatch.setattr(q8, "VNNI", vnni)
        d0, d1, d2 = (q8._block_rows(k, 4, bits) for k in KINDS[:3])
        d3, d4, d5 = (q8._block_rows_k(k, 4, bits) for k in KINDS[3:])  # per 256 values

        def run(fmt_id, raw, starts, xq, xd, xi, nb, d0=d0, d1=d1, d2=d2, d3=d3, d4=d4, d5=d5):  # noqa: ANN001, ANN202
            if fmt_id == 0:
                return d0(raw, starts, xq, xd, xi, nb)
            if fmt_id == 1:
                return d1(raw, starts, xq, xd, xi, nb)
            if fmt_id == 2:
                return d2(raw, starts, xq, xd, xi, nb)
            if fmt_id == 3:
                return d3(raw, starts, xq, xd, xi, nb)
            if fmt_id == 4:
                return d4(raw, starts, xq, xd, xi, nb)
            return d5(raw, starts, xq, xd, xi, nb)

        kernels[vnni] = numba.njit(run)  # compiled now, with this VNNI; not cached
        for fid, kind in enumerate(KINDS):
            cols = cols_for(kind, 4)
            w, _ = weight(kind, 8, cols, seed=4)
            x = np.random.default_rng(5).standard_normal((1, cols)).astype(np.float32)
            if kind.endswith("_K"):
                xq, xd, xi = q8.scratch(1, cols, bits, True)
                q8.quantize_rows_k(x, xq, xd, xi)
            else:
                xq, xd, xi = scratch(1, cols, bits)
                q8.quantize_rows(x, xq, xd, xi, kind in ("Q4_0", "Q4_1"))
            starts = np.array([0, 4, 8, 28], np.int64)
            raw = w.arrays[0] if kind == "Q6_K" else w.arrays[-1]  # the uint8 blocks
            got = kernels[vnni](fid, raw, starts, xq[0], xd[0], xi[0], 4)
            kernels[(vnni, kind)] = got
    for kind in KINDS:
        assert kernels[(True, kind)] == kernels[(False, kind)], kind


@pytest.mark.parametrize("native", [True, False])
def test_float16_scales_convert_exactly_with_or_without_f16c(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """Every float16 bit pattern, as LLVM ``half`` (F16C) or by the integer conversion the
    kernels use on an x86 target without F16C (LLVM would call ``__extendhfsf2``)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    if native and not q8.NATIVE_F16:
        pytest.skip(
            "this CPU has no F16C: LLVM would convert float16 by a library call, so only the "
            "integer conversion the kernels use here is checked (native=False)"
        )
    monkeypatch.setattr(q8, "NATIVE_F16", native)

    @intrinsic
    def widen(typingctx, arr, i):  # noqa: ANN001, ANN202
        def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            base = builder.bitcast(data, ir.IntType(8).as_pointer())
            return q8._f16(builder, base, builder.mul(args[1], ir.Constant(ir.IntType(64), 2)))

        return types.float32(arr, i), codegen

    @numba.njit
    def convert(bits, out):  # noqa: ANN001, ANN202
        for i in range(bits.shape[0]):
            out[i] = widen(bits, i)

    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.empty(65536, np.float32)
    convert(bits, out)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.fixture
def cpu() -> Iterator[CpuBackend]:
    backend = CpuBackend()
    yield backend
    backend.close()


@pytest.mark.parametrize("setting", [None, "32", "8", "16"])
def test_the_backend_runs_one_row_through_the_integer_kernels_as_set(
    cpu: CpuBackend, monkeypatch: pytest.MonkeyPatch, setting: str | None
) -> None:
    if setting is None:
        monkeypatch.delenv(cpu_ops.ACT_BITS_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_ops.ACT_BITS_ENV, setting)
    calls: list[int] = []
    real, real_job = q8.bind, jobs.q8_job

    def spy(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[-1])
        return real(*args, **kw)

    def spy_job(weight, x, out, res, bits, shared=None):  # noqa: ANN001, ANN202
        calls.append(bits)  # the team's job of the same kernels (vt_cpu.kernels.jobs)
        return real_job(weight, x, out, res, bits, shared)

    monkeypatch.setattr(q8, "bind", spy)
    monkeypatch.setattr(jobs, "q8_job", spy_job)
    default = vt.envs.get(cpu_ops.ACT_BITS_ENV, {})
    expected = int(setting) if setting is not None else default
    rows, cols = 24, 64
    values = np.random.default_rng(6).standard_normal((rows, cols)).astype(np.float32)
    qtype = GGMLQuantizationType.Q4_1
    t = vt.WeightTensor("w", int(qtype), (rows, cols), quantize_matrix(values, qtype).reshape(-1))
    ref = vt.reference.dequantize(t)
    w = cpu.upload_weight(t)
    s = cpu.create_stream("q8")
    for n in (1, 2):
        xb, ob = cpu.alloc(n * cols * 4), cpu.alloc(n * rows * 4)
        x = np.random.default_rng(7).standard_normal((n, cols)).astype(np.float32)
        cpu.copy_h2d(xb, x)
        out, xt = vt.Tensor.of(ob, F32, n, rows), vt.Tensor.of(xb, F32, n, cols)
        cpu.launch("matmul", s, out=out, x=xt, weight=w)
        cpu.synchronize(s)
        got = cpu.host_view(ob).view(np.float32).reshape(n, rows)
        assert nmse(got, x.astype(np.float64) @ ref.T) <= kernel_tolerance("matmul", "Q4_1")
    # only single rows take the integer kernels, and only when set to 8 or 16 bits
    assert calls == ([expected] if expected in (8, 16) else [])


def test_a_bad_setting_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_ops.ACT_BITS_ENV, "12")
    with pytest.raises(vt.envs.EnvError, match="VT_CPU_ACT_BITS=12 is not 8, 16 or 32"):
        cpu_ops.act_bits()


@pytest.mark.slow
@pytest.mark.parametrize("setting", [None, "16"])
def test_default_model_greedy_ids_equal_the_float64_forward(
    monkeypatch: pytest.MonkeyPatch, setting: str | None
) -> None:
    """The product's promise on the oracle fixture's prompts: greedy ids equal an exact
    (float64) forward's argmax at every step, where llama.cpp's part from it at near-ties
    (``benchmarks/greedy_vs_float64.py``: 8-bit activations part too, 16-bit do not)."""
    import functools
    import json
    from pathlib import Path

    import model_support
    from vt.execution.runner import ModelRunner, SeqChunk
    from vt.model import load_gguf
    from vt.model.cache import resolve_model

    if setting is None:
        monkeypatch.delenv(cpu_ops.ACT_BITS_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_ops.ACT_BITS_ENV, setting)
    model = load_gguf(resolve_model("default", progress=False))
    fixture = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp_greedy.json").read_text())
    n = 16  # of the fixture's 32 tokens: the float64 forward is the test's cost
    f64 = functools.lru_cache(maxsize=None)(model_support._f64)
    monkeypatch.setattr(model_support, "_f64", f64)
    with ModelRunner(model_support.make_backend("cpu"), model, max_slots=1, max_model_len=64) as r:
        for rec in fixture["records"]:
            r.free_slot(0)
            prompt = rec["prompt_ids"]
            logits = r.compute_logits([SeqChunk(slot=0, start_pos=0, token_ids=prompt)])[0]
            ids = []
            for j in range(n):
                ids.append(int(np.argmax(logits)))
                if j + 1 < n:
                    step = SeqChunk(slot=0, start_pos=len(prompt) + j, token_ids=[ids[-1]])
                    logits = r.compute_logits([step])[0]
            exact = model_support.numpy_forward(model, prompt + ids[:-1])[len(prompt) - 1 :]
            assert ids == [int(i) for i in np.argmax(exact, axis=-1)], rec["prompt"]
    f64.cache_clear()
