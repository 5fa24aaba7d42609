"""vt.gpu.GpuBackend, once, on one fake GPU runtime (``fake_gpu.FakeRuntime``).

What HIP and CUDA share is tested here: memory and copies over the runtime, pinned memory,
host views by capability, graphs, the VMM bookkeeping (access over the mapped prefix,
retries after failed releases), kernel compilation, and every op's launch against the
kernel's signature in core/vt/gpu/kernels/. The vendor plugins' tests (``plugins/*/tests``) cover
only how their adapters translate runtime calls into HIP or CUDA calls.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import vt
from fake_gpu import DISCRETE, GRANULARITY, UNIFIED, FakeGpu, make, weight_tensor
from gguf import GGMLQuantizationType
from vt.execution.memory import VmmArena
from vt.execution.runner import ModelRunner, SeqChunk
from vt.gpu import MAX_HEAD_DIM, GpuBackend, GpuCallError, GpuWeight, kernel_source
from vt.gpu import weights as W
from vt.gpu.backend import _TILED_ROWS as TILED_ROWS
from vt.gpu.backend import RopeTable, VtPrefetch, _out_of_memory, rope_table
from vt.gpu.modules import (
    KERNEL_PARTS,
    MODULE_GROUPS,
    WEIGHT_GROUPS,
    group_of,
    kernel_names,
)
from vt.management import rules
from vt.management.audit import probe_graphs
from vt.model import load_gguf
from vt.protocol.mixins import derive_capabilities
from vt.testing.tiny import write_tiny_gguf

#: The modules of every layout, in the order a backend starts them.
EVERY = [f"vt_{group}.cu" for group in MODULE_GROUPS]
#: The weights' groups' every-layout modules' parts, joined.
WEIGHT_SOURCE = "".join(kernel_source(MODULE_GROUPS[group]) for group in WEIGHT_GROUPS)


#: the int8 group's own option by default (GpuBackend.mma_stage on)
STAGE = ("-DVT_MMA_STAGE=1",)


def every(
    opts: tuple[str, ...], stage: tuple[str, ...] = STAGE
) -> list[tuple[str, tuple[str, ...]]]:
    """The compiles of every group's module of every layout, with ``opts`` (and ``stage``
    in the int8 group's)."""
    return [(name, (*opts, *stage) if name == "vt_int8.cu" else opts) for name in EVERY]


def own(
    layout: int, opts: tuple[str, ...], stage: tuple[str, ...] = STAGE
) -> list[tuple[str, tuple[str, ...]]]:
    """The compiles of ``layout``'s modules (the weights' groups), with ``opts`` (and
    ``stage`` in the int8 group's)."""
    return [(f"vt_{group}_q{layout:x}.cu",
             (*opts, *(stage if group == "int8" else ()), f"-DVT_Q_FLAGS={layout:#x}"))
            for group in WEIGHT_GROUPS]  # fmt: skip


def lg(wtype: str) -> int:
    """The kernels' ``lg`` argument for a weight of ``wtype``: its block's log2 and layout."""
    return (4 if wtype == "Q6_K" else 5) | W.LAYOUTS[GGMLQuantizationType[wtype]]


F32, I32 = np.dtype(np.float32), np.dtype(np.int32)

# --------------------------------------------------------------------------- what it is


def test_it_implements_every_capability_mixin_and_every_primitive_op() -> None:
    caps = derive_capabilities(FakeGpu, DISCRETE)
    for field in ("events", "pinned_host_memory", "async_d2h_copy", "graphs"):
        assert getattr(caps, field) is True
        assert caps.source_of(field).source is vt.Source.derived
    assert caps.source_of("graphs").detail == "implements vt.Graphs"
    # a discrete device reads the sampled ids back by an async copy into pinned memory
    assert caps.supports_async_sampled_token_readback and not caps.device_memory_is_host_addressable
    assert rules.check(FakeGpu, caps) == []
    assert rules.check(FakeGpu, derive_capabilities(FakeGpu, UNIFIED)) == []
    assert FakeGpu.op_names() == tuple(vt.OPS)  # every op natively, fused ones included


# --------------------------------------------------------------------------- memory


def test_alloc_and_free_go_to_the_runtime() -> None:
    backend, rt = make()
    buf = backend.alloc(1024)
    backend.free(buf)
    assert rt.calls == [("malloc", (1024,)), ("free", (buf.handle,))]
    assert buf.nbytes == 1024 and buf.owner == "fakegpu"


def test_free_refuses_a_view() -> None:
    backend, rt = make()
    buf = backend.alloc(64)
    with pytest.raises(ValueError, match="not a view"):
        backend.free(buf.view(16, 16))
    assert "free" not in rt.names()


def test_copies_move_bytes_and_honour_offsets() -> None:
    backend, rt = make()
    buf = backend.alloc(64)
    backend.memset(buf, 7)
    backend.copy_h2d(buf.view(16, 8), np.arange(8, dtype=np.uint8))
    out = np.empty((8, 8), dtype=np.uint8)
    backend.copy_d2h(out, buf)
    expected = np.full(64, 7, dtype=np.uint8)
    expected[16:24] = np.arange(8)
    np.testing.assert_array_equal(out.reshape(-1), expected)
    ((h2d_dst, _, h2d_n, h2d_stream),) = rt.args("memcpy_h2d")
    ((_, d2h_src, d2h_n, d2h_stream),) = rt.args("memcpy_d2h")
    assert (h2d_dst, h2d_n, h2d_stream) == (buf.handle + 16, 8, None)
    assert (d2h_src, d2h_n, d2h_stream) == (buf.handle, 64, None)
    assert rt.args("memset") == [(buf.handle, 7, 64, None)]


def test_async_copies_and_memset_run_on_the_stream() -> None:
    backend, rt = make()
    stream = backend.create_stream("main")
    a, b = backend.alloc(32), backend.alloc(32)
    pinned = backend.alloc_pinned(32)
    pinned.array[:] = np.arange(32, dtype=np.uint8)
    backend.memset(b, 0, stream)
    backend.copy_h2d_async(a, pinned, stream)
    backend.copy_d2d(b, a, 32, stream)
    out = backend.alloc_pinned(32)
    backend.copy_d2h_async(out, b, stream)
    np.testing.assert_array_equal(out.array, np.arange(32))
    assert rt.args("memset") == [(b.handle, 0, 32, stream.handle)]
    assert rt.args("memcpy_d2d") == [(b.handle, a.handle, 32, stream.handle)]
    assert [args[-1] for args in rt.args("memcpy_h2d") + rt.args("memcpy_d2h")] == [
        stream.handle,
        stream.handle,
    ]
    assert stream.name == "main"


def _read_only(n: int) -> np.ndarray:
    out = np.zeros(n, np.uint8)
    out.flags.writeable = False
    return out


@pytest.mark.parametrize(
    ("op", "message"),
    [
        (lambda be, buf: be.copy_h2d(buf, np.zeros(65, np.uint8)), "65 bytes do not fit"),
        (lambda be, buf: be.copy_d2h(np.zeros(65, np.uint8), buf), "65 bytes do not fit"),
        (lambda be, buf: be.copy_d2h(np.zeros((8, 8), np.uint8)[:, ::2], buf), "C-contiguous"),
        (lambda be, buf: be.copy_d2h(_read_only(8), buf), "read-only"),
        (lambda be, buf: be.memset(buf, 256), "is not a byte"),
        (lambda be, buf: be.alloc(-1), "non-negative integer"),
        (lambda be, buf: be.copy_d2d(buf, buf.view(0, 8), 16, be.create_stream()), "16 bytes"),
    ],
    ids=["h2d-too-big", "d2h-too-big", "d2h-strided", "d2h-read-only", "memset-value",
         "alloc", "d2d"],
)  # fmt: skip
def test_bad_copy_arguments_fail_before_calling_the_runtime(op: Callable, message: str) -> None:
    # The core checks them once; the GPU's hooks never see them.
    backend, rt = make()
    buf = backend.alloc(64)
    rt.calls.clear()
    with pytest.raises(ValueError, match=message):
        op(backend, buf)
    assert not [n for n in rt.names() if n.startswith(("memcpy", "memset", "malloc", "free"))]


def test_pinned_memory_is_the_runtimes_host_allocation() -> None:
    backend, rt = make()
    host = backend.alloc_pinned(16)
    assert host.pinned and host.nbytes == 16 and host.array.dtype == np.uint8
    assert host.array.ctypes.data == host.handle  # no copy: the array IS the pinned memory
    handle = host.handle
    backend.free_pinned(host)
    backend.free_pinned(host)  # a second free is a no-op, not a double free
    assert rt.args("host_alloc") == [(16,)] and rt.args("host_free") == [(handle,)]


def test_host_view_is_refused_unless_device_memory_is_host_addressable() -> None:
    discrete, rt = make(DISCRETE)
    with pytest.raises(vt.HostAccessError, match="not host-addressable"):
        discrete.host_view(discrete.alloc(16))
    unified, _ = make(UNIFIED)
    buf = unified.alloc(16)
    unified.host_view(buf.view(4, 8))[:] = 9
    out = np.empty(16, np.uint8)
    unified.copy_d2h(out, buf)
    assert out.tolist() == [0] * 4 + [9] * 8 + [0] * 4


def test_host_view_follows_the_effective_capability() -> None:
    backend, _ = make(UNIFIED)
    backend.capabilities = backend.capabilities.with_value(
        "device_memory_is_host_addressable", False, vt.Source.env, "VT_CAPS"
    )
    with pytest.raises(vt.HostAccessError):
        backend.host_view(backend.alloc(16))


def test_a_runtime_error_reaches_the_caller_unchanged() -> None:
    backend, rt = make()
    rt.fail["malloc"] = 2
    with pytest.raises(GpuCallError, match=r"malloc\(\) failed: FAKE_ERROR_2 \(2\)") as info:
        backend.alloc(1 << 40)
    assert isinstance(info.value, vt.VtError) and info.value.code == 2


def test_close_forgets_the_kernels_and_closes_the_runtime() -> None:
    backend, rt = make()
    backend.prepare()
    backend.close()
    backend.close()
    assert rt.closed == 2
    backend.prepare()  # compiles again on a later use
    assert [name for name, _ in rt.compiles] == EVERY * 2


# --------------------------------------------------------------------------- streams, events


def test_stream_and_event_calls() -> None:
    backend, rt = make()
    stream = backend.create_stream("copy")
    event = backend.create_event()
    backend.record_event(event, stream)
    rt.query_results = [False, True]
    assert backend.query_event(event) is False
    assert backend.query_event(event) is True
    backend.synchronize_event(event)
    backend.stream_wait_event(stream, event)
    backend.synchronize(stream)
    backend.destroy_event(event)
    backend.destroy_stream(stream)
    assert rt.calls == [
        ("stream_create", ()),
        ("event_create", ()),
        ("event_record", (event.handle, stream.handle)),
        ("event_query", (event.handle,)),
        ("event_query", (event.handle,)),
        ("event_synchronize", (event.handle,)),
        ("stream_wait_event", (stream.handle, event.handle)),
        ("stream_synchronize", (stream.handle,)),
        ("event_destroy", (event.handle,)),
        ("stream_destroy", (stream.handle,)),
    ]


# --------------------------------------------------------------------------- graphs


def test_capture_instantiate_launch_destroy() -> None:
    backend, rt = make()
    s = backend.create_stream("main")
    src, dst = backend.alloc(64), backend.alloc(64)
    backend.copy_h2d(src, np.full(64, 3, np.uint8))
    backend.memset(dst, 0)
    rt.calls.clear()
    backend.begin_capture(s)
    backend.copy_d2d(dst, src, 64, s)
    graph = backend.end_capture(s)
    assert rt.names() == [
        "graph_begin_capture",
        "memcpy_d2d",
        "graph_end_capture",
        "graph_instantiate",
        "graph_destroy",  # the executable graph does not need its source
    ]
    got = np.empty(64, np.uint8)
    backend.copy_d2h(got, dst)
    assert (got == 0).all()  # recorded, not run
    backend.copy_h2d(src, np.full(64, 5, np.uint8))
    rt.calls.clear()
    backend.launch_graph(graph, s)
    assert rt.names() == ["graph_launch"]
    backend.copy_d2h(got, dst)
    assert (got == 5).all()  # the replay copied what the source holds now
    backend.destroy_graph(graph)
    assert rt.names()[-1] == "graph_exec_destroy" and rt.execs == {} and rt.graphs == {}
    with pytest.raises(ValueError, match="graph captured on 'main' was destroyed"):
        backend.launch_graph(graph, s)
    with pytest.raises(ValueError, match="not a graph of the fakegpu backend"):
        backend.launch_graph(vt.Graph("other"), s)


def test_a_failed_instantiation_still_destroys_the_captured_graph() -> None:
    backend, rt = make()
    s = backend.create_stream()
    backend.begin_capture(s)
    rt.fail["graph_instantiate"] = 2
    with pytest.raises(GpuCallError, match="graph_instantiate"):
        backend.end_capture(s)
    assert rt.names()[-1] == "graph_destroy" and rt.graphs == {}


def test_the_audit_graph_probe_passes() -> None:
    backend, rt = make()
    (check,) = probe_graphs(backend)
    assert (check.id, check.result) == ("graph-replay", "pass"), check.detail
    assert rt.names().count("graph_launch") == 2
    assert rt.execs == {} and rt.graphs == {}  # everything destroyed


def test_a_decode_step_is_one_graph_launch_after_warm_up_and_capture(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch="llama")
    backend, rt = make()
    with load_gguf(path) as model, ModelRunner(backend, model, max_slots=2) as r:
        assert r.graphs
        r.execute([SeqChunk(slot=0, start_pos=0, token_ids=[1, 2, 3])]).get_output()

        def step(pos: int) -> list[str]:
            rt.calls.clear()
            r.execute([SeqChunk(slot=0, start_pos=pos, token_ids=None, from_previous=True)])
            r.synchronize()
            return rt.names()

        eager, captured, replayed = step(3), step(4), step(5)
        per_step = eager.count("launch")
        # embedding; per layer the norm folded into qkv_rope_kv_store's gemv (one row of dim
        # 64 <= norm_fold_max_k: one launch), attention (split over positions and combined:
        # two launches), matmul_add, the norm folded into swiglu, matmul_add; then
        # gather_rows, rms_norm, matmul, sample
        assert per_step == 1 + 6 * model.config.n_layers + 4
        assert eager.count("launch_overlapped") == 0  # the fake runtime: plain launches
        assert "graph_begin_capture" not in eager and "graph_launch" not in eager
        begin, end = captured.index("graph_begin_capture"), captured.index("graph_end_capture")
        assert captured[begin:end].count("launch") == per_step
        assert captured.count("launch") == per_step and captured.count("graph_launch") == 1
        assert "launch" not in replayed and replayed.count("graph_launch") == 1
        # around the launch: the inputs' copy, the previous ids' copy, the ids into the
        # output slot, and the readback
        assert replayed.index("memcpy_h2d") < replayed.index("graph_launch")
        assert replayed.index("memcpy_d2d") < replayed.index("graph_launch")
        assert replayed[replayed.index("graph_launch") + 1] == "memcpy_d2d"
        assert len(replayed) < 15
        stats = r.graph_stats
    assert stats["captures"] == 1 and stats["replays"] == 2
    assert rt.execs == {}  # the runner destroyed its graph on close


# --------------------------------------------------------------------------- VMM


def test_vmm_sets_access_over_the_mapped_prefix() -> None:
    backend, rt = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(4 * g)
    base = vrange.handle.base
    first = backend.vmm_map(vrange, 0, g)
    second = backend.vmm_map(vrange, g, 2 * g)
    buf = backend.vmm_buffer(vrange)
    backend.vmm_unmap(vrange, second)
    backend.vmm_unmap(vrange, first)
    backend.vmm_release(vrange)
    backend.vmm_release(vrange)  # idempotent
    assert g == GRANULARITY and (buf.handle, buf.nbytes, buf.owner) == (base, 4 * g, "fakegpu")
    assert rt.names().count("vmm_granularity") == 1  # asked once, then cached
    assert rt.args("vmm_map") == [(base, g, first.handle), (base + g, 2 * g, second.handle)]
    # The second call covers the whole mapped prefix [0, 3g), not only the new segment.
    assert rt.args("vmm_set_access") == [(base, g), (base, 3 * g)]
    assert rt.args("vmm_unmap") == [(base + g, 2 * g), (base, g)]
    assert rt.args("vmm_release") == [(second.handle,), (first.handle,)]
    assert rt.args("vmm_address_free") == [(base, 4 * g)]


def test_a_segment_past_a_gap_gets_access_on_its_own() -> None:
    backend, rt = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(4 * g)
    backend.vmm_map(vrange, 2 * g, g)
    ((ptr, n),) = rt.args("vmm_set_access")
    assert (ptr - vrange.handle.base, n) == (2 * g, g)


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda be, vr, g: be.vmm_reserve(0), "reservation of 0 bytes must be a non-zero multiple"),
        (lambda be, vr, g: be.vmm_reserve(g + 1), "non-zero multiple of granularity 4096"),
        (lambda be, vr, g: be.vmm_map(vr, 0, g + 1), "segment of 4097 bytes must be"),
        (lambda be, vr, g: be.vmm_map(vr, 1, g), "segment offset of 1 bytes must be a multiple"),
        (lambda be, vr, g: be.vmm_map(vr, g, 2 * g), r"would exceed reserve: 4096 \+ 8192 > 8192"),
        (lambda be, vr, g: be.vmm_map(vr, 0, g) and be.vmm_map(vr, 0, g), "overlaps"),
        (lambda be, vr, g: be.vmm_map(vr, 0, g) and be.vmm_release(vr), "unmap the 1 mapped"),
        (lambda be, vr, g: be.vmm_unmap(vr, vt.Segment("x", 0, g)), "is not mapped"),
        (lambda be, vr, g: be.vmm_buffer(vt.VirtualRange(object(), g)), "not a reservation"),
    ],
    ids=["zero", "reserve", "size", "offset", "exceed", "overlap", "release", "unmap", "foreign"],
)  # fmt: skip
def test_bad_vmm_requests_raise_vmm_error(action: Callable, message: str) -> None:
    backend, _ = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(2 * g)
    with pytest.raises(vt.VmmError, match=message):
        action(backend, vrange, g)


def test_vmm_on_a_device_without_it_raises_the_runtimes_reason() -> None:
    backend, rt = make(vt.Capabilities(), vmm_granularity=None)
    assert backend.capabilities.vmm is None
    with pytest.raises(vt.VmmError, match="has no virtual memory"):
        backend.vmm_reserve(GRANULARITY)
    assert rt.calls == []


def test_a_failed_map_releases_the_physical_memory() -> None:
    backend, rt = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(2 * g)
    rt.fail["vmm_map"] = 2
    with pytest.raises(GpuCallError, match="vmm_map"):
        backend.vmm_map(vrange, 0, g)
    ((handle,),) = rt.args("vmm_release")
    assert handle.startswith("mem#") and vrange.handle.segments == []
    backend.vmm_map(vrange, 0, g)  # the arena can try again


def test_a_failed_set_access_unmaps_the_segment() -> None:
    backend, rt = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(2 * g)
    rt.fail["vmm_set_access"] = 1
    with pytest.raises(GpuCallError, match="vmm_set_access"):
        backend.vmm_map(vrange, 0, g)
    assert rt.names()[-3:] == ["vmm_set_access", "vmm_unmap", "vmm_release"]
    assert vrange.handle.segments == []
    backend.vmm_release(vrange)


def test_a_failed_set_access_with_a_failed_release_still_frees_the_reservation() -> None:
    backend, rt = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(2 * g)
    rt.fail["vmm_set_access"] = 1
    rt.fail["vmm_release"] = 1
    with pytest.raises(GpuCallError, match="vmm_set_access"):
        backend.vmm_map(vrange, 0, g)
    # the caller never got the segment, so nothing could retry it: it is forgotten
    assert vrange.handle.segments == [] and vrange.handle.unmapped == []
    backend.vmm_map(vrange, 0, g)
    assert rt.names()[-1] == "vmm_set_access"


def test_a_release_after_a_failed_address_free_can_be_retried() -> None:
    backend, rt = make()
    vrange = backend.vmm_reserve(backend.vmm_granularity())
    rt.fail["vmm_address_free"] = 1
    with pytest.raises(GpuCallError):
        backend.vmm_release(vrange)
    backend.vmm_release(vrange)
    assert len(rt.args("vmm_address_free")) == 2
    with pytest.raises(vt.VmmError, match="already released"):
        backend.vmm_map(vrange, 0, GRANULARITY)


def test_an_unmap_after_a_failed_release_is_retried_without_unmapping_again() -> None:
    backend, rt = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(2 * g)
    base = vrange.handle.base
    first = backend.vmm_map(vrange, 0, g)
    second = backend.vmm_map(vrange, g, g)
    rt.fail["vmm_release"] = 1
    with pytest.raises(GpuCallError, match="vmm_release"):
        backend.vmm_unmap(vrange, second)
    # still listed, so the reservation is not freed under its physical memory
    assert vrange.handle.segments == [first, second]
    with pytest.raises(vt.VmmError, match="unmap the 2 mapped segment"):
        backend.vmm_release(vrange)
    backend.vmm_unmap(vrange, second)  # the retry completes
    assert rt.args("vmm_unmap") == [(base + g, g)]  # the range was unmapped once
    assert rt.args("vmm_release") == [(second.handle,), (second.handle,)]
    assert vrange.handle.segments == [first]
    with pytest.raises(vt.VmmError, match="is not mapped"):
        backend.vmm_unmap(vrange, second)
    backend.vmm_unmap(vrange, first)
    backend.vmm_release(vrange)


def test_the_arena_release_retries_a_failed_segment_release() -> None:
    backend, rt = make()
    g = backend.vmm_granularity()
    arena = VmmArena.reserve(backend, 4 * g, min_growth=g)
    base = arena.vrange.handle.base
    arena.ensure(g)
    arena.ensure(2 * g)
    assert arena.segments == 2
    rt.fail["vmm_release"] = 1
    with pytest.raises(vt.VmmError, match="2 segment\\(s\\) still mapped, call release"):
        arena.release()
    assert arena.segments == 2 and arena.mapped_bytes == 2 * g
    arena.release()
    assert arena.released and arena.mapped_bytes == 0
    assert rt.args("vmm_unmap") == [(base + g, g), (base, g)]  # none again on the retry
    first, second = (args[2] for args in rt.args("vmm_map"))
    assert rt.args("vmm_release") == [(second,), (second,), (first,)]
    assert rt.names()[-1] == "vmm_address_free"


# --------------------------------------------------------------------------- kernels


def test_the_kernels_compile_once_with_the_warp_size() -> None:
    backend, rt = make(warp=64)
    backend.prepare()
    backend.prepare()
    opts = ("-DVT_WARP=64", "-DVT_NORM_LATE=1")
    assert rt.compiles == every(opts)


def test_norm_late_compiles_every_module_with_its_define() -> None:
    """GpuBackend.norm_late (or norm_fold_max_k) reaches the kernels as -DVT_NORM_LATE=1,
    in the weights' module of every layout and in each layout's (the norm ops' gemv kernels
    are in both), and the other kernels' (one set of options); with both off, the bit-equal
    norm kernels compile without it."""
    for norm_late, fold, late in [(True, 0, ("-DVT_NORM_LATE=1",)), (False, 0, ())]:
        backend, rt = make()
        backend.norm_late, backend.norm_fold_max_k = norm_late, fold
        c = OpCase(backend)
        c.w("w", np.ones((16, 256), np.float32), "Q8_0")
        opts = ("-DVT_WARP=32", *late)
        assert rt.compiles == every(opts) + own(0xC00, opts)
        backend.close()
    assert "VT_NORM_LATE" in WEIGHT_SOURCE


def test_gemv_x16_compiles_every_module_with_its_define() -> None:
    """GpuBackend.gemv_x16_min_rows (x as 16-bit codes in one-row gemv blocks of at least
    that many weight rows) reaches the kernels as -DVT_GV_X16=N, in the weights' module of
    every layout and in each layout's; 0, the default, compiles without it; a negative value
    is refused by name before anything compiles."""
    for rows, x16 in [(4, ("-DVT_GV_X16=4",)), (0, ())]:
        backend, rt = make()
        backend.gemv_x16_min_rows, backend.gemv_x16_layout_flags = rows, 0
        OpCase(backend).w("w", np.ones((16, 256), np.float32), "Q8_0")
        opts = ("-DVT_WARP=32", "-DVT_NORM_LATE=1", *x16)
        assert rt.compiles == every(opts) + own(0xC00, opts)
        backend.close()
    assert "VT_GV_X16" in WEIGHT_SOURCE
    backend, rt = make()
    backend.gemv_x16_min_rows = -1
    with pytest.raises(ValueError, match=r"gemv_x16_min_rows is -1; 0 \(never\) or"):
        backend.prepare()
    assert rt.compiles == []
    backend.close()


def test_mma_stage_compiles_every_module_with_its_define() -> None:
    """GpuBackend.mma_stage (the int8 mma kernels' weight codes through shared memory and
    their scales in fewer loads; on by default) reaches the kernels as -DVT_MMA_STAGE=1 in
    the int8 group's modules alone, of every layout and each layout's own; off compiles
    without it; another value is refused by name before anything compiles."""
    for stage, define in [(True, STAGE), (1, STAGE), (False, ()), (0, ())]:
        backend, rt = make()
        backend.mma_stage = stage
        OpCase(backend).w("w", np.ones((16, 256), np.float32), "Q8_0")
        opts = ("-DVT_WARP=32", "-DVT_NORM_LATE=1")
        assert rt.compiles == every(opts, define) + own(0xC00, opts, define)
        backend.close()
    assert "VT_MMA_STAGE" in WEIGHT_SOURCE
    backend, rt = make()
    backend.mma_stage = 2
    with pytest.raises(ValueError, match=r"mma_stage is 2; True \(the int8 mma"):
        backend.prepare()
    assert rt.compiles == []
    backend.close()


def test_gemv_x16_layout_flags_keep_other_layouts_on_the_float_path() -> None:
    """gemv_x16_layout_flags 0x100 (Q_NIB): the 16-bit path compiles into the 4-bit layouts'
    modules (Q4_1: 0x500) only; Q8_0's (0xc00) and the weights' module of every layout keep
    the float path, and gemv_x16_rows says so per launch's weights; flags outside the Q_*
    flags, or negative, are refused by name before anything compiles."""
    backend, rt = make()
    backend.gemv_x16_min_rows, backend.gemv_x16_layout_flags = 2, 0x100
    c = OpCase(backend)
    a = c.w("a", np.ones((16, 256), np.float32), "Q8_0").handle
    b = c.w("b", np.ones((16, 256), np.float32), "Q4_1").handle
    opts = ("-DVT_WARP=32", "-DVT_NORM_LATE=1")
    q4_1 = (*opts, "-DVT_GV_X16=2")
    assert rt.compiles == every(opts) + own(0xC00, opts) + own(0x500, q4_1)
    assert (backend.gemv_x16_rows(a), backend.gemv_x16_rows(b)) == (0, 2)
    assert backend.gemv_x16_rows(a, b) == backend.gemv_x16_rows() == 0  # every layout's module
    backend.gemv_x16_layout_flags = 0
    assert (backend.gemv_x16_rows(a), backend.gemv_x16_rows(b), backend.gemv_x16_rows()) == (
        2, 2, 2,
    )  # fmt: skip
    backend.close()
    for flags in (0x1, -0x100):
        backend, rt = make()
        backend.gemv_x16_min_rows, backend.gemv_x16_layout_flags = 2, flags
        with pytest.raises(ValueError, match=rf"gemv_x16_layout_flags is {flags}; 0 \(every"):
            backend.prepare()
        assert rt.compiles == []
        backend.close()


def test_gemv_x16_is_on_by_default_in_the_4_bit_layouts_only() -> None:
    """By default one-row gemv blocks of 4 or more rows take x as 16-bit codes in the 4-bit
    layouts' modules (Q4_0, Q4_1, Q4_K) and the float path in Q8_0's, Q6_K's and float32's."""
    backend, _ = make()
    assert (backend.gemv_x16_min_rows, backend.gemv_x16_layout_flags) == (4, W.Q_NIB)
    c = OpCase(backend)
    rng = np.random.default_rng(5)
    values = rng.standard_normal((16, 256)).astype(np.float32)
    wtypes = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K", "F32")
    rows = {wtype: backend.gemv_x16_rows(c.w(wtype, values, wtype).handle) for wtype in wtypes}
    assert rows == {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 0, "Q6_K": 0, "F32": 0}
    backend.close()


def test_a_layout_override_uploads_and_compiles_that_layout() -> None:
    """layout_overrides (bench_variant.py --layout Q8_0=0x800) packs Q8_0 with float32
    scales and compiles that layout's module, not the default one's."""
    backend, rt = make()
    backend.layout_overrides = (("Q8_0", 0x800),)
    w = OpCase(backend).w("w", np.ones((16, 256), np.float32), "Q8_0")
    assert w.handle.layout == 0x800
    assert rt.compiles[-3:] == own(0x800, ("-DVT_WARP=32", "-DVT_NORM_LATE=1"))


def test_every_kernel_the_backend_launches_is_in_the_one_source() -> None:
    source = kernel_source()
    includes = [line for line in source.splitlines() if line.lstrip().startswith("#include")]
    assert includes == []  # nvrtc and hiprtc find no system headers
    names = {
        "rms_norm", "rope", "kv_store", "attention_split", "attention_combine", "silu_mul",
        "add", "gather_rows", "sample", "logprobs",
        "rope_kv_store", "bias_add", *(f"embedding_{s}" for s in ("f32", "f16", "bf16", "q")),
        *(f"dequantize_{s}" for s in ("f16", "bf16", "q")), "to_half",
        *(f"dequantize_h_{s}" for s in ("bf16", "q")),
        *(f"{k}_{s}" for k in ("matmul_small1", "matmul_small4", "matmul_tiled",
                               "swiglu_small1", "swiglu_small2", "qkv_small1", "qkv_small4")
          for s in ("f32", "f16", "bf16", "q")),
    }  # fmt: skip
    for gv in (1, 2, 4):  # the one-row kernels, per features a block
        assert f"\nVT_GEMV({gv})\n" in source
    for kind in ("matmul", "swiglu", "qkv"):
        assert f'extern "C" __global__ void {kind}_gemv##GV##_q(' in source.replace("\\\n", "")
    signatures = kernel_signatures()
    for name in names:
        prefix, _, suffix = name.rpartition("_")
        if prefix.rstrip("0124") in MACRO_KERNELS:  # instantiated by a macro
            assert prefix.rstrip("0124") in signatures
            macro = {"embedding": "VT_EMBEDDING", "dequantize": "VT_DEQUANTIZE",
                     "dequantize_h": "VT_DEQUANTIZE_H"}.get(prefix, "VT_MATMUL")  # fmt: skip
            assert f"\n{macro}({suffix}, " in source, name
            if prefix[-1].isdigit():  # a decode kernel per features per warp
                kind = "SW" if prefix.startswith("swiglu") else "MM"
                assert f"VT_DECODE_{kind}(SUFFIX, WT, {prefix[-1]})" in source, name
        else:
            assert name in signatures, name


def test_each_kernel_comes_from_the_module_whose_parts_declare_it() -> None:
    """The groups' parts together are the whole source; every kernel of it is declared by
    one group only, and group_of routes each name (a macro's too: attention_tiled_h64r16)
    to that group; a name no group declares is refused by name."""
    every_names, every_prefixes = kernel_names(KERNEL_PARTS)
    assert set().union(*MODULE_GROUPS.values()) == set(KERNEL_PARTS)
    declared: dict[str, list[str]] = {}
    for group, parts in MODULE_GROUPS.items():
        assert parts[0] == "common.cu"
        assert [p for p in KERNEL_PARTS if p in parts] == list(parts)  # the source's order
        names, prefixes = kernel_names(parts)
        for name in (*names, *prefixes):
            declared.setdefault(name, []).append(group)
        assert all(group_of(name) == group for name in names)
    assert set(declared) == set(every_names) | set(every_prefixes)
    assert {name: groups for name, groups in declared.items() if len(groups) > 1} == {}
    expect = {
        "rows": ["rms_norm", "embedding_q", "dequantize_h_q", "dequantize16_q", "matmul_small4_q",
                 "matmul_small4_q8a", "matmul_tiled_q"],
        "gemv": ["matmul_gemv2_q", "swiglu_psq_gemv1_q", "qkv_rope_psq_gemv_q", "rope_kv_store"],
        "int8": ["quantize_rows", "quantize_norm_rows", "swiglu_mma4_q8a", "qkv_mma1_q8a"],
        "attention": ["attention_split", "attention_combine", "sample", "logprobs", "add"],
        "attention_tiled": ["attention_tiled_h64r16"],
    }  # fmt: skip
    assert {group: [group_of(name) for name in names] for group, names in expect.items()} == {
        group: [group] * len(names) for group, names in expect.items()
    }
    with pytest.raises(ValueError, match="no kernel module declares a kernel 'no_such'"):
        group_of("no_such")
    assert "long long vt_kv_index(" in kernel_source(("common.cu",))  # for several groups
    backend, rt = make()  # a module key no group makes (a layout's attention) is refused
    for key in (("attention", 0x500), ("no_such", None)):
        with pytest.raises(ValueError, match=re.escape(f"no kernel module {key!r}")):
            backend._module(key)
    assert rt.compiles == []
    backend.close()


@pytest.mark.parametrize("on", [True, False], ids=["layout-kernels", "run-time-flags"])
def test_launches_of_one_layout_take_that_layouts_module(on: bool) -> None:
    """Each WT_Q layout compiles its modules (WEIGHT_GROUPS' parts with -DVT_Q_FLAGS) once,
    when its first weight is uploaded; a launch reading weights of one layout takes its
    kernel from that layout's module of the kernel's group, one mixing layouts (Q8_0, Q4_0,
    Q6_K) from the group's module of every layout, one reading no weight likewise (the
    attention group's). layout_kernels off: the modules of every layout, flags read at run
    time."""
    backend, rt = make()
    backend.layout_kernels = on
    c = OpCase(backend)
    rng = np.random.default_rng(3)
    ws = {name: c.w(name, rng.standard_normal((rows, 256)).astype(np.float32), wtype)
          for name, rows, wtype in [("q", 16, "Q8_0"), ("k", 8, "Q4_0"), ("v", 8, "Q6_K"),
                                    ("k8", 8, "Q8_0"), ("v8", 8, "Q8_0")]}  # fmt: skip
    late = ("-DVT_WARP=32", "-DVT_NORM_LATE=1")  # norm_fold_max_k's kernels
    x16 = ("-DVT_GV_X16=4",)  # the default: the 4-bit layouts (Q4_0) alone
    layouts = own(0xC00, late) + own(0xF00, (*late, *x16)) + own(0x800, late) if on else []
    assert rt.compiles == every(late) + layouts
    weights = set().union(*(kernel_names(MODULE_GROUPS[group])[0] for group in WEIGHT_GROUPS))
    assert "attention_split" not in weights  # only the weights' kernels
    stream = backend.create_stream()
    x = c.t("x", F32, 1, 256)
    q, k, v = c.t("q", F32, 1, 16), c.t("k", F32, 1, 8), c.t("v", F32, 1, 8)
    backend.launch("matmul", stream, out=q, x=x, weight=ws["q"])
    backend.launch("qkv", stream, q=q, k=k, v=v, x=x, wq=ws["q"], wk=ws["k8"], wv=ws["v8"])
    backend.launch("qkv", stream, q=q, k=k, v=v, x=x, wq=ws["q"], wk=ws["k"], wv=ws["v"])
    backend.launch("add", stream, out=q, a=q, b=q)
    modules = [launch.fn.split(":")[0] for launch in rt.launches]
    gemv, attention = backend._module(("gemv", None)), backend._module(("attention", None))
    q8 = backend._module(("gemv", 0xC00)) if on else gemv
    assert modules == [q8, q8, gemv, attention]


MACRO_KERNELS = (
    "embedding", "dequantize", "dequantize_h", "matmul_small", "matmul_tiled", "swiglu_small",
    "qkv_small", "swiglu_norm_gemv", "matmul_norm_gemv",
)  # fmt: skip


def macro_prefix(kernel: str) -> str:
    """``matmul_small4_q`` -> ``matmul_small``: the kernel's name in the macro."""
    return kernel.rsplit("_", 1)[0].rstrip("0123456789")


def kernel_signatures() -> dict[str, list[tuple[str, str]]]:
    """the kernel source's ``extern "C"`` kernels: name (without a macro's ``_##SUFFIX``) ->
    ``[(type, parameter name)]``."""
    source = kernel_source().replace("\\\n", " ")
    found = re.findall(
        r'extern "C" __global__ void (?:__cluster_dims__\([^)]*\) )?(?:VT_\w+_BOUNDS )?'
        r"(\w+?)(?:##NO##|##GV##_q)?(?:_##SUFFIX)?\(([^)]*)\)",
        source,
    )
    out = {}
    for name, params in found:
        pairs = []
        for param in params.split(","):
            words = param.replace("*", " * ").split()
            pairs.append((" ".join(words[:-1]), words[-1]))
        out[name] = pairs
    return out


def karg(launch: Any, name: str) -> Any:
    """A launch's argument by its parameter name in the kernel's signature."""
    names = [n for _, n in kernel_signatures()[launch.kernel]]
    return launch.args[names.index(name)]


class OpCase:
    """Tensors in buffers of their own, so each kernel pointer argument names its tensor."""

    def __init__(self, backend: FakeGpu) -> None:
        self.backend = backend
        self.addresses: dict[str, int] = {}

    def t(self, name: str, dtype: Any, *shape: int) -> vt.Tensor:
        nbytes = np.dtype(dtype).itemsize * max(1, int(np.prod(shape)))
        tensor = vt.Tensor.of(self.backend.alloc(nbytes), dtype, *shape)
        self.addresses[name] = int(tensor.buffer.handle)
        return tensor

    def w(self, name: str, values: np.ndarray, wtype: str = "F32") -> vt.Weight:
        return self.backend.upload_weight(weight_tensor(name, values, wtype))


def _case(c: OpCase, op: str) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """``op``'s arguments, the kernel it launches and that kernel's scalar arguments
    (distinct within a kernel, so that two swapped arguments fail the test)."""
    rng = np.random.default_rng(0)
    layout = vt.KVLayout(n_layers=4, n_slots=7, max_len=5, n_kv_heads=1, head_dim=8)
    rows = (3, 8)

    def kv() -> dict[str, Any]:
        return {"cache": c.t("cache", F32, *layout.shape), "slots": c.t("slots", I32, 3),
                "positions": c.t("positions", I32, 3), "layout": layout, "layer": 2}  # fmt: skip

    cases: dict[str, Callable[[], tuple[dict[str, Any], str, dict[str, Any]]]] = {
        "embedding": lambda: (
            {"out": c.t("out", F32, *rows), "ids": c.t("ids", I32, 3),
             "table": c.w("table", rng.standard_normal((11, 8)).astype(np.float32))},
            "embedding_f32",
            {"lg_block": 0, "n": 3, "vocab": 11, "dim": 8},
        ),
        "rms_norm": lambda: (
            {"out": c.t("out", F32, *rows), "x": c.t("x", F32, *rows),
             "weight": c.w("norm", np.ones(8, np.float32)), "eps": 1e-5},
            "rms_norm",
            {"n": 3, "dim": 8, "eps": np.float32(1e-5)},
        ),
        "matmul": lambda: (
            {"out": c.t("out", F32, 3, 6), "x": c.t("x", F32, 3, 32),
             "weight": c.w("proj", rng.standard_normal((6, 32)).astype(np.float32), "Q8_0"),
             "bias": c.w("bias", np.ones(6, np.float32))},
            "matmul_small4_q",
            {"lg_block": lg("Q8_0"), "n": 3, "N": 6, "K": 32, "rpb": 8},
        ),
        "rope": lambda: (
            {"x": c.t("x", F32, 3, 16), "positions": c.t("positions", I32, 3), "n_heads": 2,
             "params": vt.RopeParams(8, style=vt.RopeStyle.neox)},
            "rope",
            {"n": 3, "n_heads": 2, "head_dim": 8, "neox": 1},
        ),
        "kv_store": lambda: (
            {**kv(), "k": c.t("k", F32, *rows), "v": c.t("v", F32, *rows)},
            "kv_store",
            {"n": 3, "row": 8, "n_slots": 7, "n_layers": 4, "max_len": 5, "layer": 2},
        ),
        "attention": lambda: (
            {**kv(), "out": c.t("out", F32, 3, 48), "q": c.t("q", F32, 3, 48), "n_heads": 6,
             "scale": 0.5},
            "attention_split",
            {"n": 3, "n_heads": 6, "n_kv": 1, "head_dim": 8, "n_slots": 7, "n_layers": 4,
             "max_len": 5, "layer": 2, "scale": 0.5, "gb": 3, "splits": 32,
             "min_per_split": 16, "tile": 0},
        ),
        "attention_bounded": lambda: (  # short_context 0: op_attention's launches
            {**kv(), "out": c.t("out", F32, 3, 48), "q": c.t("q", F32, 3, 48), "n_heads": 6,
             "scale": 0.5, "context": 5},
            "attention_split",
            {"n": 3, "n_heads": 6, "n_kv": 1, "head_dim": 8, "n_slots": 7, "n_layers": 4,
             "max_len": 5, "layer": 2, "scale": 0.5, "gb": 3, "splits": 32,
             "min_per_split": 16, "tile": 0},
        ),
        "qkv_rope_kv_store": lambda: (
            {**kv(), "slots": c.t("slots", I32, 1), "positions": c.t("positions", I32, 1),
             "q": c.t("q", F32, 1, 16), "k": c.t("k", F32, 1, 8), "v": c.t("v", F32, 1, 8),
             "x": c.t("x", F32, 1, 256),
             "wq": c.w("wq", rng.standard_normal((16, 256)).astype(np.float32), "Q8_0"),
             "wk": c.w("wk", rng.standard_normal((8, 256)).astype(np.float32), "Q4_0"),
             "wv": c.w("wv", rng.standard_normal((8, 256)).astype(np.float32), "Q6_K"),
             "bk": c.w("bk", np.ones(8, np.float32)), "n_heads": 2,
             "params": vt.RopeParams(8, style=vt.RopeStyle.neox)},
            "qkv_rope_gemv_q",  # one row: the fused kernel
            {"lgq": lg("Q8_0"), "lgk": lg("Q4_0"), "lgv": lg("Q6_K"), "n_heads": 2, "n_kv": 1,
             "head_dim": 8, "K": 256, "neox": 1, "n_slots": 7, "n_layers": 4, "max_len": 5,
             "layer": 2},
        ),
        "rms_norm_qkv_rope_kv_store": lambda: (
            {**kv(), "slots": c.t("slots", I32, 1), "positions": c.t("positions", I32, 1),
             "q": c.t("q", F32, 1, 16), "k": c.t("k", F32, 1, 8), "v": c.t("v", F32, 1, 8),
             "x": c.t("x", F32, 1, 256), "scratch": c.t("scratch", F32, 1, 256),
             "norm": c.w("norm", np.ones(256, np.float32)), "eps": 1e-5,
             "wq": c.w("wq", rng.standard_normal((16, 256)).astype(np.float32), "Q8_0"),
             "wk": c.w("wk", rng.standard_normal((8, 256)).astype(np.float32), "Q4_0"),
             "wv": c.w("wv", rng.standard_normal((8, 256)).astype(np.float32), "Q6_K"),
             "bk": c.w("bk", np.ones(8, np.float32)), "n_heads": 2,
             "params": vt.RopeParams(8, style=vt.RopeStyle.neox)},
            "qkv_rope_norm_gemv_q",  # one row, the op native: the fused kernel
            {"lgq": lg("Q8_0"), "lgk": lg("Q4_0"), "lgv": lg("Q6_K"), "n_heads": 2, "n_kv": 1,
             "head_dim": 8, "K": 256, "neox": 1, "n_slots": 7, "n_layers": 4, "max_len": 5,
             "layer": 2, "eps": np.float32(1e-5)},
        ),
        "rms_norm_swiglu": lambda: (
            {"out": c.t("out", F32, 1, 6), "x": c.t("x", F32, 1, 256),
             "norm": c.w("norm", np.ones(256, np.float32)), "eps": 1e-5,
             "gate": c.w("gate", rng.standard_normal((6, 256)).astype(np.float32), "Q4_K"),
             "up": c.w("up", rng.standard_normal((6, 256)).astype(np.float32), "Q8_0"),
             "scratch": c.t("s", F32, 1, 256), "scratch_gate": c.t("sg", F32, 1, 6),
             "scratch_up": c.t("su", F32, 1, 6)},
            "swiglu_norm_gemv2_q",
            {"glg": lg("Q4_K"), "ulg": lg("Q8_0"), "N": 6, "K": 256, "eps": np.float32(1e-5)},
        ),
        "silu_mul": lambda: (
            {"out": c.t("out", F32, *rows), "gate": c.t("gate", F32, *rows),
             "up": c.t("up", F32, *rows)},
            "silu_mul",
            {"n": 24},
        ),
        "add": lambda: (
            {"out": c.t("out", F32, *rows), "a": c.t("a", F32, *rows), "b": c.t("b", F32, *rows)},
            "add",
            {"n": 24},
        ),
        "gather_rows": lambda: (
            {"out": c.t("out", F32, 2, 8), "x": c.t("x", F32, *rows), "rows": c.t("rows", I32, 2)},
            "gather_rows",
            {"n": 2, "dim": 8, "m": 3},
        ),
        "sample": lambda: (
            {"out": c.t("out", I32, 3), "logits": c.t("logits", F32, 3, 7),
             "params": c.t("params", vt.SAMPLE_PARAMS_DTYPE, 3)},
            "sample",
            {"n": 3, "vocab": 7, "parts": 0},
        ),
        "logprobs": lambda: (
            {"chosen": c.t("chosen", F32, 2), "top_ids": c.t("top_ids", I32, 2, 5),
             "top_logprobs": c.t("top_lp", F32, 2, 5), "logits": c.t("logits", F32, 3, 11),
             "ids": c.t("ids", I32, 3), "rows": c.t("rows", I32, 2)},
            "logprobs",
            {"m": 2, "k": 5, "n": 3, "vocab": 11},
        ),
        "matmul_add": lambda: (
            {"out": c.t("out", F32, 3, 6), "x": c.t("x", F32, 3, 32),
             "weight": c.w("proj", rng.standard_normal((6, 32)).astype(np.float32), "Q4_1"),
             "residual": c.t("residual", F32, 3, 6), "scratch": c.t("scratch", F32, 3, 6)},
            "matmul_small4_q",
            {"lg_block": lg("Q4_1"), "n": 3, "N": 6, "K": 32, "rpb": 8},
        ),
        "matmul_add_rms_norm": lambda: (
            {"out": c.t("out", F32, 1, 6), "normed": c.t("normed", F32, 1, 6),
             "x": c.t("x", F32, 1, 256),
             "weight": c.w("proj", rng.standard_normal((6, 256)).astype(np.float32), "Q8_0"),
             "residual": c.t("residual", F32, 1, 6), "norm": c.w("norm", np.ones(6, np.float32)),
             "eps": 1e-5, "scratch": c.t("scratch", F32, 1, 6)},
            "matmul_norm_gemv2_q",
            {"lg_block": lg("Q8_0"), "N": 6, "K": 256, "eps": np.float32(1e-5)},
        ),
        "swiglu": lambda: (
            {"out": c.t("out", F32, 3, 6), "x": c.t("x", F32, 3, 256),
             "gate": c.w("gate", rng.standard_normal((6, 256)).astype(np.float32), "Q6_K"),
             "up": c.w("up", rng.standard_normal((6, 256)).astype(np.float32), "Q8_0"),
             "scratch_gate": c.t("sg", F32, 3, 6), "scratch_up": c.t("su", F32, 3, 6)},
            "swiglu_small2_q",
            {"glg": lg("Q6_K"), "ulg": lg("Q8_0"), "n": 3, "N": 6, "K": 256, "rpb": 8},
        ),
        "rope_kv_store": lambda: (
            {**kv(), "q": c.t("q", F32, 3, 24), "k": c.t("k", F32, 3, 8), "v": c.t("v", F32, 3, 8),
             "n_heads": 3, "params": vt.RopeParams(8)},
            "rope_kv_store",
            {"n": 3, "n_heads": 3, "n_kv": 1, "head_dim": 8, "neox": 0, "n_slots": 7,
             "n_layers": 4, "max_len": 5, "layer": 2},
        ),
        "qkv": lambda: (
            {"q": c.t("q", F32, 3, 6), "k": c.t("k", F32, 3, 2), "v": c.t("v", F32, 3, 3),
             "x": c.t("x", F32, 3, 256),
             "wq": c.w("wq", rng.standard_normal((6, 256)).astype(np.float32), "Q8_0"),
             "wk": c.w("wk", rng.standard_normal((2, 256)).astype(np.float32), "Q4_0"),
             "wv": c.w("wv", rng.standard_normal((3, 256)).astype(np.float32), "Q6_K"),
             "bk": c.w("bk", np.ones(2, np.float32))},
            "qkv_small4_q",
            {"lgq": lg("Q8_0"), "lgk": lg("Q4_0"), "lgv": lg("Q6_K"), "n": 3, "Nq": 6, "Nk": 2,
             "Nv": 3, "K": 256, "rpb": 8},
        ),
    }  # fmt: skip
    return cases[op]()


#: The deferred norm's ops: (the producer's kernel, the consumer's) at one row.
DEFERRED = {
    "matmul_add_rms_norm_swiglu": ("matmul_psq_gemv2_q", "swiglu_psq_gemv2_q"),
    "matmul_add_rms_norm_qkv_rope_kv_store": ("matmul_psq_gemv2_q", "qkv_rope_psq_gemv_q"),
}


@pytest.mark.parametrize("op", tuple(DEFERRED))
def test_deferred_norm_launches_the_projection_then_the_consumer(op: str) -> None:
    """At one row, natively (``native_fused``) and wider than ``norm_fold_max_k``, the projection
    (matmul_psq_gemv2_q: out, the unscaled normed row into scratch_norm, a partial sum of
    squares a block into backend scratch) and then the consumer, which reads that row and
    those partials (their count, the norm's eps): each kernel's arguments in its
    signature's order. Not native, or at three rows: the decomposition's kernels."""
    backend, rt = make()
    c = OpCase(backend)
    rng = np.random.default_rng(1)
    dim, K = 256, 512

    def w(name: str, rows: int, cols: int = dim) -> vt.Weight:
        return c.w(name, rng.standard_normal((rows, cols)).astype(np.float32), "Q8_0")

    def args(n: int) -> dict[str, Any]:
        a: dict[str, Any] = {
            "out": c.t("out", F32, n, dim), "x": c.t("x", F32, n, K), "weight": w("wo", dim, K),
            "residual": c.t("residual", F32, n, dim), "norm": c.w("norm", np.ones(dim, F32)),
            "eps": 1e-5, "scratch": c.t("scratch", F32, n, dim),
            "scratch_norm": c.t("normed", F32, n, dim),
        }  # fmt: skip
        if op.endswith("swiglu"):
            return a | {"act": c.t("act", F32, n, 6), "gate": w("g", 6), "up": w("u", 6),
                        "scratch_gate": c.t("sg", F32, n, 6),
                        "scratch_up": c.t("su", F32, n, 6)}  # fmt: skip
        layout = vt.KVLayout(n_layers=4, n_slots=7, max_len=5, n_kv_heads=1, head_dim=8)
        return a | {"q": c.t("q", F32, n, 24), "k": c.t("k", F32, n, 8), "v": c.t("v", F32, n, 8),
                    "wq": w("wq", 24), "wk": w("wk", 8), "wv": w("wv", 8),
                    "cache": c.t("cache", F32, *layout.shape), "slots": c.t("slots", I32, n),
                    "positions": c.t("positions", I32, n), "layout": layout, "layer": 2,
                    "n_heads": 3, "params": vt.RopeParams(8)}  # fmt: skip

    stream = backend.create_stream()
    assert backend.supports(op)  # native by default (run 103)
    # rows of up to norm_fold_max_k values (1,024 by default): the decomposition, whose
    # norm op folds the norm into its consumer
    backend.launch(op, stream, **args(1))
    folded = "swiglu_norm_gemv2_q" if op.endswith("swiglu") else "qkv_rope_norm_gemv_q"
    assert [launch.kernel for launch in rt.launches] == ["matmul_gemv2_q", folded]
    backend.norm_fold_max_k = 0  # wider rows (every row here): deferred
    backend.native_fused -= {op}  # not native: rms_norm, then the plain consumer
    rt.launches.clear()
    backend.launch(op, stream, **args(1))
    consumer = DEFERRED[op][1].replace("_psq", "")
    assert [launch.kernel for launch in rt.launches] == [
        "matmul_gemv2_q", "rms_norm", consumer
    ]  # fmt: skip
    backend.native_fused |= {op}
    for n, kernels in ((3, None), (1, DEFERRED[op])):
        rt.launches.clear()
        a = args(n)
        backend.launch(op, stream, **a)
        if kernels is None:  # three rows: the decomposition (rms_norm among its kernels)
            assert "rms_norm" in [launch.kernel for launch in rt.launches]
            continue
        producer, launch = rt.launches
        assert (producer.kernel, launch.kernel) == kernels
        sig = kernel_signatures()
        assert len(producer.args) == len(sig["matmul_psq_gemv"])
        pk = {name: v for (_, name), v in zip(sig["matmul_psq_gemv"], producer.args, strict=True)}
        assert pk["out"] == c.addresses["out"] and pk["x"] == c.addresses["x"]
        assert pk["residual"] == c.addresses["residual"] and pk["normed"] == c.addresses["normed"]
        assert pk["data"] == a["weight"].handle.data and pk["nw"] == a["norm"].handle.data
        assert (pk["N"], pk["K"], pk["psq"] != 0) == (dim, K, True)
        assert producer.grid == (dim // 2, 1, 1)
        macro = launch.kernel.startswith("swiglu_psq_gemv")  # one kernel per features
        names = [name for _, name in sig[macro_prefix(launch.kernel) if macro else launch.kernel]]
        ck = dict(zip(names, launch.args, strict=True))
        # the consumer reads the producer's row and partial sums: dim / 2 of them
        assert ck["x"] == c.addresses["normed"] and ck["psq"] == pk["psq"]
        assert ck["np"] == dim // 2 and ck["eps"] == pytest.approx(1e-5)
        assert ck["K"] == dim
    # deferred_norm_features: projection blocks of 4 features, half the partial sums
    backend.deferred_norm_features = 4
    rt.launches.clear()
    backend.launch(op, stream, **args(1))
    producer, launch = rt.launches
    assert producer.kernel == "matmul_psq_gemv4_q" and producer.grid == (dim // 4, 1, 1)
    sig = kernel_signatures()
    names = [n for _, n in sig.get(launch.kernel) or sig[macro_prefix(launch.kernel)]]
    assert launch.args[names.index("np")] == dim // 4
    # gemv_long_*: a projection with K >= gemv_long_min_k on its own blocks (4 features of
    # 256 threads), unrolled where gemv_unroll_min_k says (matmul_psq_gemvu*_q)
    backend.deferred_norm_features = 0
    backend.gemv_long_min_k = K
    for unroll, threads, kernel in ((0, 256, "matmul_psq_gemv4_q"),
                                    (K, 128, "matmul_psq_gemvu4_q")):  # fmt: skip
        backend.gemv_unroll_min_k, backend.gemv_long_threads = unroll, threads
        rt.launches.clear()
        backend.launch(op, stream, **args(1))
        producer, launch = rt.launches
        got = (producer.kernel, producer.grid, producer.block)
        assert got == (kernel, (dim // 4, 1, 1), (threads, 1, 1))
        assert len(producer.args) == len(sig["matmul_psq_gemv"])
        assert launch.args[names.index("np")] == dim // 4
    # a consumer that takes the long rule too keeps qkv_rope's bound of 128 threads
    backend.gemv_long_min_k, backend.gemv_unroll_min_k, backend.gemv_long_threads = dim, 0, 256
    rt.launches.clear()
    backend.launch(op, stream, **args(1))
    consumer = rt.launches[-1]
    assert consumer.block == ((128 if "qkv" in consumer.kernel else 256), 1, 1)
    backend.gemv_long_min_k = 0


def test_sample_finds_a_long_rows_argmax_over_blocks_first() -> None:
    """A row of 5,000 ids: sample_argmax over blocks of 2,048 ids (3 a row), then sample
    reading their results from the same scratch; sample_argmax_slice = 0: sample alone."""
    backend, rt = make()
    c = OpCase(backend)
    args = {"out": c.t("out", I32, 2), "logits": c.t("logits", F32, 2, 5000),
            "params": c.t("params", vt.SAMPLE_PARAMS_DTYPE, 2)}  # fmt: skip
    stream = backend.create_stream()
    backend.launch("sample", stream, **args)
    argmax, sample = rt.launches
    assert argmax.kernel == "sample_argmax" and argmax.grid == (2, 3, 1)
    part = argmax.args[0]
    assert part and argmax.args[1:] == [c.addresses["logits"], 5000, 2048]
    assert sample.kernel == "sample" and sample.grid == (2, 1, 1)
    assert sample.args[-2:] == [part, 3]
    rt.launches.clear()
    backend.sample_argmax_slice = 0
    backend.launch("sample", stream, **args)
    (sample,) = rt.launches
    assert not sample.args[-2] and sample.args[-1] == 0


#: Kernel pointer parameters that carry a weight: (op argument, GpuWeight field).
WEIGHT_POINTERS = {
    "data": ("weight", "data"), "sm": ("weight", "scales"), "bias": ("bias", "data"),
    "gdata": ("gate", "data"), "gsm": ("gate", "scales"), "udata": ("up", "data"),
    "usm": ("up", "scales"), "nw": ("norm", "data"),
    **{f"w{k}": (f"w{k}", "data") for k in "qkv"},
    **{f"s{k}": (f"w{k}", "scales") for k in "qkv"},
    **{f"b{k}": (f"b{k}", "data") for k in "qkv"},
}  # fmt: skip


@pytest.mark.parametrize("op", tuple(o for o in vt.OPS if o not in (*DEFERRED, "prefetch")))
def test_each_op_launches_its_kernel_with_the_arguments_in_signature_order(op: str) -> None:
    """Every op of the table but the deferred norm's two-kernel ops and the prefetch hint,
    which launches nothing itself (their own tests)."""
    backend, rt = make()
    backend.native_fused |= {op}  # the norm ops: not native by default (not yet measured)
    case = OpCase(backend)
    args, kernel, scalars = _case(case, op)
    stream = backend.create_stream()
    backend.launch(op, stream, **args)
    if op in ("attention", "attention_bounded"):  # split over positions, then combined
        launch, combine = rt.launches
        assert combine.kernel == "attention_combine" and combine.args[1] == launch.args[1] != 0
        assert karg(combine, "tile") == 0 and combine.block == (128, 1, 1)  # no tiled launch
        assert karg(combine, "min_per_split") == backend.attention_min_split
        assert karg(launch, "min_per_split") == backend.attention_min_split
        assert not karg(launch, "counts")  # no counters: attention_last_block_combine is off
    else:
        (launch,) = rt.launches
    assert launch.kernel == kernel and launch.stream == stream.handle
    weights = {name: a.handle for name, a in args.items() if isinstance(a, vt.Weight)}
    macro = kernel.startswith(MACRO_KERNELS)  # one kernel per weight format
    signature = kernel_signatures()[macro_prefix(kernel) if macro else kernel]
    assert len(launch.args) == len(signature), signature
    for (ctype, name), value, raw in zip(signature, launch.args, launch.ctypes_args, strict=True):
        if "*" in ctype and name in case.addresses:
            assert value == case.addresses[name], name
        elif "*" in ctype and name in ("data", "w", "sm") and "table" in weights:
            w: GpuWeight = weights["table"]  # embedding's table; rms_norm's weight is "w"
            assert (value or 0) == {"data": w.data, "sm": w.scales}[name], name
        elif "*" in ctype and name == "w":
            assert value == weights["weight"].data, name
        elif "*" in ctype and name == "part":  # the backend's scratch for split partials
            assert bool(value) == (op != "sample"), name  # 7 ids: one block, no parts
        elif "*" in ctype and name == "counts":  # last-block combine's counters, when on
            assert bool(value) == backend.attention_last_block_combine, name
        elif "*" in ctype and name == "count":  # the norm epilogue's count: backend scratch
            assert value, name
        elif "*" in ctype and name in WEIGHT_POINTERS:  # a weight's data, scales, a bias
            arg, attr = WEIGHT_POINTERS[name]
            want = getattr(weights[arg], attr) if arg in weights else 0
            assert (value or 0) == want, name
        elif "*" in ctype:  # an optional tensor the op was not given (matmul's residual)
            assert not value, name
        elif ctype == "RopeTable":
            assert isinstance(raw, RopeTable) and raw.inv[1] == pytest.approx(10000**-0.25)
        elif ctype == "VtPrefetch":  # op_prefetch's ranges: none without a hint
            assert isinstance(raw, VtPrefetch) and not any(raw.n), name
        else:
            assert value == pytest.approx(scalars.pop(name)), name
    assert scalars == {}  # every scalar the case expects was passed


@pytest.mark.parametrize("native", [False, True], ids=["default", "native"])
def test_the_norm_ops_fold_the_norm_into_the_gemv_only_natively_at_one_row(native: bool) -> None:
    """rms_norm_swiglu and rms_norm_qkv_rope_kv_store, with norm_fold_max_k 0: not native,
    rms_norm's launch, then the op's; native, one launch where the gemv kernels take the
    row; several rows: the two launches either way. The kernel's norm sums as rms_norm's
    block of _THREADS does (RN_THREADS in the source), which is what makes it bit-equal."""
    from vt.gpu.backend import _THREADS

    assert _THREADS == 256 and "#define RN_THREADS 256\n" in kernel_source()
    backend, rt = make()
    backend.norm_fold_max_k = 0  # native_fused alone says which path runs
    if native:
        backend.native_fused |= {"rms_norm_swiglu", "rms_norm_qkv_rope_kv_store"}
    c = OpCase(backend)
    rng = np.random.default_rng(5)
    norm = c.w("norm", np.ones(256, np.float32))
    gate, up = (c.w(n, rng.standard_normal((6, 256)).astype(np.float32), "Q8_0") for n in "gu")
    stream = backend.create_stream()
    for n in (1, 3):
        backend.launch("rms_norm_swiglu", stream, out=c.t("out", F32, n, 6),
                       x=c.t("x", F32, n, 256), norm=norm, eps=1e-5, gate=gate, up=up,
                       scratch=c.t("s", F32, n, 256), scratch_gate=c.t("sg", F32, n, 6),
                       scratch_up=c.t("su", F32, n, 6))  # fmt: skip
    one = ["swiglu_norm_gemv2_q"] if native else ["rms_norm", "swiglu_gemv2_q"]
    assert [launch.kernel for launch in rt.launches] == [*one, "rms_norm", "swiglu_small2_q"]


@pytest.mark.parametrize("native", [False, True], ids=["default", "native"])
def test_the_norm_epilogue_is_one_launch_only_natively_at_one_row(native: bool) -> None:
    """matmul_add_rms_norm: not native by default (the graph then never asks for it; asked,
    its decomposition: the projection with the residual, then rms_norm); native, one launch
    at one row (matmul_norm_gemv2_q, its count a zeroed backend scratch) and the two
    launches for several rows."""
    backend, rt = make()
    assert not backend.supports("matmul_add_rms_norm")
    if native:
        backend.native_fused |= {"matmul_add_rms_norm"}
    c = OpCase(backend)
    rng = np.random.default_rng(6)
    norm = c.w("norm", np.ones(6, np.float32))
    w = c.w("w", rng.standard_normal((6, 256)).astype(np.float32), "Q8_0")
    stream = backend.create_stream()
    for n in (1, 3):
        r = c.t("r", F32, n, 6)
        backend.launch("matmul_add_rms_norm", stream, out=r, normed=c.t("h", F32, n, 6),
                       x=c.t("x", F32, n, 256), weight=w, residual=r, norm=norm, eps=1e-5,
                       scratch=c.t("s", F32, n, 6))  # fmt: skip
    one = ["matmul_norm_gemv2_q"] if native else ["matmul_gemv2_q", "rms_norm"]
    assert [launch.kernel for launch in rt.launches] == [*one, "matmul_small4_q", "rms_norm"]
    if native:
        names = [name for _, name in kernel_signatures()[macro_prefix("matmul_norm_gemv2_q")]]
        assert rt.launches[0].args[names.index("count")]


def test_norm_fold_max_k_folds_the_norm_only_into_short_rows_at_one_row() -> None:
    """norm_fold_max_k: the norm ops become native, late-scaled (-DVT_NORM_LATE=1), and fold
    the norm into the gemv only at one row whose K is at most the setting; a longer row (the
    1B shape's 2,048 against 1,024) or more rows run rms_norm's launch and then the gemv."""
    backend, rt = make()
    norm_ops = ("rms_norm_swiglu", "rms_norm_qkv_rope_kv_store")
    assert backend.norm_fold_max_k == 1024  # the default
    backend.norm_fold_max_k, backend.norm_quantize = 0, False  # norm_quantize: native too
    assert not any(backend.supports(op) for op in norm_ops)
    backend.norm_fold_max_k = 1024
    assert all(backend.supports(op) for op in norm_ops)
    backend.norm_quantize = True  # the default: no other launches below int8 rows
    c = OpCase(backend)
    rng = np.random.default_rng(3)
    stream = backend.create_stream()
    layout = vt.KVLayout(n_layers=1, n_slots=2, max_len=8, n_kv_heads=1, head_dim=8)
    cache = c.t("cache", F32, *layout.shape)
    for k in (1024, 2048):
        norm = c.w(f"n{k}", np.ones(k, np.float32))
        gate, up, wq, wk, wv = (
            c.w(f"{name}{k}", rng.standard_normal((rows, k)).astype(np.float32), "Q8_0")
            for name, rows in (("g", 6), ("u", 6), ("q", 16), ("k", 8), ("v", 8))
        )
        for n in (1, 3):
            rt.launches.clear()
            backend.launch("rms_norm_swiglu", stream, out=c.t("out", F32, n, 6),
                           x=c.t("x", F32, n, k), norm=norm, eps=1e-5, gate=gate, up=up,
                           scratch=c.t("s", F32, n, k), scratch_gate=c.t("sg", F32, n, 6),
                           scratch_up=c.t("su", F32, n, 6))  # fmt: skip
            backend.launch(
                "rms_norm_qkv_rope_kv_store", stream, q=c.t("q", F32, n, 16),
                k=c.t("k", F32, n, 8), v=c.t("v", F32, n, 8), x=c.t("x", F32, n, k),
                norm=norm, eps=1e-5, wq=wq, wk=wk, wv=wv, positions=c.t("p", I32, n),
                slots=c.t("sl", I32, n), cache=cache, layout=layout, layer=0, n_heads=2,
                params=vt.RopeParams(8), scratch=c.t("s", F32, n, k),
            )  # fmt: skip
            kernels = [launch.kernel for launch in rt.launches]
            assert rt.compiles[0] == ("vt_rows.cu", ("-DVT_WARP=32", "-DVT_NORM_LATE=1"))
            if n == 1 and k <= 1024:
                assert kernels == ["swiglu_norm_gemv2_q", "qkv_rope_norm_gemv_q"]
            elif n == 1:
                assert kernels == ["rms_norm", "swiglu_gemv2_q", "rms_norm", "qkv_rope_gemv_q"]
            else:
                assert kernels[0] == "rms_norm" and "rms_norm" in kernels[1:], kernels
    backend.close()


@pytest.mark.parametrize("last_block", [True, False])
def test_attention_splits_positions_only_while_the_grid_is_small(last_block: bool) -> None:
    """Few rows: positions split over blocks, partials combined (by each group's last
    block, from counters zeroed once on the stream; or by a second launch), in scratch
    buffers kept until close (a captured graph may hold them). Many rows: one launch, no
    partials."""
    backend, rt = make()
    backend.attention_last_block_combine = last_block
    backend.attention_tiled_min_rows = 1 << 30  # the split kernel at every row count
    backend.attention_q8a = False  # attention's own scratch alone (the int8 hand-off's: below)
    layout = vt.KVLayout(n_layers=1, n_slots=256, n_kv_heads=2, head_dim=64, max_len=8)
    cache = vt.Tensor.of(backend.alloc(layout.nbytes), F32, *layout.shape)
    stream = backend.create_stream()
    sizes = []
    for n in (1, 2, 1, 256):
        buf = backend.alloc(n * 8 * 64 * 4)
        ints = backend.alloc(n * 4)
        rt.launches.clear()
        backend.launch(
            "attention", stream, out=vt.Tensor.of(buf, F32, n, 8 * 64),
            q=vt.Tensor.of(buf, F32, n, 8 * 64), cache=cache, slots=vt.Tensor.of(ints, I32, n),
            positions=vt.Tensor.of(ints, I32, n), layout=layout, layer=0, n_heads=8, scale=0.1,
        )  # fmt: skip
        kernels = [launch.kernel for launch in rt.launches]
        split = rt.launches[0]
        if n < 256:
            assert kernels == ["attention_split"] + ["attention_combine"] * (not last_block)
            assert split.grid == (n, 4, min(32, 64 // n))  # 2 heads a block (max_group)
            assert bool(karg(split, "counts")) == last_block  # the counters
        else:
            assert kernels == ["attention_split"] and not split.args[1]
            assert not karg(split, "counts")
        sizes.append(len(backend._scratch))
    # n=2 needs larger ones; n=1 again reuses the first (partials, and counters)
    assert sizes == ([2, 4, 4, 4] if last_block else [1, 2, 2, 2])
    if last_block:  # each new counter buffer zeroed once, on the op's stream
        zeroed = [c for c in rt.calls if c[0] == "memset"]
        assert len(zeroed) == 2 and all(c[1][1] == 0 and c[1][3] is not None for c in zeroed)
    backend.close()
    assert backend._scratch == []


@pytest.mark.parametrize(
    ("n_heads", "most", "gb"),
    [(8, 8, 4), (8, 2, 2), (8, 1, 1), (8, 3, 2), (6, 2, 1), (6, 8, 3), (8, 0, 1)],
)
def test_attention_blocks_take_at_most_max_group_query_heads(
    n_heads: int, most: int, gb: int
) -> None:
    """attention_max_group caps a split block's query heads at the largest divisor of the
    group (n_heads / n_kv_heads) up to it (at least 1): more, shorter blocks."""
    backend, rt = make()
    backend.attention_max_group = most
    layout = vt.KVLayout(n_layers=2, n_slots=4, max_len=700, n_kv_heads=2, head_dim=64)
    _attention_launch(backend, 1, n_heads, layout)
    split = rt.launches[0]
    assert karg(split, "gb") == gb and split.grid[1] == 2 * (n_heads // 2 // gb)
    backend.close()


@pytest.mark.parametrize(
    ("n", "n_heads", "most", "gb"),
    [
        (8, 6, None, 3),  # the 135M shape's groups of 3 heads: one block at batches
        (8, 8, None, 2),  # the 1B shape's groups of 4: two blocks of 2, as at one row
        (1, 6, None, 1),  # one row: attention_max_group's 2, so a head a block
        (2, 6, 1, 1),
        (8, 16, 8, 8),
    ],
)
def test_attention_blocks_at_batches_take_attention_batch_max_group_heads(
    n: int, n_heads: int, most: int | None, gb: int
) -> None:
    """At steps of more than one row a split block takes up to attention_batch_max_group
    (3) query heads: the largest divisor of the group up to it."""
    backend, rt = make()
    if most is not None:
        backend.attention_batch_max_group = most
    layout = vt.KVLayout(n_layers=2, n_slots=16, max_len=700, n_kv_heads=2, head_dim=64)
    _attention_launch(backend, n, n_heads, layout)
    split = rt.launches[0]
    assert karg(split, "gb") == gb and split.grid[:2] == (n, 2 * (n_heads // 2 // gb))
    backend.close()


@pytest.mark.parametrize(
    ("arch", "n", "tiled", "want"),
    [
        ("sm_90", 1, False, ["attention_split_cluster"]),
        ("sm_90", 3, False, ["attention_split_cluster"]),
        ("sm_90", 256, False, ["attention_split"]),  # a full grid: no splits to combine
        ("sm_90", 64, True, ["attention_tiled_h64r16", "attention_split", "attention_combine"]),
        ("sm_80", 1, False, ["attention_split", "attention_combine"]),  # no clusters there
        ("gfx90a", 1, False, ["attention_split", "attention_combine"]),  # nor on HIP
    ],
)
def test_attention_cluster_combines_in_the_split_launch_where_the_device_has_clusters(
    arch: str, n: int, tiled: bool, want: list[str]
) -> None:
    """attention_cluster: at decode on sm_90 and later, attention_split_cluster alone, its
    grid's z the cluster's 8 splits (FA_CLUSTER), with attention_split's arguments in the
    same order and no counters; prefill steps (tiled rows), a grid with no splits, an older
    or another vendor's device: the kernels as without it."""
    from vt.gpu.backend import _FA_CLUSTER

    assert f"#define FA_CLUSTER {_FA_CLUSTER} " in kernel_source()
    sigs = kernel_signatures()
    assert sigs["attention_split_cluster"] == sigs["attention_split"]
    backend, rt = make()
    rt.arch = lambda: arch  # type: ignore[method-assign]
    backend.attention_cluster = True
    backend.attention_max_group = 8  # the 4 heads of a group in one block: these grids
    backend.attention_batch_max_group = 8
    backend.attention_tiled_min_rows = 64 if tiled else 1 << 30
    layout = vt.KVLayout(n_layers=2, n_slots=4, max_len=700, n_kv_heads=2, head_dim=64)
    _attention_launch(backend, n, 8, layout)
    assert [launch.kernel for launch in rt.launches] == want
    split = next(la for la in rt.launches if la.kernel.startswith("attention_split"))
    if want == ["attention_split_cluster"]:
        assert split.grid == (n, 2, _FA_CLUSTER) and karg(split, "splits") == _FA_CLUSTER
        assert karg(split, "part") and not karg(split, "counts") and not karg(split, "tile")
    backend.close()


def _attention_launch(
    backend: FakeGpu, n: int, n_heads: int, layout: vt.KVLayout
) -> tuple[dict[str, int], vt.Stream]:
    """One attention op of ``n`` rows, each tensor in a buffer of its own (its address
    returned by name), on a new stream."""
    bufs = {name: backend.alloc(max(4, nbytes)) for name, nbytes in (
        ("out", n * n_heads * layout.head_dim * 4), ("q", n * n_heads * layout.head_dim * 4),
        ("cache", layout.nbytes), ("slots", n * 4), ("positions", n * 4),
    )}  # fmt: skip
    stream = backend.create_stream()
    backend.launch(
        "attention", stream, out=vt.Tensor.of(bufs["out"], F32, n, n_heads * layout.head_dim),
        q=vt.Tensor.of(bufs["q"], F32, n, n_heads * layout.head_dim),
        cache=vt.Tensor.of(bufs["cache"], F32, *layout.shape),
        slots=vt.Tensor.of(bufs["slots"], I32, n),
        positions=vt.Tensor.of(bufs["positions"], I32, n), layout=layout, layer=1,
        n_heads=n_heads, scale=0.25,
    )  # fmt: skip
    return {name: int(b.handle) for name, b in bufs.items()}, stream


def test_attention_of_many_rows_runs_the_tiled_kernel_with_its_arguments_in_order() -> None:
    """From ``attention_tiled_min_rows`` rows: a tiled kernel, a block per (tile of rows,
    query head), then the split kernel told the tile size (it takes the rows of the tiles
    the tiled kernel leaves: many sequences); below it the split kernel alone, as before."""
    backend, rt = make()
    backend.attention_max_group = 8  # the 4 heads of a group in one block: these grids
    backend.attention_batch_max_group = 8
    layout = vt.KVLayout(n_layers=3, n_slots=5, max_len=700, n_kv_heads=2, head_dim=64)
    for n, kernel in ((63, "attention_split"), (64, "attention_tiled_h64r16")):
        rt.launches.clear()
        addresses, stream = _attention_launch(backend, n, 8, layout)
        assert rt.launches[0].kernel == kernel
    launch, split, combine = rt.launches
    assert launch.grid == (4, 8, 1) and launch.block == (128, 1, 1)
    assert launch.stream == split.stream == combine.stream == stream.handle
    assert split.kernel == "attention_split" and split.grid == (64, 2, 2)
    assert split.args[0] == addresses["out"] and karg(split, "tile") == karg(combine, "tile") == 16
    signature = kernel_signatures()["attention_tiled"]
    scalars = {"n": 64, "n_heads": 8, "n_kv": 2, "head_dim": 64, "n_slots": 5, "n_layers": 3,
               "max_len": 700, "layer": 1, "scale": 0.25}  # fmt: skip
    assert len(launch.args) == len(signature)
    for (ctype, name), value in zip(signature, launch.args, strict=True):
        if "*" in ctype:
            assert value == addresses[name], name
        else:
            assert value == pytest.approx(scalars.pop(name)), name
    assert scalars == {}
    backend.attention_tiled_min_rows = 65  # the threshold is the backend's setting
    rt.launches.clear()
    _attention_launch(backend, 64, 8, layout)
    assert rt.launches[0].kernel == "attention_split"


@pytest.mark.parametrize(
    ("n", "n_heads", "head_dim", "kernel", "tiles"),
    [
        (512, 32, 64, "h64r64", 8),  # the 1B shape, one chunk: 256 blocks of 64 rows
        (256, 32, 64, "h64r32", 8),  # a chunk of 256: 32-row tiles fill 256 blocks
        (512, 9, 64, "h64r16", 32),  # the 135M shape: its 9 heads need 16-row tiles
        (100, 4, 64, "h64r16", 7),  # too few blocks at any size: the smallest tiles
        (2000, 16, 128, "h128r32", 63),
        (512, 8, 80, "h128r16", 32),  # head_dim 80 on the 128 kernel (zero padded)
        (300, 40, 65, "h128r32", 10),
        (64, 2, 256, "h256r16", 4),
        (64, 2, 129, "h256r16", 4),
    ],
)
def test_the_tiled_attention_kernel_by_head_dim_and_grid(
    n: int, n_heads: int, head_dim: int, kernel: str, tiles: int
) -> None:
    backend, rt = make()
    layout = vt.KVLayout(n_layers=2, n_slots=2, max_len=4, n_kv_heads=1, head_dim=head_dim)
    _attention_launch(backend, n, n_heads, layout)
    launch, split, *combine = rt.launches
    assert launch.kernel == f"attention_tiled_{kernel}"
    assert launch.grid == (tiles, n_heads, 1)
    assert split.kernel == "attention_split" and karg(split, "tile") == int(kernel[-2:])
    assert [c.kernel for c in combine] in ([], ["attention_combine"])
    if combine:
        assert karg(combine[0], "tile") == karg(split, "tile")


def test_every_tiled_attention_kernel_is_instantiated_within_static_shared_memory() -> None:
    """The backend's table of tiled kernels is what kernels/attention_tiled.cu instantiates,
    and each one's shared memory (q tile, one K/V tile, P tile, row info) stays under the
    48 KiB a kernel may declare statically on every CUDA and HIP part."""
    source = kernel_source()
    made = re.findall(r"\nVT_ATTENTION_TILED\(h(\d+)r(\d+), (\d+), (\d+), (\d+)\)", source)
    assert made, "no VT_ATTENTION_TILED instantiation found"
    table = {(int(d), int(r)) for d, rs in TILED_ROWS.items() for r in rs}
    assert {(int(d), int(r)) for d, r, *_ in made} == table
    for d, r, dmax, rm, bn in made:
        dmax_, rm_, bn_ = int(dmax), int(rm), int(bn)
        assert int(d) == dmax_ and int(r) == 16 * rm_ and bn_ % 8 == 0
        shared = (16 * rm_ * (dmax_ + 4) + bn_ * (dmax_ + 4) + 16 * rm_ * (bn_ + 4)) * 4
        assert shared + 2 * 16 * rm_ * 4 + 16 <= 48 * 1024, (d, r)


@pytest.mark.parametrize("wtype", ["F32", "Q4_1"])
def test_many_rows_go_to_the_vendor_blas_over_a_float32_copy_of_the_weight(wtype: str) -> None:
    backend, rt = make(blas="fake BLAS")  # a small weight: TF32 under blas_inputs="auto"
    values = np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32)
    weight = backend.upload_weight(weight_tensor("w", values, wtype))
    bias = backend.upload_weight(weight_tensor("b", np.ones(40, np.float32), "F32"))
    w: GpuWeight = weight.handle
    stream = backend.create_stream()
    n = backend.blas_min_rows
    x = vt.Tensor.of(backend.alloc(n * 64 * 4), F32, n, 64)
    out = vt.Tensor.of(backend.alloc(n * 40 * 4), F32, n, 40)
    res = vt.Tensor.of(backend.alloc(n * 40 * 4), F32, n, 40)
    xp, op, rp = (t.buffer.handle + t.buffer.offset for t in (x, out, res))
    rt.launches.clear()
    backend.launch("matmul", stream, out=out, x=x, weight=weight, bias=bias)
    kernels = [launch.kernel for launch in rt.launches]
    gemm = rt.launches[kernels.index("gemm")].args
    if wtype == "F32":  # the weight as it is
        assert kernels == ["gemm", "bias_add"] and gemm == [n, 40, 64, xp, w.data, op, False]
    else:  # dequantized into scratch first (16 codes a thread), on the same stream
        assert kernels == ["dequantize16_q", "gemm", "bias_add"]
        scratch = rt.launches[0].args[0]
        assert gemm == [n, 40, 64, xp, scratch, op, False] and scratch != w.data
        assert rt.launches[0].args[-1] == 40 * 64 and rt.launches[0].grid == (1, 1, 1)
    # the residual is the accumulator: in place, or copied into out first
    rt.launches.clear()
    rt.calls.clear()
    backend.launch("matmul_add", stream, out=out, x=x, weight=weight, residual=out, scratch=res)
    assert rt.launches[-1].args[-1] is True and "memcpy_d2d" not in rt.names()
    backend.launch("matmul_add", stream, out=out, x=x, weight=weight, residual=res, scratch=res)
    assert rt.args("memcpy_d2d")[0][:3] == (op, rp, n * 40 * 4)
    # one row fewer: the backend's own decode kernel
    rt.launches.clear()
    small = vt.Tensor.of(x.buffer, F32, n - 1, 64)
    backend.launch("matmul", stream, out=vt.Tensor.of(out.buffer, F32, n - 1, 40), x=small,
                   weight=weight)  # fmt: skip
    assert [launch.kernel for launch in rt.launches] == [f"matmul_small4_{w.suffix}"]
    backend.close()


@pytest.mark.parametrize("inputs", ["tf32", "f16"])
def test_the_blas_path_keeps_its_weight_copies_within_a_fraction_of_the_memory(
    inputs: str,
) -> None:
    """With device_memory() known, the dequantized copy a matmul makes is kept for the next
    matmuls of that weight (one launch fewer each), while the kept copies fit
    blas_keep_fraction of it; a weight past that makes its copy in scratch every time;
    freeing a weight, or closing, frees its kept copy."""
    backend, rt = make(blas="fake BLAS", memory=1 << 40)  # free memory no limit here
    backend.blas_inputs, backend.blas_keep_fraction = inputs, 0.125
    per = 40 * 64 * (2 if inputs == "f16" else 4)  # the copy's bytes
    backend.device_memory = lambda: 8 * int(1.5 * per)  # type: ignore[method-assign]
    values = np.random.default_rng(2).standard_normal((40, 64)).astype(np.float32)
    weights = [backend.upload_weight(weight_tensor(f"w{i}", values, "Q8_0")) for i in range(2)]
    stream = backend.create_stream()
    n = backend.blas_min_rows
    x = vt.Tensor.of(backend.alloc(n * 64 * 4), F32, n, 64)
    out = vt.Tensor.of(backend.alloc(n * 40 * 4), F32, n, 40)
    copy = "dequantize16_h_q" if inputs == "f16" else "dequantize16_q"

    def copies(weight: Any) -> list[Any]:
        rt.launches.clear()
        backend.launch("matmul", stream, out=out, x=x, weight=weight)
        gemm = next(launch for launch in rt.launches if launch.kernel == "gemm")
        made = [launch.args[0] for launch in rt.launches if launch.kernel == copy]
        return [*made, gemm.args[4]]

    first = copies(weights[0])  # made and kept: 1 of 1.5 copies' room
    assert len(first) == 2 and first[0] == first[1]
    assert copies(weights[0]) == [first[0]]  # no copy launched: the kept one read
    assert len(copies(weights[1])) == 2 and len(copies(weights[1])) == 2  # no room: scratch
    malloc, free = len(rt.args("malloc")), len(rt.args("free"))
    backend.free_weight(weights[0])
    assert len(rt.args("free")) == free + 2  # the weight and its kept copy
    kept = copies(weights[1])  # room again: made and kept
    assert len(kept) == 2 and copies(weights[1]) == [kept[0]]
    assert len(rt.args("malloc")) == malloc + 1
    backend.close()
    assert len(rt.args("free")) >= free + 3


KEEP_K, KEEP_M = 64, 40
KEEP_COPY = KEEP_M * KEEP_K * 4  # a Q8_0 weight's float32 copy (blas_inputs "auto": TF32)


def keeping_backend(memory: int | None, floor: int = 0, fraction: float = 0.0) -> Any:
    """A backend whose BLAS path may keep copies (blas_keep_fraction 0.5 of a known
    device_memory, so only free memory limits them), on a fake of ``memory`` bytes; the
    margin's floor is ``floor`` bytes or ``fraction`` of the device; two Q8_0 weights, x
    and out of a 64-row matmul, and ``run(weight)``: the kernels one matmul launched and the
    address its GEMM read the weight from."""
    backend, rt = make(blas="fake BLAS", memory=memory)
    backend.blas_keep_fraction = 0.5
    backend.blas_keep_min_free_bytes = floor
    backend.blas_keep_min_free_fraction = fraction
    backend.device_memory = lambda: memory or 1 << 40  # type: ignore[method-assign]
    values = np.random.default_rng(3).standard_normal((KEEP_M, KEEP_K)).astype(np.float32)
    weights = [backend.upload_weight(weight_tensor(f"w{i}", values, "Q8_0")) for i in range(2)]
    stream = backend.create_stream()
    n = backend.blas_min_rows
    x = vt.Tensor.of(backend.alloc(n * KEEP_K * 4), F32, n, KEEP_K)
    out = vt.Tensor.of(backend.alloc(n * KEEP_M * 4), F32, n, KEEP_M)

    def run(weight: Any) -> tuple[list[str], int]:
        rt.launches.clear()
        backend.launch("matmul", stream, out=out, x=x, weight=weight)
        gemm = next(launch for launch in rt.launches if launch.kernel == "gemm")
        return [launch.kernel for launch in rt.launches], gemm.args[4]

    return backend, rt, weights, run


def test_blas_copies_are_kept_while_free_memory_keeps_its_margin() -> None:
    """Free memory after a kept copy must still hold the margin (here 1 MiB) and one more
    copy of that size for scratch: on a device with room for one such copy and not two,
    the first weight's copy is kept and read again, the second's is made in scratch every
    time; freeing the first weight (and its copy) makes room for the second's."""
    base, _, _, _ = keeping_backend(1 << 40)
    used = base.runtime.used  # what the weights, x and out take
    base.close()
    margin = 1 << 20
    # room for one kept copy: copy + margin + a scratch copy, and less than two of them
    memory = used + margin + 2 * KEEP_COPY + KEEP_COPY // 2
    backend, rt, weights, run = keeping_backend(memory, floor=margin)
    kernels, first = run(weights[0])
    assert kernels == ["dequantize16_q", "gemm"] and backend._kept_bytes == KEEP_COPY
    assert run(weights[0]) == (["gemm"], first)  # the kept copy read again
    asked = len(rt.args("memory_info"))
    kernels, second = run(weights[1])  # refused: free memory short of copy + margin
    assert kernels == ["dequantize16_q", "gemm"] and second != first
    assert run(weights[1]) == (["dequantize16_q", "gemm"], second)  # scratch every time
    assert backend._kept_bytes == KEEP_COPY and rt.used <= memory
    assert len(rt.args("memory_info")) == asked + 1  # a refusal holds: asked once
    backend.free_weight(weights[0])  # its copy goes with it: room again
    kernels, kept = run(weights[1])
    assert kernels == ["dequantize16_q", "gemm"] and run(weights[1]) == (["gemm"], kept)
    assert backend._kept_bytes == KEEP_COPY
    before = rt.used
    backend.close()  # frees the kept copy and scratch
    assert rt.used == before - KEEP_COPY - KEEP_COPY


def no_pointers(launch: Any) -> tuple[Any, ...]:
    """A BLAS-path launch without its addresses: the kernel, grid and other arguments."""
    args = launch.args[:3] + launch.args[6:] if launch.kernel == "gemm" else launch.args[3:]
    return launch.kernel, launch.grid, args


@pytest.mark.parametrize("short", ["floor", "fraction", "kv growth", "unknown"])
def test_blas_copies_are_not_kept_when_free_memory_is_short(short: str) -> None:
    """None kept when free memory minus the copy would fall under the margin: its floor in
    bytes, its fraction of the device, or what a VMM reservation (a KV cache) has yet to
    map; nor on a runtime that cannot say its free memory. The matmuls then launch exactly
    what blas_keep_fraction = 0 launches (a copy in scratch each time: the same numerics)."""
    memory = 64 << 20
    if short == "floor":
        backend, rt, weights, run = keeping_backend(memory, floor=memory)
    elif short == "fraction":
        backend, rt, weights, run = keeping_backend(memory, fraction=1.0)
    elif short == "unknown":
        backend, rt, weights, run = keeping_backend(None)
    else:
        backend, rt, weights, run = keeping_backend(memory)
        arena = VmmArena.reserve(backend, memory, min_growth=GRANULARITY)
        arena.ensure(GRANULARITY)  # all but one granule still to map
    reference, ref_rt, ref_weights, ref_run = keeping_backend(memory)
    reference.blas_keep_fraction = 0.0  # the path before kept copies
    for _ in range(2):
        for w, ref in zip(weights, ref_weights, strict=True):
            (kernels, _), (ref_kernels, _) = run(w), ref_run(ref)
            assert kernels == ref_kernels == ["dequantize16_q", "gemm"]
            assert [no_pointers(launch) for launch in rt.launches] == [
                no_pointers(launch) for launch in ref_rt.launches
            ]
    assert backend._kept_bytes == 0 and not backend._kept
    if short == "kv growth":
        arena.release()
        backend.free_weight(weights[0])  # frees memory: asks again, and now there is room
        assert run(weights[1])[0] == ["dequantize16_q", "gemm"] and backend._kept_bytes > 0
        assert run(weights[1])[0] == ["gemm"]
    backend.close()
    reference.close()


def test_keeping_a_blas_copy_never_runs_out_of_memory() -> None:
    """memory_info said there was room, but the copy's allocation runs out of memory (another
    process took it meanwhile): the copy goes to scratch, the matmul runs, no error, and no
    copy is kept after; any other failure of that allocation is raised."""
    memory = 64 << 20
    backend, rt, weights, run = keeping_backend(memory)
    backend.blas_keep_fraction = 0.0
    _, scratch = run(weights[0])  # scratch holds a copy's room already
    backend.blas_keep_fraction = 0.5
    rt.used = memory - KEEP_COPY // 2  # someone else took nearly all of it ...
    rt.memory_info = lambda: (memory, memory)  # type: ignore[method-assign]  # ... unseen
    for w in weights:
        assert run(w) == (["dequantize16_q", "gemm"], scratch)
    assert not backend._kept and rt.used == memory - KEEP_COPY // 2
    backend.free_weight(weights[0])  # room may be asked for again: another error is raised
    rt.used = 0
    rt.fail["malloc"] = 700
    with pytest.raises(GpuCallError, match="FAKE_ERROR_700"):
        run(weights[1])
    backend.close()


@pytest.mark.parametrize(
    ("name", "oom"),
    [
        ("CUDA_ERROR_OUT_OF_MEMORY", True),
        ("hipErrorOutOfMemory", True),
        ("hipErrorMemoryAllocation", True),  # hipErrorOutOfMemory's older name (2)
        ("CUDA_ERROR_INVALID_VALUE", False),
        ("hipErrorInvalidValue", False),
    ],
)
def test_which_errors_of_a_kept_copy_fall_back_to_scratch(name: str, oom: bool) -> None:
    assert _out_of_memory(GpuCallError("cuMemAlloc(1)", 2, name, "text")) is oom


@pytest.mark.parametrize("wtype", ["F32", "F16", "Q8_0"])
def test_the_blas_path_with_half_inputs(wtype: str) -> None:
    """blas_inputs="f16": x (and a weight that is neither F32 nor F16) converted to half in
    scratch; an F16 weight goes in as it is; an F32 weight stays on float32 (TF32)."""
    backend, rt = make(blas="fake BLAS")
    backend.blas_inputs = "f16"
    values = np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32)
    weight = backend.upload_weight(weight_tensor("w", values, wtype))
    w: GpuWeight = weight.handle
    stream = backend.create_stream()
    n = backend.blas_min_rows
    x = vt.Tensor.of(backend.alloc(n * 64 * 4), F32, n, 64)
    out = vt.Tensor.of(backend.alloc(n * 40 * 4), F32, n, 40)
    xp, op = (t.buffer.handle + t.buffer.offset for t in (x, out))
    rt.launches.clear()
    backend.launch("matmul", stream, out=out, x=x, weight=weight)
    kernels = [launch.kernel for launch in rt.launches]
    gemm = rt.launches[-1].args
    if wtype == "F32":
        assert kernels == ["gemm"] and gemm == [n, 40, 64, xp, w.data, op, False]
        return
    half_x = rt.launches[kernels.index("to_half8")].args  # 8 values a thread
    assert half_x[1:] == [xp, n * 64] and half_x[0] != xp
    if wtype == "F16":
        assert kernels == ["to_half8", "gemm"]
        assert gemm == [n, 40, 64, half_x[0], w.data, op, False, "f16"]
    else:
        assert kernels == ["dequantize16_h_q", "to_half8", "gemm"]
        half_w = rt.launches[0].args
        assert half_w[-1] == 40 * 64 and gemm == [n, 40, 64, half_x[0], half_w[0], op, False, "f16"]
    backend.close()


@pytest.mark.parametrize(
    ("inputs", "rows", "want"),
    [
        ("auto", 1 << 11, "dequantize16_h_q"),  # 1 << 17 values: half inputs
        ("auto", (1 << 11) - 1, "dequantize16_q"),  # one row fewer: TF32
        ("tf32", 1 << 14, "dequantize16_q"),
        ("f16", 40, "dequantize16_h_q"),
    ],
)
def test_half_inputs_by_the_weights_size(inputs: str, rows: int, want: str) -> None:
    """The default, blas_inputs="auto": half inputs for weights of blas_f16_min_values
    (128K) values or more (the 1B shape's, the 135M shape's but k and v), TF32 for smaller
    ones (the tiny test models': at most 77K values)."""
    backend, rt = make(blas="fake BLAS")
    assert backend.blas_inputs == "auto" and backend.blas_f16_min_values == 1 << 17
    backend.blas_inputs = inputs
    values = np.ones((rows, 64), np.float32)
    weight = backend.upload_weight(weight_tensor("w", values, "Q8_0"))
    n = backend.blas_min_rows
    x = vt.Tensor.of(backend.alloc(n * 64 * 4), F32, n, 64)
    out = vt.Tensor.of(backend.alloc(n * rows * 4), F32, n, rows)
    rt.launches.clear()
    backend.launch("matmul", backend.create_stream(), out=out, x=x, weight=weight)
    kernels = [launch.kernel for launch in rt.launches]
    half = want == "dequantize16_h_q"
    assert kernels == ([want, "to_half8", "gemm"] if half else [want, "gemm"])
    assert rt.launches[-1].args[7:] == (["f16"] if half else [])
    backend.close()


def test_auto_inputs_stay_on_float32_where_the_runtime_has_no_half_gemm() -> None:
    """vt_rocm's hipBLAS path refuses half inputs (NotImplementedError, before enqueuing
    anything): "auto" then redoes the matmul on float32 copies and stays there; "f16" asked
    for by name raises."""
    backend, rt = make(blas="fake BLAS")
    gemm = rt.gemm

    def float32_only(*args: Any, inputs: str = "f32") -> None:
        if inputs != "f32":
            raise NotImplementedError(f"takes float32 inputs, not {inputs}")
        gemm(*args)

    rt.gemm = float32_only  # type: ignore[method-assign]
    weight = backend.upload_weight(weight_tensor("w", np.ones((1 << 14, 64), np.float32), "Q8_0"))
    n = backend.blas_min_rows
    x = vt.Tensor.of(backend.alloc(n * 64 * 4), F32, n, 64)
    out = vt.Tensor.of(backend.alloc(n * (1 << 14) * 4), F32, n, 1 << 14)
    stream = backend.create_stream()
    for want in (["dequantize16_h_q", "to_half8", "dequantize16_q", "gemm"],
                 ["dequantize16_q", "gemm"]):  # fmt: skip
        rt.launches.clear()
        backend.launch("matmul", stream, out=out, x=x, weight=weight)
        assert [launch.kernel for launch in rt.launches] == want
    assert not backend._blas_half_ok and type(backend)._blas_half_ok  # this backend only
    backend.blas_inputs = "f16"
    with pytest.raises(NotImplementedError, match="float32 inputs"):
        backend.launch("matmul", stream, out=out, x=x, weight=weight)


@pytest.mark.parametrize("inputs", ["tf32", "f16"])
def test_the_blas_copies_fall_back_to_a_value_a_thread(inputs: str) -> None:
    """The 16-values-a-thread copies (blas_copies.cu) need quantized codes and 16-byte
    alignment; a BF16 weight, or x at an odd offset, takes the one-value kernels."""
    source = kernel_source()
    for name in ("dequantize16_q", "dequantize16_h_q", "to_half8"):
        assert name in kernel_signatures() and f"void {name}(" in source
    backend, rt = make(blas="fake BLAS")
    backend.blas_inputs = inputs
    values = np.random.default_rng(3).standard_normal((40, 64)).astype(np.float32)
    weight = backend.upload_weight(weight_tensor("w", values, "BF16"))
    n = backend.blas_min_rows
    buf = backend.alloc(n * 64 * 4 + 4)
    x = vt.Tensor.of(vt.Buffer(buf.handle, buf.nbytes - 4, owner=buf.owner, offset=4), F32, n, 64)
    out = vt.Tensor.of(backend.alloc(n * 40 * 4), F32, n, 40)
    rt.launches.clear()
    backend.launch("matmul", stream=backend.create_stream(), out=out, x=x, weight=weight)
    kernels = [launch.kernel for launch in rt.launches]
    if inputs == "f16":
        assert kernels == ["dequantize_h_bf16", "to_half", "gemm"]
        assert rt.launches[1].grid == (n * 64 // 256, 1, 1)
    else:
        assert kernels == ["dequantize_bf16", "gemm"]
    assert rt.launches[0].grid == (40 * 64 // 256, 1, 1)
    # a quantized weight with the wide copies turned off (a tool's "before")
    backend.blas_wide_copies = False
    q8 = backend.upload_weight(weight_tensor("q", values, "Q8_0"))
    rt.launches.clear()
    backend.launch("matmul", stream=backend.create_stream(), out=out, x=x, weight=q8)
    want = ["dequantize_h_q", "to_half", "gemm"] if inputs == "f16" else ["dequantize_q", "gemm"]
    assert [launch.kernel for launch in rt.launches] == want


def test_int8_activations_for_steps_of_8_rows_and_large_weights() -> None:
    """From int8_min_rows (8) rows, x is packed into int8 rows in scratch once per op
    (quantize_rows) and the q8a decode kernels read it; fewer rows, float weights or a width
    that is not a multiple of 32 keep float32 activations (the size rule: next test)."""
    source, signatures = kernel_source(), kernel_signatures()
    assert "quantize_rows" in signatures
    assert "VT_DECODE_MM(q8a, WT_Q8A, 4)" in source and "VT_DECODE_SW(q8a, WT_Q8A, 2)" in source
    backend, rt = make()
    assert backend.int8_min_rows == 8
    backend.int8_min_values = 0  # these weights are small: take int8 regardless
    rng = np.random.default_rng(2)
    weights = {t: backend.upload_weight(weight_tensor("w", rng.standard_normal((40, 64)).astype(
        np.float32), t)) for t in ("Q8_0", "F16")}  # fmt: skip
    stream = backend.create_stream()

    def kernels(n: int, wtype: str, op: str = "matmul") -> list[Any]:
        x = vt.Tensor.of(backend.alloc(n * 64 * 4), F32, n, 64)
        outs = [vt.Tensor.of(backend.alloc(n * 40 * 4), F32, n, 40) for _ in range(3)]
        rt.launches.clear()
        w = weights[wtype]
        if op == "matmul":
            backend.launch("matmul", stream, out=outs[0], x=x, weight=w)
        elif op == "swiglu":
            backend.launch("swiglu", stream, out=outs[0], x=x, gate=w, up=w,
                           scratch_gate=outs[1], scratch_up=outs[2])  # fmt: skip
        else:
            backend.launch("qkv", stream, q=outs[0], k=outs[1], v=outs[2], x=x, wq=w, wk=w, wv=w)
        xp = x.buffer.handle + x.buffer.offset
        return [(launch.kernel, launch.args[1] == xp) for launch in rt.launches]

    stride = (64 + 8 + 16 + 15) // 16 * 16
    assert kernels(8, "Q8_0") == [("quantize_rows", True), ("matmul_small4_q8a", False)]
    # the packed rows' scratch, then (dx, sum) pairs per 16 values for 64 rows (the mma's)
    assert rt.args("malloc")[-1] == (8 * stride + 64 // 16 * 64 * 8,)
    quantize = rt.launches[0] if rt.launches[0].kernel == "quantize_rows" else None
    assert quantize is not None and quantize.grid == (1, 8, 1)  # 256 values a block, a row
    assert kernels(7, "Q8_0") == [("matmul_small4_q", True)]
    assert kernels(8, "F16") == [("matmul_small4_f16", True)]
    assert kernels(16, "Q8_0", "swiglu")[1] == ("swiglu_small2_q8a", False)
    (quantize, _), (qkv, _) = kernels(16, "Q8_0", "qkv")
    assert (quantize, qkv) == ("quantize_rows", "qkv_small4_q8a")
    backend.close()


@pytest.mark.parametrize(
    ("op", "big_rows", "n", "int8"),
    [
        ("matmul", 1 << 12, 8, True),  # 1 << 18 values, 8 rows: int8
        ("matmul", 1 << 12, 7, False),  # 7 rows: float32
        ("matmul", (1 << 12) - 1, 32, False),  # one row under 256K values: float32
        ("qkv", 1 << 12, 8, True),  # wq of 256K values, wk and wv small: the largest counts
        ("qkv", (1 << 12) - 1, 63, False),
        ("swiglu", 1 << 12, 16, True),
        ("swiglu", (1 << 12) - 1, 16, False),
    ],
)
def test_int8_activations_by_the_weights_size(op: str, big_rows: int, n: int, int8: bool) -> None:
    """The default: int8 activations for steps of 8+ rows only where the op's largest weight
    has int8_min_values (256K) values or more (every projection of the 135M and 1B shapes),
    as half inputs to the BLAS path go by blas_f16_min_values; smaller weights (the tiny
    test models', at most 77K values, whose prompts of 8-63 tokens would otherwise change
    their greedy ids against cpu's) keep float32."""
    backend, rt = make()
    assert backend.int8_min_rows == 8 and backend.int8_min_values == 1 << 18
    big = backend.upload_weight(weight_tensor("w", np.ones((big_rows, 64), np.float32), "Q8_0"))
    small = backend.upload_weight(weight_tensor("s", np.ones((40, 64), np.float32), "Q8_0"))
    stream = backend.create_stream()
    x = vt.Tensor.of(backend.alloc(n * 64 * 4), F32, n, 64)

    def out(features: int) -> vt.Tensor:
        return vt.Tensor.of(backend.alloc(n * features * 4), F32, n, features)

    rt.launches.clear()
    if op == "matmul":
        backend.launch("matmul", stream, out=out(big_rows), x=x, weight=big)
    elif op == "qkv":
        backend.launch("qkv", stream, q=out(big_rows), k=out(40), v=out(40), x=x, wq=big,
                       wk=small, wv=small)  # fmt: skip
    else:
        backend.launch("swiglu", stream, out=out(big_rows), x=x, gate=big, up=big,
                       scratch_gate=out(big_rows), scratch_up=out(big_rows))  # fmt: skip
    kernels = [launch.kernel for launch in rt.launches]
    assert (kernels[0] == "quantize_rows") == int8, kernels
    assert kernels[-1].endswith("_q8a") == int8, kernels
    backend.close()


@pytest.mark.parametrize("blas", [False, True])
@pytest.mark.parametrize("first", [None, True, False])
@pytest.mark.parametrize("op", ["matmul", "swiglu", "qkv", "rms_norm_swiglu"])
def test_int8_steps_of_64_rows_stay_on_the_mma_kernels_without_a_blas(
    blas: bool, first: bool | None, op: str
) -> None:
    """int8_mma_first: a step of 64 rows (a decode batch of 33-64, its bucket) that int8
    activations apply to takes the mma kernels' 8 tiles where the BLAS or tiled path would
    take it: by default (None) only without a BLAS (the tiled kernel ran the 1B shape's
    batch 64 at 1,108 tok/s, run 146), True with one too, False never. 65 rows, and
    weights too small for int8, keep the BLAS or tiled path."""
    backend, rt = make(blas="fake BLAS") if blas else make()
    assert backend.int8_mma_first is None
    backend.int8_mma, backend.int8_mma_first = True, first
    rng = np.random.default_rng(3)
    big = backend.upload_weight(
        weight_tensor("w", rng.standard_normal((1 << 12, 64)).astype(np.float32), "Q8_0")
    )  # 256K values: int8 applies
    small = backend.upload_weight(weight_tensor("s", np.ones((32, 64), np.float32), "Q8_0"))
    norm = backend.upload_weight(weight_tensor("n", np.ones(64, np.float32), "F32"))
    stream = backend.create_stream()

    def kernels(n: int, w: vt.Weight) -> list[str]:
        rows = w.handle.rows
        x = vt.Tensor.of(backend.alloc(n * 64 * 4), F32, n, 64)
        outs = [vt.Tensor.of(backend.alloc(n * rows * 4), F32, n, rows) for _ in range(3)]
        rt.launches.clear()
        if op == "matmul":
            backend.launch("matmul", stream, out=outs[0], x=x, weight=w)
        elif op == "swiglu":
            backend.launch("swiglu", stream, out=outs[0], x=x, gate=w, up=w,
                           scratch_gate=outs[1], scratch_up=outs[2])  # fmt: skip
        elif op == "qkv":
            backend.launch("qkv", stream, q=outs[0], k=outs[1], v=outs[2], x=x, wq=w, wk=w,
                           wv=w)  # fmt: skip
        else:
            normed = vt.Tensor.of(backend.alloc(n * 64 * 4), F32, n, 64)
            backend.launch("rms_norm_swiglu", stream, out=outs[0], x=x, norm=norm, eps=1e-5,
                           gate=w, up=w, scratch=normed, scratch_gate=outs[1],
                           scratch_up=outs[2])  # fmt: skip
        return [launch.kernel for launch in rt.launches]

    mma = first is True or (first is None and not blas)
    got = kernels(64, big)
    if mma:
        quantize = "quantize_norm_rows" if op == "rms_norm_swiglu" else "quantize_rows"
        fused = {"matmul": "matmul", "rms_norm_swiglu": "swiglu"}.get(op, op)
        assert got == [quantize, f"{fused}_mma8_q8a"], got
    else:
        assert not any(k.endswith("_q8a") for k in got), got
        assert ("gemm" in got) == blas and ("matmul_tiled_q" in got) == (not blas), got
    for n, w in ((65, big), (64, small)):  # past the mma kernels' rows; float32 activations
        got = kernels(n, w)
        assert not any(k.endswith("_q8a") for k in got), (n, got)
        assert ("gemm" in got) == blas and ("matmul_tiled_q" in got) == (not blas), (n, got)
    backend.close()


def test_matmul_picks_the_tiled_kernel_for_many_rows() -> None:
    backend, rt = make()
    weight = backend.upload_weight(weight_tensor("w", np.ones((37, 96), np.float32), "Q4_1"))
    stream = backend.create_stream()
    x = vt.Tensor.of(backend.alloc(5 * 96 * 4), F32, 5, 96)
    out = vt.Tensor.of(backend.alloc(5 * 37 * 4), F32, 5, 37)
    backend.launch("matmul", stream, out=out, x=x, weight=weight)
    backend.launch("matmul", stream, out=out.rows(1), x=x.rows(1), weight=weight)
    backend.tiled_min_rows = 4
    backend.launch("matmul", stream, out=out, x=x, weight=weight)
    small5, small1, tiled = rt.launches
    h = weight.handle
    assert small5.args == [out.buffer.handle, x.buffer.handle, h.data, h.scales, lg("Q4_1"), None,
                           None, 5, 37, 96, 8]  # fmt: skip
    # 5 rows: 4 features per warp, 8 warps per block: ceil(37 / 32) blocks, each with every
    # row; 1 row: the gemv kernel, 2 features a block of 64 threads (K <= 1024), no n
    assert (small5.kernel, small5.grid, small5.block) == ("matmul_small4_q", (2, 1, 1), (256, 1, 1))
    assert (small1.kernel, small1.grid, small1.block) == ("matmul_gemv2_q", (19, 1, 1),
                                                          (64, 1, 1))  # fmt: skip
    assert small1.args[-3:] == [None, 37, 96]  # no residual, then N, K
    assert (tiled.kernel, tiled.grid, tiled.block) == ("matmul_tiled_q", (1, 1, 1), (256, 1, 1))
    assert tiled.args[-4:] == [None, 5, 37, 96]  # no residual, then n, N, K


def _one_row_matmul_launches(setting: str, value: int, ks: tuple[int, ...]) -> list[Any]:
    """The launches of one-row matmuls (8 rows of Q8_0) with each of ``ks`` inputs, on a
    fresh backend with the GpuBackend setting at value."""
    backend, rt = make()
    setattr(backend, setting, value)
    stream = backend.create_stream()
    for k in ks:
        w = backend.upload_weight(weight_tensor("w", np.ones((8, k), np.float32), "Q8_0"))
        x = vt.Tensor.of(backend.alloc(k * 4), F32, 1, k)
        out = vt.Tensor.of(backend.alloc(8 * 4), F32, 1, 8)
        backend.launch("matmul", stream, out=out, x=x, weight=w)
    backend.close()
    return list(rt.launches)


def test_long_one_row_matmuls_take_the_unrolled_gemv_where_asked() -> None:
    """gemv_unroll_min_k: one-row matmuls with at least that many inputs launch
    matmul_gemvu2_q (the same arguments), shorter ones and every other op the plain gemv."""
    short, long = _one_row_matmul_launches("gemv_unroll_min_k", 128, (96, 128))
    assert (short.kernel, long.kernel) == ("matmul_gemv2_q", "matmul_gemvu2_q")
    assert long.args[-2:] == [8, 128] and len(long.args) == len(short.args)


def test_long_one_row_matmuls_take_the_long_gemv() -> None:
    """gemv_long_min_k (4,096 by default): one-row matmuls with at least that many inputs launch
    gemv_long_features (4) a block of gemv_long_threads (256) threads; shorter ones keep
    gemv_features (2) and gemv_threads (128, K > 1024)."""
    assert (GpuBackend.gemv_long_min_k, GpuBackend.gemv_long_features,
            GpuBackend.gemv_long_threads) == (4096, 4, 256)  # fmt: skip
    short, long = _one_row_matmul_launches("gemv_long_min_k", 4096, (2048, 4096))
    assert (short.kernel, short.grid, short.block) == ("matmul_gemv2_q", (4, 1, 1), (128, 1, 1))
    assert (long.kernel, long.grid, long.block) == ("matmul_gemv4_q", (2, 1, 1), (256, 1, 1))
    assert long.args[-2:] == [8, 4096] and len(long.args) == len(short.args)
    (off,) = _one_row_matmul_launches("gemv_long_min_k", 0, (4096,))
    assert (off.kernel, off.grid, off.block) == ("matmul_gemv2_q", (4, 1, 1), (128, 1, 1))


def test_one_row_matmuls_with_many_features_take_the_wide_gemv() -> None:
    """gemv_wide_min_rows (32,768 by default: the output projection): a one-row matmul with at
    least that many features launches gemv_wide_features (4) a block of gemv_wide_threads
    (64) threads; fewer features, swiglu and qkv keep gemv_features (2) and 128 threads
    (K > 1024). Threads go to whole warps, one warp to 256 (the kernel's shared sums)."""
    backend, rt = make()
    assert (backend.gemv_wide_min_rows, backend.gemv_wide_features,
            backend.gemv_wide_threads) == (32768, 4, 64)  # fmt: skip
    backend.gemv_wide_min_rows = 40  # the tests' weights are small
    stream = backend.create_stream()
    k = 2048
    x = vt.Tensor.of(backend.alloc(k * 4), F32, 1, k)
    for rows in (39, 40, 41):
        w = backend.upload_weight(weight_tensor("w", np.ones((rows, k), np.float32), "Q8_0"))
        out = vt.Tensor.of(backend.alloc(rows * 4), F32, 1, rows)
        backend.launch("matmul", stream, out=out, x=x, weight=w)
    narrow, wide, wide41 = rt.launches
    assert (narrow.kernel, narrow.grid, narrow.block) == ("matmul_gemv2_q", (20, 1, 1),
                                                          (128, 1, 1))  # fmt: skip
    assert (wide.kernel, wide.grid, wide.block) == ("matmul_gemv4_q", (10, 1, 1), (64, 1, 1))
    assert (wide41.kernel, wide41.grid) == ("matmul_gemv4_q", (11, 1, 1))
    assert wide.args[-2:] == [40, k] and len(wide.args) == len(narrow.args)
    for asked, got in ((64, 64), (100, 96), (8, 32), (256, 256), (1000, 256), (0, 32)):
        assert backend._gemv_threads(asked) == got
    backend.close()


def _swiglu_and_matmul_launches(setting: str, values: tuple[int, ...]) -> list[Any]:
    """The launches of a one-row swiglu then a matmul (K 2,048, 8 rows of Q8_0) for each
    value of the GpuBackend setting, on a fresh backend."""
    backend, rt = make()
    stream = backend.create_stream()
    k, rows = 2048, 8
    w = backend.upload_weight(weight_tensor("w", np.ones((rows, k), np.float32), "Q8_0"))
    x = vt.Tensor.of(backend.alloc(k * 4), F32, 1, k)

    def out() -> vt.Tensor:
        return vt.Tensor.of(backend.alloc(rows * 4), F32, 1, rows)

    for value in values:
        setattr(backend, setting, value)
        backend.launch("swiglu", stream, out=out(), x=x, gate=w, up=w, scratch_gate=out(),
                       scratch_up=out())  # fmt: skip
        backend.launch("matmul", stream, out=out(), x=x, weight=w)
    backend.close()
    return list(rt.launches)


def test_swiglu_gemv_threads_are_their_own_setting() -> None:
    """gemv_swiglu_threads: swiglu's one-row gemv takes that many threads where K > 1024
    (64 by default); the matmul beside it keeps gemv_threads (128)."""
    assert (GpuBackend.gemv_swiglu_threads, GpuBackend.gemv_threads) == (64, 128)
    launches = _swiglu_and_matmul_launches("gemv_swiglu_threads", (128, 64))
    got = [(launch.kernel, launch.block[0]) for launch in launches]
    assert got == [("swiglu_gemv2_q", 128), ("matmul_gemv2_q", 128),
                   ("swiglu_gemv2_q", 64), ("matmul_gemv2_q", 128)]  # fmt: skip


def test_swiglu_gemv_features_are_their_own_setting() -> None:
    """gemv_swiglu_features: swiglu's one-row gemv takes 1, 2 or 4 output features a block
    (its grid shrinks to match); 0 or anything else is gemv_features (2); the matmul beside
    it keeps gemv_features."""
    assert (GpuBackend.gemv_swiglu_features, GpuBackend.gemv_features) == (0, 2)
    launches = _swiglu_and_matmul_launches("gemv_swiglu_features", (4, 1, 0, 3))
    got = [(launch.kernel, launch.grid[0]) for launch in launches]
    assert got == [("swiglu_gemv4_q", 2), ("matmul_gemv2_q", 4), ("swiglu_gemv1_q", 8),
                   ("matmul_gemv2_q", 4), ("swiglu_gemv2_q", 4), ("matmul_gemv2_q", 4),
                   ("swiglu_gemv2_q", 4), ("matmul_gemv2_q", 4)]  # fmt: skip


def test_decode_rows_split_over_blocks_only_when_the_grid_is_small() -> None:
    backend, rt = make()
    backend.int8_min_rows = 1 << 30  # the float32 kernels (these weights would take int8)
    stream = backend.create_stream()

    def grid(out_f: int, n: int) -> tuple[tuple[int, int, int], int]:
        rt.launches.clear()
        w = backend.upload_weight(weight_tensor("w", np.ones((out_f, 64), np.float32), "Q8_0"))
        x = vt.Tensor.of(backend.alloc(n * 64 * 4), F32, n, 64)
        out = vt.Tensor.of(backend.alloc(n * out_f * 4), F32, n, out_f)
        backend.launch("matmul", stream, out=out, x=x, weight=w)
        (launch,) = rt.launches
        return launch.grid, launch.args[-1]

    # 32 rows: 4 features per warp, 32 per block
    assert grid(32 * 256, 32) == ((256, 1, 1), 32)  # enough blocks: each weight read once
    assert grid(32 * 16, 32) == ((16, 4, 1), 8)  # 16 blocks: 4 row groups of 8
    assert grid(32 * 100, 32) == ((100, 2, 1), 16)
    assert grid(32 * 16, 3) == ((16, 1, 1), 8)
    backend.gemv_features = 0  # one row on the warp kernel
    assert grid(8 * 16, 1) == ((16, 1, 1), 8)  # one row: one feature per warp


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "wide"])
def test_a_weight_is_one_allocation_freed_once(compact: bool) -> None:
    backend, rt = make()
    backend.compact_weights = compact
    weight = backend.upload_weight(weight_tensor("w", np.ones((37, 96), np.float32), "Q4_1"))
    h = weight.handle
    # codes, then (scale, offset) pairs 256-byte aligned: one allocation per weight. Compact:
    # nibbles and half pairs; wide: int8 codes and float32 pairs.
    codes, pair = (1792, 4) if compact else (3584, 8)
    assert h.scales == h.data + codes and h.buffer.nbytes == codes + 37 * 3 * pair
    assert h.layout == (W.Q_NIB | W.Q_HALF if compact else 0)
    assert rt.compiles  # compiled at the first upload, before any step
    backend.free_weight(weight)
    backend.free_weight(weight)  # idempotent
    assert rt.args("free") == [(h.data,)]


def test_empty_batches_launch_nothing() -> None:
    backend, rt = make()
    case = OpCase(backend)
    stream = backend.create_stream()
    backend.launch("add", stream, out=case.t("o", F32, 0, 8), a=case.t("a", F32, 0, 8),
                   b=case.t("b", F32, 0, 8))  # fmt: skip
    weight = case.w("w", np.ones((4, 8), np.float32))
    backend.launch("matmul", stream, out=case.t("o", F32, 0, 4), x=case.t("x", F32, 0, 8),
                   weight=weight)  # fmt: skip
    assert rt.launches == []


def _f32(buf: vt.Buffer, *shape: int) -> vt.Tensor:
    return vt.Tensor(buf, F32, shape)  # unchecked: launch checks it


def _i32(buf: vt.Buffer, *shape: int) -> vt.Tensor:
    return vt.Tensor(buf, I32, shape)


def _kv(b: vt.Buffer, layout: vt.KVLayout, layer: int, heads: int) -> dict[str, Any]:
    """kv_store's arguments for one row of ``heads`` heads."""
    one, k = _i32(b, 1), _f32(b, 1, heads * layout.head_dim)
    cache = _f32(b, *layout.shape)
    return dict(cache=cache, k=k, v=k, slots=one, positions=one, layout=layout, layer=layer)


def _qkv_rope(w: vt.Weight, b: vt.Buffer, layout: vt.KVLayout, head_dim: int) -> dict[str, Any]:
    """qkv_rope_kv_store's arguments for one row: every projection the (4, 96) weight ``w``,
    two query heads."""
    one, x, row = _i32(b, 1), _f32(b, 1, 96), _f32(b, 1, 4)
    return dict(q=row, k=row, v=row, x=x, wq=w, wk=w, wv=w, positions=one, slots=one,
                cache=_f32(b, *layout.shape), layout=layout, layer=0, n_heads=2,
                params=vt.RopeParams(head_dim))  # fmt: skip


def _attention(b: vt.Buffer, layout: vt.KVLayout, n_heads: int) -> dict[str, Any]:
    kv = _kv(b, layout, 0, n_heads)
    q = kv.pop("k")
    del kv["v"]
    return {**kv, "out": q, "q": q, "n_heads": n_heads, "scale": 1.0}


def _norm_swiglu(w: vt.Weight, b: vt.Buffer, norm: vt.Weight) -> dict[str, Any]:
    """rms_norm_swiglu's arguments for one row: gate and up the (4, 96) weight ``w``."""
    row = _f32(b, 1, 4)
    return dict(out=row, x=_f32(b, 1, 96), norm=norm, eps=1e-5, gate=w, up=w,
                scratch=_f32(b, 1, 96), scratch_gate=row, scratch_up=row)  # fmt: skip


@pytest.mark.parametrize(
    ("op", "args", "message"),
    [
        # the core's checks, before the backend is called
        ("matmul", lambda w, b: {"out": _f32(b, 3, 4), "x": _f32(b.view(0, 64), 3, 96),
                                 "weight": w},
         "x of shape .* needs 1152 bytes, its buffer has 64"),
        ("attention", lambda w, b: _attention(b, vt.KVLayout(1, 1, 4, 3, 8), 4),
         "n_heads 4 is not a multiple of n_kv_heads 3"),
        ("kv_store", lambda w, b: _kv(b, vt.KVLayout(1, 1, 4, 1, 8), 1, 1),
         r"layer 1 is out of range \[0, 1\)"),
        ("qkv_rope_kv_store", lambda w, b: _qkv_rope(w, b, vt.KVLayout(1, 1, 4, 1, 2), 2),
         "op qkv_rope_kv_store: k has 4 columns, the layout needs 2"),
        ("qkv_rope_kv_store", lambda w, b: _qkv_rope(w, b, vt.KVLayout(1, 1, 4, 2, 2), 4),
         "op qkv_rope_kv_store: rope head_dim differs from the layout's head_dim"),
        ("rms_norm_swiglu", lambda w, b: _norm_swiglu(w, b, w),
         r"op rms_norm_swiglu: weight norm \('w'\) has shape \(4, 96\), expected 1 dimensions"),
        ("rms_norm_qkv_rope_kv_store",
         lambda w, b: {**_qkv_rope(w, b, vt.KVLayout(1, 1, 4, 1, 2), 2),
                       "norm": w, "eps": 1e-5, "scratch": _f32(b, 1, 96)},
         r"op rms_norm_qkv_rope_kv_store: weight norm \('w'\) has shape \(4, 96\)"),
        # the GPU's own limits
        ("rope", lambda w, b: {"x": _f32(b, 1, 7), "positions": _i32(b, 1), "n_heads": 1,
                               "params": vt.RopeParams(7)},
         "head_dim must be a positive even number"),
        ("rope", lambda w, b: {"x": _f32(b, 1, 2 * MAX_HEAD_DIM), "positions": _i32(b, 1),
                               "n_heads": 1, "params": vt.RopeParams(2 * MAX_HEAD_DIM)},
         f"head_dim must be a positive even number up to {MAX_HEAD_DIM}"),
        ("kv_store", lambda w, b: _kv(b, vt.KVLayout(1, 1, 1, 1, 2 * MAX_HEAD_DIM), 0, 1),
         f"head_dim {2 * MAX_HEAD_DIM} exceeds {MAX_HEAD_DIM}"),
        ("attention", lambda w, b: _attention(b, vt.KVLayout(1, 1, 1, 1, 2 * MAX_HEAD_DIM), 1),
         f"head_dim {2 * MAX_HEAD_DIM} exceeds {MAX_HEAD_DIM}"),
        ("sample", lambda w, b: {"out": _i32(b, 1), "logits": _f32(b, 1, 0),
                                 "params": vt.Tensor(b, vt.SAMPLE_PARAMS_DTYPE, (1,))},
         r"vocab must be in \[1, 2\*\*24\)"),
        ("logprobs", lambda w, b: {"chosen": _f32(b, 1), "top_ids": _i32(b, 1, 21),
                                   "top_logprobs": _f32(b, 1, 21), "logits": _f32(b, 1, 40),
                                   "ids": _i32(b, 1), "rows": _i32(b, 1)},
         r"k=21 alternatives exceed the kernel's 20"),
        ("logprobs", lambda w, b: {"chosen": _f32(b, 1), "top_ids": _i32(b, 1, 5),
                                   "top_logprobs": _f32(b, 1, 5), "logits": _f32(b, 1, 4),
                                   "ids": _i32(b, 1), "rows": _i32(b, 1)},
         r"k=5 alternatives exceed the vocabulary of 4"),
    ],
    ids=["matmul-x", "gqa", "layer", "qkv-rope-kv-width", "qkv-rope-head-dim",
         "norm-swiglu-matrix", "norm-qkv-rope-matrix", "rope-odd",
         "rope-head-dim", "kv-head-dim", "attention-head-dim", "vocab", "logprobs-k",
         "logprobs-vocab"],
)  # fmt: skip
def test_bad_op_arguments_fail_before_launching(op: str, args: Callable, message: str) -> None:
    backend, rt = make()
    weight = backend.upload_weight(weight_tensor("w", np.ones((4, 96), np.float32), "F32"))
    buf = backend.alloc(8192)
    with pytest.raises(ValueError, match=message):
        backend.launch(op, backend.create_stream(), **args(weight, buf))
    assert rt.launches == [] and "launch" not in rt.names()


def test_a_weight_of_another_backend_is_refused() -> None:
    backend, _ = make()
    foreign = vt.Weight("w", (4, 4), np.zeros((4, 4), np.float32))
    x, out = (vt.Tensor.of(backend.alloc(64), F32, 1, 4) for _ in range(2))
    with pytest.raises(ValueError, match="was not uploaded by fakegpu"):
        backend.launch("matmul", backend.create_stream(), out=out, x=x, weight=foreign)


def test_fused_ops_run_natively_or_as_their_decomposition() -> None:
    backend, rt = make()
    case = OpCase(backend)
    weight = case.w("w", np.ones((4, 8), np.float32))
    stream = backend.create_stream()

    def matmul_add() -> list[str]:
        rt.launches.clear()
        backend.launch("matmul_add", stream, out=case.t("out", F32, 2, 4),
                       x=case.t("x", F32, 2, 8), weight=weight, residual=case.t("r", F32, 2, 4),
                       scratch=case.t("s", F32, 2, 4))  # fmt: skip
        return [launch.kernel for launch in rt.launches]

    assert matmul_add() == ["matmul_small4_f32"]  # the residual add in the epilogue
    assert rt.launches[0].args[6] == case.addresses["r"]
    backend.native_fused = frozenset()  # what a tool does to measure the fusion
    assert not backend.supports("matmul_add") and backend.supports("matmul")
    assert matmul_add() == ["matmul_small4_f32", "add"]
    assert rt.launches[1].args[:3] == [case.addresses[k] for k in ("out", "r", "s")]


def test_prefill_runs_swiglu_and_qkv_as_tiled_matmuls() -> None:
    backend, rt = make()
    case = OpCase(backend)
    n = backend.tiled_min_rows
    w = {k: case.w(k, np.ones((16, 32), np.float32), "Q8_0") for k in ("g", "u", "q", "k", "v")}
    stream = backend.create_stream()
    backend.launch("swiglu", stream, out=case.t("out", F32, n, 16), x=case.t("x", F32, n, 32),
                   gate=w["g"], up=w["u"], scratch_gate=case.t("sg", F32, n, 16),
                   scratch_up=case.t("su", F32, n, 16))  # fmt: skip
    backend.launch("qkv", stream, q=case.t("q", F32, n, 16), k=case.t("k", F32, n, 16),
                   v=case.t("v", F32, n, 16), x=case.t("x", F32, n, 32), wq=w["q"], wk=w["k"],
                   wv=w["v"])  # fmt: skip
    assert [launch.kernel for launch in rt.launches] == ["matmul_tiled_q"] * 2 + ["silu_mul"] + [
        "matmul_tiled_q"
    ] * 3
    assert [launch.args[0] for launch in rt.launches[3:]] == [
        case.addresses[k] for k in ("q", "k", "v")
    ]


def test_qkv_of_weights_of_different_kinds_is_three_launches() -> None:
    backend, rt = make()
    case = OpCase(backend)
    stream = backend.create_stream()
    backend.launch(
        "qkv", stream, q=case.t("q", F32, 1, 4), k=case.t("k", F32, 1, 4),
        v=case.t("v", F32, 1, 4), x=case.t("x", F32, 1, 32),
        wq=case.w("wq", np.ones((4, 32), np.float32), "F16"),
        wk=case.w("wk", np.ones((4, 32), np.float32), "Q8_0"),
        wv=case.w("wv", np.ones((4, 32), np.float32), "Q8_0"),
    )  # fmt: skip
    assert [launch.kernel for launch in rt.launches] == ["matmul_small1_f16"] + [
        "matmul_gemv2_q"
    ] * 2


@pytest.mark.parametrize(
    ("arch", "want"), [("sm_90", True), ("sm_90a", True), ("sm_80", True), ("sm_75", False),
                       ("gfx942", False), ("fake_arch", False)],
)  # fmt: skip
def test_int8_steps_take_the_tensor_cores_where_the_device_has_them(arch: str, want: bool) -> None:
    """int8_mma None (the default): the mma kernels on NVIDIA sm_80 and later, decided once
    per backend; else the dp4a ones (HIP: their shuffle branch is never picked)."""
    backend, rt = make()
    assert backend.int8_mma is None
    rt.arch = lambda: arch  # type: ignore[method-assign]
    assert bool(backend._mma_tiles(8)) == want and backend.int8_mma is want
    assert type(backend).int8_mma is None  # this backend only


@pytest.mark.parametrize("op", ["matmul_add", "swiglu", "qkv"])
@pytest.mark.parametrize(("n", "tiles"), [(8, 1), (9, 2), (17, 4), (32, 4), (33, 8), (63, 8)])
def test_int8_mma_kernels_launch_with_the_arguments_in_signature_order(
    op: str, n: int, tiles: int
) -> None:
    """Steps of 8-63 rows on int8 activations with int8_mma: quantize_rows, then one
    ``*_mma{tiles}_q8a`` launch of a block per 16 features (256 threads; 128 for swiglu's
    8 tiles), with the q8a packed rows as x and the *_small kernels' arguments less rpb."""
    backend, rt = make()
    backend.int8_mma, backend.int8_min_values = True, 0
    c = OpCase(backend)
    rng = np.random.default_rng(1)

    def w(name: str, rows: int, wtype: str = "Q8_0") -> vt.Weight:
        return c.w(name, rng.standard_normal((rows, 64)).astype(np.float32), wtype)

    x = c.t("x", F32, n, 64)
    if op == "matmul_add":
        args = {
            "out": c.t("out", F32, n, 40),
            "x": x,
            "weight": w("proj", 40),
            "residual": c.t("residual", F32, n, 40),
            "scratch": c.t("s", F32, n, 40),
        }
        kernel, blocks, scalars = (
            "matmul_mma",
            3,
            {"lg_block": lg("Q8_0"), "n": n, "N": 40, "K": 64},
        )
    elif op == "swiglu":
        args = {
            "out": c.t("out", F32, n, 40),
            "x": x,
            "gate": w("gate", 40),
            "up": w("up", 40, "Q4_1"),
            "scratch_gate": c.t("sg", F32, n, 40),
            "scratch_up": c.t("su", F32, n, 40),
        }
        kernel, blocks = "swiglu_mma", 3
        scalars = {"glg": lg("Q8_0"), "ulg": lg("Q4_1"), "n": n, "N": 40, "K": 64}
    else:
        args = {
            "q": c.t("q", F32, n, 32),
            "k": c.t("k", F32, n, 16),
            "v": c.t("v", F32, n, 8),
            "x": x,
            "wq": w("wq", 32),
            "wk": w("wk", 16, "Q4_0"),
            "wv": w("wv", 8),
            "bq": c.w("bq", np.ones(32, np.float32)),
        }
        kernel, blocks = "qkv_mma", 4
        scalars = {
            "lgq": lg("Q8_0"),
            "lgk": lg("Q4_0"),
            "lgv": lg("Q8_0"),
            "n": n,
            "Nq": 32,
            "Nk": 16,
            "Nv": 8,
            "K": 64,
        }
    backend.launch(op, backend.create_stream(), **args)  # fmt: skip
    quantize, launch = rt.launches
    assert quantize.kernel == "quantize_rows" and quantize.args[1:] == [c.addresses["x"], n, 64]
    assert launch.kernel == f"{kernel}{tiles}_q8a"
    assert f"\nVT_DECODE_MMA(q8a, {tiles})" in kernel_source()  # instantiated
    threads = 128 if op == "swiglu" and tiles == 8 else 256
    assert launch.grid == (blocks, 1, 1) and launch.block == (threads, 1, 1)
    weights = {name: a.handle for name, a in args.items() if isinstance(a, vt.Weight)}
    signature = kernel_signatures()[kernel]
    assert len(launch.args) == len(signature), signature
    for (ctype, name), value in zip(signature, launch.args, strict=True):
        if name == "x":
            assert value == quantize.args[0] != c.addresses["x"]  # the packed rows
        elif "*" in ctype and name in c.addresses:
            assert value == c.addresses[name], name
        elif "*" in ctype and name in WEIGHT_POINTERS:
            arg, attr = WEIGHT_POINTERS[name]
            assert (value or 0) == (getattr(weights[arg], attr) if arg in weights else 0), name
        elif "*" in ctype:
            assert not value, name
        else:
            assert value == scalars.pop(name), name
    assert scalars == {}


@pytest.mark.parametrize(
    ("blocks", "min_k", "splits"), [(0, 256, 1), (8, 256, 2), (12, 256, 4), (12, 512, 2),
                                    (64, 128, 8), (64, 2048, 1), (512, 512, 2)]
)  # fmt: skip
def test_mma_split_blocks_splits_k_over_the_grids_y(blocks: int, min_k: int, splits: int) -> None:
    """mma_split_blocks: an int8 mma launch of fewer 16-feature blocks than the setting
    splits K over grid y, the most slices (a power of two) with blocks x slices within the
    setting and slices of at least mma_split_min_k values, and passes the slices' partial
    sums (part[block][slice][weight][tiles x 128 floats]) and the blocks' counters, zeroed
    when that scratch is allocated (the kernel leaves them zero); 0 (never) or too short a
    K: one slice and two nulls. On by default since run 119: 512 blocks, slices of 1,024."""
    backend, rt = make()
    assert (GpuBackend.mma_split_blocks, GpuBackend.mma_split_min_k) == (512, 1024)
    backend.int8_mma, backend.int8_min_values = True, 0
    backend.mma_split_blocks, backend.mma_split_min_k = blocks, min_k
    c = OpCase(backend)
    rng = np.random.default_rng(5)
    n, k = 17, 1024  # 4 tiles of 8 rows; 40 features: 3 blocks of 16

    def w(name: str) -> vt.Weight:
        return c.w(name, rng.standard_normal((40, k)).astype(np.float32), "Q8_0")

    stream = backend.create_stream()
    x = c.t("x", F32, n, k)
    backend.launch("matmul", stream, out=c.t("out", F32, n, 40), x=x, weight=w("proj"))
    backend.launch("swiglu", stream, out=c.t("out", F32, n, 40), x=x, gate=w("g"), up=w("u"),
                   scratch_gate=c.t("sg", F32, n, 40),
                   scratch_up=c.t("su", F32, n, 40))  # fmt: skip
    launches = [launch for launch in rt.launches if "_mma" in launch.kernel]
    assert [launch.kernel for launch in launches] == ["matmul_mma4_q8a", "swiglu_mma4_q8a"]
    counts_zeroed = {ptr for ptr, value, _, _ in rt.args("memset") if value == 0}
    for launch, weights in zip(launches, (1, 2), strict=True):
        assert launch.grid == (3, splits, 1)
        names = [name for _, name in kernel_signatures()[macro_prefix(launch.kernel)]]
        part, counts = (launch.args[names.index(name)] for name in ("part", "counts"))
        if splits == 1:
            assert not part and not counts
            continue
        scratch = {backend._addr(buf): buf.nbytes for _, buf in backend._scratch}
        assert counts in counts_zeroed and scratch[counts] >= 4 * 3
        assert scratch[part] >= 4 * 3 * splits * weights * 4 * 128


@pytest.mark.parametrize(
    ("n", "features", "setting", "types", "kernel"),
    [(8, 48, 3, ("Q8_0", "Q8_0"), "swiglu_mma1w_q8a"),
     (8, 48, 3, ("Q4_0", "Q4_0"), "swiglu_mma1w_q8a"),
     (8, 48, 3, ("Q6_K", "Q6_K"), "swiglu_mma1w_q8a"),
     (8, 64, 4, ("Q8_0", "Q8_0"), "swiglu_mma1w_q8a"),
     (8, 48, 4, ("Q8_0", "Q8_0"), "swiglu_mma1_q8a"),
     (8, 48, 0, ("Q8_0", "Q8_0"), "swiglu_mma1_q8a"),
     (9, 64, 1, ("Q8_0", "Q8_0"), "swiglu_mma2_q8a"),
     (8, 48, 3, ("Q4_1", "Q4_1"), "swiglu_mma1_q8a"),
     (8, 48, 3, ("Q4_K", "Q4_K"), "swiglu_mma1_q8a"),
     (8, 48, 3, ("Q8_0", "Q4_0"), "swiglu_mma1_q8a")],
)  # fmt: skip
def test_mma_sw1_wave_blocks_picks_swiglus_four_an_sm_form(
    n: int, features: int, setting: int, types: tuple[str, str], kernel: str
) -> None:
    """mma_sw1_wave_blocks (400 by default): an 8-row swiglu launch of at least that many
    16-feature blocks, in a layout of scales alone (Q8_0, Q4_0, Q6_K), takes
    swiglu_mma1w_q8a (swiglu_mma1_q8a's code held to 4 blocks an SM), with swiglu_mma's
    arguments and grid; fewer blocks, 0 (never), more tiles, a layout with offsets (which
    spills at 64 registers) or two layouts (the module of every layout) keep the plain
    kernels (a negative setting: test_a_negative_setting_is_refused_by_name_before_any_compile)."""
    assert GpuBackend.mma_sw1_wave_blocks == 400
    backend, rt = make()
    backend.int8_mma, backend.int8_min_values = True, 0
    backend.mma_sw1_wave_blocks = setting
    c = OpCase(backend)
    rng = np.random.default_rng(2)

    def w(name: str, wtype: str) -> vt.Weight:
        return c.w(name, rng.standard_normal((features, 256)).astype(np.float32), wtype)

    backend.launch("swiglu", backend.create_stream(), out=c.t("out", F32, n, features),
                   x=c.t("x", F32, n, 256), gate=w("g", types[0]), up=w("u", types[1]),
                   scratch_gate=c.t("sg", F32, n, features),
                   scratch_up=c.t("su", F32, n, features))  # fmt: skip
    _, launch = rt.launches
    assert launch.kernel == kernel
    assert launch.grid == (features // 16, 1, 1) and launch.block == (256, 1, 1)
    signatures = kernel_signatures()
    assert signatures["swiglu_mma1w_q8a"] == signatures["swiglu_mma"]
    names = [name for _, name in signatures["swiglu_mma"]]
    assert launch.args[names.index("N")] == features and launch.args[names.index("n")] == n
    backend.close()


@pytest.mark.parametrize("on", [False, True], ids=["off", "default"])
def test_norm_quantize_packs_the_normed_rows_in_one_launch(on: bool) -> None:
    """norm_quantize: the norm ops at int8 mma rows launch quantize_norm_rows (a block of
    256 threads a row: x, the norm's weight, n, K, eps) and their mma kernel on its packed
    rows, instead of rms_norm, quantize_rows and the mma kernel; qkv's RoPE and KV store
    follow as rope_kv_store. Off, or fewer rows than int8_min_rows: rms_norm, then the
    kernels as without the norm."""
    backend, rt = make()
    backend.int8_mma, backend.int8_min_values, backend.norm_quantize = True, 0, on
    assert GpuBackend.norm_quantize  # on by default since run 108
    c = OpCase(backend)
    rng = np.random.default_rng(7)

    def w(name: str, rows: int) -> vt.Weight:
        return c.w(name, rng.standard_normal((rows, 64)).astype(np.float32), "Q8_0")

    norm = c.w("norm", np.ones(64, np.float32))
    bq = c.w("bq", np.ones(32, np.float32))
    layout = vt.KVLayout(n_layers=2, n_slots=8, max_len=4, n_kv_heads=1, head_dim=16)
    stream = backend.create_stream()
    xs = []
    for n in (8, 4):
        x = c.t("x", F32, n, 64)
        xs.append(c.addresses["x"])
        backend.launch("rms_norm_swiglu", stream, out=c.t("out", F32, n, 16), x=x, norm=norm,
                       eps=1e-5, gate=w("g", 16), up=w("u", 16), scratch=c.t("s", F32, n, 64),
                       scratch_gate=c.t("sg", F32, n, 16),
                       scratch_up=c.t("su", F32, n, 16))  # fmt: skip
        backend.launch("rms_norm_qkv_rope_kv_store", stream, q=c.t("q", F32, n, 32),
                       k=c.t("k", F32, n, 16), v=c.t("v", F32, n, 16), x=x, norm=norm,
                       eps=1e-5, wq=w("wq", 32), wk=w("wk", 16), wv=w("wv", 16),
                       positions=c.t("positions", I32, n), slots=c.t("slots", I32, n),
                       cache=c.t("cache", F32, *layout.shape), layout=layout, layer=1,
                       n_heads=2, params=vt.RopeParams(16), bq=bq,
                       scratch=c.t("s", F32, n, 64))  # fmt: skip
    kernels = [launch.kernel for launch in rt.launches]
    few = ["rms_norm", "swiglu_small2_q", "rms_norm", "qkv_small4_q", "rope_kv_store"]
    if on:
        assert kernels == [
            "quantize_norm_rows",
            "swiglu_mma1_q8a",
            "quantize_norm_rows",
            "qkv_rope_mma1_q8a",
            *few,
        ]  # fmt: skip (mma_rope: RoPE inside)
        packed = rt.launches[0]
        names = [name for _, name in kernel_signatures()["quantize_norm_rows"]]
        assert names == ["out", "x", "w", "n", "K", "eps"]
        assert packed.grid == (8, 1, 1) and packed.block == (256, 1, 1)
        assert packed.args[1:5] == [xs[0], norm.handle.data, 8, 64]
        assert rt.launches[1].args[1] == packed.args[0]  # swiglu_mma reads the packed rows
        qkv_names = [name for _, name in kernel_signatures()["qkv_rope_mma"]]
        qkv = rt.launches[3]
        assert qkv.args[qkv_names.index("x")] == rt.launches[2].args[0]
        assert qkv.args[qkv_names.index("bq")] == bq.handle.data  # q's bias, k's and v's none
        assert not qkv.args[qkv_names.index("bk")]
        # norm_quantize_values: a row's blocks of 32 over K // N blocks of the grid's y
        backend.norm_quantize_values = 32
        rt.launches.clear()
        x = c.t("x", F32, 8, 64)
        backend.launch("rms_norm_swiglu", stream, out=c.t("out", F32, 8, 16), x=x, norm=norm,
                       eps=1e-5, gate=w("g", 16), up=w("u", 16), scratch=c.t("s", F32, 8, 64),
                       scratch_gate=c.t("sg", F32, 8, 16),
                       scratch_up=c.t("su", F32, 8, 16))  # fmt: skip
        assert rt.launches[0].kernel == "quantize_norm_rows"
        assert rt.launches[0].grid == (8, 2, 1)
    else:
        assert kernels == ["rms_norm", "quantize_rows", "swiglu_mma1_q8a", "rms_norm",
                           "quantize_rows", "qkv_mma1_q8a", "rope_kv_store", *few]  # fmt: skip


@pytest.mark.parametrize(
    "setting, style, fused",
    [(True, "normal", True), (True, "neox", False), (False, "normal", False)],
    ids=["default", "neox", "off"],
)
def test_mma_rope_puts_rope_and_the_kv_store_in_the_qkv_launch(
    setting: bool, style: str, fused: bool
) -> None:
    """mma_rope (on by default): at int8 mma rows rms_norm_qkv_rope_kv_store is
    quantize_norm_rows then qkv_rope_mma*_q8a, which takes qkv_mma's arguments then
    rope_kv_store's positions, slots, cache, head_dim, the layout's sizes, the layer and the
    RoPE table, K split as qkv_mma's; NeoX's pairs (features i and i + head_dim / 2, two
    of the kernel's 16-feature blocks) and the setting off keep qkv_mma then rope_kv_store."""
    assert GpuBackend.mma_rope
    backend, rt = make()
    backend.int8_mma, backend.int8_min_values, backend.mma_rope = True, 0, setting
    backend.mma_split_blocks = 64  # 4 blocks of 16 features: K = 2,048 in 2 slices of 1,024
    c = OpCase(backend)
    rng = np.random.default_rng(5)
    ws = {n: c.w(n, rng.standard_normal((rows, 2048)).astype(np.float32), "Q8_0")
          for n, rows in (("q", 32), ("k", 16), ("v", 16))}  # fmt: skip
    layout = vt.KVLayout(n_layers=3, n_slots=8, max_len=6, n_kv_heads=1, head_dim=16)
    params = vt.RopeParams(16, style=vt.RopeStyle(style))
    stream = backend.create_stream()
    backend.launch("rms_norm_qkv_rope_kv_store", stream, q=c.t("q", F32, 9, 32),
                   k=c.t("k", F32, 9, 16), v=c.t("v", F32, 9, 16), x=c.t("x", F32, 9, 2048),
                   norm=c.w("norm", np.ones(2048, np.float32)), eps=1e-5, wq=ws["q"],
                   wk=ws["k"], wv=ws["v"], positions=c.t("positions", I32, 9),
                   slots=c.t("slots", I32, 9), cache=c.t("cache", F32, *layout.shape),
                   layout=layout, layer=2, n_heads=2, params=params,
                   scratch=c.t("s", F32, 9, 2048))  # fmt: skip
    kernels = [launch.kernel for launch in rt.launches]
    if not fused:
        assert kernels == ["quantize_norm_rows", "qkv_mma2_q8a", "rope_kv_store"]
        backend.close()
        return
    assert kernels == ["quantize_norm_rows", "qkv_rope_mma2_q8a"]
    launch = rt.launches[1]
    names = [n for _, n in kernel_signatures()["qkv_rope_mma"]]
    assert names[:23] == [n for _, n in kernel_signatures()["qkv_mma"]]
    arg = dict(zip(names, launch.args, strict=True))
    assert launch.grid == (4, 2, 1) and launch.block == (256, 1, 1)
    assert arg["x"] == rt.launches[0].args[0]  # the packed rows
    for name in ("q", "k", "v", "positions", "slots", "cache"):
        assert arg[name] == c.addresses[name], name
    sizes = ("n", "Nq", "Nk", "Nv", "K", "head_dim", "n_slots", "n_layers", "max_len", "layer")
    assert [arg[n] for n in sizes] == [9, 32, 16, 16, 2048, 16, 8, 3, 6, 2]
    assert arg["part"] and arg["counts"]  # K split: the slices' scratch
    assert list(arg["table"].inv) == list(rope_table(params).inv)
    backend.close()


def test_mma_rope_refuses_a_head_dim_before_launching_anything() -> None:
    """A head_dim past RoPE's table is refused at int8 mma rows with the bound named,
    before quantize_norm_rows is launched: nothing runs."""
    backend, rt = make()
    backend.int8_mma, backend.int8_min_values = True, 0
    c = OpCase(backend)
    d = 2 * MAX_HEAD_DIM
    ws = {n: c.w(n, np.ones((d, 64), np.float32), "Q8_0") for n in ("q", "k", "v")}
    layout = vt.KVLayout(n_layers=1, n_slots=8, max_len=2, n_kv_heads=1, head_dim=d)
    with pytest.raises(ValueError, match=f"head_dim must be .* up to 256, got {d}"):
        backend.launch("rms_norm_qkv_rope_kv_store", backend.create_stream(),
                       q=c.t("q", F32, 8, d), k=c.t("k", F32, 8, d), v=c.t("v", F32, 8, d),
                       x=c.t("x", F32, 8, 64), norm=c.w("norm", np.ones(64, np.float32)),
                       eps=1e-5, wq=ws["q"], wk=ws["k"], wv=ws["v"],
                       positions=c.t("positions", I32, 8), slots=c.t("slots", I32, 8),
                       cache=c.t("cache", F32, *layout.shape), layout=layout, layer=0,
                       n_heads=1, params=vt.RopeParams(d),
                       scratch=c.t("s", F32, 8, 64))  # fmt: skip
    assert rt.launches == []
    backend.close()


def test_int8_mma_falls_back_to_dp4a_where_a_block_would_straddle_weights() -> None:
    """qkv needs q's and k's features in whole 16s (a block's 16 features are one weight's),
    swiglu one block size for gate and up; else the dp4a kernels run the step."""
    backend, rt = make()
    backend.int8_mma, backend.int8_min_values = True, 0
    c = OpCase(backend)
    rng = np.random.default_rng(1)

    def w(name: str, rows: int, cols: int = 256, wtype: str = "Q8_0") -> vt.Weight:
        return c.w(name, rng.standard_normal((rows, cols)).astype(np.float32), wtype)

    stream = backend.create_stream()
    x = c.t("x", F32, 8, 256)
    backend.launch("qkv", stream, q=c.t("q", F32, 8, 24), k=c.t("k", F32, 8, 16),
                   v=c.t("v", F32, 8, 16), x=x, wq=w("wq", 24), wk=w("wk", 16),
                   wv=w("wv", 16))  # fmt: skip
    assert [launch.kernel for launch in rt.launches] == ["quantize_rows", "qkv_small4_q8a"]
    rt.launches.clear()
    backend.launch("swiglu", stream, out=c.t("out", F32, 8, 16), x=x, gate=w("g", 16),
                   up=w("u", 16, wtype="Q6_K"), scratch_gate=c.t("sg", F32, 8, 16),
                   scratch_up=c.t("su", F32, 8, 16))  # fmt: skip
    assert [launch.kernel for launch in rt.launches] == ["quantize_rows", "swiglu_small2_q8a"]


def _overlapped_launches(rt: Any) -> list[str]:
    """The kernels the fake runtime ``rt`` launches overlapped from now on, in order (each
    still launched, and recorded, as a plain launch)."""
    overlapped: list[str] = []
    plain = rt.launch

    def launch_overlapped(fn: Any, *args: Any) -> None:
        overlapped.append(fn.split(":", 1)[1])
        plain(fn, *args)

    rt.launch_overlapped = launch_overlapped
    return overlapped


@pytest.mark.parametrize("on", [True, False])
def test_kernels_that_wait_for_their_predecessor_launch_overlapped(on: bool) -> None:
    """The gemv kernels and rms_norm of one row (which call vt_grid_wait before reading
    activations) go through ``launch_overlapped``; every other launch, and all of them with
    ``overlap_launches`` off, through ``launch``."""
    backend, rt = make()
    backend.overlap_launches = on
    overlapped = _overlapped_launches(rt)
    c = OpCase(backend)
    s = backend.create_stream()
    w = {n: c.w(n, np.ones((64, 64), np.float32), "Q8_0") for n in ("q", "k", "v", "g", "u")}
    x1, x5 = c.t("x1", F32, 1, 64), c.t("x5", F32, 5, 64)
    backend.launch("rms_norm", s, out=c.t("h", F32, 1, 64), x=x1, weight=c.w("n", np.ones(64)),
                   eps=1e-5)  # fmt: skip
    backend.launch("qkv", s, q=c.t("q", F32, 1, 64), k=c.t("k", F32, 1, 64),
                   v=c.t("v", F32, 1, 64), x=x1, wq=w["q"], wk=w["k"], wv=w["v"])  # fmt: skip
    sg, su = c.t("sg", F32, 1, 64), c.t("su", F32, 1, 64)
    backend.launch("swiglu", s, out=c.t("o", F32, 1, 64), x=x1, gate=w["g"], up=w["u"],
                   scratch_gate=sg, scratch_up=su)  # fmt: skip
    backend.launch("matmul", s, out=c.t("m1", F32, 1, 64), x=x1, weight=w["q"])
    backend.launch("matmul", s, out=c.t("m5", F32, 5, 64), x=x5, weight=w["q"])
    backend.launch("silu_mul", s, out=c.t("a", F32, 1, 64), gate=x1, up=x1)
    backend.launch("rms_norm", s, out=c.t("h5", F32, 5, 64), x=x5, weight=c.w("n5", np.ones(64)),
                   eps=1e-5)  # fmt: skip
    kernels = [launch.kernel for launch in rt.launches]
    assert kernels[:4] == ["rms_norm", "qkv_gemv2_q", "swiglu_gemv2_q", "matmul_gemv2_q"]
    assert kernels[4:] == ["matmul_small4_q", "silu_mul", "rms_norm"]
    assert overlapped == (kernels[:4] if on else [])  # more rows, or other kernels: plain
    source = kernel_source()
    for name in ("rms_norm(", "vt_gv_rows(const VtRow"):  # the overlapped kernels' bodies
        body = source[source.index(name) :]
        assert "vt_grid_wait();" in body[: body.index("\n}\n")], name
    backend.close()


@pytest.mark.parametrize("on", [False, True], ids=["off", "default"])
def test_overlap_mma_launches_the_int8_batch_kernels_overlapped(on: bool) -> None:
    """overlap_mma (on by default since run 119): at int8 mma rows quantize_norm_rows,
    quantize_rows and the mma kernels go through ``launch_overlapped`` (each calls
    vt_grid_wait before reading what the kernel before it wrote; an mma warp after its first
    weights; qkv_rope_mma reads positions and slots after its wait too). Off: all plain."""
    assert GpuBackend.overlap_mma
    backend, rt = make()
    backend.int8_mma, backend.int8_min_values, backend.overlap_mma = True, 0, on
    overlapped = _overlapped_launches(rt)
    c = OpCase(backend)
    s = backend.create_stream()
    rng = np.random.default_rng(2)
    ws = {
        n: c.w(n, rng.standard_normal((rows, 64)).astype(np.float32), "Q8_0")
        for n, rows in (("q", 32), ("k", 16), ("v", 16), ("g", 16), ("u", 16), ("o", 64))
    }
    norm = c.w("norm", np.ones(64, np.float32))
    layout = vt.KVLayout(n_layers=1, n_slots=8, max_len=4, n_kv_heads=1, head_dim=16)
    x = c.t("x", F32, 8, 64)
    backend.launch("rms_norm_qkv_rope_kv_store", s, q=c.t("q", F32, 8, 32),
                   k=c.t("k", F32, 8, 16), v=c.t("v", F32, 8, 16), x=x, norm=norm, eps=1e-5,
                   wq=ws["q"], wk=ws["k"], wv=ws["v"], positions=c.t("p", I32, 8),
                   slots=c.t("sl", I32, 8), cache=c.t("cache", F32, *layout.shape),
                   layout=layout, layer=0, n_heads=2, params=vt.RopeParams(16),
                   scratch=c.t("s", F32, 8, 64))  # fmt: skip
    backend.launch("matmul_add", s, out=x, x=c.t("a", F32, 8, 64), weight=ws["o"], residual=x,
                   scratch=c.t("s2", F32, 8, 64))  # fmt: skip
    backend.launch("rms_norm_swiglu", s, out=c.t("act", F32, 8, 16), x=x, norm=norm, eps=1e-5,
                   gate=ws["g"], up=ws["u"], scratch=c.t("s3", F32, 8, 64),
                   scratch_gate=c.t("sg", F32, 8, 16),
                   scratch_up=c.t("su", F32, 8, 16))  # fmt: skip
    kernels = [launch.kernel for launch in rt.launches]
    assert kernels == ["quantize_norm_rows", "qkv_rope_mma1_q8a", "quantize_rows",
                       "matmul_mma1_q8a", "quantize_norm_rows", "swiglu_mma1_q8a"]  # fmt: skip
    assert overlapped == (kernels if on else [])
    source = kernel_source()
    for name in ("void quantize_rows(", "void quantize_norm_rows(", "void vt_mma_loop("):
        body = source[source.index(name) :]
        assert "vt_grid_wait()" in body[: body.index("\n}\n")], name
    backend.close()


@pytest.mark.parametrize(("combine", "both"), [(False, False), (True, False), (False, True)])
def test_attention_combine_launches_overlapped_alone_where_asked(combine: bool, both: bool) -> None:
    """overlap_combine: attention_combine (which waits for the split kernel's partials on
    the device) through ``launch_overlapped``, the split kernel plain; overlap_attention:
    both; neither: both plain."""
    backend, rt = make()
    backend.overlap_combine, backend.overlap_attention = combine, both
    overlapped = _overlapped_launches(rt)
    c = OpCase(backend)
    layout = vt.KVLayout(n_layers=1, n_slots=2, max_len=64, n_kv_heads=1, head_dim=8)
    backend.launch(
        "attention", backend.create_stream(), out=c.t("o", F32, 1, 16), q=c.t("q", F32, 1, 16),
        cache=c.t("cache", F32, *layout.shape), slots=c.t("s", I32, 1),
        positions=c.t("p", I32, 1), layout=layout, layer=0, n_heads=2, scale=0.5,
    )  # fmt: skip
    assert [launch.kernel for launch in rt.launches] == ["attention_split", "attention_combine"]
    want = ["attention_split", "attention_combine"] if both else ["attention_combine"] * combine
    assert overlapped == want
    source = kernel_source()
    body = source[source.index("void VT_FA_BOUNDS attention_combine(") :]
    assert "vt_grid_wait();" in body[: body.index("\n}\n")]
    backend.close()


def _launch_attention(
    backend: GpuBackend, c: OpCase, layout: vt.KVLayout, rows: int, heads: int,
    op: str = "attention", **extra: Any,
) -> None:  # fmt: skip
    """``op`` (attention, attention_bounded with ``extra``'s context) over rows of ``heads``
    query heads of head_dim 64, layer 0, on fresh fake tensors."""
    width = heads * layout.head_dim
    backend.launch(
        op, backend.create_stream(), out=c.t("o", F32, rows, width), q=c.t("q", F32, rows, width),
        cache=c.t("cache", F32, *layout.shape), slots=c.t("s", I32, rows),
        positions=c.t("p", I32, rows), layout=layout, layer=0, n_heads=heads, scale=0.125,
        **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "n_heads", "min_q", "max_rows", "overlap", "want"),
    [
        (1, 32, None, None, True, True),  # the default: 32 heads of 64 (the 1B shape's 2,048)
        (1, 9, None, None, True, False),  # 9 heads of 64 (the 135M shape's 576): plain
        (1, 2, 128, None, True, True),  # the threshold itself
        (1, 2, 129, None, True, False),
        (2, 32, None, None, True, True),  # decode batches too (runs 176-177: 8-32 rows)
        (8, 32, None, None, True, True),
        (8, 9, None, None, True, False),  # a batch of narrow rows: plain
        (2, 32, None, 1, True, False),  # overlap_attention_max_rows 1: one row only
        (3, 32, None, 2, True, False),
        (2, 32, None, 2, True, True),
        (1, 32, 0, None, True, False),  # 0: never
        (1, 32, None, None, False, False),  # overlap_launches off: every launch plain
    ],
)
def test_attention_overlaps_at_decode_steps_where_the_query_row_is_wide(
    rows: int, n_heads: int, min_q: int | None, max_rows: int | None, overlap: bool, want: bool
) -> None:
    """overlap_attention_min_q: at steps of up to overlap_attention_max_rows rows (63 by
    default, below the tiled kernel's 64), where n_heads * head_dim reaches it, the split
    and combine kernels go through ``launch_overlapped`` (both wait for their predecessor on
    the device); narrower rows, longer steps, 0 and overlap_launches off launch them plain."""
    backend, rt = make()
    backend.overlap_launches = overlap
    if min_q is not None:
        backend.overlap_attention_min_q = min_q
    if max_rows is not None:
        backend.overlap_attention_max_rows = max_rows
    assert backend.overlap_attention is False  # the rule, not the every-shape switch
    overlapped = _overlapped_launches(rt)
    c = OpCase(backend)
    n_kv = 1 if n_heads < 4 else n_heads // 4 if n_heads % 4 == 0 else 3
    layout = vt.KVLayout(n_layers=1, n_slots=2, max_len=64, n_kv_heads=n_kv, head_dim=64)
    _launch_attention(backend, c, layout, rows, n_heads)
    assert [launch.kernel for launch in rt.launches] == ["attention_split", "attention_combine"]
    assert overlapped == (["attention_split", "attention_combine"] if want else [])
    source = kernel_source()
    body = source[source.index("void vt_attention_split(") :]  # attention_split's body
    assert "vt_grid_wait();" in body[: body.index("\n}\n")]
    backend.close()


def test_attention_at_the_tiled_kernels_rows_is_not_overlapped() -> None:
    """From attention_tiled_min_rows rows (prefill steps: the tiled kernel takes rows) the
    split kernel launches plain whatever overlap_attention_max_rows says; one row fewer is
    a decode batch and overlaps."""
    layout = vt.KVLayout(n_layers=1, n_slots=8, max_len=64, n_kv_heads=8, head_dim=64)
    for rows, want in ((3, []), (2, ["attention_split", "attention_combine"])):
        backend, rt = make()
        backend.attention_tiled_min_rows = 3
        overlapped = _overlapped_launches(rt)
        _launch_attention(backend, OpCase(backend), layout, rows, 32)
        assert [la.kernel for la in rt.launches if la.kernel.startswith("attention_split")]
        assert overlapped == want
        backend.close()


@pytest.mark.parametrize(
    ("n", "wtype", "kernels"),
    [
        (1, "Q8_0", ["qkv_rope_gemv_q"]),  # one row on the gemv kernels: one launch
        (3, "Q8_0", ["qkv_small4_q", "rope_kv_store"]),  # a decode batch: its parts
        (1, "F32", ["qkv_small1_f32", "rope_kv_store"]),  # not a gemv weight: its parts
    ],
)
def test_qkv_rope_kv_store_is_one_launch_only_where_the_gemv_kernels_run(
    n: int, wtype: str, kernels: list[str]
) -> None:
    backend, rt = make()
    case = OpCase(backend)
    layout = vt.KVLayout(n_layers=1, n_slots=2, max_len=8, n_kv_heads=1, head_dim=8)
    w = {name: case.w(name, np.ones((rows, 256), np.float32), wtype)
         for name, rows in (("wq", 16), ("wk", 8), ("wv", 8))}  # fmt: skip
    backend.launch(
        "qkv_rope_kv_store", backend.create_stream(), q=case.t("q", F32, n, 16),
        k=case.t("k", F32, n, 8), v=case.t("v", F32, n, 8), x=case.t("x", F32, n, 256), **w,
        positions=case.t("p", I32, n), slots=case.t("s", I32, n),
        cache=case.t("cache", F32, *layout.shape), layout=layout, layer=0, n_heads=2,
        params=vt.RopeParams(8),
    )  # fmt: skip
    assert [launch.kernel for launch in rt.launches] == kernels


@pytest.mark.parametrize(("threads", "splits"), [(128, 32), (512, 1), (256, 32)])
def test_attention_threads_reach_the_kernels_and_their_launches(threads: int, splits: int) -> None:
    """GpuBackend.attention_threads: compiled in as -DFA_THREADS (none at the default 128),
    and the block of the split kernel and, where a row splits, the combine; one split
    (attention_max_splits 1) launches no combine."""
    backend, rt = make()
    backend.attention_threads, backend.attention_max_splits = threads, splits
    c = OpCase(backend)
    layout = vt.KVLayout(n_layers=1, n_slots=2, max_len=64, n_kv_heads=2, head_dim=64)
    _launch_attention(backend, c, layout, 1, 8)
    options = rt.compiles[0][1]
    assert ("-DFA_THREADS=512" in options) is (threads == 512)
    assert not any(o.startswith("-DFA_THREADS") for o in options) or threads != 128
    kernels = ["attention_split", "attention_combine"] if splits > 1 else ["attention_split"]
    assert [launch.kernel for launch in rt.launches] == kernels
    assert {launch.block for launch in rt.launches} == {(threads, 1, 1)}
    backend.close()


@pytest.mark.parametrize(
    ("rows", "context", "heads", "short"),
    [
        (1, 256, 9, True),
        (1, 512, 9, True),
        (1, 513, 9, False),
        (2, 256, 9, False),
        (1, 256, 32, False),
    ],  # fmt: skip
    ids=["one-row", "at-the-bound", "past-it", "two-rows", "wide-row-overlapped"],
)
def test_attention_bounded_is_one_launch_at_one_row_within_short_context(
    rows: int, context: int, heads: int, short: bool
) -> None:
    """short_context 512: attention_bounded at one row within the bound, where the query
    row is narrower than overlap_attention_min_q (2,048 values: 32 heads of 64 are not), is
    attention_split alone, one split of short_context_threads from its own module
    (-DFA_THREADS=512); otherwise op_attention's split and combine launches."""
    backend, rt = make()
    backend.short_context = 512
    assert backend.context_classes == (512,)
    c = OpCase(backend)
    kv_heads = 3 if heads == 9 else 8  # the 135M shape's 9 / 3 heads, the 1B shape's 32 / 8
    layout = vt.KVLayout(n_layers=1, n_slots=2, max_len=1024, n_kv_heads=kv_heads, head_dim=64)
    _launch_attention(backend, c, layout, rows, heads, "attention_bounded", context=context)
    kernels = [launch.kernel for launch in rt.launches]
    if short:
        (launch,) = rt.launches
        assert kernels == ["attention_split"] and launch.block == (512, 1, 1)
        assert launch.grid == (1, 9, 1) and karg(launch, "splits") == 1 and not launch.args[1]
        name, options = rt.compiles[-1]
        assert name == "vt_attention_t512.cu" and "-DFA_THREADS=512" in options
        _launch_attention(backend, c, layout, rows, heads)
        plain = rt.launches[1]  # the attention group's module's attention_split
        assert plain.block == (128, 1, 1) and plain.fn.split(":")[0] != launch.fn.split(":")[0]
    else:
        assert kernels == ["attention_split", "attention_combine"]
        assert {launch.block for launch in rt.launches} == {(128, 1, 1)}
        assert [name for name, _ in rt.compiles] == ["vt_attention.cu"]
    backend.close()


def test_short_context_compiles_its_module_once_and_only_where_it_differs() -> None:
    """prepare() compiles the short path's module where short_context is set; with
    short_context_threads equal to attention_threads the attention group's module serves;
    bad settings are refused by name before anything compiles."""
    modules = EVERY
    backend, rt = make()
    backend.short_context = 256
    backend.prepare()
    backend.prepare()
    assert [name for name, _ in rt.compiles] == [*modules, "vt_attention_t512.cu"]
    backend.close()
    backend, rt = make()
    backend.short_context, backend.short_context_threads = 256, 128
    backend.prepare()
    assert [name for name, _ in rt.compiles] == modules
    backend.close()
    for attr, bad, match in (
        ("short_context", -1, r"short_context is -1; 0 \(off\)"),
        ("short_context", 1.5, r"short_context is 1.5"),
        ("short_context_threads", 100, r"short_context_threads is 100.*128, 256, 512 threads"),
    ):
        backend, rt = make()
        backend.short_context = 256
        setattr(backend, attr, bad)
        with pytest.raises(ValueError, match=match):
            backend.prepare()
        assert [name for name, _ in rt.compiles] in ([], modules[:1], modules)
        backend.close()


def test_attention_threads_the_kernels_do_not_compile_for_are_refused_by_name() -> None:
    backend, rt = make()
    backend.attention_threads = 100
    with pytest.raises(ValueError, match=r"attention_threads is 100.*128, 256, 512 threads"):
        backend.prepare()
    assert rt.compiles == []  # nothing compiled
    backend.close()


def _attention_then(backend: FakeGpu, c: OpCase, n: int, hd: int, between: str = "") -> vt.Tensor:
    """attention at n rows (2 KV heads of hd, 4 query heads), then matmul_add of its output
    by a Q8_0 weight; ``between``: "add" launches an op between the two, "other x" gives
    the projection another x of the same shape. Attention's out."""
    rng = np.random.default_rng(n + hd)
    layout = vt.KVLayout(n_layers=1, n_slots=n, max_len=16, n_kv_heads=2, head_dim=hd)
    s = backend.create_stream()
    out = c.t("attn", F32, n, 4 * hd)
    w = c.w("wo", rng.standard_normal((32, 4 * hd)).astype(np.float32), "Q8_0")  # uploaded first
    backend.launch("attention", s, out=out, q=c.t("q", F32, n, 4 * hd),
                   cache=c.t("cache", F32, *layout.shape), slots=c.t("slots", I32, n),
                   positions=c.t("pos", I32, n), layout=layout, layer=0, n_heads=4,
                   scale=0.125)  # fmt: skip
    x = out
    if between == "add":
        backend.launch("add", s, out=c.t("sum", F32, n, 4 * hd), a=out, b=out)
    elif between == "other x":
        x = c.t("x", F32, n, 4 * hd)
    y = c.t("y", F32, n, 32)
    backend.launch("matmul_add", s, out=y, x=x, weight=w, residual=y,
                   scratch=c.t("s", F32, n, 32))  # fmt: skip
    return out


@pytest.mark.parametrize(("n", "hd", "splits"), [(8, 64, 32), (8, 64, 1), (33, 128, 32)])
def test_attention_hands_its_int8_rows_to_the_projection_after_it(
    n: int, hd: int, splits: int
) -> None:
    """attention_q8a (on by default): at int8 rows the attention kernel that writes the
    output (attention_combine, or attention_split at one split) gets the int8 scratch as xq
    and the projection after it reads that scratch as x with no quantize_rows launch."""
    assert GpuBackend.attention_q8a
    backend, rt = make()
    backend.int8_mma, backend.int8_min_values = True, 0
    backend.attention_max_splits = splits
    out = _attention_then(backend, OpCase(backend), n, hd)
    launches = rt.launches
    kernels = [la.kernel for la in launches]
    tiles = 1 if n == 8 else 8
    combine = ["attention_combine"] if splits > 1 else []
    assert kernels == ["attention_split", *combine, f"matmul_mma{tiles}_q8a"]
    split, writer, mma = launches[0], launches[-2], launches[-1]
    xq = karg(writer, "xq")
    assert xq and karg(split, "xq") == xq and mma.args[1] == xq  # x
    assert karg(writer, "out") == int(out.buffer.handle)
    backend.close()


@pytest.mark.parametrize(
    ("n", "hd", "between", "on"),
    [
        (8, 64, "add", True),  # an op between: the hand-off is dropped
        (8, 64, "other x", True),  # the projection's x is not attention's output
        (8, 64, "", False),  # attention_q8a off
        (8, 48, "", True),  # head_dim 48: a head is not whole blocks of 32
        (4, 64, "", True),  # under int8_min_rows: the projection takes float x
        (64, 64, "", True),  # the tiled attention's rows
    ],
)
def test_the_projection_packs_x_itself_where_attention_handed_nothing(
    n: int, hd: int, between: str, on: bool
) -> None:
    """Without a hand-off for its very x right after the attention op (or with the setting
    off, heads not whole blocks of 32, rows outside 8-63), the attention kernels get xq 0
    or the projection runs quantize_rows (or no int8 step at all) as before."""
    backend, rt = make()
    backend.int8_mma, backend.int8_min_values, backend.attention_q8a = True, 0, on
    backend.int8_mma_first = True  # 64 rows on the mma kernels too
    _attention_then(backend, OpCase(backend), n, hd, between)
    kernels = [la.kernel for la in rt.launches]
    handed = [karg(la, "xq") for la in rt.launches if la.kernel.startswith("attention_s")]
    if between:
        assert handed[0]  # packed, then not taken
        assert kernels[-2:] == ["quantize_rows", "matmul_mma1_q8a"]
    elif n < 8:
        assert not any(handed) and not any(k.startswith("quantize") for k in kernels)
    else:
        assert not any(handed), kernels
        assert "quantize_rows" in kernels
    backend.close()


@pytest.mark.parametrize("work", ["memset", "copy_d2d", "copy_h2d_async", "graph"])
def test_work_between_attention_and_the_projection_drops_the_hand_off(work: str) -> None:
    """A memset, a copy or a graph's replay between the attention op and the projection of
    its output may write that output: the projection packs x itself (quantize_rows)."""
    backend, rt = make()
    backend.int8_mma, backend.int8_min_values = True, 0
    c = OpCase(backend)
    s = backend.create_stream()
    layout = vt.KVLayout(n_layers=1, n_slots=8, max_len=16, n_kv_heads=2, head_dim=64)
    out = c.t("attn", F32, 8, 256)
    graph = None
    if work == "graph":
        backend.begin_capture(s)
        backend.launch("add", s, out=c.t("g", F32, 1, 4), a=c.t("ga", F32, 1, 4),
                       b=c.t("gb", F32, 1, 4))  # fmt: skip
        graph = backend.end_capture(s)
    backend.launch("attention", s, out=out, q=c.t("q", F32, 8, 256),
                   cache=c.t("cache", F32, *layout.shape), slots=c.t("slots", I32, 8),
                   positions=c.t("pos", I32, 8), layout=layout, layer=0, n_heads=4,
                   scale=0.125)  # fmt: skip
    if work == "memset":
        backend.memset(out.buffer, 0, s)
    elif work == "copy_d2d":
        backend.copy_d2d(out.buffer, c.t("other", F32, 8, 256).buffer, 8 * 256 * 4, s)
    elif work == "copy_h2d_async":
        backend.copy_h2d_async(out.buffer, np.zeros((8, 256), np.float32), s)
    else:
        assert graph is not None
        backend.launch_graph(graph, s)
    w = c.w("wo", np.ones((32, 256), np.float32), "Q8_0")
    y = c.t("y", F32, 8, 32)
    backend.launch("matmul_add", s, out=y, x=out, weight=w, residual=y,
                   scratch=c.t("s", F32, 8, 32))  # fmt: skip
    kernels = [la.kernel for la in rt.launches]
    assert kernels[-2:] == ["quantize_rows", "matmul_mma1_q8a"], kernels
    backend.close()


def test_prefetch_rides_on_the_next_attention_launch() -> None:
    """GpuBackend.prefetch_bytes: the op ``prefetch`` (declared only where it is above 0)
    launches nothing; the next attention's split kernel gets its weights' byte ranges (the
    first weight whole, then the same leading share of the pair's codes and scales, in
    128-byte lines, within the budget), and the one after it none; freeing a weight drops a
    pending hint; a weight this backend did not upload and a mismatched pair are refused by
    name (a negative budget: test_a_negative_setting_is_refused_by_name_before_any_compile)."""
    backend, rt = make()
    assert not backend.supports("prefetch")  # 0 by default: nothing to launch
    backend.prefetch_bytes = 20_000
    assert backend.supports("prefetch")
    c = OpCase(backend)
    rng = np.random.default_rng(3)
    wo = c.w("wo", rng.standard_normal((16, 256)).astype(np.float32), "Q8_0")
    gate = c.w("gate", rng.standard_normal((64, 256)).astype(np.float32), "Q8_0")
    up = c.w("up", rng.standard_normal((64, 256)).astype(np.float32), "Q8_0")
    o, g, u = (w.handle for w in (wo, gate, up))
    layout = vt.KVLayout(n_layers=1, n_slots=2, n_kv_heads=2, head_dim=64, max_len=8)
    stream = backend.create_stream()

    def attention() -> VtPrefetch:
        rt.launches.clear()
        buf, ints = backend.alloc(8 * 64 * 4), backend.alloc(4)
        backend.launch(
            "attention", stream, out=vt.Tensor.of(buf, F32, 1, 8 * 64),
            q=vt.Tensor.of(buf, F32, 1, 8 * 64),
            cache=vt.Tensor.of(backend.alloc(layout.nbytes), F32, *layout.shape),
            slots=vt.Tensor.of(ints, I32, 1), positions=vt.Tensor.of(ints, I32, 1),
            layout=layout, layer=0, n_heads=8, scale=0.1,
        )  # fmt: skip
        split = rt.launches[0]
        assert split.kernel == "attention_split"
        pf = split.ctypes_args[-1]
        assert isinstance(pf, VtPrefetch)
        return pf

    backend.launch("prefetch", stream, weight=wo)
    backend.launch("prefetch", stream, weight=gate, paired=up)
    assert rt.launches == []
    pf = attention()
    got = [(pf.p[r] or 0, pf.n[r]) for r in range(6)]
    whole = o.buffer.nbytes
    share = (20_000 - whole) / (g.buffer.nbytes + u.buffer.nbytes)
    codes, scales = g.scales - g.data, g.buffer.nbytes - (g.scales - g.data)

    def lines(size: int) -> int:
        return min(size, -(-int(size * share) // 128) * 128)

    assert got == [(o.data, whole), (g.data, lines(codes)), (g.scales, lines(scales)),
                   (u.data, lines(codes)), (u.scales, lines(scales)), (0, 0)]  # fmt: skip
    assert 0 < share < 1 and sum(n for _, n in got) <= 20_000 + 4 * 128
    assert not any(attention().n)  # taken by the launch before
    backend.prefetch_bytes = 1 << 30  # every byte of every weight, each whole
    backend.launch("prefetch", stream, weight=gate, paired=up)
    pf = attention()
    assert [(pf.p[r], pf.n[r]) for r in range(2)] == [(g.data, g.buffer.nbytes),
                                                      (u.data, u.buffer.nbytes)]  # fmt: skip
    backend.launch("prefetch", stream, weight=wo)
    backend.free_weight(up)
    assert not any(attention().n)  # the hint named a weight now freed: dropped
    stranger = vt.Weight("x", (16, 256), "a handle of another backend", wo.ggml_type)
    with pytest.raises(ValueError, match="prefetch: weight 'x' was not uploaded by"):
        backend.launch("prefetch", stream, weight=stranger)
    with pytest.raises(ValueError, match="op prefetch: weight paired"):
        backend.launch("prefetch", stream, weight=wo, paired=gate)  # 64 rows against 16
    assert not any(attention().n)  # neither refused hint was kept
    backend.close()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("mma_sw1_wave_blocks", r"mma_sw1_wave_blocks is -1; 0 \(never\) or"),
        ("prefetch_bytes", r"prefetch_bytes is -1; 0 \(no prefetch hint\) or"),
    ],
)
def test_a_negative_setting_is_refused_by_name_before_any_compile(
    setting: str, message: str
) -> None:
    backend, rt = make()
    setattr(backend, setting, -1)
    with pytest.raises(ValueError, match=message):
        backend.prepare()
    assert rt.compiles == []
    backend.close()
