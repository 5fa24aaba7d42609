"""KV cache: contiguous and vmm kinds, growth policy, errors, identical contents."""

from __future__ import annotations

import numpy as np
import pytest
import vt
from vt.memory import KVCache, KVCacheStats, KVCapacityError


class NumpyBackend(vt.Backend):
    """Host memory backend with a faithful VMM model: unmapped bytes cannot be touched."""

    name = "numpy_test"

    def __init__(self, granularity: int | None = 4096) -> None:
        vmm = None if granularity is None else vt.VmmCaps(granularity=granularity)
        self.capabilities = vt.Capabilities(
            unified_memory=True, device_memory_is_host_addressable=True, vmm=vmm
        )
        self._granularity = granularity or 4096

    def alloc(self, nbytes: int) -> vt.Buffer:
        return vt.Buffer(np.zeros(nbytes, np.uint8), nbytes, owner=self.name)

    def free(self, buf: vt.Buffer) -> None:
        pass

    def _bytes(self, buf: vt.Buffer) -> np.ndarray:
        h = buf.handle
        if isinstance(h, np.ndarray):
            return h[buf.offset : buf.offset + buf.nbytes]
        lo, hi = buf.offset, buf.offset + buf.nbytes
        for off, n, store in h.segments:
            if off <= lo and hi <= off + n:
                return store[lo - off : hi - off]
        raise RuntimeError(f"access [{lo}, {hi}) outside one mapped segment")

    def memset(self, buf: vt.Buffer, value: int, stream: vt.Stream | None = None) -> None:
        self._bytes(buf)[:] = value

    def copy_h2d(self, dst: vt.Buffer, src: np.ndarray) -> None:
        raw = np.ascontiguousarray(src).view(np.uint8).reshape(-1)
        self._bytes(dst.view(0, raw.nbytes))[:] = raw

    def copy_d2h(self, dst: np.ndarray, src: vt.Buffer) -> None:
        dst.view(np.uint8).reshape(-1)[:] = self._bytes(src.view(0, dst.nbytes))

    def vmm_granularity(self) -> int:
        return self._granularity

    def vmm_reserve(self, nbytes: int) -> vt.VirtualRange:
        class Space:
            segments: list = []

        space = Space()
        space.segments = []
        return vt.VirtualRange(space, nbytes)

    def vmm_map(self, vrange: vt.VirtualRange, offset: int, nbytes: int) -> vt.Segment:
        vrange.handle.segments.append((offset, nbytes, np.zeros(nbytes, np.uint8)))
        return vt.Segment(len(vrange.handle.segments) - 1, offset, nbytes)

    def vmm_unmap(self, vrange: vt.VirtualRange, segment: vt.Segment) -> None:
        vrange.handle.segments.pop(segment.handle)

    def vmm_release(self, vrange: vt.VirtualRange) -> None:
        assert not vrange.handle.segments

    def vmm_buffer(self, vrange: vt.VirtualRange) -> vt.Buffer:
        return vt.Buffer(vrange.handle, vrange.nbytes, owner=self.name)


def _layout(max_len: int = 8192, n_slots: int = 1) -> vt.KVLayout:
    # 8 KiB per position and slot: 4 layers x K,V x 4 heads x 64 dims x 4 bytes.
    return vt.KVLayout(n_layers=4, n_slots=n_slots, max_len=max_len, n_kv_heads=4, head_dim=64)


def _read(backend: vt.Backend, buf: vt.Buffer) -> np.ndarray:
    out = np.empty(buf.nbytes, np.uint8)
    backend.copy_d2h(out, buf)
    return out


def test_contiguous_commits_everything_zeroed() -> None:
    backend = NumpyBackend(granularity=None)
    layout = _layout(max_len=256)
    cache = KVCache.create(backend, layout, kind="contiguous")
    assert cache.kind == "contiguous"
    assert cache.layout is layout
    assert cache.buffer.nbytes == layout.nbytes
    assert cache.capacity_positions == 256
    assert not _read(backend, cache.buffer).any()
    assert cache.stats() == KVCacheStats(
        backend="contiguous",
        reserved_bytes=layout.nbytes,
        mapped_bytes=layout.nbytes,
        segments=1,
    )
    assert cache.ensure_positions(256) == 0
    cache.release()


def test_auto_picks_vmm_only_where_declared() -> None:
    no_vmm = KVCache.create(NumpyBackend(granularity=None), _layout(max_len=64))
    assert no_vmm.kind == "contiguous"
    with_vmm = KVCache.create(NumpyBackend(granularity=4096), _layout(max_len=64))
    assert with_vmm.kind == "vmm"
    assert with_vmm.stats().backend == "vmm"


def test_unknown_kind_is_named() -> None:
    with pytest.raises(ValueError, match="unknown KV cache kind 'paged'"):
        KVCache.create(NumpyBackend(), _layout(), kind="paged")


def test_vmm_on_backend_without_vmm_names_the_backend() -> None:
    with pytest.raises(vt.CapabilityError, match="backend 'numpy_test' does not declare vmm"):
        KVCache.create(NumpyBackend(granularity=None), _layout(), kind="vmm")


@pytest.mark.parametrize(
    ("field", "value"), [("max_len", 0), ("n_layers", 0), ("head_dim", -1), ("n_slots", 0)]
)
def test_bad_layout_names_the_field(field: str, value: int) -> None:
    kwargs = {"n_layers": 2, "n_slots": 1, "max_len": 8, "n_kv_heads": 2, "head_dim": 8}
    kwargs[field] = value
    with pytest.raises(ValueError, match=f"KV layout {field} must be a positive integer"):
        KVCache.create(NumpyBackend(), vt.KVLayout(**kwargs), kind="contiguous")


def test_bad_growth_settings() -> None:
    with pytest.raises(ValueError, match="grow_tokens must be a positive integer, got 0"):
        KVCache.create(NumpyBackend(), _layout(), kind="vmm", grow_tokens=0)
    with pytest.raises(ValueError, match="min_growth_bytes must be a non-negative integer"):
        KVCache.create(NumpyBackend(), _layout(), kind="vmm", min_growth_bytes=-1)


@pytest.mark.parametrize("kind", ["contiguous", "vmm"])
def test_positions_beyond_max_len_name_it(kind: str) -> None:
    cache = KVCache.create(NumpyBackend(), _layout(max_len=128), kind=kind)
    with pytest.raises(KVCapacityError, match="at most max_len=128 positions"):
        cache.ensure_positions(129)
    assert cache.capacity_positions >= 64  # still usable afterwards
    with pytest.raises(ValueError, match="non-negative integer, got -1"):
        cache.ensure_positions(-1)


@pytest.mark.parametrize("kind", ["contiguous", "vmm"])
def test_release_is_idempotent(kind: str) -> None:
    cache = KVCache.create(NumpyBackend(), _layout(max_len=128), kind=kind)
    cache.release()
    cache.release()
    assert cache.released
    assert cache.capacity_positions == 0
    with pytest.raises(vt.VtError, match="released"):
        _ = cache.buffer
    with pytest.raises(vt.VtError, match="released"):
        cache.ensure_positions(1)
