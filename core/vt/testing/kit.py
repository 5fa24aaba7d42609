"""The conformance kit's cases and the context they run in, independent of pytest.

A :class:`KitCase` is one check of one backend: an op of :data:`vt.protocol.ops.OPS` (or a core
method that computes on data: ``upload_weight``, ``copy_d2d``) on one shape and dtype, one
capability contract, or one tiny model end to end. The pytest plugin
(:mod:`vt.testing.pytest_plugin`) turns each case into a test item; ``vt audit --matrix``
(:mod:`vt.testing.matrix`) runs them directly. A case that executes no check fails.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..management.registry import Registry, default_registry
from ..protocol.backend import Backend, Stream
from ..protocol.ops import OPS

Category = Literal["op", "core", "contract", "model"]
CATEGORIES: tuple[Category, ...] = ("op", "core", "contract", "model")

#: Core methods (not ops) that the kit checks against the reference like ops.
CORE_METHODS: tuple[str, ...] = ("upload_weight", "copy_d2d")


class KitFailure(AssertionError):
    """A backend broke an op's or a contract's expectation; the message names which."""


class NotDeclared(Exception):  # noqa: N818 - an outcome, like pytest's Skipped
    """The backend does not declare what a case proves: a capability, or an op."""


@dataclass(frozen=True)
class KitCase:
    """One conformance check. ``run`` returns a one-line detail, or raises KitFailure."""

    category: Category
    unit: str  # the op or core method, contract id or model id the case belongs to
    label: str  # the case's parameters ("" when the unit has one case)
    dtype: str  # weight type ("F32" for ops on activations only; "" for contracts)
    run: Callable[[KitContext], str] = field(repr=False, compare=False)
    capability: str | None = None  # contracts: the capability that must be declared

    @property
    def id(self) -> str:
        return f"{self.unit}[{self.label}]" if self.label else self.unit

    @property
    def title(self) -> str:
        return f"{self.category} {self.id}"


class Shared:
    """What every backend's run shares: tiny model files and reference results."""

    def __init__(self, root: Path | None = None) -> None:
        self._own = root is None
        self.root = Path(tempfile.mkdtemp(prefix="vt-kit-")) if root is None else Path(root)
        self.cache: dict[Any, Any] = {}

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def close(self) -> None:
        for value in self.cache.values():
            for item in value if isinstance(value, tuple) else (value,):
                close = getattr(item, "close", None)
                if callable(close):
                    close()
        self.cache.clear()
        if self._own:
            shutil.rmtree(self.root, ignore_errors=True)


class KitContext:
    """A started backend under test, its stream, and the count of checks executed."""

    def __init__(self, name: str, backend: Backend, shared: Shared) -> None:
        self.name = name
        self.backend = backend
        self.shared = shared
        self.executed = 0
        self._probes: dict[str, Any] = {}
        self.stream: Stream = backend.create_stream("vt-kit")

    @classmethod
    def start(cls, name: str, shared: Shared, registry: Registry | None = None) -> KitContext:
        """Create backend ``name``; raises :class:`vt.BackendUnavailableError` with the
        registry's recorded reason when it cannot be used."""
        backend, _ = (registry or default_registry()).create_backend(name)
        try:
            return cls(name, backend, shared)
        except BaseException:
            backend.close()
            raise

    def count(self, n: int = 1) -> None:
        """Record ``n`` executed comparisons or checks."""
        self.executed += n

    def probe(self, key: str, run: Callable[[], Any]) -> Any:
        """Run an expensive probe once per backend (several contracts read its checks)."""
        if key not in self._probes:
            self._probes[key] = run()
        return self._probes[key]

    def close(self) -> None:
        try:
            self.backend.synchronize(self.stream)
            self.backend.destroy_stream(self.stream)
        finally:
            self.backend.close()


def run_case(case: KitCase, ctx: KitContext) -> str:
    """Run one case; a case that executed no check is a failure."""
    before = ctx.executed
    detail = case.run(ctx)
    if ctx.executed == before:
        raise KitFailure(f"{case.title}: executed no check; a test that executes nothing fails")
    return detail


def _no_cases(category: Category, unit: str, where: str) -> KitCase:
    def run(ctx: KitContext) -> str:
        raise KitFailure(
            f"{category} {unit}: {where} lists it but the conformance kit has no case for it, "
            "so nothing would prove it"
        )

    return KitCase(category, unit, "no-cases", "", run)


def all_cases() -> list[KitCase]:
    """Every case, in run order: ops, core methods, contracts, models. Every op of
    :data:`vt.protocol.ops.OPS` and every core method has cases; one without fails by name."""
    from .contracts_suite import contract_cases
    from .e2e_suite import model_cases
    from .kernels_suite import op_cases

    cases = op_cases()
    covered = {(c.category, c.unit) for c in cases}
    ops = [c for c in cases if c.category == "op"]
    ops += [_no_cases("op", op, "vt.OPS") for op in OPS if ("op", op) not in covered]
    core = [c for c in cases if c.category == "core"]
    core += [
        _no_cases("core", m, "vt.testing.kit.CORE_METHODS")
        for m in CORE_METHODS
        if ("core", m) not in covered
    ]
    return ops + core + contract_cases() + model_cases()
