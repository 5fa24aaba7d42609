"""Op cases: every op of :data:`vt.protocol.ops.OPS` against its reference, through ``launch``.

Each case launches one op with :meth:`vt.Backend.launch` on guarded tensors and compares the
result with the op's reference (``vt.protocol.ops.OPS[op].reference`` on numpy arrays), for each
weight type where the op takes a weight matrix. A primitive op the backend does not support
is reported as not declared, never as a pass; a fused op it does not support still runs, as
its decomposition (the case's detail says "decomposed"). The core methods that compute on
data (``upload_weight``, ``copy_d2d``) have cases too.

Shapes follow what the llama-family model does, plus the edges where off-by-one bugs
live: odd sizes, a single row, batches of several rows over several KV slots, the first
and the last cache position, every weight type. Inputs are seeded, so a failure reproduces.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from .. import reference as R
from ..protocol.backend import (
    SAMPLE_PARAMS_DTYPE,
    Backend,
    KVLayout,
    RopeParams,
    RopeStyle,
    Weight,
    WeightTensor,
)
from ..protocol.ops import OPS, missing_ops
from .guarded import POISON, CaseBuffers, compare
from .kit import CORE_METHODS, KitCase, KitContext, KitFailure, NotDeclared
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


def reference(op: str, **args: Any) -> dict[str, np.ndarray]:
    """Run ``vt.protocol.ops.OPS[op].reference`` on copies of ``args`` (numpy arrays for tensors,
    dequantized float32 arrays for weights; every output passed as an array of its shape);
    returns every array argument after the call."""
    arrays = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in args.items()}
    OPS[op].reference(arrays)
    return {k: v for k, v in arrays.items() if isinstance(v, np.ndarray)}


# --------------------------------------------------------------------------- declared?


def _weighted(op: str) -> bool:
    return bool(OPS[op].weights)


def how_it_runs(backend: Backend, op: str, wtype: str = "") -> str:
    """``"native"``, or ``"decomposed into …"`` for a fused op the backend lacks; raises
    :class:`NotDeclared` for an op the backend cannot run (for weight type ``wtype``)."""
    spec = OPS[op]

    def supports(name: str) -> bool:
        if wtype and _weighted(name):
            return backend.supports(name, wtype)
        return backend.supports(name)

    typed = bool(wtype and _weighted(op))
    for_type = f" for {wtype} weights" if typed else ""
    if not spec.fused:
        if supports(op):
            return "native"
        call = f"supports({op!r}, {wtype!r})" if typed else f"supports({op!r})"
        raise NotDeclared(
            f"not declared: backend {backend.name!r} does not support op {op}{for_type} "
            f"({call} is False)"
        )
    if backend.supports(op):  # what launch() asks
        return "native"
    missing = missing_ops([op], supports)
    if missing:
        raise NotDeclared(
            f"not declared: backend {backend.name!r} does not support the fused op {op}"
            f"{for_type}, and its decomposition needs the op(s) {', '.join(missing)}, which it "
            "does not support either"
        )
    return f"decomposed into {', '.join(spec.parts)}"


def op_support(backend: Backend) -> dict[str, str]:
    """How ``backend`` runs each op of the table: native, decomposed, fallback (an
    optional op it lacks: the caller's fallback runs, its cases are not declared) or not
    declared."""
    out = {}
    for op in OPS:
        try:
            out[op] = how_it_runs(backend, op).split(" into ")[0]
        except NotDeclared:
            out[op] = "fallback" if OPS[op].optional else "not declared"
    return out


def _launch(ctx: KitContext, op: str, **args: Any) -> None:
    ctx.backend.launch(op, ctx.stream, **args)


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


# --------------------------------------------------------------------------- core methods


def _reads_back(ctx: KitContext, title: str, op: str, wtype: str) -> None:
    """upload_weight is read back through an op; without it there is nothing to prove."""
    try:
        how_it_runs(ctx.backend, op, wtype)
    except NotDeclared as exc:
        raise NotDeclared(f"{exc}; {title} reads the uploaded weight back with it") from None


def _upload_matrix(ctx: KitContext, title: str, wtype: str, rows: int, cols: int) -> str:
    _reads_back(ctx, title, "embedding", wtype)
    tensor, ref = weight_tensor("kit.matrix", _normal((rows, cols), "up", wtype), wtype)
    ids = np.arange(rows, dtype=I32)[::-1].copy()
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        w = up(tensor)
        out = io.output("out", F32, (rows, cols))
        _launch(ctx, "embedding", out=out, ids=io.input("ids", ids), table=w)
        got = io.result("out", F32, (rows, cols))
        detail = compare(ctx, title, "upload_weight", wtype, got, ref[ids])
        return f"{detail}; read back with embedding"


def _upload_vector(ctx: KitContext, title: str, n: int) -> str:
    """A 1-D weight, read back as the bias of a matmul by a zero matrix (exact: out = b)."""
    _reads_back(ctx, title, "matmul", "F32")
    values = 1.0 + _normal((n,), "vec", scale=0.1)
    tensor, ref = weight_tensor("kit.vector", values, "F32")
    zeros, _ = weight_tensor("kit.zeros", np.zeros((n, 32), dtype=F32), "F32")
    x = _normal((2, 32), "vec-x")
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        w, b = up(zeros), up(tensor)
        out = io.output("out", F32, (2, n))
        _launch(ctx, "matmul", out=out, x=io.input("x", x), weight=w, bias=b)
        got = io.result("out", F32, (2, n))
        detail = compare(ctx, title, "upload_weight", "F32", got, np.stack([ref, ref]))
        return f"{detail}; read back as a matmul bias"


def _copy_d2d(ctx: KitContext, title: str, size: int, nbytes: int, src_at: int, dst_at: int) -> str:
    src = _rng("d2d", size).integers(0, 256, size, dtype=np.uint8)
    want = np.full(size, POISON, dtype=np.uint8)
    want[dst_at : dst_at + nbytes] = src[src_at : src_at + nbytes]
    with CaseBuffers(ctx, title) as io:
        sb, db = io.input("src", src).buffer, io.output("dst", np.uint8, (size,)).buffer
        ctx.backend.copy_d2d(db.view(dst_at, nbytes), sb.view(src_at, nbytes), nbytes, ctx.stream)
        got = io.result("dst", np.uint8, (size,))
        return compare(ctx, title, "copy_d2d", "bytes", got, want)


# --------------------------------------------------------------------------- weighted ops


def _embedding(ctx: KitContext, title: str, wtype: str, vocab: int, ids: list[int]) -> str:
    dim = in_features(wtype)
    tensor, ref = weight_tensor("kit.embd", _normal((vocab, dim), "embd", wtype), wtype)
    idx = np.asarray(ids, dtype=I32)
    want = reference("embedding", out=np.zeros((len(ids), dim), F32), ids=idx, table=ref)
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        w = up(tensor)
        out = io.output("out", F32, (len(ids), dim))
        _launch(ctx, "embedding", out=out, ids=io.input("ids", idx), table=w)
        got = io.result("out", F32, (len(ids), dim))
        return compare(ctx, title, "embedding", wtype, got, want["out"])


def _matmul(ctx: KitContext, title: str, wtype: str, n: int, out_f: int, bias: bool) -> str:
    in_f = in_features(wtype)
    tensor, ref = weight_tensor("kit.w", _normal((out_f, in_f), "mm", wtype, out_f), wtype)
    x = _normal((n, in_f), "mm-x", wtype, n)
    b_tensor, b_ref = weight_tensor("kit.b", _normal((out_f,), "mm-b", out_f), "F32")
    args: dict[str, Any] = {"bias": b_ref} if bias else {}
    want = reference("matmul", out=np.zeros((n, out_f), F32), x=x, weight=ref, **args)
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        w = up(tensor)
        if bias:
            args = {"bias": up(b_tensor)}
        out = io.output("out", F32, (n, out_f))
        _launch(ctx, "matmul", out=out, x=io.input("x", x), weight=w, **args)
        got = io.result("out", F32, (n, out_f))
        return compare(ctx, title, "matmul", wtype, got, want["out"])


class _Norm:
    """The norm ops' extra inputs: row scales 1e-2..1e2 (for the rows the norm sees), a norm
    weight, eps."""

    def __init__(self, n: int, dim: int, *key: Any) -> None:
        self.scales = (10.0 ** _rng("norm-s", n, dim, *key).uniform(-2, 2, (n, 1))).astype(F32)
        self.tensor, self.ref = weight_tensor(
            "kit.norm", 1.0 + _normal((dim,), "norm-w", dim, scale=0.1), "F32"
        )
        self.eps = 1e-5

    def args(self, up: _Uploaded, io: CaseBuffers, n: int, dim: int) -> dict[str, Any]:
        return {"norm": up(self.tensor), "eps": self.eps,
                "scratch": io.scratch("scratch", F32, (n, dim))}  # fmt: skip


def _matmul_add(
    ctx: KitContext, title: str, wtype: str, n: int, out_f: int, in_place: bool,
    norm: bool = False,
) -> str:  # fmt: skip
    """matmul_add, or (``norm``) matmul_add_rms_norm, whose ``normed`` is checked too."""
    op, in_f = "matmul_add_rms_norm" if norm else "matmul_add", in_features(wtype)
    tensor, ref = weight_tensor("kit.wo", _normal((out_f, in_f), "mma", wtype, out_f), wtype)
    x = _normal((n, in_f), "mma-x", wtype, n)
    residual = _normal((n, out_f), "mma-r", wtype, n)
    nrm = _Norm(n, out_f, "mma") if norm else None
    extra: dict[str, Any] = {}
    if nrm is not None:  # rows of out at scales 1e-2..1e2: what the norm sees
        x, residual = (x * nrm.scales).astype(F32), (residual * nrm.scales).astype(F32)
        extra = {"normed": np.zeros((n, out_f), F32), "norm": nrm.ref, "eps": nrm.eps}
    want = reference(
        op, out=np.zeros((n, out_f), F32), x=x, weight=ref, residual=residual,
        scratch=np.zeros((n, out_f), F32), **extra,
    )  # fmt: skip
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        w = up(tensor)
        if nrm is None:
            args: dict[str, Any] = {"scratch": io.scratch("scratch", F32, (n, out_f))}
        else:  # norm, eps and the scratch (n, out_f)
            args = {"normed": io.output("normed", F32, (n, out_f)), **nrm.args(up, io, n, out_f)}
        if in_place:  # the graph's residual update: out aliases residual
            r = io.inout("residual", residual)
            _launch(ctx, op, out=r, x=io.input("x", x), weight=w, residual=r, **args)
            got = io.result("residual", F32, (n, out_f))
        else:
            out = io.output("out", F32, (n, out_f))
            _launch(ctx, op, out=out, x=io.input("x", x), weight=w,
                    residual=io.input("residual", residual), **args)  # fmt: skip
            got = io.result("out", F32, (n, out_f))
        if nrm is None:
            return compare(ctx, title, op, wtype, got, want["out"])
        normed = io.result("normed", F32, (n, out_f))
        return "; ".join(
            f"{k} " + compare(ctx, title, op, wtype, g, want[k], k)
            for k, g in (("out", got), ("normed", normed))
        )


def _swiglu(
    ctx: KitContext, title: str, wtype: str, n: int, ffn: int, norm: bool = False,
    prefetch: bool = False,
) -> str:  # fmt: skip
    """swiglu, or (``norm``) rms_norm_swiglu; ``prefetch``: after the hint ``prefetch`` of
    its gate and up weights (which must change nothing)."""
    op, dim = "rms_norm_swiglu" if norm else "swiglu", in_features(wtype)
    g_tensor, g_ref = weight_tensor("kit.gate", _normal((ffn, dim), "sw-g", wtype, ffn), wtype)
    u_tensor, u_ref = weight_tensor("kit.up", _normal((ffn, dim), "sw-u", wtype, ffn), wtype)
    x = _normal((n, dim), "sw-x", wtype, n)
    nrm = _Norm(n, dim, "sw") if norm else None
    extra: dict[str, Any] = {}
    if nrm is not None:
        x = (x * nrm.scales).astype(F32)
        extra = {"norm": nrm.ref, "eps": nrm.eps, "scratch": np.zeros((n, dim), F32)}
    want = reference(
        op, out=np.zeros((n, ffn), F32), x=x, gate=g_ref, up=u_ref,
        scratch_gate=np.zeros((n, ffn), F32), scratch_up=np.zeros((n, ffn), F32), **extra,
    )  # fmt: skip
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        gate, upw = up(g_tensor), up(u_tensor)
        out = io.output("out", F32, (n, ffn))
        if prefetch:
            _launch(ctx, "prefetch", weight=gate, paired=upw)
            _launch(ctx, "prefetch", weight=upw)
        _launch(
            ctx, op, out=out, x=io.input("x", x), gate=gate, up=upw,
            scratch_gate=io.scratch("scratch_gate", F32, (n, ffn)),
            scratch_up=io.scratch("scratch_up", F32, (n, ffn)),
            **(nrm.args(up, io, n, dim) if nrm is not None else {}),
        )  # fmt: skip
        got = io.result("out", F32, (n, ffn))
        return compare(ctx, title, op, wtype, got, want["out"])


def _qkv(ctx: KitContext, title: str, wtype: str, n: int, dims: tuple[int, int, int],
         bias: bool) -> str:  # fmt: skip
    dim = in_features(wtype)
    names = ("q", "k", "v")
    tensors, refs, b_tensors, b_refs = {}, {}, {}, {}
    for name, rows in zip(names, dims, strict=True):
        tensors[name], refs[name] = weight_tensor(
            f"kit.w{name}", _normal((rows, dim), "qkv", name, wtype, rows), wtype
        )
        b_tensors[name], b_refs[name] = weight_tensor(
            f"kit.b{name}", _normal((rows,), "qkv-b", name, rows), "F32"
        )
    x = _normal((n, dim), "qkv-x", wtype, n)
    outs = {name: np.zeros((n, rows), F32) for name, rows in zip(names, dims, strict=True)}
    ref_args: dict[str, Any] = {f"w{k}": refs[k] for k in names}
    if bias:
        ref_args |= {f"b{k}": b_refs[k] for k in names}
    want = reference("qkv", x=x, **outs, **ref_args)
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        args: dict[str, Any] = {f"w{k}": up(tensors[k]) for k in names}
        if bias:
            args |= {f"b{k}": up(b_tensors[k]) for k in names}
        for name, rows in zip(names, dims, strict=True):
            args[name] = io.output(name, F32, (n, rows))
        _launch(ctx, "qkv", x=io.input("x", x), **args)
        details = [
            compare(ctx, title, "qkv", wtype, io.result(name, F32, (n, rows)), want[name], name)
            for name, rows in zip(names, dims, strict=True)
        ]
        return "; ".join(f"{k} {d}" for k, d in zip(names, details, strict=True))


# --------------------------------------------------------------------------- activations


def _rms_norm(ctx: KitContext, title: str, n: int, dim: int, eps: float) -> str:
    scales = 10.0 ** _rng("rms-s", n, dim).uniform(-2, 2, (n, 1))
    x = (_normal((n, dim), "rms", n, dim) * scales).astype(F32)
    tensor, w_ref = weight_tensor("kit.norm", 1.0 + _normal((dim,), "rms-w", dim, scale=0.1), "F32")
    want = reference("rms_norm", out=np.zeros_like(x), x=x, weight=w_ref, eps=eps)
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        w = up(tensor)
        out = io.output("out", F32, x.shape)
        _launch(ctx, "rms_norm", out=out, x=io.input("x", x), weight=w, eps=eps)
        got = io.result("out", F32, x.shape)
        return compare(ctx, title, "rms_norm", "F32", got, want["out"])


def _rope(
    ctx: KitContext, title: str, n_heads: int, positions: list[int], params: RopeParams
) -> str:
    n = len(positions)
    x = _normal((n, n_heads * params.head_dim), "rope", n, n_heads, params.head_dim)
    pos = np.asarray(positions, dtype=I32)
    want = reference("rope", x=x, positions=pos, n_heads=n_heads, params=params)
    with CaseBuffers(ctx, title) as io:
        _launch(ctx, "rope", x=io.inout("x", x), positions=io.input("positions", pos),
                n_heads=n_heads, params=params)  # fmt: skip
        got = io.result("x", F32, x.shape)
        return compare(ctx, title, "rope", "F32", got, want["x"])


def _kv_store(
    ctx: KitContext, title: str, layout: KVLayout, layer: int, slots: list[int], pos: list[int]
) -> str:
    n, row = len(pos), layout.n_kv_heads * layout.head_dim
    cache = _normal(layout.shape, "kv-cache", layout)
    k, v = _normal((n, row), "kv-k", n), _normal((n, row), "kv-v", n)
    s, p = np.asarray(slots, dtype=I32), np.asarray(pos, dtype=I32)
    want = reference("kv_store", cache=cache, k=k, v=v, slots=s, positions=p, layout=layout,
                     layer=layer)  # fmt: skip
    with CaseBuffers(ctx, title) as io:
        _launch(
            ctx, "kv_store", cache=io.inout("cache", cache), k=io.input("k", k),
            v=io.input("v", v), slots=io.input("slots", s), positions=io.input("positions", p),
            layout=layout, layer=layer,
        )  # fmt: skip
        got = io.result("cache", F32, layout.shape)
        return compare(ctx, title, "kv_store", "F32", got, want["cache"])


def _loud_cache(layout: KVLayout, s: np.ndarray, p: np.ndarray, *key: Any) -> np.ndarray:
    """A random cache whose positions past what any row of a slot may see hold loud values,
    so reading them shows."""
    cache = _normal(layout.shape, *key, layout)
    for slot in range(layout.n_slots):
        seen = p[s == slot]
        end = int(seen.max()) + 1 if seen.size else 0
        cache[end:, slot, :, 0] *= 8.0
        cache[end:, slot, :, 1] += 50.0
    return cache


def _attention(
    ctx: KitContext,
    title: str,
    layout: KVLayout,
    layer: int,
    n_heads: int,
    slots: list[int],
    pos: list[int],
    context: int = 0,
) -> str:
    """attention, or (``context``) attention_bounded with that bound."""
    n, hd = len(pos), layout.head_dim
    s, p = np.asarray(slots, dtype=I32), np.asarray(pos, dtype=I32)
    cache = _loud_cache(layout, s, p, "attn-cache")
    q = _normal((n, n_heads * hd), "attn-q", n, n_heads)
    scale = 1.0 / float(np.sqrt(hd))
    attrs: dict[str, Any] = {"layout": layout, "layer": layer, "n_heads": n_heads, "scale": scale}
    op = "attention"
    if context:
        op, attrs["context"] = "attention_bounded", context
    want = reference(op, out=np.zeros_like(q), q=q, cache=cache, slots=s, positions=p, **attrs)
    with CaseBuffers(ctx, title) as io:
        out = io.output("out", F32, q.shape)
        _launch(
            ctx, op, out=out, q=io.input("q", q), cache=io.input("cache", cache),
            slots=io.input("slots", s), positions=io.input("positions", p), **attrs,
        )  # fmt: skip
        got = io.result("out", F32, q.shape)
        return compare(ctx, title, op, "F32", got, want["out"])


def _qkv_rope_kv_store(
    ctx: KitContext, title: str, wtype: str, layout: KVLayout, n_heads: int,
    params: RopeParams, slots: list[int], pos: list[int], bias: bool, norm: bool = False,
) -> str:  # fmt: skip
    """qkv_rope_kv_store, or (``norm``) rms_norm_qkv_rope_kv_store."""
    op = "rms_norm_qkv_rope_kv_store" if norm else "qkv_rope_kv_store"
    n, hd, dim = len(pos), layout.head_dim, in_features(wtype)
    rows = {"q": n_heads * hd, "k": layout.n_kv_heads * hd, "v": layout.n_kv_heads * hd}
    tensors, ref_args, b_tensors = {}, {}, {}
    for name, r in rows.items():
        tensors[name], ref_args[f"w{name}"] = weight_tensor(
            f"kit.w{name}", _normal((r, dim), "qrkv", name, wtype, r), wtype
        )
        if bias:
            b_tensors[name], ref_args[f"b{name}"] = weight_tensor(
                f"kit.b{name}", _normal((r,), "qrkv-b", name, r), "F32"
            )
    x = _normal((n, dim), "qrkv-x", wtype, n)
    nrm = _Norm(n, dim, "qrkv") if norm else None
    if nrm is not None:
        x = (x * nrm.scales).astype(F32)
        ref_args |= {"norm": nrm.ref, "eps": nrm.eps, "scratch": np.zeros((n, dim), F32)}
    s, p = np.asarray(slots, dtype=I32), np.asarray(pos, dtype=I32)
    cache = _normal(layout.shape, "qrkv-cache", layout)
    attrs = {"layout": layout, "layer": 1, "n_heads": n_heads, "params": params}
    outs = {name: np.zeros((n, r), F32) for name, r in rows.items()}
    want = reference(op, x=x, **outs, **ref_args, positions=p, slots=s, cache=cache, **attrs)
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        args: dict[str, Any] = {f"w{k}": up(tensors[k]) for k in rows}
        args |= {f"b{k}": up(b_tensors[k]) for k in b_tensors}
        args |= {name: io.output(name, F32, (n, r)) for name, r in rows.items()}
        if nrm is not None:
            args |= nrm.args(up, io, n, dim)
        _launch(
            ctx, op, x=io.input("x", x), positions=io.input("positions", p),
            slots=io.input("slots", s), cache=io.inout("cache", cache), **args, **attrs,
        )  # fmt: skip
        got_cache = io.result("cache", F32, layout.shape)
        got = {name: io.result(name, F32, (n, r)) for name, r in rows.items()}
        got |= {"cache K": got_cache[:, :, :, 0], "cache V": got_cache[:, :, :, 1]}
        want |= {"cache K": want["cache"][:, :, :, 0], "cache V": want["cache"][:, :, :, 1]}
        return "; ".join(
            f"{k} " + compare(ctx, title, op, wtype, got[k], want[k], k)
            for k in ("q", "k", "v", "cache K", "cache V")
        )


def _proj_norm(ctx: KitContext, title: str, wtype: str, n: int, then: str, **kw: Any) -> str:
    """matmul_add_rms_norm_swiglu (``then`` "swiglu": ``ffn``) or
    matmul_add_rms_norm_qkv_rope_kv_store (``then`` "qkv": ``layout``, ``n_heads``,
    ``params``, ``slots``, ``pos``), in place as the model runs them: out (the residual's
    update) and every output of the op after the norm are checked."""
    op = "matmul_add_rms_norm_" + ("swiglu" if then == "swiglu" else "qkv_rope_kv_store")
    dim = in_features(wtype)
    wo, wo_ref = weight_tensor("kit.wo", _normal((dim, dim), "pn-o", wtype, dim), wtype)
    nrm = _Norm(n, dim, "pn", then)
    x = (_normal((n, dim), "pn-x", wtype, n) * nrm.scales).astype(F32)
    residual = (_normal((n, dim), "pn-r", wtype, n) * nrm.scales).astype(F32)
    tensors: dict[str, WeightTensor] = {}
    refs: dict[str, Any] = {"norm": nrm.ref, "eps": nrm.eps}
    outs: dict[str, tuple[int, ...]] = {}
    extra: dict[str, Any] = {}  # the op after the norm's inputs and attributes
    if then == "swiglu":
        for name in ("gate", "up"):
            tensors[name], refs[name] = weight_tensor(
                f"kit.{name}", _normal((kw["ffn"], dim), "pn", name, wtype), wtype
            )
        outs["act"] = (n, kw["ffn"])
        scratches = {k: (n, kw["ffn"]) for k in ("scratch_gate", "scratch_up")}
    else:
        layout: KVLayout = kw["layout"]
        hd, heads = layout.head_dim, {"q": kw["n_heads"], "k": layout.n_kv_heads}
        for name in ("q", "k", "v"):
            r = heads.get(name, layout.n_kv_heads) * hd
            tensors[f"w{name}"], refs[f"w{name}"] = weight_tensor(
                f"kit.w{name}", _normal((r, dim), "pn", name, wtype), wtype
            )
            if kw.get("bias"):  # qwen2's
                tensors[f"b{name}"], refs[f"b{name}"] = weight_tensor(
                    f"kit.b{name}", _normal((r,), "pn-b", name), "F32"
                )
            outs[name] = (n, r)
        scratches = {}
        extra = {"layout": layout, "layer": 1, "n_heads": kw["n_heads"],
                 "params": kw["params"], "positions": np.asarray(kw["pos"], I32),
                 "slots": np.asarray(kw["slots"], I32)}  # fmt: skip
        cache = _normal(layout.shape, "pn-cache", layout)
    scratches |= {"scratch": (n, dim), "scratch_norm": (n, dim)}
    want = reference(
        op, out=residual.copy(), x=x, weight=wo_ref, residual=residual, **refs, **extra,
        **{k: np.zeros(shape, F32) for k, shape in (outs | scratches).items()},
        **({} if then == "swiglu" else {"cache": cache}),
    )  # fmt: skip
    with _Uploaded(ctx, title) as up, CaseBuffers(ctx, title) as io:
        args: dict[str, Any] = {k: up(t) for k, t in tensors.items()}
        args |= {k: io.output(k, F32, shape) for k, shape in outs.items()}
        args |= {k: io.scratch(k, F32, shape) for k, shape in scratches.items()}
        args |= {k: io.input(k, v) if isinstance(v, np.ndarray) else v for k, v in extra.items()}
        if then != "swiglu":
            args["cache"] = io.inout("cache", cache)
        r = io.inout("residual", residual)
        _launch(ctx, op, out=r, x=io.input("x", x), weight=up(wo), residual=r,
                norm=up(nrm.tensor), eps=nrm.eps, **args)  # fmt: skip
        got = {"out": io.result("residual", F32, (n, dim))}
        got |= {k: io.result(k, F32, shape) for k, shape in outs.items()}
        if then != "swiglu":
            c = io.result("cache", F32, cache.shape)
            got |= {"cache K": c[:, :, :, 0], "cache V": c[:, :, :, 1]}
            want |= {"cache K": want["cache"][:, :, :, 0], "cache V": want["cache"][:, :, :, 1]}
        return "; ".join(
            f"{k} " + compare(ctx, title, op, wtype, g, want[k], k) for k, g in got.items()
        )


def _rope_kv_store(
    ctx: KitContext,
    title: str,
    layout: KVLayout,
    layer: int,
    n_heads: int,
    params: RopeParams,
    slots: list[int],
    pos: list[int],
) -> str:
    n, hd = len(pos), layout.head_dim
    s, p = np.asarray(slots, dtype=I32), np.asarray(pos, dtype=I32)
    cache = _normal(layout.shape, "rkv-cache", layout)
    q = _normal((n, n_heads * hd), "rkv-q", n, n_heads)
    k = _normal((n, layout.n_kv_heads * hd), "rkv-k", n)
    v = _normal((n, layout.n_kv_heads * hd), "rkv-v", n)
    attrs = {"layout": layout, "layer": layer, "n_heads": n_heads, "params": params}
    want = reference("rope_kv_store", q=q, k=k, v=v, positions=p, slots=s, cache=cache, **attrs)
    with CaseBuffers(ctx, title) as io:
        _launch(
            ctx, "rope_kv_store", q=io.inout("q", q), k=io.inout("k", k), v=io.input("v", v),
            positions=io.input("positions", p), slots=io.input("slots", s),
            cache=io.inout("cache", cache), **attrs,
        )  # fmt: skip
        got_cache = io.result("cache", F32, layout.shape)
        details = [
            compare(ctx, title, "rope_kv_store", "F32", io.result("q", F32, q.shape), want["q"],
                    "q"),
            compare(ctx, title, "rope_kv_store", "F32", io.result("k", F32, k.shape), want["k"],
                    "k"),
            # the roped K plane within rope's tolerance; the V plane is a plain copy: exact
            compare(ctx, title, "rope_kv_store", "F32", got_cache[:, :, :, 0],
                    want["cache"][:, :, :, 0], "cache K"),
            compare(ctx, title, "kv_store", "F32", got_cache[:, :, :, 1],
                    want["cache"][:, :, :, 1], "cache V"),
        ]  # fmt: skip
        return "; ".join(
            f"{w} {d}" for w, d in zip(("q", "k", "cache K", "cache V"), details, strict=True)
        )


def _silu_mul(ctx: KitContext, title: str, n: int, dim: int) -> str:
    gate = _normal((n, dim), "gate", n, dim, scale=4.0)
    flat = gate.reshape(-1)
    flat[::97] = -100.0  # exp(-gate) overflows: silu -> -0
    flat[50::97] = 100.0
    up = _normal((n, dim), "up", n, dim)
    want = reference("silu_mul", out=np.zeros_like(gate), gate=gate, up=up)
    with CaseBuffers(ctx, title) as io:
        out = io.output("out", F32, gate.shape)
        _launch(ctx, "silu_mul", out=out, gate=io.input("gate", gate), up=io.input("up", up))
        got = io.result("out", F32, gate.shape)
        return compare(ctx, title, "silu_mul", "F32", got, want["out"])


def _add(ctx: KitContext, title: str, n: int, dim: int, in_place: bool) -> str:
    a, b = _normal((n, dim), "add-a", n, dim), _normal((n, dim), "add-b", n, dim)
    want = reference("add", out=np.zeros_like(a), a=a, b=b)
    with CaseBuffers(ctx, title) as io:
        if in_place:  # a residual update: out aliases a
            ab = io.inout("a", a)
            _launch(ctx, "add", out=ab, a=ab, b=io.input("b", b))
            got = io.result("a", F32, a.shape)
        else:
            out = io.output("out", F32, a.shape)
            _launch(ctx, "add", out=out, a=io.input("a", a), b=io.input("b", b))
            got = io.result("out", F32, a.shape)
        return compare(ctx, title, "add", "F32", got, want["out"])


def _gather_rows(ctx: KitContext, title: str, m: int, dim: int, rows: list[int]) -> str:
    x = _normal((m, dim), "gather", m, dim)
    r = np.asarray(rows, dtype=I32)
    want = reference("gather_rows", out=np.zeros((len(rows), dim), F32), x=x, rows=r)
    with CaseBuffers(ctx, title) as io:
        out = io.output("out", F32, (len(rows), dim))
        _launch(ctx, "gather_rows", out=out, x=io.input("x", x), rows=io.input("rows", r))
        got = io.result("out", F32, (len(rows), dim))
        return compare(ctx, title, "gather_rows", "F32", got, want["out"])


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


def _sample(
    ctx: KitContext, title: str, seed: str, rows: list[tuple[float, float, int, int]]
) -> str:
    n, vocab = len(rows), 301
    logits = _normal((n, vocab), "sample", seed, scale=2.0)
    if "ties" in seed:
        logits[0, [17, 200]] = logits[0].max() + 1.0  # equal maxima: the lowest id wins
        logits[1, ::3] = -np.inf
        logits[2] = 0.5
    params = sample_params(logits, rows)
    want = reference("sample", out=np.zeros(n, I32), logits=logits, params=params)
    with CaseBuffers(ctx, title) as io:
        out = io.output("ids", I32, (n,))
        _launch(ctx, "sample", out=out, logits=io.input("logits", logits),
                params=io.input("params", params))  # fmt: skip
        got = io.result("ids", I32, (n,))
        return compare(ctx, title, "sample", "F32", got, want["out"])


# --------------------------------------------------------------------------- logprobs


def _logprobs(
    ctx: KitContext, title: str, n: int, vocab: int, rows: list[int], k: int, edges: bool
) -> str:
    logits = _normal((n, vocab), "logprobs", n, vocab, scale=3.0)
    ids = _rng("logprobs-ids", n, vocab).integers(0, vocab, n).astype(I32)
    if edges:  # ties at the top and across the k-th place, -inf logits, a failed draw
        top = logits[0].max()
        logits[0, [5, 2, vocab - 1]] = top + 1.0
        logits[0, [40, 9, 100]] = top + 0.5  # k=5 keeps 9 and 40 of these three
        logits[1, ::2] = -np.inf
        logits[1, [7, 3, 11]] = 4.0  # equal logits: the lower id first
        ids[2] = -1  # a row whose draw failed (the sampler writes -1): chosen is NaN
    r = np.asarray(rows, dtype=I32)
    m = len(rows)
    outs = {"chosen": np.zeros(m, F32), "top_ids": np.zeros((m, k), I32),
            "top_logprobs": np.zeros((m, k), F32)}  # fmt: skip
    want = reference("logprobs", **outs, logits=logits, ids=ids, rows=r)
    with CaseBuffers(ctx, title) as io:
        chosen = io.output("chosen", F32, (m,))
        top_ids, top_lp = io.output("top_ids", I32, (m, k)), io.output("top_lp", F32, (m, k))
        _launch(ctx, "logprobs", chosen=chosen, top_ids=top_ids, top_logprobs=top_lp,
                logits=io.input("logits", logits), ids=io.input("ids", ids),
                rows=io.input("rows", r))  # fmt: skip
        got_c = io.result("chosen", F32, (m,))
        nan = np.isnan(want["chosen"])
        if not np.array_equal(np.isnan(got_c), nan):
            raise KitFailure(f"{title}: chosen is NaN exactly where the id is outside the "
                             f"vocabulary: got {got_c!r}, want {want['chosen']!r}")  # fmt: skip
        parts = [compare(ctx, title, "logprobs", "F32", got_c[~nan], want["chosen"][~nan],
                         "chosen"),
                 compare(ctx, title, "logprobs", "I32", io.result("top_ids", I32, (m, k)),
                         want["top_ids"], "top_ids"),
                 compare(ctx, title, "logprobs", "F32", io.result("top_lp", F32, (m, k)),
                         want["top_logprobs"], "top_logprobs")]  # fmt: skip
        return "; ".join(parts)


def _logprobs_cases() -> list[KitCase]:
    specs = [
        ("n=1,k=0", 1, 301, [0], 0, False),
        ("n=4,rows=3,k=5,ties", 4, 301, [2, 0, 1], 5, True),
        ("n=3,k=20,vocab=70001", 3, 70001, [0, 1, 2], 20, False),
        ("n=2,k=vocab", 2, 7, [1], 7, False),
    ]
    return [
        _case("logprobs", label, "F32", _logprobs, n=n, vocab=v, rows=r, k=k, edges=e)
        for label, n, v, r, k, e in specs
    ]


# --------------------------------------------------------------------------- the cases


def _case(unit: str, label: str, dtype: str, fn: Callable[..., str], **kw: Any) -> KitCase:
    category = "core" if unit in CORE_METHODS else "op"
    title = f"{category} {unit}[{label}]"
    return KitCase(category, unit, label, dtype, partial(_bound, unit, fn, title, kw))


def _bound(
    unit: str, fn: Callable[..., str], title: str, kw: dict[str, Any], ctx: KitContext
) -> str:
    if unit not in OPS:
        return fn(ctx, title, **kw)
    how = how_it_runs(ctx.backend, unit, kw.get("wtype", ""))
    return f"{fn(ctx, title, **kw)}; {how}"


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
    # The bound just past the last position (a class that fits), past it (a class with
    # room to grow), and the layout's max_len (the largest the op takes).
    for label, layout, layer, heads, slots, pos, context in (
        ("n=1,tight", at, 1, 4, [2], [6], 7),
        ("n=1,room", wide, 0, 8, [1], [2], 8),
        ("n=1,max-len", at, 0, 4, [1], [12], 13),
        ("n=7,3-slots,prefill+decode", at, 1, 4, [0, 0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 9, 12], 13),
        ("n=3,gqa-4,hd=64", wide, 0, 8, [0, 0, 1], [5, 6, 2], 7),
    ):
        cases.append(
            _case("attention_bounded", label, "F32", _attention, layout=layout, layer=layer,
                  n_heads=heads, slots=slots, pos=pos, context=context)
        )  # fmt: skip
    neox = RopeParams(16, 1e6, RopeStyle.neox)
    for label, layout, layer, heads, params, slots, pos in (
        ("normal,n=1,last-pos", kv, 1, 4, RopeParams(16), [2], [10]),
        ("neox,n=5,3-slots", kv, 0, 4, neox, [0, 0, 0, 1, 2], [0, 1, 2, 5, 10]),
        ("normal,n=3,no-gqa,hd=64", wide, 0, 2, RopeParams(64, 500000.0), [1, 1, 0], [6, 7, 8]),
    ):
        cases.append(
            _case("rope_kv_store", label, "F32", _rope_kv_store, layout=layout, layer=layer,
                  n_heads=heads, params=params, slots=slots, pos=pos)
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
    return [_case("sample", label, "F32", _sample, seed=label, rows=rows) for label, rows in specs]


def op_cases() -> list[KitCase]:
    """Every op case in :data:`vt.protocol.ops.OPS` order, then the core methods' cases."""
    cases: list[KitCase] = []
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
    cases += [
        _case("silu_mul", f"{n}x{d}", "F32", _silu_mul, n=n, dim=d) for n, d in ((1, 1), (7, 143))
    ]
    adds = (("1x1", 1, 1, False), ("7x143", 7, 143, False), ("7x143,in-place", 7, 143, True))
    cases += [_case("add", lb, "F32", _add, n=n, dim=d, in_place=ip) for lb, n, d, ip in adds]
    cases += [
        _case("gather_rows", f"n={len(r)},dim=67", "F32", _gather_rows, m=5, dim=67, rows=r)
        for r in ([3], [4, 0, 4, 2])
    ]
    cases += _sample_cases()
    cases += _logprobs_cases()
    cases += [
        _case("prefetch", f"{wt},then-swiglu,n=1,37x{in_features(wt)}", wt, _swiglu, wtype=wt,
              n=1, ffn=37, prefetch=True)
        for wt in ("Q8_0", "F32")
    ]  # fmt: skip
    # fused ops: run natively, or as their decomposition where the backend lacks them
    cases += [
        _case("matmul_add", f"{wt},n=5,37x{in_features(wt)},in-place", wt, _matmul_add,
              wtype=wt, n=5, out_f=37, in_place=True)
        for wt in WEIGHT_TYPES
    ]  # fmt: skip
    cases.append(
        _case("matmul_add", "F32,n=1,37x67", "F32", _matmul_add, wtype="F32", n=1, out_f=37,
              in_place=False)
    )  # fmt: skip
    cases += [
        _case("swiglu", f"{wt},n=5,37x{in_features(wt)}", wt, _swiglu, wtype=wt, n=5, ffn=37)
        for wt in WEIGHT_TYPES
    ]
    cases.append(_case("swiglu", "F32,n=1,37x67", "F32", _swiglu, wtype="F32", n=1, ffn=37))
    cases += [
        _case("qkv", f"{wt},n=5,(37,13,13)x{in_features(wt)}", wt, _qkv, wtype=wt, n=5,
              dims=(37, 13, 13), bias=False)
        for wt in WEIGHT_TYPES
    ]  # fmt: skip
    cases.append(
        _case("qkv", "F32,n=1,(48,16,16)x67,bias", "F32", _qkv, wtype="F32", n=1,
              dims=(48, 16, 16), bias=True)
    )  # fmt: skip
    cases.append(
        _case("qkv", "Q8_0,n=3,(64,16,24)x96,bias", "Q8_0", _qkv, wtype="Q8_0", n=3,
              dims=(64, 16, 24), bias=True)
    )  # fmt: skip
    # one row (a GPU's fused kernel) for every weight type; several rows, neox, biases
    qkv_kv = KVLayout(n_layers=2, n_slots=3, max_len=16, n_kv_heads=2, head_dim=16)
    neox = RopeParams(16, 1e6, RopeStyle.neox)
    cases += [
        _case("qkv_rope_kv_store", f"{wt},n=1,normal", wt, _qkv_rope_kv_store, wtype=wt,
              layout=qkv_kv, n_heads=4, params=RopeParams(16), slots=[2], pos=[9],
              bias=False)
        for wt in WEIGHT_TYPES
    ]  # fmt: skip
    cases.append(
        _case("qkv_rope_kv_store", "Q8_0,n=1,neox,bias", "Q8_0", _qkv_rope_kv_store,
              wtype="Q8_0", layout=qkv_kv, n_heads=4, params=neox, slots=[0], pos=[15],
              bias=True)
    )  # fmt: skip
    cases.append(
        _case("qkv_rope_kv_store", "F32,n=4,3-slots,neox,bias", "F32", _qkv_rope_kv_store,
              wtype="F32", layout=qkv_kv, n_heads=8, params=neox, slots=[0, 0, 1, 2],
              pos=[3, 4, 0, 11], bias=True)
    )  # fmt: skip
    # the norm folded in: one row (a GPU's gemv kernels) per weight type; several rows
    cases += [
        _case("rms_norm_qkv_rope_kv_store", f"{wt},n=1,normal", wt, _qkv_rope_kv_store,
              wtype=wt, layout=qkv_kv, n_heads=4, params=RopeParams(16), slots=[2], pos=[9],
              bias=False, norm=True)
        for wt in WEIGHT_TYPES
    ]  # fmt: skip
    cases.append(
        _case("rms_norm_qkv_rope_kv_store", "Q4_K,n=3,neox,bias", "Q4_K", _qkv_rope_kv_store,
              wtype="Q4_K", layout=qkv_kv, n_heads=4, params=neox, slots=[0, 1, 1],
              pos=[15, 2, 3], bias=True, norm=True)
    )  # fmt: skip
    cases += [
        _case("rms_norm_swiglu", f"{wt},n=1,37x{in_features(wt)}", wt, _swiglu, wtype=wt,
              n=1, ffn=37, norm=True)
        for wt in WEIGHT_TYPES
    ]  # fmt: skip
    cases.append(
        _case("rms_norm_swiglu", "Q8_0,n=5,37x96", "Q8_0", _swiglu, wtype="Q8_0", n=5, ffn=37,
              norm=True)
    )  # fmt: skip
    # the next layer's norm in the projection's epilogue: one row (a GPU's gemv kernel) per
    # weight type, in place as the model runs it; several rows; out apart from residual
    cases += [
        _case("matmul_add_rms_norm", f"{wt},n=1,37x{in_features(wt)},in-place", wt,
              _matmul_add, wtype=wt, n=1, out_f=37, in_place=True, norm=True)
        for wt in WEIGHT_TYPES
    ]  # fmt: skip
    cases.append(
        _case("matmul_add_rms_norm", "Q8_0,n=5,37x96,in-place", "Q8_0", _matmul_add,
              wtype="Q8_0", n=5, out_f=37, in_place=True, norm=True)
    )  # fmt: skip
    cases.append(
        _case("matmul_add_rms_norm", "F32,n=1,37x67", "F32", _matmul_add, wtype="F32", n=1,
              out_f=37, in_place=False, norm=True)
    )  # fmt: skip
    # the projection and the op after its norm as one op: one row (a GPU's gemv kernels)
    # per weight type; several rows
    cases += [
        _case("matmul_add_rms_norm_swiglu", f"{wt},n=1,37x{in_features(wt)}", wt, _proj_norm,
              wtype=wt, n=1, then="swiglu", ffn=37)
        for wt in WEIGHT_TYPES
    ]  # fmt: skip
    cases.append(
        _case("matmul_add_rms_norm_swiglu", "Q8_0,n=5,37x96", "Q8_0", _proj_norm,
              wtype="Q8_0", n=5, then="swiglu", ffn=37)
    )  # fmt: skip
    cases += [
        _case("matmul_add_rms_norm_qkv_rope_kv_store", f"{wt},n=1,neox", wt, _proj_norm,
              wtype=wt, n=1, then="qkv", layout=qkv_kv, n_heads=4, params=neox, slots=[2],
              pos=[9])
        for wt in WEIGHT_TYPES
    ]  # fmt: skip
    cases.append(
        _case("matmul_add_rms_norm_qkv_rope_kv_store", "Q8_0,n=1,neox,bias", "Q8_0", _proj_norm,
              wtype="Q8_0", n=1, then="qkv", layout=qkv_kv, n_heads=4, params=neox, slots=[1],
              pos=[4], bias=True)
    )  # fmt: skip
    cases.append(
        _case("matmul_add_rms_norm_qkv_rope_kv_store", "Q4_K,n=3,normal", "Q4_K", _proj_norm,
              wtype="Q4_K", n=3, then="qkv", layout=qkv_kv, n_heads=4, params=RopeParams(16),
              slots=[0, 1, 1], pos=[15, 2, 3])
    )  # fmt: skip
    cases.sort(key=lambda c: list(OPS).index(c.unit))  # table order (stable)
    # core methods
    cases += [
        _case("upload_weight", f"{wt},37x{in_features(wt)}", wt, _upload_matrix, wtype=wt,
              rows=37, cols=in_features(wt))
        for wt in WEIGHT_TYPES
    ]  # fmt: skip
    cases.append(_case("upload_weight", "F32,vector-67", "F32", _upload_vector, n=67))
    cases += [
        _case("copy_d2d", "1001-bytes,offsets", "bytes", _copy_d2d, size=4096, nbytes=1001,
              src_at=3, dst_at=5),
        _case("copy_d2d", "4-bytes,at-end", "bytes", _copy_d2d, size=64, nbytes=4, src_at=0,
              dst_at=60),
    ]  # fmt: skip
    return cases
