"""GpuBackend: the vt.Backend protocol over a :class:`GpuRuntime` and kernels/*.cu.

Written once for every GPU vendor: a plugin subclasses it with a name and a probe (whose
capability function declares the device's physical facts), and hands it its runtime
adapter. Device pointers are plain ints (``Buffer.handle``), so ``Buffer.offset`` is
pointer arithmetic.

The core :class:`vt.Backend` checks every argument once (sizes against buffers, tensors
against each op's signature, shapes against weights); the hooks here trust them and keep
only what the GPU itself needs (kernel limits such as :data:`MAX_HEAD_DIM`, handles of
this backend). An op enqueues one launch: no allocation, no host synchronisation, so a
decode step can be captured in a graph. The kernel source is compiled from the first
weight upload on (on helper threads: ``GpuTuning.parallel_compile``), loaded before a
model's first launch or graph capture, and cached per process and device.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np

from ..protocol.backend import (
    Backend,
    Buffer,
    Graph,
    KVLayout,
    RopeParams,
    RopeStyle,
    Stream,
    Tensor,
    Weight,
    WeightTensor,
)
from ..protocol.mixins import (
    AsyncD2HCopy,
    Events,
    Graphs,
    HostAddressable,
    PinnedHostMemory,
    VirtualMemory,
)
from ..protocol.ops import FUSED_OPS, get_op
from . import weights as W
from .modules import GpuModules
from .resources import GpuResources, _Reservation
from .runtime import GpuCallError, GpuRuntime

P, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float

#: Largest head_dim the rope and attention kernels take (ROPE_MAX_PAIRS, qs[256]).
MAX_HEAD_DIM = 256
_THREADS = 256
_SAMPLE_THREADS = 512
_ARGMAX_THREADS = 256  # ARGMAX_THREADS in kernels/sample.cu
_MAX_BLOCKS = 65535
#: Rows of x per pass of the decode-path matmul kernels (MM_R in kernels/matmul_small.cu).
MM_R = 8
#: Query heads per block of attention_split (FA_MAXG in attention.cu).
_FA_MAXG = 8
#: Most threads a block of the qkv_rope gemv kernels: qkv_rope_psq_gemv_q's
#: __launch_bounds__(128, 12) in layout modules (rope_kv.cu).
_QKV_ROPE_MAX_THREADS = 128
#: Splits a (row, KV group) of attention_split_cluster: its cluster's blocks (FA_CLUSTER).
_FA_CLUSTER = 8
#: attention_tiled's kernels (kernels/attention_tiled.cu): per largest head_dim (DMAX), the
#: rows per block (16 * RM) it is instantiated with, largest first; 128 threads a block.
_TILED_ROWS = {64: (64, 32, 16), 128: (32, 16), 256: (16,)}
_AT_THREADS = 128


class VtPrefetch(ctypes.Structure):
    """kernels/common.cu's VtPrefetch, passed by value: byte ranges to bring into L2."""

    _fields_ = [("p", ctypes.c_void_p * 6), ("n", ctypes.c_int64 * 6)]


_NO_PREFETCH = VtPrefetch()


class RopeTable(ctypes.Structure):
    """kernels/rope_kv.cu's RopeTable: inverse frequencies in float64, passed by value."""

    _fields_ = [("inv", ctypes.c_double * (MAX_HEAD_DIM // 2))]


@lru_cache(maxsize=64)
def rope_table(params: RopeParams) -> RopeTable:
    """``base**(-2i/d) / linear_factor`` (or ``inv_freq / linear_factor``), as the reference."""
    d = params.head_dim
    if d <= 0 or d % 2 or d > MAX_HEAD_DIM:
        raise ValueError(
            f"rope: head_dim must be a positive even number up to {MAX_HEAD_DIM}, got {d}"
        )
    if params.linear_factor <= 0:
        raise ValueError(f"rope: linear_factor must be positive, got {params.linear_factor}")
    half = d // 2
    if params.inv_freq is not None:
        if len(params.inv_freq) != half:
            raise ValueError(
                f"rope: inv_freq has {len(params.inv_freq)} entries, head_dim {d} needs {half}"
            )
        inv = np.asarray(params.inv_freq, dtype=np.float64)
    else:
        inv = float(params.base) ** (-2.0 * np.arange(half, dtype=np.float64) / d)
    inv = inv / float(params.linear_factor)
    table = RopeTable()
    table.inv[:half] = inv.tolist()
    return table


@dataclass(eq=False)
class GpuWeight:
    """What ``Weight.handle`` holds: the packed weight's device pointers."""

    kind: int
    rows: int
    cols: int
    data: int
    scales: int  # 0 unless kind is WT_Q
    lg_block: int
    buffer: Buffer
    layout: int = 0  # WT_Q's layout flags (weights.Q_*)

    @property
    def suffix(self) -> str:
        return W.SUFFIX[self.kind]

    @property
    def qarg(self) -> int:
        """The kernels' ``lg`` argument: ``lg_block`` with the layout's flags."""
        return self.lg_block | self.layout


def _mma_threads(weights: int, tiles: int) -> int:
    """Threads of a block of the int8 mma kernels (WARPS in matmul_int8.cu's vt_mma_op: 8 warps
    while a lane's sums, weights * tiles * 4, fit 32 floats of shared memory each, else 4)."""
    return 32 * (8 if weights * tiles * 4 <= 32 else 4)


def _out_of_memory(error: GpuCallError) -> bool:
    """Whether a failed call ran out of device memory (CUDA_ERROR_OUT_OF_MEMORY,
    hipErrorOutOfMemory, hipErrorMemoryAllocation, a fake's ..._OUT_OF_MEMORY)."""
    name = error.error_name.upper().replace("_", "")
    return "OUTOFMEMORY" in name or "MEMORYALLOCATION" in name


#: Kernels that call vt_grid_wait() before reading anything but weights and before any
#: store (kernels/common.cu), so they may be launched overlapped with their predecessor.
#: rms_norm only for one row (the gemv kernels run only then). Measured (docs/gpu.md runs
#: 39-41): adding rope_kv_store and attention's kernels (a wait at their start) gave the 1B
#: shape +0.5-3% at batch 1 and cost the 135M shape 9%. sample and sample_argmax wait at
#: their start (since run 52).
_OVERLAP = (
    "matmul_gemv",  # and matmul_gemvu
    "matmul_norm_gemv",
    "swiglu_gemv",
    "qkv_gemv",
    "qkv_rope_gemv",
    "rms_norm",
    "swiglu_norm_gemv",
    "qkv_rope_norm_gemv",
    "matmul_psq_gemv",
    "swiglu_psq_gemv",
    "qkv_rope_psq_gemv",
    "sample",
)
#: Attention's kernels, overlapped where ``GpuBackend.overlap_attention`` says: the split
#: kernel prefetches its K and V rows into L2 before its wait.
_OVERLAP_ATTENTION = ("attention_split", "attention_combine")
#: The int8 batch kernels, overlapped where GpuBackend.overlap_mma says.
_OVERLAP_MMA = (
    "quantize_rows",
    "quantize_norm_rows",
    "matmul_mma",
    "swiglu_mma",
    "qkv_mma",
    "qkv_rope_mma",
)
#: The fused ops that fold rms_norm into their gemv kernels (GpuBackend.norm_fold_max_k).
_NORM_OPS = frozenset({"rms_norm_swiglu", "rms_norm_qkv_rope_kv_store"})


def _qkv_weight_args(ws: list[GpuWeight], biases: list[int]) -> list[Any]:
    """(data, scales, lg, bias) of each of q, k and v: the qkv kernels' arguments."""
    args: list[Any] = []
    for w, b in zip(ws, biases, strict=True):
        args += [P(w.data), P(w.scales), I32(w.qarg), P(b)]
    return args


def _blocks(n: int, per: int = _THREADS) -> int:
    return max(1, min(_MAX_BLOCKS, -(-n // per)))


class GpuBackend(
    GpuModules,
    GpuResources,
    HostAddressable,
    Events,
    PinnedHostMemory,
    AsyncD2HCopy,
    Graphs,
    VirtualMemory,
    Backend,
):
    """A GPU through a vendor runtime adapter; the plugin supplies the name and the probe.

    It implements every capability mixin: whether device memory is host-addressable and
    whether there is VMM are the device's facts, which the plugin's probe declares.
    """

    name: ClassVar[str] = "gpu"
    description: ClassVar[str] = "a GPU through a runtime adapter (vt.gpu)"
    #: Prefill chunks of 512 (not the protocol's 256): every chunk copies each quantized
    #: weight once for its GEMMs, so two chunks of 256 cost nearly twice one of 512 (1B
    #: shape pp512 27,540 -> 61,660 tok/s, docs/gpu.md run 18).
    default_batch_tokens: ClassVar[int] = 512
    #: Prefill steps replay as graphs too: a 135M-shape chunk of 512 is 457 launches and 210
    #: GEMM calls (12 ms of host time) for 4.3 ms of kernels (docs/gpu.md run 34).
    prefill_graphs: ClassVar[bool] = True
    #: Cleared the first time the runtime's ``gemm`` refuses half inputs (vt_rocm's
    #: hipBLAS path takes float32 only): "auto" then stays on float32 inputs.
    _blas_half_ok: bool = True

    def __init__(self, runtime: GpuRuntime) -> None:
        self._rt = runtime
        self._init_modules()
        self._granularity: int | None = None
        self._scratch: list[tuple[str, Buffer]] = []
        self._kept: dict[tuple[int, str], Buffer] = {}  # (weight data, slot) -> its BLAS copy
        self._kept_bytes = 0
        # Set when free memory refused a copy: no more copies kept (nor memory_info asked a
        # matmul) until a weight's copies are freed.
        self._keep_full = False
        self._reservations: list[_Reservation] = []  # live VMM reservations (KV growth)
        self._sm_number: int | None = None  # _sm()'s answer, once asked
        # attention_q8a's hand-off: (stream, out's address, rows, values a row, the int8
        # scratch) of the attention op just run, whose kernels packed out there; the next
        # op's _int8_x of that x takes it, and the end of any other op's dispatch drops it.
        self._q8a_ready: tuple[Any, int, int, int, int] | None = None
        # op_prefetch's hints (weight, paired) since the last attention launch, which takes them
        self._prefetch: list[tuple[GpuWeight, GpuWeight | None]] = []

    @property
    def runtime(self) -> GpuRuntime:
        return self._rt

    def close(self) -> None:
        """Forget the kernels and let the adapter release its context (idempotent)."""
        self._close_modules()
        while self._scratch:
            self._free(self._scratch.pop()[1])
        self._drop_copies()
        self._rt.close()

    @property
    def context_classes(self) -> tuple[int, ...]:  # type: ignore[override]
        """``(short_context,)`` where it is set (the runner's context classes), else ()."""
        bound = self.short_context
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
            raise ValueError(
                f"GpuBackend.short_context is {bound!r}; 0 (off) or the positions a short "
                "context ends within"
            )
        return (bound,) if bound else ()

    def _kernel(
        self, name: str, grid: tuple[int, int, int], block: int, stream: Stream, *args: Any,
        overlap: bool = True, weights: tuple[GpuWeight, ...] = (),
        overlap_attention: bool = False, short: bool = False,
    ) -> None:  # fmt: skip
        """Launch ``name``; ``weights``: the GpuWeights it reads (which module it comes from);
        ``overlap_attention``: attention's kernels overlapped for this launch (op_attention's
        rule) as ``self.overlap_attention`` has them for every launch; ``short``: from the
        short-context attention's module."""
        fn = self._fn(name, None if short else self._layout(weights), short)
        if (
            overlap
            and self.overlap_launches
            and (
                name.startswith(_OVERLAP)
                or (
                    (self.overlap_attention or overlap_attention)
                    and name.startswith(_OVERLAP_ATTENTION)
                )
                or (self.overlap_combine and name == "attention_combine")
                or (self.overlap_mma and name.startswith(_OVERLAP_MMA))
            )
        ):
            self._rt.launch_overlapped(fn, grid, (block, 1, 1), 0, stream.handle, args)
        else:
            self._rt.launch(fn, grid, (block, 1, 1), 0, stream.handle, args)

    # ---- weights
    def _upload_weight(self, tensor: WeightTensor) -> Weight:
        packed = W.pack(tensor, compact=self.compact_weights, layouts=dict(self.layout_overrides))
        self._prebuild_every_layout()  # on helper threads while the weights go on uploading
        if self.context_classes:
            self._short()
        if packed.kind == W.WT_Q and self.layout_kernels:
            self._prebuild_layout(packed.layout)
        data = np.ascontiguousarray(packed.data).reshape(-1).view(np.uint8)
        at = -(-data.nbytes // 256) * 256
        total = at + (0 if packed.scales is None else packed.scales.nbytes)
        buf = self.alloc(max(total, 1))
        try:
            self.copy_h2d(buf, data)
            if packed.scales is not None:
                self.copy_h2d(buf.view(at, packed.scales.nbytes), packed.scales)
        except BaseException:
            self.free(buf)
            raise
        base = int(buf.handle)
        handle = GpuWeight(
            kind=packed.kind,
            rows=packed.rows,
            cols=packed.cols,
            data=base,
            scales=base + at if packed.scales is not None else 0,
            lg_block=packed.lg_block,
            buffer=buf,
            layout=packed.layout,
        )
        return Weight(tensor.name, tuple(int(d) for d in tensor.shape), handle, tensor.ggml_type)

    def _free_weight(self, weight: Weight) -> None:
        w = self._gpu_weight(weight, "free_weight")
        self._prefetch.clear()  # no hint may outlive a weight it names
        self._drop_copies(w)  # before its address can be reused by another weight
        self.free(w.buffer)

    def _gpu_weight(self, weight: Weight, what: str) -> GpuWeight:
        handle = weight.handle
        if not isinstance(handle, GpuWeight):
            raise ValueError(f"{what}: weight {weight.name!r} was not uploaded by {self.name}")
        return handle

    # ---- ops: the core has checked every tensor and weight against the op's signature
    def _dispatch(self, op: str, stream: Stream, args: dict[str, Any]) -> None:
        """Backend._dispatch; an int8 hand-off (attention_q8a) lives to the end of
        the op after the one that made it (whose first int8 step takes it), so an op that
        writes the packed output in between can never meet stale int8 rows."""
        ready = self._q8a_ready
        try:
            super()._dispatch(op, stream, args)
        finally:
            if ready is not None and self._q8a_ready is ready:
                self._q8a_ready = None

    # Work other than an op between an int8 hand-off's producer and its consumer (a copy, a
    # memset, a graph's replay) may write the packed output's buffer: it drops the hand-off.
    def _memset(self, buf: Buffer, value: int, stream: Stream | None) -> None:
        self._q8a_ready = None
        super()._memset(buf, value, stream)

    def _copy_h2d(self, dst: Buffer, src: np.ndarray) -> None:
        self._q8a_ready = None
        super()._copy_h2d(dst, src)

    def _copy_h2d_async(self, dst: Buffer, src: np.ndarray, stream: Stream) -> None:
        self._q8a_ready = None
        super()._copy_h2d_async(dst, src, stream)

    def _copy_d2d(self, dst: Buffer, src: Buffer, nbytes: int, stream: Stream) -> None:
        self._q8a_ready = None
        super()._copy_d2d(dst, src, nbytes, stream)

    def _launch_graph(self, graph: Graph, stream: Stream) -> None:
        self._q8a_ready = None
        super()._launch_graph(graph, stream)

    @staticmethod
    def _address(t: Tensor) -> int:
        return int(t.buffer.handle) + t.buffer.offset

    @classmethod
    def _ptr(cls, t: Tensor) -> P:
        return P(cls._address(t))

    def op_embedding(self, stream: Stream, out: Tensor, ids: Tensor, table: Weight) -> None:
        w = self._gpu_weight(table, "embedding")
        n = ids.shape[0]
        if n:
            self._kernel(
                f"embedding_{w.suffix}", (n, 1, 1), _THREADS, stream,
                self._ptr(out), P(w.data), P(w.scales), I32(w.qarg), self._ptr(ids), I32(n),
                I32(w.rows), I32(w.cols), weights=(w,),
            )  # fmt: skip

    def op_rms_norm(
        self, stream: Stream, out: Tensor, x: Tensor, weight: Weight, eps: float
    ) -> None:
        w = self._gpu_weight(weight, "rms_norm")
        n, dim = x.shape
        if n:  # overlapped for one row: batch 1, where runs 39-41 measured the gain
            self._kernel("rms_norm", (n, 1, 1), _THREADS, stream, self._ptr(out), self._ptr(x),
                         P(w.data), I32(n), I32(dim), F32(eps), overlap=n == 1)  # fmt: skip

    def _rows_per_block(self, n: int, blocks_x: int) -> int:
        """Rows of x per block of a decode-path kernel: all of them (each weight row read
        once) unless that leaves the GPU short of blocks; then split in groups of MM_R."""
        groups = -(-n // MM_R)
        split = min(groups, max(1, -(-self.target_blocks // blocks_x)))
        return MM_R * -(-groups // split)

    def _small_grid(
        self, n: int, features: int, most: int = 4
    ) -> tuple[tuple[int, int, int], int, int]:
        """Grid, rows per block and features per warp (NO) of a decode-path kernel: one
        feature per warp for one row (bound by the weights' bandwidth), ``most`` for more
        rows (so each x value read serves several weight rows)."""
        per_warp = 1 if n == 1 else most
        warps = _THREADS // self._rt.warp_size()
        blocks_x = -(-features // (warps * per_warp))
        rpb = self._rows_per_block(n, blocks_x)
        return (blocks_x, -(-n // rpb), 1), rpb, per_warp

    def _gemv(
        self, x: Tensor, *ws: GpuWeight, threads: int = 0, features: int = 0
    ) -> tuple[int, int]:
        """(features per block, threads per block) of the gemv kernels for a one-row step
        against ``ws``, or (0, 0): the warp kernels. 64 threads where K <= 1024 (16 values
        a thread: K = 576 leaves most of 128 idle), else ``threads`` (the caller's; 0:
        ``gemv_threads``); ``features`` the caller's (1, 2 or 4; else ``gemv_features``);
        the output projection ``gemv_wide_*``, long rows ``gemv_long_*``."""
        n, k = x.shape
        ok = (
            n == 1 and self.gemv_features in (1, 2, 4) and k % 16 == 0
            and (self._ptr(x).value or 0) % 16 == 0
            and all(w.kind == W.WT_Q and w.data % 16 == 0 and w.scales % 8 == 0
                    and w.lg_block >= 4 for w in ws)
        )  # fmt: skip
        if not ok:
            return 0, 0
        wide = self.gemv_wide_min_rows
        if wide and min(w.rows for w in ws) >= wide and self.gemv_wide_features in (1, 2, 4):
            return self.gemv_wide_features, self._gemv_threads(self.gemv_wide_threads)
        if 0 < self.gemv_long_min_k <= k and self.gemv_long_features in (1, 2, 4):
            return self.gemv_long_features, self._gemv_threads(self.gemv_long_threads)
        long_k = self._gemv_threads(threads or self.gemv_threads)
        per_block = features if features in (1, 2, 4) else self.gemv_features
        return per_block, 64 if k <= 1024 else long_k

    @property
    def _swiglu_gemv(self) -> dict[str, int]:
        """``_gemv``'s keywords for swiglu's kernels (its own threads and features)."""
        return {"threads": self.gemv_swiglu_threads, "features": self.gemv_swiglu_features}

    def _unrolled(self, k: int) -> bool:
        """Whether a one-row matmul of ``k`` inputs takes the unrolled gemv kernels
        (``gemv_unroll_min_k``)."""
        return 0 < self.gemv_unroll_min_k <= k

    def _gemv_threads(self, threads: int) -> int:
        """``threads`` as a gemv block can take them: whole warps, at most 256
        (``GV_MAX_THREADS``), at least one warp."""
        warp = self._rt.warp_size()
        return max(warp, min(256, threads) // warp * warp)

    def _matmul(
        self,
        stream: Stream,
        out: Tensor,
        x: Tensor,
        w: GpuWeight,
        bias: int = 0,
        residual: Tensor | None = None,
    ) -> None:
        n = x.shape[0]
        if n == 0:
            return
        first = self._mma_first(x, w)
        if n >= self.blas_min_rows and self._rt.blas() and not first:
            self._blas_matmul(stream, out, x, w, bias, residual)
            return
        out_f, in_f = w.rows, w.cols
        res = P(0) if residual is None else self._ptr(residual)
        args = [self._ptr(out), self._ptr(x), P(w.data), P(w.scales), I32(w.qarg), P(bias),
                res, I32(n), I32(out_f), I32(in_f)]  # fmt: skip
        if n >= self.tiled_min_rows and not first:
            grid = (-(-out_f // 64), -(-n // 64), 1)
            self._kernel(f"matmul_tiled_{w.suffix}", grid, 256, stream, *args, weights=(w,))
        elif (gv := self._gemv(x, w))[0]:
            del args[7]  # n: one row
            u = "u" if self._unrolled(in_f) else ""
            self._kernel(f"matmul_gemv{u}{gv[0]}_q", (-(-out_f // gv[0]), 1, 1), gv[1], stream,
                         *args, weights=(w,))  # fmt: skip
        else:
            suffix, xq = self._int8_x(stream, x, w)
            if xq:
                args = [args[0], P(xq), *args[2:]]
            if xq and (nt := self._mma_tiles(n)):
                grid, split = self._mma_split(stream, -(-out_f // 16), in_f, 1, nt)
                self._kernel(f"matmul_mma{nt}_q8a", grid, _mma_threads(1, nt), stream, *args,
                             *split, weights=(w,))  # fmt: skip
                return
            grid, rpb, no = self._small_grid(n, out_f)
            self._kernel(f"matmul_small{no}_{suffix}", grid, _THREADS, stream, *args, I32(rpb),
                         weights=(w,))  # fmt: skip

    def _sm(self) -> int:
        """The NVIDIA device's compute capability as a number (90 for ``sm_90``; asked
        once), or 0 on any other (HIP's ``gfx...``)."""
        if self._sm_number is None:
            arch = self._rt.arch()
            digits = arch[3:].rstrip("abcdefghijklmnopqrstuvwxyz")
            self._sm_number = int(digits) if arch.startswith("sm_") and digits.isdigit() else 0
        return self._sm_number

    def _mma_split(
        self, stream: Stream, blocks: int, k: int, weights: int, nt: int
    ) -> tuple[tuple[int, int, int], list[Any]]:
        """The grid of an int8 mma launch of ``blocks`` 16-feature blocks over K = ``k``
        (``weights`` a block: 2 for swiglu; ``nt`` tiles of 8 rows), K split as
        ``mma_split_blocks`` says, and its last arguments: the slices' partial sums and the
        blocks' counters (zero, as the kernel leaves them), or two nulls unsplit."""
        s = 1
        while (
            self.mma_split_blocks
            and blocks * s * 2 <= self.mma_split_blocks
            and k // (s * 2) >= self.mma_split_min_k
        ):
            s *= 2
        if s == 1:
            return (blocks, 1, 1), [P(0), P(0)]
        sums = 4 * blocks * s * weights * nt * 4 * 32  # part[b][s][weight][the tiles' sums]
        part = self._scratch_at_least(sums, slot="mma split partial sums")
        counts = self._scratch_at_least(4 * blocks, slot="mma split counts", zero_on=stream)
        return (blocks, s, 1), [P(part), P(counts)]

    def _mma_tiles(self, n: int) -> int:
        """Tiles of 8 rows (1, 2, 4 or 8) for an int8 step of n rows on the tensor-core
        kernels, or 0: the dp4a ones (no tensor cores for s8, or more than 64 rows)."""
        use = self.int8_mma
        if use is None:
            use = self._sm() >= 80
            self.int8_mma = use  # this backend's device, once
        if not use or n > 64:
            return 0
        return 1 << (-(-n // 8) - 1).bit_length()

    def _mma_first(self, x: Tensor, *ws: GpuWeight) -> bool:
        """Whether a step of ``x``'s rows against ``ws`` that the BLAS or tiled path would
        take (``blas_min_rows``, ``tiled_min_rows``) stays on the int8 mma kernels
        (``int8_mma_first``): at most their 64 rows, int8 activations, tensor cores."""
        n = x.shape[0]
        first = self.int8_mma_first
        if n < min(self.blas_min_rows, self.tiled_min_rows) or n > 64 or first is False:
            return False
        if first is None and self._rt.blas():
            return False
        return self._int8_applies(x, *ws) and self._mma_tiles(n) > 0

    def _int8_applies(self, x: Tensor, *ws: GpuWeight) -> bool:
        """Whether a step of ``x``'s rows against ``ws`` takes int8 activations: at least
        ``int8_min_rows`` rows, quantized weights with blocks of 16 or 32 (K a multiple of
        32), the largest of ``int8_min_values`` values or more."""
        n, k = x.shape
        return not (
            n < max(2, self.int8_min_rows)
            or k % 32
            or any(w.kind != W.WT_Q or w.lg_block not in (4, 5) for w in ws)
            or max(w.rows * w.cols for w in ws) < self.int8_min_values
        )

    def _int8_x(
        self, stream: Stream, x: Tensor, *ws: GpuWeight, norm: GpuWeight | None = None,
        eps: float = 0.0,
    ) -> tuple[str, int]:  # fmt: skip
        """Where ``_int8_applies``: x packed as int8 rows in scratch (``quantize_rows``;
        ``norm``: rms_norm(x) packed, ``quantize_norm_rows``) and the kernel suffix ``q8a``;
        else ``(suffix, 0)``, x as it is (float32)."""
        if not self._int8_applies(x, *ws):
            return ws[0].suffix, 0
        n, k = x.shape
        ready, self._q8a_ready = self._q8a_ready, None
        if norm is None and ready and ready[:4] == (stream.handle, self._address(x), n, k):
            return "q8a", ready[4]  # the op before packed x there (attention_q8a)
        xq = self._int8_scratch(n, k)
        if norm is None:
            self._kernel("quantize_rows", (-(-k // _THREADS), n, 1), _THREADS, stream, P(xq),
                         self._ptr(x), I32(n), I32(k))  # fmt: skip
        else:
            chunks = max(1, k // self.norm_quantize_values) if self.norm_quantize_values else 1
            self._kernel("quantize_norm_rows", (n, chunks, 1), _THREADS, stream, P(xq),
                         self._ptr(x), P(norm.data), I32(n), I32(k), F32(eps))  # fmt: skip
        return "q8a", xq

    def _int8_scratch(self, n: int, k: int) -> int:
        """The scratch for n rows of k values packed as int8 (the rows, then the mma
        kernels' pairs)."""
        stride = (k + k // 8 + k // 4 + 15) // 16 * 16  # vt_q8a_stride in common.cu
        pairs = (k // 16) * max(64, -(-n // 8) * 8) * 8  # vt_q8a_pairs: (dx, sum) pairs
        return self._scratch_at_least(n * stride + pairs, slot="int8_x")

    def _attention_q8a(self, stream: Stream, out: Tensor, head_dim: int) -> int:
        """Where ``attention_q8a`` applies to attention's ``out`` (int8 rows, below the
        tiled kernel's, whole blocks of 32 a head): the int8 scratch its kernels also pack
        out into, handed to the next op's ``_int8_x`` of out; else 0."""
        n, k = out.shape
        if (
            not self.attention_q8a
            or head_dim % 32
            or n < max(2, self.int8_min_rows)
            or n >= self.attention_tiled_min_rows
        ):
            return 0
        return self._int8_scratch(n, k)

    def _norm_mma(self, x: Tensor, nw: GpuWeight, *ws: GpuWeight) -> int:
        """The int8 mma kernels' row tiles where a norm op of ``x`` before ``ws`` normalises
        and quantizes in one launch (``norm_quantize``); 0: it does not."""
        n = x.shape[0]
        if (
            not self.norm_quantize
            or nw.kind != W.WT_F32
            or (n >= self.tiled_min_rows and not self._mma_first(x, *ws))
            or len({w.kind for w in ws}) > 1
            or not self._int8_applies(x, *ws)
        ):
            return 0
        return self._mma_tiles(n)

    def device_memory(self) -> int:
        """Bytes of device memory where the plugin knows them; 0: unknown (nothing kept)."""
        return 0

    def _weight_copy(self, w: GpuWeight, slot: str, nbytes: int) -> tuple[int, bool]:
        """Where the BLAS path's copy of ``w`` (``slot``: its float32 or half form) goes, and
        whether it must be made: a copy kept from an earlier matmul is reused (False); a new
        one is kept while all kept copies fit ``blas_keep_fraction`` of ``device_memory()``
        and the device's free memory keeps its margin (:meth:`_room_to_keep`), else it
        goes to scratch and is made again next time (True either way)."""
        key = (w.data, slot)
        kept = self._kept.get(key)
        if kept is not None:
            return self._addr(kept), False
        if self._room_to_keep(nbytes, slot):
            try:
                buf = self._alloc(nbytes)
            except GpuCallError as e:
                if not _out_of_memory(e):
                    raise
                self._keep_full = True  # the memory went elsewhere: scratch, as before
            else:
                self._kept[key] = buf
                self._kept_bytes += nbytes
                return self._addr(buf), True
        return self._scratch_at_least(nbytes, slot=slot), True

    def _keep_margin(self, total: int, nbytes: int, slot: str) -> int:
        """Bytes of free memory a kept copy of ``nbytes`` must leave on a device of
        ``total`` bytes: ``blas_keep_min_free_*``, what VMM reservations have yet to map,
        and room for a copy of that size in ``slot``'s scratch unless it has it already."""
        floor = max(self.blas_keep_min_free_bytes, int(self.blas_keep_min_free_fraction * total))
        growth = sum(r.unmapped_bytes() for r in self._reservations)
        scratch = any(s == slot and buf.nbytes >= nbytes for s, buf in self._scratch)
        return floor + growth + (0 if scratch else nbytes)

    def _room_to_keep(self, nbytes: int, slot: str) -> bool:
        """Whether a new copy of ``nbytes`` may be kept: within ``blas_keep_fraction`` of
        ``device_memory()``, and (asked only then) free memory of at least the copy and
        :meth:`_keep_margin`. A refusal for free memory (or a runtime that cannot say)
        holds until a weight's copies are freed."""
        if self._keep_full or (
            self._kept_bytes + nbytes > self.blas_keep_fraction * self.device_memory()
        ):
            return False
        info = self._rt.memory_info()
        if info is None or info[0] < nbytes + self._keep_margin(info[1], nbytes, slot):
            self._keep_full = True
            return False
        return True

    def _drop_copies(self, w: GpuWeight | None = None) -> None:
        """Free the kept BLAS copies of ``w`` (None: of every weight); the room they and the
        weight leave may be kept in again."""
        for key in [k for k in self._kept if w is None or k[0] == w.data]:
            buf = self._kept.pop(key)
            self._kept_bytes -= buf.nbytes
            self._free(buf)
        self._keep_full = False

    def _blas_matmul(
        self, stream: Stream, out: Tensor, x: Tensor, w: GpuWeight, bias: int,
        residual: Tensor | None,
    ) -> None:  # fmt: skip
        """The vendor BLAS path (``GpuRuntime.gemm``): a float32 copy of a non-F32 weight in
        scratch (``dequantize``, bit-exact), one GEMM with the residual as its accumulator
        (copied into ``out`` first unless ``out`` is the residual), then the bias. With
        ``blas_inputs == "f16"`` (or "auto" and a weight of ``blas_f16_min_values`` values or
        more) a non-F32 weight and x go in as IEEE half instead (an F16 weight as it is):
        half the bytes of the copy, twice the tensor-core rate."""
        n, (m, k) = x.shape[0], (w.rows, w.cols)
        xp = int(x.buffer.handle) + x.buffer.offset
        op = int(out.buffer.handle) + out.buffer.offset
        wptr, inputs, total = w.data, "f32", m * k
        # Quantized codes 16 at a time (blas_copies.cu) where 16 values share a scale pair
        # and the codes are 16-byte aligned; else a value a thread (embedding_norm.cu).
        wide = (
            self.blas_wide_copies and w.kind == W.WT_Q and w.lg_block >= 4 and total % 16 == 0
            and w.data % 16 == 0
        )  # fmt: skip
        copy = "dequantize16" if wide else "dequantize"
        per = 16 if wide else 1
        half = self.blas_inputs == "f16" or (
            self.blas_inputs == "auto" and total >= self.blas_f16_min_values
            and self._blas_half_ok
        )  # fmt: skip
        if w.kind != W.WT_F32 and half:
            inputs = "f16"
            if w.kind != W.WT_F16:
                wptr, fresh = self._weight_copy(w, "half_weight", total * 2)
                if fresh:
                    self._kernel(f"{copy}_h_{w.suffix}", (_blocks(total // per), 1, 1),
                                 _THREADS, stream, P(wptr), P(w.data), P(w.scales),
                                 I32(w.qarg), I64(total), weights=(w,))  # fmt: skip
            xh = self._scratch_at_least(n * k * 2, slot="half_x")
            x8 = 8 if self.blas_wide_copies and (n * k) % 8 == 0 and xp % 16 == 0 else 1
            self._kernel("to_half8" if x8 > 1 else "to_half", (_blocks(n * k // x8), 1, 1),
                         _THREADS, stream, P(xh), P(xp), I64(n * k))  # fmt: skip
            xp = xh
        elif w.kind != W.WT_F32:
            wptr, fresh = self._weight_copy(w, "f32_weight", total * 4)
            if fresh:
                self._kernel(f"{copy}_{w.suffix}", (_blocks(total // per), 1, 1), _THREADS,
                             stream, P(wptr), P(w.data), P(w.scales), I32(w.qarg),
                             I64(total), weights=(w,))  # fmt: skip
        accumulate = residual is not None
        if residual is not None and (rp := self._ptr(residual).value or 0) != op:
            self._rt.memcpy_d2d(op, rp, n * m * 4, stream.handle)
        if inputs == "f32":
            self._rt.gemm(stream.handle, n, m, k, xp, wptr, op, accumulate)
        else:
            try:
                self._rt.gemm(stream.handle, n, m, k, xp, wptr, op, accumulate, inputs=inputs)
            except NotImplementedError:
                if self.blas_inputs != "auto":
                    raise  # half inputs asked for by name: say the runtime has none
                # "auto" on a runtime without half GEMMs: float32 from now on, this matmul
                # again (the refusal comes before anything is enqueued; out still holds
                # the residual, which the retry copies again).
                self._blas_half_ok = False
                self._blas_matmul(stream, out, x, w, bias, residual)
                return
        if bias:
            self._kernel("bias_add", (_blocks(n * m), 1, 1), _THREADS, stream, self._ptr(out),
                         P(bias), I32(n), I32(m))  # fmt: skip

    def op_matmul(
        self, stream: Stream, out: Tensor, x: Tensor, weight: Weight, bias: Weight | None = None
    ) -> None:
        w = self._gpu_weight(weight, "matmul")
        b = 0 if bias is None else self._gpu_weight(bias, "matmul").data
        self._matmul(stream, out, x, w, b)

    # ---- fused ops (native; GpuBackend.native_fused lists those that run so)
    def supports(self, op: str, dtype: str | None = None) -> bool:
        if op == "prefetch" and self.prefetch_bytes <= 0:
            return False  # a hint that would do nothing: the graph launches none
        if op in FUSED_OPS and op not in self.native_fused:
            if not ((self.norm_fold_max_k or self.norm_quantize) and op in _NORM_OPS):
                return False  # run as its decomposition (to measure what the fusion buys)
        return super().supports(op, dtype)

    def _fold_norm(self, op: str, k: int) -> bool:
        """Whether ``op`` (a norm op, one row) folds the norm into its gemv kernels."""
        return op in self.native_fused or 0 < k <= self.norm_fold_max_k

    def op_matmul_add(
        self, stream: Stream, out: Tensor, x: Tensor, weight: Weight, residual: Tensor,
        scratch: Tensor,
    ) -> None:  # fmt: skip
        """The residual add in the projection's epilogue: one launch (scratch unused)."""
        self._matmul(stream, out, x, self._gpu_weight(weight, "matmul_add"), residual=residual)

    def op_matmul_add_rms_norm(
        self, stream: Stream, out: Tensor, normed: Tensor, x: Tensor, weight: Weight,
        residual: Tensor, norm: Weight, eps: float, scratch: Tensor,
    ) -> None:  # fmt: skip
        """One row on the gemv kernels (``matmul_norm_gemv*_q``): the residual add in the
        epilogue, then the grid's last block (a device-wide count) normalises the row as
        ``rms_norm`` does, bit for bit: one launch where matmul_add and rms_norm take two.
        Otherwise the op's decomposition (matmul_add, then rms_norm)."""
        w = self._gpu_weight(weight, "matmul_add_rms_norm")
        nw = self._gpu_weight(norm, "matmul_add_rms_norm")
        k = x.shape[1]
        gv = self._proj_gemv(x, w, nw)
        if not gv[0]:
            args = {"out": out, "normed": normed, "x": x, "weight": weight,
                    "residual": residual, "norm": norm, "eps": eps, "scratch": scratch}  # fmt: skip
            self._decompose(stream, "matmul_add_rms_norm", args)
            return
        count = self._scratch_at_least(4, slot="norm epilogue count", zero_on=stream)
        self._kernel(
            f"matmul_norm_gemv{gv[0]}_q", (-(-w.rows // gv[0]), 1, 1), gv[1], stream,
            self._ptr(out), self._ptr(x), P(w.data), P(w.scales), I32(w.qarg), P(0),
            self._ptr(residual), I32(w.rows), I32(k), self._ptr(normed), P(nw.data),
            F32(eps), P(count), weights=(w,),
        )  # fmt: skip

    def op_swiglu(
        self, stream: Stream, out: Tensor, x: Tensor, gate: Weight, up: Weight,
        scratch_gate: Tensor, scratch_up: Tensor,
    ) -> None:  # fmt: skip
        """Decode batches: gate and up in one pass with the SiLU-mul epilogue (one launch).
        Prefill (tiled) or weights of different kinds: two matmuls and silu_mul."""
        g, u = self._gpu_weight(gate, "swiglu"), self._gpu_weight(up, "swiglu")
        n, dim = x.shape
        if n == 0:
            return
        first = g.lg_block == u.lg_block and self._mma_first(x, g, u)
        if (n >= self.tiled_min_rows and not first) or g.kind != u.kind:
            self._matmul(stream, scratch_gate, x, g)
            self._matmul(stream, scratch_up, x, u)
            self.op_silu_mul(stream, out, scratch_gate, scratch_up)
            return
        if (gv := self._gemv(x, g, u, **self._swiglu_gemv))[0]:
            self._kernel(
                f"swiglu_gemv{gv[0]}_q", (-(-g.rows // gv[0]), 1, 1), gv[1], stream,
                self._ptr(out), self._ptr(x), P(g.data), P(g.scales), I32(g.qarg),
                P(u.data), P(u.scales), I32(u.qarg), I32(g.rows), I32(dim), weights=(g, u),
            )  # fmt: skip
            return
        suffix, xq = self._int8_x(stream, x, g, u)
        if xq and g.lg_block == u.lg_block and (nt := self._mma_tiles(n)):
            self._swiglu_mma(stream, out, xq, g, u, n, dim, nt)
            return
        grid, rpb, no = self._small_grid(n, g.rows, most=2)
        self._kernel(
            f"swiglu_small{no}_{suffix}", grid, _THREADS, stream,
            self._ptr(out), P(xq) if xq else self._ptr(x), P(g.data), P(g.scales),
            I32(g.qarg), P(u.data),
            P(u.scales), I32(u.qarg), I32(n), I32(g.rows), I32(dim), I32(rpb), weights=(g, u),
        )  # fmt: skip

    def _swiglu_mma(
        self, stream: Stream, out: Tensor, xq: int, g: GpuWeight, u: GpuWeight, n: int,
        dim: int, nt: int,
    ) -> None:  # fmt: skip
        """``swiglu_mma{nt}_q8a`` of x packed at ``xq`` (n rows of dim values); at one tile
        of a launch of ``mma_sw1_wave_blocks`` blocks or more, in a layout of scales alone
        (its own module's), its 4-an-SM form."""
        grid, split = self._mma_split(stream, -(-g.rows // 16), dim, 2, nt)
        layout = self._layout((g, u))
        wave = (
            nt == 1
            and 0 < self.mma_sw1_wave_blocks <= grid[0] * grid[1]
            and layout is not None
            and bool(layout & W.Q_ONE)  # offsets: spills at its 64 registers
        )
        self._kernel(
            "swiglu_mma1w_q8a" if wave else f"swiglu_mma{nt}_q8a", grid, _mma_threads(2, nt),
            stream,
            self._ptr(out), P(xq), P(g.data), P(g.scales), I32(g.qarg), P(u.data),
            P(u.scales), I32(u.qarg), I32(n), I32(g.rows), I32(dim), *split, weights=(g, u),
        )  # fmt: skip

    def op_qkv(
        self, stream: Stream, q: Tensor, k: Tensor, v: Tensor, x: Tensor, wq: Weight,
        wk: Weight, wv: Weight, bq: Weight | None = None, bk: Weight | None = None,
        bv: Weight | None = None,
    ) -> None:  # fmt: skip
        """Decode batches: the three projections in one launch (three weights, one grid).
        Prefill (tiled) or weights of different kinds: three matmuls."""
        ws = [self._gpu_weight(w, "qkv") for w in (wq, wk, wv)]
        bs = [0 if b is None else self._gpu_weight(b, "qkv").data for b in (bq, bk, bv)]
        n, dim = x.shape
        if n == 0:
            return
        first = self._mma_first(x, *ws) and self._qkv_mma_tiles(n, ws) > 0
        if (n >= self.tiled_min_rows and not first) or len({w.kind for w in ws}) > 1:
            for out, w, b in zip((q, k, v), ws, bs, strict=True):
                self._matmul(stream, out, x, w, b)
            return
        total = sum(w.rows for w in ws)
        per_weight = _qkv_weight_args(ws, bs)
        if (gv := self._gemv(x, *ws))[0]:
            self._kernel(
                f"qkv_gemv{gv[0]}_q", (-(-total // gv[0]), 1, 1), gv[1], stream,
                self._ptr(q), self._ptr(k), self._ptr(v), self._ptr(x), *per_weight,
                *(I32(w.rows) for w in ws), I32(dim), weights=tuple(ws),
            )  # fmt: skip
            return
        suffix, xq = self._int8_x(stream, x, *ws)
        if xq and (nt := self._qkv_mma_tiles(n, ws)):
            self._qkv_mma(stream, (q, k, v), xq, ws, per_weight, n, dim, nt)
            return
        grid, rpb, no = self._small_grid(n, total)
        self._kernel(
            f"qkv_small{no}_{suffix}", grid, _THREADS, stream,
            self._ptr(q), self._ptr(k), self._ptr(v), P(xq) if xq else self._ptr(x),
            *per_weight, I32(n),
            *(I32(w.rows) for w in ws), I32(dim), I32(rpb), weights=tuple(ws),
        )  # fmt: skip

    def _qkv_mma_tiles(self, n: int, ws: list[GpuWeight]) -> int:
        """``_mma_tiles`` for qkv: a block of its mma kernel takes 16 features of one
        weight, so q and k in whole 16s; else 0."""
        return self._mma_tiles(n) if ws[0].rows % 16 == 0 and ws[1].rows % 16 == 0 else 0

    def _qkv_mma(
        self, stream: Stream, qkv: tuple[Tensor, Tensor, Tensor], xq: int,
        ws: list[GpuWeight], per_weight: list[Any], n: int, dim: int, nt: int,
        rope: list[Any] | None = None,
    ) -> None:  # fmt: skip
        """``qkv_mma{nt}_q8a`` of x packed at ``xq`` (``per_weight``: _qkv_weight_args);
        with ``rope`` (its RoPE and KV store arguments) ``qkv_rope_mma{nt}_q8a``."""
        grid, split = self._mma_split(stream, -(-sum(w.rows for w in ws) // 16), dim, 1, nt)
        self._kernel(
            f"qkv_{'rope_' if rope else ''}mma{nt}_q8a", grid, _mma_threads(1, nt), stream,
            *(self._ptr(t) for t in qkv), P(xq), *per_weight, I32(n),
            *(I32(w.rows) for w in ws), I32(dim), *split, *(rope or ()), weights=tuple(ws),
        )  # fmt: skip

    def op_qkv_rope_kv_store(
        self, stream: Stream, q: Tensor, k: Tensor, v: Tensor, x: Tensor, wq: Weight,
        wk: Weight, wv: Weight, positions: Tensor, slots: Tensor, cache: Tensor,
        layout: KVLayout, layer: int, n_heads: int, params: RopeParams,
        bq: Weight | None = None, bk: Weight | None = None, bv: Weight | None = None,
    ) -> None:  # fmt: skip
        """One row on the gemv kernels: projections, RoPE and the KV store in one launch
        (``qkv_rope_gemv_q``, a block per rotated pair of features). Otherwise ``qkv``, then
        ``rope_kv_store`` (each native or decomposed, as the backend runs them)."""
        args = {"q": q, "k": k, "v": v, "x": x, "wq": wq, "wk": wk, "wv": wv, "bq": bq,
                "bk": bk, "bv": bv, "positions": positions, "slots": slots, "cache": cache,
                "layout": layout, "layer": layer, "n_heads": n_heads, "params": params}  # fmt: skip
        self._qkv_rope(stream, "qkv_rope_kv_store", args)

    def op_rms_norm_qkv_rope_kv_store(
        self, stream: Stream, q: Tensor, k: Tensor, v: Tensor, x: Tensor, norm: Weight,
        eps: float, wq: Weight, wk: Weight, wv: Weight, positions: Tensor, slots: Tensor,
        cache: Tensor, layout: KVLayout, layer: int, n_heads: int, params: RopeParams,
        scratch: Tensor, bq: Weight | None = None, bk: Weight | None = None,
        bv: Weight | None = None,
    ) -> None:  # fmt: skip
        """One row on the gemv kernels, where the norm folds (``_fold_norm``):
        ``qkv_rope_norm_gemv_q``, the block normalising x as ``rms_norm`` does (the same sums
        and roundings: bit-equal to the two launches; late-scaled where ``norm_late`` or
        ``norm_fold_max_k`` compiled it so: not bit-equal). Otherwise ``rms_norm`` into
        ``scratch``, then ``qkv_rope_kv_store``."""
        args = {"q": q, "k": k, "v": v, "x": x, "norm": norm, "eps": eps, "wq": wq, "wk": wk,
                "wv": wv, "bq": bq, "bk": bk, "bv": bv, "positions": positions,
                "slots": slots, "cache": cache, "layout": layout, "layer": layer,
                "n_heads": n_heads, "params": params, "scratch": scratch}  # fmt: skip
        self._qkv_rope(stream, "rms_norm_qkv_rope_kv_store", args)

    def _qkv_rope(self, stream: Stream, op: str, a: dict[str, Any]) -> None:
        """``op`` (qkv_rope_kv_store or its rms_norm_ form) on its one-launch kernel where the
        gemv kernels take the step, else as the op's decomposition."""
        ws = [self._gpu_weight(a[w], op) for w in ("wq", "wk", "wv")]
        params: RopeParams = a["params"]
        gv = self._gemv(a["x"], *ws)  # all three WT_Q where it says yes
        norm = self._gpu_weight(a["norm"], op) if "norm" in a else None
        if norm is not None and not self._fold_norm(op, a["x"].shape[1]):
            gv = (0, 0)
        if (
            norm is not None
            and not gv[0]
            and self._norm_mma(a["x"], norm, *ws)
            and (nt := self._qkv_mma_tiles(a["x"].shape[0], ws))
        ):  # norm_quantize: x normalised and packed in one launch, then the mma kernel
            self._norm_qkv_mma(stream, a, norm, ws, nt)
            return
        if not gv[0] or params.head_dim % 2 or (norm is not None and norm.kind != W.WT_F32):
            self._decompose(stream, op, a)
            return
        extra = [] if norm is None else [P(norm.data), F32(a["eps"])]
        kernel = "qkv_rope_gemv_q" if norm is None else "qkv_rope_norm_gemv_q"
        self._qkv_rope_launch(stream, op, kernel, a, ws, gv[1], extra)

    def _norm_qkv_mma(
        self, stream: Stream, a: dict[str, Any], norm: GpuWeight, ws: list[GpuWeight], nt: int
    ) -> None:
        """rms_norm_qkv_rope_kv_store at int8 rows (``norm_quantize``): x normalised and
        quantized in one launch, then the projections, RoPE and the KV store on
        ``qkv_rope_mma{nt}_q8a`` (``mma_rope``), or on ``qkv_mma{nt}_q8a`` then
        ``rope_kv_store`` (the op's decomposition without rms_norm's and quantize_rows'
        launches: the same bits either way)."""
        op = "rms_norm_qkv_rope_kv_store"
        x: Tensor = a["x"]
        n, dim = x.shape
        params: RopeParams = a["params"]
        layout: KVLayout = a["layout"]
        # (k and v are each n_kv_heads * head_dim wide: the op's checks)
        rope: list[Any] | None = None
        if self.mma_rope and params.style != RopeStyle.neox and params.head_dim % 2 == 0:
            # what the launch refuses, refused before anything is launched
            table = rope_table(params)
            self._head_dim(layout, op)
            rope = [self._ptr(a["positions"]), self._ptr(a["slots"]), self._ptr(a["cache"]),
                    I32(params.head_dim), I32(layout.n_slots), I32(layout.n_layers),
                    I32(layout.max_len), I32(a["layer"]), table]  # fmt: skip
        _, xq = self._int8_x(stream, x, *ws, norm=norm, eps=a["eps"])
        per_weight = _qkv_weight_args(ws, self._qkv_biases(a, op))
        self._qkv_mma(stream, (a["q"], a["k"], a["v"]), xq, ws, per_weight, n, dim, nt, rope)
        if rope is not None:
            return
        rope_args = get_op("rope_kv_store").args
        self._dispatch_part("rope_kv_store", stream, **{arg.name: a[arg.name] for arg in rope_args})

    def _qkv_biases(self, a: dict[str, Any], op: str) -> list[int]:
        """The device addresses of ``op``'s q, k and v biases in ``a`` (0 where absent)."""
        return [self._gpu_weight(a[b], op).data if a.get(b) is not None else 0
                for b in ("bq", "bk", "bv")]  # fmt: skip

    def _qkv_rope_launch(
        self, stream: Stream, op: str, kernel: str, a: dict[str, Any], ws: list[GpuWeight],
        threads: int, extra: list[Any],
    ) -> None:  # fmt: skip
        """``kernel`` (qkv_rope_gemv_q or a norm form of it: ``extra`` its last arguments)
        of ``op``'s arguments ``a`` (x: the row the projections take)."""
        params: RopeParams = a["params"]
        layout: KVLayout = a["layout"]
        table = rope_table(params)
        self._head_dim(layout, op)
        per_weight = _qkv_weight_args(ws, self._qkv_biases(a, op))
        neox = 1 if params.style == RopeStyle.neox else 0
        threads = min(threads, _QKV_ROPE_MAX_THREADS)  # whatever gemv_*_threads ask
        self._kernel(
            kernel, (sum(w.rows for w in ws) // 2, 1, 1), threads, stream,
            self._ptr(a["q"]), self._ptr(a["k"]), self._ptr(a["v"]), self._ptr(a["x"]),
            *per_weight, I32(a["n_heads"]), I32(layout.n_kv_heads), I32(params.head_dim),
            I32(a["x"].shape[1]), I32(neox), self._ptr(a["positions"]), self._ptr(a["slots"]),
            self._ptr(a["cache"]), I32(layout.n_slots), I32(layout.n_layers),
            I32(layout.max_len), I32(a["layer"]), table, *extra, weights=tuple(ws),
        )  # fmt: skip

    def _decompose(self, stream: Stream, op: str, a: dict[str, Any]) -> None:
        """Run the fused ``op`` as its decomposition (each part native or decomposed)."""
        decompose = get_op(op).decompose
        assert decompose is not None  # a fused op
        decompose(self._dispatch_part, stream, a)

    # ---- the deferred norm: a projection and the op after its norm as one op
    def _proj_gemv(
        self, x: Tensor, w: GpuWeight, nw: GpuWeight, features: int = 0, unrolled: bool = False
    ) -> tuple[int, int]:
        """``_gemv``'s answer for a matmul_add_rms_norm* projection of ``x`` by ``w`` (norm
        weight ``nw``; ``features`` a block as ``_gemv`` takes them): (0, 0) where
        ``_matmul`` would not take the one-row gemv kernel (BLAS, or the unrolled kernel
        where the caller has no ``unrolled`` form)."""
        if nw.kind != W.WT_F32 or (not unrolled and self._unrolled(x.shape[1])):
            return 0, 0
        if x.shape[0] >= self.blas_min_rows and self._rt.blas():
            return 0, 0
        return self._gemv(x, w, features=features)

    def _deferred_gemv(self, x: Tensor, w: GpuWeight, nw: GpuWeight) -> tuple[int, int]:
        """``_proj_gemv`` for the deferred norm's projection (``deferred_norm_features`` a
        block), or (0, 0) where the norm's row (w's rows) is short enough to fold
        (``norm_fold_max_k``: the op after it folds the norm, which run 103 measured faster
        there)."""
        if w.rows <= self.norm_fold_max_k:
            return 0, 0
        return self._proj_gemv(x, w, nw, self.deferred_norm_features, unrolled=True)

    def _psq_producer(
        self, stream: Stream, a: dict[str, Any], w: GpuWeight, nw: GpuWeight,
        gv: tuple[int, int],
    ) -> tuple[int, int]:  # fmt: skip
        """matmul_psq_gemv*_q: out = residual + x @ w.T, scratch_norm = out * nw (not yet
        scaled) and a partial sum of out's squares a block; (their address, their count)."""
        count = -(-w.rows // gv[0])
        psq = self._scratch_at_least(4 * count, slot="deferred norm partial sums")
        u = "u" if self._unrolled(a["x"].shape[1]) else ""
        self._kernel(
            f"matmul_psq_gemv{u}{gv[0]}_q", (count, 1, 1), gv[1], stream,
            self._ptr(a["out"]), self._ptr(a["x"]), P(w.data), P(w.scales), I32(w.qarg), P(0),
            self._ptr(a["residual"]), I32(w.rows), I32(a["x"].shape[1]),
            self._ptr(a["scratch_norm"]), P(nw.data), P(psq), weights=(w,),
        )  # fmt: skip
        return psq, count

    def op_matmul_add_rms_norm_swiglu(self, stream: Stream, **a: Any) -> None:
        """One row on the gemv kernels, the norm deferred: ``matmul_psq_gemv*_q`` (the
        residual add, out * norm into scratch_norm and a partial sum of out's squares a
        block), then ``swiglu_psq_gemv*_q``, which sums the partials beside its products and
        scales its sums by the norm's 1 / sqrt(mean + eps) at the end (as the late-scaled
        fold: not bit-equal to the decomposition, within the kit's tolerances): no
        ``rms_norm`` launch and no pass over the norm weight in the gate and up kernel.
        Otherwise the op's decomposition."""
        op = "matmul_add_rms_norm_swiglu"
        w, nw = self._gpu_weight(a["weight"], op), self._gpu_weight(a["norm"], op)
        g, u = self._gpu_weight(a["gate"], op), self._gpu_weight(a["up"], op)
        pv = self._deferred_gemv(a["x"], w, nw)
        sv = (0, 0)
        if pv[0] and g.kind == u.kind:
            sv = self._gemv(a["scratch_norm"], g, u, **self._swiglu_gemv)
        if not sv[0]:
            self._decompose(stream, op, a)
            return
        psq, count = self._psq_producer(stream, a, w, nw, pv)
        self._kernel(
            f"swiglu_psq_gemv{sv[0]}_q", (-(-g.rows // sv[0]), 1, 1), sv[1], stream,
            self._ptr(a["act"]), self._ptr(a["scratch_norm"]), P(g.data), P(g.scales),
            I32(g.qarg), P(u.data), P(u.scales), I32(u.qarg), I32(g.rows), I32(w.rows),
            P(psq), I32(count), F32(a["eps"]), weights=(g, u),
        )  # fmt: skip

    def op_matmul_add_rms_norm_qkv_rope_kv_store(self, stream: Stream, **a: Any) -> None:
        """One row on the gemv kernels, the norm deferred as in
        ``op_matmul_add_rms_norm_swiglu``: ``matmul_psq_gemv*_q``, then
        ``qkv_rope_psq_gemv_q`` (``qkv_rope_gemv_q`` of out * norm, its sums scaled at the
        end). Otherwise the op's decomposition."""
        op = "matmul_add_rms_norm_qkv_rope_kv_store"
        w, nw = self._gpu_weight(a["weight"], op), self._gpu_weight(a["norm"], op)
        ws = [self._gpu_weight(a[n], op) for n in ("wq", "wk", "wv")]
        pv = self._deferred_gemv(a["x"], w, nw)
        qv = (0, 0)
        if pv[0] and a["params"].head_dim % 2 == 0:
            qv = self._gemv(a["scratch_norm"], *ws)
        if not qv[0]:
            self._decompose(stream, op, a)
            return
        psq, count = self._psq_producer(stream, a, w, nw, pv)
        extra = [P(psq), I32(count), F32(a["eps"])]
        rest = {**a, "x": a["scratch_norm"]}
        self._qkv_rope_launch(stream, op, "qkv_rope_psq_gemv_q", rest, ws, qv[1], extra)

    def op_rms_norm_swiglu(
        self, stream: Stream, out: Tensor, x: Tensor, norm: Weight, eps: float, gate: Weight,
        up: Weight, scratch: Tensor, scratch_gate: Tensor, scratch_up: Tensor,
    ) -> None:  # fmt: skip
        """One row on the gemv kernels, where the norm folds (``_fold_norm``):
        ``swiglu_norm_gemv*_q``, x normalised in the block as ``rms_norm`` does it (bit-equal
        to the two launches; late-scaled, not bit-equal, as ``op_rms_norm_qkv_rope_kv_store``
        says). Otherwise ``rms_norm`` into ``scratch``, then ``swiglu``."""
        g, u = self._gpu_weight(gate, "rms_norm_swiglu"), self._gpu_weight(up, "rms_norm_swiglu")
        nw = self._gpu_weight(norm, "rms_norm_swiglu")
        fold = nw.kind == W.WT_F32 and self._fold_norm("rms_norm_swiglu", x.shape[1])
        gv = self._gemv(x, g, u, **self._swiglu_gemv) if fold else (0, 0)
        nt = 0 if gv[0] or g.lg_block != u.lg_block else self._norm_mma(x, nw, g, u)
        if nt:  # norm_quantize: x normalised and packed in one launch, then the mma kernel
            _, xq = self._int8_x(stream, x, g, u, norm=nw, eps=eps)
            self._swiglu_mma(stream, out, xq, g, u, x.shape[0], x.shape[1], nt)
            return
        if not gv[0]:
            args = {"out": out, "x": x, "norm": norm, "eps": eps, "gate": gate, "up": up,
                    "scratch": scratch, "scratch_gate": scratch_gate,
                    "scratch_up": scratch_up}  # fmt: skip
            self._decompose(stream, "rms_norm_swiglu", args)
            return
        self._kernel(
            f"swiglu_norm_gemv{gv[0]}_q", (-(-g.rows // gv[0]), 1, 1), gv[1], stream,
            self._ptr(out), self._ptr(x), P(g.data), P(g.scales), I32(g.qarg),
            P(u.data), P(u.scales), I32(u.qarg), I32(g.rows), I32(x.shape[1]), P(nw.data),
            F32(eps), weights=(g, u),
        )  # fmt: skip

    def op_rope_kv_store(
        self, stream: Stream, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
        slots: Tensor, cache: Tensor, layout: KVLayout, layer: int, n_heads: int,
        params: RopeParams,
    ) -> None:  # fmt: skip
        """RoPE on q and k and the KV store in one launch."""
        table = rope_table(params)
        self._head_dim(layout, "rope_kv_store")
        n, d = q.shape[0], params.head_dim
        if n == 0:
            return
        neox = 1 if params.style == RopeStyle.neox else 0
        pairs = n * (n_heads + layout.n_kv_heads) * d // 2
        self._kernel(
            "rope_kv_store", (_blocks(pairs), 1, 1), _THREADS, stream,
            self._ptr(q), self._ptr(k), self._ptr(v), self._ptr(positions), self._ptr(slots),
            self._ptr(cache), I32(n), I32(n_heads), I32(layout.n_kv_heads), I32(d), I32(neox),
            I32(layout.n_slots), I32(layout.n_layers), I32(layout.max_len), I32(layer), table,
        )  # fmt: skip

    def op_rope(
        self, stream: Stream, x: Tensor, positions: Tensor, n_heads: int, params: RopeParams
    ) -> None:
        table = rope_table(params)  # refuses a head_dim the kernel cannot take
        n, d = x.shape[0], params.head_dim
        if n == 0 or n_heads == 0:
            return
        neox = 1 if params.style == RopeStyle.neox else 0
        self._kernel(
            "rope", (_blocks(n * n_heads * d // 2), 1, 1), _THREADS, stream,
            self._ptr(x), self._ptr(positions), I32(n), I32(n_heads), I32(d), I32(neox), table,
        )  # fmt: skip

    @staticmethod
    def _head_dim(layout: KVLayout, what: str) -> None:
        if layout.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"{what}: head_dim {layout.head_dim} exceeds {MAX_HEAD_DIM}")

    def op_kv_store(
        self,
        stream: Stream,
        cache: Tensor,
        k: Tensor,
        v: Tensor,
        slots: Tensor,
        positions: Tensor,
        layout: KVLayout,
        layer: int,
    ) -> None:
        self._head_dim(layout, "kv_store")
        n, row = k.shape
        if n:
            self._kernel(
                "kv_store", (_blocks(n * row), 1, 1), _THREADS, stream,
                self._ptr(cache), self._ptr(k), self._ptr(v), self._ptr(slots),
                self._ptr(positions), I32(n), I32(row), I32(layout.n_slots),
                I32(layout.n_layers), I32(layout.max_len), I32(layer),
            )  # fmt: skip

    def op_prefetch(self, stream: Stream, weight: Weight, paired: Weight | None = None) -> None:
        """The hint: kept for the next attention launch, whose split kernel brings up to
        ``prefetch_bytes`` of these weights into L2 before it waits (_prefetch_ranges); at
        most 8 hints wait for one launch (the graph gives 2), the rest are dropped."""
        w = self._gpu_weight(weight, "prefetch")
        p = None if paired is None else self._gpu_weight(paired, "prefetch")
        if self.prefetch_bytes > 0 and len(self._prefetch) < 8:
            self._prefetch.append((w, p))

    def _prefetch_ranges(self) -> VtPrefetch:
        """The hints since the last attention launch as the kernel's ranges (and forget
        them): each weight whole while ``prefetch_bytes`` lasts, then the same leading
        share of a weight and its pair (codes and scales alike: their first rows, which
        the first blocks of the op after read), in lines of 128 bytes."""
        hints, self._prefetch = self._prefetch, []
        if not hints:
            return _NO_PREFETCH
        pf, r, left = VtPrefetch(), 0, self.prefetch_bytes
        for w, p in hints:
            ws = [w] if p is None else [w, p]
            total = sum(x.buffer.nbytes for x in ws)
            share = min(1.0, left / total)
            for x in ws:
                parts = [(x.data, x.buffer.nbytes)]
                if x.scales and share < 1.0:  # codes, then scales (256-byte aligned)
                    parts = [(x.data, x.scales - x.data),
                             (x.scales, x.buffer.nbytes - (x.scales - x.data))]  # fmt: skip
                for at, size in parts:
                    n = -(-int(size * share) // 128) * 128
                    if n > 0 and r < len(pf.n):
                        pf.p[r], pf.n[r] = at, min(n, size)
                        r += 1
            left -= int(total * share)
            if left <= 0:
                break
        return pf

    def op_attention(
        self,
        stream: Stream,
        out: Tensor,
        q: Tensor,
        cache: Tensor,
        slots: Tensor,
        positions: Tensor,
        layout: KVLayout,
        layer: int,
        n_heads: int,
        scale: float,
        short: bool = False,
    ) -> None:
        """``short``: one launch of ``short_context_threads`` threads a (row, KV group), no
        splits (op_attention_bounded's rule)."""
        self._head_dim(layout, "attention")
        n = q.shape[0]
        if n == 0:
            return
        n_kv, hd = layout.n_kv_heads, layout.head_dim
        kv_args = (self._ptr(cache), self._ptr(slots), self._ptr(positions))
        tile = 0  # no tiled launch: attention_split takes every row
        if n >= self.attention_tiled_min_rows:
            # Tiles of rows of at most two sequences on the tiled kernel; the split kernel
            # below takes the rows of the other tiles (decode rows of many sequences beside a
            # prefill chunk), deciding on the device from the same slots: each row once.
            name, tile = self._tiled_attention_kernel(n, n_heads, hd)
            self._kernel(
                name, (-(-n // tile), n_heads, 1), _AT_THREADS, stream, self._ptr(out),
                self._ptr(q), *kv_args, I32(n), I32(n_heads), I32(n_kv), I32(hd),
                I32(layout.n_slots), I32(layout.n_layers), I32(layout.max_len), I32(layer),
                F32(scale),
            )  # fmt: skip
        group = n_heads // n_kv
        most = self.attention_max_group if n == 1 else self.attention_batch_max_group
        most = max(1, min(group, _FA_MAXG, most))
        gb = max(g for g in range(1, most + 1) if group % g == 0)
        blocks = n * n_kv * (group // gb)
        splits = max(1, min(self.attention_max_splits, -(-self.target_blocks // blocks)))
        splits = 1 if short else splits
        cluster = self.attention_cluster and splits > 1 and not tile and self._sm() >= 90
        if cluster:
            splits = _FA_CLUSTER
        wide = (
            n <= self.overlap_attention_max_rows
            and n < self.attention_tiled_min_rows
            and 0 < self.overlap_attention_min_q <= n_heads * hd
        )
        threads = self._short_threads() if short else self.attention_threads
        part = counts = 0
        xq = self._attention_q8a(stream, out, hd)
        if splits > 1:
            part = self._scratch_at_least(n * n_heads * splits * (hd + 2) * 4, slot="attention")
            if self.attention_last_block_combine and not cluster:
                counts = self._scratch_at_least(
                    n * n_kv * (group // gb) * 4, slot="attention counts", zero_on=stream
                )
        self._kernel(
            "attention_split_cluster" if cluster else "attention_split",
            (n, n_kv * (group // gb), splits), threads, stream,
            self._ptr(out), P(part), self._ptr(q), *kv_args, I32(n), I32(n_heads), I32(n_kv),
            I32(hd), I32(layout.n_slots), I32(layout.n_layers), I32(layout.max_len), I32(layer),
            F32(scale), I32(gb), I32(splits), I32(self.attention_min_split), I32(tile), P(counts),
            P(xq), self._prefetch_ranges(), overlap_attention=wide, short=short,
        )  # fmt: skip
        if splits > 1 and not counts and not cluster:
            self._kernel(
                "attention_combine", (n * n_heads, 1, 1), self.attention_threads, stream,
                self._ptr(out), P(part), self._ptr(slots), self._ptr(positions), I32(n),
                I32(n_heads), I32(hd), I32(layout.n_slots), I32(layout.max_len), I32(splits),
                I32(tile), I32(self.attention_min_split), P(xq), overlap_attention=wide,
            )  # fmt: skip
        if xq:
            self._q8a_ready = (stream.handle, self._address(out), n, n_heads * hd, xq)

    def op_attention_bounded(
        self,
        stream: Stream,
        out: Tensor,
        q: Tensor,
        cache: Tensor,
        slots: Tensor,
        positions: Tensor,
        layout: KVLayout,
        layer: int,
        n_heads: int,
        scale: float,
        context: int,
    ) -> None:
        """op_attention; at one row within ``short_context`` positions, where the query
        row is narrower than ``overlap_attention_min_q`` (its attention not overlapped), as
        one launch of ``short_context_threads`` threads a (row, KV group): no splits, no
        combine."""
        n, width = q.shape[0], n_heads * layout.head_dim
        short = (
            n == 1
            and context <= self.short_context
            and not 0 < self.overlap_attention_min_q <= width
            and n < self.attention_tiled_min_rows
        )
        self.op_attention(
            stream, out, q, cache, slots, positions, layout, layer, n_heads, scale, short
        )

    def _tiled_attention_kernel(self, n: int, n_heads: int, head_dim: int) -> tuple[str, int]:
        """The ``attention_tiled_*`` kernel for these rows and its rows per block: the
        smallest instantiated head_dim bound, and the most rows per block that still give
        ``target_blocks`` blocks (fewer, larger tiles read K/V less often; more blocks keep
        every SM busy and shorten the longest tile's chain of positions), else the fewest."""
        dmax = next(d for d in sorted(_TILED_ROWS) if head_dim <= d)
        options = _TILED_ROWS[dmax]
        rows = next((r for r in options if -(-n // r) * n_heads >= self.target_blocks),
                    options[-1])  # fmt: skip
        return f"attention_tiled_h{dmax}r{rows}", rows

    def _scratch_at_least(self, nbytes: int, slot: str, zero_on: Stream | None = None) -> int:
        """The address of a scratch buffer of at least ``nbytes`` for ``slot`` (what it
        holds: the BLAS path's float32 or half weight and half x, int8 rows of x,
        attention's split partials and counters). Outgrown buffers are kept until close (a
        captured graph may hold any of them); the first step of every shape runs eagerly, so
        none is allocated during a capture. ``zero_on``: a new buffer is zeroed on that
        stream (the kernels using it leave it zero)."""
        for s, buf in self._scratch:
            if s == slot and buf.nbytes >= nbytes:
                return self._addr(buf)
        buf = self._alloc(nbytes)
        self._scratch.append((slot, buf))
        if zero_on is not None:
            self._memset(buf, 0, zero_on)
        return self._addr(buf)

    def op_silu_mul(self, stream: Stream, out: Tensor, gate: Tensor, up: Tensor) -> None:
        n = out.size
        if n:
            self._kernel("silu_mul", (_blocks(n), 1, 1), _THREADS, stream, self._ptr(out),
                         self._ptr(gate), self._ptr(up), I32(n))  # fmt: skip

    def op_add(self, stream: Stream, out: Tensor, a: Tensor, b: Tensor) -> None:
        n = out.size
        if n:
            self._kernel("add", (_blocks(n), 1, 1), _THREADS, stream, self._ptr(out),
                         self._ptr(a), self._ptr(b), I32(n))  # fmt: skip

    def op_gather_rows(self, stream: Stream, out: Tensor, x: Tensor, rows: Tensor) -> None:
        m, dim = x.shape
        n = rows.shape[0]
        if n:
            self._kernel("gather_rows", (n, 1, 1), _THREADS, stream, self._ptr(out),
                         self._ptr(x), self._ptr(rows), I32(n), I32(dim), I32(m))  # fmt: skip

    def op_sample(self, stream: Stream, out: Tensor, logits: Tensor, params: Tensor) -> None:
        n, vocab = logits.shape
        if not 1 <= vocab < 1 << 24:  # the kernel reduces ids as floats: exact below 2**24
            raise ValueError(f"sample: vocab must be in [1, 2**24), got {vocab}")
        if not n:
            return
        # A long row's argmax over several blocks first (sample_argmax), a slice of at least
        # ``sample_argmax_slice`` ids each; the sample kernel then reduces their results.
        per = -(-max(self.sample_argmax_slice, -(-vocab // 128)) // 4) * 4
        parts = -(-vocab // per) if self.sample_argmax_slice else 1
        part = 0
        if parts > 1:
            part = self._scratch_at_least(n * parts * 12, slot="sample")
            self._kernel("sample_argmax", (n, parts, 1), _ARGMAX_THREADS, stream, P(part),
                         self._ptr(logits), I32(vocab), I32(per))  # fmt: skip
        self._kernel("sample", (n, 1, 1), _SAMPLE_THREADS, stream, self._ptr(out),
                     self._ptr(logits), self._ptr(params), I32(n), I32(vocab), P(part),
                     I32(parts if parts > 1 else 0))  # fmt: skip

    def op_logprobs(
        self, stream: Stream, chosen: Tensor, top_ids: Tensor, top_logprobs: Tensor,
        logits: Tensor, ids: Tensor, rows: Tensor,
    ) -> None:  # fmt: skip
        """One block of 256 threads (LP_THREADS) per requested row; k up to 20 (LP_MAX_K in
        kernels/logprobs.cu): only the chosen logprob and k (id, logprob) pairs per row are
        written, for the runner to read back instead of the logits."""
        m, k = top_ids.shape
        n, vocab = logits.shape
        if k > 20:
            raise ValueError(f"logprobs: k={k} alternatives exceed the kernel's 20 (LP_MAX_K)")
        if m:
            self._kernel(
                "logprobs", (m, 1, 1), 256, stream, self._ptr(chosen),
                self._ptr(top_ids), self._ptr(top_logprobs), self._ptr(logits), self._ptr(ids),
                self._ptr(rows), I32(m), I32(k), I32(n), I32(vocab),
            )  # fmt: skip
