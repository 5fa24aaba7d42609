"""A team of threads that share one kernel's rows without a fork-join per kernel.

numba's own parallel kernels (``prange``) cost a thread hand-off per call: launched from
a thread other than the process's first (the backend's stream threads), libgomp woke its
team for every call, 60-90 us on this 2-core machine against 10-70 us of work per decode
kernel, so two threads gained about 5% per token. Here the helpers stay in native code
between kernels, spinning on a shared control block, and a kernel is *posted* instead of
launched:

- the poster writes the job (a C function's address, the address of its arguments, the
  number of work units and the units per chunk) into ``ctl`` and publishes it by bumping
  ``ctl[SEQ]`` (release);
- every thread, the poster included, claims chunks with a compare-and-swap on
  ``ctl[CLAIM]`` (the job's sequence number in the high 32 bits, the next chunk in the
  low 32) and calls ``fn(args, u0, u1)`` for the chunk's units;
- the poster returns once ``ctl[DONE]`` counts every chunk.

A helper that is late (descheduled, or still waking) finds the chunks taken and only the
poster's time is lost, never a result: chunks are claimed, not assigned. A helper that sees
no job for ``spin`` pauses parks (returns to Python and waits on an event); the poster
sees its ``PARKED`` flag after publishing and wakes it (``post`` returns 1 and the caller
sets the event, then calls :func:`finish`). The functions take and return only integers
and arrays: they run without the GIL.

The jobs are ``cfunc``s of signature ``void(int64 args, int64 u0, int64 u1)``;
:mod:`vt_cpu.kernels.jobs` has the backend's, which rebuild their arrays from the
addresses in ``args`` with :func:`ptr`.
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_KW = {"cache": True, "nogil": True, "boundscheck": False}

#: Slots of the control block (int64); each group on its own 64-byte line.
SEQ, CLAIM, DONE = 0, 8, 16
FN, ARGS, TOTAL, CHUNK, NCHUNKS = 24, 25, 26, 27, 28
STOP = 32
PARK_NOW = 33  # set: spinning helpers park at once (other threads need the cores)
PARKED = 40  # + 8 * helper
MASK32 = 0xFFFFFFFF


def control_size(helpers: int) -> int:
    """Slots of a control block for ``helpers`` helper threads."""
    return PARKED + 8 * max(1, helpers)


def _slot(context, builder, arrty, arr, idxty, idx):  # noqa: ANN001, ANN202
    ary = context.make_array(arrty)(context, builder, arr)
    i = context.cast(builder, idx, idxty, types.intp)
    return builder.gep(ary.data, [i])


@intrinsic
def load_acquire(typingctx, arr, idx):  # noqa: ANN001, ANN201
    """``arr[idx]`` (int64), an acquire load: later loads see what was written before the
    release store that wrote it."""
    sig = types.int64(arr, idx)

    def codegen(context, builder, sig, args):
        ptr = _slot(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def store_release(typingctx, arr, idx, value):  # noqa: ANN001, ANN201
    """``arr[idx] = value`` (int64), a release store."""
    sig = types.void(arr, idx, types.int64)

    def codegen(context, builder, sig, args):
        ptr = _slot(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(v, ptr, "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_seq_cst(typingctx, arr, idx, value):  # noqa: ANN001, ANN201
    """``arr[idx] = value`` (int64), sequentially consistent: a later load of another slot
    is not moved before it (what publishing a job and then reading the parked flags, or
    parking and then re-reading the job, both need)."""
    sig = types.void(arr, idx, types.int64)

    def codegen(context, builder, sig, args):
        ptr = _slot(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.atomic_rmw("xchg", ptr, v, "seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def compare_swap(typingctx, arr, idx, expect, value):  # noqa: ANN001, ANN201
    """Set ``arr[idx] = value`` if it holds ``expect`` (acq_rel); whether it did."""
    sig = types.boolean(arr, idx, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        ptr = _slot(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        got = builder.cmpxchg(ptr, args[2], args[3], "acq_rel", "acquire")
        return builder.extract_value(got, 1)

    return sig, codegen


@intrinsic
def fetch_add(typingctx, arr, idx, value):  # noqa: ANN001, ANN201
    """``arr[idx] += value`` atomically (acq_rel); the value before."""
    sig = types.int64(arr, idx, types.int64)

    def codegen(context, builder, sig, args):
        ptr = _slot(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "acq_rel")

    return sig, codegen


def _pause_call(builder: ir.IRBuilder) -> None:
    triple = llvm.get_process_triple()
    if triple.startswith(("x86_64", "i686", "i386")):
        fnty = ir.FunctionType(ir.VoidType(), [])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause")
        builder.call(fn, [])
    elif triple.startswith(("aarch64", "arm64")):
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.aarch64.hint")
        builder.call(fn, [ir.Constant(i32, 1)])  # yield
    # elsewhere: a plain spin (the loads are atomic, so the loop is not optimized away)


@intrinsic
def pause(typingctx):  # noqa: ANN001, ANN201
    """A spin-wait hint (x86 ``pause``, arm ``yield``): cheaper for the sibling
    hyper-thread and for the memory bus than a bare loop."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        _pause_call(builder)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def call_job(typingctx, fn, args, u0, u1):  # noqa: ANN001, ANN201
    """Call the C function at address ``fn`` as ``void fn(int64 args, int64 u0, int64 u1)``."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, sig, a):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64, i64, i64])
        f = builder.inttoptr(a[0], fnty.as_pointer())
        builder.call(f, [a[1], a[2], a[3]])
        return context.get_dummy_value()

    return sig, codegen


def _pointer_intrinsic(dtype):  # noqa: ANN001, ANN202
    @intrinsic
    def to_pointer(typingctx, addr):  # noqa: ANN001, ANN202
        sig = types.CPointer(dtype)(types.int64)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

        return sig, codegen

    return to_pointer


#: Typed pointers from addresses (for ``numba.carray`` in the jobs).
ptr_f32 = _pointer_intrinsic(types.float32)
ptr_u8 = _pointer_intrinsic(types.uint8)
ptr_i8 = _pointer_intrinsic(types.int8)
ptr_i32 = _pointer_intrinsic(types.int32)
ptr_i64 = _pointer_intrinsic(types.int64)


@njit(**_KW)
def work(ctl, seq):
    """Claim and run chunks of job ``seq`` until none is left (or a newer job replaced
    it); the number of chunks run."""
    fn, args, total, chunk = ctl[FN], ctl[ARGS], ctl[TOTAL], ctl[CHUNK]
    tag = seq & MASK32
    ran = 0
    while True:
        w = load_acquire(ctl, CLAIM)
        c = w & MASK32
        # A claim succeeds only while the word still names this job, so the fields read
        # above were this job's: the poster rewrites them only after every chunk is done.
        if (w >> 32) != tag or c * chunk >= total:
            return ran
        if compare_swap(ctl, CLAIM, w, w + 1):
            u0 = c * chunk
            call_job(fn, args, u0, min(total, u0 + chunk))
            fetch_add(ctl, DONE, 1)
            ran += 1


@njit(**_KW)
def helper_loop(ctl, me, last, spin):
    """A helper's life between parks: run the chunks of every new job; after ``spin``
    pauses without one, set its PARKED flag and return the last job seen (the caller
    waits for a wake-up, then calls again). Returns at once when ``ctl[STOP]`` is set."""
    flag = PARKED + 8 * me
    store_seq_cst(ctl, flag, 0)
    idle = 0
    while load_acquire(ctl, STOP) == 0:
        s = load_acquire(ctl, SEQ)
        if s != last:
            last = s
            work(ctl, s)
            idle = 0
            continue
        pause()
        idle += 1
        if idle >= spin or load_acquire(ctl, PARK_NOW) != 0:
            store_seq_cst(ctl, flag, 1)
            if load_acquire(ctl, SEQ) == last or load_acquire(ctl, STOP) != 0:
                return last
            store_seq_cst(ctl, flag, 0)  # a job came in while parking: take part
            idle = 0
    return last


@njit(**_KW)
def post(ctl, fn, args, total, chunk, helpers):
    """Publish a job of ``total`` units in chunks of ``chunk``. When a helper is parked,
    return 1 at once (the caller wakes it, then calls :func:`finish`); else take part and
    return 0 once every chunk is done. The caller is the only poster of ``ctl``."""
    seq = ctl[SEQ] + 1
    store_release(ctl, PARK_NOW, 0)
    ctl[FN] = fn
    ctl[ARGS] = args
    ctl[TOTAL] = total
    ctl[CHUNK] = chunk
    ctl[NCHUNKS] = (total + chunk - 1) // chunk
    store_release(ctl, DONE, 0)
    store_release(ctl, CLAIM, (seq & MASK32) << 32)
    store_seq_cst(ctl, SEQ, seq)
    for i in range(helpers):
        if load_acquire(ctl, PARKED + 8 * i) != 0:
            return 1
    finish(ctl)
    return 0


@njit(**_KW)
def finish(ctl):
    """Take part in the current job, then wait until every chunk of it is done."""
    seq = ctl[SEQ]
    work(ctl, seq)
    n = ctl[NCHUNKS]
    while load_acquire(ctl, DONE) < n:
        pause()


@njit(**_KW)
def run_alone(fn, args, total):
    """A job's units on the calling thread only (no team, or the team is busy)."""
    call_job(fn, args, 0, total)


#: A program step's slots (int64): job address, argument block, units, units per chunk,
#: shared (1) or alone (0), the address of a size that must reach the next slot's minimum
#: for the step to be shared (0: none), that minimum, the address of a status word (0:
#: none) that a failing job sets nonzero.
STEP = 8


@njit(**_KW)
def run_program(ctl, prog, helpers, shared):
    """Run a program's steps in order (:mod:`vt_cpu.program`): each as a posted job of the
    team when ``shared`` and its slot say so (the caller holds the team, as a poster
    does), else on the calling thread. Returns -1, or the index of the first step whose
    status word is nonzero after it ran (the steps after it do not run)."""
    for i in range(prog.shape[0] // STEP):
        b = i * STEP
        fn, args, units, chunk = prog[b], prog[b + 1], prog[b + 2], prog[b + 3]
        share = shared and prog[b + 4] != 0
        if share and prog[b + 5] != 0:
            share = carray(ptr_i64(prog[b + 5]), 1)[0] >= prog[b + 6]
        if share:
            if post(ctl, fn, args, units, chunk, helpers):
                finish(ctl)  # a parked helper is not woken here: the others take its chunks
        elif units > 0:
            call_job(fn, args, 0, units)
        if prog[b + 7] != 0 and carray(ptr_i64(prog[b + 7]), 1)[0] != 0:
            return i
    return -1


@njit(**_KW)
def spin_seconds_probe(ctl, n):
    """``n`` pauses (timed by the caller, to size a helper's spin in pauses)."""
    s = 0
    for _ in range(n):
        pause()
        s += load_acquire(ctl, STOP)
    return s


@njit(**_KW)
def park_now(ctl):
    """Ask the spinning helpers to park at once (the next post wakes them)."""
    store_seq_cst(ctl, PARK_NOW, 1)


@njit(**_KW)
def stop(ctl):
    """Tell the helpers to return (they see it within one spin)."""
    store_seq_cst(ctl, STOP, 1)


# --------------------------------------------------------------------------- C entries
# The functions above as C functions of integers (an array as its address and length),
# for the backend to call through ctypes: mapped by vt from their saved object code
# (vt_cpu.native) or compiled by numba once, so a process that only runs them never
# builds numba's target. ``entries()`` gives them as ctypes functions.

_I = types.int64
_CKW = {"cache": True, "boundscheck": False}


def _ctl(ptr, n):  # noqa: ANN001, ANN202 - numba only
    return carray(ptr_i64(ptr), n)


_ctl = njit(**_KW, inline="always")(_ctl)


def _c_helper_loop(ctl, n, me, last, spin):  # noqa: ANN001, ANN202
    return helper_loop(_ctl(ctl, n), me, last, spin)


def _c_post(ctl, n, fn, args, total, chunk, helpers):  # noqa: ANN001, ANN202
    return post(_ctl(ctl, n), fn, args, total, chunk, helpers)


def _c_finish(ctl, n):  # noqa: ANN001, ANN202
    finish(_ctl(ctl, n))
    return 0


def _c_run_alone(fn, args, total):  # noqa: ANN001, ANN202
    run_alone(fn, args, total)
    return 0


def _c_run_program(ctl, n, prog, steps, helpers, shared):  # noqa: ANN001, ANN202
    return run_program(_ctl(ctl, n), carray(ptr_i64(prog), steps * STEP), helpers, shared != 0)


def _c_spin_seconds_probe(ctl, n, pauses):  # noqa: ANN001, ANN202
    return spin_seconds_probe(_ctl(ctl, n), pauses)


def _c_park_now(ctl, n):  # noqa: ANN001, ANN202
    park_now(_ctl(ctl, n))
    return 0


def _c_stop(ctl, n):  # noqa: ANN001, ANN202
    stop(_ctl(ctl, n))
    return 0


#: name: (Python function, number of int64 arguments); each returns an int64.
C_ENTRIES = {
    "helper_loop": (_c_helper_loop, 5),
    "post": (_c_post, 7),
    "finish": (_c_finish, 2),
    "run_alone": (_c_run_alone, 3),
    "run_program": (_c_run_program, 6),
    "spin_seconds_probe": (_c_spin_seconds_probe, 3),
    "park_now": (_c_park_now, 2),
    "stop": (_c_stop, 2),
}


class Entries:
    """The C entries as ctypes functions (they release the GIL while they run)."""

    def __init__(self) -> None:
        import ctypes

        from .. import native

        for name, (fn, nargs) in C_ENTRIES.items():

            def compile_it(fn: object = fn, nargs: int = nargs) -> object:
                from numba import cfunc

                from . import init_numba_runtime

                init_numba_runtime()  # (compiled anew where vt saves it: see jobs.py)
                kw = {**_CKW, "cache": not native.supported()}
                return cfunc(_I(*([_I] * nargs)), **kw)(fn)

            addr = native.address(f"team.{name}", compile_it)
            proto = ctypes.CFUNCTYPE(ctypes.c_int64, *([ctypes.c_int64] * nargs))
            setattr(self, name, proto(addr))


_entries: Entries | None = None


def entries() -> Entries:
    """The team's C entries, mapped or compiled once per process."""
    global _entries
    if _entries is None:
        _entries = Entries()
    return _entries
