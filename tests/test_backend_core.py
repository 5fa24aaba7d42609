"""The core's argument checks: once, in :class:`vt.Backend`, for every backend.

Each bad call raises at the call site with a message naming the call and the problem,
before any hook runs: nothing is written, nothing is enqueued, and the backend (and its
stream) go on working. Run on cpu (host-addressable, asynchronous worker streams) and on
tt_stub (discrete, synchronous), plus a backend with only the required core.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import vt
from vt import reference as ref
from vt_cpu import CpuBackend
from vt_tt_stub import TtStubBackend

F32, I32, U8 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint8)
BACKENDS: dict[str, Callable[[], vt.Backend]] = {"cpu": CpuBackend, "tt_stub": TtStubBackend}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Iterator[vt.Backend]:
    b = BACKENDS[request.param]()
    yield b
    b.close()


@pytest.fixture
def stream(backend: vt.Backend) -> Iterator[vt.Stream]:
    s = backend.create_stream("core")
    yield s
    backend.destroy_stream(s)


@pytest.fixture
def other(backend: vt.Backend) -> Iterator[vt.Backend]:
    """The other built-in backend: its buffers are foreign to ``backend``."""
    b = BACKENDS["tt_stub" if backend.name == "cpu" else "cpu"]()
    yield b
    b.close()


def t(buf: vt.Buffer, *shape: int, dtype: np.dtype = F32) -> vt.Tensor:
    return vt.Tensor.of(buf, dtype, *shape)


def put(backend: vt.Backend, a: np.ndarray) -> vt.Buffer:
    buf = backend.alloc(a.nbytes)
    backend.copy_h2d(buf, np.ascontiguousarray(a))
    return buf


def get(backend: vt.Backend, buf: vt.Buffer, dtype: np.dtype = U8) -> np.ndarray:
    out = np.empty(buf.nbytes, np.uint8)
    backend.copy_d2h(out, buf)
    return out.view(dtype)


def assert_usable(backend: vt.Backend, stream: vt.Stream) -> None:
    """Memory, copies, a stream memset and an op all still work, and the stream carries
    no error from the refused calls."""
    backend.synchronize(stream)
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    out, other = backend.alloc(a.nbytes), backend.alloc(16)
    backend.launch(
        "add", stream, out=t(out, 2, 4), a=t(put(backend, a), 2, 4), b=t(put(backend, a), 2, 4)
    )
    backend.memset(other, 0xAB, stream)
    backend.synchronize(stream)
    assert np.array_equal(get(backend, out, F32).reshape(2, 4), 2 * a)
    assert np.all(get(backend, other) == 0xAB)
    backend.free(out)
    backend.free(other)


def esc(value: object) -> str:
    return re.escape(repr(value))


# --------------------------------------------------------------------------- sizes

BAD_SIZES = [-1, -4096, 1.5, 8.0, True, "8", None, np.float64(8)]


@pytest.mark.parametrize("bad", BAD_SIZES, ids=repr)
def test_sizes_must_be_non_negative_integers(
    backend: vt.Backend, stream: vt.Stream, bad: Any
) -> None:
    with pytest.raises(
        ValueError, match=f"alloc: size must be a non-negative integer, got {esc(bad)}"
    ):
        backend.alloc(bad)
    with pytest.raises(ValueError, match="alloc_pinned: size must be a non-negative integer"):
        backend.alloc_pinned(bad)
    dst, src = backend.alloc(8), put(backend, np.arange(8, dtype=np.uint8))
    with pytest.raises(ValueError, match="copy_d2d: size must be a non-negative integer"):
        backend.copy_d2d(dst, src, bad, stream)
    backend.memset(dst, 0)
    backend.synchronize(stream)
    assert np.all(get(backend, dst) == 0)  # nothing was copied
    assert_usable(backend, stream)


def test_numpy_integer_sizes_are_sizes(backend: vt.Backend, stream: vt.Stream) -> None:
    buf = backend.alloc(np.int64(8))
    assert buf.nbytes == 8 and type(buf.nbytes) is int and buf.owner == backend.name
    assert backend.alloc(0).nbytes == 0
    backend.copy_d2d(buf, put(backend, np.ones(8, np.uint8)), np.uint32(8), stream)
    backend.synchronize(stream)
    assert np.all(get(backend, buf) == 1)


# --------------------------------------------------------------------------- memset


@pytest.mark.parametrize("bad", [256, -1, 1000, 1.0, True, "7", None, np.float32(3)], ids=repr)
def test_memset_value_must_be_a_byte(backend: vt.Backend, stream: vt.Stream, bad: Any) -> None:
    buf = backend.alloc(8)
    backend.memset(buf, 5)
    with pytest.raises(ValueError, match=f"^memset: value {esc(bad)} is not a byte$"):
        backend.memset(buf, bad)
    with pytest.raises(ValueError, match="memset: value .* is not a byte"):
        backend.memset(buf, bad, stream)
    backend.synchronize(stream)
    assert np.all(get(backend, buf) == 5)
    for value in (0, 255, np.uint8(7)):
        backend.memset(buf, value)
        assert np.all(get(backend, buf) == value)
    assert_usable(backend, stream)


# --------------------------------------------------------------------------- foreign buffers


def test_foreign_buffers_are_refused_naming_both_backends(
    backend: vt.Backend, other: vt.Backend, stream: vt.Stream
) -> None:
    foreign = put(other, np.full(8, 3, np.uint8))
    own = backend.alloc(8)
    data = np.zeros(8, np.uint8)
    pinned = backend.alloc_pinned(8)
    names = f"buffer of backend {other.name!r} passed to {backend.name!r}"
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("copy_h2d dst", lambda: backend.copy_h2d(foreign, data)),
        ("copy_d2h src", lambda: backend.copy_d2h(np.empty(8, np.uint8), foreign)),
        ("copy_h2d_async dst", lambda: backend.copy_h2d_async(foreign, data, stream)),
        ("copy_d2h_async src", lambda: backend.copy_d2h_async(pinned, foreign, stream)),
        ("copy_d2d dst", lambda: backend.copy_d2d(foreign, own, 8, stream)),
        ("copy_d2d src", lambda: backend.copy_d2d(own, foreign, 8, stream)),
        ("memset", lambda: backend.memset(foreign, 0)),
        ("memset", lambda: backend.memset(foreign, 0, stream)),
        ("free", lambda: backend.free(foreign)),
        (
            "op add",
            lambda: backend.launch(
                "add", stream, out=t(own, 1, 2), a=t(foreign, 1, 2), b=t(own, 1, 2)
            ),
        ),
    ]
    for what, call in calls:
        with pytest.raises(ValueError, match=f"^{re.escape(what)}: {re.escape(names)}$"):
            call()
    with pytest.raises(TypeError, match="copy_h2d dst: expected a vt.Buffer, got ndarray"):
        backend.copy_h2d(np.zeros(8, np.uint8), data)  # type: ignore[arg-type]
    backend.synchronize(stream)
    assert np.all(get(other, foreign) == 3)  # the other backend's memory was not touched
    assert_usable(backend, stream)
    assert_usable(other, other.create_stream("other"))


def test_host_view_of_a_foreign_buffer_is_refused() -> None:
    cpu, tt = CpuBackend(), TtStubBackend()
    with pytest.raises(ValueError, match="host_view: buffer of backend 'tt_stub' passed to 'cpu'"):
        cpu.host_view(tt.alloc(8))
    assert cpu.host_view(cpu.alloc(8)).nbytes == 8
    cpu.close()


# --------------------------------------------------------------------------- host arrays


def test_host_arrays_must_fit_the_device_buffer(backend: vt.Backend, stream: vt.Stream) -> None:
    own = put(backend, np.arange(8, dtype=np.uint8))
    big, pinned = backend.alloc(16), backend.alloc_pinned(16)
    calls: list[tuple[str, Callable[[], Any]]] = [
        (
            "copy_h2d: 16 bytes do not fit the buffer of 8",
            lambda: backend.copy_h2d(own, np.ones(16, np.uint8)),
        ),
        (
            "copy_h2d: 12 bytes do not fit the buffer of 8",
            lambda: backend.copy_h2d(own, np.ones(3, np.float32)),
        ),
        (
            "copy_h2d: 8 bytes do not fit the buffer of 4",
            lambda: backend.copy_h2d(own.view(4, 4), np.ones(8, np.uint8)),
        ),
        (
            "copy_d2h: 16 bytes do not fit the buffer of 8",
            lambda: backend.copy_d2h(np.empty(16, np.uint8), own),
        ),
        (
            "copy_h2d_async: 16 bytes do not fit the buffer of 8",
            lambda: backend.copy_h2d_async(own, np.ones(16, np.uint8), stream),
        ),
        (
            "copy_d2h_async: 16 bytes do not fit the buffer of 8",
            lambda: backend.copy_d2h_async(pinned, own, stream),
        ),
        (
            "copy_d2d dst: 16 bytes do not fit the buffer of 8",
            lambda: backend.copy_d2d(own, big, 16, stream),
        ),
        (
            "copy_d2d src: 16 bytes do not fit the buffer of 8",
            lambda: backend.copy_d2d(big, own, 16, stream),
        ),
        (
            "copy_h2d: host array must be C-contiguous",
            lambda: backend.copy_h2d(own, np.ones(16, np.uint8)[::2]),
        ),
        ("copy_d2h: destination array is read-only", lambda: backend.copy_d2h(_read_only(8), own)),
    ]
    for message, call in calls:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            call()
    backend.synchronize(stream)
    assert get(backend, own).tolist() == list(range(8))  # nothing was written
    assert_usable(backend, stream)


def _read_only(n: int) -> np.ndarray:
    a = np.zeros(n, np.uint8)
    a.setflags(write=False)
    return a


# --------------------------------------------------------------------------- ops


class Matmul:
    """A valid ``matmul`` call on ``backend``: out[2, 4] = x[2, 3] @ w[4, 3].T."""

    def __init__(self, backend: vt.Backend) -> None:
        rng = np.random.default_rng(7)
        self.x = rng.standard_normal((2, 3)).astype(np.float32)
        self.w = rng.standard_normal((4, 3)).astype(np.float32)
        self.weight = backend.upload_weight(vt.WeightTensor("w", 0, (4, 3), self.w))
        self.out = backend.alloc(2 * 4 * 4)
        backend.memset(self.out, 0x7F)  # a sentinel no refused call may overwrite
        self.x_buf = put(backend, self.x)
        self.big = backend.alloc(256)  # room for any shape the cases try

    def args(self) -> dict[str, Any]:
        return {"out": t(self.out, 2, 4), "x": t(self.x_buf, 2, 3), "weight": self.weight}


def _freed(backend: vt.Backend, m: Matmul) -> dict[str, Any]:
    w = backend.upload_weight(vt.WeightTensor("gone", 0, (4, 3), m.w))
    backend.free_weight(w)
    return {**m.args(), "weight": w}


#: (case, how to break the valid call, error type, message)
OP_ERRORS: list[tuple[str, Callable[[vt.Backend, Matmul], dict[str, Any]], type, str]] = [
    (
        "wrong dtype",
        lambda b, m: {**m.args(), "x": t(m.x_buf, 2, 3, dtype=I32)},
        TypeError,
        "op matmul: x has dtype int32, expected f32",
    ),
    (
        "shape symbol mismatch",
        lambda b, m: {**m.args(), "x": t(m.big, 2, 5)},
        ValueError,
        "op matmul: weight weight ('w') has in_f=3, but another argument has in_f=5",
    ),
    (
        "row count mismatch",
        lambda b, m: {**m.args(), "out": t(m.big, 3, 4)},
        ValueError,
        "op matmul: x has n=2, but another argument has n=3",
    ),
    (
        "wrong rank",
        lambda b, m: {**m.args(), "x": t(m.x_buf, 6)},
        ValueError,
        "op matmul: x has shape (6,), expected 2 dimensions ('n', 'in_f')",
    ),
    (
        "tensor larger than its buffer",
        lambda b, m: {**m.args(), "out": vt.Tensor(m.x_buf, F32, (2, 4))},
        ValueError,
        "op matmul: out of shape (2, 4) needs 32 bytes, its buffer has 24",
    ),
    (
        "missing argument",
        lambda b, m: {k: v for k, v in m.args().items() if k != "x"},
        TypeError,
        "op matmul: missing argument 'x'",
    ),
    (
        "unknown argument",
        lambda b, m: {**m.args(), "y": t(m.x_buf, 2, 3)},
        TypeError,
        "op matmul: unknown argument(s) y",
    ),
    (
        "not a tensor",
        lambda b, m: {**m.args(), "x": m.x},
        TypeError,
        "op matmul: x must be a vt.Tensor",
    ),
    (
        "not a weight",
        lambda b, m: {**m.args(), "weight": t(m.big, 4, 3)},
        TypeError,
        "op matmul: weight must be a vt.Weight",
    ),
    ("freed weight", _freed, ValueError, "op matmul: weight 'gone' was freed"),
]


@pytest.mark.parametrize(
    ("case", "broken", "error", "message"), OP_ERRORS, ids=[c[0] for c in OP_ERRORS]
)
def test_op_argument_errors_are_named_and_nothing_runs(
    backend: vt.Backend,
    stream: vt.Stream,
    case: str,
    broken: Callable[[vt.Backend, Matmul], dict[str, Any]],
    error: type,
    message: str,
) -> None:
    m = Matmul(backend)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        backend.launch("matmul", stream, **broken(backend, m))
    backend.synchronize(stream)
    assert np.all(get(backend, m.out) == 0x7F), f"{case}: the refused op wrote its output"
    backend.launch("matmul", stream, **m.args())  # the same op, called right, still runs
    backend.synchronize(stream)
    assert np.allclose(get(backend, m.out, F32).reshape(2, 4), ref.matmul(m.x, m.w), atol=1e-5)
    assert_usable(backend, stream)


def test_cross_argument_rules_and_unknown_ops(backend: vt.Backend, stream: vt.Stream) -> None:
    x, pos = backend.alloc(2 * 8 * 4), put(backend, np.array([0, 1], np.int32))
    params = vt.RopeParams(head_dim=4)
    with pytest.raises(ValueError, match=r"^op rope: x has 8 columns, n_heads 3 x head_dim 4"):
        backend.launch(
            "rope", stream, x=t(x, 2, 8), positions=t(pos, 2, dtype=I32), n_heads=3, params=params
        )
    layout = vt.KVLayout(n_layers=2, n_slots=1, max_len=4, n_kv_heads=1, head_dim=4)
    cache, kv = backend.alloc(layout.nbytes), backend.alloc(2 * 4 * 4)
    store = {
        "cache": t(cache, *layout.shape),
        "k": t(kv, 2, 4),
        "v": t(kv, 2, 4),
        "slots": t(pos, 2, dtype=I32),
        "positions": t(pos, 2, dtype=I32),
        "layout": layout,
    }
    with pytest.raises(ValueError, match=r"^op kv_store: layer 2 is out of range \[0, 2\)$"):
        backend.launch("kv_store", stream, **store, layer=2)
    with pytest.raises(ValueError, match="^op kv_store: cache has shape"):
        backend.launch(
            "kv_store", stream, **{**store, "cache": t(cache, 4, 1, 2, 2, 2, 2)}, layer=0
        )
    with pytest.raises(KeyError, match="unknown op 'conv2d'; the op table has embedding"):
        backend.launch("conv2d", stream, x=t(x, 2, 8))
    with pytest.raises(KeyError, match="unknown op 'conv2d'"):
        backend.supports("conv2d")
    assert_usable(backend, stream)


# --------------------------------------------------------------------------- capabilities


def test_host_view_on_tt_stub_raises_host_access_error() -> None:
    tt = TtStubBackend()
    buf = put(tt, np.arange(8, dtype=np.uint8))
    for view in (buf, buf.view(2, 4)):
        with pytest.raises(
            vt.HostAccessError,
            match="backend 'tt_stub': device memory is not host-addressable; copy it to the "
            "host with copy_d2h or copy_d2h_async",
        ):
            tt.host_view(view)
    # a false claim does not get it a view either: the hook it lacks refuses
    tt.capabilities = tt.capabilities.with_value(
        "device_memory_is_host_addressable", True, vt.Source.env, "test: a lie"
    )
    with pytest.raises(vt.HostAccessError, match="'tt_stub' does not implement host_view"):
        tt.host_view(buf)
    assert get(tt, buf).tolist() == list(range(8))


class CoreOnly(vt.Backend):
    """The required core and nothing else: numpy memory, synchronous streams, no mixin."""

    name = "core-only"

    def _alloc(self, nbytes: int) -> vt.Buffer:
        return vt.Buffer(np.zeros(nbytes, np.uint8), nbytes, 0, self.name)

    def _free(self, buf: vt.Buffer) -> None:
        pass

    def _mem(self, buf: vt.Buffer) -> np.ndarray:
        return buf.handle[buf.offset : buf.offset + buf.nbytes]

    def _memset(self, buf: vt.Buffer, value: int, stream: vt.Stream | None) -> None:
        self._mem(buf).fill(value)

    def _copy_h2d(self, dst: vt.Buffer, src: np.ndarray) -> None:
        self._mem(dst)[: src.nbytes] = src

    def _copy_d2h(self, dst: np.ndarray, src: vt.Buffer) -> None:
        dst[...] = self._mem(src)[: dst.nbytes]

    def _copy_h2d_async(self, dst: vt.Buffer, src: np.ndarray, stream: vt.Stream) -> None:
        self._copy_h2d(dst, src)

    def _copy_d2d(self, dst: vt.Buffer, src: vt.Buffer, nbytes: int, stream: vt.Stream) -> None:
        self._mem(dst)[:nbytes] = self._mem(src)[:nbytes]

    def _create_stream(self, name: str) -> vt.Stream:
        return vt.Stream(None, name)

    def _destroy_stream(self, stream: vt.Stream) -> None:
        pass

    def _synchronize(self, stream: vt.Stream) -> None:
        pass


def test_copy_d2h_async_without_the_mixin_raises_capability_error() -> None:
    b = CoreOnly()
    caps = b.capabilities
    assert not caps.async_d2h_copy
    assert caps.source_of("async_d2h_copy").detail == "does not implement vt.AsyncD2HCopy"
    s = b.create_stream("s")
    src = put(b, np.arange(8, dtype=np.uint8))
    host = b.alloc_pinned(8)
    assert not host.pinned  # ordinary memory: no vt.PinnedHostMemory
    with pytest.raises(
        vt.CapabilityError,
        match=r"backend 'core-only' has no async device-to-host copy \(vt.AsyncD2HCopy\)",
    ):
        b.copy_d2h_async(host, src, s)
    # the argument checks come first, for the bad call and the unsupported one alike
    with pytest.raises(ValueError, match="copy_d2h_async: 16 bytes do not fit the buffer of 8"):
        b.copy_d2h_async(b.alloc_pinned(16), src, s)
    # the synchronous path is the core's, and works
    out = np.empty(8, np.uint8)
    b.synchronize(s)
    b.copy_d2h(out, src)
    assert out.tolist() == list(range(8))


def test_a_core_only_backend_refuses_what_it_lacks_by_name() -> None:
    b = CoreOnly()
    s = b.create_stream("s")
    caps = b.capabilities
    assert not any(getattr(caps, f) for f in ("events", "graphs", "pinned_host_memory"))
    with pytest.raises(vt.HostAccessError, match="'core-only': device memory is not host-addr"):
        b.host_view(b.alloc(8))
    with pytest.raises(vt.CapabilityError, match="'core-only' does not implement vt.Graphs"):
        b.begin_capture(s)
    with pytest.raises(vt.CapabilityError, match="does not implement vt.VirtualMemory"):
        b.vmm_reserve(4096)
    with pytest.raises(vt.KernelNotImplementedError, match="does not implement upload_weight"):
        b.upload_weight(vt.WeightTensor("w", 0, (4, 3), np.zeros((4, 3), np.float32)))
    # ops: checked first, then refused by name; a fused op names the primitive it lacks
    w = vt.Weight("w", (4, 3), handle=object())
    x, out = b.alloc(2 * 3 * 4), b.alloc(2 * 4 * 4)
    assert b.op_names() == ()
    with pytest.raises(
        vt.KernelNotImplementedError, match="'core-only' does not implement op 'matmul'"
    ):
        b.launch("matmul", s, out=t(out, 2, 4), x=t(x, 2, 3), weight=w)
    with pytest.raises(vt.KernelNotImplementedError, match="does not implement op 'matmul'"):
        b.launch(
            "matmul_add",
            s,
            out=t(out, 2, 4),
            x=t(x, 2, 3),
            weight=w,
            residual=t(out, 2, 4),
            scratch=t(b.alloc(32), 2, 4),
        )
    with pytest.raises(TypeError, match="op matmul: x has dtype int32"):
        b.launch("matmul", s, out=t(out, 2, 4), x=t(x, 2, 3, dtype=I32), weight=w)
    # events without vt.Events are null: an event "completes" at once
    e = b.create_event()
    b.record_event(e, s)
    assert b.query_event(e)


# --------------------------------------------------------------------------- found by these tests
# Each was a core bug when this file was written; now each is a regression test.


def test_a_tensor_takes_a_numpy_scalar_type_as_dtype(
    backend: vt.Backend, stream: vt.Stream
) -> None:
    m = Matmul(backend)
    out = vt.Tensor(m.out, np.float32, (2, 4))  # type: ignore[arg-type]
    assert out.nbytes == 32 and out.dtype == F32
    backend.launch("matmul", stream, **{**m.args(), "out": out})
    backend.synchronize(stream)
    assert np.allclose(get(backend, m.out, F32).reshape(2, 4), ref.matmul(m.x, m.w), atol=1e-5)


def test_negative_dimensions_are_refused_at_the_call(
    backend: vt.Backend, stream: vt.Stream
) -> None:
    m = Matmul(backend)
    with pytest.raises(ValueError, match=r"dimension -2 is not a size"):
        backend.launch(
            "matmul",
            stream,
            out=vt.Tensor(m.out, F32, (-2, 4)),
            x=vt.Tensor(m.x_buf, F32, (-2, 3)),
            weight=m.weight,
        )
    assert_usable(backend, stream)


def test_a_foreign_weight_is_refused_at_the_call() -> None:
    cpu, tt = CpuBackend(), TtStubBackend()
    try:
        s = cpu.create_stream("s")
        w = tt.upload_weight(vt.WeightTensor("w", 0, (4, 3), np.zeros((4, 3), np.float32)))
        with pytest.raises(ValueError, match="'tt_stub' passed to 'cpu'"):
            cpu.launch("matmul", s, out=t(cpu.alloc(32), 2, 4), x=t(cpu.alloc(24), 2, 3), weight=w)
        assert_usable(cpu, s)
    finally:
        cpu.close()


def test_copy_d2h_async_into_a_plain_array(backend: vt.Backend, stream: vt.Stream) -> None:
    src = put(backend, np.arange(8, dtype=np.uint8))
    dst = np.zeros(8, np.uint8)
    try:
        backend.copy_d2h_async(dst, src, stream)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:  # refusing it by name is a fix too
        assert "copy_d2h_async" in str(exc)
    else:
        backend.synchronize(stream)
        assert dst.tolist() == list(range(8))
