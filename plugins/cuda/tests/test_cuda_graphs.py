"""CUDA graphs through the adapter, on the fake driver (which records work on a capturing
stream and runs it on cuGraphLaunch): which driver calls a capture and a replay make.

The runner's decode step as one graph launch is tested once for vt.gpu, on the fake GPU
runtime (tests/test_gpu_backend.py); that replays compute the same ids as eager steps is
proven on the GPU (gpu_checks.py) and on the cpu backend (tests/test_step_graphs.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from fake_cuda import H200, CUresult, CUstreamCaptureMode, FakeDriver, FakeNvrtc
from vt.protocol.mixins import derive_capabilities
from vt_cuda.adapter import CudaError, CudaRuntime
from vt_cuda.backend import CudaBackend
from vt_cuda.caps import capabilities_from_device


@pytest.fixture(autouse=True)
def _fresh_cubin_cache() -> None:
    CudaRuntime.binaries.clear()


def make() -> tuple[CudaBackend, FakeDriver]:
    driver = FakeDriver()
    backend = CudaBackend(CudaRuntime(driver, FakeNvrtc(), platform="linux"))
    # what the registry derives from the fake H200's declaration
    backend.capabilities = derive_capabilities(CudaBackend, capabilities_from_device(H200))
    driver.calls.clear()
    return backend, driver


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
