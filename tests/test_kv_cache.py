"""KV cache: contiguous and vmm kinds, growth policy, errors, identical contents."""

from __future__ import annotations

import numpy as np
import pytest
import vt
from vmm_support import AliasingCpu, InjectingCpu
from vt.execution.memory import KVCache, KVCacheStats, KVCapacityError

KiB, MiB = 1 << 10, 1 << 20
F32, I32 = np.dtype(np.float32), np.dtype(np.int32)


def host_backend(granularity: int | None = 4 * KiB) -> InjectingCpu:
    """The CPU backend with vmm of ``granularity`` (None: vmm turned off)."""
    backend = InjectingCpu(granularity or 4 * KiB)
    if granularity is None:
        backend.capabilities = backend.capabilities.model_copy(update={"vmm": None})
    return backend


def _layout(max_len: int = 8192, n_slots: int = 1) -> vt.KVLayout:
    # 8 KiB per position and slot: 4 layers x K,V x 4 heads x 64 dims x 4 bytes.
    return vt.KVLayout(n_layers=4, n_slots=n_slots, max_len=max_len, n_kv_heads=4, head_dim=64)


def _read(backend: vt.Backend, buf: vt.Buffer) -> np.ndarray:
    out = np.empty(buf.nbytes, np.uint8)
    backend.copy_d2h(out, buf)
    return out


def test_contiguous_commits_everything_zeroed() -> None:
    backend = host_backend(granularity=None)
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
    no_vmm = KVCache.create(host_backend(granularity=None), _layout(max_len=64))
    assert no_vmm.kind == "contiguous"
    with_vmm = KVCache.create(host_backend(granularity=4096), _layout(max_len=64))
    assert with_vmm.kind == "vmm"
    assert with_vmm.stats().backend == "vmm"


def test_unknown_kind_is_named() -> None:
    with pytest.raises(ValueError, match="unknown KV cache kind 'paged'"):
        KVCache.create(host_backend(), _layout(), kind="paged")


def test_vmm_on_backend_without_vmm_names_the_backend() -> None:
    with pytest.raises(vt.CapabilityError, match="backend 'cpu' does not declare vmm") as err:
        KVCache.create(host_backend(granularity=None), _layout(), kind="vmm")
    assert "--kv-cache contiguous, kv_cache='contiguous'" in str(err.value)  # real option names


@pytest.mark.parametrize(
    ("field", "value"), [("max_len", 0), ("n_layers", 0), ("head_dim", -1), ("n_slots", 0)]
)
def test_bad_layout_names_the_field(field: str, value: int) -> None:
    kwargs = {"n_layers": 2, "n_slots": 1, "max_len": 8, "n_kv_heads": 2, "head_dim": 8}
    kwargs[field] = value
    with pytest.raises(ValueError, match=f"KV layout {field} must be a positive integer"):
        KVCache.create(host_backend(), vt.KVLayout(**kwargs), kind="contiguous")


def test_bad_growth_settings() -> None:
    with pytest.raises(ValueError, match="grow_tokens must be a positive integer, got 0"):
        KVCache.create(host_backend(), _layout(), kind="vmm", grow_tokens=0)
    with pytest.raises(ValueError, match="min_growth_bytes must be a non-negative integer"):
        KVCache.create(host_backend(), _layout(), kind="vmm", min_growth_bytes=-1)


@pytest.mark.parametrize("kind", ["contiguous", "vmm"])
def test_positions_beyond_max_len_name_it(kind: str) -> None:
    cache = KVCache.create(host_backend(), _layout(max_len=128), kind=kind)
    with pytest.raises(KVCapacityError, match="at most max_len=128 positions"):
        cache.ensure_positions(129)
    assert cache.capacity_positions >= 64  # still usable afterwards
    with pytest.raises(ValueError, match="non-negative integer, got -1"):
        cache.ensure_positions(-1)


@pytest.mark.parametrize("kind", ["contiguous", "vmm"])
def test_release_is_idempotent(kind: str) -> None:
    cache = KVCache.create(host_backend(), _layout(max_len=128), kind=kind)
    backend = cache.backend
    cache.release()
    cache.release()
    assert (backend.freed, backend.released_ranges) == ((1, 0) if kind == "contiguous" else (0, 1))
    assert cache.stats().mapped_bytes == 0
    assert cache.released
    assert cache.capacity_positions == 0
    with pytest.raises(vt.VtError, match="released"):
        _ = cache.buffer
    with pytest.raises(vt.VtError, match="released"):
        cache.ensure_positions(1)


def test_vmm_commits_a_small_fraction_for_a_short_chat() -> None:
    backend = host_backend(64 * KiB)
    layout = _layout(max_len=8192)  # 64 MiB reserved
    cache = KVCache.create(backend, layout, kind="vmm")
    assert cache.kind == "vmm"
    assert cache.buffer.nbytes == layout.nbytes
    # The first chunk is 64 positions = 512 KiB, raised to the 2 MiB minimum growth.
    assert cache.stats() == KVCacheStats(
        backend="vmm", reserved_bytes=64 * MiB, mapped_bytes=2 * MiB, segments=1
    )
    assert cache.capacity_positions == 256
    for n in range(1, 201):  # a 200-token chat, ensured before every step
        cache.ensure_positions(n)
    assert cache.stats().mapped_bytes == 2 * MiB
    assert cache.ensure_positions(257) == 2 * MiB
    assert cache.capacity_positions == 512
    stats = cache.stats()
    assert stats.segments == 2
    assert stats.mapped_bytes / stats.reserved_bytes <= 1 / 16
    cache.release()
    assert cache.stats().mapped_bytes == 0


def test_vmm_grows_by_grow_tokens_when_larger_than_min_growth() -> None:
    # 64 KiB per position: 64 positions (4 MiB) per chunk beats the 2 MiB minimum.
    layout = vt.KVLayout(n_layers=16, n_slots=1, max_len=1024, n_kv_heads=8, head_dim=64)
    cache = KVCache.create(host_backend(4 * KiB), layout, kind="vmm", grow_tokens=64)
    assert cache.capacity_positions == 64
    assert cache.ensure_positions(65) == 4 * MiB
    assert cache.capacity_positions == 128
    assert cache.ensure_positions(1000) == 4 * MiB * 14  # to 1024 = 16 chunks, one segment
    assert cache.capacity_positions == 1024
    assert cache.stats().segments == 3


def test_vmm_rounds_growth_to_the_granularity_and_caps_at_max_len() -> None:
    # 192 bytes per position does not divide the 64 KiB granularity.
    layout = vt.KVLayout(n_layers=3, n_slots=1, max_len=1000, n_kv_heads=1, head_dim=8)
    cache = KVCache.create(host_backend(64 * KiB), layout, kind="vmm", min_growth_bytes=0)
    assert cache.stats().mapped_bytes == 64 * KiB
    assert cache.capacity_positions == 64 * KiB // 192
    cache.ensure_positions(1000)
    assert cache.stats().mapped_bytes == cache.stats().reserved_bytes == 192 * KiB
    assert cache.capacity_positions == 1000  # never more than max_len


def test_full_map_policy_kv_cache_never_grows() -> None:
    backend = AliasingCpu(64 * KiB, declare_alias=True)
    cache = KVCache.create(backend, _layout(max_len=512), kind="auto")
    assert cache.kind == "vmm"
    assert cache.capacity_positions == 512
    assert cache.ensure_positions(512) == 0
    assert cache.stats() == KVCacheStats(
        backend="vmm", reserved_bytes=4 * MiB, mapped_bytes=4 * MiB, segments=1
    )


def test_failed_growth_leaves_cache_usable() -> None:
    backend = host_backend(4 * KiB)
    layout = _layout(max_len=1024)
    cache = KVCache.create(backend, layout, kind="vmm", min_growth_bytes=0)
    data = np.arange(64 * layout.position_bytes // 4, dtype=np.float32)
    backend.copy_h2d(cache.buffer, data)
    backend.fail_maps = 1
    with pytest.raises(vt.VmmError, match="injected"):
        cache.ensure_positions(65)
    assert cache.capacity_positions == 64
    got = np.empty_like(data)
    backend.copy_d2h(got, cache.buffer)
    np.testing.assert_array_equal(got, data)
    assert cache.ensure_positions(65) > 0


def test_contiguous_and_vmm_hold_identical_data() -> None:
    layout = _layout(max_len=512, n_slots=2)
    backend = host_backend(4 * KiB)
    caches = [
        KVCache.create(backend, layout, kind=k, grow_tokens=16, min_growth_bytes=0)
        for k in ("contiguous", "vmm")
    ]
    rng = np.random.default_rng(0)
    row = layout.token_bytes // 4  # floats per (position, slot)
    for pos in range(300):
        for slot in range(layout.n_slots):
            kv = rng.standard_normal(row).astype(np.float32)
            for cache in caches:
                cache.ensure_positions(pos + 1)
                offset = pos * layout.position_bytes + slot * layout.token_bytes
                backend.copy_h2d(cache.buffer.view(offset, layout.token_bytes), kv)
    n = 300 * layout.position_bytes
    views = []
    for cache in caches:
        out = np.empty(n, np.uint8)
        backend.copy_d2h(out, cache.buffer.view(0, n))
        views.append(out)
    np.testing.assert_array_equal(views[0], views[1])
    # Growth zeroes fresh memory, like the contiguous cache's memset.
    vmm = caches[1]
    tail = vmm.capacity_positions * layout.position_bytes - n
    out = np.empty(tail, np.uint8)
    backend.copy_d2h(out, vmm.buffer.view(n, tail))
    assert tail > 0 and not out.any()


def test_kv_store_writes_identically_to_both_kinds() -> None:
    backend = host_backend(4 * KiB)
    layout = vt.KVLayout(n_layers=3, n_slots=2, max_len=512, n_kv_heads=2, head_dim=16)
    caches = [
        KVCache.create(backend, layout, kind=k, grow_tokens=32, min_growth_bytes=0)
        for k in ("contiguous", "vmm")
    ]
    stream = backend.create_stream("kv")
    rng = np.random.default_rng(1)
    row = layout.n_kv_heads * layout.head_dim
    # A 40-token prefill in slot 0, then 260 decode steps of one token in each slot.
    steps = [(np.zeros(40, np.int32), np.arange(40, dtype=np.int32))]
    steps += [(np.array([0, 1], np.int32), np.array([40 + i, i], np.int32)) for i in range(260)]
    bufs = {name: backend.alloc(40 * row * 4) for name in ("k", "v")}
    slots, positions = backend.alloc(40 * 4), backend.alloc(40 * 4)
    for slot_ids, pos in steps:
        n = len(pos)
        backend.copy_h2d(slots, slot_ids)
        backend.copy_h2d(positions, pos)
        for cache in caches:
            cache.ensure_positions(int(pos.max()) + 1, stream)
        for layer in range(layout.n_layers):
            for name in ("k", "v"):
                backend.copy_h2d(bufs[name], rng.standard_normal((n, row)).astype(np.float32))
            for cache in caches:
                backend.launch(
                    "kv_store", stream, cache=vt.Tensor(cache.buffer, F32, layout.shape),
                    k=vt.Tensor(bufs["k"], F32, (n, row)), v=vt.Tensor(bufs["v"], F32, (n, row)),
                    slots=vt.Tensor(slots, I32, (n,)), positions=vt.Tensor(positions, I32, (n,)),
                    layout=layout, layer=layer,
                )  # fmt: skip
        backend.synchronize(stream)
    vmm = caches[1]
    assert vmm.capacity_positions == 320  # grown in 32-position chunks (4 KiB granules)
    used = 300 * layout.position_bytes
    contiguous = backend.host_view(caches[0].buffer.view(0, used))
    grown = backend.host_view(vmm.buffer.view(0, used))
    np.testing.assert_array_equal(contiguous, grown)
    assert contiguous.any()
    # The arena's accounting matches what the backend really has mapped.
    assert backend.vmm_mapped_bytes(vmm.arena.vrange) == vmm.stats().mapped_bytes
    backend.destroy_stream(stream)
    for cache in caches:
        cache.release()
