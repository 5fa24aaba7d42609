"""vt: a Python inference runtime for GGUF models with pluggable, capability-checked backends.

This module is vt's public API: a plugin imports only what is exported here, including the
subpackages ``vt.reference`` (numpy reference kernels, the ``ReferenceOps`` and
``HostMemory`` mixins) and ``vt.gpu`` (the shared GPU backend over a runtime adapter).
"""

from __future__ import annotations

from typing import Any

from .errors import (
    BackendUnavailableError,
    BackendVerificationError,
    CapabilityError,
    HostAccessError,
    KernelNotImplementedError,
    ModelError,
    VmmError,
    VtError,
)
from .management.hookspecs import hookimpl, hookspec
from .protocol.backend import (
    SAMPLE_PARAMS_DTYPE,
    Backend,
    Buffer,
    Event,
    Graph,
    HostBuffer,
    KVLayout,
    Probe,
    RopeParams,
    RopeStyle,
    Segment,
    Stream,
    Tensor,
    VirtualRange,
    Weight,
    WeightTensor,
)
from .protocol.capabilities import Capabilities, Provenance, Source, VmmCaps
from .protocol.mixins import (
    AsyncD2HCopy,
    Events,
    Graphs,
    HostAddressable,
    PinnedHostMemory,
    VirtualMemory,
)
from .protocol.ops import FUSED_OPS, OPS, OPTIONAL_OPS, PRIMITIVE_OPS, Arg, OpDef

__version__ = "0.1.0"

# Heavy parts (model loading, tokenizers) load on first use, so `import vt` stays cheap for
# plugins and `vt backends`.
_LAZY = {
    "LLM": ("vt.frontends.llm", "LLM"),
    "SamplingParams": ("vt.frontends.sampling", "SamplingParams"),
    "reference": ("vt.reference", None),
    "envs": ("vt.envs", None),
    "gpu": ("vt.gpu", None),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'vt' has no attribute {name!r}")


__all__ = [
    "FUSED_OPS",
    "OPS",
    "OPTIONAL_OPS",
    "PRIMITIVE_OPS",
    "SAMPLE_PARAMS_DTYPE",
    "Arg",
    "AsyncD2HCopy",
    "Events",
    "Graphs",
    "HostAddressable",
    "OpDef",
    "PinnedHostMemory",
    "Tensor",
    "VirtualMemory",
    "Backend",
    "BackendUnavailableError",
    "BackendVerificationError",
    "Buffer",
    "Capabilities",
    "CapabilityError",
    "Event",
    "Graph",
    "HostAccessError",
    "HostBuffer",
    "KVLayout",
    "KernelNotImplementedError",
    "LLM",
    "ModelError",
    "Probe",
    "Provenance",
    "RopeParams",
    "RopeStyle",
    "SamplingParams",
    "Segment",
    "Source",
    "Stream",
    "VirtualRange",
    "VmmCaps",
    "VmmError",
    "VtError",
    "Weight",
    "WeightTensor",
    "hookimpl",
    "hookspec",
    "envs",
    "gpu",
    "reference",
]
