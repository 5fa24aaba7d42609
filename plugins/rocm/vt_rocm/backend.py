"""The ROCm backend: :class:`vt.gpu.GpuBackend` over the hip-python adapter.

Memory, streams, events, VMM and the kernels (one source, compiled by hiprtc) are vt.gpu's,
shared with the CUDA backend: this module says how to find HIP and what the device can do.
"""

from __future__ import annotations

import re

from vt import BackendUnavailableError, Probe
from vt.gpu import GpuBackend

from .adapter import INSTALL_HINT, HipError, HipLibraryError, HipRuntime
from .caps import DeviceProfile, capabilities_from_device


def import_reason(error: ImportError) -> str:
    """Why the backend is unavailable when hip-python cannot be imported."""
    if isinstance(error, ModuleNotFoundError) and error.name in ("hip", "rocm", "rocm.bindings"):
        return f"hip-python is not installed ({INSTALL_HINT})"
    return f"hip-python failed to import ({error}); reinstall it ({INSTALL_HINT})"


def runtime_reason(error: RuntimeError) -> str:
    """Why the backend is unavailable when the HIP runtime fails (missing library, no device)."""
    if isinstance(error, HipError):
        return str(error)
    # hip-python loads libamdhip64 on the first call and says so in its RuntimeError, with
    # bytes reprs ("failed to dlopen 'b'libamdhip64.so'': b'...'"): show them as text.
    text = re.sub(r"\bb'([^']*)'", r"\1", str(error))
    return f"the HIP runtime could not be loaded: {text}"


def load_runtime(device: int = 0) -> HipRuntime:
    """The HIP runtime, or BackendUnavailableError with the same reason probe() gives."""
    try:
        return HipRuntime.load(device)
    except ImportError as e:
        raise BackendUnavailableError(f"backend 'rocm' is unavailable: {import_reason(e)}") from e
    except HipLibraryError as e:
        raise BackendUnavailableError(f"backend 'rocm' is unavailable: {runtime_reason(e)}") from e


class RocmBackend(GpuBackend):
    """AMD GPUs through HIP. The probe declares the device's physical facts
    (:func:`capabilities_from_device`); vt derives the rest from GpuBackend's mixins."""

    name = "rocm"
    priority = 100
    description = "AMD GPU through HIP (hip-python) and hiprtc kernels"

    def __init__(self, runtime: HipRuntime | None = None, platform: str | None = None) -> None:
        rt = runtime if runtime is not None else load_runtime()
        rt.call("hipSetDevice", rt.device)
        self.profile: DeviceProfile = rt.device_profile(platform)
        super().__init__(rt)

    @classmethod
    def probe(cls) -> Probe:
        try:
            runtime = HipRuntime.load()
        except ImportError as e:
            return Probe(available=False, reason=import_reason(e))
        except HipLibraryError as e:
            return Probe(available=False, reason=runtime_reason(e))
        return cls.probe_runtime(runtime)

    @classmethod
    def probe_runtime(cls, runtime: HipRuntime, platform: str | None = None) -> Probe:
        """Probe through an existing runtime (the seam the tests use)."""
        try:
            if runtime.device_count() < 1:
                return Probe(available=False, reason="no HIP device found")
            profile = runtime.device_profile(platform)
        except RuntimeError as e:
            return Probe(available=False, reason=runtime_reason(e))
        return Probe(
            available=True,
            capabilities=capabilities_from_device(profile),
            device=f"{profile.name} ({profile.gcn_arch_name}, {profile.platform})",
            details=profile.model_dump(),
        )
