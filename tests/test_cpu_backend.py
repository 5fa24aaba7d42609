"""The CPU backend: real asynchronous streams and events, kernels, pinned memory, real VMM."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np
import psutil
import pytest
import vt
from vt import reference as ref
from vt_cpu import CpuBackend, StreamError, cpu_capabilities, granularity_from_env
from vt_cpu.plugin import vt_register_backends

MiB = 1 << 20
F32, I32 = np.dtype(np.float32), np.dtype(np.int32)


@pytest.fixture
def cpu() -> Iterator[CpuBackend]:
    backend = CpuBackend()
    yield backend
    backend.close()


@pytest.fixture
def stream(cpu: CpuBackend) -> Iterator[vt.Stream]:
    s = cpu.create_stream("test")
    yield s
    cpu.destroy_stream(s)


def f32(cpu: CpuBackend, a: np.ndarray) -> vt.Buffer:
    buf = cpu.alloc(a.nbytes)
    cpu.copy_h2d(buf, np.ascontiguousarray(a, dtype=a.dtype))
    return buf


def read(cpu: CpuBackend, buf: vt.Buffer, dtype=np.float32) -> np.ndarray:
    return cpu.host_view(buf).view(dtype).copy()


def t(buf: vt.Buffer, *shape: int, dtype=F32) -> vt.Tensor:
    """A typed tensor over ``buf`` (raises if it does not fit)."""
    return vt.Tensor.of(buf, dtype, *shape)


class Gate:
    """Blocks a stream (via enqueue_host) until the test opens it."""

    def __init__(self) -> None:
        self.open_ = threading.Event()
        self.entered = threading.Event()

    def __call__(self) -> None:
        self.entered.set()
        assert self.open_.wait(10), "gate never opened"

    def open(self) -> None:
        self.open_.set()


# --------------------------------------------------------------------------- declaration


def test_plugin_registers_the_cpu_backend_with_its_declaration() -> None:
    seen: list[type] = []
    vt_register_backends(seen.append)
    assert seen == [CpuBackend]
    assert CpuBackend.name == "cpu" and CpuBackend.priority == 10
    assert not CpuBackend.emulated
    # The probe declares physical facts only ...
    declared = CpuBackend.probe().capabilities
    assert declared is not None and declared == cpu_capabilities()
    assert declared.unified_memory and declared.device_memory_is_host_addressable
    assert declared.host_memory_is_device_addressable
    assert declared.vmm == vt.VmmCaps(granularity=2 * MiB, segments_may_alias=False)
    # ... and what needs code is derived from the mixins the class implements.
    backend = CpuBackend()
    caps = backend.capabilities
    assert caps.events and caps.pinned_host_memory and caps.async_d2h_copy and caps.graphs
    assert caps.supports_async_sampled_token_readback
    for field in ("events", "pinned_host_memory", "async_d2h_copy", "graphs"):
        assert caps.source_of(field).source is vt.Source.derived
    assert caps.vmm == declared.vmm
    # every op of the table runs natively (the reference), fused ones included, but
    # the GPU's fusions of a projection with the norm after it, which run as their
    # decompositions, attention_bounded (it declares no context classes) and the prefetch
    # hint (nothing to bring nearer: the graph launches none here)
    decomposed = ("matmul_add_rms_norm", "matmul_add_rms_norm_swiglu",
                  "matmul_add_rms_norm_qkv_rope_kv_store", "attention_bounded",
                  "prefetch")  # fmt: skip
    assert CpuBackend.op_names() == tuple(op for op in vt.OPS if op not in decomposed)
    assert all(backend.supports(op) is (op not in decomposed) for op in vt.OPS)
    backend.close()


def test_vmm_granularity_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VT_CPU_VMM_GRANULARITY", "65536")
    assert granularity_from_env() == 65536
    assert CpuBackend.probe().capabilities.vmm.granularity == 65536
    backend = CpuBackend()
    assert backend.vmm_granularity() == 65536
    assert backend.capabilities.vmm == cpu_capabilities(65536).vmm
    backend.close()
    monkeypatch.setenv("VT_CPU_VMM_GRANULARITY", "4096")
    assert CpuBackend().vmm_granularity() == 4096
    monkeypatch.setenv("VT_CPU_VMM_GRANULARITY", "3000")
    with pytest.raises(vt.VmmError, match="VT_CPU_VMM_GRANULARITY=3000.*power of two"):
        CpuBackend()
    with pytest.raises(vt.VmmError, match="VT_CPU_VMM_GRANULARITY=3000.*power of two"):
        CpuBackend.probe()
    monkeypatch.setenv("VT_CPU_VMM_GRANULARITY", "lots")
    with pytest.raises(vt.VmmError, match="'lots' is not a number of bytes"):
        granularity_from_env()
    monkeypatch.setenv("VT_CPU_VMM_GRANULARITY", "2048")
    with pytest.raises(vt.VmmError, match="granularity 2048 must be .* page size"):
        CpuBackend()


# --------------------------------------------------------------------------- memory


def test_copies_memset_and_host_view_honour_offsets(cpu: CpuBackend, stream: vt.Stream) -> None:
    buf = cpu.alloc(256)
    data = np.arange(256, dtype=np.uint8)
    cpu.copy_h2d(buf, data)
    part = buf.view(64, 32)
    cpu.memset(part, 7)
    assert np.all(cpu.host_view(part) == 7)
    cpu.copy_h2d(buf.view(200, 4), np.array([1, 2, 3, 4], np.uint8))
    got = np.empty(8, np.uint8)
    cpu.copy_d2h(got, buf.view(198, 8))
    assert got.tolist() == [198, 199, 1, 2, 3, 4, 204, 205]
    other = cpu.alloc(16)
    cpu.copy_d2d(other, buf.view(8, 16), 16, stream)
    cpu.memset(buf.view(0, 8), 9, stream)
    cpu.synchronize(stream)
    assert read(cpu, other, np.uint8).tolist() == list(range(8, 24))
    assert np.all(cpu.host_view(buf)[:8] == 9)


def test_bad_sizes_raise_at_the_call_site(cpu: CpuBackend, stream: vt.Stream) -> None:
    """The core checks sizes once, for every backend (see test_backend_core.py)."""
    small = cpu.alloc(8)
    with pytest.raises(ValueError, match="copy_h2d: 16 bytes do not fit the buffer of 8"):
        cpu.copy_h2d(small, np.zeros(16, np.uint8))
    w = cpu.upload_weight(vt.WeightTensor("w", 0, (3, 2), np.zeros((3, 2), np.float32)))
    with pytest.raises(
        ValueError, match=r"op matmul: out of shape \(4, 3\) needs 48 bytes, its buffer has 8"
    ):
        cpu.launch(
            "matmul", stream, out=vt.Tensor(small, F32, (4, 3)), x=t(cpu.alloc(64), 4, 2), weight=w
        )
    with pytest.raises(ValueError, match="memset: value 300 is not a byte"):
        cpu.memset(small, 300)
    with pytest.raises(ValueError, match="not a cpu stream"):
        cpu.memset(small, 0, vt.Stream(object(), "alien"))


def test_free_weight_lets_go_of_the_weight_memory(cpu: CpuBackend, stream: vt.Stream) -> None:
    """The Weight object may outlive free_weight (a closed runner keeps its graph); the
    dequantized array must not."""
    w = cpu.upload_weight(vt.WeightTensor("w", 0, (4, 2), np.ones((4, 2), np.float32)))
    memory = weakref.ref(w.handle)
    cpu.free_weight(w)
    cpu.free_weight(w)  # idempotent
    gc.collect()
    assert memory() is None
    with pytest.raises(ValueError, match="op matmul: weight 'w' was freed"):
        cpu.launch("matmul", stream, out=t(cpu.alloc(32), 2, 4), x=t(cpu.alloc(64), 2, 2), weight=w)


def test_pinned_memory_is_a_dedicated_mapping(cpu: CpuBackend, stream: vt.Stream) -> None:
    hb = cpu.alloc_pinned(10_000)
    assert hb.pinned and hb.nbytes == 10_000 and hb.array.dtype == np.uint8
    assert hb.array.flags.writeable
    src = f32(cpu, np.arange(2500, dtype=np.float32))
    done = cpu.create_event()
    cpu.copy_d2h_async(hb, src, stream)
    cpu.record_event(done, stream)
    cpu.synchronize_event(done)
    assert np.array_equal(hb.array.view(np.float32), np.arange(2500, dtype=np.float32))
    cpu.free_pinned(hb)
    assert not hb.handle.locked


# --------------------------------------------------------------------------- streams


def test_stream_work_runs_while_the_host_continues(cpu: CpuBackend, stream: vt.Stream) -> None:
    a = f32(cpu, np.ones(1024, np.float32))
    out = f32(cpu, np.zeros(1024, np.float32))
    gate, done = Gate(), cpu.create_event()
    cpu.enqueue_host(stream, "gate", gate)
    start = time.perf_counter()
    cpu.launch("add", stream, out=t(out, 1, 1024), a=t(a, 1, 1024), b=t(a, 1, 1024))
    cpu.record_event(done, stream)
    assert time.perf_counter() - start < 1.0  # enqueueing does not wait for the stream
    assert gate.entered.wait(5)  # the worker thread is running, blocked in the gate
    assert not cpu.query_event(done)
    assert np.all(read(cpu, out) == 0)  # host_view reads without waiting: not yet computed
    gate.open()
    cpu.synchronize_event(done)
    assert cpu.query_event(done)
    assert np.all(read(cpu, out) == 2)


def test_streams_are_independent_until_one_waits_on_an_event(cpu: CpuBackend) -> None:
    first, second = cpu.create_stream("first"), cpu.create_stream("second")
    cell = cpu.alloc(4)
    gate, event = Gate(), cpu.create_event()
    cpu.enqueue_host(first, "gate", gate)
    cpu.memset(cell, 0x11, first)
    cpu.record_event(event, first)
    # Work on another stream does not wait for the blocked one ...
    other = cpu.alloc(4)
    cpu.memset(other, 0x33, second)
    cpu.synchronize(second)
    assert np.all(cpu.host_view(other) == 0x33) and not cpu.query_event(event)
    # ... unless it waits on an event recorded there.
    cpu.stream_wait_event(second, event)
    cpu.memset(cell, 0x22, second)
    marker = cpu.create_event()
    cpu.record_event(marker, second)
    time.sleep(0.05)
    assert not cpu.query_event(marker)
    gate.open()
    cpu.synchronize(second)
    assert cpu.query_event(event)
    assert np.all(cpu.host_view(cell) == 0x22)  # 0x11 ran first, then 0x22
    cpu.destroy_stream(first)
    cpu.destroy_stream(second)


def test_event_semantics(cpu: CpuBackend, stream: vt.Stream) -> None:
    fresh = cpu.create_event()
    assert cpu.query_event(fresh)  # never recorded: complete, as on a device
    cpu.synchronize_event(fresh)
    cpu.stream_wait_event(stream, fresh)  # waiting on it is a no-op
    cpu.synchronize(stream)
    gate = Gate()
    cpu.record_event(fresh, stream)
    cpu.synchronize_event(fresh)
    cpu.enqueue_host(stream, "gate", gate)
    cpu.record_event(fresh, stream)  # re-recording refers to the new position
    assert not cpu.query_event(fresh)
    gate.open()
    cpu.synchronize_event(fresh)
    assert cpu.query_event(fresh)
    cpu.destroy_event(fresh)


def test_a_failed_op_is_raised_by_synchronize_and_names_the_op(
    cpu: CpuBackend, stream: vt.Stream
) -> None:
    table = cpu.upload_weight(vt.WeightTensor("emb", 0, (4, 2), np.ones((4, 2), np.float32)))
    ids = f32(cpu, np.array([9], np.int32))  # out of range: only the kernel can tell
    out, cell = cpu.alloc(8), cpu.alloc(4)
    after = cpu.create_event()
    # enqueued fine: the ids live on the device
    cpu.launch("embedding", stream, out=t(out, 1, 2), ids=t(ids, 1, dtype=I32), table=table)
    cpu.memset(cell, 0x44, stream)  # skipped: the stream has failed
    cpu.record_event(after, stream)
    with pytest.raises(StreamError, match=r"'test': embedding failed: ValueError: .*token id 9"):
        cpu.synchronize_event(after)
    with pytest.raises(StreamError, match="embedding failed") as info:
        cpu.synchronize(stream)
    assert isinstance(info.value.__cause__, ValueError)
    assert np.all(cpu.host_view(cell) == 0)
    cpu.memset(cell, 0x55, stream)  # the error was reported: the stream runs again
    cpu.synchronize(stream)
    assert np.all(cpu.host_view(cell) == 0x55)


def test_a_stream_waiting_on_a_failed_stream_fails_too(cpu: CpuBackend) -> None:
    bad, good = cpu.create_stream("bad"), cpu.create_stream("good")
    event = cpu.create_event()

    def boom() -> None:
        raise RuntimeError("device fault")

    cpu.enqueue_host(bad, "boom", boom)
    cpu.record_event(event, bad)
    cpu.stream_wait_event(good, event)
    with pytest.raises(StreamError, match=r"'good': stream_wait_event failed.*'bad'.*device fault"):
        cpu.synchronize(good)
    with pytest.raises(StreamError, match="'bad': boom failed: RuntimeError: device fault"):
        cpu.destroy_stream(bad)
    cpu.destroy_stream(good)


def test_close_stops_the_worker_threads() -> None:
    backend = CpuBackend()
    streams = [backend.create_stream(f"s{i}") for i in range(3)]
    threads = [s.handle._thread for s in streams]
    assert all(t.is_alive() for t in threads)
    backend.close()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(StreamError, match="destroyed"):
        backend.memset(backend.alloc(4), 0, streams[0])


def test_a_forgotten_backend_stops_its_threads_when_collected() -> None:
    backend = CpuBackend()
    thread = backend.create_stream("orphan").handle._thread
    del backend
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


# --------------------------------------------------------------------------- kernels


def test_kernels_equal_the_reference_through_buffer_views(
    cpu: CpuBackend, stream: vt.Stream
) -> None:
    rng = np.random.default_rng(0)
    arena = cpu.alloc(1 << 16)  # every operand lives at an offset within one allocation
    off = [0]

    def put(a: np.ndarray) -> vt.Buffer:
        view = arena.view(off[0] + 12, a.nbytes)
        off[0] += a.nbytes + 12
        cpu.copy_h2d(view, np.ascontiguousarray(a))
        return view

    x = rng.standard_normal((3, 16)).astype(np.float32)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    wt = cpu.upload_weight(vt.WeightTensor("w", 0, (8, 16), w))
    nw = cpu.upload_weight(vt.WeightTensor("n", 0, (16,), np.full(16, 0.5, np.float32)))
    xb, out = put(x), put(np.zeros((3, 8), np.float32))
    cpu.launch("matmul", stream, out=t(out, 3, 8), x=t(xb, 3, 16), weight=wt)
    normed = put(np.zeros((3, 16), np.float32))
    cpu.launch("rms_norm", stream, out=t(normed, 3, 16), x=t(xb, 3, 16), weight=nw, eps=1e-5)
    pos = put(np.array([0, 1, 7], np.int32))
    roped = put(x.copy())
    params = vt.RopeParams(head_dim=8, base=100.0)
    cpu.launch(
        "rope", stream, x=t(roped, 3, 16), positions=t(pos, 3, dtype=I32), n_heads=2, params=params
    )
    logits = rng.standard_normal((2, 50)).astype(np.float32)
    sp = np.zeros(2, vt.SAMPLE_PARAMS_DTYPE)
    sp["temperature"], sp["top_p"], sp["seed"] = [0.0, 0.9], 1.0, 3
    ids = put(np.zeros(2, np.int32))
    cpu.launch(
        "sample",
        stream,
        out=t(ids, 2, dtype=I32),
        logits=t(put(logits), 2, 50),
        params=t(put(sp), 2, dtype=vt.SAMPLE_PARAMS_DTYPE),
    )
    cpu.synchronize(stream)
    assert np.allclose(read(cpu, out).reshape(3, 8), ref.matmul(x, w), atol=1e-5)
    assert np.allclose(read(cpu, normed).reshape(3, 16), ref.rms_norm(x, nw.handle, 1e-5))
    assert np.allclose(read(cpu, roped).reshape(3, 16), ref.rope(x, [0, 1, 7], 2, params))
    assert np.array_equal(read(cpu, ids, np.int32), ref.sample(logits, sp))


def test_kv_store_and_attention_on_the_device_cache(cpu: CpuBackend, stream: vt.Stream) -> None:
    rng = np.random.default_rng(1)
    layout = vt.KVLayout(n_layers=2, n_slots=2, max_len=8, n_kv_heads=2, head_dim=4)
    cache = cpu.alloc(layout.nbytes)
    n, n_heads = 5, 4
    k, v = (rng.standard_normal((n, 8)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((n, n_heads * 4)).astype(np.float32)
    slots, pos = np.array([1, 1, 0, 1, 0], np.int32), np.array([0, 1, 0, 2, 1], np.int32)
    sb, pb = t(f32(cpu, slots), n, dtype=I32), t(f32(cpu, pos), n, dtype=I32)
    kv = t(cache, *layout.shape)
    cpu.launch(
        "kv_store",
        stream,
        cache=kv,
        k=t(f32(cpu, k), n, 8),
        v=t(f32(cpu, v), n, 8),
        slots=sb,
        positions=pb,
        layout=layout,
        layer=1,
    )
    out = cpu.alloc(q.nbytes)
    cpu.launch(
        "attention",
        stream,
        out=t(out, n, 16),
        q=t(f32(cpu, q), n, 16),
        cache=kv,
        slots=sb,
        positions=pb,
        layout=layout,
        layer=1,
        n_heads=n_heads,
        scale=0.5,
    )
    cpu.synchronize(stream)
    want_cache = np.zeros(layout.shape, np.float32)
    ref.kv_store(want_cache, 1, k, v, slots, pos)
    assert np.array_equal(read(cpu, cache).reshape(layout.shape), want_cache)
    want = ref.attention(q, want_cache, layout, 1, slots, pos, n_heads, 0.5)
    assert np.allclose(read(cpu, out).reshape(n, -1), want)


# --------------------------------------------------------------------------- vmm


def rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("granularity", [4096, 64 << 10, 2 * MiB])
def test_vmm_reserve_map_write_unmap_release(
    granularity: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VT_CPU_VMM_GRANULARITY", str(granularity))
    cpu = CpuBackend()
    g = cpu.vmm_granularity()
    vr = cpu.vmm_reserve(8 * g)
    buf = cpu.vmm_buffer(vr)
    assert buf.nbytes == 8 * g and cpu.vmm_mapped_bytes(vr) == 0
    a = cpu.vmm_map(vr, 0, 2 * g)
    b = cpu.vmm_map(vr, 5 * g, g)
    assert cpu.vmm_mapped_bytes(vr) == 3 * g
    cpu.copy_h2d(buf.view(g, 4), np.array([1, 2, 3, 4], np.uint8))
    cpu.host_view(buf.view(5 * g, g))[:] = 7
    assert cpu.host_view(buf.view(g, 4)).tolist() == [1, 2, 3, 4]
    assert np.all(cpu.host_view(buf.view(5 * g, g)) == 7)
    # Unmapping returns the physical memory: a fresh map at the same place reads zeros.
    cpu.vmm_unmap(vr, b)
    b = cpu.vmm_map(vr, 5 * g, g)
    assert np.all(cpu.host_view(buf.view(5 * g, g)) == 0)
    assert cpu.host_view(buf.view(g, 4)).tolist() == [1, 2, 3, 4]  # other segment intact
    cpu.vmm_unmap(vr, a)
    cpu.vmm_unmap(vr, b)
    cpu.vmm_release(vr)
    cpu.close()


def test_vmm_commits_memory_only_for_what_is_mapped() -> None:
    cpu = CpuBackend()  # the default granularity, 2 MiB
    assert cpu.vmm_granularity() == 2 * MiB
    before = rss()
    vr = cpu.vmm_reserve(4096 * MiB)  # 4 GiB of address space, nothing committed
    buf = cpu.vmm_buffer(vr)
    assert rss() - before < 16 * MiB
    seg = cpu.vmm_map(vr, 1024 * MiB, 64 * MiB)
    cpu.memset(buf.view(1024 * MiB, 64 * MiB), 1)  # touch every page of the segment
    grown = rss() - before
    assert 60 * MiB <= grown < 100 * MiB, f"rss grew {grown / MiB:.1f} MiB for a 64 MiB map"
    cpu.vmm_unmap(vr, seg)
    assert rss() - before < 16 * MiB
    cpu.vmm_release(vr)
    cpu.close()


def test_vmm_rejects_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    g = 64 << 10
    monkeypatch.setenv("VT_CPU_VMM_GRANULARITY", str(g))
    cpu = CpuBackend()
    with pytest.raises(
        vt.VmmError,
        match=f"vmm_reserve: size 1000 is not a positive multiple of the granularity {g}",
    ):
        cpu.vmm_reserve(1000)
    with pytest.raises(vt.VmmError, match="size 0 is not a positive multiple"):
        cpu.vmm_reserve(0)
    vr = cpu.vmm_reserve(4 * g)
    with pytest.raises(vt.VmmError, match="vmm_map: offset 4096 is not a non-negative multiple"):
        cpu.vmm_map(vr, 4096, g)
    with pytest.raises(vt.VmmError, match=f"vmm_map: size {g + 1} is not a positive multiple"):
        cpu.vmm_map(vr, 0, g + 1)
    with pytest.raises(
        vt.VmmError, match=rf"\[{3 * g}, {5 * g}\) runs past the reservation of {4 * g}"
    ):
        cpu.vmm_map(vr, 3 * g, 2 * g)
    seg = cpu.vmm_map(vr, g, 2 * g)
    with pytest.raises(vt.VmmError, match=rf"overlaps the mapped segment \[{g}, {3 * g}\)"):
        cpu.vmm_map(vr, 2 * g, 2 * g)
    with pytest.raises(vt.VmmError, match="1 segment\\(s\\) are still mapped; unmap them first"):
        cpu.vmm_release(vr)
    with pytest.raises(vt.VmmError, match=rf"no segment \[0, {g}\) is mapped"):
        cpu.vmm_unmap(vr, vt.Segment(-1, 0, g))
    cpu.vmm_unmap(vr, seg)
    with pytest.raises(vt.VmmError, match="no segment"):
        cpu.vmm_unmap(vr, seg)  # twice
    cpu.vmm_release(vr)
    with pytest.raises(vt.VmmError, match="was already released"):
        cpu.vmm_release(vr)
    with pytest.raises(vt.VmmError, match="vmm_map: the reservation .* already released"):
        cpu.vmm_map(vr, 0, g)
    with pytest.raises(vt.VmmError, match="not a cpu virtual range"):
        cpu.vmm_buffer(vt.VirtualRange(object(), g))
    # sizes that are not byte counts at all are the core's to refuse
    with pytest.raises(ValueError, match="vmm_reserve: size must be a non-negative integer"):
        cpu.vmm_reserve(-g)
    with pytest.raises(ValueError, match="vmm_map offset: size must be a non-negative integer"):
        cpu.vmm_map(cpu.vmm_reserve(g), -g, g)
    cpu.close()


class AliasingCpuBackend(CpuBackend):
    """Every segment after the first reuses the first one's pages (the Windows ROCm bug)."""

    name = "cpu-aliasing"

    def __init__(self) -> None:
        super().__init__()
        self.first_fd: int | None = None

    def _create_physical(self, nbytes: int) -> int:
        if self.first_fd is None:
            self.first_fd = super()._create_physical(nbytes)
            return self.first_fd
        return os.dup(self.first_fd)


def test_physical_segment_creation_is_overridable_to_emulate_aliasing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VT_CPU_VMM_GRANULARITY", "4096")
    cpu = AliasingCpuBackend()
    assert cpu.vmm_granularity() == 4096
    vr = cpu.vmm_reserve(2 * 4096)
    buf = cpu.vmm_buffer(vr)
    segs = [cpu.vmm_map(vr, 0, 4096), cpu.vmm_map(vr, 4096, 4096)]
    cpu.host_view(buf.view(4096, 4096))[:] = 0xBB  # write the second segment ...
    assert np.all(cpu.host_view(buf.view(0, 4096)) == 0xBB)  # ... and the first changes
    for seg in segs:
        cpu.vmm_unmap(vr, seg)
    cpu.vmm_release(vr)
