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
from vt_cpu.kernels import q8

F32 = np.dtype(np.float32)
KINDS = ("Q8_0", "Q4_0", "Q4_1")


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
    w, ref = weight(kind, 37, 160, seed=1)  # 37 rows: a group of four with one row
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


def test_activations_round_to_blocks_of_32_with_their_sums() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 96)).astype(np.float32)
    x[1, 32:64] = 0.0
    for dtype, qmax in ((np.int8, 127), (np.int16, 32767)):
        xq = np.empty((2, 96), dtype)
        xd = np.empty((2, 3), np.float32)
        xi = np.empty((2, 3), np.int32)
        q8.quantize_rows(x, xq, xd, xi, False)
        blocks = x.reshape(2, 3, 32)
        amax = np.abs(blocks).max(axis=-1)
        assert np.allclose(xd, amax / qmax, rtol=1e-6)
        inv = np.where(amax > 0, np.float32(qmax) / np.where(amax > 0, amax, 1), 0)
        want = np.rint(blocks * inv[..., None].astype(np.float32)).astype(np.int64)
        assert np.abs(xq.reshape(2, 3, 32) - want).max() <= 1  # float32 rounding of x / d
        assert np.array_equal(xi, xq.reshape(2, 3, 32).astype(np.int64).sum(-1))
        assert xd[1, 1] == 0 and not xq[1, 32:64].any()
        # the nibble formats' order: element j at 2j, element 16 + j at 2j + 1
        pairs = np.empty_like(xq)
        q8.quantize_rows(x, pairs, xd, xi, True)
        p = pairs.reshape(2, 3, 16, 2)
        assert np.array_equal(p[..., 0], xq.reshape(2, 3, 32)[..., :16])
        assert np.array_equal(p[..., 1], xq.reshape(2, 3, 32)[..., 16:])


@pytest.mark.parametrize("bits", [8, 16])
def test_the_portable_ir_computes_what_vnni_computes(monkeypatch: pytest.MonkeyPatch,
                                                     bits: int) -> None:  # fmt: skip
    """Without VNNI the kernels multiply widened vectors: the same int32 sums."""
    kernels = {}
    for vnni in (True, False):
        monkeypatch.setattr(q8, "VNNI", vnni)
        d0, d1, d2 = (q8._block_rows(k, 4, bits) for k in KINDS)

        def run(fmt_id, raw, starts, xq, xd, xi, nb, d0=d0, d1=d1, d2=d2):  # noqa: ANN001, ANN202
            if fmt_id == 0:
                return d0(raw, starts, xq, xd, xi, nb)
            if fmt_id == 1:
                return d1(raw, starts, xq, xd, xi, nb)
            return d2(raw, starts, xq, xd, xi, nb)

        kernels[vnni] = numba.njit(run)  # compiled now, with this VNNI; not cached
        for fid, kind in enumerate(KINDS):
            w, _ = weight(kind, 8, 128, seed=4)
            x = np.random.default_rng(5).standard_normal((1, 128)).astype(np.float32)
            xq = np.empty((1, 128), np.int8 if bits == 8 else np.int16)
            xd, xi = np.empty((1, 4), np.float32), np.empty((1, 4), np.int32)
            q8.quantize_rows(x, xq, xd, xi, kind != "Q8_0")
            starts = np.array([0, 4, 8, 28], np.int64)
            got = kernels[vnni](fid, w.arrays[-1], starts, xq[0], xd[0], xi[0], 4)
            kernels[(vnni, kind)] = got
    for kind in KINDS:
        assert kernels[(True, kind)] == kernels[(False, kind)], kind


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
    real = q8.bind

    def spy(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[-1])
        return real(*args, **kw)

    monkeypatch.setattr(q8, "bind", spy)
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
