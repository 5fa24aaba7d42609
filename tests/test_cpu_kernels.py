"""The CPU backend's numba kernels, block weights, thread owner and compile cache."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import vt
from gguf import GGMLQuantizationType
from threadpoolctl import threadpool_info
from vt.testing.tiny import quantize_matrix
from vt.testing.tolerances import kernel_tolerance, nmse
from vt_cpu import CpuBackend, StreamError, kernels, ops, weights
from vt_cpu import compile as kernels_compile
from vt_cpu.threads import Choice, Idle, ThreadOwner

F32, I32 = np.dtype(np.float32), np.dtype(np.int32)
QUANT = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
ALL = (*QUANT, "F32", "F16", "BF16")


def tensor(kind: str, rows: int, cols: int, seed: int = 0) -> tuple[vt.WeightTensor, np.ndarray]:
    """A GGML tensor of ``kind`` and its float32 values as the reference dequantizes them."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    if kind == "BF16":
        data = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        data = quantize_matrix(values, qtype).view(np.uint8)
    t = vt.WeightTensor(f"w.{kind}", int(qtype), (rows, cols), data.reshape(-1))
    return t, vt.reference.dequantize(t)


def cols_for(kind: str) -> int:
    return 512 if kind in ("Q4_K", "Q5_K", "Q6_K") else 96


@pytest.fixture
def cpu() -> Iterator[CpuBackend]:
    backend = CpuBackend()
    yield backend
    backend.close()


@pytest.mark.parametrize("kind", QUANT)
def test_a_quantized_matrix_stays_in_its_blocks(kind: str) -> None:
    t, _ = tensor(kind, 37, cols_for(kind))
    w = weights.upload(t)
    assert isinstance(w, weights.BlockWeight) and w.kind == kind
    # the blocks, scales included, are the tensor's own bytes (for a model file: the mmap)
    for a in w.arrays:
        assert np.shares_memory(a, t.data) and not a.flags.writeable


@pytest.mark.parametrize("kind", ALL)
def test_dequantized_rows_equal_the_reference(kind: str) -> None:
    t, ref = tensor(kind, 37, cols_for(kind), seed=1)
    w = weights.upload(t)
    rows = np.array([36, 0, 17, 17], np.int64)
    out = np.full((4, w.cols), np.nan, np.float32)
    w.dequantize_rows(rows, out)
    assert np.array_equal(out, ref[rows])


#: Activation rows around every boundary: row kernels (1), tile kernels from
#: ``MM_MIN_ROWS`` (2-3) with full and partial tiles of 4, tiles of 8 from
#: ``MM8_MIN_ROWS`` (full and partial), up to ``KERNEL_MAX_ROWS`` (8-32) and one past it
#: (BLAS tiles).
ROWS = sorted(
    {1, 2, 3, 4, 5, 12, 21}
    | set(weights.MM_MIN_ROWS.values())
    | {kernels.quant.MM8_MIN_ROWS + d for d in (-1, 0, 1)}
    | {m + d for m in ops.KERNEL_MAX_ROWS.values() for d in (0, 1)}
)


@pytest.mark.parametrize("kind", ALL)
@pytest.mark.parametrize("n", ROWS)
def test_matmuls_over_blocks_match_the_reference(kind: str, n: int) -> None:
    t, ref = tensor(kind, 37, cols_for(kind), seed=2)
    w = weights.upload(t)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, w.cols)).astype(np.float32)
    res = rng.standard_normal((n, w.rows)).astype(np.float32)
    want = x.astype(np.float64) @ ref.T.astype(np.float64)
    bound = kernel_tolerance("matmul", kind)
    for nchunk in (1, 2):
        out = np.full((n, w.rows), np.nan, np.float32)
        w.matvec(x, out, None, nchunk)
        assert nmse(out, want) <= bound, (kind, n, nchunk)
        acc = res.copy()  # out aliases the residual, as matmul_add(out=x, residual=x) does
        w.matvec(x, acc, acc, nchunk)
        assert nmse(acc, res + want) <= bound
    if kind in QUANT:  # the kernel of the other kind (row or tile) gives the same
        serial, parallel, flags = w.kernels(1 if n >= weights.MM_MIN_ROWS[kind] else 32)
        xb = x.reshape(n, -1, 32)
        for nchunk in (1, 2):
            out = np.full((n, w.rows), np.nan, np.float32)
            if nchunk == 1:
                serial(*w.arrays, xb, out, out, False, *flags)
            else:
                parallel(*w.arrays, xb, out, out, False, nchunk, *flags)
            assert nmse(out, want) <= bound, (kind, n, nchunk)
    tiled = np.full((n, w.rows), np.nan, np.float32)
    owner = ThreadOwner(2)
    try:
        w.tiled(x, tiled, res, lambda step, fn: owner.tiles(5, w.rows, fn))
    finally:
        owner.close()
    assert nmse(tiled, res + want) <= bound


def test_choice_measures_both_ways_then_keeps_the_faster_and_retries_the_other() -> None:
    def run(parallel_cost: float, calls: int = 400) -> list[int]:
        c = Choice(explore=8, warmup=2)
        picks = []
        for _ in range(calls):
            way = c.pick()
            if way >= 2:  # untimed
                picks.append(way - 2)
                continue
            picks.append(way)
            c.record(way, 1.0 if way == 0 else parallel_cost)
        return picks

    picks = run(3.0)  # serial is faster
    assert sorted(picks[:4]) == [0, 0, 1, 1]
    later = picks[4:]
    assert later.count(0) > 0.9 * len(later) and 1 in later  # exploits, and still explores
    assert run(100.0)[4:].count(1) < run(3.0)[4:].count(1)  # a costly way is retried less
    assert run(0.5)[4:].count(1) > 0.9 * 396  # parallel faster: kept


def test_idle_says_whether_other_threads_leave_a_core_free(tmp_path: Path) -> None:
    loadavg = tmp_path / "loadavg"
    idle = Idle(cpus=2, period=0.0, path=str(loadavg), tasks=str(tmp_path / "no-tasks"))
    loadavg.write_text("0.50 0.40 0.30 1/300 1234\n")  # only the reader runs
    assert idle()
    loadavg.write_text("4.00 3.00 2.00 3/300 1234\n")  # two others keep both cores busy
    assert not any([idle() for _ in range(10)][5:])
    for _ in range(30):
        loadavg.write_text("0.50 0.40 0.30 1/300 1234\n")
        free = idle()
    assert free  # they stopped: a core is free again
    assert Idle(cpus=2, path=str(tmp_path / "missing"))()  # no /proc: Choice decides


def test_one_slow_call_does_not_settle_a_choice() -> None:
    """A sample counts at most 3x the mean: a first parallel call held up for milliseconds
    (a compile, a page fault, a helper waking) must not keep parallel off for thousands of
    calls."""
    c = Choice(explore=8, warmup=2)
    for way, seconds in ((0, 1.0), (1, 0.5), (0, 1.0), (1, 500.0)):  # one outlier
        c.record(way, seconds)
    assert c.times[1] == 0.5 + 0.2 * (1.5 - 0.5)  # clipped to 3x the mean, not 500
    assert c.times[1] < c.times[0]  # parallel stays the faster way


def test_kernels_of_one_size_share_a_choice() -> None:
    owner = ThreadOwner(2)
    try:
        assert owner.choice(600_000) is owner.choice(700_000)
        assert owner.choice(600_000) is not owner.choice(60_000)
    finally:
        owner.close()


def test_tiles_cover_every_row_once_across_threads() -> None:
    owner = ThreadOwner(2)
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def fn(r0: int, r1: int) -> None:
        with lock:
            seen.append((r0, r1))

    try:
        owner.tiles(16, 100, fn)
    finally:
        owner.close()
    assert sorted(seen) == [(r, min(100, r + 16)) for r in range(0, 100, 16)]


@pytest.mark.parametrize(("rows", "cols"), [(576, 576), (1536, 576), (2048, 8192),
                                            (8192, 2048), (40, 8192), (49152, 576)])  # fmt: skip
def test_prefill_tiles_suit_blas_and_two_threads(rows: int, cols: int) -> None:
    """A BLAS tile holds at most TILE_ELEMENTS weights but at least 16 rows, and a matrix
    has at least TILES_MIN tiles where it has the rows for them (two threads share it)."""
    w = weights.BlockWeight.__new__(weights.BlockWeight)
    w.rows, w.cols = rows, cols
    step = w.tile_rows()
    assert step >= 16 or step == rows
    assert step * cols <= weights.TILE_ELEMENTS or step == 16
    assert -(-rows // step) >= min(weights.TILES_MIN, -(-rows // 16))


def _blas_threads() -> dict[str, int]:
    return {p["filepath"]: p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}


def test_blas_is_held_to_one_thread_while_a_backend_is_open() -> None:
    before = _blas_threads()
    a, b = CpuBackend(), CpuBackend()
    assert set(_blas_threads().values()) == {1}
    a.close()
    assert set(_blas_threads().values()) == {1}  # b still holds it
    b.close()
    if not any(p for p in before):  # pragma: no cover - no BLAS loaded
        return
    after = _blas_threads()
    assert {k: after[k] for k in before} == before or set(before.values()) == {1}


def test_a_graph_replays_as_one_queue_item_and_a_failure_names_its_op(cpu: CpuBackend) -> None:
    s = cpu.create_stream("g")
    try:
        table = cpu.upload_weight(vt.WeightTensor("emb", 0, (4, 2), np.ones((4, 2), F32)))
        ids, out = cpu.alloc(4), cpu.alloc(8)
        cpu.copy_h2d(ids, np.array([1], np.int32))
        cpu.begin_capture(s)
        cpu.memset(out, 0, s)
        cpu.launch("embedding", s, out=vt.Tensor.of(out, F32, 1, 2),
                   ids=vt.Tensor.of(ids, I32, 1), table=table)  # fmt: skip
        graph = cpu.end_capture(s)
        gate, release = threading.Event(), threading.Event()
        cpu.enqueue_host(s, "gate", lambda: (gate.set(), release.wait(10)))
        assert gate.wait(10)
        cpu.launch_graph(graph, s)
        worker = s.handle
        assert worker._queue.qsize() == 1  # the whole graph is one hand-off
        release.set()
        cpu.synchronize(s)
        assert np.array_equal(cpu.host_view(out).view(np.float32), [1, 1])
        cpu.copy_h2d(ids, np.array([7], np.int32))  # out of range: the replay fails there
        cpu.launch_graph(graph, s)
        with pytest.raises(StreamError, match=r"embedding failed: ValueError: .*token id 7"):
            cpu.synchronize(s)
        cpu.destroy_graph(graph)
    finally:
        cpu.destroy_stream(s)


def test_kernels_compile_once_per_format_and_are_in_the_disk_cache() -> None:
    kernels_compile.ensure_compiled("Q8_0")
    assert kernels_compile.ensure_compiled("Q8_0") == 0.0  # done in this process
    for kernel in kernels_compile._GROUPS["Q8_0"]:
        assert kernels_compile._cached(kernel) is True
    assert kernels_compile.threading_layer in ("omp", "tbb", "workqueue")


def test_with_the_team_a_formats_pool_kernels_stay_on_disk() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from vt_cpu import compile as C\n"
        "from vt_cpu.kernels import quant as Q\n"
        "C.ensure_compiled('Q4_0', quiet=True, pool=sys.argv[1] == 'pool')\n"
        "print(sorted(k.__name__ for k in C._GROUPS['Q4_0'] if k.overloads))\n"
        "def boom(kernel): raise AssertionError('the disk cache was looked at again')\n"
        "C._cached = boom  # every later weight upload asks again: done, nothing to check\n"
        "assert C.ensure_compiled('Q4_0', quiet=True, pool=sys.argv[1] == 'pool') == 0.0\n"
    )

    def loaded(mode: str) -> str:
        run = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    everything = "['dq_q4', 'mm1_q4', 'mm_q4', 'mv1_q4', 'mv_q4']"
    assert loaded("pool") == everything  # and now they are all in the disk cache
    assert loaded("team") == "[]"  # the team's jobs only (tiles and dequantizers: C jobs)


def test_the_activation_ops_fallback_functions_stay_on_disk_once_cached() -> None:
    """Every activation op runs as jobs; the numba functions only its fallbacks call are
    compiled on a first run but not loaded by later ones (~11 MiB of numba's memory), nor
    are the integer jobs of the activation width not in use."""
    import subprocess
    import sys

    code = (
        "from vt_cpu import compile as C\n"
        "from vt_cpu.kernels import jobs as J\n"
        "C.ensure_compiled('layers', quiet=True)\n"
        "C.ensure_compiled('int8', quiet=True, pool=False)\n"
        "print(sorted(k.__name__ for k in C._GROUPS['layers'] if getattr(k, 'overloads', 1)))\n"
        "print(sorted(J._compiled))\n"
        "def boom(kernel): raise AssertionError('the disk cache was looked at again')\n"
        "C._cached = boom\n"
        "assert C.ensure_compiled('layers', quiet=True) == 0.0\n"
    )
    kernels_compile.ensure_compiled("layers", quiet=True)  # compiled or found: then cached
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "VT_CPU_ACT_BITS": "16"})  # fmt: skip
    assert run.returncode == 0, run.stderr
    layers, jobs = run.stdout.strip().splitlines()
    assert layers == "[]"  # the ops run as jobs, the team as C entries: no numba dispatcher
    assert "'q8_16'" in jobs and "'quant16'" in jobs
    assert "q8_8" not in jobs and "quant8" not in jobs


def test_the_cache_goes_under_vt_home_when_the_package_is_not_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(kernels, "_HERE", blocker)  # its __pycache__ cannot be created
    monkeypatch.setattr(kernels.numba.config, "CACHE_DIR", "")
    monkeypatch.setenv("VT_HOME", str(tmp_path / "home"))
    assert kernels._cache_dir() == str(tmp_path / "home" / "numba-cache")
    monkeypatch.setattr(kernels.numba.config, "CACHE_DIR", str(tmp_path / "mine"))
    assert kernels._cache_dir() is None  # NUMBA_CACHE_DIR wins


def test_fused_ops_are_native_and_a_subclass_can_narrow_to_the_reference(cpu: CpuBackend) -> None:
    for op in ("matmul_add", "swiglu", "rope_kv_store", "embedding", "matmul", "rms_norm"):
        assert cpu.supports(op), op

    class PrimitiveOnly(CpuBackend):
        reference_ops = vt.PRIMITIVE_OPS

    narrow = PrimitiveOnly()
    try:
        assert not narrow.supports("swiglu") and narrow.supports("matmul")
    finally:
        narrow.close()


def test_numba_compiles_with_the_kernels_cpu_features() -> None:
    # vt_cpu configures numba before any of its modules defines a kernel: numba reads the
    # features once, at the first @njit, and a kernel defined earlier had left every kernel
    # on 256-bit vectors (1.3-1.6x slower on AVX-512)
    from numba.core.registry import cpu_target

    features = cpu_target.target_context.codegen()._tm_features
    assert kernels.CPU_FEATURES is None or features == kernels.CPU_FEATURES


@pytest.mark.parametrize(("n", "max_len"), [(1, 70), (3, 70), (16, 70), (32, 70), (33, 70),
                                            (16, 600), (256, 70), (257, 70)])  # fmt: skip
def test_attention_over_the_kv_cache_matches_the_reference(cpu: CpuBackend, n: int,
                                                           max_len: int) -> None:  # fmt: skip
    # rows (their own slots or shared, any lengths) through the op: the numba kernels up to
    # ATTENTION_KERNEL_MAX_ROWS (16 rows of ~300 positions: as team jobs), the reference's
    # matmuls beyond
    layout = vt.KVLayout(n_layers=2, n_slots=300, max_len=max_len, n_kv_heads=2, head_dim=16)
    heads, hd = 6, 16
    rng = np.random.default_rng(n)
    shape = (layout.max_len, layout.n_slots, layout.n_layers, 2, layout.n_kv_heads, hd)
    cache = rng.standard_normal(shape).astype(np.float32)
    q = rng.standard_normal((n, heads * hd)).astype(np.float32)
    slots = rng.permutation(layout.n_slots)[:n].astype(np.int32)
    slots[-1] = slots[0]  # two rows of one slot
    positions = rng.integers(0, layout.max_len, n).astype(np.int32)
    want = vt.reference.attention(q, cache, layout, 1, slots, positions, heads, 0.25)
    s = cpu.create_stream("a")
    bufs = [cpu.alloc(a.nbytes) for a in (q, cache, slots, positions, q)]
    try:
        for b, a in zip(bufs, (q, cache, slots, positions), strict=False):
            cpu.copy_h2d(b, a)
        tq, tc, ts, tp, to = (vt.Tensor.of(b, a.dtype, *a.shape) for b, a in
                              zip(bufs, (q, cache, slots, positions, q), strict=True))  # fmt: skip
        cpu.launch("attention", s, out=to, q=tq, cache=tc, slots=ts, positions=tp,
                   layout=layout, layer=1, n_heads=heads, scale=0.25)  # fmt: skip
        cpu.synchronize(s)
        got = cpu.host_view(bufs[4]).view(np.float32).reshape(n, -1)
        assert nmse(got, want) <= kernel_tolerance("attention", "F32")
        bad = positions.copy()
        bad[n // 2] = layout.max_len  # out of range: the reference's message
        cpu.copy_h2d(bufs[3], bad)
        cpu.launch("attention", s, out=to, q=tq, cache=tc, slots=ts, positions=tp,
                   layout=layout, layer=1, n_heads=heads, scale=0.25)  # fmt: skip
        with pytest.raises(StreamError, match=rf"position {layout.max_len} is out of range"):
            cpu.synchronize(s)
    finally:
        cpu.destroy_stream(s)
