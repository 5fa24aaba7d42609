"""The backend protocol: the only way vt touches a device.

In layers (tinygrad's ``Allocator`` style: public methods check arguments once, here, and
call the backend's hooks, which trust them):

- the required core of :class:`Backend`: memory (``_alloc``, ``_free``, ``_memset``),
  copies (``_copy_h2d``, ``_copy_d2h``, ``_copy_h2d_async``, ``_copy_d2d``), streams
  (``_create_stream``, ``_destroy_stream``, ``_synchronize``) and weights
  (``_upload_weight``, ``_free_weight``);
- optional mixins, one per capability that needs code (:mod:`vt.protocol.mixins`): ``Events``,
  ``PinnedHostMemory``, ``AsyncD2HCopy``, ``HostAddressable``, ``Graphs``,
  ``VirtualMemory``;
- ops (:mod:`vt.protocol.ops`): methods ``op_<name>(stream, **args)``, called through
  :meth:`Backend.launch`.

Work enqueued on a :class:`Stream` runs in order and asynchronously to the host; ops and
``*_async`` copies never block the host and never allocate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..errors import CapabilityError, HostAccessError, KernelNotImplementedError
from ..reference.quant import ggml_type_name
from .capabilities import Capabilities
from .handles import (
    SAMPLE_PARAMS_DTYPE,
    Buffer,
    Event,
    Graph,
    HostBuffer,
    KVLayout,
    RopeParams,
    RopeStyle,
    Segment,
    Stream,
    Tensor,
    VirtualRange,
    Weight,
    WeightTensor,
)
from .ops import OPS, get_op

__all__ = [
    "SAMPLE_PARAMS_DTYPE",
    "Backend",
    "Buffer",
    "Event",
    "Graph",
    "HostBuffer",
    "KVLayout",
    "Probe",
    "RopeParams",
    "RopeStyle",
    "Segment",
    "Stream",
    "Tensor",
    "VirtualRange",
    "Weight",
    "WeightTensor",
]


@functools.cache
def _type_name(ggml_type: int) -> str:
    return ggml_type_name(ggml_type)


def _missing(backend: Backend, what: str) -> KernelNotImplementedError:
    return KernelNotImplementedError(f"backend {backend.name!r} does not implement {what}")


def _host_bytes(src: np.ndarray | HostBuffer, what: str) -> np.ndarray:
    arr = src.array if isinstance(src, HostBuffer) else np.asarray(src)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: host array must be C-contiguous")
    return arr.reshape(-1).view(np.uint8)


def _size(nbytes: object, what: str) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"{what}: size must be a non-negative integer, got {nbytes!r}")
    return int(nbytes)


class Backend:
    """Base class of every backend: the required core. Subclasses implement the hooks.

    Class attributes: ``name`` (unique), ``priority`` (higher wins under ``auto``),
    ``description``, ``emulated`` (True for a stand-in that runs no real hardware:
    ``auto`` never picks it). What the hardware is (physical facts) is declared once, in
    :meth:`probe`; vt derives the rest from the mixins the class implements
    (:func:`vt.protocol.mixins.derive_capabilities`).
    """

    name: ClassVar[str] = "base"
    priority: ClassVar[int] = 0
    description: ClassVar[str] = ""
    emulated: ClassVar[bool] = False
    #: Tokens per engine step when the user does not choose (``max_batch_tokens=None``): a
    #: hint for the runner, not a limit. Larger where a step's fixed cost is high (a GPU
    #: copies every quantized weight once per prefill chunk for its GEMMs); smaller keeps a
    #: step, and so the decode latency of requests beside a long prompt, short on a CPU.
    default_batch_tokens: ClassVar[int] = 256
    #: Replay prefill and mixed steps as graphs too (padded to a token bucket; needs the
    #: ``graphs`` capability): a hint, for a backend whose step costs more in launches
    #: than padding costs in compute (a GPU). ``VT_PREFILL_GRAPHS`` overrides it.
    prefill_graphs: ClassVar[bool] = False
    #: Context bounds (positions, ascending) that the backend's attention kernels differ by:
    #: a step whose rows all end within a bound launches ``attention_bounded`` with the
    #: smallest such bound, and the runner keys its graphs by it (a graph replayed while the
    #: context grows stays within its bound); a longer step launches plain ``attention``.
    #: Empty (the default): one class, plain ``attention`` everywhere.
    context_classes: tuple[int, ...] = ()

    @classmethod
    def probe(cls) -> Probe:
        """Is the hardware there, and what does it declare? Must be cheap; may raise."""
        return Probe(available=True)

    @property
    def capabilities(self) -> Capabilities:
        """The effective capabilities: set by the registry when it creates the backend;
        for an instance made directly, derived from :meth:`probe` without overrides."""
        caps = self.__dict__.get("_vt_capabilities")
        if caps is None:
            from .mixins import derive_capabilities

            probe = type(self).probe()
            caps = derive_capabilities(type(self), probe.capabilities or Capabilities())
            self.__dict__["_vt_capabilities"] = caps
        return caps

    @capabilities.setter
    def capabilities(self, caps: Capabilities) -> None:
        if not isinstance(caps, Capabilities):
            raise TypeError(f"capabilities must be vt.Capabilities, got {type(caps).__name__}")
        self.__dict__["_vt_capabilities"] = caps

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release everything the backend holds."""

    # ------------------------------------------------------------------ checks
    def _own(self, buf: Buffer, what: str) -> Buffer:
        if not isinstance(buf, Buffer):
            raise TypeError(f"{what}: expected a vt.Buffer, got {type(buf).__name__}")
        if buf.owner and buf.owner != self.name:
            raise ValueError(f"{what}: buffer of backend {buf.owner!r} passed to {self.name!r}")
        return buf

    def _own_weight(self, weight: Weight, what: str) -> Weight:
        if weight.owner and weight.owner != self.name:
            raise ValueError(
                f"{what}: weight {weight.name!r} of backend {weight.owner!r} "
                f"passed to {self.name!r}"
            )
        return weight

    @staticmethod
    def _fits(buf: Buffer, nbytes: int, what: str) -> None:
        if nbytes > buf.nbytes:
            raise ValueError(f"{what}: {nbytes} bytes do not fit the buffer of {buf.nbytes}")

    # ------------------------------------------------------------------ memory
    def alloc(self, nbytes: int) -> Buffer:
        """``nbytes`` of device memory (contents unspecified)."""
        buf = self._alloc(_size(nbytes, "alloc"))
        buf.owner = buf.owner or self.name
        return buf

    def free(self, buf: Buffer) -> None:
        self._free(self._own(buf, "free"))

    def memset(self, buf: Buffer, value: int, stream: Stream | None = None) -> None:
        """Set every byte of ``buf`` to ``value``; synchronous when ``stream`` is None."""
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"memset: value {value!r} is not a byte")
        if not 0 <= value <= 255:
            raise ValueError(f"memset: value {value} is not a byte")
        self._memset(self._own(buf, "memset"), int(value), stream)

    def copy_h2d(self, dst: Buffer, src: np.ndarray) -> None:
        """Synchronous host-to-device copy of ``src``'s bytes to the start of ``dst``."""
        data = _host_bytes(src, "copy_h2d")
        self._fits(self._own(dst, "copy_h2d dst"), data.nbytes, "copy_h2d")
        self._copy_h2d(dst, data)

    def copy_d2h(self, dst: np.ndarray, src: Buffer) -> None:
        """Synchronous device-to-host copy of ``dst.nbytes`` bytes from ``src``."""
        if not dst.flags.writeable:
            raise ValueError("copy_d2h: destination array is read-only")
        data = _host_bytes(dst, "copy_d2h")
        self._fits(self._own(src, "copy_d2h src"), data.nbytes, "copy_d2h")
        self._copy_d2h(data, src)

    def copy_h2d_async(self, dst: Buffer, src: HostBuffer | np.ndarray, stream: Stream) -> None:
        """Enqueue a host-to-device copy; ``src`` must stay alive until the stream passes it."""
        data = _host_bytes(src, "copy_h2d_async")
        self._fits(self._own(dst, "copy_h2d_async dst"), data.nbytes, "copy_h2d_async")
        self._copy_h2d_async(dst, data, stream)

    def copy_d2d(self, dst: Buffer, src: Buffer, nbytes: int, stream: Stream) -> None:
        n = _size(nbytes, "copy_d2d")
        self._fits(self._own(dst, "copy_d2d dst"), n, "copy_d2d dst")
        self._fits(self._own(src, "copy_d2d src"), n, "copy_d2d src")
        self._copy_d2d(dst, src, n, stream)

    # ---- optional memory paths (their mixins replace the hooks)
    def host_view(self, buf: Buffer) -> np.ndarray:
        """A uint8 numpy view of device memory; raises unless it is host-addressable."""
        if not self.capabilities.device_memory_is_host_addressable:
            raise HostAccessError(
                f"backend {self.name!r}: device memory is not host-addressable; "
                "copy it to the host with copy_d2h or copy_d2h_async"
            )
        return self._host_view(self._own(buf, "host_view"))

    def alloc_pinned(self, nbytes: int) -> HostBuffer:
        """Page-locked host memory where the backend has it (``PinnedHostMemory``);
        ordinary memory (``pinned=False``) otherwise."""
        return self._alloc_pinned(_size(nbytes, "alloc_pinned"))

    def free_pinned(self, buf: HostBuffer) -> None:
        self._free_pinned(buf)

    def copy_d2h_async(self, dst: HostBuffer, src: Buffer, stream: Stream) -> None:
        """Enqueue a copy of ``dst.nbytes`` bytes from ``src`` into (pinned) host memory."""
        if not isinstance(dst, HostBuffer):
            raise TypeError(
                "copy_d2h_async: dst must be a vt.HostBuffer from alloc_pinned, "
                f"got {type(dst).__name__}"
            )
        data = _host_bytes(dst, "copy_d2h_async")
        self._fits(self._own(src, "copy_d2h_async src"), data.nbytes, "copy_d2h_async")
        self._copy_d2h_async(dst, src, stream)

    # ---- streams
    def create_stream(self, name: str = "") -> Stream:
        return self._create_stream(str(name))

    def destroy_stream(self, stream: Stream) -> None:
        self._destroy_stream(stream)

    def synchronize(self, stream: Stream) -> None:
        """Block the host until all work enqueued on ``stream`` has finished."""
        self._synchronize(stream)

    def enqueue_host(self, stream: Stream, name: str, fn: Callable[[], Any]) -> None:
        """Run the host callable ``fn`` in order with ``stream``'s work (host ops use it).

        The base synchronizes the stream and runs ``fn`` at once: correct on any backend,
        but it blocks the host; a backend with host-side streams overrides it to enqueue.
        """
        self._synchronize(stream)
        fn()

    # ---- events: without the ``Events`` mixin they are null, and an event "completes" at
    # once; the runner never relies on that (it reads ``capabilities.events``).
    def create_event(self) -> Event:
        return self._create_event()

    def destroy_event(self, event: Event) -> None:
        self._destroy_event(event)

    def record_event(self, event: Event, stream: Stream) -> None:
        self._record_event(event, stream)

    def query_event(self, event: Event) -> bool:
        return self._query_event(event)

    def synchronize_event(self, event: Event) -> None:
        self._synchronize_event(event)

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        self._stream_wait_event(stream, event)

    # ---- graphs (``Graphs`` mixin)
    def begin_capture(self, stream: Stream) -> None:
        """Record the work enqueued on ``stream`` from now on instead of running it.

        Until :meth:`end_capture`, ops, ``*_async`` copies, ``copy_d2d`` and stream memsets
        on ``stream`` are recorded with their arguments, not executed. The host must not
        synchronize ``stream`` or record events on it meanwhile.
        """
        self._begin_capture(stream)

    def end_capture(self, stream: Stream) -> Graph:
        return self._end_capture(stream)

    def launch_graph(self, graph: Graph, stream: Stream) -> None:
        """Enqueue one replay; it computes on the buffers' contents when it runs."""
        self._launch_graph(graph, stream)

    def destroy_graph(self, graph: Graph) -> None:
        self._destroy_graph(graph)

    # ---- virtual memory (``VirtualMemory`` mixin)
    def vmm_granularity(self) -> int:
        return self._vmm_granularity()

    def vmm_reserve(self, nbytes: int) -> VirtualRange:
        return self._vmm_reserve(_size(nbytes, "vmm_reserve"))

    def vmm_map(self, vrange: VirtualRange, offset: int, nbytes: int) -> Segment:
        """Create ``nbytes`` of physical memory and map it at ``offset`` in ``vrange``."""
        return self._vmm_map(vrange, _size(offset, "vmm_map offset"), _size(nbytes, "vmm_map"))

    def vmm_unmap(self, vrange: VirtualRange, segment: Segment) -> None:
        self._vmm_unmap(vrange, segment)

    def vmm_release(self, vrange: VirtualRange) -> None:
        self._vmm_release(vrange)

    def vmm_buffer(self, vrange: VirtualRange) -> Buffer:
        """A buffer over the whole reservation; only mapped bytes may be touched."""
        buf = self._vmm_buffer(vrange)
        buf.owner = buf.owner or self.name
        return buf

    # ------------------------------------------------------------------ weights
    def upload_weight(self, tensor: WeightTensor) -> Weight:
        """The file tensor in the backend's own format (once, at load)."""
        if not isinstance(tensor, WeightTensor):
            raise TypeError(f"upload_weight: expected a vt.WeightTensor, got {type(tensor)}")
        weight = self._upload_weight(tensor)
        if not isinstance(weight, Weight) or tuple(weight.shape) != tuple(tensor.shape):
            raise TypeError(
                f"backend {self.name!r}: upload_weight of {tensor.name!r} returned "
                f"{weight!r}, not a vt.Weight of shape {tuple(tensor.shape)}"
            )
        weight.owner = self.name
        return weight

    def free_weight(self, weight: Weight) -> None:
        """Let go of the weight's memory (idempotent); the Weight may outlive the call."""
        self._own_weight(weight, "free_weight")
        if weight.handle is not None:
            self._free_weight(weight)
            weight.handle = None

    # ------------------------------------------------------------------ ops
    @classmethod
    def op_names(cls) -> tuple[str, ...]:
        """The ops this class implements natively, in table order."""
        return tuple(name for name in OPS if callable(getattr(cls, f"op_{name}", None)))

    def supports(self, op: str, dtype: str | None = None) -> bool:
        """Does this backend run ``op`` natively (for weight type ``dtype`` when given)?

        The default: the class has ``op_<name>``. Override to narrow by device or dtype.
        """
        get_op(op)
        return callable(getattr(self, f"op_{op}", None))

    def launch(self, op: str, stream: Stream, **args: Any) -> None:
        """Enqueue ``op`` on ``stream`` after checking ``args`` against its signature.

        A fused op the backend lacks runs as its decomposition; a primitive op it lacks
        raises :class:`vt.KernelNotImplementedError`.
        """
        spec = get_op(op)
        spec.bind(args)
        name = self.name
        for value in args.values():  # ~400 launches per decode step: format only on error
            if isinstance(value, Tensor):
                buf = value.buffer
                if not isinstance(buf, Buffer) or (buf.owner and buf.owner != name):
                    self._own(buf, f"op {op}")
            elif isinstance(value, Weight) and value.owner and value.owner != name:
                self._own_weight(value, f"op {op}")
        self._dispatch(op, stream, args)

    def _dispatch(self, op: str, stream: Stream, args: dict[str, Any]) -> None:
        """Run checked ``args``: natively, or as the decomposition of a fused op.

        The parts of a decomposition are not checked again: their arguments are the fused
        op's, already bound, so the check would only cost host time per step.
        """
        dtype = None  # the weight type, for a backend whose support differs per type
        for value in args.values():
            if isinstance(value, Weight):
                dtype = _type_name(value.ggml_type)
                break
        if self.supports(op, dtype):
            getattr(self, f"op_{op}")(stream, **args)
            return
        spec = OPS[op]
        if spec.decompose is None:
            raise _missing(self, f"op {op!r}" + (f" for {dtype} weights" if dtype else ""))
        spec.decompose(self._dispatch_part, stream, args)

    def _dispatch_part(self, op: str, stream: Stream, **args: Any) -> None:
        self._dispatch(op, stream, args)

    # ------------------------------------------------------------------ hooks (required)
    def _alloc(self, nbytes: int) -> Buffer:
        raise _missing(self, "alloc")

    def _free(self, buf: Buffer) -> None:
        raise _missing(self, "free")

    def _memset(self, buf: Buffer, value: int, stream: Stream | None) -> None:
        raise _missing(self, "memset")

    def _copy_h2d(self, dst: Buffer, src: np.ndarray) -> None:
        raise _missing(self, "copy_h2d")

    def _copy_d2h(self, dst: np.ndarray, src: Buffer) -> None:
        raise _missing(self, "copy_d2h")

    def _copy_h2d_async(self, dst: Buffer, src: np.ndarray, stream: Stream) -> None:
        raise _missing(self, "copy_h2d_async")

    def _copy_d2d(self, dst: Buffer, src: Buffer, nbytes: int, stream: Stream) -> None:
        raise _missing(self, "copy_d2d")

    def _create_stream(self, name: str) -> Stream:
        raise _missing(self, "create_stream")

    def _destroy_stream(self, stream: Stream) -> None:
        raise _missing(self, "destroy_stream")

    def _synchronize(self, stream: Stream) -> None:
        raise _missing(self, "synchronize")

    def _upload_weight(self, tensor: WeightTensor) -> Weight:
        raise _missing(self, "upload_weight")

    def _free_weight(self, weight: Weight) -> None:  # noqa: B027 - nothing to release
        pass

    # ------------------------------------------------------------------ hooks (mixins)
    def _host_view(self, buf: Buffer) -> np.ndarray:
        raise HostAccessError(f"backend {self.name!r} does not implement host_view")

    def _alloc_pinned(self, nbytes: int) -> HostBuffer:
        return HostBuffer(np.zeros(nbytes, dtype=np.uint8), pinned=False)

    def _free_pinned(self, buf: HostBuffer) -> None:  # noqa: B027 - ordinary memory is GC'd
        pass

    def _copy_d2h_async(self, dst: HostBuffer, src: Buffer, stream: Stream) -> None:
        raise CapabilityError(
            f"backend {self.name!r} has no async device-to-host copy (vt.AsyncD2HCopy)"
        )

    def _create_event(self) -> Event:
        return Event(None)

    def _destroy_event(self, event: Event) -> None:  # noqa: B027
        pass

    def _record_event(self, event: Event, stream: Stream) -> None:  # noqa: B027
        pass

    def _query_event(self, event: Event) -> bool:
        return True

    def _synchronize_event(self, event: Event) -> None:  # noqa: B027
        pass

    def _stream_wait_event(self, stream: Stream, event: Event) -> None:  # noqa: B027
        pass

    def _no(self, mixin: str) -> CapabilityError:
        return CapabilityError(f"backend {self.name!r} does not implement vt.{mixin}")

    def _begin_capture(self, stream: Stream) -> None:
        raise self._no("Graphs")

    def _end_capture(self, stream: Stream) -> Graph:
        raise self._no("Graphs")

    def _launch_graph(self, graph: Graph, stream: Stream) -> None:
        raise self._no("Graphs")

    def _destroy_graph(self, graph: Graph) -> None:
        raise self._no("Graphs")

    def _vmm_granularity(self) -> int:
        raise self._no("VirtualMemory")

    def _vmm_reserve(self, nbytes: int) -> VirtualRange:
        raise self._no("VirtualMemory")

    def _vmm_map(self, vrange: VirtualRange, offset: int, nbytes: int) -> Segment:
        raise self._no("VirtualMemory")

    def _vmm_unmap(self, vrange: VirtualRange, segment: Segment) -> None:
        raise self._no("VirtualMemory")

    def _vmm_release(self, vrange: VirtualRange) -> None:
        raise self._no("VirtualMemory")

    def _vmm_buffer(self, vrange: VirtualRange) -> Buffer:
        raise self._no("VirtualMemory")

    # ------------------------------------------------------------------ introspection
    @classmethod
    def overrides(cls, method: str) -> bool:
        """Whether this class overrides ``method`` of the base protocol."""
        return getattr(cls, method, None) is not getattr(Backend, method, None)


@dataclass
class Probe:
    """What a backend's probe found: availability, why not, and its declaration.

    ``capabilities`` declares physical facts (``unified_memory``,
    ``device_memory_is_host_addressable``, ``host_memory_is_device_addressable``, ``vmm``
    granularity and aliasing); a capability that needs code is derived from the mixins the
    class implements, and set here only to turn it off where the device lacks it.
    """

    available: bool
    reason: str = ""
    capabilities: Capabilities | None = None
    device: str = ""
    details: dict[str, Any] = field(default_factory=dict)
