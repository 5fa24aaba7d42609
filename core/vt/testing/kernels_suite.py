"""Kernel cases: every kernel of ``vt.MODEL_KERNELS`` against ``vt.reference``.

Shapes follow what the llama-family model does, plus the edges where off-by-one bugs
live: odd sizes, a single row, batches of several rows over several KV slots, the first
and the last cache position, every weight type for ``upload_weight``/``embedding``/
``matmul``. Inputs are seeded, so a failure reproduces.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from .. import reference as R
from ..backend import SAMPLE_PARAMS_DTYPE, KVLayout, RopeParams, RopeStyle, Weight, WeightTensor
from .guarded import POISON, CaseBuffers, compare
from .kit import KitCase, KitContext, KitFailure
from .tiny import quantize_matrix
from .tolerances import WEIGHT_TYPES

F32, I32 = np.float32, np.int32


def _rng(*key: Any) -> np.random.Generator:
    # crc32, not hash(): string hashes change per process, and failures must reproduce.
    return np.random.default_rng(zlib.crc32(repr(("vt-kit", *key)).encode()))


def _normal(shape: tuple[int, ...], *key: Any, scale: float = 1.0) -> np.ndarray:
    return (_rng(*key).standard_normal(shape) * scale).astype(F32)


def in_features(wtype: str) -> int:
    """A row length valid for ``wtype``: odd for float types, 3 blocks of 32, one of 256."""
    if wtype in ("F32", "F16", "BF16"):
        return 67
    return 256 if wtype.endswith("_K") else 96


def weight_tensor(name: str, values: np.ndarray, wtype: str) -> tuple[WeightTensor, np.ndarray]:
    """``values`` stored as ``wtype`` the way the GGUF loader hands it over (read-only
    flat bytes), and its reference dequantization."""
    qtype = GGMLQuantizationType[wtype]
    if wtype == "F32":
        data = values.astype(F32)
    elif wtype == "F16":
        data = values.astype(np.float16)
    else:
        data = quantize_matrix(values, qtype)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).copy()
    raw.setflags(write=False)
    tensor = WeightTensor(name, int(qtype), tuple(values.shape), raw)
    return tensor, R.dequantize(tensor)


class _Uploaded:
    """Weights uploaded for one case, freed at the end."""

    def __init__(self, ctx: KitContext, title: str) -> None:
        self.ctx, self.title, self.weights = ctx, title, []

    def __enter__(self) -> _Uploaded:
        return self

    def __exit__(self, *exc: object) -> None:
        for w in self.weights:
            self.ctx.backend.free_weight(w)

    def __call__(self, tensor: WeightTensor) -> Weight:
        w = self.ctx.backend.upload_weight(tensor)
        if not isinstance(w, Weight):
            raise KitFailure(
                f"{self.title}: upload_weight returned {type(w).__name__}, not vt.Weight"
            )
        self.weights.append(w)
        if tuple(w.shape) != tuple(tensor.shape) or w.name != tensor.name:
            raise KitFailure(
                f"{self.title}: upload_weight returned Weight(name={w.name!r}, "
                f"shape={tuple(w.shape)}) for tensor {tensor.name!r} of shape {tensor.shape}"
            )
        self.ctx.count()
        return w


# --------------------------------------------------------------------------- weights


def _upload_matrix(ctx: KitContext, title: str, wtype: str, rows: int, cols: int) -> str:
    tensor, ref = weight_tensor("kit.matrix", _normal((rows, cols), "up", wtype), wtype)
    ids = np.arange(rows, dtype=I32)[::-1].copy()
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        w = up(tensor)
        out = io.output("out", rows * cols * 4)
        ctx.backend.embedding(out, w, io.input("ids", ids), rows, ctx.stream)
        got = io.result("out", F32, (rows, cols))
        return compare(ctx, title, "upload_weight", wtype, got, ref[ids])


def _upload_vector(ctx: KitContext, title: str, n: int) -> str:
    """A 1-D weight, read back as the bias of a matmul by a zero matrix (exact: out = b)."""
    values = 1.0 + _normal((n,), "vec", scale=0.1)
    tensor, ref = weight_tensor("kit.vector", values, "F32")
    zeros, _ = weight_tensor("kit.zeros", np.zeros((n, 32), dtype=F32), "F32")
    x = _normal((2, 32), "vec-x")
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        w, b = up(zeros), up(tensor)
        out = io.output("out", 2 * n * 4)
        ctx.backend.matmul(out, io.input("x", x), w, 2, ctx.stream, bias=b)
        got = io.result("out", F32, (2, n))
        return compare(ctx, title, "upload_weight", "F32", got, np.stack([ref, ref]))


def _embedding(ctx: KitContext, title: str, wtype: str, vocab: int, ids: list[int]) -> str:
    dim = in_features(wtype)
    tensor, ref = weight_tensor("kit.embd", _normal((vocab, dim), "embd", wtype), wtype)
    idx = np.asarray(ids, dtype=I32)
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        w = up(tensor)
        out = io.output("out", len(ids) * dim * 4)
        ctx.backend.embedding(out, w, io.input("ids", idx), len(ids), ctx.stream)
        got = io.result("out", F32, (len(ids), dim))
        return compare(ctx, title, "embedding", wtype, got, R.embedding(ref, idx))


def _matmul(ctx: KitContext, title: str, wtype: str, n: int, out_f: int, bias: bool) -> str:
    in_f = in_features(wtype)
    tensor, ref = weight_tensor("kit.w", _normal((out_f, in_f), "mm", wtype, out_f), wtype)
    x = _normal((n, in_f), "mm-x", wtype, n)
    b_tensor, b_ref = weight_tensor("kit.b", _normal((out_f,), "mm-b", out_f), "F32")
    want = R.matmul(x, ref, b_ref if bias else None)
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        w = up(tensor)
        bw = up(b_tensor) if bias else None
        out = io.output("out", n * out_f * 4)
        ctx.backend.matmul(out, io.input("x", x), w, n, ctx.stream, bias=bw)
        got = io.result("out", F32, (n, out_f))
        return compare(ctx, title, "matmul", wtype, got, want)


# --------------------------------------------------------------------------- activations


def _rms_norm(ctx: KitContext, title: str, n: int, dim: int, eps: float) -> str:
    scales = 10.0 ** _rng("rms-s", n, dim).uniform(-2, 2, (n, 1))
    x = (_normal((n, dim), "rms", n, dim) * scales).astype(F32)
    tensor, w_ref = weight_tensor("kit.norm", 1.0 + _normal((dim,), "rms-w", dim, scale=0.1), "F32")
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        w = up(tensor)
        out = io.output("out", x.nbytes)
        ctx.backend.rms_norm(out, io.input("x", x), w, n, dim, eps, ctx.stream)
        got = io.result("out", F32, x.shape)
        return compare(ctx, title, "rms_norm", "F32", got, R.rms_norm(x, w_ref, eps))


def _rope(
    ctx: KitContext, title: str, n_heads: int, positions: list[int], params: RopeParams
) -> str:
    n = len(positions)
    x = _normal((n, n_heads * params.head_dim), "rope", n, n_heads, params.head_dim)
    pos = np.asarray(positions, dtype=I32)
    want = R.rope(x, pos, n_heads, params)
    with CaseBuffers(ctx, title) as io:
        xb = io.inout("x", x)
        ctx.backend.rope(xb, io.input("positions", pos), n, n_heads, params, ctx.stream)
        got = io.result("x", F32, x.shape)
        return compare(ctx, title, "rope", "F32", got, want)


def _kv_store(
    ctx: KitContext, title: str, layout: KVLayout, layer: int, slots: list[int], pos: list[int]
) -> str:
    n, row = len(pos), layout.n_kv_heads * layout.head_dim
    cache = _normal(layout.shape, "kv-cache", layout)
    k, v = _normal((n, row), "kv-k", n), _normal((n, row), "kv-v", n)
    s, p = np.asarray(slots, dtype=I32), np.asarray(pos, dtype=I32)
    want = cache.copy()
    R.kv_store(want, layer, k, v, s, p)
    with CaseBuffers(ctx, title) as io:
        cb = io.inout("cache", cache)
        ctx.backend.kv_store(
            cb, layout, layer, io.input("k", k), io.input("v", v), io.input("slots", s),
            io.input("positions", p), n, ctx.stream,
        )  # fmt: skip
        got = io.result("cache", F32, layout.shape)
        return compare(ctx, title, "kv_store", "F32", got, want)


def _attention(
    ctx: KitContext,
    title: str,
    layout: KVLayout,
    layer: int,
    n_heads: int,
    slots: list[int],
    pos: list[int],
) -> str:
    n, hd = len(pos), layout.head_dim
    cache = _normal(layout.shape, "attn-cache", layout)
    s, p = np.asarray(slots, dtype=I32), np.asarray(pos, dtype=I32)
    # Positions past what any row of a slot may see get loud values, so reading them shows.
    for slot in range(layout.n_slots):
        seen = p[s == slot]
        end = int(seen.max()) + 1 if seen.size else 0
        cache[end:, slot, :, 0] *= 8.0
        cache[end:, slot, :, 1] += 50.0
    q = _normal((n, n_heads * hd), "attn-q", n, n_heads)
    scale = 1.0 / float(np.sqrt(hd))
    want = R.attention(q, cache, layout, layer, s, p, n_heads, scale)
    with CaseBuffers(ctx, title) as io:
        out = io.output("out", q.nbytes)
        ctx.backend.attention(
            out, io.input("q", q), io.input("cache", cache), layout, layer, io.input("slots", s),
            io.input("positions", p), n, n_heads, scale, ctx.stream,
        )  # fmt: skip
        got = io.result("out", F32, q.shape)
        return compare(ctx, title, "attention", "F32", got, want)


def _silu_mul(ctx: KitContext, title: str, n: int) -> str:
    gate = _normal((n,), "gate", n, scale=4.0)
    gate[::97] = -100.0  # exp(-gate) overflows: silu -> -0
    gate[50::97] = 100.0
    up = _normal((n,), "up", n)
    with CaseBuffers(ctx, title) as io:
        out = io.output("out", gate.nbytes)
        ctx.backend.silu_mul(out, io.input("gate", gate), io.input("up", up), n, ctx.stream)
        got = io.result("out", F32, (n,))
        return compare(ctx, title, "silu_mul", "F32", got, R.silu_mul(gate, up))


def _add(ctx: KitContext, title: str, n: int, in_place: bool) -> str:
    a, b = _normal((n,), "add-a", n), _normal((n,), "add-b", n)
    with CaseBuffers(ctx, title) as io:
        if in_place:  # the runner's residual update: out aliases a
            ab = io.inout("a", a)
            ctx.backend.add(ab, ab, io.input("b", b), n, ctx.stream)
            got = io.result("a", F32, (n,))
        else:
            out = io.output("out", a.nbytes)
            ctx.backend.add(out, io.input("a", a), io.input("b", b), n, ctx.stream)
            got = io.result("out", F32, (n,))
        return compare(ctx, title, "add", "F32", got, R.add(a, b))


def _gather_rows(ctx: KitContext, title: str, m: int, dim: int, rows: list[int]) -> str:
    x = _normal((m, dim), "gather", m, dim)
    r = np.asarray(rows, dtype=I32)
    with CaseBuffers(ctx, title) as io:
        out = io.output("out", len(rows) * dim * 4)
        ctx.backend.gather_rows(out, io.input("x", x), io.input("rows", r), len(rows), dim,
                                ctx.stream)  # fmt: skip
        got = io.result("out", F32, (len(rows), dim))
        return compare(ctx, title, "gather_rows", "F32", got, R.gather_rows(x, r))


def _copy_d2d(ctx: KitContext, title: str, size: int, nbytes: int, src_at: int, dst_at: int) -> str:
    src = _rng("d2d", size).integers(0, 256, size, dtype=np.uint8)
    want = np.full(size, POISON, dtype=np.uint8)
    want[dst_at : dst_at + nbytes] = src[src_at : src_at + nbytes]
    with CaseBuffers(ctx, title) as io:
        sb, db = io.input("src", src), io.output("dst", size)
        ctx.backend.copy_d2d(db.view(dst_at, nbytes), sb.view(src_at, nbytes), nbytes, ctx.stream)
        got = io.result("dst", np.uint8, (size,))
        return compare(ctx, title, "copy_d2d", "bytes", got, want)


# --------------------------------------------------------------------------- sampling


def _cdf(row: np.ndarray, t: float, top_p: float, top_k: int) -> tuple[np.ndarray, float]:
    """The kept candidates' CDF in float64, and how close the top-p cut came to top_p."""
    lg = row.astype(np.float64) / t
    order = np.argsort(-lg, kind="stable")
    if 0 < top_k < lg.size:
        order = order[:top_k]
    p = np.exp(lg[order] - lg[order[0]])
    c = np.cumsum(p / p.sum())
    cut = 1.0
    if top_p < 1:
        keep = int(np.searchsorted(c, top_p)) + 1
        cut = float(np.min(np.abs(c[max(0, keep - 2) : keep + 1] - top_p)))
        c = c[:keep]
    return c / c[-1], cut


def sample_params(logits: np.ndarray, rows: list[tuple[float, float, int, int]]) -> np.ndarray:
    """``(temperature, top_p, top_k, seed)`` per row; the counter is chosen so that the draw
    is not within rounding of a CDF boundary, where a backend that sums in another order
    could legitimately draw the neighbouring id."""
    params = np.zeros(len(rows), dtype=SAMPLE_PARAMS_DTYPE)
    for r, (t, top_p, top_k, seed) in enumerate(rows):
        counter = 0
        if t > 0:
            cdf, cut = _cdf(logits[r], t, top_p, top_k)
            if cut < 1e-5:  # a kit bug, not a backend's: pick other logits
                raise ValueError(f"sample case row {r}: the top-p cut is within rounding")
            while np.min(np.abs(cdf - R.uniform(seed, counter))) < 1e-4:
                counter += 1
        params[r] = (t, top_p, top_k, seed, counter)
    return params


def _sample(ctx: KitContext, title: str, rows: list[tuple[float, float, int, int]]) -> str:
    n, vocab = len(rows), 301
    logits = _normal((n, vocab), "sample", title, scale=2.0)
    if "ties" in title:
        logits[0, [17, 200]] = logits[0].max() + 1.0  # equal maxima: the lowest id wins
        logits[1, ::3] = -np.inf
        logits[2] = 0.5
    params = sample_params(logits, rows)
    want = R.sample(logits, params)
    with CaseBuffers(ctx, title) as io:
        out = io.output("ids", n * 4)
        ctx.backend.sample(out, io.input("logits", logits), io.input("params", params), n, vocab,
                           ctx.stream)  # fmt: skip
        got = io.result("ids", I32, (n,))
        return compare(ctx, title, "sample", "F32", got, want)


# --------------------------------------------------------------------------- the cases


def _case(kernel: str, label: str, dtype: str, fn: Callable[..., str], **kw: Any) -> KitCase:
    title = f"kernel {kernel}[{label}]"
    return KitCase("kernel", kernel, label, dtype, partial(_bound, fn, title, kw))


def _bound(fn: Callable[..., str], title: str, kw: dict[str, Any], ctx: KitContext) -> str:
    return fn(ctx, title, **kw)


def _rope_cases() -> list[KitCase]:
    llama3 = 10000.0 ** (-np.arange(8) / 8) / np.array([1, 1, 1, 2, 4, 8, 8, 8])
    specs = [
        ("normal,n=1,hd=16", 3, [7], RopeParams(16)),
        ("normal,n=5,hd=64", 4, [0, 1, 2, 3, 4], RopeParams(64, 100000.0)),
        ("neox,n=5,hd=64", 2, [3, 4, 5, 100, 1023], RopeParams(64, 1e6, RopeStyle.neox)),
        ("neox,n=1,pos=4095", 3, [4095], RopeParams(16, 1e6, RopeStyle.neox)),
        ("normal,linear=4", 2, [0, 17, 500], RopeParams(32, linear_factor=4.0)),
        ("normal,inv_freq", 2, [9, 2000], RopeParams(16, inv_freq=tuple(map(float, llama3)))),
    ]
    return [
        _case("rope", label, "F32", _rope, n_heads=h, positions=p, params=params)
        for label, h, p, params in specs
    ]


def _cache_cases() -> list[KitCase]:
    kv = KVLayout(n_layers=2, n_slots=3, max_len=11, n_kv_heads=2, head_dim=16)
    at = KVLayout(n_layers=2, n_slots=3, max_len=13, n_kv_heads=2, head_dim=16)
    two = KVLayout(n_layers=1, n_slots=2, max_len=9, n_kv_heads=2, head_dim=16)
    wide = KVLayout(n_layers=1, n_slots=2, max_len=9, n_kv_heads=2, head_dim=64)
    cases = [
        _case("kv_store", "n=1,last-pos", "F32", _kv_store, layout=kv, layer=1, slots=[2],
              pos=[10]),
        _case("kv_store", "n=5,3-slots", "F32", _kv_store, layout=kv, layer=0,
              slots=[0, 0, 0, 1, 2], pos=[0, 1, 2, 5, 10]),
    ]  # fmt: skip
    for label, layout, layer, heads, slots, pos in (
        ("n=1,pos=0", at, 0, 4, [1], [0]),
        ("n=1,last-pos", at, 1, 4, [2], [12]),
        ("n=7,3-slots,prefill+decode", at, 1, 4, [0, 0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 9, 12]),
        ("n=2,no-gqa", two, 0, 2, [1, 0], [8, 3]),
        ("n=3,gqa-4,hd=64", wide, 0, 8, [0, 0, 1], [5, 6, 2]),
    ):
        cases.append(
            _case("attention", label, "F32", _attention, layout=layout, layer=layer,
                  n_heads=heads, slots=slots, pos=pos)
        )  # fmt: skip
    return cases


def _sample_cases() -> list[KitCase]:
    specs: list[tuple[str, list[tuple[float, float, int, int]]]] = [
        ("greedy,n=1", [(0.0, 1.0, 0, 0)]),
        ("greedy-ties,n=4", [(0.0, 1.0, 0, 0), (0.0, 1.0, 0, 1), (0.0, 1.0, 0, 2),
                             (-1.0, 1, 0, 3)]),
        ("temperature,n=4", [(0.5, 1.0, 0, 11), (0.8, 1.0, 0, 12), (1.0, 1.0, 0, 13),
                             (1.7, 1.0, 0, 14)]),
        ("top-k,n=3", [(1.0, 1.0, 1, 21), (1.0, 1.0, 5, 22), (1.0, 1.0, 40, 23)]),
        ("top-p,n=3", [(0.7, 0.3, 0, 31), (1.0, 0.9, 0, 32), (1.2, 0.99, 0, 33)]),
        ("mixed,n=5", [(0.0, 1.0, 0, 0), (0.9, 0.95, 50, 41), (1.0, 1.0, -1, 42),
                       (0.6, 0.5, 10, 43), (2.0, 1.0, 3, 2**32 - 1)]),
    ]  # fmt: skip
    return [_case("sample", label, "F32", _sample, rows=rows) for label, rows in specs]


def kernel_cases() -> list[KitCase]:
    """Every kernel case, grouped by kernel in ``vt.MODEL_KERNELS`` order."""
    cases = [
        _case("upload_weight", f"{wt},37x{in_features(wt)}", wt, _upload_matrix, wtype=wt,
              rows=37, cols=in_features(wt))
        for wt in WEIGHT_TYPES
    ]  # fmt: skip
    cases.append(_case("upload_weight", "F32,vector-67", "F32", _upload_vector, n=67))
    ids = [36, 0, 5, 5, 17, 36, 1]
    cases += [
        _case("embedding", f"{wt},n=7", wt, _embedding, wtype=wt, vocab=37, ids=ids)
        for wt in WEIGHT_TYPES
    ]
    cases.append(_case("embedding", "F32,n=1", "F32", _embedding, wtype="F32", vocab=37, ids=[36]))
    cases += [
        _case("rms_norm", f"n={n},dim={d},eps={e:g}", "F32", _rms_norm, n=n, dim=d, eps=e)
        for n, d, e in ((1, 67, 1e-5), (5, 64, 1e-6), (24, 16, 1e-6), (3, 256, 1e-5))
    ]
    for wt in WEIGHT_TYPES:
        for n in (1, 5):
            cases.append(
                _case("matmul", f"{wt},n={n},37x{in_features(wt)}", wt, _matmul, wtype=wt, n=n,
                      out_f=37, bias=False)
            )  # fmt: skip
    cases.append(
        _case("matmul", "F32,n=3,bias", "F32", _matmul, wtype="F32", n=3, out_f=37, bias=True)
    )
    cases.append(
        _case("matmul", "Q8_0,n=2,301x96", "Q8_0", _matmul, wtype="Q8_0", n=2, out_f=301,
              bias=False)
    )  # fmt: skip
    cases += _rope_cases()
    cases += _cache_cases()
    cases += [_case("silu_mul", f"n={n}", "F32", _silu_mul, n=n) for n in (1, 1001)]
    adds = (("n=1", 1, False), ("n=1001", 1001, False), ("n=1001,in-place", 1001, True))
    cases += [_case("add", label, "F32", _add, n=n, in_place=ip) for label, n, ip in adds]
    cases += [
        _case("gather_rows", f"n={len(r)},dim=67", "F32", _gather_rows, m=5, dim=67, rows=r)
        for r in ([3], [4, 0, 4, 2])
    ]
    cases += _sample_cases()
    cases += [
        _case("copy_d2d", "1001-bytes,offsets", "bytes", _copy_d2d, size=4096, nbytes=1001,
              src_at=3, dst_at=5),
        _case("copy_d2d", "4-bytes,at-end", "bytes", _copy_d2d, size=64, nbytes=4, src_at=0,
              dst_at=60),
    ]  # fmt: skip
    return cases
