"""Readback by capability: the contract from the original bug.

The runner reads sampled ids through ``host_view`` only when device memory is
host-addressable; otherwise through an async copy on a second stream fenced by events, or a
plain synchronous copy. These tests record the protocol calls the runner makes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import vt
from model_support import PROMPT, cpu_with_readback, greedy, make_backend
from vt.execution.readback import ReadbackPath, async_scheduling_enabled, choose_readback
from vt.execution.runner import ModelRunner, SeqChunk

ASYNC_CAPS = vt.Capabilities(
    unified_memory=False,
    device_memory_is_host_addressable=False,
    supports_async_sampled_token_readback=True,
    async_d2h_copy=True,
    events=True,
    pinned_host_memory=True,
)


class Spy:
    """Records the protocol calls made on a backend instance (and passes them through).

    Ops arrive through ``launch(op, stream, **args)``; a launch of one of ``OPS`` is
    recorded under the op's name, with ``(stream, args)``.
    """

    WATCH = (
        "alloc",
        "alloc_pinned",
        "create_event",
        "create_stream",
        "host_view",
        "copy_d2h",
        "copy_d2h_async",
        "copy_h2d_async",
        "copy_d2d",
        "record_event",
        "stream_wait_event",
        "synchronize",
        "synchronize_event",
    )
    OPS = ("sample",)

    def __init__(self, backend: vt.Backend) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        for name in self.WATCH:
            setattr(backend, name, self._wrap(name, getattr(backend, name)))
        launch = backend.launch

        def launch_op(op: str, stream: vt.Stream, **args: Any) -> None:
            if op in self.OPS:
                self.calls.append((op, (stream, args)))
            launch(op, stream, **args)

        backend.launch = launch_op  # type: ignore[method-assign]

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            return fn(*args, **kwargs)

        return call

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    def take(self) -> list[tuple[str, tuple[Any, ...]]]:
        calls, self.calls = self.calls, []
        return calls


# --------------------------------------------------------------------------- choosing


@pytest.mark.parametrize(
    ("caps", "enabled", "path"),
    [
        (vt.Capabilities(device_memory_is_host_addressable=True), True, "host_view"),
        (
            ASYNC_CAPS.model_copy(update={"device_memory_is_host_addressable": True}),
            True,
            "host_view",
        ),
        (ASYNC_CAPS, True, "async_d2h"),
        (ASYNC_CAPS, False, "sync"),
        (vt.Capabilities(device_memory_is_host_addressable=True), False, "sync"),
        (vt.Capabilities(), True, "sync"),
        # the original bug's declaration: async readback claimed, no way to read the ids
        (vt.Capabilities(supports_async_sampled_token_readback=True), True, "sync"),
        (ASYNC_CAPS.model_copy(update={"async_d2h_copy": False}), True, "sync"),
        (ASYNC_CAPS.model_copy(update={"events": False}), True, "sync"),
    ],
)
def test_readback_path_follows_capabilities(
    caps: vt.Capabilities, enabled: bool, path: str
) -> None:
    chosen, reason = choose_readback(caps, enabled)
    assert chosen is ReadbackPath(path) and reason


def test_unusable_async_claim_names_what_is_missing() -> None:
    _, reason = choose_readback(vt.Capabilities(supports_async_sampled_token_readback=True), True)
    assert "events" in reason and "pinned_host_memory" in reason and "async_d2h_copy" in reason


def test_vt_async_runner_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VT_ASYNC_RUNNER", raising=False)
    assert async_scheduling_enabled()[0] is True
    for value, on in (("0", False), ("false", False), ("OFF", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("VT_ASYNC_RUNNER", value)
        assert async_scheduling_enabled()[0] is on
    monkeypatch.setenv("VT_ASYNC_RUNNER", "0")
    assert async_scheduling_enabled(True)[0] is True  # the explicit argument wins
    monkeypatch.setenv("VT_ASYNC_RUNNER", "maybe")
    with pytest.raises(ValueError, match="VT_ASYNC_RUNNER='maybe' is not a boolean"):
        async_scheduling_enabled()


@pytest.mark.parametrize("path", ["host_view", "async_d2h", "sync"])
def test_runner_picks_the_path_of_effective_capabilities(llama: Any, path: str) -> None:
    with ModelRunner(cpu_with_readback(path), llama, max_slots=1, max_model_len=16) as r:
        assert r.readback == path
        assert r.readback_reason


def test_cpu_default_is_host_view_and_env_turns_async_off(
    llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ModelRunner(make_backend("cpu"), llama, max_slots=1, max_model_len=16) as r:
        assert r.readback == "host_view"
    monkeypatch.setenv("VT_ASYNC_RUNNER", "0")
    with ModelRunner(make_backend("cpu"), llama, max_slots=1, max_model_len=16) as r:
        assert r.readback == "sync"
        assert "VT_ASYNC_RUNNER=0" in r.readback_reason


# --------------------------------------------------------------------------- protocol


def _one_step(r: ModelRunner) -> dict[int, int]:
    return r.execute([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)]).get_output()


def test_tt_stub_sync_path_never_touches_host_view(llama: Any) -> None:
    backend = make_backend("tt_stub")
    assert not backend.capabilities.device_memory_is_host_addressable
    spy = Spy(backend)
    with ModelRunner(backend, llama, max_slots=2, max_model_len=32) as r:
        assert r.readback == "sync"
        out = r.execute([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)])
        ids = out.get_output()
        r.execute([SeqChunk(slot=0, start_pos=9, token_ids=None, from_previous=True)]).get_output()
        r.compute_logits([SeqChunk(slot=1, start_pos=0, token_ids=PROMPT)])
    assert set(ids) == {0}
    assert "host_view" not in spy.names()
    assert "copy_d2h" in spy.names()
    # and had it tried, the stub would have refused
    buf = backend.alloc(16)
    with pytest.raises(vt.HostAccessError):
        backend.host_view(buf)
    backend.free(buf)


def test_a_backend_that_lies_about_host_access_fails_loudly(llama: Any) -> None:
    """The original bug's shape: claims host-addressable memory it does not have. The
    runner asks host_view, which refuses: an error, never garbage ids."""
    backend = make_backend("tt_stub")
    backend.capabilities = backend.capabilities.with_value(
        "device_memory_is_host_addressable", True, vt.Source.env, "test: a lie"
    )
    with ModelRunner(backend, llama, max_slots=1, max_model_len=16) as r:
        assert r.readback == "host_view"
        out = r.execute([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)])
        with pytest.raises(vt.HostAccessError):
            out.get_output()
        with pytest.raises(vt.HostAccessError):  # still the same error, not a crash
            out.get_output()


def test_async_d2h_copies_on_a_second_stream_and_waits_only_on_ready(llama: Any) -> None:
    backend = cpu_with_readback("async_d2h")
    spy = Spy(backend)
    with ModelRunner(backend, llama, max_slots=1, max_model_len=16) as r:
        main = r.stream
        spy.take()
        out = r.execute([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)])
        step = spy.take()
        ids = out.get_output()
        read = spy.take()
    names = [n for n, _ in step]
    assert "host_view" not in names + [n for n, _ in read]
    # the step: sample on main, fork event on main, copy stream waits on it, copies, records
    i = names.index("sample")
    assert names[i + 1 :] == ["record_event", "stream_wait_event", "copy_d2h_async", "record_event"]
    fork_rec, wait, copy, ready_rec = step[i + 1 :]
    assert fork_rec[1][1] is main
    copy_stream = wait[1][0]
    assert copy_stream is not main and wait[1][1] is fork_rec[1][0]
    assert copy[1][2] is copy_stream and copy[1][0].pinned
    assert ready_rec[1][1] is copy_stream
    slot = ready_rec[1][0]
    # get_output: synchronize the ready event only, then read pinned memory
    assert read == [("synchronize_event", (slot,))]
    assert set(ids) == {0}


def test_host_view_path_waits_on_ready_then_views(llama: Any) -> None:
    backend = make_backend("cpu")
    spy = Spy(backend)
    with ModelRunner(backend, llama, max_slots=1, max_model_len=16) as r:
        spy.take()
        out = r.execute([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)])
        step = spy.take()
        out.get_output()
        read = spy.take()
    names = [n for n, _ in step]
    assert names[names.index("sample") + 1 :] == ["record_event"]
    ready = step[-1][1][0]
    assert [n for n, _ in read] == ["synchronize_event", "host_view"]
    assert read[0][1][0] is ready


def test_sync_path_synchronizes_the_main_stream_then_copies(llama: Any) -> None:
    backend = cpu_with_readback("sync")
    spy = Spy(backend)
    with ModelRunner(backend, llama, max_slots=1, max_model_len=16) as r:
        out = r.execute([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)])
        spy.take()
        out.get_output()
        read = spy.take()
        main = r.stream
    assert [n for n, _ in read] == ["synchronize", "copy_d2h"]
    assert read[0][1][0] is main


@pytest.mark.parametrize("path", ["host_view", "async_d2h", "sync"])
def test_steps_allocate_nothing(llama: Any, path: str) -> None:
    backend = cpu_with_readback(path)
    spy = Spy(backend)
    with ModelRunner(backend, llama, max_slots=2, max_model_len=64, kv_cache="contiguous") as r:
        spy.take()
        prefill = [SeqChunk(0, 0, PROMPT), SeqChunk(1, 0, PROMPT[:4])]
        r.execute(prefill).get_output()
        for j in range(8):
            r.execute(
                [
                    SeqChunk(slot=0, start_pos=9 + j, token_ids=None, from_previous=True),
                    SeqChunk(slot=1, start_pos=4 + j, token_ids=None, from_previous=True),
                ]
            ).get_output()
        calls = spy.names()
    for name in ("alloc", "alloc_pinned", "create_event", "create_stream"):
        assert name not in calls, f"a step called {name}"
    # one host-to-device copy per step; decode inputs come device-side in one copy, and
    # with graphs (cpu declares them) the ids sampled into the graph's fixed buffer are
    # copied into the step's output slot
    assert r.graphs
    assert calls.count("copy_h2d_async") == 9
    assert calls.count("copy_d2d") == 8 * 2


def test_reused_output_slot_is_read_before_its_staging_is_rewritten(llama: Any) -> None:
    """With 2 output slots and 3 steps in flight, the third step first waits for the first
    step's ready event (reading its ids), then reuses its pinned staging."""
    backend = cpu_with_readback("async_d2h")
    spy = Spy(backend)
    with ModelRunner(backend, llama, max_slots=1, max_model_len=32, n_output_slots=2) as r:
        outs = [r.execute([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)])]
        first_ready = [a for n, a in spy.calls if n == "record_event"][-1][0]
        outs.append(r.execute([SeqChunk(0, 9, None, from_previous=True)]))
        spy.take()
        outs.append(r.execute([SeqChunk(0, 10, None, from_previous=True)]))
        third = spy.take()
        ids = [o.get_output()[0] for o in outs]
    names = [n for n, _ in third]
    assert names[0] == "synchronize_event" and third[0][1][0] is first_ready
    assert names.index("synchronize_event") < names.index("copy_h2d_async")
    with ModelRunner(make_backend("cpu"), llama, max_slots=1, max_model_len=32) as r:
        assert greedy(r, {0: PROMPT}, 3)[0] == ids
