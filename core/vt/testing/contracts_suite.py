"""Capability contracts: what a declared capability promises, proven on the backend.

A contract runs whenever its capability is declared (effective capabilities, so VT_CAPS
overrides count) and is never skipped then: a probe that cannot run fails. An undeclared
capability's contract raises :class:`NotDeclared`, reported as "not declared", never as a
pass. Contracts without a capability (memory, host_view, sync readback, staging reuse)
hold for every backend.

There is one implementation of each check: most contracts judge an audit probe's checks
(:mod:`vt.management.probes`, run once per backend); the stricter ones (pinned memory,
async readback,
staging reuse, graph replay) add their checks on top, with the probes' helpers
(:mod:`vt.management.probes.base`) and, for async readback, the audit's own copy
(:func:`vt.management.probes.copy_behind_work`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from ..management import probes
from ..management.probes import Check
from ..management.probes.base import (
    POISON,
    WORK_BYTES,
    WORK_ROUNDS,
    busy,
    device_buffer,
    first_index,
    new_stream,
    pattern,
    pinned_buffer,
    read,
)
from ..protocol.backend import Backend, Buffer, HostBuffer, Tensor
from .kit import KitCase, KitContext, KitFailure, NotDeclared

STAGING_ROUNDS = 4


def _declared(backend: Backend, capability: str) -> bool:
    value = getattr(backend.capabilities, capability)
    return value is not None and value is not False


def _data(n: int, seed: int) -> np.ndarray:
    """Random bytes below the poison value, so no byte of data looks poisoned."""
    return pattern(n, seed, below=POISON)


# --------------------------------------------------------------------------- from the audit


def _from_probe(
    ctx: KitContext, contract: str, probe: Callable[[Backend], list[Check]], ids: tuple[str, ...]
) -> str:
    """Run an audit probe (once per backend) and judge the checks named ``ids``."""
    checks = ctx.probe(probe.__name__, partial(probe, ctx.backend))
    picked = [c for c in checks if not ids or c.id in ids]
    if not picked:
        raise KitFailure(f"contract {contract}: the probe reported none of the checks {ids}")
    for c in picked:
        if c.result == "fail":
            raise KitFailure(f"contract {contract} failed: {c.id}: {c.detail}")
        if c.result == "skip":
            raise KitFailure(
                f"contract {contract}: the capability is declared but check {c.id} did not "
                f"run ({c.detail}); a declared capability is never skipped"
            )
    ctx.count(len(picked))
    return "; ".join(f"{c.id}: {c.detail}" for c in picked)


def _host_view(ctx: KitContext) -> str:
    which = (
        "host-view-roundtrip"
        if ctx.backend.capabilities.device_memory_is_host_addressable
        else "host-view-refused"
    )
    return _from_probe(ctx, "host-view", probes.probe_host_view, (which,))


# --------------------------------------------------------------------------- pinned memory


def _pinned_memory(ctx: KitContext) -> str:
    """The audit's pinned probe, plus: pinned memory is not (and does not alias) device
    memory, whichever of the two is allocated first."""
    detail = _from_probe(ctx, "pinned-host-memory", probes.probe_pinned, ("pinned-host-memory",))
    b, n = ctx.backend, 64 << 10
    c = "contract pinned-host-memory failed"
    with device_buffer(b, n) as before, pinned_buffer(b, n) as pinned, device_buffer(b, n) as after:
        pinned.array[:] = POISON
        for name, dev, seed in (("earlier", before, 1), ("later", after, 2)):
            data = _data(n, seed)
            b.copy_h2d(dev, data)
            if (pinned.array != POISON).any():
                raise KitFailure(
                    f"{c}: writing the device allocation made {name} changed the pinned buffer "
                    f"(first changed byte {first_index(pinned.array != POISON)}): alloc_pinned "
                    "returned memory that is (or aliases) a device allocation"
                )
            pinned.array[:] = _data(n, seed + 10)
            got = read(b, dev)
            if not np.array_equal(got, data):
                raise KitFailure(
                    f"{c}: writing the pinned buffer changed the device allocation made {name} "
                    f"(first changed byte {first_index(got != data)}): alloc_pinned returned "
                    "memory that is (or aliases) a device allocation"
                )
            if b.capabilities.device_memory_is_host_addressable and np.shares_memory(
                pinned.array, b.host_view(dev)
            ):
                raise KitFailure(f"{c}: the pinned buffer shares memory with a device allocation")
            pinned.array[:] = POISON
            ctx.count(2)
    return detail + "; distinct from device allocations made before and after it"


# --------------------------------------------------------------------------- async readback


def _async_round(
    ctx: KitContext, src: Buffer, dst: HostBuffer, want: np.ndarray, rounds: int
) -> bool:
    """The audit's copy behind ``rounds`` of work, the ids written on the stream just before
    it, and stricter judging; True when the poison was seen before ready."""
    b = ctx.backend
    c = "contract async-d2h-readback failed"
    array = dst.array
    stale = _data(src.nbytes, rounds)
    b.copy_h2d(src, stale)
    early, after, fence = probes.copy_behind_work(b, src, dst, rounds, produce=want)
    if dst.array is not array:
        raise KitFailure(
            f"{c}: copy_d2h_async replaced HostBuffer.array with other memory; the pinned "
            "buffer must stay the caller's (this makes it the device allocation)"
        )
    if not np.array_equal(after, want):
        bad = after != want
        hint = (
            "still poisoned: the copy had not run when the event said it had"
            if (after[bad] == POISON).all()
            else "wrong bytes"
        )
        raise KitFailure(
            f"{c}: after {fence} the pinned buffer is wrong ({hint}; first wrong byte "
            f"{first_index(bad)})"
        )
    odd = (early != POISON) & (early != want)
    if odd.any():
        i = first_index(odd)
        what = "the device buffer's earlier contents" if early[i] == stale[i] else "garbage"
        raise KitFailure(
            f"{c}: before {fence} the pinned buffer held bytes that are neither the poison "
            f"nor the copied data (byte {i} is {int(early[i]):#04x}, {what}): the pinned "
            "buffer is (or aliases) the device allocation"
        )
    b.memset(src, 0)
    if not np.array_equal(dst.array, want):
        raise KitFailure(
            f"{c}: overwriting the device buffer after the copy finished changed the pinned "
            f"buffer (first changed byte {first_index(dst.array != want)}): it is (or aliases) "
            "the device allocation"
        )
    ctx.count(4)
    return bool((early == POISON).all())


def _async_d2h(ctx: KitContext) -> str:
    """A poisoned pinned buffer is wrong before the ready event and right after, and stays
    right when the device memory changes later."""
    b, n, off = ctx.backend, 64 << 10, 1024
    want = _data(n, 7)
    with device_buffer(b, off + n) as whole, pinned_buffer(b, n) as dst:
        src = whole.view(off, n)  # copies must honour the source offset
        for rounds in WORK_ROUNDS:
            if _async_round(ctx, src, dst, want, rounds):
                return (
                    f"poisoned before the ready event behind {rounds} memsets of "
                    f"{WORK_BYTES >> 20} MiB, correct after it, unchanged by later device writes"
                )
    return (
        "correct after the ready event and unchanged by later device writes; the copy always "
        "finished before it could be seen pending"
    )


# --------------------------------------------------------------------------- staging reuse


def _staging_reuse(ctx: KitContext) -> str:
    """The runner's input staging: a ring of pinned buffers, each reused once the event
    recorded after its async host-to-device copy completes. No copy may read its staging
    after that event, or the device gets a later step's (torn) inputs."""
    b, caps = ctx.backend, ctx.backend.capabilities
    n, ring, steps = 16 << 10, 2, 6
    fence = "its event" if caps.events else "synchronize"
    with (
        pinned_buffer(b, n) as s0,
        pinned_buffer(b, n) as s1,
        device_buffer(b, steps * n) as dst,
        device_buffer(b, WORK_BYTES) as work,
        new_stream(b, "vt-kit-staging") as s,
    ):
        staging = [s0, s1]
        events = [b.create_event() for _ in range(ring)] if caps.events else []
        try:
            for step in range(steps):
                k = step % ring
                if step >= ring:  # reuse: wait for the copy that last read this staging
                    if events:
                        b.synchronize_event(events[k])
                    else:
                        b.synchronize(s)
                staging[k].array[:] = _data(n, 100 + step)
                busy(b, work, s, STAGING_ROUNDS)
                b.copy_h2d_async(dst.view(step * n, n), staging[k], s)
                if events:
                    b.record_event(events[k], s)
            b.synchronize(s)
        finally:
            for e in events:
                b.destroy_event(e)
        got = read(b, dst).reshape(steps, n)
    for step in range(steps):
        want = _data(n, 100 + step)
        if not np.array_equal(got[step], want):
            later = [
                q for q in range(step + 1, steps) if np.array_equal(got[step], _data(n, 100 + q))
            ]
            what = (
                f"the bytes staged for step {later[0]}, written after {fence} said step "
                f"{step}'s copy was done"
                if later
                else f"torn bytes (first wrong byte {first_index(got[step] != want)})"
            )
            raise KitFailure(
                f"contract staging-reuse failed: step {step}'s device input holds {what}: the "
                "async host-to-device copy read its pinned staging after the host was allowed "
                "to reuse it"
            )
    ctx.count(steps)
    return f"{steps} steps through a ring of {ring} pinned staging buffers, reused after {fence}"


# --------------------------------------------------------------------------- graphs


def _graph_replay(ctx: KitContext) -> str:
    """The audit's graph probe, plus a captured kernel: ``x += y`` twice per replay, so
    each replay must start from what the previous one left (a rerun, not a recording)."""
    detail = _from_probe(ctx, "graph-replay", probes.probe_graphs, ("graph-replay",))
    b = ctx.backend
    if not b.supports("add"):
        return detail + " (no add op to capture)"
    c = "contract graph-replay failed"
    n = 1024
    # x has slack past its n floats: this contract proves replays, not add's bounds (the
    # kernel cases catch an add that writes past its output)
    with (
        device_buffer(b, 4 * n + 256) as x,
        device_buffer(b, 4 * n) as y,
        new_stream(b, "vt-kit-graph") as s,
    ):
        b.copy_h2d(x, np.ones(n, np.float32))
        b.copy_h2d(y, np.full(n, 0.5, np.float32))
        xt, yt = Tensor(x, np.dtype(np.float32), (1, n)), Tensor(y, np.dtype(np.float32), (1, n))
        b.begin_capture(s)
        try:
            b.launch("add", s, out=xt, a=xt, b=yt)
            b.launch("add", s, out=xt, a=xt, b=yt)
        finally:
            graph = b.end_capture(s)
        try:
            expect = 1.0
            for step in (0.5, 0.5, 2.0):
                b.copy_h2d(y, np.full(n, step, np.float32))
                b.launch_graph(graph, s)
                b.synchronize(s)
                expect += 2 * step
                got = np.empty(n, np.float32)
                b.copy_d2h(got, x.view(0, 4 * n))
                if not (got == expect).all():
                    raise KitFailure(
                        f"{c}: after a replay of two captured add(x, x, y) x holds "
                        f"{float(got[0])}, expected {expect}: the replay did not rerun the "
                        "kernels on the buffers' current contents"
                    )
                ctx.count()
        finally:
            b.destroy_graph(graph)
    return detail + "; captured add kernels rerun on current contents (3 replays)"


# --------------------------------------------------------------------------- the cases

#: ``(id, capability or None, run)`` in run order.
CONTRACTS: tuple[tuple[str, str | None, Callable[[KitContext], str]], ...] = (
    (
        "memory-roundtrip",
        None,
        lambda ctx: _from_probe(ctx, "memory-roundtrip", probes.probe_memory, ()),
    ),
    ("host-view", None, _host_view),
    ("pinned-host-memory", "pinned_host_memory", _pinned_memory),
    (
        "event-ordering",
        "events",
        lambda ctx: _from_probe(ctx, "event-ordering", probes.probe_events, ("event-ordering",)),
    ),
    (
        "stream-wait-event",
        "events",
        lambda ctx: _from_probe(
            ctx, "stream-wait-event", probes.probe_events, ("stream-wait-event",)
        ),
    ),
    ("async-d2h-readback", "async_d2h_copy", _async_d2h),
    (
        "async-readback",
        "supports_async_sampled_token_readback",
        lambda ctx: _from_probe(ctx, "async-readback", probes.probe_readback, ("async-readback",)),
    ),
    (
        "sync-readback",
        None,
        lambda ctx: _from_probe(ctx, "sync-readback", probes.probe_readback, ("sync-readback",)),
    ),
    ("staging-reuse", None, _staging_reuse),
    ("vmm-arena", "vmm", lambda ctx: _from_probe(ctx, "vmm-arena", probes.probe_vmm, ())),
    ("graph-replay", "graphs", _graph_replay),
)


def _contract(
    cid: str, capability: str | None, run: Callable[[KitContext], str], ctx: KitContext
) -> str:
    if capability is not None and not _declared(ctx.backend, capability):
        raise NotDeclared(f"not declared: {capability} (contract {cid} proves it when declared)")
    return run(ctx)


def contract_cases() -> list[KitCase]:
    return [
        KitCase("contract", cid, "", "", partial(_contract, cid, cap, run), capability=cap)
        for cid, cap, run in CONTRACTS
    ]
