"""VmmArena: rounding, growth, every error path (data intact), release, aliasing policy."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import vt
import vt.management.probes.vmm
from vmm_support import AliasingCpu, InjectingCpu
from vt.execution.memory import TENSOR_ALIGNMENT, VmmArena, arena_tensor
from vt.management.probes.vmm import SMOKE_IDS, arena_smoke

KiB, MiB = 1 << 10, 1 << 20
GRANULARITIES = [4 * KiB, 64 * KiB, 2 * MiB]


def make_backend(granularity: int = 4 * KiB, **kwargs: bool) -> InjectingCpu:
    return InjectingCpu(granularity, **kwargs)


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _read(arena: VmmArena, nbytes: int | None = None) -> np.ndarray:
    n = arena.mapped_bytes if nbytes is None else nbytes
    out = np.empty(n, np.uint8)
    arena.backend.copy_d2h(out, arena.buffer.view(0, n))
    return out


def _filled(backend: vt.Backend, g: int, reserve: int) -> tuple[VmmArena, np.ndarray]:
    arena = VmmArena.reserve(backend, reserve)
    arena.map_next(g)
    data = _pattern(g, 1)
    backend.copy_h2d(arena.buffer.view(0, g), data)
    return arena, data


def _state(arena: VmmArena) -> tuple[int, int, int]:
    return arena.reserved_bytes, arena.mapped_bytes, arena.segments


# --------------------------------------------------------------------------- reserve


@pytest.mark.parametrize("g", GRANULARITIES)
def test_reserve_rounds_up_to_granularity(g: int) -> None:
    arena = VmmArena.reserve(make_backend(g), g + 1)
    assert arena.granularity == g
    assert arena.reserved_bytes == 2 * g
    assert arena.mapped_bytes == 0 and arena.segments == 0
    assert arena.buffer.nbytes == 2 * g
    assert not arena.full_map
    exact = VmmArena.reserve(make_backend(g), 3 * g)
    assert exact.reserved_bytes == 3 * g


@pytest.mark.parametrize("nbytes", [0, -4096])
def test_reserve_needs_positive_size(nbytes: int) -> None:
    with pytest.raises(vt.VmmError, match=f"must be a positive number of bytes, got {nbytes}"):
        VmmArena.reserve(make_backend(), nbytes)


def test_reserve_on_backend_without_vmm_names_it() -> None:
    backend = make_backend()
    backend.capabilities = backend.capabilities.model_copy(update={"vmm": None})
    with pytest.raises(vt.CapabilityError, match="backend 'cpu' does not declare vmm"):
        VmmArena.reserve(backend, 4096)


def test_declared_granularity_must_match_runtime() -> None:
    backend = make_backend(64 * KiB)  # the runtime's granularity
    backend.capabilities = backend.capabilities.model_copy(
        update={"vmm": vt.VmmCaps(granularity=4 * KiB)}
    )
    with pytest.raises(vt.VmmError, match="declared vmm granularity 4096 is not a positive"):
        VmmArena.reserve(backend, 4096)


# --------------------------------------------------------------------------- map_next


@pytest.mark.parametrize("g", GRANULARITIES)
def test_segments_hold_their_own_data(g: int) -> None:
    backend = make_backend(g)
    arena, a = _filled(backend, g, 3 * g)
    arena.map_next(2 * g)
    b = _pattern(2 * g, 2)
    backend.copy_h2d(arena.buffer.view(g, 2 * g), b)
    assert _state(arena) == (3 * g, 3 * g, 2)
    np.testing.assert_array_equal(_read(arena), np.concatenate([a, b]))
    arena.release()


@pytest.mark.parametrize("g", GRANULARITIES)
@pytest.mark.parametrize("factor", [0.0, 0.5, 1.5, -1.0])
def test_map_next_rejects_non_multiples(g: int, factor: float) -> None:
    backend = make_backend(g)
    arena, data = _filled(backend, g, 4 * g)
    size = int(g * factor)
    with pytest.raises(
        vt.VmmError, match=f"map size {size} must be a non-zero multiple of granularity {g}$"
    ):
        arena.map_next(size)
    assert _state(arena) == (4 * g, g, 1)
    np.testing.assert_array_equal(_read(arena), data)


@pytest.mark.parametrize("g", GRANULARITIES)
def test_map_next_past_reservation_names_sizes(g: int) -> None:
    backend = make_backend(g)
    arena, data = _filled(backend, g, 2 * g)
    with pytest.raises(vt.VmmError, match=rf"would exceed reserve {g} \+ {2 * g} > {2 * g}$"):
        arena.map_next(2 * g)
    assert _state(arena) == (2 * g, g, 1)
    np.testing.assert_array_equal(_read(arena), data)
    arena.map_next(g)  # what does fit still maps
    assert arena.mapped_bytes == arena.reserved_bytes


def test_failed_backend_map_leaves_arena_intact() -> None:
    backend = make_backend()
    arena, data = _filled(backend, 4096, 4 * 4096)
    backend.fail_maps = 1
    with pytest.raises(vt.VmmError, match="injected: out of physical memory"):
        arena.map_next(4096)
    assert _state(arena) == (4 * 4096, 4096, 1)
    np.testing.assert_array_equal(_read(arena), data)
    arena.map_next(4096)
    assert arena.segments == 2


# --------------------------------------------------------------------------- ensure


@pytest.mark.parametrize("g", GRANULARITIES)
def test_ensure_grows_in_min_growth_chunks(g: int) -> None:
    backend = make_backend(g)
    arena = VmmArena.reserve(backend, 16 * g, min_growth=3 * g - 1)
    assert arena.min_growth == 3 * g  # rounded up to the granularity
    assert arena.ensure(1) == 3 * g
    assert arena.ensure(3 * g) == 0  # already covered
    assert arena.ensure(7 * g + 1) == 5 * g  # several granules at once, one segment
    assert _state(arena) == (16 * g, 8 * g, 2)
    assert arena.ensure(15 * g) == 7 * g
    assert arena.ensure(15 * g + 1) == g  # min_growth clipped to the reservation
    assert _state(arena) == (16 * g, 16 * g, 4)
    with pytest.raises(vt.VmmError, match=f"cannot map {16 * g + 1} bytes: the arena reserves"):
        arena.ensure(16 * g + 1)
    with pytest.raises(vt.VmmError, match="ensure size must be a non-negative number"):
        arena.ensure(-1)


def test_min_growth_must_not_be_negative() -> None:
    with pytest.raises(vt.VmmError, match="min_growth must be a non-negative number of bytes"):
        VmmArena.reserve(make_backend(), 4096, min_growth=-1)


# --------------------------------------------------------------------------- release


def test_release_unmaps_in_reverse_order_and_is_idempotent() -> None:
    backend = make_backend()
    arena = VmmArena.reserve(backend, 4 * 4096)
    for _ in range(3):
        arena.map_next(4096)
    arena.release()
    assert backend.unmapped == [8192, 4096, 0]
    assert backend.released_ranges == 1
    assert arena.released and arena.segments == 0 and arena.mapped_bytes == 0
    arena.release()
    assert backend.unmapped == [8192, 4096, 0]
    for call in (lambda: arena.map_next(4096), lambda: arena.ensure(1), lambda: arena.buffer):
        with pytest.raises(vt.VmmError, match="the VMM arena has been released"):
            call()


def test_release_retries_after_a_failing_unmap() -> None:
    backend = make_backend()
    arena = VmmArena.reserve(backend, 4 * 4096)
    for _ in range(4):
        arena.map_next(4096)
    original = backend.vmm_unmap
    calls = {"n": 0}

    def flaky(vrange: vt.VirtualRange, segment: vt.Segment) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the last segment goes, the next one fails and stays listed
            raise RuntimeError("injected: unmap failed")
        original(vrange, segment)

    backend.vmm_unmap = flaky  # type: ignore[method-assign]
    with pytest.raises(
        vt.VmmError, match=r"segment at offset 8192 \(4096 bytes\) failed: injected: unmap failed"
    ) as info:
        arena.release()
    assert "3 segment(s) still mapped, call release() again" in str(info.value)
    assert not arena.released
    assert _state(arena) == (4 * 4096, 3 * 4096, 3)
    arena.release()
    assert arena.released
    assert backend.unmapped == [12288, 8192, 4096, 0]


def test_release_retries_after_a_failing_address_free() -> None:
    backend = make_backend()
    arena = VmmArena.reserve(backend, 2 * 4096)
    arena.map_next(4096)
    backend.fail_releases = 1
    with pytest.raises(vt.VmmError, match="freeing the reservation of 8192 bytes failed"):
        arena.release()
    assert not arena.released and arena.segments == 0
    arena.release()
    assert arena.released and backend.released_ranges == 1
    assert backend.unmapped == [0]


# --------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("g", GRANULARITIES)
def test_4097_byte_tensor_maps_whole_granules(g: int) -> None:
    backend = make_backend(g)
    tensor = arena_tensor(backend, 4097)
    assert tensor.nbytes == 4097 and tensor.buffer.nbytes == 4097
    assert tensor.arena.segments == 1
    assert tensor.arena.mapped_bytes == -(-4097 // g) * g
    data = _pattern(4097, 3)
    backend.copy_h2d(tensor.buffer, data)
    got = np.empty(4097, np.uint8)
    backend.copy_d2h(got, tensor.buffer)
    np.testing.assert_array_equal(got, data)
    tensor.release()
    assert tensor.arena.released


def test_alloc_tensor_bumps_aligned_offsets() -> None:
    backend = make_backend(64 * KiB)
    arena = VmmArena.reserve(backend, 256 * KiB)
    first = arena.alloc_tensor(4097)
    second = arena.alloc_tensor(100)
    assert (first.offset, first.nbytes) == (0, 4097)
    assert second.offset == -(-4097 // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
    assert arena.mapped_bytes == 64 * KiB and arena.segments == 1
    with pytest.raises(vt.VmmError, match="does not fit in the arena's reservation of 262144"):
        arena.alloc_tensor(256 * KiB)
    with pytest.raises(vt.VmmError, match="tensor size must be a positive number of bytes, got 0"):
        arena.alloc_tensor(0)
    with pytest.raises(vt.VmmError, match="tensor size must be a positive number of bytes"):
        arena_tensor(backend, -1)


# --------------------------------------------------------------------------- aliasing policy


@pytest.mark.parametrize("g", GRANULARITIES)
def test_full_map_policy_maps_everything_once(g: int) -> None:
    backend = AliasingCpu(g, declare_alias=True)
    arena = VmmArena.reserve(backend, 5 * g + 1, min_growth=g)
    assert arena.full_map
    assert _state(arena) == (6 * g, 6 * g, 1)
    data = _pattern(6 * g, 4)
    backend.copy_h2d(arena.buffer, data)
    # Growing anywhere within the reservation is a no-op, never "exceed reserve".
    for n in (1, g, 6 * g):
        assert arena.ensure(n) == 0
    with pytest.raises(vt.VmmError, match="must be a non-zero multiple of granularity"):
        arena.map_next(g + 1)
    with pytest.raises(vt.VmmError, match=rf"exceed reserve {6 * g} \+ {g} > {6 * g}") as info:
        arena.map_next(g)
    assert "segments_may_alias" in str(info.value)
    assert _state(arena) == (6 * g, 6 * g, 1)
    np.testing.assert_array_equal(_read(arena), data)
    arena.release()
    assert backend.unmapped == [0]


def test_aliasing_backend_really_aliases() -> None:
    # Without the policy, the second segment overwrites the first: the bug the smoke catches.
    backend = AliasingCpu(4096)
    arena, a = _filled(backend, 4096, 2 * 4096)
    arena.map_next(4096)
    backend.copy_h2d(arena.buffer.view(4096, 4096), _pattern(4096, 2))
    assert not np.array_equal(_read(arena, 4096), a)


# --------------------------------------------------------------------------- arena smoke


def _by_id(checks: list) -> dict:
    assert [c.id for c in checks] == list(SMOKE_IDS)
    assert all(c.kind == "probe" for c in checks)
    return {c.id: c for c in checks}


@pytest.mark.parametrize("g", GRANULARITIES)
def test_smoke_passes_on_a_correct_backend(g: int) -> None:
    checks = _by_id(arena_smoke(make_backend(g)))
    assert {c.result for c in checks.values()} == {"pass"}, checks
    assert "grow policy" in checks["vmm-granularity"].detail


def test_smoke_catches_undeclared_aliasing_and_names_the_fix() -> None:
    checks = _by_id(arena_smoke(AliasingCpu(64 * KiB)))
    alias = checks["vmm-segments-distinct"]
    assert alias.result == "fail"
    assert "segment 2 aliases segment 1" in alias.detail
    assert "declare `segments_may_alias=True`" in alias.detail
    assert "full-map policy" in alias.detail


@pytest.mark.parametrize("g", GRANULARITIES)
def test_declaring_aliasing_selects_full_map_which_passes(g: int) -> None:
    checks = _by_id(arena_smoke(AliasingCpu(g, declare_alias=True)))
    assert {c.result for c in checks.values()} == {"pass"}, checks
    assert "full-map policy" in checks["vmm-segments-distinct"].detail


def test_smoke_reports_broken_map_errors() -> None:
    backend = make_backend()
    backend.fail_maps = 100
    checks = _by_id(arena_smoke(backend))
    assert checks["vmm-granularity"].result == "pass"
    for check_id in SMOKE_IDS[1:]:
        assert checks[check_id].result == "fail"
        assert "injected: out of physical memory" in checks[check_id].detail


def test_smoke_skips_a_backend_without_vmm() -> None:
    backend = make_backend()
    backend.capabilities = backend.capabilities.model_copy(update={"vmm": None})
    checks = _by_id(arena_smoke(backend))
    assert {c.result for c in checks.values()} == {"skip"}
    assert "does not declare vmm" in checks["vmm-segments-distinct"].detail


def test_smoke_fails_on_granularity_mismatch() -> None:
    backend = make_backend(8192)
    backend.capabilities = backend.capabilities.model_copy(
        update={"vmm": vt.VmmCaps(granularity=4096)}
    )
    checks = _by_id(arena_smoke(backend))
    assert checks["vmm-granularity"].result == "fail"
    assert "not a positive multiple" in checks["vmm-granularity"].detail
    assert checks["vmm-segments-distinct"].result == "skip"


def _imports(path: Path, package: str) -> set[str]:
    """The modules (and ``from`` names) a source file imports, relative imports resolved."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_memory_never_imports_the_probes_or_the_audit() -> None:
    """Execution sits below backend management: the VMM probe uses the arena, and the
    dependency points that way only (vt.execution.memory and vt.management.probes used to
    import each other)."""
    memory = Path(vt.execution.memory.__file__).parent
    for path in sorted(memory.glob("*.py")):
        bad = {
            m
            for m in _imports(path, "vt.execution.memory")
            if m.startswith(("vt.management.probes", "vt.management.audit", "vt.testing"))
        }
        assert not bad, f"{path.name} imports {sorted(bad)}"
    assert "vt.execution.memory.arena" in _imports(
        Path(vt.management.probes.vmm.__file__), "vt.management.probes"
    )
