"""The op table: every operation a model step asks of a backend.

Each :class:`OpDef` has a name, a typed signature (tensors with dtype and symbolic shape,
weights, scalar attributes), its reference implementation in :mod:`vt.reference` and, for
a fused op, its decomposition into other ops. A backend implements an op as a method
``op_<name>(stream, **args)``; :meth:`vt.Backend.launch` checks the arguments against the
signature once, for every backend, then calls the backend, or runs the decomposition of a
fused op the backend lacks. A primitive op that a backend lacks refuses the model
(:func:`missing_ops`).

Scratch arguments belong to fused ops: the caller allocates them so that a decomposition
never allocates (a step must stay capturable in a graph); a native implementation may
ignore them. A collective (an ``all_reduce`` over a device group for tensor parallelism)
fits the same table: an ``inout`` tensor plus a ``group`` attribute.

An *optional* op (``fallback`` set) is one no model needs: a backend that lacks it runs
every model, and the runner does what ``fallback`` says instead (``logprobs``: the host
computes them from a copy of the logits). It is never "missing" (:func:`op_plan` says
``fallback``), and the conformance kit reports it "not declared" where a backend lacks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..errors import KernelNotImplementedError
from ..reference import kernels as K
from ..reference.sampling import logprobs_op as _logprobs
from ..reference.sampling import sample as _sample
from .handles import F32, I32, SAMPLE_PARAMS_DTYPE, KVLayout, RopeParams, Tensor, Weight

if TYPE_CHECKING:
    from .handles import Stream

ArgKind = Literal["in", "out", "inout", "scratch", "weight", "attr"]
TENSOR_KINDS: frozenset[str] = frozenset({"in", "out", "inout", "scratch"})
DTYPES: dict[str, np.dtype] = {"f32": F32, "i32": I32, "sample_params": SAMPLE_PARAMS_DTYPE}

#: A function that launches an op by name (``Backend.launch`` bound to a backend).
Launch = Callable[..., None]


@dataclass(frozen=True)
class Arg:
    """One argument of an op. ``shape`` names each dimension; a name used twice must
    have one value in a call (``("n", "in")`` for ``x`` and ``("out", "in")`` for a weight)."""

    name: str
    kind: ArgKind
    dtype: str = ""  # a key of DTYPES for tensors; "" for weights and attributes
    shape: tuple[str, ...] = ()
    optional: bool = False
    doc: str = ""

    @property
    def is_tensor(self) -> bool:
        return self.kind in TENSOR_KINDS


@dataclass(frozen=True)
class OpDef:
    """An op: signature, reference, and (fused ops only) a decomposition."""

    name: str
    doc: str
    args: tuple[Arg, ...]
    reference: Callable[[dict[str, Any]], None]
    decompose: Callable[[Launch, Stream, dict[str, Any]], None] | None = None
    parts: tuple[str, ...] = ()  # the ops the decomposition launches
    check: Callable[[dict[str, Any]], str | None] | None = None  # cross-argument rule
    fallback: str = ""  # optional ops only: what the caller does on a backend without it

    @property
    def fused(self) -> bool:
        return self.decompose is not None

    @property
    def optional(self) -> bool:
        return bool(self.fallback)

    @property
    def weights(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args if a.kind == "weight")

    def arg(self, name: str) -> Arg:
        for a in self.args:
            if a.name == name:
                return a
        raise KeyError(name)

    @cached_property
    def _plan(self) -> tuple[frozenset[str], tuple[tuple[Arg, np.dtype | None, int], ...]]:
        """What :meth:`bind` walks, computed once: the argument names, and each argument
        with its numpy dtype (tensors) and number of dimensions."""
        names = frozenset(a.name for a in self.args)
        return names, tuple((a, DTYPES.get(a.dtype), len(a.shape)) for a in self.args)

    def bind(self, args: Mapping[str, Any]) -> dict[str, int]:
        """Check ``args`` against the signature; returns the value of each shape symbol.

        Raises ``ValueError``/``TypeError`` naming the op and the argument. It runs on
        every launch (about 600 per decode step of a 30-layer model), so it is kept lean.
        """
        names, plan = self._plan
        if not names.issuperset(args):
            unknown = sorted(set(args) - names)
            raise TypeError(f"op {self.name}: unknown argument(s) {', '.join(unknown)}")
        dims: dict[str, int] = {}
        for a, want, ndim in plan:
            value = args.get(a.name)
            if value is None:
                if not a.optional:
                    raise TypeError(f"op {self.name}: missing argument {a.name!r}")
                continue
            kind = a.kind
            if kind == "attr":
                continue
            if kind == "weight":
                if not isinstance(value, Weight):
                    raise TypeError(f"op {self.name}: {a.name} must be a vt.Weight")
                if value.handle is None:
                    raise ValueError(f"op {self.name}: weight {value.name!r} was freed")
                shape = tuple(value.shape)
            else:
                if not isinstance(value, Tensor):
                    raise TypeError(f"op {self.name}: {a.name} must be a vt.Tensor")
                dtype = value.dtype
                if dtype is not want and dtype != want:  # numpy's own dtypes are singletons
                    raise TypeError(
                        f"op {self.name}: {a.name} has dtype {value.dtype}, expected {a.dtype}"
                    )
                shape = value.shape
                if dtype.itemsize * math.prod(shape) > value.buffer.nbytes:
                    raise ValueError(
                        f"op {self.name}: {a.name} of shape {value.shape} needs {value.nbytes} "
                        f"bytes, its buffer has {value.buffer.nbytes}"
                    )
            if len(shape) != ndim:
                what = a.name if kind != "weight" else f"weight {a.name} ({value.name!r})"
                raise ValueError(
                    f"op {self.name}: {what} has shape {shape}, expected {ndim} "
                    f"dimensions {a.shape}"
                )
            for sym, size in zip(a.shape, shape):  # noqa: B905 - lengths checked above
                if dims.setdefault(sym, size) != size:
                    what = a.name if kind != "weight" else f"weight {a.name} ({value.name!r})"
                    raise ValueError(
                        f"op {self.name}: {what} has {sym}={size}, but another argument "
                        f"has {sym}={dims[sym]}"
                    )
        if self.check is not None:
            problem = self.check(dict(args))
            if problem:
                raise ValueError(f"op {self.name}: {problem}")
        return dims


# --------------------------------------------------------------------------- checks


def _rope_check(a: dict[str, Any]) -> str | None:
    params: RopeParams = a["params"]
    width = a["x"].shape[1]
    if width != a["n_heads"] * params.head_dim:
        return f"x has {width} columns, n_heads {a['n_heads']} x head_dim {params.head_dim} needed"
    return None


def _cache_check(a: dict[str, Any], row: str, heads: int | None = None) -> str | None:
    layout: KVLayout = a["layout"]
    if tuple(a["cache"].shape) != layout.shape:
        return f"cache has shape {a['cache'].shape}, the layout {layout.shape}"
    if not 0 <= a["layer"] < layout.n_layers:
        return f"layer {a['layer']} is out of range [0, {layout.n_layers})"
    width = a[row].shape[1]
    per_row = (heads or layout.n_kv_heads) * layout.head_dim
    if width != per_row:
        return f"{row} has {width} columns, the layout needs {per_row}"
    return None


def _attention_check(a: dict[str, Any]) -> str | None:
    n_kv = a["layout"].n_kv_heads
    if a["n_heads"] <= 0 or a["n_heads"] % n_kv:
        return f"n_heads {a['n_heads']} is not a multiple of n_kv_heads {n_kv}"
    return _cache_check(a, "q", a["n_heads"])


def _attention_bounded_check(a: dict[str, Any]) -> str | None:
    max_len, context = a["layout"].max_len, a["context"]
    if not isinstance(context, int) or isinstance(context, bool):
        return f"context must be an int (a bound in positions), got {context!r}"
    if not 0 < context <= max_len:
        return f"context {context} is out of range [1, {max_len}] (the layout's max_len)"
    return _attention_check(a)


def _rope_kv_check(a: dict[str, Any]) -> str | None:
    problem = _attention_check({**a, "q": a["q"]})
    if problem or a["params"].head_dim != a["layout"].head_dim:
        return problem or "rope head_dim differs from the layout's head_dim"
    return _cache_check(a, "k")


def _logprobs_check(a: dict[str, Any]) -> str | None:
    k, vocab = a["top_ids"].shape[1], a["logits"].shape[1]
    if k > vocab:
        return f"k={k} alternatives exceed the vocabulary of {vocab}"
    return None


# --------------------------------------------------------------------------- references


def _ref_attention_bounded(a: dict[str, Any]) -> None:
    positions = np.asarray(a["positions"])
    if positions.size and int(positions.max()) >= a["context"]:
        raise ValueError(
            f"attention_bounded: position {int(positions.max())} is past the context bound "
            f"{a['context']}"
        )
    K.attention(a["q"], a["cache"], a["layout"], a["layer"], a["slots"], a["positions"],
                a["n_heads"], a["scale"], out=a["out"])  # fmt: skip


def _ref_matmul_add(a: dict[str, Any]) -> None:
    K.add(a["residual"], K.matmul(a["x"], a["weight"]), out=a["out"])


def _ref_swiglu(a: dict[str, Any]) -> None:
    K.silu_mul(K.matmul(a["x"], a["gate"]), K.matmul(a["x"], a["up"]), out=a["out"])


def _ref_qkv(a: dict[str, Any]) -> None:
    for out, w, b in (("q", "wq", "bq"), ("k", "wk", "bk"), ("v", "wv", "bv")):
        K.matmul(a["x"], a[w], a.get(b), out=a[out])


def _ref_rope_kv_store(a: dict[str, Any]) -> None:
    layout: KVLayout = a["layout"]
    K.rope(a["q"], a["positions"], a["n_heads"], a["params"], out=a["q"])
    K.rope(a["k"], a["positions"], layout.n_kv_heads, a["params"], out=a["k"])
    K.kv_store(a["cache"], a["layer"], a["k"], a["v"], a["slots"], a["positions"])


def _ref_qkv_rope_kv_store(a: dict[str, Any]) -> None:
    _ref_qkv(a)
    _ref_rope_kv_store(a)


def _normed(a: dict[str, Any]) -> dict[str, Any]:
    """The arguments with ``x`` replaced by rms_norm(x) (the reference of the norm ops)."""
    return {**a, "x": K.rms_norm(a["x"], a["norm"], a["eps"])}


def _ref_rms_norm_qkv_rope_kv_store(a: dict[str, Any]) -> None:
    _ref_qkv_rope_kv_store(_normed(a))


def _ref_rms_norm_swiglu(a: dict[str, Any]) -> None:
    _ref_swiglu(_normed(a))


def _ref_matmul_add_rms_norm(a: dict[str, Any]) -> None:
    _ref_matmul_add(a)
    K.rms_norm(a["out"], a["norm"], a["eps"], out=a["normed"])


def _ref_matmul_add_rms_norm_swiglu(a: dict[str, Any]) -> None:
    _ref_matmul_add(a)
    _ref_rms_norm_swiglu({**a, "out": a["act"], "x": a["out"]})


def _ref_matmul_add_rms_norm_qkv_rope_kv_store(a: dict[str, Any]) -> None:
    _ref_matmul_add(a)
    _ref_rms_norm_qkv_rope_kv_store({**a, "x": a["out"]})


# --------------------------------------------------------------------------- decompositions


def _dec_matmul_add(launch: Launch, stream: Stream, a: dict[str, Any]) -> None:
    launch("matmul", stream, out=a["scratch"], x=a["x"], weight=a["weight"])
    launch("add", stream, out=a["out"], a=a["residual"], b=a["scratch"])


def _dec_swiglu(launch: Launch, stream: Stream, a: dict[str, Any]) -> None:
    launch("matmul", stream, out=a["scratch_gate"], x=a["x"], weight=a["gate"])
    launch("matmul", stream, out=a["scratch_up"], x=a["x"], weight=a["up"])
    launch("silu_mul", stream, out=a["out"], gate=a["scratch_gate"], up=a["scratch_up"])


def _dec_qkv(launch: Launch, stream: Stream, a: dict[str, Any]) -> None:
    for out, w, b in (("q", "wq", "bq"), ("k", "wk", "bk"), ("v", "wv", "bv")):
        launch("matmul", stream, out=a[out], x=a["x"], weight=a[w], bias=a.get(b))


def _dec_rope_kv_store(launch: Launch, stream: Stream, a: dict[str, Any]) -> None:
    layout: KVLayout = a["layout"]
    pos, params = a["positions"], a["params"]
    launch("rope", stream, x=a["q"], positions=pos, n_heads=a["n_heads"], params=params)
    launch("rope", stream, x=a["k"], positions=pos, n_heads=layout.n_kv_heads, params=params)
    launch(
        "kv_store", stream, cache=a["cache"], k=a["k"], v=a["v"], slots=a["slots"],
        positions=pos, layout=layout, layer=a["layer"],
    )  # fmt: skip


_QKV_ARGS = ("q", "k", "v", "x", "wq", "wk", "wv", "bq", "bk", "bv")
_ROPE_KV_ARGS = ("q", "k", "v", "positions", "slots", "cache", "layout", "layer", "n_heads",
                 "params")  # fmt: skip


def _dec_qkv_rope_kv_store(launch: Launch, stream: Stream, a: dict[str, Any]) -> None:
    launch("qkv", stream, **{n: a.get(n) for n in _QKV_ARGS})
    launch("rope_kv_store", stream, **{n: a[n] for n in _ROPE_KV_ARGS})


def _dec_attention_bounded(launch: Launch, stream: Stream, a: dict[str, Any]) -> None:
    launch("attention", stream, **{n: v for n, v in a.items() if n != "context"})


def _norm_first(launch: Launch, stream: Stream, a: dict[str, Any]) -> dict[str, Any]:
    """rms_norm(x) into ``scratch``; the arguments of the op that follows it."""
    launch("rms_norm", stream, out=a["scratch"], x=a["x"], weight=a["norm"], eps=a["eps"])
    rest = {n: v for n, v in a.items() if n not in ("norm", "eps", "scratch")}
    return {**rest, "x": a["scratch"]}


def _dec_rms_norm_qkv_rope_kv_store(launch: Launch, stream: Stream, a: dict[str, Any]) -> None:
    launch("qkv_rope_kv_store", stream, **_norm_first(launch, stream, a))


def _dec_rms_norm_swiglu(launch: Launch, stream: Stream, a: dict[str, Any]) -> None:
    launch("swiglu", stream, **_norm_first(launch, stream, a))


def _dec_matmul_add_rms_norm(launch: Launch, stream: Stream, a: dict[str, Any]) -> None:
    launch("matmul_add", stream, out=a["out"], x=a["x"], weight=a["weight"],
           residual=a["residual"], scratch=a["scratch"])  # fmt: skip
    launch("rms_norm", stream, out=a["normed"], x=a["out"], weight=a["norm"], eps=a["eps"])


def _matmul_add_first(launch: Launch, stream: Stream, a: dict[str, Any]) -> dict[str, Any]:
    """matmul_add into ``out``; the arguments of the norm op that follows it (its x is
    ``out``, its scratch ``scratch_norm``)."""
    launch("matmul_add", stream, out=a["out"], x=a["x"], weight=a["weight"],
           residual=a["residual"], scratch=a["scratch"])  # fmt: skip
    rest = {n: v for n, v in a.items() if n not in ("x", "weight", "residual", "scratch_norm")}
    return {**rest, "x": a["out"], "scratch": a["scratch_norm"]}


def _dec_matmul_add_rms_norm_swiglu(launch: Launch, stream: Stream, a: dict[str, Any]) -> None:
    rest = _matmul_add_first(launch, stream, a)
    rest["out"] = rest.pop("act")
    launch("rms_norm_swiglu", stream, **rest)


def _dec_matmul_add_rms_norm_qkv_rope_kv_store(
    launch: Launch, stream: Stream, a: dict[str, Any]
) -> None:
    rest = _matmul_add_first(launch, stream, a)
    del rest["out"]
    launch("rms_norm_qkv_rope_kv_store", stream, **rest)


# --------------------------------------------------------------------------- the table

_CACHE = ("max_len", "n_slots", "n_layers", "kv", "n_kv_heads", "head_dim")


def _t(name: str, kind: ArgKind, shape: tuple[str, ...], dtype: str = "f32", **kw: Any) -> Arg:
    return Arg(name, kind, dtype, shape, **kw)


def _w(name: str, shape: tuple[str, ...], **kw: Any) -> Arg:
    return Arg(name, "weight", "", shape, **kw)


def _attr(name: str, doc: str) -> Arg:
    return Arg(name, "attr", doc=doc)


#: qkv_rope_kv_store's arguments; the norm op's are these with _NORM_ARGS after x.
_QKV_ROPE_KV_ARGS: tuple[Arg, ...] = (
    _t("q", "out", ("n", "q_dim")), _t("k", "out", ("n", "kv_dim")),
    _t("v", "out", ("n", "kv_dim")), _t("x", "in", ("n", "dim")),
    _w("wq", ("q_dim", "dim")), _w("wk", ("kv_dim", "dim")),
    _w("wv", ("kv_dim", "dim")), _w("bq", ("q_dim",), optional=True),
    _w("bk", ("kv_dim",), optional=True), _w("bv", ("kv_dim",), optional=True),
    _t("positions", "in", ("n",), "i32"), _t("slots", "in", ("n",), "i32"),
    _t("cache", "inout", _CACHE), _attr("layout", "vt.KVLayout"),
    _attr("layer", "int"), _attr("n_heads", "int: query heads"),
    _attr("params", "vt.RopeParams"),
)  # fmt: skip
#: The rms_norm_* ops' norm: rms_norm's weight and eps.
_NORM_ARGS: tuple[Arg, ...] = (
    _w("norm", ("dim",)),
    _attr("eps", "float: added to the mean square"),
)

#: The matmul_add_rms_norm_* ops' projection: out = residual + x @ weight.T, whose
#: rms_norm (norm, eps) the op after it takes.
_PROJ_NORM_ARGS: tuple[Arg, ...] = (
    _t("out", "out", ("n", "dim")), _t("x", "in", ("n", "in_f")),
    _w("weight", ("dim", "in_f")), _t("residual", "in", ("n", "dim")), *_NORM_ARGS,
)  # fmt: skip
_PROJ_NORM_SCRATCH: tuple[Arg, ...] = (
    _t("scratch", "scratch", ("n", "dim"), doc="the decomposition's product"),
    _t("scratch_norm", "scratch", ("n", "dim"), doc="the decomposition's rms_norm(out)"),
)

OPS: dict[str, OpDef] = {
    op.name: op
    for op in (
        OpDef(
            "embedding",
            "out[i] = table[ids[i]], dequantized to float32",
            (_t("out", "out", ("n", "dim")), _t("ids", "in", ("n",), "i32"),
             _w("table", ("vocab", "dim"))),
            lambda a: K.embedding(a["table"], a["ids"], out=a["out"]),
        ),
        OpDef(
            "rms_norm",
            "out[i] = x[i] / sqrt(mean(x[i]**2) + eps) * weight",
            (_t("out", "out", ("n", "dim")), _t("x", "in", ("n", "dim")), _w("weight", ("dim",)),
             _attr("eps", "float: added to the mean square")),
            lambda a: K.rms_norm(a["x"], a["weight"], a["eps"], out=a["out"]),
        ),
        OpDef(
            "matmul",
            "out = x @ weight.T (+ bias); a weight row is one output feature",
            (_t("out", "out", ("n", "out_f")), _t("x", "in", ("n", "in_f")),
             _w("weight", ("out_f", "in_f")), _w("bias", ("out_f",), optional=True)),
            lambda a: K.matmul(a["x"], a["weight"], a.get("bias"), out=a["out"]),
        ),
        OpDef(
            "rope",
            "rotate x[n, n_heads * head_dim] in place by each row's position",
            (_t("x", "inout", ("n", "width")), _t("positions", "in", ("n",), "i32"),
             _attr("n_heads", "int"), _attr("params", "vt.RopeParams: style, base, scaling")),
            lambda a: K.rope(a["x"], a["positions"], a["n_heads"], a["params"], out=a["x"]),
            check=_rope_check,
        ),
        OpDef(
            "kv_store",
            "write k[i], v[i] at cache position positions[i] of slot slots[i]",
            (_t("cache", "inout", _CACHE), _t("k", "in", ("n", "kv_dim")),
             _t("v", "in", ("n", "kv_dim")), _t("slots", "in", ("n",), "i32"),
             _t("positions", "in", ("n",), "i32"), _attr("layout", "vt.KVLayout"),
             _attr("layer", "int")),
            lambda a: K.kv_store(a["cache"], a["layer"], a["k"], a["v"], a["slots"],
                                 a["positions"]),
            check=lambda a: _cache_check(a, "k"),
        ),
        OpDef(
            "attention",
            "causal attention of q over positions 0..positions[i] of slot slots[i]; "
            "query head h reads KV head h // (n_heads // n_kv_heads)",
            (_t("out", "out", ("n", "q_dim")), _t("q", "in", ("n", "q_dim")),
             _t("cache", "in", _CACHE), _t("slots", "in", ("n",), "i32"),
             _t("positions", "in", ("n",), "i32"), _attr("layout", "vt.KVLayout"),
             _attr("layer", "int"), _attr("n_heads", "int"), _attr("scale", "float")),
            lambda a: K.attention(a["q"], a["cache"], a["layout"], a["layer"], a["slots"],
                                  a["positions"], a["n_heads"], a["scale"], out=a["out"]),
            check=_attention_check,
        ),
        OpDef(
            "silu_mul",
            "out = silu(gate) * up, elementwise",
            (_t("out", "out", ("n", "dim")), _t("gate", "in", ("n", "dim")),
             _t("up", "in", ("n", "dim"))),
            lambda a: K.silu_mul(a["gate"], a["up"], out=a["out"]),
        ),
        OpDef(
            "add",
            "out = a + b, elementwise (out may alias a)",
            (_t("out", "out", ("n", "dim")), _t("a", "in", ("n", "dim")),
             _t("b", "in", ("n", "dim"))),
            lambda a: K.add(a["a"], a["b"], out=a["out"]),
        ),
        OpDef(
            "gather_rows",
            "out[i] = x[rows[i]]",
            (_t("out", "out", ("r", "dim")), _t("x", "in", ("n", "dim")),
             _t("rows", "in", ("r",), "i32")),
            lambda a: K.gather_rows(a["x"], a["rows"], out=a["out"]),
        ),
        OpDef(
            "sample",
            "one int32 id per row of logits; params holds one vt.SAMPLE_PARAMS_DTYPE record "
            "per row; the draw must equal vt.reference.sample",
            (_t("out", "out", ("r",), "i32"), _t("logits", "in", ("r", "vocab")),
             _t("params", "in", ("r",), "sample_params")),
            lambda a: _sample(a["logits"], a["params"], out=a["out"]),
        ),
        # ---- optional ops: a backend that lacks one runs every model (see ``fallback``)
        OpDef(
            "logprobs",
            "log-softmax of the raw logits of the rows ``rows`` (float64-faithful, rounded "
            "to float32): chosen[i] = the logprob of ids[rows[i]] (NaN where that id is "
            "outside the vocabulary); top_ids[i] / top_logprobs[i] = the k most likely ids "
            "and theirs, by (logprob desc, id asc; equal logits tie); ids equal to "
            "vt.reference.sampling.logprobs_op",
            (_t("chosen", "out", ("m",)), _t("top_ids", "out", ("m", "k"), "i32"),
             _t("top_logprobs", "out", ("m", "k")), _t("logits", "in", ("r", "vocab")),
             _t("ids", "in", ("r",), "i32"), _t("rows", "in", ("m",), "i32")),
            _logprobs,
            check=_logprobs_check,
            fallback="the runner copies the rows' logits to the host and computes them there "
            "(vt.reference.sampling.logprobs)",
        ),
        OpDef(
            "prefetch",
            "a hint with no outputs: the ops after the next attention read weight (with "
            "paired beside it, row for row: the feed-forward's gate and up), so a backend may "
            "start bringing it nearer (a GPU's L2) while attention waits on memory; it "
            "changes no tensor and no result",
            (_w("weight", ("out_f", "in_f")), _w("paired", ("out_f", "in_f"), optional=True)),
            lambda a: None,
            fallback="nothing: the graph launches it only where the backend declares it",
        ),
        # ---- fused ops: a backend that lacks one runs its decomposition
        OpDef(
            "matmul_add",
            "out = residual + x @ weight.T (the residual add in a projection's epilogue; "
            "out may alias residual)",
            (_t("out", "out", ("n", "out_f")), _t("x", "in", ("n", "in_f")),
             _w("weight", ("out_f", "in_f")), _t("residual", "in", ("n", "out_f")),
             _t("scratch", "scratch", ("n", "out_f"))),
            _ref_matmul_add,
            _dec_matmul_add,
            ("matmul", "add"),
        ),
        OpDef(
            "swiglu",
            "out = silu(x @ gate.T) * (x @ up.T) (the feed-forward's gate and up projections "
            "with the SiLU-mul epilogue)",
            (_t("out", "out", ("n", "ffn")), _t("x", "in", ("n", "dim")),
             _w("gate", ("ffn", "dim")), _w("up", ("ffn", "dim")),
             _t("scratch_gate", "scratch", ("n", "ffn")),
             _t("scratch_up", "scratch", ("n", "ffn"))),
            _ref_swiglu,
            _dec_swiglu,
            ("matmul", "silu_mul"),
        ),
        OpDef(
            "rope_kv_store",
            "rope(q) and rope(k) in place, then store k and v in the cache",
            (_t("q", "inout", ("n", "q_dim")), _t("k", "inout", ("n", "kv_dim")),
             _t("v", "in", ("n", "kv_dim")), _t("positions", "in", ("n",), "i32"),
             _t("slots", "in", ("n",), "i32"), _t("cache", "inout", _CACHE),
             _attr("layout", "vt.KVLayout"), _attr("layer", "int"),
             _attr("n_heads", "int: query heads"), _attr("params", "vt.RopeParams")),
            _ref_rope_kv_store,
            _dec_rope_kv_store,
            ("rope", "kv_store"),
            check=_rope_kv_check,
        ),
        OpDef(
            "qkv",
            "q, k, v = x @ wq.T (+ bq), x @ wk.T (+ bk), x @ wv.T (+ bv) (the attention's "
            "three input projections as one op)",
            (_t("q", "out", ("n", "q_dim")), _t("k", "out", ("n", "k_dim")),
             _t("v", "out", ("n", "v_dim")), _t("x", "in", ("n", "dim")),
             _w("wq", ("q_dim", "dim")), _w("wk", ("k_dim", "dim")), _w("wv", ("v_dim", "dim")),
             _w("bq", ("q_dim",), optional=True), _w("bk", ("k_dim",), optional=True),
             _w("bv", ("v_dim",), optional=True)),
            _ref_qkv,
            _dec_qkv,
            ("matmul",),
        ),
        OpDef(
            "qkv_rope_kv_store",
            "qkv, then rope_kv_store of its q, k and v (the attention's input projections, "
            "RoPE and the KV store as one op: at one row a backend can rotate each pair of "
            "features as it computes them and store k and v straight into the cache)",
            _QKV_ROPE_KV_ARGS,
            _ref_qkv_rope_kv_store,
            _dec_qkv_rope_kv_store,
            ("qkv", "rope_kv_store"),
            check=_rope_kv_check,
        ),
        OpDef(
            "rms_norm_qkv_rope_kv_store",
            "rms_norm of x (norm, eps), then qkv_rope_kv_store of it (at one row a backend "
            "can normalise x inside the projections' kernel; scratch: the normalised x of "
            "the decomposition, left undefined)",
            (*_QKV_ROPE_KV_ARGS[:4], *_NORM_ARGS, *_QKV_ROPE_KV_ARGS[4:],
             _t("scratch", "scratch", ("n", "dim"))),
            _ref_rms_norm_qkv_rope_kv_store,
            _dec_rms_norm_qkv_rope_kv_store,
            ("rms_norm", "qkv_rope_kv_store"),
            check=_rope_kv_check,
        ),
        OpDef(
            "rms_norm_swiglu",
            "rms_norm of x (norm, eps), then swiglu of it (scratch: the normalised x of the "
            "decomposition, left undefined)",
            (_t("out", "out", ("n", "ffn")), _t("x", "in", ("n", "dim")), *_NORM_ARGS,
             _w("gate", ("ffn", "dim")), _w("up", ("ffn", "dim")),
             _t("scratch", "scratch", ("n", "dim")),
             _t("scratch_gate", "scratch", ("n", "ffn")),
             _t("scratch_up", "scratch", ("n", "ffn"))),
            _ref_rms_norm_swiglu,
            _dec_rms_norm_swiglu,
            ("rms_norm", "swiglu"),
        ),
        OpDef(
            "matmul_add_rms_norm",
            "matmul_add, then normed = rms_norm(out) (norm, eps): a projection's residual add "
            "with the next layer's norm in its epilogue, so the consumer of normed needs no "
            "norm of its own (at one row a backend can normalise in the projection's last "
            "block; scratch: the decomposition's product, left undefined; out may alias "
            "residual)",
            (_t("out", "out", ("n", "out_f")), _t("normed", "out", ("n", "out_f")),
             _t("x", "in", ("n", "in_f")), _w("weight", ("out_f", "in_f")),
             _t("residual", "in", ("n", "out_f")), _w("norm", ("out_f",)),
             _attr("eps", "float: added to the mean square"),
             _t("scratch", "scratch", ("n", "out_f"))),
            _ref_matmul_add_rms_norm,
            _dec_matmul_add_rms_norm,
            ("matmul_add", "rms_norm"),
        ),
        OpDef(
            "matmul_add_rms_norm_swiglu",
            "matmul_add into out, then act = rms_norm_swiglu of out (norm, eps): a layer's "
            "output projection with the feed-forward after it, so a backend can pass the "
            "norm's sum of squares from the projection's blocks to the gate and up "
            "projections' in any form (scratches: the decomposition's, left undefined; out "
            "may alias residual)",
            (*_PROJ_NORM_ARGS, _t("act", "out", ("n", "ffn")), _w("gate", ("ffn", "dim")),
             _w("up", ("ffn", "dim")), *_PROJ_NORM_SCRATCH,
             _t("scratch_gate", "scratch", ("n", "ffn")),
             _t("scratch_up", "scratch", ("n", "ffn"))),
            _ref_matmul_add_rms_norm_swiglu,
            _dec_matmul_add_rms_norm_swiglu,
            ("matmul_add", "rms_norm_swiglu"),
        ),
        OpDef(
            "matmul_add_rms_norm_qkv_rope_kv_store",
            "matmul_add into out, then rms_norm_qkv_rope_kv_store of out (norm, eps): a "
            "layer's down projection with the next layer's attention inputs, as "
            "matmul_add_rms_norm_swiglu pairs the output projection with the feed-forward "
            "(scratches: the decomposition's, left undefined; out may alias residual)",
            (*_PROJ_NORM_ARGS, *_QKV_ROPE_KV_ARGS[:3], *_QKV_ROPE_KV_ARGS[4:],
             *_PROJ_NORM_SCRATCH),
            _ref_matmul_add_rms_norm_qkv_rope_kv_store,
            _dec_matmul_add_rms_norm_qkv_rope_kv_store,
            ("matmul_add", "rms_norm_qkv_rope_kv_store"),
            check=_rope_kv_check,
        ),
        OpDef(
            "attention_bounded",
            "attention where every row's positions[i] < context (the runner's bound for the "
            "step: a context class of the backend's context_classes), so a backend may pick "
            "its kernels by the bound, and a graph captured at a bound stays right while the "
            "context grows up to it; decomposes to attention",
            (_t("out", "out", ("n", "q_dim")), _t("q", "in", ("n", "q_dim")),
             _t("cache", "in", _CACHE), _t("slots", "in", ("n",), "i32"),
             _t("positions", "in", ("n",), "i32"), _attr("layout", "vt.KVLayout"),
             _attr("layer", "int"), _attr("n_heads", "int"), _attr("scale", "float"),
             _attr("context", "int")),
            _ref_attention_bounded,
            _dec_attention_bounded,
            ("attention",),
            check=_attention_bounded_check,
        ),
    )
}  # fmt: skip

PRIMITIVE_OPS: tuple[str, ...] = tuple(
    n for n, op in OPS.items() if not op.fused and not op.optional
)
FUSED_OPS: tuple[str, ...] = tuple(n for n, op in OPS.items() if op.fused)
#: Ops no model needs; the caller falls back (``OpDef.fallback``) where a backend lacks one.
OPTIONAL_OPS: tuple[str, ...] = tuple(n for n, op in OPS.items() if op.optional)


def get_op(name: str) -> OpDef:
    """The op called ``name``; ``KeyError`` naming the known ops otherwise."""
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; the op table has {', '.join(OPS)}") from None


def closure(ops: Iterable[str], supports: Callable[[str], bool]) -> tuple[set[str], set[str]]:
    """``(native, missing)`` for running ``ops``: a fused op the backend lacks expands into
    its parts; a primitive op it lacks is missing."""
    native: set[str] = set()
    missing: set[str] = set()
    todo = list(ops)
    while todo:
        name = todo.pop()
        op = get_op(name)
        if supports(name):
            native.add(name)
        elif op.fused:
            todo.extend(op.parts)
        else:
            missing.add(name)
    return native, missing


def op_plan(supports: Callable[[str], bool]) -> dict[str, str]:
    """How a backend runs each op of the table: ``native``, ``decomposed`` (a fused op
    whose parts all run), ``fallback`` (an optional op it lacks: the caller's fallback
    runs) or ``missing``."""
    plan: dict[str, str] = {}
    for name, op in OPS.items():
        if supports(name):
            plan[name] = "native"
        elif op.optional:
            plan[name] = "fallback"
        elif op.fused and not closure([name], supports)[1]:
            plan[name] = "decomposed"
        else:
            plan[name] = "missing"
    return plan


def plan_text(plan: dict[str, str]) -> str:
    """One line: ``native: a, b; decomposed: c; fallback: d; missing: e`` (empty groups
    left out)."""
    groups = {kind: [n for n, k in plan.items() if k == kind] for kind in
              ("native", "decomposed", "fallback", "missing")}  # fmt: skip
    return "; ".join(f"{k}: {', '.join(v)}" for k, v in groups.items() if v) or "none"


def missing_ops(ops: Iterable[str], supports: Callable[[str], bool]) -> list[str]:
    """The primitive ops among ``ops`` (after decomposing unsupported fused ones) that
    ``supports`` says no to."""
    return sorted(closure(ops, supports)[1])


def require_ops(backend_name: str, what: str, ops: Iterable[str], supports: Any) -> None:
    """Raise :class:`vt.KernelNotImplementedError` naming every primitive op missing."""
    missing = missing_ops(ops, supports)
    if missing:
        raise KernelNotImplementedError(
            f"backend {backend_name!r} does not implement the op(s) {', '.join(missing)} "
            f"that {what} needs (see `vt backends --json` for its ops)"
        )
