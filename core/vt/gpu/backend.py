"""GpuBackend: the whole vt.Backend protocol over a :class:`GpuRuntime` and kernels.cu.

Written once for every GPU vendor: a plugin subclasses it with a name, a probe and its
capability function, and hands it its runtime adapter. Device pointers are plain ints
(``Buffer.handle``), so ``Buffer.offset`` is pointer arithmetic.

Kernel methods check their arguments on the host (sizes against buffers, shapes against
weights) and enqueue one launch: no allocation, no host synchronisation, so a decode step
can later be captured in a graph. The kernel source is compiled on first use (at weight
upload, before any step) and cached per process and device.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, ClassVar

import numpy as np

from ..backend import (
    SAMPLE_PARAMS_DTYPE,
    Backend,
    Buffer,
    Event,
    Graph,
    HostBuffer,
    KVLayout,
    RopeParams,
    RopeStyle,
    Segment,
    Stream,
    VirtualRange,
    Weight,
    WeightTensor,
)
from ..capabilities import Capabilities
from ..errors import VmmError
from . import weights as W
from .runtime import GpuCallError, GpuRuntime, host_array

P, I32, F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float

#: Largest head_dim the rope and attention kernels take (ROPE_MAX_PAIRS, qs[256]).
MAX_HEAD_DIM = 256
_THREADS = 256
_SAMPLE_THREADS = 512
_MAX_BLOCKS = 65535


class RopeTable(ctypes.Structure):
    """kernels.cu's RopeTable: inverse frequencies in float64, passed by value."""

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


@lru_cache(maxsize=1)
def kernel_source() -> str:
    """The one kernel source (kernels.cu beside this module)."""
    return resources.files(__package__).joinpath("kernels.cu").read_text(encoding="utf-8")


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

    @property
    def suffix(self) -> str:
        return W.SUFFIX[self.kind]


@dataclass(eq=False)
class _GpuGraph:
    """What ``Graph.handle`` holds: the executable graph (its source graph is destroyed)."""

    exec: Any
    destroyed: bool = False


@dataclass(eq=False)
class _Reservation:
    """The state behind a VirtualRange: its base address and mapped segments."""

    base: int
    segments: list[Segment] = field(default_factory=list)
    unmapped: list[Segment] = field(default_factory=list)  # unmapped, release failed
    released: bool = False

    def mapped_prefix(self) -> int:
        """End of the run of segments that starts at offset 0 without gaps."""
        end = 0
        for seg in sorted(self.segments, key=lambda s: s.offset):
            if seg.offset != end:
                break
            end += seg.nbytes
        return end


def _host_ptr(array: np.ndarray, writable: bool = False) -> int:
    if not array.flags.c_contiguous:
        raise ValueError("host array must be C-contiguous (use np.ascontiguousarray)")
    if writable and not array.flags.writeable:
        raise ValueError("destination host array is read-only")
    return int(array.ctypes.data)


def _check_fits(what: str, nbytes: int, capacity: int) -> None:
    if nbytes > capacity:
        raise ValueError(f"{what}: {nbytes} bytes do not fit in a buffer of {capacity} bytes")


def _blocks(n: int, per: int = _THREADS) -> int:
    return max(1, min(_MAX_BLOCKS, -(-n // per)))


class GpuBackend(Backend):
    """A GPU through a vendor runtime adapter; the plugin supplies name, probe and caps."""

    name: ClassVar[str] = "gpu"
    description: ClassVar[str] = "a GPU through a runtime adapter (vt.gpu)"
    #: Batches of at least this many rows use the tiled matmul, smaller ones the warp one.
    tiled_min_rows: int = 16

    def __init__(self, runtime: GpuRuntime, capabilities: Capabilities) -> None:
        self._rt = runtime
        self.capabilities = capabilities
        self._kernels: Any = None
        self._functions: dict[str, Any] = {}
        self._granularity: int | None = None
        self._lock = threading.Lock()

    @property
    def runtime(self) -> GpuRuntime:
        return self._rt

    def close(self) -> None:
        """Forget the kernels and let the adapter release its context (idempotent)."""
        self._functions.clear()
        self._kernels = None
        self._rt.close()

    # ---- kernels: compiled once per process (the adapter caches the binary)
    def compile_options(self) -> list[str]:
        return [f"-DVT_WARP={self._rt.warp_size()}"]

    def _module(self) -> Any:
        with self._lock:
            if self._kernels is None:
                self._kernels = self._rt.compile(
                    kernel_source(), "vt_kernels.cu", self.compile_options()
                )
        return self._kernels

    def _fn(self, name: str) -> Any:
        fn = self._functions.get(name)
        if fn is None:
            fn = self._rt.get_function(self._module(), name)
            self._functions[name] = fn
        return fn

    def prepare(self) -> None:
        """Compile the kernels now (upload_weight does it too, before any step runs)."""
        self._module()

    def _launch(
        self,
        name: str,
        grid: tuple[int, int, int],
        block: int,
        stream: Stream,
        *args: Any,
    ) -> None:
        self._rt.launch(self._fn(name), grid, (block, 1, 1), 0, stream.handle, args)

    # ---- memory
    @staticmethod
    def _addr(buf: Buffer) -> int:
        return int(buf.handle) + buf.offset

    def alloc(self, nbytes: int) -> Buffer:
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes} bytes)")
        return Buffer(int(self._rt.malloc(nbytes)), nbytes, owner=self.name)

    def free(self, buf: Buffer) -> None:
        if buf.offset:
            raise ValueError("free() takes the buffer alloc() returned, not a view of it")
        self._rt.free(int(buf.handle))

    def memset(self, buf: Buffer, value: int, stream: Stream | None = None) -> None:
        if not 0 <= value <= 255:
            raise ValueError(f"memset value must be a byte (0..255), got {value}")
        handle = None if stream is None else stream.handle
        self._rt.memset(self._addr(buf), value, buf.nbytes, handle)

    def copy_h2d(self, dst: Buffer, src: np.ndarray) -> None:
        src = np.ascontiguousarray(src)
        _check_fits("copy_h2d", src.nbytes, dst.nbytes)
        self._rt.memcpy_h2d(self._addr(dst), _host_ptr(src), src.nbytes)

    def copy_d2h(self, dst: np.ndarray, src: Buffer) -> None:
        _check_fits("copy_d2h", dst.nbytes, src.nbytes)
        self._rt.memcpy_d2h(_host_ptr(dst, writable=True), self._addr(src), dst.nbytes)

    def copy_h2d_async(self, dst: Buffer, src: HostBuffer | np.ndarray, stream: Stream) -> None:
        # No ascontiguousarray here: a temporary copy could die before the stream reads it.
        array = src.array if isinstance(src, HostBuffer) else src
        _check_fits("copy_h2d_async", array.nbytes, dst.nbytes)
        self._rt.memcpy_h2d(self._addr(dst), _host_ptr(array), array.nbytes, stream.handle)

    def copy_d2h_async(self, dst: HostBuffer, src: Buffer, stream: Stream) -> None:
        _check_fits("copy_d2h_async", dst.nbytes, src.nbytes)
        ptr = _host_ptr(dst.array, writable=True)
        self._rt.memcpy_d2h(ptr, self._addr(src), dst.nbytes, stream.handle)

    def copy_d2d(self, dst: Buffer, src: Buffer, nbytes: int, stream: Stream) -> None:
        _check_fits("copy_d2d source", nbytes, src.nbytes)
        _check_fits("copy_d2d destination", nbytes, dst.nbytes)
        self._rt.memcpy_d2d(self._addr(dst), self._addr(src), nbytes, stream.handle)

    def alloc_pinned(self, nbytes: int) -> HostBuffer:
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes} bytes)")
        ptr, array = self._rt.host_alloc(nbytes)
        return HostBuffer(array, handle=int(ptr), pinned=True)

    def free_pinned(self, buf: HostBuffer) -> None:
        if buf.pinned and buf.handle is not None:
            self._rt.host_free(buf.handle)
            buf.handle = None  # a second free is a no-op, not a double free

    def host_view(self, buf: Buffer) -> np.ndarray:
        # The effective capability decides: an override that turns it off is honoured.
        if not self.capabilities.device_memory_is_host_addressable:
            return super().host_view(buf)
        return host_array(self._addr(buf), buf.nbytes)

    # ---- streams and events
    def create_stream(self, name: str = "") -> Stream:
        return Stream(self._rt.stream_create(), name)

    def destroy_stream(self, stream: Stream) -> None:
        self._rt.stream_destroy(stream.handle)

    def synchronize(self, stream: Stream) -> None:
        self._rt.stream_synchronize(stream.handle)

    def create_event(self) -> Event:
        return Event(self._rt.event_create())

    def destroy_event(self, event: Event) -> None:
        self._rt.event_destroy(event.handle)

    def record_event(self, event: Event, stream: Stream) -> None:
        self._rt.event_record(event.handle, stream.handle)

    def query_event(self, event: Event) -> bool:
        return self._rt.event_query(event.handle)

    def synchronize_event(self, event: Event) -> None:
        self._rt.event_synchronize(event.handle)

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        self._rt.stream_wait_event(stream.handle, event.handle)

    # ---- graphs: stream capture, instantiated at once; the source graph is not kept
    def begin_capture(self, stream: Stream) -> None:
        self._rt.graph_begin_capture(stream.handle)

    def end_capture(self, stream: Stream) -> Graph:
        graph = self._rt.graph_end_capture(stream.handle)
        try:
            graph_exec = self._rt.graph_instantiate(graph)
        finally:
            self._rt.graph_destroy(graph)  # an executable graph does not need its source
        return Graph(_GpuGraph(graph_exec), stream.name)

    def _gpu_graph(self, graph: Graph) -> _GpuGraph:
        g = graph.handle
        if not isinstance(g, _GpuGraph):
            raise ValueError(f"graph is not a graph of the {self.name} backend")
        if g.destroyed:
            raise ValueError(f"graph captured on {graph.name!r} was destroyed")
        return g

    def launch_graph(self, graph: Graph, stream: Stream) -> None:
        self._rt.graph_launch(self._gpu_graph(graph).exec, stream.handle)

    def destroy_graph(self, graph: Graph) -> None:
        g = self._gpu_graph(graph)
        g.destroyed = True  # in-flight replays finish; the runtime frees it after them
        self._rt.graph_exec_destroy(g.exec)

    # ---- virtual memory
    def vmm_granularity(self) -> int:
        if self._granularity is None:
            self._granularity = int(self._rt.vmm_granularity())
        return self._granularity

    def _check_multiple(self, what: str, nbytes: int, allow_zero: bool = False) -> int:
        g = self.vmm_granularity()
        if nbytes < 0 or nbytes % g or (nbytes == 0 and not allow_zero):
            kind = "a multiple" if allow_zero else "a non-zero multiple"
            raise VmmError(f"{what} of {nbytes} bytes must be {kind} of granularity {g}")
        return g

    def vmm_reserve(self, nbytes: int) -> VirtualRange:
        self._check_multiple("reservation", nbytes)
        return VirtualRange(_Reservation(int(self._rt.vmm_reserve(nbytes))), nbytes)

    def _reservation(self, vrange: VirtualRange) -> _Reservation:
        res = vrange.handle
        if not isinstance(res, _Reservation):
            raise VmmError(f"not a reservation of the {self.name} backend")
        if res.released:
            raise VmmError("the reservation was already released")
        return res

    def vmm_map(self, vrange: VirtualRange, offset: int, nbytes: int) -> Segment:
        res = self._reservation(vrange)
        self._check_multiple("segment", nbytes)
        self._check_multiple("segment offset", offset, allow_zero=True)
        if offset + nbytes > vrange.nbytes:
            raise VmmError(
                f"segment would exceed reserve: {offset} + {nbytes} > {vrange.nbytes} bytes"
            )
        for seg in res.segments:
            if offset < seg.offset + seg.nbytes and seg.offset < offset + nbytes:
                raise VmmError(
                    f"segment [{offset}, {offset + nbytes}) overlaps the mapped segment "
                    f"[{seg.offset}, {seg.offset + seg.nbytes})"
                )
        handle = self._rt.vmm_create(nbytes)
        try:
            self._rt.vmm_map(res.base + offset, nbytes, handle)
        except GpuCallError:
            with contextlib.suppress(GpuCallError):  # the map failure is the error to report
                self._rt.vmm_release(handle)
            raise
        segment = Segment(handle, offset, nbytes)
        res.segments.append(segment)
        # Access is set over the whole mapped prefix, not just the new segment (as the
        # original engine did on ROCm); a segment past a gap gets access on its own.
        prefix = res.mapped_prefix()
        start, size = (0, prefix) if offset + nbytes <= prefix else (offset, nbytes)
        try:
            self._rt.vmm_set_access(res.base + start, size)
        except GpuCallError:
            with contextlib.suppress(GpuCallError):
                self.vmm_unmap(vrange, segment)
            if segment in res.unmapped:
                # Its release failed, and the caller never sees this segment to retry it:
                # forget it (leaking the physical memory) so the reservation can be freed.
                res.unmapped.remove(segment)
                res.segments.remove(segment)
            raise
        return segment

    def vmm_unmap(self, vrange: VirtualRange, segment: Segment) -> None:
        res = self._reservation(vrange)
        if segment not in res.segments:
            raise VmmError(
                f"segment [{segment.offset}, {segment.offset + segment.nbytes}) "
                "is not mapped in this reservation"
            )
        if segment not in res.unmapped:  # a retry after a failed release only releases
            self._rt.vmm_unmap(res.base + segment.offset, segment.nbytes)
            res.unmapped.append(segment)
        self._rt.vmm_release(segment.handle)
        # Forget the segment only now, so the arena's retry of a failed release finds it.
        res.unmapped.remove(segment)
        res.segments.remove(segment)

    def vmm_release(self, vrange: VirtualRange) -> None:
        res = vrange.handle
        if isinstance(res, _Reservation) and res.released:
            return
        res = self._reservation(vrange)
        if res.segments:
            raise VmmError(
                f"unmap the {len(res.segments)} mapped segment(s) before releasing the reservation"
            )
        self._rt.vmm_address_free(res.base, vrange.nbytes)
        res.released = True

    def vmm_buffer(self, vrange: VirtualRange) -> Buffer:
        return Buffer(self._reservation(vrange).base, vrange.nbytes, owner=self.name)

    # ---- argument checks (host side, before anything is enqueued)
    def _need(self, buf: Buffer, nbytes: int, what: str) -> int:
        if nbytes > buf.nbytes:
            raise ValueError(
                f"{self.name} {what}: needs {nbytes} bytes, the buffer has {buf.nbytes}"
            )
        return self._addr(buf)

    @staticmethod
    def _count(n: int, what: str) -> None:
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"{what} must be a non-negative integer, got {n!r}")

    def _gpu_weight(self, weight: Weight, what: str) -> GpuWeight:
        handle = weight.handle
        if not isinstance(handle, GpuWeight):
            raise ValueError(f"{what}: weight {weight.name!r} was not uploaded by {self.name}")
        return handle

    def _vector(self, weight: Weight, length: int, what: str) -> int:
        w = self._gpu_weight(weight, what)
        if w.kind != W.WT_F32 or w.rows * w.cols != length or len(weight.shape) != 1:
            raise ValueError(
                f"{what}: weight {weight.name!r} has shape {tuple(weight.shape)}, not ({length},)"
            )
        return w.data

    # ---- kernels
    def upload_weight(self, tensor: WeightTensor) -> Weight:
        packed = W.pack(tensor)
        self.prepare()  # compile before the first step, never during one
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
        )
        return Weight(tensor.name, tuple(int(d) for d in tensor.shape), handle, tensor.ggml_type)

    def free_weight(self, weight: Weight) -> None:
        handle = weight.handle
        if isinstance(handle, GpuWeight) and handle.buffer is not None:
            buf, handle.buffer = handle.buffer, None  # type: ignore[assignment]
            self.free(buf)

    def embedding(self, out: Buffer, table: Weight, ids: Buffer, n: int, stream: Stream) -> None:
        self._count(n, "embedding n")
        w = self._gpu_weight(table, "embedding")
        if len(table.shape) != 2:
            raise ValueError(f"embedding: table {table.name!r} must be a matrix")
        o = self._need(out, n * w.cols * 4, "embedding out")
        i = self._need(ids, n * 4, "embedding ids")
        if n == 0:
            return
        self._launch(
            f"embedding_{w.suffix}", (n, 1, 1), _THREADS, stream,
            P(o), P(w.data), P(w.scales), I32(w.lg_block), P(i), I32(n), I32(w.rows),
            I32(w.cols),
        )  # fmt: skip

    def rms_norm(
        self, out: Buffer, x: Buffer, weight: Weight, n: int, dim: int, eps: float, stream: Stream
    ) -> None:
        self._count(n, "rms_norm n")
        w = self._vector(weight, dim, "rms_norm")
        xa = self._need(x, n * dim * 4, "rms_norm x")
        o = self._need(out, n * dim * 4, "rms_norm out")
        if n == 0:
            return
        self._launch("rms_norm", (n, 1, 1), _THREADS, stream, P(o), P(xa), P(w), I32(n),
                     I32(dim), F32(eps))  # fmt: skip

    def matmul(
        self,
        out: Buffer,
        x: Buffer,
        weight: Weight,
        n: int,
        stream: Stream,
        bias: Weight | None = None,
    ) -> None:
        self._count(n, "matmul n")
        w = self._gpu_weight(weight, "matmul")
        if len(weight.shape) != 2:
            raise ValueError(f"matmul: weight {weight.name!r} must be a matrix")
        out_f, in_f = w.rows, w.cols
        b = 0
        if bias is not None:
            bw = self._gpu_weight(bias, "matmul")
            if bw.kind != W.WT_F32 or bw.rows * bw.cols != out_f or len(bias.shape) != 1:
                raise ValueError(
                    f"matmul: bias {bias.name!r} has shape {tuple(bias.shape)}, not ({out_f},)"
                )
            b = bw.data
        xa = self._need(x, n * in_f * 4, "matmul x")
        o = self._need(out, n * out_f * 4, "matmul out")
        if n == 0:
            return
        args = (P(o), P(xa), P(w.data), P(w.scales), I32(w.lg_block), P(b), I32(n),
                I32(out_f), I32(in_f))  # fmt: skip
        if n >= self.tiled_min_rows:
            grid = (-(-out_f // 64), -(-n // 64), 1)
            self._launch(f"matmul_tiled_{w.suffix}", grid, 256, stream, *args)
        else:
            warps = _THREADS // self._rt.warp_size()
            grid = (-(-out_f // warps), -(-n // 4), 1)
            self._launch(f"matmul_small_{w.suffix}", grid, _THREADS, stream, *args)

    def rope(
        self,
        x: Buffer,
        positions: Buffer,
        n: int,
        n_heads: int,
        params: RopeParams,
        stream: Stream,
    ) -> None:
        self._count(n, "rope n")
        table = rope_table(params)
        d = params.head_dim
        xa = self._need(x, n * n_heads * d * 4, "rope x")
        pos = self._need(positions, n * 4, "rope positions")
        if n == 0 or n_heads == 0:
            return
        neox = 1 if params.style == RopeStyle.neox else 0
        self._launch(
            "rope", (_blocks(n * n_heads * d // 2), 1, 1), _THREADS, stream,
            P(xa), P(pos), I32(n), I32(n_heads), I32(d), I32(neox), table,
        )  # fmt: skip

    def _check_layout(self, cache: Buffer, layout: KVLayout, layer: int, what: str) -> int:
        if not 0 <= layer < layout.n_layers:
            raise ValueError(f"{what}: layer {layer} is out of range [0, {layout.n_layers})")
        if layout.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"{what}: head_dim {layout.head_dim} exceeds {MAX_HEAD_DIM}")
        return self._need(cache, layout.nbytes, f"{what} cache")

    def kv_store(
        self,
        cache: Buffer,
        layout: KVLayout,
        layer: int,
        k: Buffer,
        v: Buffer,
        slots: Buffer,
        positions: Buffer,
        n: int,
        stream: Stream,
    ) -> None:
        self._count(n, "kv_store n")
        c = self._check_layout(cache, layout, layer, "kv_store")
        row = layout.n_kv_heads * layout.head_dim
        ka = self._need(k, n * row * 4, "kv_store k")
        va = self._need(v, n * row * 4, "kv_store v")
        s = self._need(slots, n * 4, "kv_store slots")
        p = self._need(positions, n * 4, "kv_store positions")
        if n == 0:
            return
        self._launch(
            "kv_store", (_blocks(n * row), 1, 1), _THREADS, stream,
            P(c), P(ka), P(va), P(s), P(p), I32(n), I32(row), I32(layout.n_slots),
            I32(layout.n_layers), I32(layout.max_len), I32(layer),
        )  # fmt: skip

    def attention(
        self,
        out: Buffer,
        q: Buffer,
        cache: Buffer,
        layout: KVLayout,
        layer: int,
        slots: Buffer,
        positions: Buffer,
        n: int,
        n_heads: int,
        scale: float,
        stream: Stream,
    ) -> None:
        self._count(n, "attention n")
        n_kv, hd = layout.n_kv_heads, layout.head_dim
        if n_heads <= 0 or n_heads % n_kv:
            raise ValueError(f"attention: n_heads {n_heads} is not a multiple of n_kv_heads {n_kv}")
        c = self._check_layout(cache, layout, layer, "attention")
        qa = self._need(q, n * n_heads * hd * 4, "attention q")
        o = self._need(out, n * n_heads * hd * 4, "attention out")
        s = self._need(slots, n * 4, "attention slots")
        p = self._need(positions, n * 4, "attention positions")
        if n == 0:
            return
        self._launch(
            "attention", (n, n_heads, 1), _THREADS, stream,
            P(o), P(qa), P(c), P(s), P(p), I32(n), I32(n_heads), I32(n_kv), I32(hd),
            I32(layout.n_slots), I32(layout.n_layers), I32(layout.max_len), I32(layer),
            F32(scale),
        )  # fmt: skip

    def silu_mul(self, out: Buffer, gate: Buffer, up: Buffer, n: int, stream: Stream) -> None:
        self._count(n, "silu_mul n")
        g = self._need(gate, n * 4, "silu_mul gate")
        u = self._need(up, n * 4, "silu_mul up")
        o = self._need(out, n * 4, "silu_mul out")
        if n:
            self._launch("silu_mul", (_blocks(n), 1, 1), _THREADS, stream, P(o), P(g), P(u), I32(n))

    def add(self, out: Buffer, a: Buffer, b: Buffer, n: int, stream: Stream) -> None:
        self._count(n, "add n")
        aa = self._need(a, n * 4, "add a")
        ba = self._need(b, n * 4, "add b")
        o = self._need(out, n * 4, "add out")
        if n:
            self._launch("add", (_blocks(n), 1, 1), _THREADS, stream, P(o), P(aa), P(ba), I32(n))

    def gather_rows(
        self, out: Buffer, x: Buffer, rows: Buffer, n: int, dim: int, stream: Stream
    ) -> None:
        self._count(n, "gather_rows n")
        if dim <= 0:
            raise ValueError(f"gather_rows: dim must be positive, got {dim}")
        m = x.nbytes // (4 * dim)
        xa = self._need(x, m * dim * 4, "gather_rows x")
        r = self._need(rows, n * 4, "gather_rows rows")
        o = self._need(out, n * dim * 4, "gather_rows out")
        if n:
            self._launch("gather_rows", (n, 1, 1), _THREADS, stream, P(o), P(xa), P(r), I32(n),
                         I32(dim), I32(m))  # fmt: skip

    def sample(
        self,
        out_ids: Buffer,
        logits: Buffer,
        params: Buffer,
        n: int,
        vocab: int,
        stream: Stream,
    ) -> None:
        self._count(n, "sample n")
        if vocab <= 0 or vocab >= 1 << 24:
            raise ValueError(f"sample: vocab must be in [1, 2**24), got {vocab}")
        lg = self._need(logits, n * vocab * 4, "sample logits")
        pa = self._need(params, n * SAMPLE_PARAMS_DTYPE.itemsize, "sample params")
        o = self._need(out_ids, n * 4, "sample out_ids")
        if n:
            self._launch("sample", (n, 1, 1), _SAMPLE_THREADS, stream, P(o), P(lg), P(pa), I32(n),
                         I32(vocab))  # fmt: skip
