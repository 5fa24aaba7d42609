"""The cpu backend's team (vt_cpu.team): helper threads that take chunks of a posted kernel.

A job's result must not depend on how its rows were shared out, so every job is compared
bit for bit with the same job run on the calling thread alone (which the backend runs when
it does not share a kernel), and that within float rounding with the kernels' numba entry
points (tested against vt.reference in test_cpu_kernels and test_cpu_q8_kernels). The
team must never hang or run a job twice: parked helpers are woken, a second poster runs
its kernel alone, a closed team refuses work.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_cpu_q8_kernels import KINDS, cols_for, weight
from vt_cpu.kernels import jobs, q8
from vt_cpu.team import Team
from vt_cpu.threads import Idle, ThreadOwner
from vt_cpu.weights import MM_MIN_ROWS


@pytest.fixture(scope="module")
def team() -> Team:
    t = Team(3)  # two helpers: more than this machine's spare core, on purpose
    yield t
    t.close()


def _inputs(kind: str, n: int, residual: bool, rows: int = 45):
    w, _ = weight(kind, rows, cols_for(kind, 3), seed=3)  # 45 rows: 11 groups of 4 and one
    rng = np.random.default_rng(4)
    x = rng.standard_normal((n, w.cols)).astype(np.float32)
    res = rng.standard_normal((n, w.rows)).astype(np.float32)
    return w, x, res


def _run(team: Team, job: jobs.Job, chunk: int) -> None:
    for p in job.pre:  # the activations' quantization, on the poster
        ThreadOwner.alone_call(p)()
    assert team.run(job.address, int(job.args.ctypes.data), job.units, chunk)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("residual", [False, True])
def test_q8_job_equals_the_serial_kernel(team: Team, kind: str, bits: int,
                                         residual: bool) -> None:  # fmt: skip
    w, x, res = _inputs(kind, 1, residual)
    want = res.copy()
    ThreadOwner.alone_call(jobs.q8_job(w, x, want, want if residual else None, bits))()
    ref = res.copy()
    q8.bind(w, x, ref, ref if residual else None, bits)[0]()
    np.testing.assert_allclose(want, ref, rtol=1e-5, atol=1e-5)  # the q8 kernels' own
    for chunk in (1, 2, 5, 100):
        out = res.copy() if residual else np.full_like(res, np.nan)
        _run(team, jobs.q8_job(w, x, out, out if residual else None, bits), chunk)
        np.testing.assert_array_equal(out, want, err_msg=f"{kind} chunk {chunk}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [4, 9, 13])
@pytest.mark.parametrize("residual", [False, True])
def test_tile_job_equals_the_serial_kernel(team: Team, kind: str, n: int,
                                           residual: bool) -> None:  # fmt: skip
    w, x, res = _inputs(kind, n, residual)
    want = res.copy()
    job = w.job(x, want, want if residual else None)
    assert job is not None
    ThreadOwner.alone_call(job)()
    ref = res.copy()
    w.bind(x, ref, ref if residual else None)[0]()  # numba's compile of the same kernel
    np.testing.assert_allclose(want, ref, rtol=1e-5, atol=1e-5)
    for chunk in (1, 3, 100):
        out = res.copy() if residual else np.full_like(res, np.nan)
        _run(team, w.job(x, out, out if residual else None), chunk)
        np.testing.assert_array_equal(out, want, err_msg=f"{kind} n {n} chunk {chunk}")


def test_kernels_without_a_job_keep_numba() -> None:
    w, x, _ = _inputs("Q4_K", MM_MIN_ROWS["Q4_K"] - 1, False)
    assert w.job(x, np.empty((x.shape[0], w.rows), np.float32), None) is None
    f, _ = weight("Q8_0", 8, 64)
    f.kind = "F32"  # a float weight runs BLAS tiles, not a job
    assert f.job(np.ones((4, 64), np.float32), np.empty((4, 8), np.float32), None) is None


def test_parked_helpers_are_woken_and_finish_the_job() -> None:
    t = Team(2, spin_seconds=0.0)  # helpers park after a few pauses
    try:
        w, x, _ = _inputs("Q4_1", 1, False, rows=4096)
        want = np.empty((1, w.rows), np.float32)
        q8.bind(w, x, want, None, 16)[0]()
        for _ in range(20):
            threading.Event().wait(0.002)  # let the helper park between jobs
            out = np.full_like(want, np.nan)
            _run(t, jobs.q8_job(w, x, out, None, 16), 4)
            np.testing.assert_array_equal(out, want)
    finally:
        t.close()


def test_park_stops_the_spinning_at_once_and_the_next_job_wakes_the_helpers() -> None:
    """Before prefill's BLAS tiles run on a pool of their own, the team's helpers park
    instead of spinning on the cores the tiles need; the next job still gets its answer."""
    import time

    from vt_cpu.kernels import team as K

    t = Team(3, spin_seconds=60.0)  # without park() they would spin for a minute
    try:
        w, x, _ = _inputs("Q4_1", 1, False, rows=4096)
        want = np.empty((1, w.rows), np.float32)
        q8.bind(w, x, want, None, 16)[0]()
        for _ in range(5):
            out = np.full_like(want, np.nan)
            _run(t, jobs.q8_job(w, x, out, None, 16), 4)
            np.testing.assert_array_equal(out, want)
            t.park()
            deadline = time.monotonic() + 10
            while not all(t.ctl[K.PARKED + 8 * i] for i in range(t.helpers)):
                assert time.monotonic() < deadline, "the helpers kept spinning"
                time.sleep(0.001)
    finally:
        t.close()


def test_a_second_poster_runs_alone_and_both_results_are_right(team: Team) -> None:
    w, x, _ = _inputs("Q8_0", 1, False, rows=2048)
    want = np.empty((1, w.rows), np.float32)
    q8.bind(w, x, want, None, 16)[0]()
    owner = ThreadOwner(2)
    errors: list[str] = []

    def poster(k: int) -> None:
        out = np.empty_like(want)
        call = owner.team_call(jobs.q8_job(w, x, out, None, 16))
        for _ in range(200):
            out[:] = np.nan
            call()
            if not np.array_equal(out, want):
                errors.append(f"poster {k}")

    try:
        threads = [threading.Thread(target=poster, args=(k,)) for k in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        assert not any(th.is_alive() for th in threads), "a poster hung"
        assert errors == []
    finally:
        owner.close()


def test_a_closed_team_refuses_work_and_its_helpers_exit() -> None:
    t = Team(3)
    helpers = list(t._threads)
    t.close()
    t.close()  # idempotent
    assert all(not h.is_alive() for h in helpers)
    args = np.zeros(jobs.Q8_ARGS, np.int64)
    at = int(args.ctypes.data)
    assert t.run(jobs.address("q8_16"), at, 4, 1) is False
    assert t.run(jobs.address("q8_16"), at, 0, 1) is True  # nothing to do is done


def test_a_team_needs_two_threads() -> None:
    with pytest.raises(ValueError, match="at least 2 threads, got 1"):
        Team(1)


def test_our_own_runnable_threads_are_not_other_load(tmp_path) -> None:  # noqa: ANN001
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.00 0.00 0.00 3/100 1\n")  # the reader, a helper, an engine thread
    tasks = tmp_path / "task"
    for tid, state in ((1, "R"), (2, "R"), (3, "R"), (4, "S")):
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "stat").write_text(f"{tid} (vt (a) b) {state} 1 2 3\n")
    idle = Idle(cpus=2, period=0.0, path=str(loadavg), tasks=str(tasks))
    assert idle.ours() == 3
    assert idle()
    loadavg.write_text("0.00 0.00 0.00 5/100 1\n")  # and two other processes' threads
    assert not any([idle() for _ in range(10)][5:])


def test_a_bound_job_keeps_its_arrays_alive() -> None:
    """The closures hold the job, and the job every array its addresses point into (the
    residual path's scratch exists nowhere else)."""
    import gc

    w, x, res = _inputs("Q4_1", 9, True)
    want = res.copy()
    w.bind(x, want, want)[0]()
    out = res.copy()
    owner = ThreadOwner(2)
    try:
        calls = [owner.team_call(w.job(x, out, out)), ThreadOwner.alone_call(w.job(x, out, out))]
        gc.collect()
        for _ in range(3):
            junk = [np.full((64, 64), np.nan, np.float32) for _ in range(64)]  # reuse freed memory
            del junk
        for call in calls:
            out[:] = res
            call()
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    finally:
        owner.close()


@pytest.mark.parametrize("kinds", [("Q4_1", "Q4_1", "Q4_1"), ("Q4_K", "Q6_K", "Q8_0"),
                                   ("Q4_0", "Q8_0", "Q4_1")])  # fmt: skip
@pytest.mark.parametrize("n", [1, 9])
def test_a_multi_job_equals_its_parts(team: Team, kinds: tuple[str, ...], n: int) -> None:
    """Q, K and V (or gate and up) as one job: each output as its own job gives, with the
    activations quantized once per activation layout (the nibble formats interleave it, the
    K-quants take it per 256 values)."""
    cols = cols_for("Q4_K", 1)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    shapes = zip(kinds, (33, 8, 8), strict=True)
    ws = [weight(k, rows, cols, seed=i)[0] for i, (k, rows) in enumerate(shapes)]

    def part(w, out, shared):  # noqa: ANN001, ANN202
        return jobs.q8_job(w, x, out, None, 16, shared) if n == 1 else w.job(x, out, None)

    want = [np.empty((n, w.rows), np.float32) for w in ws]
    for w, o in zip(ws, want, strict=True):
        ThreadOwner.alone_call(part(w, o, None))()
    for chunk in (1, 4, 1000):
        outs = [np.full((n, w.rows), np.nan, np.float32) for w in ws]
        shared: dict = {}
        job = jobs.multi_job([part(w, o, shared) for w, o in zip(ws, outs, strict=True)])
        assert job.units == sum((w.rows + 3) // 4 if n < 8 else (w.rows + 1) // 2 for w in ws)
        _run(team, job, chunk)
        for got, exp in zip(outs, want, strict=True):
            np.testing.assert_array_equal(got, exp)
    if n == 1:
        layouts = {q8.layout(q8.FMT_ID[k]) for k in kinds}
        assert len(shared) == len(layouts)  # quantized once each


ATTENTION_SHAPES = [(1, 9, 3, 64), (5, 32, 8, 64), (3, 4, 4, 128), (2, 6, 1, 32)]


@pytest.mark.parametrize(("n", "heads", "n_kv", "hd"), ATTENTION_SHAPES)
def test_attention_jobs_equal_the_serial_kernels(team: Team, n: int, heads: int, n_kv: int,
                                                 hd: int) -> None:  # fmt: skip
    """Decode attention as jobs (check and lay out, scores, values over (row, KV head)
    units) gives the serial kernels' bits, shared or alone, as the context grows; a bad
    position leaves its code in the status word and writes nothing."""
    from vt_cpu.kernels import attention as A

    rng = np.random.default_rng(9)
    length, n_slots, n_layers = 200, 6, 3
    cache = rng.standard_normal((length, n_slots, n_layers, 2, n_kv, hd)).astype(np.float32)
    q = rng.standard_normal((n, heads * hd)).astype(np.float32)
    slots = rng.permutation(n_slots)[:n].astype(np.int32)
    pos = rng.integers(0, 40, n).astype(np.int32)
    maxes, out = np.empty(n * heads, np.float32), np.full((n, heads * hd), np.nan, np.float32)
    buf = np.full(n * heads * length, np.nan, np.float32)
    aj = jobs.AttentionJobs(q, cache, 1, slots, pos, heads, 0.125, maxes, out, buf)
    prep, job_s, job_v = aj.jobs()
    for step in range(3):
        pos += 50 * step  # the next calls see longer contexts
        total = A.packed_size(slots, pos, heads, length, n_slots)
        ref_buf, want = np.empty(total, np.float32), np.empty_like(out)
        A.scores(q, cache, 1, slots, pos, heads, 0.125, ref_buf, np.empty_like(maxes))
        A.weighted_values(cache, 1, slots, pos, heads, ref_buf, want)
        for shared in (False, True):
            out[:] = np.nan
            ThreadOwner.alone_call(prep)()
            assert aj.status[0] == 0 and aj.starts[n] == total
            for job in (job_s, job_v):
                if shared:
                    _run(team, job, 1)
                else:
                    ThreadOwner.alone_call(job)()
            np.testing.assert_array_equal(out, want, err_msg=f"step {step} shared {shared}")
    pos[n - 1] = length  # out of range: its code, nothing computed
    ThreadOwner.alone_call(prep)()
    assert aj.status[0] == -(2 + n - 1)


def test_attention_exp_is_within_an_ulp_or_two_of_float64() -> None:
    """The softmax's ``exp`` (a polynomial LLVM vectorizes) against float64's, over the
    range scores minus their maximum take; 0 where float32's exp would be denormal."""
    from numba import njit
    from vt_cpu.kernels.attention import expf

    @njit
    def apply(x: np.ndarray) -> None:
        for i in range(x.shape[0]):
            x[i] = expf(x[i])

    x = -np.abs(np.random.default_rng(1).standard_normal(200_000) * 15).astype(np.float32)
    x[:4] = [0.0, -1e-9, -86.99, -87.01]
    got = x.copy()
    apply(got)
    want = np.exp(x.astype(np.float64))
    normal = x >= -87.0
    ulps = np.abs(got[normal] - want[normal]) / np.spacing(want[normal].astype(np.float32))
    assert ulps.max() <= 2.0
    assert got[0] == 1.0 and np.all(got[~normal] == 0.0)


def test_vt_cpu_team_0_keeps_numbas_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """``VT_CPU_TEAM=0``: no team is started; the decode matmuls bind numba's kernels and
    give the same answer within the kernels' bounds."""
    import vt
    from gguf import GGMLQuantizationType
    from vt_cpu import CpuBackend

    QTYPE_Q4_1 = int(GGMLQuantizationType.Q4_1)  # noqa: N806

    w, x, _ = _inputs("Q4_1", 1, False)
    want = np.empty((1, w.rows), np.float32)
    ThreadOwner.alone_call(jobs.q8_job(w, x, want, None, 16))()
    monkeypatch.setenv("VT_CPU_TEAM", "0")
    backend = CpuBackend()
    try:
        assert backend.threads.use_team is False
        data = w.arrays[0].reshape(-1)
        p = backend._upload_weight(vt.WeightTensor("w", QTYPE_Q4_1, (w.rows, w.cols), data))
        out = np.full_like(want, np.nan)
        backend._project(p.handle, x, out, None)()
        assert backend.threads._team is None  # never started
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    finally:
        backend.close()
