"""Verified before trusted: a backend's probes pass before vt runs a model on it.

A backend whose declarations are consistent but false passes the load rules and then
produces wrong text with exit status 0 (events that do not wait gave an empty answer; VMM
segments that alias turned a long answer into "slice-slice-slice..."). ``vt audit`` catches
both, but nothing makes a user run it. So whenever vt opens a backend to run a model
(``vt run``, ``vt serve``, ``vt bench``, :class:`vt.LLM`), :func:`open_verified_backend`
runs the audit's runtime probes (:func:`vt.management.audit.probe_backend`) on the
instance it is about
to use, and refuses the backend with :class:`vt.BackendVerificationError` when one fails:
the message names each failing probe, what it saw, and the ``VT_CAPS`` setting that stops
declaring the capability it disproved. Never a silent fallback.

The probes cost a few hundred milliseconds on cpu (``docs/benchmarks.md``), so their result
is cached as JSON in ``$VT_HOME/verified/<backend>-<hash>.json``, keyed by
:class:`BackendIdentity`: the backend, its distribution and version, the device the probe
reported, the effective capabilities (``VT_CAPS`` changes what is declared, hence what is
probed) and vt's version (a newer vt may probe more). A failing result is cached too, so a
liar is refused at once; any change of the key verifies again. Two processes verifying at
once both probe; each writes its record atomically and the last write wins, which is fine
because both hold a result for the same key. A cache file that cannot be read is ignored and
rewritten; a cache that cannot be written costs a warning and a verification next time,
never the run.

``verify=False`` (``--no-verify``, ``VT_VERIFY=0``) skips it, and the summary line says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError

from .. import envs
from ..errors import BackendVerificationError
from .probes import Check

if TYPE_CHECKING:
    from ..protocol.backend import Backend
    from ..protocol.capabilities import Capabilities
    from .registry import Entry, Registry

__all__ = [
    "BackendIdentity",
    "BackendVerificationError",
    "OpenedBackend",
    "Verification",
    "VerificationRecord",
    "identify",
    "open_verified_backend",
    "verified_dir",
    "verify_backend",
    "workaround",
]

log = logging.getLogger(__name__)

#: Bumped when :class:`VerificationRecord` changes shape; older files are re-verified.
FORMAT = 1


# --------------------------------------------------------------------------- records


class BackendIdentity(BaseModel):
    """What a verification result holds for: any change verifies again."""

    model_config = ConfigDict(frozen=True)

    backend: str
    distribution: str
    version: str
    device: str
    capabilities: dict[str, Any]  # effective values, without provenance
    vt_version: str

    def key(self) -> str:
        """``<backend>-<16 hex digits>``: the cache file's stem."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return f"{self.backend}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


class VerificationRecord(BaseModel):
    """What ``$VT_HOME/verified/<key>.json`` holds: the probes' checks for one identity."""

    format: Literal[1] = FORMAT
    identity: BackendIdentity
    checks: list[Check]
    seconds: float  # time the probes took
    verified_at: datetime

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.result == "fail"]

    @property
    def ok(self) -> bool:
        """No probe failed and at least one ran (as for ``vt audit``)."""
        return not self.failed and any(c.result == "pass" for c in self.checks)


class Verification(BaseModel):
    """How an opened backend came to be trusted; ``summary()`` is the summary lines' text."""

    status: Literal["verified", "cached", "skipped"]
    reason: str = ""  # skipped: what turned verification off
    record: VerificationRecord | None = None
    path: Path | None = None  # the cache file (None when skipped)
    cache_error: str = ""  # why the record could not be written

    @classmethod
    def skipped(cls, reason: str) -> Verification:
        return cls(status="skipped", reason=reason)

    def summary(self) -> str:
        """``verified (cached)``, ``verified in 0.42 s`` or ``verification skipped (why)``."""
        if self.status == "skipped":
            return f"verification skipped ({self.reason})"
        if self.status == "cached":
            return "verified (cached)"
        seconds = self.record.seconds if self.record is not None else 0.0
        return f"verified in {seconds:.2f} s" + (" (not cached)" if self.cache_error else "")


class OpenedBackend(NamedTuple):
    """What :func:`open_verified_backend` returns."""

    backend: Backend
    why: str  # how it was selected (the registry's sentence)
    verification: Verification


# --------------------------------------------------------------------------- settings


def verified_dir() -> Path:
    """``$VT_HOME/verified`` (default ``~/.cache/vt/verified``)."""
    home: Path = envs.get("VT_HOME")
    return home / "verified"


# --------------------------------------------------------------------------- workaround

#: Probe id (or prefix, ending in "-") -> the VT_CAPS items that stop declaring what it
#: proves. Probe ids without an entry check the required core (memory, copies, the sync
#: readback, host_view refusing): no setting avoids them, the plugin must be fixed.
PROBE_SETTINGS: dict[str, tuple[str, ...]] = {
    "host-view-roundtrip": ("host_addressable=0",),
    "pinned-host-memory": ("pinned=0",),
    "pinned": ("pinned=0",),
    "event-ordering": ("events=0",),
    "stream-wait-event": ("events=0",),
    "events": ("events=0",),
    "async-d2h-copy": ("async_d2h_copy=0",),
    "async-d2h": ("async_d2h_copy=0",),
    "async-readback": ("async_readback=0",),
    # Segments that alias are what the full-map policy is for (docs/memory.md).
    "vmm-segments-distinct": ("vmm.segments_may_alias=1",),
    "vmm-": ("vmm=off",),
    "vmm": ("vmm=off",),
    "graph-replay": ("graphs=0",),
    "graphs": ("graphs=0",),
}


def _settings_for(check_id: str) -> tuple[str, ...]:
    if check_id in PROBE_SETTINGS:
        return PROBE_SETTINGS[check_id]
    for prefix, items in PROBE_SETTINGS.items():
        if prefix.endswith("-") and check_id.startswith(prefix):
            return items
    return ()


def workaround(name: str, caps: Capabilities, failed: list[Check]) -> str | None:
    """The ``VT_CAPS`` items that stop declaring what ``failed`` disproved, or None.

    None when a failure is in the required core, which no declaration avoids. The items
    keep the capabilities consistent: async readback needs events, pinned memory and a D2H
    path, so turning one of those off turns it off too.
    """
    items: list[str] = []
    for check in failed:
        settings = _settings_for(check.id)
        if not settings:
            return None
        items += [s for s in settings if s not in items]
    if "events=0" in items and "async_d2h_copy=0" in items:
        # The async copy's probe fences with an event: events that lie fail it too. Turn
        # off the cause only; vt verifies again under the new VT_CAPS anyway.
        items.remove("async_d2h_copy=0")
    if "vmm=off" in items and "vmm.segments_may_alias=1" in items:
        items.remove("vmm.segments_may_alias=1")
    off = {item.partition("=")[0] for item in items if item.endswith("=0")}
    if caps.supports_async_sampled_token_readback and "async_readback" not in off:
        host = caps.device_memory_is_host_addressable and "host_addressable" not in off
        d2h = caps.async_d2h_copy and "async_d2h_copy" not in off
        if "events" in off or "pinned" in off or not (host or d2h):
            items.append("async_readback=0")
    return ",".join(f"{name}:{item}" for item in items)


def _refusal(
    name: str, entry: Entry, caps: Capabilities, verification: Verification
) -> BackendVerificationError:
    record = verification.record
    assert record is not None
    failed = record.failed
    dist = " ".join(p for p in (entry.distribution, entry.version) if p)
    where = f" ({dist})" if dist else ""
    if failed:
        what = "; ".join(f"probe {c.id}: {c.detail}" for c in failed)
    else:
        what = "no probe could run"
    fix = workaround(name, caps, failed) if failed else None
    if fix is not None:
        current = str(envs.get("VT_CAPS")).strip().strip(",")
        setting = f"{current},{fix}" if current else fix
        hint = (
            f"Workaround: VT_CAPS={setting} corrects the declaration, so vt avoids what "
            "failed; the plugin's authors should fix it"
        )
    else:
        hint = (
            "No VT_CAPS setting avoids this: it is the backend's required core; report it "
            "to the plugin's authors"
        )
    cached = ""
    if verification.status == "cached":
        cached = f" (cached on {record.verified_at:%Y-%m-%d %H:%M} UTC in {verification.path})"
    elif verification.path is not None and not verification.cache_error:
        cached = f" (saved in {verification.path})"
    message = (
        f"backend {name!r}{where} failed verification{cached}: {what}. {hint}. "
        f"`vt audit --backend {name}` shows every check; vt verifies again when the "
        "plugin's version, the device or VT_CAPS change."
    )
    return BackendVerificationError(
        message, verification=verification, failed=failed, workaround=fix
    )


# --------------------------------------------------------------------------- the cache


def identify(backend: Backend, entry: Entry) -> BackendIdentity:
    """The identity a verification of ``backend`` (created from ``entry``) holds for."""
    from .. import __version__

    return BackendIdentity(
        backend=entry.name,
        distribution=entry.distribution,
        version=entry.version,
        device=entry.device,
        capabilities=backend.capabilities.summary(),
        vt_version=__version__,
    )


def _load(path: Path, identity: BackendIdentity) -> VerificationRecord | None:
    """The cached record for ``identity``, or None (missing, unreadable, or another key)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("vt: cannot read %s (%s); verifying again", path, exc)
        return None
    try:
        record = VerificationRecord.model_validate_json(text)
    except ValidationError as exc:
        # A crash mid-write cannot leave this (writes are atomic), but an old format, a
        # hand edit or a full disk can: verify again and overwrite it.
        why = exc.errors()[0]["msg"] if exc.errors() else str(exc)
        log.warning("vt: ignoring unreadable %s (%s); verifying again", path, why)
        return None
    return record if record.identity == identity else None


def _store(path: Path, record: VerificationRecord) -> str:
    """Write ``record`` atomically; return why it could not be written ("" on success)."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(record.model_dump_json(indent=2) + "\n")
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
        return ""
    except OSError as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        error = f"{type(exc).__name__}: {exc}"
        log.warning(
            "vt: cannot cache the verification of backend %r in %s (%s); it runs again next "
            "time (set VT_HOME to a writable directory)",
            record.identity.backend,
            path.parent,
            error,
        )
        return error


# --------------------------------------------------------------------------- verify


def verify_backend(backend: Backend, entry: Entry) -> Verification:
    """Probe ``backend`` (or reuse the cached result); raise if a probe failed.

    Raises :class:`vt.BackendVerificationError` naming each failing probe and the VT_CAPS
    workaround. The caller owns ``backend`` either way.
    """
    from .audit import probe_backend

    identity = identify(backend, entry)
    path = verified_dir() / f"{identity.key()}.json"
    record = _load(path, identity)
    if record is not None:
        verification = Verification(status="cached", record=record, path=path)
    else:
        start = time.perf_counter()
        checks = probe_backend(backend)
        record = VerificationRecord(
            identity=identity,
            checks=checks,
            seconds=round(time.perf_counter() - start, 4),
            verified_at=datetime.now(timezone.utc),
        )
        error = _store(path, record)
        verification = Verification(status="verified", record=record, path=path, cache_error=error)
    if not record.ok:
        raise _refusal(entry.name, entry, backend.capabilities, verification)
    return verification


def open_verified_backend(
    name: str | None = None, *, verify: bool | None = None, registry: Registry | None = None
) -> OpenedBackend:
    """Create the backend ``name`` selects (None: ``VT_BACKEND``, else auto) and verify it.

    ``verify=None`` follows ``VT_VERIFY`` (default on); False skips the probes. Raises
    :class:`vt.BackendUnavailableError` when the backend cannot be used, and its subclass
    :class:`vt.BackendVerificationError` when a probe disproved a declared capability.
    """
    from . import registry as default

    # The module's functions (the process-wide registry) unless one is given: tests wrap
    # vt.management.registry.create_backend to watch what vt creates.
    source: Any = default if registry is None else registry
    reason = "verify=False"
    if verify is None:
        verify, reason = envs.bool_with_reason("VT_VERIFY")  # reason: "VT_VERIFY=0"
    entry, why = source.select(name)
    backend, _ = source.create_backend(entry.name)
    if not verify:
        return OpenedBackend(backend, why, Verification.skipped(reason))
    try:
        verification = verify_backend(backend, entry)
    except BaseException:
        backend.close()
        raise
    return OpenedBackend(backend, why, verification)
