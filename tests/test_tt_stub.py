"""The TT stub: discrete-device semantics on the host (opaque memory, copies only)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import vt
from vt import reference as ref
from vt.management.audit import audit
from vt.management.registry import Registry
from vt_tt_stub import TtStubBackend
from vt_tt_stub.plugin import vt_register_backends

F32, I32 = np.dtype(np.float32), np.dtype(np.int32)


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


def t(buf: vt.Buffer, *shape: int, dtype=F32) -> vt.Tensor:
    """A typed tensor over ``buf`` (raises if it does not fit)."""
    return vt.Tensor.of(buf, dtype, *shape)


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
    assert TtStubBackend.emulated  # never chosen by `auto`, only by name
    # nothing that needs code is derived either: no capability mixin is implemented
    derived = TtStubBackend().capabilities
    assert not any(
        getattr(derived, f)
        for f in (
            "events",
            "pinned_host_memory",
            "async_d2h_copy",
            "graphs",
            "supports_async_sampled_token_readback",
        )
    )
    # only the primitive ops: a fused op runs as its decomposition
    assert TtStubBackend.op_names() == vt.PRIMITIVE_OPS
    assert not any(TtStubBackend().supports(op) for op in vt.FUSED_OPS)
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
    with pytest.raises(vt.CapabilityError, match="'tt_stub' does not implement vt.VirtualMemory"):
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
    with pytest.raises(
        ValueError, match="copy_d2h src: buffer of backend 'cpu' passed to 'tt_stub'"
    ):
        tt.copy_d2h(np.empty(8, np.uint8), cpu_like)
    # a buffer that names no backend still is not tt_stub memory: the backend refuses it
    anonymous = vt.Buffer(np.zeros(8, np.uint8), 8)
    with pytest.raises(ValueError, match="is not tt_stub device memory"):
        tt.copy_d2h(np.empty(8, np.uint8), anonymous)
    w = vt.Weight("w", (2, 2), np.eye(2, dtype=np.float32))
    s = tt.create_stream()
    with pytest.raises(ValueError, match="weight 'w' was not uploaded to tt_stub"):
        tt.launch("matmul", s, out=t(tt.alloc(16), 2, 2), x=t(tt.alloc(16), 2, 2), weight=w)


def test_free_weight_lets_go_of_the_weight_memory(tt: TtStubBackend) -> None:
    w = tt.upload_weight(vt.WeightTensor("w", 0, (2, 2), np.eye(2, dtype=np.float32)))
    memory = weakref.ref(w.handle._array)
    tt.free_weight(w)
    tt.free_weight(w)  # idempotent
    gc.collect()
    assert memory() is None
    with pytest.raises(ValueError, match="op matmul: weight 'w' was freed"):
        tt.launch(
            "matmul",
            tt.create_stream(),
            out=t(tt.alloc(16), 2, 2),
            x=t(tt.alloc(16), 2, 2),
            weight=w,
        )
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
    tt.launch("matmul", s, out=t(out, 2, 4), x=t(upload(tt, x), 2, 8), weight=wt, bias=bt)
    gate, up = upload(tt, x.reshape(-1)), upload(tt, x.reshape(-1)[::-1].copy())
    act = tt.alloc(64)
    tt.launch("silu_mul", s, out=t(act, 1, 16), gate=t(gate, 1, 16), up=t(up, 1, 16))
    rows = tt.alloc(2 * 8 * 4)
    tt.launch(
        "gather_rows",
        s,
        out=t(rows, 2, 8),
        x=t(upload(tt, x), 2, 8),
        rows=t(upload(tt, np.array([1, 0], np.int32)), 2, dtype=I32),
    )
    logits = rng.standard_normal((3, 40)).astype(np.float32)
    sp = np.zeros(3, vt.SAMPLE_PARAMS_DTYPE)
    sp["temperature"], sp["top_p"], sp["top_k"] = [0.0, 1.0, 0.8], [1.0, 0.9, 1.0], [0, 0, 5]
    sp["seed"], sp["counter"] = 11, [0, 1, 2]
    ids = tt.alloc(12)
    tt.launch(
        "sample",
        s,
        out=t(ids, 3, dtype=I32),
        logits=t(upload(tt, logits), 3, 40),
        params=t(upload(tt, sp), 3, dtype=vt.SAMPLE_PARAMS_DTYPE),
    )
    tt.synchronize(s)
    assert np.allclose(download(tt, out).reshape(2, 4), ref.matmul(x, w, b), atol=1e-5)
    assert np.allclose(download(tt, act), ref.silu_mul(x.reshape(-1), x.reshape(-1)[::-1]))
    assert np.array_equal(download(tt, rows).reshape(2, 8), x[[1, 0]])
    assert np.array_equal(download(tt, ids, np.int32), ref.sample(logits, sp))


def test_kernel_errors_raise_at_the_call(tt: TtStubBackend) -> None:
    s = tt.create_stream()
    table = tt.upload_weight(vt.WeightTensor("emb", 0, (4, 2), np.ones((4, 2), np.float32)))
    ids = t(upload(tt, np.array([7], np.int32)), 1, dtype=I32)
    with pytest.raises(ValueError, match="embedding: token id 7 is out of range"):
        tt.launch("embedding", s, out=t(tt.alloc(8), 1, 2), ids=ids, table=table)


def test_fused_ops_run_as_their_decomposition_and_equal_the_reference(
    tt: TtStubBackend,
) -> None:
    rng = np.random.default_rng(4)
    s = tt.create_stream("fused")
    launched: list[str] = []
    plain_dispatch = tt._dispatch

    def dispatch(op: str, stream: vt.Stream, args: dict) -> None:
        launched.append(op)
        plain_dispatch(op, stream, args)

    tt._dispatch = dispatch  # type: ignore[method-assign]  # the decomposition runs through it
    n, dim, ffn = 3, 8, 12
    x = rng.standard_normal((n, dim)).astype(np.float32)
    res = rng.standard_normal((n, dim)).astype(np.float32)
    wo = rng.standard_normal((dim, dim)).astype(np.float32)
    wg, wu = (rng.standard_normal((ffn, dim)).astype(np.float32) for _ in range(2))
    w = {
        k: tt.upload_weight(vt.WeightTensor(k, 0, a.shape, a))
        for k, a in (("wo", wo), ("wg", wg), ("wu", wu))
    }
    out = tt.alloc(x.nbytes)
    tt.launch(
        "matmul_add",
        s,
        out=t(out, n, dim),
        x=t(upload(tt, x), n, dim),
        weight=w["wo"],
        residual=t(upload(tt, res), n, dim),
        scratch=t(tt.alloc(x.nbytes), n, dim),
    )
    assert launched == ["matmul_add", "matmul", "add"]
    launched.clear()
    act = tt.alloc(n * ffn * 4)
    tt.launch(
        "swiglu",
        s,
        out=t(act, n, ffn),
        x=t(upload(tt, x), n, dim),
        gate=w["wg"],
        up=w["wu"],
        scratch_gate=t(tt.alloc(n * ffn * 4), n, ffn),
        scratch_up=t(tt.alloc(n * ffn * 4), n, ffn),
    )
    assert launched == ["swiglu", "matmul", "matmul", "silu_mul"]
    tt.synchronize(s)
    assert np.allclose(download(tt, out).reshape(n, dim), res + ref.matmul(x, wo), atol=1e-5)
    want = ref.silu_mul(ref.matmul(x, wg), ref.matmul(x, wu))
    assert np.allclose(download(tt, act).reshape(n, ffn), want, atol=1e-5)


def test_rope_kv_store_decomposes_into_rope_and_kv_store(tt: TtStubBackend) -> None:
    rng = np.random.default_rng(5)
    s = tt.create_stream("rope")
    layout = vt.KVLayout(n_layers=1, n_slots=2, max_len=4, n_kv_heads=1, head_dim=4)
    params = vt.RopeParams(head_dim=4, base=50.0)
    n, n_heads = 3, 2
    q = rng.standard_normal((n, n_heads * 4)).astype(np.float32)
    k, v = (rng.standard_normal((n, 4)).astype(np.float32) for _ in range(2))
    slots, pos = np.array([0, 1, 0], np.int32), np.array([0, 0, 1], np.int32)
    qb, kb, cache = upload(tt, q), upload(tt, k), tt.alloc(layout.nbytes)
    tt.memset(cache, 0)
    tt.launch(
        "rope_kv_store",
        s,
        q=t(qb, n, 8),
        k=t(kb, n, 4),
        v=t(upload(tt, v), n, 4),
        positions=t(upload(tt, pos), n, dtype=I32),
        slots=t(upload(tt, slots), n, dtype=I32),
        cache=t(cache, *layout.shape),
        layout=layout,
        layer=0,
        n_heads=n_heads,
        params=params,
    )
    tt.synchronize(s)
    want_q, want_k = ref.rope(q, pos, n_heads, params), ref.rope(k, pos, 1, params)
    want_cache = np.zeros(layout.shape, np.float32)
    ref.kv_store(want_cache, 0, want_k, v, slots, pos)
    assert np.allclose(download(tt, qb).reshape(n, 8), want_q, atol=1e-6)
    assert np.allclose(download(tt, kb).reshape(n, 4), want_k, atol=1e-6)
    assert np.allclose(download(tt, cache).reshape(layout.shape), want_cache, atol=1e-6)
