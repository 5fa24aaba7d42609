"""The CPU backend's native ops: numba kernels over block weights, one call per op.

Each ``op_*`` builds the numpy views of its tensors once, when it is launched (a captured
graph keeps them), and enqueues one closure that calls the kernels; the ops the table has
and this module lacks (``sample``, ``gather_rows``, ``add``, ``silu_mul``, and the parts
``rope``/``kv_store`` of the fused op) run from :mod:`vt.reference`.

Per layer of a llama-family decode step that is 10 closures (rms_norm, 3 matmuls,
rope_kv_store, attention, matmul_add, rms_norm, swiglu, matmul_add) calling 12 compiled
kernels; the reference ran ~50 numpy calls for the same layer.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import vt
from vt.reference import ReferenceOps, rope_cos_sin
from vt.reference import attention as ref_attention

from . import anon
from . import compile as kernels_compile
from . import weights as W
from .kernels import attention as A
from .kernels import jobs as J
from .kernels import layers as L
from .kernels import q8
from .program import NativeOp, Step
from .threads import WORKQUEUE_LOCK, ThreadOwner

F32 = np.float32

#: Activation rows up to which a projection runs the numba kernels (one row: the row
#: kernels; several: the tile kernels, see ``vt_cpu.weights.MM_MIN_ROWS``); more rows
#: (prefill) multiply dequantized tiles with BLAS. Measured crossovers of a whole prefill
#: on the team against BLAS tiles on as many threads (``docs/benchmarks.md``): since the
#: tiles grew and Q8_0/Q4_x/Q6_K dequantization vectorized, BLAS wins from ~44 rows on
#: SmolLM2-135M (Q4_1; it was ~96), ~64 on the 1B shape's Q8_0, ~40 on its Q4_K, 24-32
#: for Q6_K (Q5_K, not measured again, keeps 32).
KERNEL_MAX_ROWS: dict[str, int] = {
    "Q8_0": 56, "Q4_0": 40, "Q4_1": 40, "Q4_K": 40, "Q5_K": 32, "Q6_K": 24,
}  # fmt: skip
#: One activation row times Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K: 8 or 16 (the default) runs
#: kernels.q8 (integer activations of that many bits), 32 the float kernels of kernels.quant.
ACT_BITS_ENV = "VT_CPU_ACT_BITS"  # read through vt.envs


def act_bits() -> int:
    """``VT_CPU_ACT_BITS``: 8, 16 or 32 (float32 activations)."""
    bits = vt.envs.get(ACT_BITS_ENV)
    if bits not in (8, 16, 32):
        raise vt.envs.EnvError(f"{ACT_BITS_ENV}={bits} is not 8, 16 or 32")
    return int(bits)


#: Query rows up to which attention runs the numba kernels (decode steps, and prefill
#: chunks of up to the default 256 tokens: row by row, each up to its own position); more
#: rows run the reference's batched BLAS matmuls. The kernels on the team beat those
#: (single-threaded, every row over the chunk's longest context, then masked): a 128-token
#: prompt's attention 37 -> 24 ms, the prefill 284 -> 267 ms; 1024 tokens in chunks of 256
#: 966 -> 790 ms of 2.5 s (docs/benchmarks.md).
ATTENTION_KERNEL_MAX_ROWS = 256
#: Decode attention goes to the team (jobs over a row's KV head) from this many units and
#: this many scores (rows x heads x positions); below, a post costs more than a second
#: thread saves (docs/benchmarks.md: 16 rows at 128 positions 333 -> 247 us, one row of
#: the 1B shape at 2048 1117 -> 912 us; one row of 3 KV heads barely gains at any length).
ATTENTION_TEAM_MIN_UNITS = 8
ATTENTION_TEAM_MIN_SCORES = 16384
#: Largest table of RoPE angles (cos and sin of every position) kept for the jobs; a longer
#: context computes each step's angles instead (and its graphs replay op by op there).
ROPE_TABLE_MAX_BYTES = 32 << 20


def _ids_error(kernel: str, code: int, positions: np.ndarray, slots: np.ndarray, max_len: int,
               n_slots: int) -> ValueError:  # fmt: skip
    n = positions.shape[0]
    if code < -1:
        i = -code - 2
        return ValueError(f"{kernel}: position {int(positions[i])} is out of range [0, {max_len})")
    i = code - n
    return ValueError(f"{kernel}: slot {int(slots[i])} is out of range [0, {n_slots})")


def _attention_total(slots: np.ndarray, positions: np.ndarray, n_heads: int, max_len: int,
                     n_slots: int) -> int:  # fmt: skip
    """The packed scores' size for these rows (``kernels.attention.packed_size``); a bad
    position or slot raises, naming it."""
    total = A.packed_size(slots, positions, n_heads, max_len, n_slots)
    if total < 0:
        t = -total - 2  # a bad position at row t, or a bad slot at row t - n
        code = total if t < positions.shape[0] else t
        raise _ids_error("attention", code, positions, slots, max_len, n_slots)
    return int(total)


class _Projection:
    """A matrix weight's handle: its :class:`vt_cpu.weights.BlockWeight`."""

    __slots__ = ("weight", "__weakref__")

    def __init__(self, weight: W.BlockWeight) -> None:
        self.weight = weight


class CpuOps(ReferenceOps):
    """Native ops over :class:`vt_cpu.weights.BlockWeight` handles (mixin of CpuBackend)."""

    threads: ThreadOwner
    native_ops: ClassVar[tuple[str, ...]] = (
        "embedding", "rms_norm", "matmul", "matmul_add", "swiglu", "rope_kv_store", "attention",
        "qkv", "qkv_rope_kv_store", "rms_norm_qkv_rope_kv_store", "rms_norm_swiglu",
        "silu_mul", "gather_rows",
    )  # fmt: skip
    #: From the reference: the ops without weights that have no kernel here. An op that
    #: takes weights is native or runs as its decomposition, never dequantized as a whole.
    reference_ops: ClassVar[tuple[str, ...]] = (
        "rope", "kv_store", "add", "sample",
    )  # fmt: skip

    def supports(self, op: str, dtype: str | None = None) -> bool:
        # A subclass that names its own reference_ops runs exactly those (natively where a
        # kernel exists): tests narrow the backend that way to exercise decompositions.
        if type(self).reference_ops is not CpuOps.reference_ops:
            super().supports(op, dtype)  # an unknown op raises, naming the table
            return op in type(self).reference_ops
        return op in self.native_ops or super().supports(op, dtype)

    def _angles(self, positions: np.ndarray, params: vt.RopeParams) -> tuple[Any, Any]:
        """``rope_cos_sin`` of a step's positions, computed once for all its layers."""
        key = (params, positions.tobytes())
        cache = self.__dict__.setdefault("_angle_cache", {})
        got = cache.get(key)
        if got is None:
            if len(cache) >= 8:
                cache.clear()
            got = cache[key] = rope_cos_sin(positions, params)
        return got

    def _rope_table(self, params: vt.RopeParams, max_len: int) -> tuple[Any, Any] | None:
        """``rope_cos_sin`` of every position below ``max_len`` (shared by the layers and
        the graphs of a runner), or None past :data:`ROPE_TABLE_MAX_BYTES`."""
        if max_len * params.head_dim * 4 > ROPE_TABLE_MAX_BYTES:
            return None
        tables = self.__dict__.setdefault("_rope_tables", {})
        key = (params, int(max_len))
        got = tables.get(key)
        if got is None:
            cos, sin = rope_cos_sin(np.arange(max_len), params)
            got = tables[key] = (np.ascontiguousarray(cos), np.ascontiguousarray(sin))
        return got

    # ---- weights
    def _upload_weight(self, tensor: vt.WeightTensor) -> vt.Weight:
        kernels_compile.ensure_compiled()
        handle = W.upload(tensor)
        if isinstance(handle, W.BlockWeight):
            kernels_compile.ensure_compiled(handle.kind, pool=not self.threads.use_team)
            if kernels_compile.threading_layer == "workqueue":
                self.threads.parallel_lock = WORKQUEUE_LOCK
            handle = _Projection(handle)
        shape = tuple(int(s) for s in tensor.shape)
        return vt.Weight(tensor.name, shape, handle, tensor.ggml_type)

    def _weight_array(self, weight: vt.Weight) -> np.ndarray:
        """A weight as float32 as a whole (only for a reference op given a matrix)."""
        h = weight.handle
        if isinstance(h, _Projection):
            w = h.weight
            return w.tile(0, w.rows)
        return h

    @staticmethod
    def _projection(weight: vt.Weight) -> _Projection:
        h = weight.handle
        if not isinstance(h, _Projection):  # a 1-D weight where a matrix is needed
            raise ValueError(f"weight {weight.name!r} of shape {weight.shape} is not a matrix")
        return h

    # ---- the matmuls
    def _job(self, w: W.BlockWeight, x: np.ndarray, out: np.ndarray, res: np.ndarray | None,
             shared: dict[int, tuple[np.ndarray, ...]]) -> J.Job | None:  # fmt: skip
        """``out = x @ w.T (+ res)`` as a team job, where the rows' kernel is one (the
        integer kernels for one row, the tile kernels for several); None otherwise."""
        if not self.threads.use_team or not x.flags.c_contiguous:
            return None
        if x.shape[0] == 1 and act_bits() != 32 and q8.supports(w.kind):
            kernels_compile.ensure_compiled("int8", pool=False)
            return J.q8_job(w, x, out, res, act_bits(), shared)
        return w.job(x, out, res) if x.shape[0] > 1 else None

    def _project(
        self, p: _Projection, x: np.ndarray, out: np.ndarray, res: np.ndarray | None
    ) -> Callable[[], None]:
        """A closure computing ``out = x @ w.T (+ res)``."""
        return self._projections([(p, out, res)], x)

    def _projections(
        self, items: list[tuple[_Projection, np.ndarray, np.ndarray | None]], x: np.ndarray
    ) -> Callable[[], None]:
        """A closure computing ``out = x @ w.T (+ res)`` for each ``(w, out, res)`` of
        ``items`` (weights sharing the activations ``x``: Q, K and V; gate and up). Where
        each is a team job they run as one (one post, one wait, ``x`` quantized once)."""
        owner, n = self.threads, x.shape[0]
        if all(n <= KERNEL_MAX_ROWS.get(p.weight.kind, 0) for p, _, _ in items):
            shared: dict[int, tuple[np.ndarray, ...]] = {}
            jobs = [self._job(p.weight, x, o, r, shared) for p, o, r in items]
            if all(j is not None for j in jobs):
                job = J.multi_job([j for j in jobs if j is not None])
                serial = owner.alone_call(job)  # the same compiled kernels as shared: same bits
                if owner.n <= 1:
                    return NativeOp(serial, [Step(job)])
                nbytes = sum(p.weight.nbytes for p, _, _ in items)
                choice, run, par = owner.choice(nbytes * n), owner.run, owner.team_call(job)
                return NativeOp(lambda: run(choice, serial, par), [Step(job, choice)])
        if len(items) > 1:
            calls = [self._projections([item], x) for item in items]

            def each() -> None:
                for call in calls:
                    call()

            return each
        (p, out, res) = items[0]
        w = p.weight
        if n <= KERNEL_MAX_ROWS.get(w.kind, 0):
            bits = act_bits() if n == 1 else 32
            if bits != 32 and q8.supports(w.kind):
                kernels_compile.ensure_compiled("int8")
                serial, parallel = q8.bind(w, x, out, res, bits)
            else:
                serial, parallel = w.bind(x, out, res)
            if owner.n <= 1:
                return serial
            # one serial/parallel choice per amount of work (bytes x activation rows)
            choice, run, par = owner.choice(w.nbytes * n), owner.run, owner.numba_call(parallel)
            return lambda: run(choice, serial, par)
        step = w.tile_rows()

        def tiled() -> None:
            w.tiled(x, out, res, lambda _step, fn: owner.tiles(step, w.rows, fn))

        return tiled

    def op_matmul(self, stream: vt.Stream, out: vt.Tensor, x: vt.Tensor, weight: vt.Weight,
                  bias: vt.Weight | None = None) -> None:  # fmt: skip
        o, xa = self._array(out), self._array(x)
        run = self._project(self._projection(weight), xa, o, None)
        if bias is not None:
            b = bias.handle
            project = run

            def run() -> None:
                project()
                o.__iadd__(b)

        self.enqueue_host(stream, "matmul", run)

    def op_matmul_add(self, stream: vt.Stream, out: vt.Tensor, x: vt.Tensor, weight: vt.Weight,
                      residual: vt.Tensor, scratch: vt.Tensor) -> None:  # fmt: skip
        o, xa, r = self._array(out), self._array(x), self._array(residual)
        self.enqueue_host(stream, "matmul_add", self._project(self._projection(weight), xa, o, r))

    def op_qkv(self, stream: vt.Stream, q: vt.Tensor, k: vt.Tensor, v: vt.Tensor, x: vt.Tensor,
               wq: vt.Weight, wk: vt.Weight, wv: vt.Weight, bq: vt.Weight | None = None,
               bk: vt.Weight | None = None, bv: vt.Weight | None = None) -> None:  # fmt: skip
        xa = self._array(x)
        outs = [self._array(t) for t in (q, k, v)]
        project = self._projections(
            [(self._projection(w), o, None) for w, o in zip((wq, wk, wv), outs, strict=True)], xa
        )
        biases = [(o, b.handle) for o, b in zip(outs, (bq, bk, bv), strict=True) if b is not None]
        if not biases:
            self.enqueue_host(stream, "qkv", project)
            return

        def run() -> None:
            project()
            for o, b in biases:
                o += b

        self.enqueue_host(stream, "qkv", run)

    def op_qkv_rope_kv_store(
        self, stream: vt.Stream, q: vt.Tensor, k: vt.Tensor, v: vt.Tensor, x: vt.Tensor,
        wq: vt.Weight, wk: vt.Weight, wv: vt.Weight, positions: vt.Tensor, slots: vt.Tensor,
        cache: vt.Tensor, layout: vt.KVLayout, layer: int, n_heads: int,
        params: vt.RopeParams, bq: vt.Weight | None = None, bk: vt.Weight | None = None,
        bv: vt.Weight | None = None,
    ) -> None:  # fmt: skip
        """The qkv and rope_kv_store kernels back to back (on the host there is no launch
        to save; the projections' threads and the rotation's are different jobs)."""
        self.op_qkv(stream, q, k, v, x, wq, wk, wv, bq, bk, bv)
        self.op_rope_kv_store(stream, q, k, v, positions, slots, cache, layout, layer, n_heads,
                              params)  # fmt: skip

    def op_rms_norm_qkv_rope_kv_store(
        self, stream: vt.Stream, q: vt.Tensor, k: vt.Tensor, v: vt.Tensor, x: vt.Tensor,
        norm: vt.Weight, eps: float, wq: vt.Weight, wk: vt.Weight, wv: vt.Weight,
        positions: vt.Tensor, slots: vt.Tensor, cache: vt.Tensor, layout: vt.KVLayout,
        layer: int, n_heads: int, params: vt.RopeParams, scratch: vt.Tensor,
        bq: vt.Weight | None = None, bk: vt.Weight | None = None, bv: vt.Weight | None = None,
    ) -> None:  # fmt: skip
        """rms_norm into ``scratch``, then qkv_rope_kv_store of it (no launch to save here)."""
        self.op_rms_norm(stream, scratch, x, norm, eps)
        self.op_qkv_rope_kv_store(stream, q, k, v, scratch, wq, wk, wv, positions, slots, cache,
                                  layout, layer, n_heads, params, bq, bk, bv)  # fmt: skip

    def op_rms_norm_swiglu(
        self, stream: vt.Stream, out: vt.Tensor, x: vt.Tensor, norm: vt.Weight, eps: float,
        gate: vt.Weight, up: vt.Weight, scratch: vt.Tensor, scratch_gate: vt.Tensor,
        scratch_up: vt.Tensor,
    ) -> None:  # fmt: skip
        """rms_norm into ``scratch``, then swiglu of it."""
        self.op_rms_norm(stream, scratch, x, norm, eps)
        self.op_swiglu(stream, out, scratch, gate, up, scratch_gate, scratch_up)

    def op_swiglu(self, stream: vt.Stream, out: vt.Tensor, x: vt.Tensor, gate: vt.Weight,
                  up: vt.Weight, scratch_gate: vt.Tensor,
                  scratch_up: vt.Tensor) -> None:  # fmt: skip
        o, xa = self._array(out), self._array(x)
        sg, su = self._array(scratch_gate), self._array(scratch_up)
        project = self._projections(
            [(self._projection(gate), sg, None), (self._projection(up), su, None)], xa
        )
        silu = self._silu_mul(sg, su, o)

        def run() -> None:
            project()
            silu()

        if isinstance(project, NativeOp) and isinstance(silu, NativeOp):
            run = NativeOp(run, project.steps + silu.steps)
        self.enqueue_host(stream, "swiglu", run)

    def _silu_mul(self, g: np.ndarray, u: np.ndarray, o: np.ndarray) -> Callable[[], None]:
        """``o = silu(g) * u`` as a job where the arrays allow (C-contiguous, 2-D)."""
        if g.ndim == 2 and all(a.flags.c_contiguous and a.shape == g.shape for a in (u, o)):
            job = J.silu_mul_job(g, u, o)
            return NativeOp(self.threads.alone_call(job), [Step(job)])
        kernel = L.silu_mul
        return lambda: kernel(g, u, o)

    # ---- activations
    def op_silu_mul(self, stream: vt.Stream, out: vt.Tensor, gate: vt.Tensor,
                    up: vt.Tensor) -> None:  # fmt: skip
        o, g, u = self._array(out), self._array(gate), self._array(up)
        self.enqueue_host(stream, "silu_mul", self._silu_mul(g, u, o))

    def op_gather_rows(self, stream: vt.Stream, out: vt.Tensor, x: vt.Tensor,
                       rows: vt.Tensor) -> None:  # fmt: skip
        o, xa, r = self._array(out), self._array(x), self._array(rows)
        if not (
            xa.ndim == 2
            and o.shape == (r.shape[0], xa.shape[1])
            and r.dtype == np.int32
            and all(a.flags.c_contiguous for a in (o, xa, r))
            and o.dtype == xa.dtype == F32
        ):
            self._run_reference("gather_rows", stream, out=out, x=x, rows=rows)
            return
        job = J.gather_job(xa, r, o)
        status, call, limit = job.status, self.threads.alone_call(job), xa.shape[0]
        assert status is not None

        def error() -> BaseException:
            i, status[0] = int(status[0]) - 1, 0
            return ValueError(f"gather_rows: row {int(r[i])} is out of range [0, {limit})")

        def run() -> None:
            call()
            if status[0]:
                raise error()

        self.enqueue_host(stream, "gather_rows", NativeOp(run, [Step(job)], error))

    def op_embedding(self, stream: vt.Stream, out: vt.Tensor, ids: vt.Tensor,
                     table: vt.Weight) -> None:  # fmt: skip
        o, i = self._array(out), self._array(ids)
        w = self._projection(table).weight

        def run() -> None:
            bad = np.flatnonzero((i < 0) | (i >= w.rows))
            if bad.size:
                raise ValueError(
                    f"embedding: token id {int(i[bad[0]])} is out of range [0, {w.rows})"
                )
            w.dequantize_rows(i.astype(np.int64), o)

        self.enqueue_host(stream, "embedding", run)

    def op_rms_norm(self, stream: vt.Stream, out: vt.Tensor, x: vt.Tensor, weight: vt.Weight,
                    eps: float) -> None:  # fmt: skip
        o, xa = self._array(out), self._array(x)
        w = self._weight_array(weight)
        kernel, e = L.rms_norm, float(eps)
        if (
            xa.ndim == 2
            and xa.shape == o.shape
            and w.shape == xa.shape[1:]
            and all(a.flags.c_contiguous and a.dtype == F32 for a in (xa, w, o))
        ):
            job = J.rms_norm_job(xa, w, e, o)
            op = NativeOp(self.threads.alone_call(job), [Step(job)])
            self.enqueue_host(stream, "rms_norm", op)
            return
        self.enqueue_host(stream, "rms_norm", lambda: kernel(xa, w, e, o))

    def op_rope_kv_store(self, stream: vt.Stream, q: vt.Tensor, k: vt.Tensor, v: vt.Tensor,
                         positions: vt.Tensor, slots: vt.Tensor, cache: vt.Tensor,
                         layout: vt.KVLayout, layer: int, n_heads: int,
                         params: vt.RopeParams) -> None:  # fmt: skip
        qa, ka, va = self._array(q), self._array(k), self._array(v)
        pos, sl, c = self._array(positions), self._array(slots), self._array(cache)
        neox = params.style == vt.RopeStyle.neox
        kernel, lay, heads, angles = L.rope_kv_store, int(layer), int(n_heads), self._angles
        table = self._rope_table(params, layout.max_len)
        arrays = (qa, ka, va, pos, sl, c)
        if (
            table is not None
            and qa.ndim == 2
            and all(a.flags.c_contiguous for a in arrays)
            and all(a.dtype == F32 for a in (qa, ka, va, c))
            and pos.dtype == sl.dtype == np.int32
        ):
            job = J.rope_job(qa, ka, va, pos, sl, c, lay, heads, *table, neox)
            status, call = job.status, self.threads.alone_call(job)
            assert status is not None

            def error() -> BaseException:
                code, status[0] = int(status[0]), 0
                return _ids_error("rope_kv_store", code, pos, sl, layout.max_len, layout.n_slots)

            def run_job() -> None:
                call()
                if status[0]:
                    raise error()

            self.enqueue_host(stream, "rope_kv_store", NativeOp(run_job, [Step(job)], error))
            return

        def run() -> None:
            cos, sin = angles(pos, params)
            code = kernel(qa, ka, va, pos, sl, c, lay, heads, cos, sin, neox)
            if code != -1:
                raise _ids_error("rope_kv_store", code, pos, sl, layout.max_len, layout.n_slots)

        self.enqueue_host(stream, "rope_kv_store", run)

    def op_attention(self, stream: vt.Stream, out: vt.Tensor, q: vt.Tensor, cache: vt.Tensor,
                     slots: vt.Tensor, positions: vt.Tensor, layout: vt.KVLayout, layer: int,
                     n_heads: int, scale: float) -> None:  # fmt: skip
        # Decode rows (each its own sequence, typically): the numba kernels of
        # vt_cpu.kernels.attention, all rows in three calls. Many rows (prefill) take the
        # reference's batched BLAS matmuls, which read a slot's K and V once for its rows.
        o, qa, c = self._array(out), self._array(q), self._array(cache)
        pos, sl = self._array(positions), self._array(slots)
        lay, heads, sc = int(layer), int(n_heads), float(scale)
        n, n_kv, hd = qa.shape[0], layout.n_kv_heads, layout.head_dim
        native = (
            n <= ATTENTION_KERNEL_MAX_ROWS
            and heads > 0
            and heads % n_kv == 0
            and heads * hd <= A.MAX_WIDTH
            and qa.shape[1] == heads * hd
            and o.shape == qa.shape
            and pos.shape[0] == n == sl.shape[0]
        )
        if not native:

            def run() -> None:
                ref_attention(qa, c, layout, lay, sl, pos, heads, sc, out=o)

            self.enqueue_host(stream, "attention", run)
            return
        max_len, n_slots = layout.max_len, layout.n_slots
        maxes = np.empty(n * heads, F32)
        owner = self.threads
        if not (
            all(a.flags.c_contiguous for a in (qa, c, sl, pos, o))
            and pos.dtype == sl.dtype == np.int32
        ):
            scores, values, scratch = A.scores, A.weighted_values, self._attention_scratch

            def run_native() -> None:
                total = _attention_total(sl, pos, heads, max_len, n_slots)
                buf = scratch(total)
                scores(qa, c, lay, sl, pos, heads, sc, buf, maxes)
                values(c, lay, sl, pos, heads, buf, o)

            self.enqueue_host(stream, "attention", run_native)
            return
        # Three jobs (check and lay out, scores, values) over a buffer with room for the
        # longest context: the same kernels whether the team shares a pass or not, and a
        # captured step runs them as part of its program.
        buf = self._attention_buffer(stream, n * heads * max_len)
        aj = J.AttentionJobs(qa, c, lay, sl, pos, heads, sc, maxes, o, buf)
        prep, job_s, job_v = aj.jobs()
        status, starts = aj.status, aj.starts

        def error() -> BaseException:
            code, status[0] = int(status[0]), 0
            if code == 1:  # pragma: no cover - the buffer is sized for max_len
                return RuntimeError("attention: the scores buffer is too small")
            t = -code - 2  # a bad position at row t, or a bad slot at row t - n
            return _ids_error("attention", code if t < n else t, pos, sl, max_len, n_slots)

        check = owner.alone_call(prep)
        alone = [owner.alone_call(j) for j in (job_s, job_v)]
        if owner.use_team and owner.n > 1 and n * n_kv >= ATTENTION_TEAM_MIN_UNITS:
            choice = owner.choice(c[0, 0, 0].nbytes * max_len * n, "attention")
            shared = [owner.team_call(j) for j in (job_s, job_v)]
            run, gate = owner.run, aj.size_address
            steps = [Step(prep), *(Step(j, choice, gate, ATTENTION_TEAM_MIN_SCORES)
                                   for j in (job_s, job_v))]  # fmt: skip

            def run_jobs() -> None:
                check()
                if status[0]:
                    raise error()
                if starts[n] < ATTENTION_TEAM_MIN_SCORES:  # short contexts: not worth a post
                    alone[0]()
                    alone[1]()
                    return
                run(choice, alone[0], shared[0])
                run(choice, alone[1], shared[1])

            self.enqueue_host(stream, "attention", NativeOp(run_jobs, steps, error))
            return

        def run_alone_jobs() -> None:
            check()
            if status[0]:
                raise error()
            alone[0]()
            alone[1]()

        steps = [Step(prep), Step(job_s), Step(job_v)]
        self.enqueue_host(stream, "attention", NativeOp(run_alone_jobs, steps, error))

    def _attention_buffer(self, stream: vt.Stream, size: int) -> np.ndarray:
        """A float32 buffer of at least ``size`` for the attention ops bound to ``stream``
        (its ops run one at a time, so they share it); a larger need gets a new one, and
        the ops bound to the old one keep it."""
        bufs = self.__dict__.setdefault("_attention_buffers", weakref.WeakKeyDictionary())
        key = stream.handle
        buf = bufs.get(key)
        if buf is None or buf.size < size:  # (pages count once a context reaches them)
            buf = bufs[key] = anon.zeros(4 * max(size, 1 << 14), F32)
        return buf

    def _attention_scratch(self, size: int) -> np.ndarray:
        """A float32 scratch of ``size`` for the calling thread (grown, never shrunk)."""
        local = self.__dict__.setdefault("_attention_local", threading.local())
        buf = getattr(local, "buf", None)
        if buf is None or buf.shape[0] < size:
            buf = local.buf = np.empty(max(size, 1 << 16), F32)
        return buf[:size]


def _check_native(cls: type[Any]) -> None:  # pragma: no cover - import-time guard
    for name in CpuOps.native_ops:
        assert callable(getattr(cls, f"op_{name}", None)), name


_check_native(CpuOps)
