"""The CPU backend's team: helper threads that take chunks of a posted kernel.

See :mod:`vt_cpu.kernels.team` for the protocol. A :class:`Team` has ``n - 1`` helper
threads (daemons); each spins in native code for about :data:`SPIN_SECONDS` after its
last job (a decode step posts its next kernel within microseconds, so the helpers stay
hot for a whole step) and then parks on an event until a poster wakes it. One thread posts
at a time: :meth:`Team.run` returns False when another is posting (the caller then runs
the kernel itself), so two streams never wait on each other here.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from .kernels import team as K

#: How long a helper spins for the next job before parking (seconds). Between two kernels
#: of a decode step the gap is a few microseconds of Python; between two steps it is the
#: engine's scheduling and sampling, well under this.
SPIN_SECONDS = 0.002


def _pauses(seconds: float) -> int:
    """How many spin-wait pauses last about ``seconds`` on this CPU (measured once)."""
    ctl = np.zeros(K.control_size(1), np.int64)
    probe = K.entries().spin_seconds_probe  # mapped or compiled here
    probe(ctl.ctypes.data, ctl.size, 1000)
    n = 20000
    t0 = time.perf_counter()
    probe(ctl.ctypes.data, ctl.size, n)
    per = max(1e-9, (time.perf_counter() - t0) / n)
    return max(1000, int(seconds / per))


class Team:
    """``n`` threads for one kernel at a time: the poster and ``n - 1`` helpers."""

    def __init__(self, n: int, spin_seconds: float = SPIN_SECONDS) -> None:
        if n < 2:
            raise ValueError(f"a team needs at least 2 threads, got {n}")
        self.n = n
        self.helpers = n - 1
        self.ctl = np.zeros(K.control_size(self.helpers), np.int64)
        self._c = K.entries()
        self._ctl = (self.ctl.ctypes.data, self.ctl.size)  # the control block, for C
        self.spin = _pauses(spin_seconds)
        self._events = [threading.Event() for _ in range(self.helpers)]
        self._post = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(
                target=self._helper, args=(i,), name=f"vt-cpu-team-{i + 1}", daemon=True
            )  # fmt: skip
            for i in range(self.helpers)
        ]
        for t in self._threads:
            t.start()

    def _helper(self, me: int) -> None:
        ctl, event, last = self.ctl, self._events[me], 0
        helper_loop, (at, n) = self._c.helper_loop, self._ctl
        while True:
            last = helper_loop(at, n, me, last, self.spin)
            if ctl[K.STOP]:
                return
            event.wait()
            event.clear()

    def chunk(self, total: int) -> int:
        """Units per chunk for a job of ``total`` units: about 8 chunks per thread, so a
        late or slow thread delays the job by one small chunk at most."""
        return max(1, -(-total // (8 * self.n)))

    def run(self, fn: int, args: int, total: int, chunk: int) -> bool:
        """Run job ``fn`` (a :mod:`vt_cpu.kernels.jobs` address) with its argument block at
        address ``args`` over ``total`` units in chunks of ``chunk`` on the team; False
        (nothing run) while another thread posts or after :meth:`close`."""
        if total <= 0:
            return True
        if self._closed or not self._post.acquire(blocking=False):
            return False
        try:
            c, (at, n) = self._c, self._ctl
            if c.post(at, n, fn, args, total, max(1, chunk), self.helpers):
                for e in self._events:
                    e.set()
                c.finish(at, n)
        finally:
            self._post.release()
        return True

    def park(self) -> None:
        """Let the helpers stop spinning now: the caller is about to run work on other
        threads (prefill's BLAS tiles), which a spinning helper would take a core from.
        The next job wakes them."""
        if not self._closed:
            self._c.park_now(*self._ctl)

    def begin(self) -> bool:
        """Become the poster for a series of jobs (a program, :mod:`vt_cpu.program`),
        waking the parked helpers first; False while another thread posts or after
        :meth:`close`. :meth:`end` gives the team back."""
        if self._closed or not self._post.acquire(blocking=False):
            return False
        ctl = self.ctl
        for i, e in enumerate(self._events):
            if ctl[K.PARKED + 8 * i]:
                e.set()
        return True

    def end(self) -> None:
        self._post.release()

    def close(self) -> None:
        """Stop the helpers (idempotent); later :meth:`run` calls return False."""
        if self._closed:
            return
        with self._post:
            self._closed = True
            self._c.stop(*self._ctl)
        for e in self._events:
            e.set()
        for t in self._threads:
            t.join()
