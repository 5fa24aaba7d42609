"""The cpu backend's captured decode steps run as native programs of jobs
(``vt_cpu.program``): the op-by-op bits, errors named by their op, the team or alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import vt
from model_support import PROMPT, make_backend, tiny_path
from vt.execution.runner import ModelRunner, SeqChunk
from vt.model import load_gguf
from vt_cpu import CpuBackend
from vt_cpu.program import Program
from vt_cpu.streams import StreamError

F32, I32 = np.float32, np.int32


@pytest.fixture
def cpu() -> Iterator[CpuBackend]:
    backend = CpuBackend()
    yield backend
    backend.close()


def _programs(runner: ModelRunner) -> list[Program]:
    graphs = runner._graphs._graphs.values()  # the runner's captured decode steps
    return [fn for g in graphs for _, fn, _ in g.handle.ops if isinstance(fn, Program)]


def _decode(path: Path, program: bool, rows: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Greedy ids and top-3 logprobs of 24 decode steps of ``rows`` sequences."""
    monkeypatch.setenv("VT_CPU_PROGRAM", "1" if program else "0")
    with ModelRunner(make_backend("cpu"), load_gguf(path), max_slots=rows) as r:
        r.enable_logprobs()
        prompts = {s: PROMPT[s:] for s in range(rows)}
        outs = [r.execute([SeqChunk(s, 0, p) for s, p in prompts.items()]).get_output()]
        pos = {s: len(p) for s, p in prompts.items()}
        for _ in range(24):
            step = [SeqChunk(s, pos[s], None, from_previous=True, logprobs=3) for s in pos]
            out = r.execute(step)
            outs.append((out.get_output(), out.get_logprobs()))
            pos = {s: p + 1 for s, p in pos.items()}
        programs = _programs(r)
        native = sum(p.native_runs for p in programs)
        return outs, programs, native, r.graph_stats["replays"]


@pytest.mark.parametrize("weight_type", ["Q4_1", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_replayed_decode_step_runs_as_a_program_with_the_op_by_op_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weight_type: str, rows: int
) -> None:
    path = tiny_path(tmp_path, "llama", weight_type, dim=256, ffn=512, n_heads=8,
                     n_kv_heads=2, n_layers=3)  # fmt: skip
    want, none, _, replays = _decode(path, False, rows, monkeypatch)
    got, programs, native, _ = _decode(path, True, rows, monkeypatch)
    assert not none and replays == 23
    assert got == want  # ids and logprobs, bit for bit
    # one program: from the first layer's norm to the output projection (the embedding
    # and the sampling stay closures), natively run once the thread choices settled
    assert len(programs) == 1
    assert {name for name, _ in programs[0].ops} >= {
        "rms_norm",
        "qkv",
        "rope_kv_store",
        "attention",
        "swiglu",
        "matmul_add",
    }
    assert native >= 10


def _rope_graph(cpu: CpuBackend, s: vt.Stream) -> tuple[Any, ...]:
    """A captured rms_norm then rope_kv_store (a program of two ops) over fresh buffers."""
    heads, kv_heads, hd, max_len = 2, 1, 8, 8
    layout = vt.KVLayout(n_layers=1, n_slots=2, max_len=max_len, n_kv_heads=kv_heads,
                         head_dim=hd)  # fmt: skip
    rng = np.random.default_rng(0)
    x = cpu.alloc(4 * heads * hd)
    cpu.copy_h2d(x, rng.standard_normal(heads * hd).astype(F32))
    q, k, v = cpu.alloc(4 * heads * hd), cpu.alloc(4 * kv_heads * hd), cpu.alloc(4 * kv_heads * hd)
    cpu.copy_h2d(k, rng.standard_normal(kv_heads * hd).astype(F32))
    cpu.copy_h2d(v, rng.standard_normal(kv_heads * hd).astype(F32))
    pos, slots, cache = cpu.alloc(4), cpu.alloc(4), cpu.alloc(layout.nbytes)
    cpu.copy_h2d(slots, np.array([1], I32))
    w = cpu.upload_weight(vt.WeightTensor("norm", 0, (heads * hd,), np.ones(heads * hd, F32)))
    cpu.begin_capture(s)
    cpu.launch("rms_norm", s, out=vt.Tensor.of(q, F32, 1, heads * hd),
               x=vt.Tensor.of(x, F32, 1, heads * hd), weight=w, eps=1e-5)  # fmt: skip
    cpu.launch("rope_kv_store", s, q=vt.Tensor.of(q, F32, 1, heads * hd),
               k=vt.Tensor.of(k, F32, 1, kv_heads * hd), v=vt.Tensor.of(v, F32, 1, kv_heads * hd),
               positions=vt.Tensor.of(pos, I32, 1), slots=vt.Tensor.of(slots, I32, 1),
               cache=vt.Tensor.of(cache, F32, *layout.shape), layout=layout, layer=0,
               n_heads=heads, params=vt.RopeParams(head_dim=hd))  # fmt: skip
    return cpu.end_capture(s), pos, q, cache


def test_a_program_step_that_fails_names_its_op_and_the_next_replay_runs(
    cpu: CpuBackend,
) -> None:
    s = cpu.create_stream("p")
    try:
        graph, pos, q, cache = _rope_graph(cpu, s)
        assert [name for name, _, _ in graph.handle.ops] == ["program"]
        cpu.copy_h2d(pos, np.array([3], I32))
        cpu.launch_graph(graph, s)
        cpu.synchronize(s)
        want = cpu.host_view(q).view(F32).copy()
        cpu.copy_h2d(pos, np.array([8], I32))  # max_len is 8
        cpu.launch_graph(graph, s)
        with pytest.raises(
            StreamError,
            match=r"rope_kv_store failed: ValueError: rope_kv_store: position 8 is out of range",
        ):
            cpu.synchronize(s)
        cpu.copy_h2d(pos, np.array([3], I32))  # the status word was cleared
        cpu.launch_graph(graph, s)
        cpu.synchronize(s)
        assert np.array_equal(cpu.host_view(q).view(F32), want)
        cpu.destroy_graph(graph)
    finally:
        cpu.destroy_stream(s)


def test_vt_cpu_program_0_replays_op_by_op(
    cpu: CpuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VT_CPU_PROGRAM", "0")
    s = cpu.create_stream("p")
    try:
        graph, *_ = _rope_graph(cpu, s)
        assert [name for name, _, _ in graph.handle.ops] == ["rms_norm", "rope_kv_store"]
        cpu.destroy_graph(graph)
    finally:
        cpu.destroy_stream(s)


def test_rope_tables_equal_each_positions_own_angles() -> None:
    """The jobs read RoPE's angles from a table over every position: its rows are what
    ``rope_cos_sin`` gives for those positions alone (so the fused op still equals the
    reference's rope bit for bit)."""
    from vt.reference import rope_cos_sin

    params = vt.RopeParams(head_dim=64, base=500000.0)
    cos, sin = rope_cos_sin(np.arange(4096), params)
    for positions in ([0], [4095], [17, 3, 2048], list(range(100, 164))):
        c, s = rope_cos_sin(np.array(positions, I32), params)
        assert np.array_equal(cos[positions], c) and np.array_equal(sin[positions], s)


def test_gather_rows_is_native_and_a_bad_row_names_itself(cpu: CpuBackend) -> None:
    """``gather_rows`` runs as a job (so a graph's program takes it in): the reference's
    rows, and for a row out of range the reference's message, nothing written."""
    x = np.arange(12, dtype=F32).reshape(4, 3)
    s = cpu.create_stream("g")
    bx, brows, bout = cpu.alloc(x.nbytes), cpu.alloc(8), cpu.alloc(2 * 3 * 4)
    try:
        cpu.copy_h2d(bx, x)
        args = dict(out=vt.Tensor.of(bout, F32, 2, 3), x=vt.Tensor.of(bx, F32, 4, 3),
                    rows=vt.Tensor.of(brows, I32, 2))  # fmt: skip
        cpu.copy_h2d(brows, np.array([3, 1], I32))
        cpu.launch("gather_rows", s, **args)
        cpu.synchronize(s)
        got = cpu.host_view(bout).view(F32).reshape(2, 3)
        assert np.array_equal(got, vt.reference.gather_rows(x, np.array([3, 1])))
        cpu.copy_h2d(brows, np.array([0, 7], I32))
        cpu.launch("gather_rows", s, **args)
        with pytest.raises(StreamError, match=r"gather_rows failed: ValueError: "
                           r"gather_rows: row 7 is out of range \[0, 4\)"):  # fmt: skip
            cpu.synchronize(s)
        assert np.array_equal(got, x[[3, 1]])  # untouched
        cpu.copy_h2d(brows, np.array([2, 2], I32))  # the status word was cleared
        cpu.launch("gather_rows", s, **args)
        cpu.synchronize(s)
        assert np.array_equal(got, x[[2, 2]])
    finally:
        cpu.destroy_stream(s)
