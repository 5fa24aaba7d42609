"""The ROCm backend: vt's protocol over real HIP calls (hip-python).

Device pointers are kept as plain ints (``Buffer.handle``); hip-python accepts ints wherever
the C API takes a pointer, which makes ``Buffer.offset`` simple pointer arithmetic.
Model kernels are not here yet (a later issue adds one GPU kernel source); until then the
runner refuses this backend because :meth:`Backend.missing_kernels` is not empty.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass, field

import numpy as np
from vt import (
    Backend,
    BackendUnavailableError,
    Buffer,
    Event,
    HostBuffer,
    Probe,
    Segment,
    Stream,
    VirtualRange,
    VmmError,
)

from .adapter import INSTALL_HINT, HipError, HipRuntime
from .caps import DeviceProfile, capabilities_from_device, use_managed_alloc


def import_reason(error: ImportError) -> str:
    """Why the backend is unavailable when hip-python cannot be imported."""
    if isinstance(error, ModuleNotFoundError) and error.name in ("hip", "rocm", "rocm.bindings"):
        return f"hip-python is not installed ({INSTALL_HINT})"
    return f"hip-python failed to import ({error}); reinstall it ({INSTALL_HINT})"


def runtime_reason(error: RuntimeError) -> str:
    """Why the backend is unavailable when the HIP runtime fails (missing library, no device)."""
    if isinstance(error, HipError):
        return str(error)
    # hip-python loads libamdhip64 on the first call and says so in its RuntimeError.
    return f"the HIP runtime could not be loaded: {error}"


def load_runtime(device: int = 0) -> HipRuntime:
    """The HIP runtime, or BackendUnavailableError with the same reason probe() gives."""
    try:
        return HipRuntime.load(device)
    except ImportError as e:
        raise BackendUnavailableError(f"backend 'rocm' is unavailable: {import_reason(e)}") from e


def _host_array(address: int, nbytes: int) -> np.ndarray:
    """A uint8 numpy view of ``nbytes`` at ``address`` (it does not keep the memory alive)."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def _host_ptr(array: np.ndarray, writable: bool = False) -> int:
    if not array.flags.c_contiguous:
        raise ValueError("host array must be C-contiguous (use np.ascontiguousarray)")
    if writable and not array.flags.writeable:
        raise ValueError("destination host array is read-only")
    return int(array.ctypes.data)


def _check_fits(what: str, nbytes: int, capacity: int) -> None:
    if nbytes > capacity:
        raise ValueError(f"{what}: {nbytes} bytes do not fit in a buffer of {capacity} bytes")


@dataclass(eq=False)
class _Reservation:
    """The state behind a VirtualRange: its base address and mapped segments.

    ``segments`` lists every segment not yet fully unmapped; ``unmapped`` those among them
    whose range is unmapped but whose physical memory is not yet released (a release failed),
    so a retry of ``vmm_unmap`` only releases.
    """

    base: int
    segments: list[Segment] = field(default_factory=list)
    unmapped: list[Segment] = field(default_factory=list)
    released: bool = False

    def mapped_prefix(self) -> int:
        """End of the run of segments that starts at offset 0 without gaps."""
        end = 0
        mapped = [s for s in self.segments if s not in self.unmapped]
        for seg in sorted(mapped, key=lambda s: s.offset):
            if seg.offset != end:
                break
            end += seg.nbytes
        return end


class RocmBackend(Backend):
    """AMD GPUs through HIP. Capabilities come from :func:`capabilities_from_device`."""

    name = "rocm"
    priority = 100
    description = "AMD GPU through HIP (hip-python); memory, streams, events and VMM"

    def __init__(self, runtime: HipRuntime | None = None, platform: str | None = None) -> None:
        self._rt = runtime if runtime is not None else load_runtime()
        self._hip = self._rt.hip
        self._rt.call("hipSetDevice", self._rt.device)
        self.profile: DeviceProfile = self._rt.device_profile(platform)
        self._managed = use_managed_alloc(self.profile)
        self.capabilities = capabilities_from_device(self.profile)
        self._granularity: int | None = None

    @classmethod
    def probe(cls) -> Probe:
        try:
            runtime = HipRuntime.load()
        except ImportError as e:
            return Probe(available=False, reason=import_reason(e))
        return cls.probe_runtime(runtime)

    @classmethod
    def probe_runtime(cls, runtime: HipRuntime, platform: str | None = None) -> Probe:
        """Probe through an existing runtime (the seam the tests use)."""
        try:
            if runtime.device_count() < 1:
                return Probe(available=False, reason="no HIP device found")
            profile = runtime.device_profile(platform)
        except RuntimeError as e:
            return Probe(available=False, reason=runtime_reason(e))
        return Probe(
            available=True,
            capabilities=capabilities_from_device(profile),
            device=f"{profile.name} ({profile.gcn_arch_name}, {profile.platform})",
            details=profile.model_dump(),
        )

    # ---- memory
    def _addr(self, buf: Buffer) -> int:
        return int(buf.handle) + buf.offset

    def alloc(self, nbytes: int) -> Buffer:
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes} bytes)")
        if self._managed:
            ptr = self._rt.call("hipMallocManaged", nbytes, self._hip.hipMemAttachGlobal)
        else:
            ptr = self._rt.call("hipMalloc", nbytes)
        return Buffer(int(ptr), nbytes, owner=self.name)

    def free(self, buf: Buffer) -> None:
        if buf.offset:
            raise ValueError("free() takes the buffer alloc() returned, not a view of it")
        self._rt.call("hipFree", int(buf.handle))

    def memset(self, buf: Buffer, value: int, stream: Stream | None = None) -> None:
        if not 0 <= value <= 255:
            raise ValueError(f"memset value must be a byte (0..255), got {value}")
        if stream is None:
            self._rt.call("hipMemset", self._addr(buf), value, buf.nbytes)
        else:
            self._rt.call("hipMemsetAsync", self._addr(buf), value, buf.nbytes, stream.handle)

    def copy_h2d(self, dst: Buffer, src: np.ndarray) -> None:
        src = np.ascontiguousarray(src)
        _check_fits("copy_h2d", src.nbytes, dst.nbytes)
        kind = self._hip.hipMemcpyKind.hipMemcpyHostToDevice
        self._rt.call("hipMemcpy", self._addr(dst), _host_ptr(src), src.nbytes, kind)

    def copy_d2h(self, dst: np.ndarray, src: Buffer) -> None:
        _check_fits("copy_d2h", dst.nbytes, src.nbytes)
        kind = self._hip.hipMemcpyKind.hipMemcpyDeviceToHost
        self._rt.call("hipMemcpy", _host_ptr(dst, writable=True), self._addr(src), dst.nbytes, kind)

    def copy_h2d_async(self, dst: Buffer, src: HostBuffer | np.ndarray, stream: Stream) -> None:
        # No ascontiguousarray here: a temporary copy could die before the stream reads it.
        array = src.array if isinstance(src, HostBuffer) else src
        _check_fits("copy_h2d_async", array.nbytes, dst.nbytes)
        kind = self._hip.hipMemcpyKind.hipMemcpyHostToDevice
        self._rt.call(
            "hipMemcpyAsync", self._addr(dst), _host_ptr(array), array.nbytes, kind, stream.handle
        )

    def copy_d2h_async(self, dst: HostBuffer, src: Buffer, stream: Stream) -> None:
        _check_fits("copy_d2h_async", dst.nbytes, src.nbytes)
        kind = self._hip.hipMemcpyKind.hipMemcpyDeviceToHost
        ptr = _host_ptr(dst.array, writable=True)
        self._rt.call("hipMemcpyAsync", ptr, self._addr(src), dst.nbytes, kind, stream.handle)

    def copy_d2d(self, dst: Buffer, src: Buffer, nbytes: int, stream: Stream) -> None:
        _check_fits("copy_d2d source", nbytes, src.nbytes)
        _check_fits("copy_d2d destination", nbytes, dst.nbytes)
        kind = self._hip.hipMemcpyKind.hipMemcpyDeviceToDevice
        self._rt.call(
            "hipMemcpyAsync", self._addr(dst), self._addr(src), nbytes, kind, stream.handle
        )

    def alloc_pinned(self, nbytes: int) -> HostBuffer:
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes} bytes)")
        ptr = int(self._rt.call("hipHostMalloc", nbytes, self._hip.hipHostMallocDefault))
        return HostBuffer(_host_array(ptr, nbytes), handle=ptr, pinned=True)

    def free_pinned(self, buf: HostBuffer) -> None:
        if buf.pinned and buf.handle is not None:
            self._rt.call("hipHostFree", buf.handle)
            buf.handle = None  # a second free is a no-op, not a double free

    def host_view(self, buf: Buffer) -> np.ndarray:
        # The effective capability decides: an override that turns it off is honoured.
        if not self.capabilities.device_memory_is_host_addressable:
            return super().host_view(buf)
        return _host_array(self._addr(buf), buf.nbytes)

    # ---- streams
    def create_stream(self, name: str = "") -> Stream:
        return Stream(self._rt.call("hipStreamCreate"), name)

    def destroy_stream(self, stream: Stream) -> None:
        self._rt.call("hipStreamDestroy", stream.handle)

    def synchronize(self, stream: Stream) -> None:
        self._rt.call("hipStreamSynchronize", stream.handle)

    # ---- events (timing off: they only order work, which is the cheap kind)
    def create_event(self) -> Event:
        return Event(self._rt.call("hipEventCreateWithFlags", self._hip.hipEventDisableTiming))

    def destroy_event(self, event: Event) -> None:
        self._rt.call("hipEventDestroy", event.handle)

    def record_event(self, event: Event, stream: Stream) -> None:
        self._rt.call("hipEventRecord", event.handle, stream.handle)

    def query_event(self, event: Event) -> bool:
        return self._rt.ready("hipEventQuery", event.handle)

    def synchronize_event(self, event: Event) -> None:
        self._rt.call("hipEventSynchronize", event.handle)

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        self._rt.call("hipStreamWaitEvent", stream.handle, event.handle, 0)

    # ---- virtual memory
    def vmm_granularity(self) -> int:
        if not self.profile.vmm_supported:
            raise VmmError(
                f"{self.profile.gcn_arch_name}: the device does not support virtual memory "
                "(hipDeviceAttributeVirtualMemoryManagementSupported=0)"
            )
        if self._granularity is None:
            minimum = self._hip.hipMemAllocationGranularity_flags
            self._granularity = int(
                self._rt.call(
                    "hipMemGetAllocationGranularity",
                    self._rt.allocation_prop(),
                    minimum.hipMemAllocationGranularityMinimum,
                )
            )
        return self._granularity

    def _check_multiple(self, what: str, nbytes: int, allow_zero: bool = False) -> int:
        g = self.vmm_granularity()
        if nbytes < 0 or nbytes % g or (nbytes == 0 and not allow_zero):
            kind = "a multiple" if allow_zero else "a non-zero multiple"
            raise VmmError(f"{what} of {nbytes} bytes must be {kind} of granularity {g}")
        return g

    def vmm_reserve(self, nbytes: int) -> VirtualRange:
        self._check_multiple("reservation", nbytes)
        base = self._rt.call("hipMemAddressReserve", nbytes, 0, None, 0)
        return VirtualRange(_Reservation(int(base)), nbytes)

    def _reservation(self, vrange: VirtualRange) -> _Reservation:
        res = vrange.handle
        if not isinstance(res, _Reservation):
            raise VmmError("not a reservation of the rocm backend")
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
        handle = self._rt.call("hipMemCreate", nbytes, self._rt.allocation_prop(), 0)
        try:
            self._rt.call("hipMemMap", res.base + offset, nbytes, 0, handle, 0)
        except HipError:
            with contextlib.suppress(HipError):  # the map failure is the error to report
                self._rt.call("hipMemRelease", handle)
            raise
        segment = Segment(handle, offset, nbytes)
        res.segments.append(segment)
        # Access is set over the whole mapped prefix, not just the new segment, as the
        # original engine did on ROCm; a segment past a gap gets access on its own.
        prefix = res.mapped_prefix()
        start, size = (0, prefix) if offset + nbytes <= prefix else (offset, nbytes)
        try:
            self._rt.call("hipMemSetAccess", res.base + start, size, self._rt.access_desc(), 1)
        except HipError:
            with contextlib.suppress(HipError):
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
            self._rt.call("hipMemUnmap", res.base + segment.offset, segment.nbytes)
            res.unmapped.append(segment)
        self._rt.call("hipMemRelease", segment.handle)
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
        self._rt.call("hipMemAddressFree", res.base, vrange.nbytes)
        res.released = True

    def vmm_buffer(self, vrange: VirtualRange) -> Buffer:
        return Buffer(self._reservation(vrange).base, vrange.nbytes, owner=self.name)
