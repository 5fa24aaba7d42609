"""Exceptions that vt raises to users and plugin authors."""

from __future__ import annotations


class VtError(Exception):
    """Base class of every error vt raises on purpose."""


class HostAccessError(VtError):
    """The host tried to dereference device memory that is not host-addressable."""


class BackendUnavailableError(VtError):
    """A backend was asked for by name but is unavailable, rejected, broken or unknown."""


class CapabilityError(VtError):
    """A backend was asked for something its capabilities do not allow."""


class KernelNotImplementedError(VtError, NotImplementedError):
    """A backend does not implement a kernel the model needs."""


class VmmError(VtError):
    """A virtual-memory reservation or mapping request is invalid or failed."""


class ModelError(VtError):
    """A model file is malformed, truncated or unsupported."""
