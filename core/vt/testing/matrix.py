"""The kit's results as a support matrix per backend: op x dtype, capability, model.

``vt audit --matrix`` runs the kit in-process (:func:`run_matrix`); ``pytest --vt-backend
NAME --vt-matrix PATH`` builds the same matrix from the pytest run
(:func:`matrix_from_results`). ``docs/support-matrix.md`` is the Markdown rendering.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from ..management.registry import Registry, Status, default_registry
from .kit import CATEGORIES, KitCase

Result = Literal["pass", "fail", "not declared"]

#: Capability fields in the order the matrix lists them, with the contracts that prove them.
CAPABILITY_CONTRACTS: dict[str, tuple[str, ...]] = {
    "device_memory_is_host_addressable": ("host-view",),
    "pinned_host_memory": ("pinned-host-memory",),
    "events": ("event-ordering", "stream-wait-event"),
    "async_d2h_copy": ("async-d2h-readback",),
    "supports_async_sampled_token_readback": ("async-readback",),
    "vmm": ("vmm-arena",),
    "graphs": ("graph-replay",),
}


class CaseResult(BaseModel):
    """One kit case's outcome on one backend."""

    backend: str
    category: str
    unit: str
    label: str
    dtype: str
    capability: str | None
    result: Result
    detail: str = ""

    @classmethod
    def of(cls, backend: str, case: KitCase, result: Result, detail: str) -> CaseResult:
        return cls(
            backend=backend,
            category=case.category,
            unit=case.unit,
            label=case.label,
            dtype=case.dtype,
            capability=case.capability,
            result=result,
            detail=detail,
        )


def _combine(results: list[Result]) -> Result:
    if "fail" in results:
        return "fail"
    return "not declared" if results and all(r == "not declared" for r in results) else "pass"


@dataclass
class Summary:
    """Per-unit outcomes of one backend: a unit fails if any of its cases failed."""

    units: dict[str, dict[str, Result]] = field(default_factory=dict)  # category -> unit
    extra_failed: int = 0

    def count(self, category: str, result: Result) -> int:
        return sum(1 for r in self.units.get(category, {}).values() if r == result)

    @property
    def failed(self) -> int:
        return sum(self.count(c, "fail") for c in CATEGORIES) + self.extra_failed

    def line(self, name: str) -> str:
        o, k, c, m = (self.count(cat, "pass") for cat in CATEGORIES)
        return (
            f"vt conformance [{name}]: {o} ops, {k} core methods, {c} contracts, {m} models "
            f"passed ({self.failed} failed)"
        )

    def details(self) -> list[str]:
        lines = []
        failed = [
            f"{cat} {unit}"
            for cat in CATEGORIES
            for unit, r in self.units.get(cat, {}).items()
            if r == "fail"
        ]
        if failed:
            lines.append("failed: " + ", ".join(failed))
        undeclared = [
            f"{cat} {unit}"
            for cat in CATEGORIES
            for unit, r in self.units.get(cat, {}).items()
            if r == "not declared"
        ]
        if undeclared:
            lines.append("not declared: " + ", ".join(undeclared))
        return lines


def summarize(results: list[CaseResult], extra_failed: int = 0) -> Summary:
    grouped: dict[str, dict[str, list[Result]]] = {}
    for r in results:
        grouped.setdefault(r.category, {}).setdefault(r.unit, []).append(r.result)
    units = {cat: {u: _combine(rs) for u, rs in by.items()} for cat, by in grouped.items()}
    return Summary(units, extra_failed)


class BackendMatrix(BaseModel):
    name: str
    tested: bool
    reason: str = ""  # why it was not tested
    capabilities: dict[str, object] = {}
    ops: dict[str, str] = {}  # op -> native, decomposed, fallback or not declared
    results: list[CaseResult] = []

    @property
    def ok(self) -> bool:
        return self.tested and bool(self.results) and summarize(self.results).failed == 0


class SupportMatrix(BaseModel):
    command: str
    backends: list[BackendMatrix]
    ok: bool

    def render(self, markdown: bool = True) -> str:
        if not markdown:
            return self.model_dump_json(indent=2) + "\n"
        from .matrix_markdown import render_markdown

        return render_markdown(self)


def matrix_from_results(
    names: list[str],
    results: list[CaseResult],
    command: str,
    capabilities: dict[str, dict[str, object]],
    not_started: dict[str, str],
    ops: dict[str, dict[str, str]] | None = None,
) -> SupportMatrix:
    """A matrix from cases already run (the pytest plugin's results)."""
    backends = [
        BackendMatrix(name=n, tested=False, reason=not_started[n])
        if n in not_started
        else BackendMatrix(
            name=n,
            tested=True,
            capabilities=capabilities.get(n, {}),
            ops=(ops or {}).get(n, {}),
            results=[r for r in results if r.backend == n],
        )
        for n in names
    ]
    return SupportMatrix(command=command, backends=backends, ok=all(b.ok for b in backends))


def run_backend(name: str, registry: Registry) -> BackendMatrix:
    """Run every kit case on backend ``name`` in this process."""
    from ..errors import VtError
    from .kernels_suite import op_support
    from .kit import KitContext, KitFailure, NotDeclared, Shared, all_cases, run_case

    shared = Shared()
    try:
        try:
            ctx = KitContext.start(name, shared, registry)
        except VtError as exc:
            return BackendMatrix(name=name, tested=False, reason=str(exc))
        results = []
        try:
            caps = ctx.backend.capabilities.summary()
            ops = op_support(ctx.backend)
            for case in all_cases():
                try:
                    results.append(CaseResult.of(name, case, "pass", run_case(case, ctx)))
                except NotDeclared as exc:
                    results.append(CaseResult.of(name, case, "not declared", str(exc)))
                except KitFailure as exc:
                    results.append(CaseResult.of(name, case, "fail", str(exc)))
                except Exception as exc:
                    detail = f"{case.title}: {type(exc).__name__}: {exc}"
                    results.append(CaseResult.of(name, case, "fail", detail))
        finally:
            ctx.close()
        return BackendMatrix(name=name, tested=True, capabilities=caps, ops=ops, results=results)
    finally:
        shared.close()


def run_matrix(
    names: list[str] | None, registry: Registry | None = None, command: str = ""
) -> SupportMatrix:
    """The matrix of the named backends, or of every installed one (``None``).

    A named backend that cannot be started fails the matrix; without names, backends that
    are not available are listed with their reason and do not.
    """
    registry = registry or default_registry()
    if names is None:
        entries = registry.entries()
        names = list(dict.fromkeys(e.name for e in entries))
        # Like `vt audit`: missing hardware is not a failure, a broken or rejected plugin is.
        required = {e.name for e in entries if e.status is not Status.unavailable}
    else:
        required = set(names)
    backends = [run_backend(n, registry) for n in names]
    ok = any(b.tested for b in backends) and all(
        b.ok for b in backends if b.name in required or b.tested
    )
    return SupportMatrix(command=command, backends=backends, ok=ok)


def matrix_command(backend: str | None, as_json: bool) -> int:
    """``vt audit --matrix [--backend NAME[,NAME]] [--json]``: print; the exit status."""
    names = [n.strip() for n in backend.split(",") if n.strip()] if backend else None
    command = "vt audit --matrix" + (f" --backend {','.join(names)}" if names else "")
    matrix = run_matrix(names, command=command)
    sys.stdout.write(matrix.render(markdown=not as_json))
    return 0 if matrix.ok else 1
