"""CUDA graphs through the adapter, on the fake driver (which records work on a capturing
stream and runs it on cuGraphLaunch), and the runner's decode step as one graph launch.

That replays compute the same ids as eager steps is proven on the GPU (gpu_checks.py) and
on the cpu backend (tests/test_step_graphs.py); here, which driver calls make it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fake_cuda import H200, CUresult, CUstreamCaptureMode, FakeDriver, FakeNvrtc
from vt.audit import probe_graphs
from vt.mixins import derive_capabilities
from vt.model import load_gguf
from vt.runner import ModelRunner, SeqChunk
from vt.testing.tiny import write_tiny_gguf
from vt_cuda.adapter import CudaError, CudaRuntime
from vt_cuda.backend import CudaBackend
from vt_cuda.caps import capabilities_from_device


@pytest.fixture(autouse=True)
def _fresh_cubin_cache() -> None:
    CudaRuntime._cubins.clear()


def make() -> tuple[CudaBackend, FakeDriver]:
    driver = FakeDriver()
    backend = CudaBackend(CudaRuntime(driver, FakeNvrtc(), platform="linux"))
    # what the registry derives from the fake H200's declaration
    backend.capabilities = derive_capabilities(CudaBackend, capabilities_from_device(H200))
    driver.calls.clear()
    return backend, driver


def test_graphs_are_derived_from_the_graphs_mixin() -> None:
    backend, _ = make()
    caps = backend.capabilities
    assert caps.graphs is True
    prov = caps.source_of("graphs")
    assert (prov.source.value, prov.detail) == ("derived", "implements vt.Graphs")


def test_capture_instantiate_launch_destroy_call_sequence() -> None:
    backend, driver = make()
    s = backend.create_stream("main")
    src, dst = backend.alloc(64), backend.alloc(64)
    backend.copy_h2d(src, np.full(64, 3, np.uint8))
    backend.memset(dst, 0)
    driver.calls.clear()
    backend.begin_capture(s)
    backend.copy_d2d(dst, src, 64, s)
    graph = backend.end_capture(s)
    assert driver.names() == [
        "cuStreamBeginCapture",
        "cuMemcpyDtoDAsync",
        "cuStreamEndCapture",
        "cuGraphInstantiate",
        "cuGraphDestroy",  # the executable graph does not need its source
    ]
    assert driver.args("cuStreamBeginCapture") == [
        (s.handle, CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    ]
    (graph_handle,) = driver.args("cuGraphDestroy")[0]
    assert driver.args("cuGraphInstantiate") == [(graph_handle, 0)]
    got = np.empty(64, np.uint8)
    backend.copy_d2h(got, dst)
    assert (got == 0).all()  # recorded, not run
    backend.copy_h2d(src, np.full(64, 5, np.uint8))
    driver.calls.clear()
    backend.launch_graph(graph, s)
    assert driver.names() == ["cuGraphLaunch"]
    backend.copy_d2h(got, dst)
    assert (got == 5).all()  # the replay copied what the source holds now
    backend.destroy_graph(graph)
    assert driver.names()[-1] == "cuGraphExecDestroy"
    with pytest.raises(ValueError, match="graph captured on 'main' was destroyed"):
        backend.launch_graph(graph, s)


def test_a_failed_instantiation_still_destroys_the_graph_and_names_the_call() -> None:
    backend, driver = make()
    s = backend.create_stream()
    backend.begin_capture(s)
    driver.fail["cuGraphInstantiate"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaError, match=r"cuGraphInstantiate\(.*CUDA_ERROR_OUT_OF_MEMORY"):
        backend.end_capture(s)
    assert driver.names()[-1] == "cuGraphDestroy"


def test_synchronizing_a_capturing_stream_fails_with_the_drivers_error() -> None:
    backend, driver = make()
    s = backend.create_stream()
    backend.begin_capture(s)
    with pytest.raises(CudaError, match="CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"):
        backend.synchronize(s)
    backend.destroy_graph(backend.end_capture(s))


def test_the_audit_graph_probe_passes_on_the_fake_driver() -> None:
    backend, driver = make()
    (check,) = probe_graphs(backend)
    assert (check.id, check.result) == ("graph-replay", "pass"), check.detail
    assert driver.names().count("cuGraphLaunch") == 2
    assert driver.execs == {} and driver.graphs == {}  # everything destroyed


def test_a_decode_step_is_one_graph_launch_after_warm_up_and_capture(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch="llama")
    backend, driver = make()
    with load_gguf(path) as model, ModelRunner(backend, model, max_slots=2) as r:
        assert r.graphs
        r.execute([SeqChunk(slot=0, start_pos=0, token_ids=[1, 2, 3])]).get_output()

        def step(pos: int) -> list[str]:
            driver.calls.clear()
            r.execute([SeqChunk(slot=0, start_pos=pos, token_ids=None, from_previous=True)])
            r.synchronize()
            return driver.names()

        eager, captured, replayed = step(3), step(4), step(5)
        per_step = eager.count("cuLaunchKernel")
        assert per_step == 1 + 16 * model.config.n_layers + 4  # embedding, layers, head
        assert "cuStreamBeginCapture" not in eager and "cuGraphLaunch" not in eager
        begin, end = captured.index("cuStreamBeginCapture"), captured.index("cuStreamEndCapture")
        assert captured[begin:end].count("cuLaunchKernel") == per_step
        assert captured.count("cuLaunchKernel") == per_step and captured.count("cuGraphLaunch") == 1
        assert "cuLaunchKernel" not in replayed and replayed.count("cuGraphLaunch") == 1
        # around the launch: the inputs' copy, the previous ids' copy, the ids into the
        # output slot, and the readback
        assert replayed.index("cuMemcpyHtoDAsync") < replayed.index("cuGraphLaunch")
        assert replayed.index("cuMemcpyDtoDAsync") < replayed.index("cuGraphLaunch")
        assert replayed[replayed.index("cuGraphLaunch") + 1] == "cuMemcpyDtoDAsync"
        assert len(replayed) < 15
        stats = r.graph_stats
    assert stats["captures"] == 1 and stats["replays"] == 2
    assert driver.execs == {}  # the runner destroyed its graph on close
