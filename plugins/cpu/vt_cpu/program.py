"""Captured graphs as programs: a decode step's ops run by one native call.

A graph replay used to run each op's closure in turn: about eight ops a layer, each a few
microseconds of Python around its kernels (the closure, the serial/parallel choice, the
team's post and wait, numba's dispatch), holding the GIL meanwhile, so the engine thread
preparing the next step and the stream thread running this one took turns. An op bound
as jobs (:mod:`vt_cpu.kernels.jobs`) now carries its native form, a list of :class:`Step`
(a :class:`NativeOp`); when a graph is captured, each run of such ops becomes one
:class:`Program`, which :func:`vt_cpu.kernels.team.run_program` runs step after step
without the GIL. Its steps are the closures' own compiled jobs, so a replay gives the
same bits either way.

A step that may split over the team follows its op's :class:`~vt_cpu.threads.Choice`,
which only the closures measure: until every choice of a program has settled, and one
replay in :data:`REFRESH` after, the program runs op by op. The whole program runs on the
stream's thread alone while the machine has no idle core or another stream holds the team.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .kernels import team as K
from .kernels.jobs import Job
from .streams import OpFailed
from .threads import Choice, ThreadOwner

#: One replay in this many runs op by op, so the serial/parallel choices keep measuring.
REFRESH = 64
#: Replays between two reads of the choices into the program's steps.
MODES_EVERY = 16


@dataclass(frozen=True)
class Step:
    """One job of an op's native form. ``choice``: shared over the team when it says so
    (None: always alone); ``gate``: the address of an int64 that must reach ``gate_min``
    for the step to be shared (0: none), e.g. the attention's number of scores."""

    job: Job
    choice: Choice | None = None
    gate: int = 0
    gate_min: int = 0


class NativeOp:
    """An op's closure with its native form: ``run()`` computes the op (what a replay op by
    op calls), ``steps`` the same as jobs; ``error()`` builds the exception to raise (and
    clears the status word) after a step's status word was set."""

    __slots__ = ("run", "steps", "error")

    def __init__(self, run: Callable[[], None], steps: Sequence[Step],
                 error: Callable[[], BaseException] | None = None) -> None:  # fmt: skip
        self.run = run
        self.steps = tuple(steps)
        self.error = error

    def __call__(self) -> None:
        self.run()


class Program:
    """Consecutive native ops of a captured graph (``(op name, NativeOp)`` in order) as one
    array of :data:`vt_cpu.kernels.team.STEP` slots a step; calling it runs them."""

    def __init__(self, ops: Sequence[tuple[str, NativeOp]], owner: ThreadOwner) -> None:
        self.ops = tuple(ops)
        self.owner = owner
        team = owner.use_team and owner.n > 1
        rows: list[list[int]] = []
        self.step_op: list[int] = []  # the op of each step
        self._choices: list[tuple[int, Choice]] = []  # (step, choice) of the shareable ones
        for k, (_, op) in enumerate(self.ops):
            for step in op.steps:
                job = step.job
                for p in job.pre:  # the activations' quantization: alone, first
                    rows.append([p.address, _addr(p.args), p.units, max(1, p.units), 0, 0, 0,
                                 _status(p)])  # fmt: skip
                    self.step_op.append(k)
                chunk = owner.team.chunk(job.units) if team else max(1, job.units)
                rows.append([job.address, _addr(job.args), job.units, chunk, 0, step.gate,
                             step.gate_min, _status(job)])  # fmt: skip
                if team and step.choice is not None:
                    self._choices.append((len(rows) - 1, step.choice))
                self.step_op.append(k)
        self.prog = np.array(rows, np.int64).reshape(-1)
        self._alone = np.zeros(K.control_size(1), np.int64)
        self._run = K.entries().run_program
        self._replays = 0
        self._modes_at = -MODES_EVERY  # the replay that last read the choices
        self.native_runs = 0  # replays run as one native call (the others: op by op)

    @property
    def steps(self) -> int:
        return len(self.step_op)

    def __call__(self) -> None:
        owner = self.owner
        n = self._replays = self._replays + 1
        shared = bool(self._choices) and owner.idle()
        if shared and (n % REFRESH == 0 or n - self._modes_at >= MODES_EVERY):
            if n % REFRESH == 0 or not self._read_modes():
                self._op_by_op()
                return
            self._modes_at = n
        team = owner.team if shared else None
        prog, steps, run = self.prog.ctypes.data, self.prog.size // K.STEP, self._run
        if team is not None and team.begin():
            try:
                failed = run(team.ctl.ctypes.data, team.ctl.size, prog, steps, team.helpers, 1)
            finally:
                team.end()
        else:
            failed = run(self._alone.ctypes.data, self._alone.size, prog, steps, 0, 0)
        self.native_runs += 1
        if failed >= 0:
            name, op = self.ops[self.step_op[failed]]
            assert op.error is not None, f"{name} set a status word without an error"
            raise OpFailed(name, op.error())

    def _read_modes(self) -> bool:
        """Each shareable step's way from its choice; False while one is still unsettled."""
        prog = self.prog
        ways = [(i, c.settled()) for i, c in self._choices]
        if any(w < 0 for _, w in ways):
            return False
        for i, w in ways:
            prog[i * K.STEP + 4] = w
        return True

    def _op_by_op(self) -> None:
        for name, op in self.ops:
            try:
                op()
            except Exception as exc:
                raise OpFailed(name, exc) from exc


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def _status(job: Job) -> int:
    return 0 if job.status is None else _addr(job.status)


def build(ops: Sequence[tuple[str, Callable[[], object], bool]],
          owner: ThreadOwner) -> list[tuple[str, Callable[[], object], bool]]:  # fmt: skip
    """A captured stream's work (``(op, fn, always)`` in order) with each run of native ops
    (two or more) replaced by one :class:`Program` (named ``program``)."""
    out: list[tuple[str, Callable[[], object], bool]] = []
    run: list[tuple[str, NativeOp]] = []

    def flush() -> None:
        if len(run) >= 2:
            out.append(("program", Program(run, owner), False))
        else:
            out.extend((name, op, False) for name, op in run)
        run.clear()

    for name, fn, always in ops:
        if isinstance(fn, NativeOp) and not always:
            run.append((name, fn))
            continue
        flush()
        out.append((name, fn, always))
    flush()
    return out
