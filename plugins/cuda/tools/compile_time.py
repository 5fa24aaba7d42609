"""A model's kernel modules compiled by the real NVRTC, without a GPU: how long a machine's
first run spends compiling, the modules one after another or on helper threads.

    python plugins/cuda/tools/compile_time.py MODEL.gguf [--rounds 2] [--site DIR]

NVRTC needs no GPU, so this runs anywhere ``cuda-bindings`` and ``nvidia-cuda-nvrtc`` are
installed (``--site``: a virtual environment's site-packages that has them, searched after
vt's own; the folder of ``libnvrtc.so`` on ``LD_LIBRARY_PATH`` if cuda-bindings cannot find
it): the driver is the tests' fake (``plugins/cuda/tests/fake_cuda.py``, an H200), so
memory, copies and module loads cost nothing and only the compiles are real (sm_90 cubins,
as on the device). Each round runs two fresh processes, ``GpuBackend.parallel_compile``
off then on (flipped every other round), each with ``VT_KERNEL_CACHE=0``: every weight of
MODEL uploaded, then ``prepare()`` (every module loaded). Prints one JSON object: per
process the seconds to the last upload and to the loaded modules, and each setting's mean.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from first_load import alternate, child

TESTS = Path(__file__).resolve().parents[1] / "tests"

CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[3])
sys.path.extend(sys.argv[4:])
import cuda.bindings.nvrtc as nvrtc
from fake_cuda import H200, FakeDriver
from vt.gpu import GpuBackend
from vt.model import load_gguf
from vt_cuda.adapter import CudaRuntime
from vt_cuda.backend import CudaBackend

GpuBackend.parallel_compile = bool(int(sys.argv[2]))
t0 = time.perf_counter()
backend = CudaBackend(CudaRuntime(FakeDriver(H200), nvrtc, platform=H200.platform))
with load_gguf(sys.argv[1]) as model:
    for name in model.tensor_names:
        backend.upload_weight(model.tensor(name))
    t1 = time.perf_counter()
    backend.prepare()
t2 = time.perf_counter()
modules = len(backend._modules)
backend.close()
print(json.dumps({"uploaded_s": t1 - t0, "ready_s": t2 - t0, "modules": modules}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--site", action="append", default=[], help="a site-packages with NVRTC")
    args = ap.parse_args()
    t0 = time.perf_counter()
    runs, mean = alternate(
        args.rounds,
        lambda parallel: child(CHILD, args.model, str(int(parallel)), str(TESTS), *args.site),
        "ready_s",
    )
    result = {"model": args.model, "cpus": os.cpu_count(), "runs": runs, "mean_ready_s": mean}
    result["seconds"] = round(time.perf_counter() - t0)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
