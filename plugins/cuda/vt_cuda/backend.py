"""The CUDA backend: :class:`vt.gpu.GpuBackend` over the cuda-python adapter.

Everything but availability and capabilities lives in vt.gpu, shared with the ROCm
backend; this module says how to find the driver and what the device can do.
"""

from __future__ import annotations

import importlib.util

from vt import BackendUnavailableError, Probe
from vt.gpu import GpuBackend

from .adapter import INSTALL_HINT, CudaError, CudaRuntime, NoDeviceError, import_cuda
from .blas import INSTALL_HINT as BLAS_HINT
from .caps import DeviceProfile, capabilities_from_device


def import_reason(error: ImportError) -> str:
    """Why the backend is unavailable when cuda-python cannot be imported."""
    if isinstance(error, ModuleNotFoundError) and error.name in ("cuda", "cuda.bindings"):
        return f"cuda-python is not installed ({INSTALL_HINT})"
    return f"cuda-python failed to import ({error}); reinstall it ({INSTALL_HINT})"


def runtime_reason(error: RuntimeError) -> str:
    """Why the backend is unavailable when the driver fails (no library, no device)."""
    if isinstance(error, (CudaError, NoDeviceError)):
        return str(error)
    # cuda-python finds libcuda on the first call and raises a RuntimeError naming it.
    return f"the CUDA driver could not be loaded: {error}"


def load_runtime(device: int = 0, platform: str | None = None) -> CudaRuntime:
    """The CUDA runtime adapter, or BackendUnavailableError with the probe's reason."""
    try:
        return CudaRuntime.load(device, platform)
    except ImportError as e:
        raise BackendUnavailableError(f"backend 'cuda' is unavailable: {import_reason(e)}") from e
    except RuntimeError as e:
        raise BackendUnavailableError(f"backend 'cuda' is unavailable: {runtime_reason(e)}") from e


class CudaBackend(GpuBackend):
    """NVIDIA GPUs through the CUDA driver. The probe declares the device's physical facts
    (:func:`capabilities_from_device`); vt derives the rest from GpuBackend's mixins."""

    name = "cuda"
    priority = 100
    description = "NVIDIA GPU through the CUDA driver (cuda-python) and NVRTC kernels"
    #: The BLAS path (prefill, batches of 64+ rows) keeps its dequantized copy of each weight
    #: for later matmuls while all kept copies fit this fraction of ``device_memory()``
    #: (cuDeviceTotalMem): an H200's eighth is 17.6 GB, an 8 GB card's 1 GB. The copies are
    #: float32 (weights under 1M values) or half: the 1B shape's take 1.9 GB, the 135M
    #: shape's 0.4 GB. They are allocated at a weight's first prefill matmul, each only
    #: while cuMemGetInfo's free memory keeps GpuBackend's margin after it (1 GiB or a
    #: sixteenth of the device, the KV cache's unmapped growth, a scratch copy); past that,
    #: or if the allocation runs out of memory, the copy goes to scratch as with 0 (none
    #: kept, a copy every matmul, as before run 33). docs/gpu.md (runs 32-37): 1B
    #: pp512 +15-65%; 135M between +85% and none (its host-bound figure swings by up to 80%
    #: between repeats); the numerics are the same copies read again.
    blas_keep_fraction = 0.125

    def __init__(self, runtime: CudaRuntime | None = None, platform: str | None = None) -> None:
        rt = runtime if runtime is not None else load_runtime(platform=platform)
        self.profile: DeviceProfile = rt.profile
        super().__init__(rt)

    def device_memory(self) -> int:
        """cuDeviceTotalMem (the BLAS path keeps weight copies within a fraction of it)."""
        return int(self.profile.total_memory)

    @classmethod
    def probe(cls) -> Probe:
        try:
            driver, nvrtc = import_cuda()
        except ImportError as e:
            return Probe(available=False, reason=import_reason(e))
        return cls.probe_modules(driver, nvrtc)

    @classmethod
    def probe_modules(cls, driver: object, nvrtc: object, platform: str | None = None) -> Probe:
        """Probe through given cuda-python modules (the seam the tests use)."""
        try:
            runtime = CudaRuntime(driver, nvrtc, 0, platform, context=False)
        except RuntimeError as e:
            return Probe(available=False, reason=runtime_reason(e))
        try:
            nvrtc_version = nvrtc.nvrtcVersion()  # type: ignore[attr-defined]
        except RuntimeError as e:  # libnvrtc missing: the kernels could never compile
            return Probe(available=False, reason=f"NVRTC could not be loaded: {e} ({INSTALL_HINT})")
        profile = runtime.profile
        blas = importlib.util.find_spec("nvmath") is not None
        return Probe(
            available=True,
            # an available backend's reason is a note: prefill works either way, slower
            reason="" if blas else f"prefill matmuls run on vt's own kernel: {BLAS_HINT}",
            capabilities=capabilities_from_device(profile),
            device=f"{profile.name} ({profile.arch}, {profile.platform})",
            details={
                **profile.model_dump(),
                "device_count": runtime.device_count,
                "nvrtc_version": ".".join(str(v) for v in nvrtc_version[1:]),
                "blas": "cuBLAS (nvmath-python)" if blas else "none",
            },
        )
