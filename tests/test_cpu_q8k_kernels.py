"""The cpu backend's K-quant decode kernels with activations quantized per 256 values.

``vt_cpu.kernels.q8.quantize_rows_k`` quantizes an activation row per super-block of 256
values (one float32 scale, llama.cpp's ``q8_K``, in 8 or 16 bits) with the sums of each 32
and 16 values' quants; the Q4_K/Q5_K/Q6_K kernels sum a block's sub-block products times
their integer scales in int32 and scale once per block. Checked here: the quantization
bit for bit against numpy, the kernels against a numpy evaluation of the same integer
arithmetic (exactly where float32 holds every partial sum, else to float32 rounding), the
portable IR and the 256-bit one against the kernels' own, and the backend's one-row ops.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import vt
from gguf import GGMLQuantizationType
from vt.testing.tiny import quantize_matrix
from vt.testing.tolerances import kernel_tolerance, nmse
from vt_cpu import CpuBackend, weights
from vt_cpu.kernels import q8

F32 = np.float32
KINDS = ("Q4_K", "Q5_K", "Q6_K")
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


# --------------------------------------------------------------------------- references


def quantize_k_reference(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The quants ``[n, nb, 256]`` (int64) and scales ``[n, nb]`` (float32) of ``x``, in
    float32 as the kernel computes them: ``d = amax / qmax``, ``q = rint(x * (qmax /
    amax))``, ties to even."""
    qmax = F32(127 if bits == 8 else 32767)
    n, k = x.shape
    blocks = x.reshape(n, k // 256, 256)
    amax = np.abs(blocks).max(axis=-1)
    d = amax / qmax
    safe = np.where(amax > 0, amax, F32(1))
    inv = np.where(amax > 0, qmax / safe, F32(0)).astype(F32)
    q = np.rint(blocks * inv[..., None]).astype(np.int64)
    return q, d.astype(F32)


def f16(raw: np.ndarray, offset: int) -> np.ndarray:
    return raw[:, offset : offset + 2].copy().view(np.float16)[:, 0].astype(np.float64)


def decode_blocks(kind: str, raw: np.ndarray) -> dict[str, np.ndarray]:
    """A block format's integers per block: ``codes [nblk, 256]``, ``scales`` per sub-block
    (8 of 32 values; Q6_K: 16 of 16), ``mins`` (Q4_K/Q5_K), and ``d``/``dmin`` as float64;
    the value is ``d sc code - dmin mn`` (Q4_K, Q5_K) or ``d sc (code - 32)`` (Q6_K)."""
    raw = raw.astype(np.int64)
    if kind == "Q6_K":
        ql, qh = raw[:, :128], raw[:, 128:192]
        codes = np.empty((raw.shape[0], 256), np.int64)
        for h in range(2):
            a, b = ql[:, 64 * h : 64 * h + 32], ql[:, 64 * h + 32 : 64 * h + 64]
            q = qh[:, 32 * h : 32 * h + 32]
            codes[:, 128 * h : 128 * h + 32] = (a & 15) | ((q & 3) << 4)
            codes[:, 128 * h + 32 : 128 * h + 64] = (b & 15) | (((q >> 2) & 3) << 4)
            codes[:, 128 * h + 64 : 128 * h + 96] = (a >> 4) | (((q >> 4) & 3) << 4)
            codes[:, 128 * h + 96 : 128 * h + 128] = (b >> 4) | (((q >> 6) & 3) << 4)
        scales = raw[:, 192:208].astype(np.uint8).view(np.int8).astype(np.int64)
        return {"codes": codes, "scales": scales, "d": f16(raw.astype(np.uint8), 208)}
    c = raw[:, 4:16]
    sc = np.empty((raw.shape[0], 8), np.int64)
    mn = np.empty((raw.shape[0], 8), np.int64)
    for s in range(4):
        sc[:, s], mn[:, s] = c[:, s] & 63, c[:, s + 4] & 63
        sc[:, s + 4] = (c[:, s + 8] & 15) | ((c[:, s] >> 6) << 4)
        mn[:, s + 4] = (c[:, s + 8] >> 4) | ((c[:, s + 4] >> 6) << 4)
    qs = raw[:, 48:176] if kind == "Q5_K" else raw[:, 16:144]
    codes = np.empty((raw.shape[0], 256), np.int64)
    for chunk in range(4):
        q = qs[:, 32 * chunk : 32 * chunk + 32]
        codes[:, 64 * chunk : 64 * chunk + 32] = q & 15
        codes[:, 64 * chunk + 32 : 64 * chunk + 64] = q >> 4
    if kind == "Q5_K":
        qh = raw[:, 16:48]
        for s in range(8):
            codes[:, 32 * s : 32 * s + 32] |= ((qh >> s) & 1) << 4
    u8 = raw.astype(np.uint8)
    return {"codes": codes, "scales": sc, "mins": mn, "d": f16(u8, 0), "dmin": f16(u8, 2)}


def integer_products(kind: str, raw: np.ndarray, rows: int, q: np.ndarray,
                     dx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``out[t, r]`` as the kernels compute it, in float64 from exact integer sums per
    block (``d dx I - dmin dx M``), and the sum of the terms' magnitudes (the scale of a
    float32 evaluation's rounding)."""
    blk = decode_blocks(kind, raw)
    n, nb = dx.shape
    codes = blk["codes"].reshape(rows, nb, 256)
    out = np.zeros((n, rows))
    mag = np.zeros((n, rows))
    for t in range(n):
        x = q[t]  # [nb, 256]
        if kind == "Q6_K":
            sc = blk["scales"].reshape(rows, nb, 16)
            prod = ((codes - 32) * x[None]).reshape(rows, nb, 16, 16).sum(-1)  # per 16 values
            i_sum = (prod * sc).sum(-1)
            i_mag = (np.abs((codes - 32) * x[None]).reshape(rows, nb, 16, 16).sum(-1)
                     * np.abs(sc)).sum(-1)  # fmt: skip
            d = blk["d"].reshape(rows, nb)
            out[t] = (d * dx[t] * i_sum).sum(-1)
            mag[t] = (np.abs(d * dx[t]) * i_mag).sum(-1)
            continue
        sc = blk["scales"].reshape(rows, nb, 8)
        mn = blk["mins"].reshape(rows, nb, 8)
        prod = (codes * x[None]).reshape(rows, nb, 8, 32).sum(-1)
        xs = x.reshape(nb, 8, 32).sum(-1)
        i_sum = (prod * sc).sum(-1)
        m_sum = (mn * xs[None]).sum(-1)
        i_mag = ((np.abs(codes * x[None])).reshape(rows, nb, 8, 32).sum(-1) * sc).sum(-1)
        m_mag = (mn * np.abs(x).reshape(nb, 8, 32).sum(-1)[None]).sum(-1)
        d, dmin = blk["d"].reshape(rows, nb), blk["dmin"].reshape(rows, nb)
        out[t] = (d * dx[t] * i_sum - dmin * dx[t] * m_sum).sum(-1)
        mag[t] = (np.abs(d * dx[t]) * i_mag + np.abs(dmin * dx[t]) * m_mag).sum(-1)
    return out, mag


def random_blocks(kind: str, nblocks: int, seed: int, small_scales: bool = False,
                  exact: bool = False) -> np.ndarray:  # fmt: skip
    """Random block bytes; ``exact``: the float16 scales set to 1.0 (``d``, ``dmin``);
    ``small_scales``: sub-block scales and mins small enough that with 8-bit activations
    every partial sum is an integer below 2^24."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (nblocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    if kind == "Q6_K":
        if small_scales:
            raw[:, 192:208] = rng.integers(-15, 16, (nblocks, 16)).astype(np.int8).view(np.uint8)
        if exact:
            raw[:, 208:210] = one
        else:
            raw[:, 208:210] = np.frombuffer(
                rng.uniform(0.001, 0.01, nblocks).astype(np.float16).tobytes(), np.uint8
            ).reshape(nblocks, 2)
        return raw
    if small_scales:  # 6-bit scales and mins below 32 (Q4_K) or 16 (Q5_K): bytes 0..7
        # hold those of sub-blocks 0-3 (bits 0-5) and the top two bits of 4-7 (bits 6-7)
        raw[:, 4:12] &= 0x0F if kind == "Q5_K" else 0x5F
    halves = [one, one] if exact else [
        np.frombuffer(rng.uniform(0.001, 0.01, nblocks).astype(np.float16).tobytes(), np.uint8)
        .reshape(nblocks, 2)
        for _ in range(2)
    ]  # fmt: skip
    raw[:, 0:2], raw[:, 2:4] = halves
    return raw


def run_rows(kind: str, raw: np.ndarray, rows: int, x: np.ndarray, bits: int) -> np.ndarray:
    """``mv1`` of the per-256 kernel over ``rows`` rows of blocks ``raw``."""
    n, k = x.shape
    xq, xd, xi = q8.scratch(n, k, bits, True)
    out = np.full((n, rows), np.nan, F32)
    q8.mv1(q8.FMT_ID[kind], raw, x, xq, xd, xi, out, out, False)
    return out


# --------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("bits", [8, 16])
def test_activations_per_256_equal_numpy_bit_for_bit(bits: int) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 768)).astype(F32)
    x[1, 256:512] = 0.0  # a super-block of zeros: scale 0, quants 0
    x[2, :256] *= 1e4
    x[2, 7] = -np.abs(x[2, :256]).max() * 1.5  # the extreme is negative
    x[0, 300] = np.float32(0.5) * np.abs(x[0, 256:512]).max()  # ties round to even
    xq, xd, xi = q8.scratch(3, 768, bits, True)
    assert xi.shape == (3, 3 * q8.KS)
    q8.quantize_rows_k(x, xq, xd, xi)
    q, d = quantize_k_reference(x, bits)
    assert np.array_equal(xd.view(np.uint32), d.view(np.uint32))
    qmax = 127 if bits == 8 else 32767
    assert np.abs(q).max() <= qmax and not q[1, 1].any() and xd[1, 1] == 0
    if bits == 8:
        assert np.array_equal(xq.astype(np.int64).reshape(3, 3, 256), q)
        part = q
    else:  # per 64 values: their high bytes (signed), then their low bytes (unsigned)
        b = xq.reshape(3, 3, 4, 2, 64)
        high = b[:, :, :, 0].view(np.int8).astype(np.int64).reshape(3, 3, 256)
        low = b[:, :, :, 1].astype(np.int64).reshape(3, 3, 256)
        assert np.array_equal(256 * high + low, q)
        assert np.array_equal(high, q >> 8) and np.array_equal(low, q & 255)
        part = high
    sums = xi.reshape(3, 3, q8.KS).astype(np.int64)
    assert np.array_equal(sums[..., :8], q.reshape(3, 3, 8, 32).sum(-1))
    assert np.array_equal(sums[..., 8:], part.reshape(3, 3, 16, 16).sum(-1))


def test_the_job_quantizes_rows_as_the_function_does() -> None:
    """``quant8``/``quant16`` with layout 2 run :func:`q8.quantize_range_k` (a job's rows)."""
    from vt_cpu.kernels import jobs
    from vt_cpu.kernels import team as K

    x = np.random.default_rng(2).standard_normal((3, 512)).astype(F32)
    for bits in (8, 16):
        want = q8.scratch(3, 512, bits, True)
        q8.quantize_rows_k(x, *want)
        got = tuple(np.zeros_like(a) for a in want)
        job = jobs.quant_job(x, *got, 2)
        K.run_alone(job.address, int(job.args.ctypes.data), 3)
        for a, b in zip(got, want, strict=True):
            assert np.array_equal(a, b)


# --------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("kind", KINDS)
def test_kernels_equal_the_integer_arithmetic_exactly_where_float32_is_exact(kind: str) -> None:
    """Scales 1.0 and 8-bit activations that are integers (``dx = 1``): every partial sum
    is an integer below 2^24, so the kernel's float32 result is the exact integer."""
    rows, nb = 9, 3
    raw = random_blocks(kind, rows * nb, seed=3, small_scales=True, exact=True)
    rng = np.random.default_rng(4)
    x = rng.integers(-127, 128, (2, nb * 256)).astype(F32)
    x[:, ::256] = 127.0  # amax 127 in each super-block: dx = 1, q = x
    out = run_rows(kind, raw, rows, x, 8)
    q, dx = quantize_k_reference(x, 8)
    assert (dx == 1).all() and np.array_equal(q.reshape(2, -1), x.astype(np.int64))
    want, mag = integer_products(kind, raw, rows, q, dx)
    assert mag.max() < 2**24
    assert np.array_equal(out.astype(np.float64), want), (out, want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [8, 16])
def test_kernels_equal_the_integer_arithmetic_to_float32_rounding(kind: str, bits: int) -> None:
    rows, nb = 13, 4
    raw = random_blocks(kind, rows * nb, seed=5)
    x = np.random.default_rng(6).standard_normal((3, nb * 256)).astype(F32)
    x[1, 256:512] = 0.0
    x[2, 512:768] *= 300.0
    out = run_rows(kind, raw, rows, x, bits)
    q, dx = quantize_k_reference(x, bits)
    want, mag = integer_products(kind, raw, rows, q, dx.astype(np.float64))
    err = np.abs(out - want)
    assert (err <= 2.0**-19 * mag).all(), (err / mag).max()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [8, 16])
def test_per_256_kernels_match_the_reference(kind: str, bits: int) -> None:
    """Against ``vt.reference`` (the dequantized weight in float64): the kit's matmul bound
    with 8 bits, a thousand times tighter with 16."""
    rows, cols = 37, 5 * 256
    values = np.random.default_rng(7).standard_normal((rows, cols)).astype(F32)
    qtype = GGMLQuantizationType[kind]
    t = vt.WeightTensor("w", int(qtype), (rows, cols), quantize_matrix(values, qtype).reshape(-1))
    w = weights.upload(t)
    ref = vt.reference.dequantize(t).astype(np.float64)
    x = np.random.default_rng(8).standard_normal((1, cols)).astype(F32)
    out = np.zeros((1, rows), F32)
    serial, parallel = q8.bind(w, x, out, None, bits)
    serial()
    bound = kernel_tolerance("matmul", kind) if bits == 8 else 1e-6
    assert nmse(out, x.astype(np.float64) @ ref.T) <= bound
    again = np.zeros_like(out)
    _, parallel = q8.bind(w, x, again, None, bits)
    parallel(3)
    assert np.allclose(again, out, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bits", [8, 16])
def test_portable_and_256_bit_ir_compute_what_the_kernels_compute(
    monkeypatch: pytest.MonkeyPatch, bits: int
) -> None:
    """Without VNNI the kernels multiply widened vectors, and without 512-bit vectors they
    take one sub-block an instruction: the same int32 sums. With integer data exact in
    float32 (8 bits) every variant's result is the same float; with 16 bits the variants
    of one width agree bit for bit (their float32 lanes are the same)."""
    variants = [(True, True, True), (True, True, False), (False, True, False),
                (True, False, False), (False, False, False)]  # (VNNI, wide, asm)  # fmt: skip
    results: dict = {}
    rows, nb = 8, 2
    for vnni, wide, asm in variants:
        if (vnni and not q8.VNNI) or (wide and not q8.WIDE) or (asm and not q8.ASM):
            continue
        monkeypatch.setattr(q8, "VNNI", vnni)
        monkeypatch.setattr(q8, "ASM", asm)
        for kind in KINDS:
            kern = q8._block_rows_k(kind, 4, bits, wide)

            def run(raw, starts, xq, xd, xi, nb, kern=kern):  # noqa: ANN001, ANN202
                return kern(raw, starts, xq, xd, xi, nb)

            fn = numba.njit(run)  # compiled now, with these settings; not cached
            exact = bits == 8
            raw = random_blocks(kind, rows * nb, seed=9, small_scales=exact, exact=exact)
            rng = np.random.default_rng(10)
            if exact:
                x = rng.integers(-127, 128, (1, nb * 256)).astype(F32)
                x[:, ::256] = 127.0
            else:
                x = rng.standard_normal((1, nb * 256)).astype(F32)
            xq, xd, xi = q8.scratch(1, nb * 256, bits, True)
            q8.quantize_rows_k(x, xq, xd, xi)
            starts = np.array([0, 2, 4, 14], np.int64)  # block indices of 4 rows
            results[(vnni, wide, asm, kind)] = fn(raw, starts, xq[0], xd[0], xi[0], nb)
    for kind in KINDS:
        got = {k[:3]: v for k, v in results.items() if k[3] == kind}
        for key, value in got.items():
            same_width = [v for k, v in got.items() if k[1] == key[1]]
            assert all(v == value for v in same_width), (kind, got)
            if bits == 8:
                assert all(v == value for v in got.values()), (kind, got)


# --------------------------------------------------------------------------- backend


@pytest.fixture
def cpu():  # noqa: ANN201
    backend = CpuBackend()
    yield backend
    backend.close()


@pytest.mark.parametrize("setting", ["8", "16"])
def test_one_row_qkv_of_mixed_formats_quantizes_each_layout_once(
    cpu: CpuBackend, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    """Q (Q4_K) and K (Q6_K) share one per-256 quantization of ``x``, V (Q4_0) its own
    nibble-ordered one; each projection matches the reference."""
    from vt_cpu.kernels import jobs

    monkeypatch.setenv("VT_CPU_ACT_BITS", setting)
    made: list[int] = []
    real = jobs.quant_job

    def spy(x, xq, xd, xi, layout):  # noqa: ANN001, ANN202
        made.append(int(layout))
        return real(x, xq, xd, xi, layout)

    monkeypatch.setattr(jobs, "quant_job", spy)
    cols = 512
    rng = np.random.default_rng(11)
    ws, refs = [], []
    for name, kind, rows in (("q", "Q4_K", 24), ("k", "Q6_K", 8), ("v", "Q4_0", 8)):
        qtype = GGMLQuantizationType[kind]
        values = rng.standard_normal((rows, cols)).astype(F32)
        t = vt.WeightTensor(
            name, int(qtype), (rows, cols), quantize_matrix(values, qtype).reshape(-1)
        )
        ws.append(cpu.upload_weight(t))
        refs.append(vt.reference.dequantize(t).astype(np.float64))
    x = rng.standard_normal((1, cols)).astype(F32)
    s = cpu.create_stream("qkv")
    xb = cpu.alloc(cols * 4)
    cpu.copy_h2d(xb, x)
    outs = [cpu.alloc(r.shape[0] * 4) for r in refs]
    tensors = [vt.Tensor.of(b, F32, 1, r.shape[0]) for b, r in zip(outs, refs, strict=True)]
    cpu.launch("qkv", s, q=tensors[0], k=tensors[1], v=tensors[2],
               x=vt.Tensor.of(xb, F32, 1, cols), wq=ws[0], wk=ws[1], wv=ws[2])  # fmt: skip
    cpu.synchronize(s)
    for b, r, kind in zip(outs, refs, ("Q4_K", "Q6_K", "Q4_0"), strict=True):
        got = cpu.host_view(b).view(np.float32).reshape(1, -1)
        bound = kernel_tolerance("qkv", kind) if setting == "8" else 1e-6
        assert nmse(got, x.astype(np.float64) @ r.T) <= bound, kind
    if cpu.threads.use_team:
        assert sorted(made) == [1, 2]
