"""Exceptions that vt raises to users and plugin authors."""

from __future__ import annotations

from typing import Any


class VtError(Exception):
    """Base class of every error vt raises on purpose."""


class HostAccessError(VtError):
    """The host tried to dereference device memory that is not host-addressable."""


class BackendUnavailableError(VtError):
    """A backend was asked for by name but is unavailable, rejected, broken or unknown."""


class BackendVerificationError(BackendUnavailableError):
    """A backend's runtime probes disproved a capability it declares (see ``vt.management.trust``).

    ``failed`` holds the failing checks, ``workaround`` the ``VT_CAPS`` items that correct
    the declaration they disproved (None when no declaration avoids it), ``verification``
    the :class:`vt.management.trust.Verification` (with the cache file).
    """

    def __init__(
        self,
        message: str,
        *,
        verification: Any = None,
        failed: Any = (),
        workaround: str | None = None,
    ) -> None:
        super().__init__(message)
        self.verification = verification
        self.failed = list(failed)
        self.workaround = workaround


class CapabilityError(VtError):
    """A backend was asked for something its capabilities do not allow."""


class KernelNotImplementedError(VtError, NotImplementedError):
    """A backend does not implement a kernel the model needs."""


class VmmError(VtError):
    """A virtual-memory reservation or mapping request is invalid or failed."""


class ModelError(VtError):
    """A model file is malformed, truncated or unsupported."""
