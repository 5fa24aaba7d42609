"""The numpy reference kernels against straightforward definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import vt
from gguf import GGMLQuantizationType as T
from gguf import quants
from vt import reference as ref

RNG = np.random.default_rng(1234)


def f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def wt(ggml_type: int, shape: tuple[int, ...], data: bytes | np.ndarray) -> vt.WeightTensor:
    arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    return vt.WeightTensor("blk.0.test", int(ggml_type), shape, arr)


# --------------------------------------------------------------------------- dequantize


def test_dequantize_float_types_round_trip() -> None:
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    assert np.array_equal(ref.dequantize(wt(T.F32, (3, 64), x)), x)
    h = x.astype(np.float16)
    assert np.array_equal(ref.dequantize(wt(T.F16, (3, 64), h)), h.astype(np.float32))
    bf = quants.quantize(x, T.BF16)
    expected = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)  # truncation bound
    assert np.allclose(ref.dequantize(wt(T.BF16, (3, 64), bf)), expected, rtol=1e-2)


def test_dequantize_q8_0_hand_block() -> None:
    qs = np.arange(-16, 16, dtype=np.int8)
    block = f16(0.5) + qs.tobytes()
    assert np.array_equal(ref.dequantize(wt(T.Q8_0, (32,), block)), qs.astype(np.float32) * 0.5)


def test_dequantize_q4_0_and_q4_1_hand_blocks() -> None:
    nib = np.arange(32, dtype=np.uint8) % 16  # element j: low nibble j<16, high nibble j>=16
    packed = (nib[:16] | (nib[16:] << 4)).astype(np.uint8).tobytes()
    got = ref.dequantize(wt(T.Q4_0, (32,), f16(2.0) + packed))
    assert np.array_equal(got, (nib.astype(np.float32) - 8) * 2.0)
    got = ref.dequantize(wt(T.Q4_1, (32,), f16(0.25) + f16(-1.0) + packed))
    assert np.array_equal(got, nib.astype(np.float32) * 0.25 - 1.0)


def _scale_min_k4(j: int, s: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(s[j] & 63), int(s[j + 4] & 63)
    return int((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)), int((s[j + 4] >> 4) | ((s[j] >> 6) << 4))


def _naive_q4_k(block: bytes) -> np.ndarray:
    d, dmin = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    sc = np.frombuffer(block[4:16], dtype=np.uint8)
    q = np.frombuffer(block[16:], dtype=np.uint8)
    y = []
    for j in range(4):
        (s1, m1), (s2, m2) = _scale_min_k4(2 * j, sc), _scale_min_k4(2 * j + 1, sc)
        chunk = q[32 * j : 32 * j + 32]
        y += [d * s1 * (c & 0xF) - dmin * m1 for c in chunk]
        y += [d * s2 * (c >> 4) - dmin * m2 for c in chunk]
    return np.array(y, dtype=np.float32)


def _naive_q5_k(block: bytes) -> np.ndarray:
    d, dmin = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    sc = np.frombuffer(block[4:16], dtype=np.uint8)
    qh = np.frombuffer(block[16:48], dtype=np.uint8)
    ql = np.frombuffer(block[48:], dtype=np.uint8)
    y = []
    for j in range(4):
        (s1, m1), (s2, m2) = _scale_min_k4(2 * j, sc), _scale_min_k4(2 * j + 1, sc)
        u1, u2 = 1 << (2 * j), 2 << (2 * j)
        pairs = list(zip(ql[32 * j : 32 * j + 32], qh, strict=True))
        y += [d * s1 * ((c & 0xF) + (16 if h & u1 else 0)) - dmin * m1 for c, h in pairs]
        y += [d * s2 * ((c >> 4) + (16 if h & u2 else 0)) - dmin * m2 for c, h in pairs]
    return np.array(y, dtype=np.float32)


def _naive_q6_k(block: bytes) -> np.ndarray:
    ql = np.frombuffer(block[:128], dtype=np.uint8).astype(np.int32)
    qh = np.frombuffer(block[128:192], dtype=np.uint8).astype(np.int32)
    sc = np.frombuffer(block[192:208], dtype=np.int8).astype(np.float32)
    d = np.float32(np.frombuffer(block[208:210], dtype=np.float16)[0])
    y = np.zeros(256, dtype=np.float32)
    for half in range(2):
        L, H, S, Y = ql[64 * half :], qh[32 * half :], sc[8 * half :], 128 * half
        for i in range(32):
            s = i // 16
            y[Y + i] = d * S[s] * (((L[i] & 0xF) | ((H[i] & 3) << 4)) - 32)
            y[Y + i + 32] = d * S[s + 2] * (((L[i + 32] & 0xF) | (((H[i] >> 2) & 3) << 4)) - 32)
            y[Y + i + 64] = d * S[s + 4] * (((L[i] >> 4) | (((H[i] >> 4) & 3) << 4)) - 32)
            y[Y + i + 96] = d * S[s + 6] * (((L[i + 32] >> 4) | (((H[i] >> 6) & 3) << 4)) - 32)
    return y


@pytest.mark.parametrize(
    ("qtype", "body", "naive"),
    [(T.Q4_K, 140, _naive_q4_k), (T.Q5_K, 172, _naive_q5_k), (T.Q6_K, 208, _naive_q6_k)],
)
def test_dequantize_k_quants_match_the_block_layout(qtype, body, naive) -> None:
    rows = []
    for _ in range(2):
        rnd = RNG.integers(0, 256, body, dtype=np.uint8).tobytes()
        if qtype == T.Q6_K:
            rows.append(rnd + f16(0.03))
        else:
            rows.append(f16(0.02) + f16(0.01) + rnd)
    got = ref.dequantize(wt(qtype, (2, 256), b"".join(rows)))
    expected = np.stack([naive(r) for r in rows])
    assert np.allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_dequantize_refuses_unsupported_types_by_name() -> None:
    with pytest.raises(vt.ModelError, match=r"'blk\.0\.test'.*Q5_0 is not supported"):
        ref.dequantize(wt(T.Q5_0, (32,), bytes(22)))
    with pytest.raises(vt.ModelError, match="type 99 is not supported"):
        ref.dequantize(wt(99, (32,), bytes(22)))


def test_dequantize_checks_sizes() -> None:
    with pytest.raises(vt.ModelError, match="needs 34 bytes, got 33"):
        ref.dequantize(wt(T.Q8_0, (32,), bytes(33)))
    with pytest.raises(vt.ModelError, match="row length 48 is not a multiple of the Q8_0 block"):
        ref.dequantize(wt(T.Q8_0, (48,), bytes(51)))


# --------------------------------------------------------------------------- elementwise


def test_rms_norm_matmul_embedding_and_elementwise() -> None:
    x = RNG.standard_normal((4, 16)).astype(np.float32)
    w = RNG.standard_normal(16).astype(np.float32)
    expected = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    assert np.allclose(ref.rms_norm(x, w, 1e-5), expected, rtol=1e-5, atol=1e-6)

    m = RNG.standard_normal((8, 16)).astype(np.float32)
    b = RNG.standard_normal(8).astype(np.float32)
    assert np.allclose(ref.matmul(x, m, b), x @ m.T + b, rtol=1e-5, atol=1e-5)
    out = np.empty((4, 8), np.float32)
    assert ref.matmul(x, m, out=out) is out

    ids = np.array([3, 0, 3], dtype=np.int32)
    assert np.array_equal(ref.embedding(m, ids), m[[3, 0, 3]])
    assert np.array_equal(ref.gather_rows(m, np.array([7, 1], np.int32)), m[[7, 1]])
    with pytest.raises(ValueError, match=r"embedding: token id 8 is out of range \[0, 8\)"):
        ref.embedding(m, np.array([8], np.int32))

    g, u = x.reshape(-1) * 30, RNG.standard_normal(64).astype(np.float32)
    expected = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    assert np.allclose(ref.silu_mul(g, u), expected, rtol=1e-5, atol=1e-6)
    alias = u.copy()
    ref.silu_mul(g, alias, out=alias)  # out may alias an input
    assert np.allclose(alias, expected, rtol=1e-5, atol=1e-6)
    a = g.copy()
    ref.add(a, u, out=a)
    assert np.array_equal(a, g + u)


# --------------------------------------------------------------------------- rope


def naive_rope(x: np.ndarray, pos: np.ndarray, n_heads: int, p: vt.RopeParams) -> np.ndarray:
    d = p.head_dim
    out = x.astype(np.float64).reshape(len(pos), n_heads, d).copy()
    src = out.copy()
    for r, position in enumerate(pos):
        for i in range(d // 2):
            freq = p.inv_freq[i] if p.inv_freq else p.base ** (-2 * i / d)
            theta = position / p.linear_factor * freq
            a, b = (2 * i, 2 * i + 1) if p.style == vt.RopeStyle.normal else (i, i + d // 2)
            xa, xb = src[r, :, a], src[r, :, b]
            out[r, :, a] = xa * math.cos(theta) - xb * math.sin(theta)
            out[r, :, b] = xa * math.sin(theta) + xb * math.cos(theta)
    return out.reshape(x.shape)


@pytest.mark.parametrize("style", [vt.RopeStyle.normal, vt.RopeStyle.neox])
def test_rope_styles_match_the_pairwise_rotation(style: vt.RopeStyle) -> None:
    p = vt.RopeParams(head_dim=8, base=100000.0, style=style)
    x = RNG.standard_normal((3, 2 * 8)).astype(np.float32)
    pos = np.array([0, 5, 1000], dtype=np.int32)
    got = ref.rope(x, pos, 2, p)
    assert np.allclose(got, naive_rope(x, pos, 2, p), atol=1e-5)
    assert np.array_equal(got[0], x[0])  # position 0 is the identity
    ref.rope(x, pos, 2, p, out=x)  # in place
    assert np.array_equal(x, got)


def test_rope_normal_and_neox_differ_in_pairing() -> None:
    x = np.zeros((1, 4), np.float32)
    x[0, 1] = 1.0  # pairs with x[0] under normal, with x[3] under neox
    pos = np.array([1], np.int32)
    normal = ref.rope(x, pos, 1, vt.RopeParams(head_dim=4, base=1.0))
    neox = ref.rope(x, pos, 1, vt.RopeParams(head_dim=4, base=1.0, style=vt.RopeStyle.neox))
    assert np.allclose(normal, [[-math.sin(1), math.cos(1), 0, 0]], atol=1e-6)
    assert np.allclose(neox, [[0, math.cos(1), 0, math.sin(1)]], atol=1e-6)


def test_rope_linear_scaling_and_inv_freq_override() -> None:
    x = RNG.standard_normal((2, 8)).astype(np.float32)
    base = vt.RopeParams(head_dim=8, base=10000.0)
    scaled = vt.RopeParams(head_dim=8, base=10000.0, linear_factor=4.0)
    pos = np.array([3, 40], np.int32)
    assert np.allclose(ref.rope(x, pos * 4, 1, scaled), ref.rope(x, pos, 1, base), atol=1e-5)
    inv = tuple(0.5**i for i in range(4))
    custom = vt.RopeParams(head_dim=8, inv_freq=inv)
    assert np.allclose(ref.rope(x, pos, 1, custom), naive_rope(x, pos, 1, custom), atol=1e-5)


def test_rope_rejects_bad_params() -> None:
    x = np.zeros((1, 8), np.float32)
    pos = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="inv_freq has 2 entries, head_dim 8 needs 4"):
        ref.rope(x, pos, 1, vt.RopeParams(head_dim=8, inv_freq=(1.0, 2.0)))
    with pytest.raises(ValueError, match="head_dim must be a positive even number, got 7"):
        ref.rope(np.zeros((1, 7), np.float32), pos, 1, vt.RopeParams(head_dim=7))
    with pytest.raises(ValueError, match="expected n=1 x n_heads=2 x head_dim=8"):
        ref.rope(x, pos, 2, vt.RopeParams(head_dim=8))


# --------------------------------------------------------------------------- attention


def naive_attention(q, cache, slots, positions, layer, n_heads, scale) -> np.ndarray:
    n_kv, hd = cache.shape[4], cache.shape[5]
    q3 = q.reshape(len(slots), n_heads, hd).astype(np.float64)
    out = np.zeros_like(q3)
    for i, (slot, pos) in enumerate(zip(slots, positions, strict=True)):
        for h in range(n_heads):
            kvh = h // (n_heads // n_kv)
            k = cache[: pos + 1, slot, layer, 0, kvh].astype(np.float64)
            v = cache[: pos + 1, slot, layer, 1, kvh].astype(np.float64)
            s = k @ q3[i, h] * scale
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v
    return out.reshape(q.shape)


def test_kv_store_and_attention_with_gqa_and_several_slots() -> None:
    layout = vt.KVLayout(n_layers=2, n_slots=3, max_len=16, n_kv_heads=2, head_dim=8)
    cache = np.full(layout.shape, np.nan, dtype=np.float32)  # unwritten positions poison
    n_heads, kvd = 6, 2 * 8
    # A prefill of 5 rows in slot 2 and 3 rows in slot 0, interleaved, on layer 1.
    slots = np.array([2, 0, 2, 2, 0, 2, 0, 2], np.int32)
    positions = np.array([0, 0, 1, 2, 1, 3, 2, 4], np.int32)
    k = RNG.standard_normal((8, kvd)).astype(np.float32)
    v = RNG.standard_normal((8, kvd)).astype(np.float32)
    ref.kv_store(cache, 1, k, v, slots, positions)
    assert np.array_equal(cache[3, 2, 1, 0].reshape(-1), k[5])
    assert np.array_equal(cache[2, 0, 1, 1].reshape(-1), v[6])
    q = RNG.standard_normal((8, n_heads * 8)).astype(np.float32)
    got = ref.attention(q, cache, layout, 1, slots, positions, n_heads, 0.3)
    expected = naive_attention(q, cache, slots, positions, 1, n_heads, 0.3)
    assert np.allclose(got, expected, rtol=1e-4, atol=1e-5)
    # A decode row per slot after the prefill, with out= preallocated.
    out = np.empty((2, n_heads * 8), np.float32)
    s2, p2 = np.array([0, 2], np.int32), np.array([2, 4], np.int32)
    ref.attention(q[:2], cache, layout, 1, s2, p2, n_heads, 0.3, out=out)
    assert np.allclose(out, naive_attention(q[:2], cache, s2, p2, 1, n_heads, 0.3), atol=1e-5)


def test_attention_and_kv_store_reject_bad_arguments() -> None:
    layout = vt.KVLayout(n_layers=1, n_slots=2, max_len=4, n_kv_heads=2, head_dim=4)
    cache = np.zeros(layout.shape, np.float32)
    q = np.zeros((1, 3 * 4), np.float32)
    one = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="n_heads 3 is not a multiple of n_kv_heads 2"):
        ref.attention(q, cache, layout, 0, one, one, 3, 1.0)
    q = np.zeros((1, 4 * 4), np.float32)
    with pytest.raises(ValueError, match=r"attention: position 4 is out of range \[0, 4\)"):
        ref.attention(q, cache, layout, 0, one, one + 4, 4, 1.0)
    with pytest.raises(ValueError, match=r"attention: slot 2 is out of range \[0, 2\)"):
        ref.attention(q, cache, layout, 0, one + 2, one, 4, 1.0)
    with pytest.raises(ValueError, match=r"layer 1 is out of range \[0, 1\)"):
        ref.attention(q, cache, layout, 1, one, one, 4, 1.0)
    kv = np.zeros((1, 8), np.float32)
    with pytest.raises(ValueError, match=r"kv_store: position -1 is out of range"):
        ref.kv_store(cache, 0, kv, kv, one, one - 1)


# --------------------------------------------------------------------------- sampling


def params(n: int = 1, temperature=1.0, top_p=1.0, top_k=0, seed=0, counter=0) -> np.ndarray:
    p = np.zeros(n, dtype=vt.SAMPLE_PARAMS_DTYPE)
    p["temperature"], p["top_p"], p["top_k"] = temperature, top_p, top_k
    p["seed"], p["counter"] = seed, counter
    return p


def draws(logits: np.ndarray, count: int, **kw) -> np.ndarray:
    """``count`` draws for one row of logits, one per counter value."""
    rows = np.repeat(logits[None, :].astype(np.float32), count, axis=0)
    p = params(count, **kw)
    p["counter"] = np.arange(count)
    return ref.sample(rows, p)


def test_uniform_is_splitmix64_top_24_bits() -> None:
    assert ref.splitmix64(0) == 0xE220A8397B1DCDAF  # SplitMix64's first output from seed 0
    assert ref.uniform(0, 0) == 0xE220A8 / 2**24
    assert ref.uniform(7, 3) == (ref.splitmix64((7 << 32) | 3) >> 40) / 2**24
    us = [ref.uniform(42, c) for c in range(2000)]
    assert 0 <= min(us) and max(us) < 1 and abs(np.mean(us) - 0.5) < 0.03
    with pytest.raises(ValueError, match="must be uint32"):
        ref.uniform(2**32, 0)


def test_greedy_takes_the_lowest_index_on_ties() -> None:
    logits = np.array([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]], np.float32)
    assert ref.sample(logits, params(2, temperature=0.0)).tolist() == [1, 0]
    assert ref.sample(logits, params(2, temperature=-1.0, seed=9)).tolist() == [1, 0]
    assert ref.sample(logits, params(2, temperature=0.7, top_k=1)).tolist() == [1, 0]


def test_sampling_is_deterministic_and_follows_the_distribution() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    a = draws(logits, 4000, seed=5)
    assert np.array_equal(a, draws(logits, 4000, seed=5))
    assert not np.array_equal(a, draws(logits, 4000, seed=6))
    freq = np.bincount(a, minlength=4) / 4000
    assert np.allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    # The draw is the inverse CDF of u over the candidates sorted by probability.
    u = ref.uniform(5, 17)
    expected = int(np.searchsorted(np.cumsum([0.5, 0.3, 0.15, 0.05]), u, side="right"))
    assert a[17] == expected
    # Temperature flattens: at T=100 every token is nearly equally likely.
    freq = np.bincount(draws(logits, 4000, temperature=100.0), minlength=4) / 4000
    assert np.allclose(freq, 0.25, atol=0.04)


def test_top_k_and_top_p_truncate() -> None:
    logits = np.log(np.array([0.1, 0.5, 0.3, 0.1], np.float32))
    assert set(draws(logits, 500, top_k=2).tolist()) == {1, 2}
    assert set(draws(logits, 500, top_p=0.75).tolist()) == {1, 2}  # 0.5 + 0.3 >= 0.75
    assert set(draws(logits, 500, top_p=0.45).tolist()) == {1}
    assert set(draws(logits, 500, top_p=1.0).tolist()) == {0, 1, 2, 3}
    # Ties at the top-k boundary keep the lowest ids: 0.1 at ids 0 and 3 -> id 0.
    assert set(draws(logits, 2000, top_k=3).tolist()) == {0, 1, 2}
    # top_k >= vocab or <= 0 is no top-k.
    assert set(draws(logits, 2000, top_k=10).tolist()) == {0, 1, 2, 3}
    assert set(draws(logits, 2000, top_k=-1).tolist()) == {0, 1, 2, 3}


def test_masked_logits_are_never_drawn() -> None:
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0, -np.inf], np.float32)
    assert set(draws(logits, 500).tolist()) == {1, 3}
    out = draws(np.array([-np.inf, 0.0], np.float32), 200, temperature=1e-3)
    assert set(out.tolist()) == {1}


def test_sample_rejects_bad_inputs() -> None:
    logits = np.zeros((1, 4), np.float32)
    with pytest.raises(ValueError, match="top_p must be in"):
        ref.sample(logits, params(top_p=0.0))
    with pytest.raises(ValueError, match="temperature is NaN"):
        ref.sample(logits, params(temperature=float("nan")))
    with pytest.raises(ValueError, match="2 parameter rows for 1 rows"):
        ref.sample(logits, params(2))
    with pytest.raises(ValueError, match="SAMPLE_PARAMS_DTYPE"):
        ref.sample(logits, np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="row 0: logits contain NaN"):
        ref.sample(np.full((1, 4), np.nan, np.float32), params())
    with pytest.raises(ValueError, match="every logit is -inf"):
        ref.sample(np.full((1, 4), -np.inf, np.float32), params())
    with pytest.raises(ValueError, match=r"logits must be \[n, vocab\]"):
        ref.sample(np.zeros(4, np.float32), params())
