"""The llama-family forward graph (``llama``, ``qwen2``, ``qwen3``) over the backend protocol.

The graph owns the uploaded weights and the activation buffers; it enqueues one step's
kernels on a stream and never touches the host. Every step is one flattened batch
(vLLM style): the tokens of all sequences are rows of one ``[n_tokens, dim]`` activation,
each row carrying its own position and KV slot, so decoding many sequences is one
matmul per projection. Only the rows that are sampled reach the output projection.

Per layer, as ops of :data:`vt.protocol.ops.OPS`::

    q, k, v = rms_norm_qkv_rope_kv_store(x, attn_norm, Wq, Wk, Wv)
                                                  (+ bias: qwen2) RoPE style from the config
                                                  qwen3, with a norm between the two:
    h = rms_norm(x)                               attn_norm
    q, k, v = qkv(h, Wq, Wk, Wv)
    q, k = rms_norm per head                      attn_q_norm, attn_k_norm
    rope_kv_store(q, k, v)
    a = attention(q)                              scale 1/sqrt(head_dim)
    x = matmul_add(a, Wo, residual=x)
    g = rms_norm_swiglu(x, ffn_norm, Wg, Wu)      silu(h @ Wg) * (h @ Wu), h = rms_norm(x)
    x = matmul_add(g, Wd, residual=x)

Where the backend runs ``matmul_add_rms_norm`` natively, the projections carry the next
norm in their epilogue instead: ``x, h = matmul_add_rms_norm(a, Wo, x, ffn_norm)`` then
``swiglu(h)``, and the down projection's with the next layer's attn_norm, whose
``qkv_rope_kv_store`` (or qwen3's ``qkv``) takes ``h`` (one kernel fewer a norm on a GPU).

then ``logits = matmul(rms_norm(gather_rows(x)), Wout)`` and ``sample``. The fused ops
(``rms_norm_qkv_rope_kv_store``, ``qkv_rope_kv_store``, ``qkv``, ``rope_kv_store``,
``matmul_add``, ``rms_norm_swiglu``, ``swiglu``) run as their decompositions on a backend
that lacks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import partial
from typing import TYPE_CHECKING, Any

from ..errors import ModelError
from ..protocol.backend import Backend, Buffer, KVLayout, Stream, Tensor, Weight
from ..protocol.handles import F32, I32, SAMPLE_PARAMS_DTYPE
from ..protocol.ops import require_ops

if TYPE_CHECKING:
    from collections.abc import Iterator

#: Architectures this graph runs (``general.architecture`` of the GGUF).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")

_LLAMA_OPS: tuple[str, ...] = (
    "embedding",
    "rms_norm",
    "rms_norm_qkv_rope_kv_store",
    "matmul",
    "attention",
    "attention_bounded",  # where the backend declares context_classes
    "matmul_add",
    "rms_norm_swiglu",
    "gather_rows",
    "sample",
)

#: The ops each architecture's forward pass launches (fused ones included).
ARCHITECTURE_OPS: dict[str, tuple[str, ...]] = {
    "llama": _LLAMA_OPS,
    "qwen2": _LLAMA_OPS,  # matmul with a bias for Q, K and V
    # rms_norm per head of Q and K, between the projections and RoPE
    "qwen3": tuple(o for o in _LLAMA_OPS if o != "rms_norm_qkv_rope_kv_store")
    + ("qkv", "rope_kv_store"),
}


def check_backend(backend: Backend, architecture: str = "llama") -> None:
    """Refuse a backend that lacks a primitive op the architecture needs, naming them all."""
    require_ops(
        backend.name, f"a {architecture} model", ARCHITECTURE_OPS[architecture], backend.supports
    )


@dataclass(eq=False)
class LayerWeights:
    """One transformer block's weights in the backend's format (None where absent)."""

    attn_norm: Weight
    wq: Weight
    wk: Weight
    wv: Weight
    wo: Weight
    ffn_norm: Weight
    w_gate: Weight
    w_up: Weight
    w_down: Weight
    bq: Weight | None = None
    bk: Weight | None = None
    bv: Weight | None = None
    q_norm: Weight | None = None
    k_norm: Weight | None = None

    def all(self) -> Iterator[Weight]:
        for f in fields(self):
            w = getattr(self, f.name)
            if w is not None:
                yield w


@dataclass(eq=False)
class Activations:
    """Every buffer a step's kernels use, allocated once for the largest step.

    ``x`` is the residual stream; ``h`` the normalised input of a projection and the
    output of the o/down projections before they are added back.
    """

    x: Buffer
    h: Buffer
    q: Buffer
    k: Buffer
    v: Buffer
    attn: Buffer
    gate: Buffer
    up: Buffer
    act: Buffer
    sel: Buffer  # the sampled rows of x, then normalised in place of sel_norm
    sel_norm: Buffer
    logits: Buffer
    max_tokens: int
    max_rows: int

    def buffers(self) -> list[Buffer]:
        return [
            getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Buffer)
        ]


@dataclass(eq=False)
class StepInputs:
    """The device-side int32 inputs of one step (views of buffers the caller owns).

    ``ids``/``positions``/``slots`` have one entry per token row; ``rows`` the index of
    each sampled row; ``params`` one :data:`vt.SAMPLE_PARAMS_DTYPE` record per sampled row.
    """

    ids: Buffer
    positions: Buffer
    slots: Buffer
    rows: Buffer
    params: Buffer


def _config_value(config: Any, name: str) -> Any:
    try:
        return getattr(config, name)
    except AttributeError as exc:  # pragma: no cover - ModelConfig always has them
        raise ModelError(f"model config has no {name!r}") from exc


class LlamaGraph:
    """Uploaded weights plus the kernel sequence of one forward step.

    ``model`` is a :class:`vt.model.ModelFile` (anything with ``.config`` and
    ``.tensor(name)``). Weights are uploaded once here; a tied output projection reuses
    ``token_embd``.
    """

    def __init__(self, backend: Backend, model: Any) -> None:
        config = model.config
        arch = _config_value(config, "architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelError(
                f"architecture {arch!r} is not supported by the llama-family graph "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        check_backend(backend, arch)
        if config.n_heads % config.n_kv_heads:
            raise ModelError(
                f"n_heads={config.n_heads} is not a multiple of n_kv_heads={config.n_kv_heads}"
            )
        if config.rope.head_dim != config.head_dim:
            raise ModelError(
                f"RoPE head_dim {config.rope.head_dim} differs from the model's {config.head_dim}"
            )
        self.backend = backend
        self.config = config
        # Where the backend runs it natively, each projection's epilogue normalises x for the
        # op after it (matmul_add_rms_norm), whose consumer then takes the normalised h.
        self._norm_epilogue = backend.supports("matmul_add_rms_norm")
        # Where it runs them natively, the projection and the op after the norm go as one
        # op (matmul_add_rms_norm_swiglu, matmul_add_rms_norm_qkv_rope_kv_store): the
        # backend may hand the norm from one kernel to the next in its own form.
        wide = config.ffn_dim >= config.dim  # the product's scratch apart from h (forward)
        self._proj_swiglu = wide and backend.supports("matmul_add_rms_norm_swiglu")
        self._proj_qkv = wide and backend.supports("matmul_add_rms_norm_qkv_rope_kv_store")
        # The optional hint before each attention: the weights read after it (a GPU's
        # attention blocks bring them toward L2 while they wait on memory).
        self._prefetch = backend.supports("prefetch")
        self._uploaded: list[Weight] = []
        try:
            self.token_embd = self._upload(model, "token_embd.weight")
            self.output_norm = self._upload(model, "output_norm.weight")
            self.output = (
                self.token_embd if config.tied_output else self._upload(model, "output.weight")
            )
            self.layers = [self._upload_layer(model, i) for i in range(config.n_layers)]
        except BaseException:
            self.close()
            raise
        self._check_shapes()

    # ---- weights
    def _upload(self, model: Any, name: str) -> Weight:
        weight = self.backend.upload_weight(model.tensor(name))
        self._uploaded.append(weight)
        return weight

    def _upload_layer(self, model: Any, i: int) -> LayerWeights:
        c = self.config

        def up(suffix: str) -> Weight:
            return self._upload(model, f"blk.{i}.{suffix}")

        layer = LayerWeights(
            attn_norm=up("attn_norm.weight"),
            wq=up("attn_q.weight"),
            wk=up("attn_k.weight"),
            wv=up("attn_v.weight"),
            wo=up("attn_output.weight"),
            ffn_norm=up("ffn_norm.weight"),
            w_gate=up("ffn_gate.weight"),
            w_up=up("ffn_up.weight"),
            w_down=up("ffn_down.weight"),
        )
        if c.has_qkv_bias:
            layer.bq, layer.bk, layer.bv = (
                up("attn_q.bias"),
                up("attn_k.bias"),
                up("attn_v.bias"),
            )
        if c.has_qk_norm:
            layer.q_norm, layer.k_norm = up("attn_q_norm.weight"), up("attn_k_norm.weight")
        return layer

    def _check_shapes(self) -> None:
        """Catch a file whose tensor shapes disagree with its metadata before any kernel runs."""
        c = self.config
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        expect: list[tuple[Weight, tuple[int, ...]]] = [
            (self.token_embd, (c.vocab_size, c.dim)),
            (self.output, (c.vocab_size, c.dim)),
            (self.output_norm, (c.dim,)),
        ]
        for layer in self.layers:
            expect += [
                (layer.attn_norm, (c.dim,)),
                (layer.wq, (q_dim, c.dim)),
                (layer.wk, (kv_dim, c.dim)),
                (layer.wv, (kv_dim, c.dim)),
                (layer.wo, (c.dim, q_dim)),
                (layer.ffn_norm, (c.dim,)),
                (layer.w_gate, (c.ffn_dim, c.dim)),
                (layer.w_up, (c.ffn_dim, c.dim)),
                (layer.w_down, (c.dim, c.ffn_dim)),
            ]
            if layer.bq is not None:
                expect += [(layer.bq, (q_dim,)), (layer.bk, (kv_dim,)), (layer.bv, (kv_dim,))]
            if layer.q_norm is not None:
                expect += [(layer.q_norm, (c.head_dim,)), (layer.k_norm, (c.head_dim,))]
        for weight, shape in expect:
            if tuple(weight.shape) != shape:
                raise ModelError(
                    f"tensor {weight.name!r} has shape {tuple(weight.shape)}, "
                    f"but the model config implies {shape}"
                )

    # ---- buffers
    def allocate(self, max_tokens: int, max_rows: int) -> Activations:
        """Allocate the activation buffers for steps of up to ``max_tokens`` token rows and
        ``max_rows`` sampled rows."""
        c = self.config
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        sizes = {
            "x": max_tokens * c.dim,
            "h": max_tokens * c.dim,
            "q": max_tokens * q_dim,
            "k": max_tokens * kv_dim,
            "v": max_tokens * kv_dim,
            "attn": max_tokens * q_dim,  # also qwen3's un-normalised q
            "gate": max_tokens * max(c.ffn_dim, kv_dim),  # also qwen3's un-normalised k
            "up": max_tokens * c.ffn_dim,
            "act": max_tokens * c.ffn_dim,
            "sel": max_rows * c.dim,
            "sel_norm": max_rows * c.dim,
            "logits": max_rows * c.vocab_size,
        }
        done: dict[str, Buffer] = {}
        try:
            for name, n in sizes.items():
                done[name] = self.backend.alloc(n * F32.itemsize)
        except BaseException:
            for buf in done.values():
                self.backend.free(buf)
            raise
        return Activations(**done, max_tokens=max_tokens, max_rows=max_rows)

    def free_activations(self, act: Activations) -> None:
        for buf in act.buffers():
            self.backend.free(buf)

    # ---- the step
    def forward(
        self,
        act: Activations,
        inp: StepInputs,
        cache: Buffer,
        layout: KVLayout,
        n_tokens: int,
        n_rows: int,
        out_ids: Buffer,
        stream: Stream,
        context: int = 0,
    ) -> None:
        """Enqueue one step: ``n_tokens`` rows in, ``n_rows`` sampled ids into ``out_ids``.

        Leaves the float32 logits of the sampled rows in ``act.logits``. Enqueues only
        ops: no allocation, no host synchronisation. ``context``: a bound on every row's
        position + 1 (the runner's context class), for ``attention_bounded``; 0: none.
        """
        c, n = self.config, n_tokens
        if not 0 < n <= act.max_tokens or not 0 <= n_rows <= min(n, act.max_rows):
            raise ValueError(
                f"step of {n} tokens / {n_rows} sampled rows exceeds the buffers "
                f"({act.max_tokens} tokens / {act.max_rows} rows)"
            )
        op = partial(self.backend.launch, stream=stream)
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        x, h = Tensor(act.x, F32, (n, c.dim)), Tensor(act.h, F32, (n, c.dim))
        q, k = Tensor(act.q, F32, (n, q_dim)), Tensor(act.k, F32, (n, kv_dim))
        v, attn = Tensor(act.v, F32, (n, kv_dim)), Tensor(act.attn, F32, (n, q_dim))
        ffn = (n, c.ffn_dim)
        gate, up = Tensor(act.gate, F32, ffn), Tensor(act.up, F32, ffn)
        ffn_act = Tensor(act.act, F32, ffn)
        ids, pos = Tensor(inp.ids, I32, (n,)), Tensor(inp.positions, I32, (n,))
        slots = Tensor(inp.slots, I32, (n,))
        kv = Tensor(cache, F32, layout.shape)
        eps, scale = c.rms_eps, 1.0 / math.sqrt(c.head_dim)
        op("embedding", out=x, ids=ids, table=self.token_embd)
        # matmul_add_rms_norm's product scratch: gate, free between attention and swiglu
        # and after swiglu (ffn >= dim in this family; h where it is not).
        spare = Tensor(act.gate, F32, (n, c.dim)) if c.ffn_dim >= c.dim else h
        epilogue = self._norm_epilogue
        normed = False  # h holds rms_norm(x) with this layer's attn_norm (the last epilogue)
        projected = False  # this layer's q, k, v and cache rows came with the last down
        for i, w in enumerate(self.layers):
            rope_args = dict(positions=pos, slots=slots, cache=kv, layout=layout, layer=i,
                             n_heads=c.n_heads, params=c.rope)  # fmt: skip
            if projected:
                pass  # the last layer's down projection wrote q, k, v and the cache rows
            elif w.q_norm is not None and w.k_norm is not None:
                if not normed:
                    op("rms_norm", out=h, x=x, weight=w.attn_norm, eps=eps)
                # qwen3: project q into ``attn`` and k into ``gate`` (both free until
                # attention and the feed-forward write them), then normalise each head.
                k_raw = Tensor(act.gate, F32, (n, kv_dim))
                op("qkv", q=attn, k=k_raw, v=v, x=h, wq=w.wq, wk=w.wk, wv=w.wv, bq=w.bq,
                   bk=w.bk, bv=w.bv)  # fmt: skip
                hq, hk = n * c.n_heads, n * c.n_kv_heads
                op("rms_norm", out=q.reshape(hq, c.head_dim), x=attn.reshape(hq, c.head_dim),
                   weight=w.q_norm, eps=eps)  # fmt: skip
                op("rms_norm", out=k.reshape(hk, c.head_dim), x=k_raw.reshape(hk, c.head_dim),
                   weight=w.k_norm, eps=eps)  # fmt: skip
                op("rope_kv_store", q=q, k=k, v=v, **rope_args)
            elif normed:
                op("qkv_rope_kv_store", q=q, k=k, v=v, x=h, wq=w.wq, wk=w.wk, wv=w.wv,
                   bq=w.bq, bk=w.bk, bv=w.bv, **rope_args)  # fmt: skip
            else:  # h: the normalised x where the backend runs the op decomposed
                op("rms_norm_qkv_rope_kv_store", q=q, k=k, v=v, x=x, norm=w.attn_norm,
                   eps=eps, wq=w.wq, wk=w.wk, wv=w.wv, bq=w.bq, bk=w.bk, bv=w.bv,
                   scratch=h, **rope_args)  # fmt: skip
            if self._prefetch:
                op("prefetch", weight=w.wo)
                op("prefetch", weight=w.w_gate, paired=w.w_up)
            if context:
                op("attention_bounded", out=attn, q=q, cache=kv, slots=slots, positions=pos,
                   layout=layout, layer=i, n_heads=c.n_heads, scale=scale,
                   context=context)  # fmt: skip
            else:
                op("attention", out=attn, q=q, cache=kv, slots=slots, positions=pos,
                   layout=layout, layer=i, n_heads=c.n_heads, scale=scale)  # fmt: skip
            # h is free again: the projections above consumed it.
            if self._proj_swiglu:
                op("matmul_add_rms_norm_swiglu", out=x, x=attn, weight=w.wo, residual=x,
                   norm=w.ffn_norm, eps=eps, act=ffn_act, gate=w.w_gate, up=w.w_up,
                   scratch=spare, scratch_norm=h, scratch_gate=gate,
                   scratch_up=up)  # fmt: skip
            elif epilogue:
                op("matmul_add_rms_norm", out=x, normed=h, x=attn, weight=w.wo, residual=x,
                   norm=w.ffn_norm, eps=eps, scratch=spare)  # fmt: skip
                op("swiglu", out=ffn_act, x=h, gate=w.w_gate, up=w.w_up, scratch_gate=gate,
                   scratch_up=up)  # fmt: skip
            else:
                op("matmul_add", out=x, x=attn, weight=w.wo, residual=x, scratch=h)
                op("rms_norm_swiglu", out=ffn_act, x=x, norm=w.ffn_norm, eps=eps,
                   gate=w.w_gate, up=w.w_up, scratch=h, scratch_gate=gate,
                   scratch_up=up)  # fmt: skip
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            projected = self._proj_qkv and nxt is not None and nxt.q_norm is None
            normed = epilogue and nxt is not None and not projected
            if projected and nxt is not None:
                nxt_rope = {**rope_args, "layer": i + 1}
                op("matmul_add_rms_norm_qkv_rope_kv_store", out=x, x=ffn_act, weight=w.w_down,
                   residual=x, norm=nxt.attn_norm, eps=eps, q=q, k=k, v=v, wq=nxt.wq,
                   wk=nxt.wk, wv=nxt.wv, bq=nxt.bq, bk=nxt.bk, bv=nxt.bv, scratch=spare,
                   scratch_norm=h, **nxt_rope)  # fmt: skip
            elif normed:
                op("matmul_add_rms_norm", out=x, normed=h, x=ffn_act, weight=w.w_down,
                   residual=x, norm=self.layers[i + 1].attn_norm, eps=eps,
                   scratch=spare)  # fmt: skip
            else:
                op("matmul_add", out=x, x=ffn_act, weight=w.w_down, residual=x, scratch=h)
        if n_rows == 0:
            return
        # RMS norm is per row, so gathering first normalises only the rows that are sampled.
        r = n_rows
        sel, sel_norm = Tensor(act.sel, F32, (r, c.dim)), Tensor(act.sel_norm, F32, (r, c.dim))
        logits = Tensor(act.logits, F32, (r, c.vocab_size))
        op("gather_rows", out=sel, x=x, rows=Tensor(inp.rows, I32, (r,)))
        op("rms_norm", out=sel_norm, x=sel, weight=self.output_norm, eps=eps)
        op("matmul", out=logits, x=sel_norm, weight=self.output)
        op("sample", out=Tensor(out_ids, I32, (r,)), logits=logits,
           params=Tensor(inp.params, SAMPLE_PARAMS_DTYPE, (r,)))  # fmt: skip

    # ---- teardown
    def close(self) -> None:
        """Free the uploaded weights (idempotent)."""
        uploaded, self._uploaded = self._uploaded, []
        for weight in uploaded:
            self.backend.free_weight(weight)
