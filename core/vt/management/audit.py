"""Prove declared capabilities: static rule checks plus runtime probes on a real instance.

The probes themselves are in :mod:`vt.management.probes` (re-exported here, so
``vt.management.audit.probe_events``
and friends keep working); this module runs them with the rule checks, per backend, into an
:class:`AuditReport`. An audit in which nothing ran fails.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from pydantic import BaseModel, computed_field

from ..protocol.backend import Backend
from ..protocol.ops import op_plan
from .probes import (
    Check,
    Kind,
    ProbeFailed,
    Result,
    probe_async_d2h,
    probe_events,
    probe_graphs,
    probe_host_view,
    probe_memory,
    probe_pinned,
    probe_readback,
    probe_vmm,
    run_checks,
    run_probe,
)
from .probes.base import check
from .registry import Entry, Registry, Status, default_registry
from .rules import RULES

__all__ = [
    "PROBES",
    "AuditReport",
    "BackendAudit",
    "Check",
    "Kind",
    "ProbeFailed",
    "Result",
    "audit",
    "audit_entry",
    "probe_async_d2h",
    "probe_backend",
    "probe_events",
    "probe_graphs",
    "probe_host_view",
    "probe_memory",
    "probe_pinned",
    "probe_readback",
    "probe_vmm",
    "rule_checks",
    "run_checks",
    "run_probe",
]


class BackendAudit(BaseModel):
    name: str
    status: str
    checks: list[Check]
    #: How each op of vt.OPS runs: native, decomposed or missing (empty if never loaded).
    ops: dict[str, str] = {}

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        """Every executed check passed, and at least one ran."""
        ran = [c for c in self.checks if c.result != "skip"]
        return bool(ran) and all(c.result == "pass" for c in ran)


class AuditReport(BaseModel):
    backends: list[BackendAudit]
    ok: bool


#: Every probe, in the order the audit runs them.
PROBES: tuple[Callable[[Backend], list[Check]], ...] = (
    probe_memory,
    probe_host_view,
    probe_pinned,
    probe_events,
    probe_async_d2h,
    probe_readback,
    probe_vmm,
    probe_graphs,
)


def probe_backend(backend: Backend) -> list[Check]:
    """Run every probe on a started backend; a probe that raises is one failed check."""
    checks: list[Check] = []
    for probe in PROBES:
        name = probe.__name__.removeprefix("probe_").replace("_", "-")
        checks.extend(run_checks(name, partial(probe, backend)))
    return checks


# --------------------------------------------------------------------------- audit


def rule_checks(entry: Entry) -> list[Check]:
    """One check per rule, from the violations the registry recorded."""
    if entry.capabilities is None:  # broken before declaring anything
        return [check("rules", "skip", "no capabilities to check", kind="rule")]
    checks = []
    for rule in RULES:
        hits = [v.message for v in entry.violations if v.rule == rule.id]
        if hits:
            checks.append(check(rule.id, "fail", "; ".join(hits), kind="rule"))
        else:
            checks.append(check(rule.id, "pass", rule.why, kind="rule"))
    return checks


def audit_entry(registry: Registry, entry: Entry, *, named: bool = False) -> BackendAudit:
    """Audit one discovered backend. ``named``: asked for by name, so unavailable fails."""
    checks = rule_checks(entry)
    status = entry.status
    ops = op_plan(set(entry.ops).__contains__) if entry.backend_class is not None else {}
    if status is Status.available:
        checks.append(check("available", "pass", entry.reason or entry.device or "probe found it"))
    elif status is Status.unavailable and not named:
        checks.append(check("available", "skip", f"unavailable: {entry.reason}"))
    else:
        checks.append(check("available", "fail", f"{status.value}: {entry.reason}"))
    if status is Status.available:
        try:
            backend, _ = registry.create_backend(entry.name)
        except Exception as exc:
            checks.append(check("start", "fail", f"{type(exc).__name__}: {exc}"))
        else:
            try:
                ops = op_plan(backend.supports)
                checks.extend(probe_backend(backend))
            finally:
                backend.close()
    else:
        checks.append(check("probes", "skip", f"not run: the backend is {status.value}"))
    audit = BackendAudit(name=entry.name, status=status.value, checks=checks, ops=ops)
    if not any(c.result != "skip" for c in checks):
        audit.checks.append(check("executed-checks", "fail", "no check could run"))
    return audit


def audit(name: str | None = None, registry: Registry | None = None) -> AuditReport:
    """Audit every discovered backend, or the one named (``"auto"``: the auto pick)."""
    registry = registry or default_registry()
    if name is None:
        entries = registry.entries()
        audits = [audit_entry(registry, e) for e in entries]
    else:
        if name == "auto":
            try:
                name = registry.select("auto")[0].name
            except Exception as exc:
                audits = [
                    BackendAudit(
                        name="auto",
                        status="unavailable",
                        checks=[check("available", "fail", str(exc))],
                    )
                ]
                return AuditReport(backends=audits, ok=False)
        matches = [e for e in registry.entries() if e.name == name]
        if not matches:
            known = ", ".join(sorted({e.name for e in registry.entries()})) or "none"
            detail = f"unknown backend {name!r}; installed backends: {known}"
            audits = [
                BackendAudit(
                    name=name,
                    status="unknown",
                    checks=[check("available", "fail", detail)],
                )
            ]
        else:
            audits = [audit_entry(registry, e, named=True) for e in matches]
    ok = bool(audits) and all(a.ok for a in audits)
    return AuditReport(backends=audits, ok=ok)
