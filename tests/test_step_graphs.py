"""Steps replayed as graphs: the same ids as eager steps, a bounded cache, KV growth.

The cpu backend declares ``graphs`` (a capture records its streams' closures, a launch
enqueues them again), so these tests run the runner's real graph path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import vt
from model_support import PROMPT, make_backend
from vt.execution.runner import ModelRunner, SeqChunk
from vt.execution.step_graphs import (
    bucket,
    context_bound,
    context_classes,
    graphs_enabled,
    padding,
    prefill_graphs_enabled,
    token_bucket,
)
from vt.management.registry import Registry

KV_SLOTS = 64  # a position is 32 KiB: the vmm cache's first 2 MiB chunk holds 64 positions


def _next(pos: dict[int, int], slots: list[int], counter: int) -> list[SeqChunk]:
    """One decode step; slot 1 samples with temperature (its parameters change per step)."""
    return [
        SeqChunk(slot=s, start_pos=pos[s], token_ids=None, from_previous=True)
        if s != 1
        else SeqChunk(
            slot=1,
            start_pos=pos[1],
            token_ids=None,
            from_previous=True,
            temperature=0.9,
            top_k=5,
            seed=11,
            counter=counter,
        )
        for s in slots
    ]


def scripted(r: ModelRunner) -> list[dict[int, int]]:
    """Batches that grow, shrink, mix in a prefill and reorder; every step's ids."""
    prompts = {0: PROMPT, 1: PROMPT[::-1], 2: PROMPT[2:], 3: [7, 8, 9]}
    outs = [r.execute([SeqChunk(s, 0, p) for s, p in prompts.items()]).get_output()]
    pos = {s: len(p) for s, p in prompts.items()}
    counter = 0

    def decode(slots: list[int], n: int) -> None:
        nonlocal counter
        for _ in range(n):
            counter += 1
            outs.append(r.execute(_next(pos, slots, counter)).get_output())
            for s in slots:
                pos[s] += 1

    decode([0, 1, 2, 3], 5)
    decode([0, 1, 3], 4)  # slot 2 stopped: the previous step's indices have a gap
    r.free_slot(2)
    mixed = _next(pos, [0, 1, 3], 99) + [SeqChunk(slot=2, start_pos=0, token_ids=[4, 5, 6])]
    outs.append(r.execute(mixed).get_output())  # a prefill in the step: eager
    for s in (0, 1, 3):
        pos[s] += 1
    pos[2] = 3
    decode([0, 1, 2, 3], 4)
    decode([3, 1], 3)  # given out of order; rows follow the previous step's samples
    return outs


def test_graph_replay_gives_the_same_ids_as_eager_steps(llama: Any) -> None:
    with ModelRunner(make_backend("cpu"), llama, max_slots=4, graphs=False) as r:
        assert not r.graphs and r.graphs_reason == "graphs=False"
        want = scripted(r)
        assert r.graph_stats["captures"] == r.graph_stats["replays"] == 0
    with ModelRunner(make_backend("cpu"), llama, max_slots=4) as r:
        assert r.graphs
        assert r.graphs_reason == "decode steps are captured once per shape and replayed (default)"
        got = scripted(r)
        stats = r.graph_stats
    assert got == want
    # decode batches of 4 x5, 3 x4 (padded to 4), 4 x4, 2 x3: each bucket eager once,
    # captured the second time, replayed from then on
    assert stats["captures"] == 2 and stats["cached"] == 2
    assert stats["replays"] == (5 + 4 + 4 - 1) + (3 - 1)
    assert stats["evictions"] == stats["invalidations"] == 0


def test_decode_steps_with_host_ids_replay_too(llama: Any) -> None:
    """Without async scheduling every decode step takes its token from the host: still a
    decode step (one sampled token per sequence), padded and replayed like the others."""

    def run(graphs: bool) -> tuple[list[dict[int, int]], dict[str, int]]:
        with ModelRunner(make_backend("cpu"), llama, max_slots=4, graphs=graphs) as r:
            prompts = {0: PROMPT, 1: PROMPT[::-1], 2: PROMPT[2:]}
            outs = [r.execute([SeqChunk(s, 0, p) for s, p in prompts.items()]).get_output()]
            pos = {s: len(p) for s, p in prompts.items()}
            for _ in range(6):
                last = outs[-1]
                step = [SeqChunk(s, pos[s], [last[s]]) for s in sorted(last)]
                outs.append(r.execute(step).get_output())
                pos = {s: p + 1 for s, p in pos.items()}
            return outs, r.graph_stats

    want, _ = run(False)
    got, stats = run(True)
    assert got == want
    assert stats["captures"] == 1 and stats["replays"] == 5  # 3 rows padded to 4


def test_buckets_and_padding_rows() -> None:
    assert [bucket(n, 32) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert bucket(5, 6) == 6 and bucket(6, 6) == 6 and bucket(7, 6) == 7
    assert padding([(3, 10), (0, 4)], max_len=64) == (3, 11)
    assert padding([(3, 63), (0, 4)], max_len=64) == (0, 5)  # slot 3 has no position left
    assert padding([(3, 63)], max_len=64) is None


def test_context_bounds_and_the_classes_hint() -> None:
    """A step's bound: the smallest class it ends within, at most the cache's max_len; past
    every class 0 (plain attention). A hint that is not ascending positive integers is
    refused, naming the backend."""
    assert context_bound((), 5, 64) == 0
    assert [context_bound((16, 48), end, 64) for end in (1, 16, 17, 48, 49)] == [16, 16, 48, 48, 0]
    assert context_bound((256,), 100, 200) == 200  # every position of the cache fits
    backend = make_backend("tt_stub")
    assert context_classes(backend) == ()
    for bad in ((16, 16), (32, 16), (0,), (-4,), (True,), (16.0,), "16", 16):
        backend.context_classes = bad  # type: ignore[assignment]
        with pytest.raises(ValueError, match=r"backend 'tt_stub': context_classes must be"):
            context_classes(backend)
    backend.context_classes = [8, 24]  # type: ignore[assignment]
    assert context_classes(backend) == (8, 24)


def _bounded(backend: vt.Backend, classes: tuple[int, ...]) -> list[int]:
    """Declare ``classes`` on ``backend``; the list its attention launches' bounds go to
    (0 for plain attention)."""
    backend.context_classes = classes  # type: ignore[misc]
    bounds: list[int] = []
    launch = backend.launch

    def spy(op: str, stream: Any, **args: Any) -> None:
        if op in ("attention", "attention_bounded"):
            bounds.append(args.get("context", 0))
        launch(op, stream, **args)

    backend.launch = spy  # type: ignore[method-assign]
    return bounds


def test_context_classes_key_the_graphs_and_bound_attention(llama: Any) -> None:
    """With classes (12, 16), each step launches attention_bounded with the class its rows
    end within (the padding rows' position too) and plain attention past them; graphs are
    keyed by the class, so a batch size is captured again in each class it reaches; the
    ids are those of eager steps without classes."""
    with ModelRunner(make_backend("cpu"), llama, max_slots=4, graphs=False) as r:
        want = scripted(r)
    backend = make_backend("cpu")
    bounds = _bounded(backend, (12, 16))
    with ModelRunner(backend, llama, max_slots=4) as r:
        assert r.context_classes == (12, 16)
        got = scripted(r)
        stats = r.graph_stats
    assert got == want
    # the steps that launch ops (eager or captured; a replay launches none), a layer's
    # bound each: the prefill ends at 9, decode steps at 10-12 (class 12), 13-16 (16),
    # then past every class
    per_step = bounds[:: llama.config.n_layers]
    assert per_step == [12, 12, 12, 16, 16, 0, 0, 0, 0, 0]
    # scripted's 2 captures without classes become 4: 4 rows in classes 12, 16 and none,
    # 2 rows (the last steps) in none
    assert stats["captures"] == stats["cached"] == 4 and stats["evictions"] == 0


def test_a_bad_context_classes_hint_is_refused_before_anything_is_allocated(llama: Any) -> None:
    backend = make_backend("cpu")
    backend.context_classes = (64, 32)  # type: ignore[misc]
    allocs: list[int] = []
    alloc = backend.alloc
    backend.alloc = lambda n: allocs.append(n) or alloc(n)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"backend 'cpu': context_classes .* got \(64, 32\)"):
        ModelRunner(backend, llama, max_slots=2)
    assert allocs == []


def test_prefill_and_mixed_steps_run_eagerly(llama: Any) -> None:
    """Without the prefill_graphs hint (the cpu backend has none)."""
    backend = make_backend("cpu")
    with ModelRunner(backend, llama, max_slots=2) as r:
        assert not r.prefill_graphs
        assert r.prefill_graphs_reason == (
            "prefill and mixed steps run eagerly (the cpu backend's prefill_graphs hint)"
        )
        for _ in range(3):  # the same prefill shape three times: never captured
            r.free_slot(0)
            r.execute([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)]).get_output()
        assert r.graph_stats["captures"] == 0
        r.execute([SeqChunk(slot=0, start_pos=9, token_ids=None, from_previous=True)])
        r.execute(
            [
                SeqChunk(slot=0, start_pos=10, token_ids=None, from_previous=True),
                SeqChunk(slot=1, start_pos=0, token_ids=[1, 2]),
            ]
        ).get_output()
        assert r.graph_stats == {
            "cached": 0, "captures": 0, "replays": 0, "evictions": 0, "invalidations": 0,
        }  # fmt: skip


def test_token_buckets() -> None:
    got = [token_bucket(n, 512) for n in (1, 3, 9, 16, 17, 19, 33, 100, 257, 300, 500, 512)]
    assert got == [1, 4, 16, 16, 18, 20, 36, 104, 288, 320, 512, 512]
    assert token_bucket(300, 310) == 310 and token_bucket(300, 300) == 300
    for n in range(1, 1025):  # at most an eighth of a bucket's rows are padding
        b = token_bucket(n, 4096)
        assert n <= b and (n <= 16 or (b - n) * 8 <= b)


def prefill_script(r: ModelRunner) -> list[dict[int, int]]:
    """Prompts of lengths that share buckets, chunked prompts, mixed steps, and a prompt
    that ends at the last position (its step pads in another sequence's slot)."""
    outs: list[dict[int, int]] = []
    long = (PROMPT * 4)[:30]
    for length in (17, 18, 17):  # one bucket (18): eager, captured, replayed
        r.free_slot(0)
        outs.append(r.execute([SeqChunk(0, 0, long[:length])]).get_output())
    r.free_slot(0)
    r.execute([SeqChunk(0, 0, long[:20], sample=False)])  # a non-final chunk: no sample
    outs.append(r.execute([SeqChunk(0, 20, long[20:])]).get_output())
    pos = 30
    for j in range(3):  # slot 0 decodes beside a prompt in slot 1 (mixed steps)
        r.free_slot(1)
        step = [
            SeqChunk(0, pos, None, from_previous=True, temperature=0.8, seed=3, counter=j),
            SeqChunk(1, 0, PROMPT[: 6 + j]),
        ]
        outs.append(r.execute(step).get_output())
        pos += 1
    # slot 2's prompt fills max_model_len (40): the padding goes to slot 1's next position
    r.free_slot(1)
    full = [SeqChunk(1, 0, PROMPT[:5]), SeqChunk(2, 0, (PROMPT * 5)[:40])]
    outs.append(r.execute(full).get_output())
    outs.append(r.execute([SeqChunk(1, 5, None, from_previous=True)]).get_output())
    outs.append(r.execute([SeqChunk(1, 6, None, from_previous=True)]).get_output())
    return outs


def test_prefill_and_mixed_steps_replay_with_prefill_graphs(llama: Any) -> None:
    """Padded prefill and mixed steps replayed: the same ids as eager steps, the padding rows
    (past a chunk's end, or in another slot) never seen by a real row."""
    with ModelRunner(make_backend("cpu"), llama, max_slots=3, max_model_len=40,
                     graphs=False) as r:  # fmt: skip
        want = prefill_script(r)
    with ModelRunner(make_backend("cpu"), llama, max_slots=3, max_model_len=40,
                     prefill_graphs=True) as r:  # fmt: skip
        assert r.prefill_graphs
        assert r.prefill_graphs_reason == (
            "prefill and mixed steps are padded to a token bucket and replayed "
            "(prefill_graphs=True)"
        )
        got = prefill_script(r)
        stats = r.graph_stats
        # the last prefill's plan: 45 rows -> 48, padding in slot 1 (slot 2 has no room)
        r.free_slot(1)
        r.free_slot(2)
        plan = r._plan([SeqChunk(1, 0, PROMPT[:5]), SeqChunk(2, 0, (PROMPT * 5)[:40])])
        r._pad(plan)
        assert (plan.rows, plan.samples, plan.pad, plan.max_end) == (48, 2, (1, 5), 40)
    assert got == want
    # (18, 1): eager, captured, replayed; (20, 0) and (16, 1): the chunked prompt, eager;
    # mixed steps of 7, 8, 9 rows: (8, 2) eager, captured, then (16, 2) eager; (48, 2) eager;
    # slot 1's decode (1, 1): eager, captured
    assert stats == {
        "cached": 3, "captures": 3, "replays": 4, "evictions": 0, "invalidations": 0,
    }  # fmt: skip


def test_prefill_buckets_count_captures(llama: Any) -> None:
    with ModelRunner(make_backend("cpu"), llama, max_slots=9, prefill_graphs=True) as r:
        r.enable_logprobs()
        for length in (17, 18, 17, 18):  # one bucket: eager, captured, replayed twice
            r.free_slot(0)
            r.execute([SeqChunk(0, 0, (PROMPT * 2)[:length])]).get_output()
        assert r.graph_stats["captures"] == 1 and r.graph_stats["replays"] == 3
        # prompt logprobs (echo): scored rows are never padded nor captured
        for _ in range(3):
            r.free_slot(1)
            chunk = SeqChunk(1, 0, PROMPT, prompt_logprobs=0, prompt_targets=PROMPT[1:])
            r.execute([chunk]).get_output()
        assert r.graph_stats["captures"] == 1 and r.graph_stats["replays"] == 3


def test_prefill_graphs_follow_the_argument_the_environment_and_the_hint(
    llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = make_backend("cpu")
    assert prefill_graphs_enabled(cpu, False, True) == (False, "graphs are off")
    with ModelRunner(cpu, llama, max_slots=1, graphs=False, prefill_graphs=True) as r:
        assert (r.prefill_graphs, r.prefill_graphs_reason) == (False, "graphs are off")
    monkeypatch.setenv("VT_PREFILL_GRAPHS", "1")
    assert prefill_graphs_enabled(cpu, True) == (
        True,
        "prefill and mixed steps are padded to a token bucket and replayed (VT_PREFILL_GRAPHS=1)",
    )
    assert prefill_graphs_enabled(cpu, True, False) == (
        False, "prefill and mixed steps run eagerly (prefill_graphs=False)"
    )  # fmt: skip
    monkeypatch.setenv("VT_PREFILL_GRAPHS", "maybe")
    with pytest.raises(ValueError, match="VT_PREFILL_GRAPHS='maybe' is not a boolean"):
        ModelRunner(make_backend("cpu"), llama, max_slots=1)
    monkeypatch.delenv("VT_PREFILL_GRAPHS")
    assert vt.gpu.GpuBackend.prefill_graphs and not vt.Backend.prefill_graphs
    for name in ("graphs", "prefill_graphs", "async_scheduling"):
        for bad in ("yes", 1, 0.0):
            with pytest.raises(ValueError, match=f"{name} must be True, False or None, got"):
                ModelRunner(make_backend("cpu"), llama, max_slots=1, **{name: bad})


def test_vmm_growth_does_not_invalidate_captured_graphs(llama: Any) -> None:
    """Decoding crosses the vmm cache's first chunk while replaying: the reservation's address
    is fixed and growth maps more of it before the replay is enqueued."""
    prompt, n_new = PROMPT * 6, 20  # 54 positions; decode crosses position 64

    def run(graphs: bool, kind: str) -> tuple[list[int], ModelRunner]:
        r = ModelRunner(
            make_backend("cpu"), llama, max_slots=KV_SLOTS, max_model_len=256, kv_cache=kind,
            graphs=graphs,
        )  # fmt: skip
        outs = [r.execute([SeqChunk(slot=0, start_pos=0, token_ids=prompt)])]
        for j in range(n_new - 1):  # run ahead of get_output, as the engine does
            pos = len(prompt) + j
            outs.append(
                r.execute([SeqChunk(slot=0, start_pos=pos, token_ids=None, from_previous=True)])
            )
        ids = [o.get_output()[0] for o in outs]
        if kind == "vmm":
            assert r.kv.stats().segments == 2  # grew while decode steps were replayed
        r.close()
        return ids, r

    want, _ = run(False, "contiguous")
    got, r = run(True, "vmm")
    assert got == want
    assert r.kv.kind == "vmm"
    stats = r.graph_stats
    # 19 decode steps: the first eager, the second captured, every one after it replayed
    assert stats["captures"] == 1 and stats["replays"] == n_new - 2
    assert stats["invalidations"] == 0


def test_a_changed_kv_buffer_drops_the_graphs(llama: Any) -> None:
    """Never a replay against the KV address a graph was captured with, if it ever moved."""

    def run(move: bool) -> tuple[list[int], dict[str, int]]:
        backend = make_backend("cpu")
        with ModelRunner(backend, llama, max_slots=1, kv_cache="contiguous") as r:
            ids = [r.execute([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)]).get_output()[0]]
            for j in range(8):
                if move and j == 4:
                    r.synchronize()
                    old = r.kv.buffer
                    new = backend.alloc(old.nbytes)
                    backend.host_view(new)[:] = backend.host_view(old)
                    r.kv._buffer = new
                chunk = SeqChunk(slot=0, start_pos=9 + j, token_ids=None, from_previous=True)
                ids.append(r.execute([chunk]).get_output()[0])
            return ids, r.graph_stats

    want, stats = run(False)
    assert stats["captures"] == 1 and stats["invalidations"] == 0
    got, stats = run(True)
    assert got == want
    assert stats["invalidations"] == 1
    assert stats["captures"] == 2  # eager again once, then captured against the new buffer


def test_the_cache_is_bounded_and_freed_on_close(llama: Any) -> None:
    backend = make_backend("cpu")
    destroyed: list[vt.Graph] = []
    plain = backend.destroy_graph

    def destroy(graph: vt.Graph) -> None:
        destroyed.append(graph)
        plain(graph)

    backend.destroy_graph = destroy  # type: ignore[method-assign]

    def shrink(r: ModelRunner) -> list[dict[int, int]]:
        outs = [r.execute([SeqChunk(s, 0, PROMPT[s:]) for s in range(3)]).get_output()]
        pos = {s: len(PROMPT) - s for s in range(3)}
        for slots in ([0, 1, 2], [0, 1], [0]):
            for _ in range(3):
                outs.append(r.execute(_next(pos, slots, 1)).get_output())
                for s in slots:
                    pos[s] += 1
        return outs

    with ModelRunner(make_backend("cpu"), llama, max_slots=3, graphs=False) as r:
        want = shrink(r)
    r = ModelRunner(backend, llama, max_slots=3, max_graphs=1)
    assert shrink(r) == want
    stats = r.graph_stats
    assert stats["captures"] == 3 and stats["evictions"] == 2 and stats["cached"] == 1
    assert len(destroyed) == 2
    r.close()
    assert len(destroyed) == 3 and r.graph_stats["cached"] == 0


def test_graphs_follow_the_argument_the_environment_and_the_capability(
    llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VT_GRAPHS", "0")
    with ModelRunner(make_backend("cpu"), llama, max_slots=1) as r:
        assert (r.graphs, r.graphs_reason) == (False, "VT_GRAPHS=0")
    with ModelRunner(make_backend("cpu"), llama, max_slots=1, graphs=True) as r:
        assert r.graphs  # the argument wins over the environment
    monkeypatch.setenv("VT_GRAPHS", "sometimes")
    with pytest.raises(ValueError, match="VT_GRAPHS='sometimes' is not a boolean; use 0 or 1"):
        ModelRunner(make_backend("cpu"), llama, max_slots=1)
    monkeypatch.delenv("VT_GRAPHS")
    no_graphs, _ = Registry(env={"VT_CAPS": "cpu:graphs=0"}).create_backend("cpu")
    assert not no_graphs.capabilities.graphs
    with ModelRunner(no_graphs, llama, max_slots=1, graphs=True) as r:
        assert not r.graphs
        assert r.graphs_reason == "the backend does not declare graphs (graphs=True)"
        r.execute([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)]).get_output()
        for j in range(3):
            r.execute([SeqChunk(slot=0, start_pos=9 + j, token_ids=None, from_previous=True)])
        r.synchronize()
        assert r.graph_stats["replays"] == 0
    caps = vt.Capabilities(graphs=True)
    assert graphs_enabled(caps, None) == (
        True,
        "decode steps are captured once per shape and replayed (default)",
    )
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_graphs must be a positive integer"):
            ModelRunner(make_backend("cpu"), llama, max_slots=1, max_graphs=bad)


def test_a_failed_capture_ends_the_capture_and_raises(llama: Any) -> None:
    backend = make_backend("cpu")
    capturing = {"on": False}
    plain_begin, plain_end = backend.begin_capture, backend.end_capture
    plain_op = backend.op_matmul_add  # the residual add every layer launches

    def begin(stream: vt.Stream) -> None:
        capturing["on"] = True
        plain_begin(stream)

    def end(stream: vt.Stream) -> vt.Graph:
        capturing["on"] = False
        return plain_end(stream)

    def matmul_add(stream: vt.Stream, **args: Any) -> None:
        if capturing["on"]:
            raise ValueError("matmul_add refused during capture")
        plain_op(stream, **args)

    backend.begin_capture, backend.end_capture = begin, end  # type: ignore[method-assign]
    backend.op_matmul_add = matmul_add  # type: ignore[attr-defined]
    with ModelRunner(backend, llama, max_slots=1) as r:
        r.execute([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)]).get_output()
        r.execute([SeqChunk(slot=0, start_pos=9, token_ids=None, from_previous=True)])
        with pytest.raises(ValueError, match="matmul_add refused during capture"):
            r.execute([SeqChunk(slot=0, start_pos=10, token_ids=None, from_previous=True)])
        assert not capturing["on"]
        r.synchronize()  # the stream is not left capturing
        assert r.graph_stats["cached"] == 0


def test_cpu_capture_records_and_refuses_what_a_gpu_refuses() -> None:
    b = make_backend("cpu")
    s = b.create_stream("cap")
    src, dst = b.alloc(16), b.alloc(16)
    b.host_view(src)[:] = 7
    b.begin_capture(s)
    with pytest.raises(vt.VtError, match="already capturing"):
        b.begin_capture(s)
    b.copy_d2d(dst, src, 16, s)
    event = b.create_event()
    with pytest.raises(vt.VtError, match="is capturing a graph; record_event is refused"):
        b.record_event(event, s)
    with pytest.raises(vt.VtError, match="is capturing a graph; stream_wait_event is refused"):
        b.stream_wait_event(s, event)
    with pytest.raises(vt.VtError, match="end the capture before synchronizing it"):
        b.synchronize(s)
    graph = b.end_capture(s)
    b.synchronize(s)
    assert (b.host_view(dst) == 0).all()  # recorded, not run
    b.host_view(src)[:] = 9
    b.launch_graph(graph, s)
    b.synchronize(s)
    assert np.array_equal(b.host_view(dst), np.full(16, 9, np.uint8))
    b.destroy_graph(graph)
    with pytest.raises(ValueError, match="graph captured on 'cap' was destroyed"):
        b.launch_graph(graph, s)
    with pytest.raises(vt.VtError, match="is not capturing"):
        b.end_capture(s)
    b.destroy_stream(s)
    b.close()


def _random_schedule(r: ModelRunner, seed: int) -> list[dict[int, int]]:
    """Steps a server might run: prompts of random lengths (some chunked) joining decodes
    in random order, sequences ending at max_model_len, slots freed and reused."""
    rng = np.random.default_rng(seed)
    pos: dict[int, int] = {}  # slot -> positions held, for slots decoding
    queued: dict[int, list[int]] = {}  # slot -> prompt tokens not yet prefilled
    outs: list[dict[int, int]] = []
    for _ in range(40):
        free = [s for s in range(r.max_slots) if s not in pos and s not in queued]
        if free and rng.random() < 0.5:
            slot = int(rng.choice(free))
            r.free_slot(slot)
            queued[slot] = [int(t) for t in rng.integers(1, 60, int(rng.integers(1, 40)))]
        chunks: list[SeqChunk] = []
        for slot in sorted(pos, key=lambda _: rng.random()):
            chunks.append(SeqChunk(slot, pos[slot], None, from_previous=True))
        budget = 24  # tokens a step for prompts: longer ones are chunked
        for slot, rest in list(queued.items()):
            if budget <= 0:
                break
            start = r.seq_len(slot)
            take = rest[:budget]
            last = len(take) == len(rest)
            chunks.append(SeqChunk(slot, start, take, sample=last))
            budget -= len(take)
            queued[slot] = rest[len(take) :]
            if last:
                del queued[slot]
                pos[slot] = start + len(take)
        if not chunks:
            continue
        outs.append(r.execute(chunks).get_output())
        for c in chunks:
            if c.from_previous:
                pos[c.slot] += 1
        for slot in [s for s, p in pos.items() if p >= r.max_model_len or rng.random() < 0.05]:
            del pos[slot]  # finished (max_model_len or a stop): its slot is reused later
    return outs


@pytest.mark.parametrize("seed", [0, 1])
def test_random_serving_schedules_replay_the_ids_of_eager_steps(llama: Any, seed: int) -> None:
    """Many step shapes through a cache of two graphs (evictions), every prefill and mixed
    step padded (eager at first sight too), sequences ending at max_model_len: the same ids
    as eager steps without padding."""
    kw: dict[str, Any] = {"max_slots": 4, "max_model_len": 48, "max_batch_tokens": 32}
    with ModelRunner(make_backend("cpu"), llama, graphs=False, **kw) as r:
        want = _random_schedule(r, seed)
    with ModelRunner(make_backend("cpu"), llama, prefill_graphs=True, max_graphs=2, **kw) as r:
        got = _random_schedule(r, seed)
        stats = r.graph_stats
    assert got == want
    assert stats["replays"] > 0 and stats["evictions"] > 0, stats


def test_the_graph_hints_each_layers_weights_before_its_attention(llama: Any) -> None:
    """Where a backend declares the optional op ``prefetch``, each layer launches it twice
    right before attention (the output projection's weight, then gate with up: what the
    ops after attention read), in eager and captured steps alike; the ids stay those of
    the plain backend, whose steps launch no prefetch."""
    plain = make_backend("cpu")
    plain_ops = _ops(plain)
    with ModelRunner(plain, llama, max_slots=4, graphs=False) as r:
        want = scripted(r)
    assert plain_ops and "prefetch" not in plain_ops
    backend = make_backend("cpu")
    hints: list[tuple[str, str | None]] = []
    supports = backend.supports
    backend.supports = lambda op, dtype=None: op == "prefetch" or supports(op, dtype)  # type: ignore[method-assign]

    def op_prefetch(stream: Any, weight: vt.Weight, paired: vt.Weight | None = None) -> None:
        hints.append((weight.name, None if paired is None else paired.name))

    backend.op_prefetch = op_prefetch  # type: ignore[attr-defined]
    ops = _ops(backend)
    with ModelRunner(backend, llama, max_slots=4) as r:
        got = scripted(r)
    assert got == want
    layers = llama.config.n_layers
    assert hints[: 2 * layers] == [
        hint
        for i in range(layers)
        for hint in ((f"blk.{i}.attn_output.weight", None),
                     (f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"))
    ]  # fmt: skip
    at = [j for j, op in enumerate(ops) if op.startswith("attention")]
    assert at and all(ops[j - 2 : j] == ["prefetch", "prefetch"] for j in at)
    assert ops.count("prefetch") == 2 * len(at) == len(hints)


def _ops(backend: Any) -> list[str]:
    """The ops ``backend`` launches from now on, in order (a spy on its launch)."""
    ops: list[str] = []
    launch = backend.launch

    def spy(op: str, stream: Any, **args: Any) -> None:
        ops.append(op)
        launch(op, stream, **args)

    backend.launch = spy
    return ops
