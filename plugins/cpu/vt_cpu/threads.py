"""One owner of the CPU threads: the team's, numba's pool and BLAS's are sized together.

The backend runs its kernels on its stream threads. A kernel either runs on the calling
thread alone (BLAS limited to one thread) or splits its rows: the decode matmuls as jobs
of the team (:mod:`vt_cpu.team`: ``n - 1`` helpers that spin between kernels), the other
numba kernels over numba's pool (OpenMP or TBB, ``n`` threads, the caller included). BLAS
always runs single-threaded, through ``threadpoolctl``, so no BLAS pool ever spins beside
the others; prefill tiles run on ``n`` threads through :meth:`ThreadOwner.tiles`.

Whether splitting pays depends on the machine *now*: on an idle machine two threads
nearly halve a matrix-vector product, on a busy one every hand-off to a second thread
waits for the scheduler (milliseconds) and the split costs far more than it saves. While
other threads keep every other core busy (:class:`Idle`, from the kernel's runnable count)
kernels run serially; otherwise :class:`Choice` measures both ways per size of weight
matrix as it runs (an exponential moving average of each, re-trying the slower one now and
then) and uses the faster.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numba
import vt
from threadpoolctl import threadpool_limits

from .kernels.jobs import Job
from .kernels.team import entries
from .team import Team


def available_cpus() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, int(numba.config.NUMBA_NUM_THREADS)))


class Choice:
    """Serial or parallel, for kernels of one size: the faster as measured.

    Each way keeps an exponential moving average of its time; each is tried ``warmup``
    times first, then the faster runs and the slower is tried again now and then (a
    machine's load changes), the less often the more it costs: every ``explore`` calls
    times the measured slowdown (a parallel call that waits milliseconds for a busy
    scheduler is retried every few thousand calls, not every 64).
    """

    __slots__ = ("times", "calls", "explore", "warmup", "timing_every", "_next")

    def __init__(self, explore: int = 64, warmup: int = 2, timing_every: int = 16) -> None:
        self.timing_every = timing_every
        self.times = [0.0, 0.0]  # 0: serial, 1: parallel
        self.calls = [0, 0]
        self.explore = explore
        self.warmup = warmup
        self._next = 0  # calls until the slower way is tried again

    def pick(self) -> int:
        """The way to run next: 0 serial, 1 parallel; +2 when the call need not be timed
        (the settled choice is timed one call in ``timing_every``)."""
        c0, c1 = self.calls
        if c0 < self.warmup or c1 < self.warmup:
            return 0 if c0 <= c1 else 1
        best = 0 if self.times[0] <= self.times[1] else 1
        self._next -= 1
        if self._next <= 0:
            slow, fast = self.times[1 - best], self.times[best]
            ratio = min(64.0, slow / fast) if fast > 0 else 64.0
            self._next = int(self.explore * max(1.0, ratio))
            return 1 - best
        return best if self._next % self.timing_every == 0 else best + 2

    def settled(self) -> int:
        """The faster way once both were tried ``warmup`` times (0 serial, 1 parallel),
        else -1; unlike :meth:`pick` it changes nothing."""
        c0, c1 = self.calls
        if c0 < self.warmup or c1 < self.warmup:
            return -1
        return 0 if self.times[0] <= self.times[1] else 1

    def record(self, way: int, seconds: float) -> None:
        n = self.calls[way]
        self.calls[way] = n + 1
        if n == 0:
            self.times[way] = seconds
        else:
            # One call held up for milliseconds (a page fault, a preempted helper) must not
            # settle the choice for thousands of calls: a sample counts at most 3x the mean.
            seconds = min(seconds, 3.0 * self.times[way])
            self.times[way] += 0.2 * (seconds - self.times[way])


#: Serializes parallel kernels when numba's threading layer is workqueue (not thread-safe:
#: two streams launching at once would abort the process).
WORKQUEUE_LOCK = threading.Lock()
_blas_lock = threading.Lock()
_blas_users = 0
_blas_limits: threadpool_limits | None = None


def _hold_blas() -> None:
    """Hold BLAS to one thread while any backend is open (process-wide, counted)."""
    global _blas_users, _blas_limits
    with _blas_lock:
        if _blas_users == 0:
            _blas_limits = threadpool_limits(limits=1, user_api="blas")
        else:  # a BLAS library loaded since (scipy's, say) is held too
            threadpool_limits(limits=1, user_api="blas")
        _blas_users += 1


def _release_blas() -> None:
    global _blas_users, _blas_limits
    with _blas_lock:
        _blas_users -= 1
        if _blas_users == 0 and _blas_limits is not None:
            _blas_limits.restore_original_limits()
            _blas_limits = None


class Idle:
    """Whether the machine has a core to spare for a second thread, sampled every
    ``period`` seconds from the kernel's count of runnable threads (``/proc/loadavg``) less
    this process's own (``/proc/self/task``), smoothed: other processes' runnable threads
    must leave a core idle. (Counting one other runnable thread as idle was tried: with one
    CPU-bound process beside it on two cores, the team's spinning helper then took a third of
    the poster's core, serial calls included, and decode fell from 83 to 63 tok/s.)
    Without ``/proc`` (not Linux) it always says yes and :class:`Choice` alone decides."""

    def __init__(self, cpus: int, period: float = 0.25, path: str = "/proc/loadavg",
                 tasks: str = "/proc/self/task") -> None:  # fmt: skip
        self.cpus = cpus
        self.period = period
        self.path = path
        self.tasks = tasks
        self.others = 0.0  # smoothed count of other processes' runnable threads
        self._at = -1.0e9

    def ours(self) -> int:
        """This process's runnable threads (the reader among them): its engine thread, the
        stream threads, the team's spinning helpers use cores, but they are not a load
        that makes a second thread wait for the scheduler."""
        n = 0
        try:
            names = os.listdir(self.tasks)
        except OSError:
            return 1
        for tid in names:
            try:
                with open(f"{self.tasks}/{tid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # the thread exited
                continue
            state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
            n += state == b"R"
        return max(1, n)

    def sample(self) -> float | None:
        try:
            with open(self.path, "rb") as f:
                running = int(f.read().split()[3].split(b"/")[0])
        except (OSError, ValueError, IndexError):
            return None
        return float(max(0, running - self.ours()))

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._at >= self.period:
            self._at = now
            got = self.sample()
            if got is None:
                self.others = 0.0
            else:
                self.others += 0.3 * (got - self.others)
        return self.others <= self.cpus - 1.5


class ThreadOwner:
    """The backend's threads: ``n`` of them for numba's pool and for prefill tiles; BLAS
    is held to one thread for the process's lifetime of the backend."""

    def __init__(self, n: int | None = None) -> None:
        self.n = n or available_cpus()
        self._holding = True
        _hold_blas()
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.parallel_lock: threading.Lock | None = None  # set for a non-thread-safe layer
        self._choices: dict[tuple[str, int], Choice] = {}
        self._team: Team | None = None
        #: Whether decode matmuls run as team jobs (``VT_CPU_TEAM``), else numba's pool.
        self.use_team = bool(vt.envs.get("VT_CPU_TEAM"))
        self.idle = Idle(self.n)

    def choice(self, nbytes: int, kind: str = "matmul") -> Choice:
        """The serial/parallel choice shared by kernels of ``kind`` over about ``nbytes``
        (one per power of two), so it is learnt from every projection of that size."""
        key = (kind, max(0, int(nbytes)).bit_length())
        got = self._choices.get(key)
        if got is None:
            got = self._choices.setdefault(key, Choice())
        return got

    def close(self) -> None:
        team, self._team = self._team, None
        if team is not None:
            team.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self._holding:
            self._holding = False
            _release_blas()

    def numba_threads(self) -> int:
        """Set numba's thread count on the calling thread (it is thread-local) to ``n``."""
        if getattr(self._local, "numba", 0) != self.n:
            numba.set_num_threads(self.n)
            self._local.numba = self.n
        return self.n

    @property
    def team(self) -> Team:
        """The helper threads for team jobs (started on first use)."""
        team = self._team
        if team is None:
            with self._lock:
                if self._team is None:
                    self._team = Team(self.n)
                team = self._team
        return team

    def numba_call(self, parallel: Callable[[int], None]) -> Callable[[], None]:
        """``parallel(n)`` (a numba ``prange`` kernel) as a call for :meth:`run`: numba's
        thread count set on the calling thread, serialized under a non-thread-safe layer."""

        def call() -> None:
            n = self.numba_threads()
            lock = self.parallel_lock
            if lock is None:
                parallel(n)
            else:
                with lock:
                    parallel(n)

        return call

    def team_call(self, job: Job) -> Callable[[], None]:
        """A :class:`vt_cpu.kernels.jobs.Job` as a call for :meth:`run`: posted to the
        team, or run on the calling thread alone while another thread posts."""
        pre, args, units = _pre(job), job.args, job.units
        fn, addr = self.team, job.address  # started and compiled now, not in a timed call
        at, chunk = int(args.ctypes.data), fn.chunk(units)  # (ctypes costs ~1 us a call)
        run_alone = entries().run_alone

        def call(job: Job = job) -> None:  # holds the job: args points into its arrays
            for p_addr, p_at, p_units in pre:
                run_alone(p_addr, p_at, p_units)
            if not fn.run(addr, at, units, chunk):
                run_alone(addr, at, units)

        return call

    @staticmethod
    def alone_call(job: Job) -> Callable[[], None]:
        """A :class:`vt_cpu.kernels.jobs.Job` on the calling thread alone: the same
        compiled kernel as :meth:`team_call`, so the two give the same bits."""
        pre, args, units = _pre(job), job.args, job.units
        addr, at = job.address, int(args.ctypes.data)
        run_alone = entries().run_alone

        def call(job: Job = job) -> None:  # holds the job: args points into its arrays
            for p_addr, p_at, p_units in pre:
                run_alone(p_addr, p_at, p_units)
            run_alone(addr, at, units)

        return call

    def run(self, choice: Choice, serial: Callable[[], None], parallel: Callable[[], None]) -> None:
        """Run one kernel serially or in parallel (a :meth:`team_call` or
        :meth:`numba_call`), as ``choice`` says; time it. While the machine has no idle core
        the kernel runs serially without asking."""
        if self.n <= 1 or not self.idle():
            serial()
            return
        way = choice.pick()
        if way >= 2:  # settled: run the faster way untimed
            if way == 2:
                serial()
            else:
                parallel()
            return
        t0 = time.perf_counter()
        if way:
            parallel()
        else:
            serial()
        choice.record(way, time.perf_counter() - t0)

    def tiles(self, step: int, total: int, fn: Callable[[int, int], None]) -> None:
        """Run ``fn(r0, r1)`` over ``[0, total)`` in tiles of ``step``, on up to ``n``
        threads that take tiles as they go (a descheduled helper delays only its tile), or
        on the calling thread alone while the machine has no idle core."""
        starts = list(range(0, total, step))
        team = self._team
        if team is not None:  # its helpers would spin on the cores these tiles need
            team.park()
        if self.n <= 1 or len(starts) < 2 or not self.idle():
            for r0 in starts:
                fn(r0, min(total, r0 + step))
            return
        lock = threading.Lock()
        it = iter(starts)

        def work() -> None:
            while True:
                with lock:
                    r0 = next(it, None)
                if r0 is None:
                    return
                fn(r0, min(total, r0 + step))

        helpers: list[Future[None]] = [
            self._executor().submit(work) for _ in range(min(self.n, len(starts)) - 1)
        ]
        work()
        for f in helpers:
            f.result()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=max(1, self.n - 1), thread_name_prefix="vt-cpu-tiles"
                )
            return self._pool


def _pre(job: Job) -> list[tuple[int, int, int]]:
    """``(address, argument block's address, units)`` of each of ``job.pre``."""
    return [(p.address, int(p.args.ctypes.data), p.units) for p in job.pre]
