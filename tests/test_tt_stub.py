"""The TT stub: discrete-device semantics on the host (opaque memory, copies only)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import vt
from vt import reference as ref
from vt.audit import audit
from vt.registry import Registry
from vt_tt_stub import TtStubBackend
from vt_tt_stub.plugin import vt_register_backends


@pytest.fixture
def tt() -> TtStubBackend:
    return TtStubBackend()


def upload(tt: TtStubBackend, a: np.ndarray) -> vt.Buffer:
    buf = tt.alloc(a.nbytes)
    tt.copy_h2d(buf, np.ascontiguousarray(a))
    return buf


def download(tt: TtStubBackend, buf: vt.Buffer, dtype=np.float32) -> np.ndarray:
    out = np.empty(buf.nbytes, np.uint8)
    tt.copy_d2h(out, buf)
    return out.view(dtype)


def test_declares_a_discrete_device_and_says_it_is_emulated() -> None:
    seen: list[type] = []
    vt_register_backends(seen.append)
    assert seen == [TtStubBackend]
    probe = TtStubBackend.probe()
    assert probe.available and "emulated" in probe.reason and "emulated" in probe.device
    caps = probe.capabilities
    assert caps is not None and caps.vmm is None
    assert not any(
        getattr(caps, f)
        for f in (
            "unified_memory",
            "device_memory_is_host_addressable",
            "events",
            "pinned_host_memory",
            "async_d2h_copy",
            "supports_async_sampled_token_readback",
        )
    )
    entry = Registry(env={}).get("tt_stub")
    assert entry is not None and entry.status.value == "available" and not entry.violations
    assert "emulated stub" in entry.reason


def test_audit_passes() -> None:
    report = audit("tt_stub", Registry(env={}))
    assert report.ok, report.model_dump_json(indent=1)


def test_host_view_raises_and_handles_are_opaque(tt: TtStubBackend) -> None:
    buf = upload(tt, np.arange(16, dtype=np.uint8))
    for view in (buf, buf.view(4, 8)):
        with pytest.raises(vt.HostAccessError, match="'tt_stub'.*not host-addressable"):
            tt.host_view(view)
    assert not isinstance(buf.handle, np.ndarray)
    assert np.asarray(buf.handle).dtype == object  # numpy cannot see through it either
    w = tt.upload_weight(vt.WeightTensor("w", 0, (2, 2), np.eye(2, dtype=np.float32)))
    assert not isinstance(w.handle, np.ndarray) and "tt_stub" in repr(w.handle)
    with pytest.raises(vt.KernelNotImplementedError, match="vmm_reserve"):
        tt.vmm_reserve(1 << 20)


def test_copies_round_trip_with_offsets(tt: TtStubBackend) -> None:
    buf = upload(tt, np.arange(64, dtype=np.uint8))
    tt.copy_h2d(buf.view(10, 3), np.array([200, 201, 202], np.uint8))
    tt.memset(buf.view(20, 2), 9)
    got = download(tt, buf.view(8, 16), np.uint8)
    assert got.tolist() == [8, 9, 200, 201, 202, 13, 14, 15, 16, 17, 18, 19, 9, 9, 22, 23]
    stream = tt.create_stream("s")
    other = tt.alloc(8)
    tt.copy_d2d(other, buf.view(10, 8), 8, stream)
    host = tt.alloc_pinned(8)
    assert host.pinned is False  # the base's pageable memory: no pinned memory declared
    tt.copy_d2h_async(host, other, stream)
    tt.synchronize(stream)
    assert host.array.tolist() == [200, 201, 202, 13, 14, 15, 16, 17]
    tt.copy_h2d_async(other, np.zeros(8, np.uint8), stream)
    tt.synchronize(stream)
    assert download(tt, other, np.uint8).tolist() == [0] * 8
    tt.destroy_stream(stream)


def test_foreign_buffers_and_weights_are_refused(tt: TtStubBackend) -> None:
    cpu_like = vt.Buffer(np.zeros(8, np.uint8), 8, 0, "cpu")
    with pytest.raises(ValueError, match="backend 'cpu' is not tt_stub device memory"):
        tt.copy_d2h(np.empty(8, np.uint8), cpu_like)
    w = vt.Weight("w", (2, 2), np.eye(2, dtype=np.float32))
    with pytest.raises(ValueError, match="weight 'w' was not uploaded to tt_stub"):
        tt.matmul(tt.alloc(16), tt.alloc(16), w, 2, tt.create_stream())


def test_free_weight_lets_go_of_the_weight_memory(tt: TtStubBackend) -> None:
    w = tt.upload_weight(vt.WeightTensor("w", 0, (2, 2), np.eye(2, dtype=np.float32)))
    memory = weakref.ref(w.handle._array)
    tt.free_weight(w)
    tt.free_weight(w)  # idempotent
    gc.collect()
    assert memory() is None
    with pytest.raises(ValueError, match="weight 'w' was freed"):
        tt.matmul(tt.alloc(16), tt.alloc(16), w, 2, tt.create_stream())
    with pytest.raises(ValueError, match="weight 'x' was not uploaded to tt_stub"):
        tt.free_weight(vt.Weight("x", (2, 2), np.eye(2, dtype=np.float32)))


def test_kernels_equal_the_reference(tt: TtStubBackend) -> None:
    rng = np.random.default_rng(3)
    s = tt.create_stream("main")
    x = rng.standard_normal((2, 8)).astype(np.float32)
    w = rng.standard_normal((4, 8)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    wt = tt.upload_weight(vt.WeightTensor("w", 0, (4, 8), w))
    bt = tt.upload_weight(vt.WeightTensor("b", 0, (4,), b))
    out = tt.alloc(2 * 4 * 4)
    tt.matmul(out, upload(tt, x), wt, 2, s, bias=bt)
    gate, up = upload(tt, x.reshape(-1)), upload(tt, x.reshape(-1)[::-1].copy())
    act = tt.alloc(64)
    tt.silu_mul(act, gate, up, 16, s)
    rows = tt.alloc(2 * 8 * 4)
    tt.gather_rows(rows, upload(tt, x), upload(tt, np.array([1, 0], np.int32)), 2, 8, s)
    logits = rng.standard_normal((3, 40)).astype(np.float32)
    sp = np.zeros(3, vt.SAMPLE_PARAMS_DTYPE)
    sp["temperature"], sp["top_p"], sp["top_k"] = [0.0, 1.0, 0.8], [1.0, 0.9, 1.0], [0, 0, 5]
    sp["seed"], sp["counter"] = 11, [0, 1, 2]
    ids = tt.alloc(12)
    tt.sample(ids, upload(tt, logits), upload(tt, sp), 3, 40, s)
    tt.synchronize(s)
    assert np.allclose(download(tt, out).reshape(2, 4), ref.matmul(x, w, b), atol=1e-5)
    assert np.allclose(download(tt, act), ref.silu_mul(x.reshape(-1), x.reshape(-1)[::-1]))
    assert np.array_equal(download(tt, rows).reshape(2, 8), x[[1, 0]])
    assert np.array_equal(download(tt, ids, np.int32), ref.sample(logits, sp))


def test_kernel_errors_raise_at_the_call(tt: TtStubBackend) -> None:
    s = tt.create_stream()
    table = tt.upload_weight(vt.WeightTensor("emb", 0, (4, 2), np.ones((4, 2), np.float32)))
    with pytest.raises(ValueError, match="embedding: token id 7 is out of range"):
        tt.embedding(tt.alloc(8), table, upload(tt, np.array([7], np.int32)), 1, s)
