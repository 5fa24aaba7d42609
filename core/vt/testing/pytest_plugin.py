"""The conformance kit as a pytest plugin: ``pytest --vt-backend NAME``.

Installed with vt (entry point ``pytest11``), so a backend's own CI runs the kit with
nothing copied. Without ``--vt-backend`` the plugin adds nothing to a test run.

For each named backend the kit adds one test per op case (every op of ``vt.OPS`` on its
shapes and weight types), core-method case (``upload_weight``, ``copy_d2d``), capability
contract and tiny model, under ``vt-conformance[NAME]::ops|core|contracts|models::...``,
plus a final ``executed`` test that fails when nothing was proven. A backend that cannot be
started (unknown, unavailable, rejected, broken) fails every one of its tests at setup with
the registry's recorded reason; a contract whose capability is not declared, or a primitive
op the backend does not support, is reported as skipped "not declared", never as a pass (a
fused op it does not support runs as its decomposition). The terminal summary says, per
backend, ``vt conformance [NAME]: O ops, K core methods, C contracts, M models passed (F
failed)``.
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .kit import KitCase, KitContext, Shared
    from .matrix import CaseResult

_CATEGORY_NODES = {"op": "ops", "core": "core", "contract": "contracts", "model": "models"}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vt", "vt backend conformance kit")
    group.addoption(
        "--vt-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="Run vt's conformance kit against backend NAME (repeatable, or a comma list). "
        "A name that is not available fails every kit test with the registry's reason.",
    )
    group.addoption(
        "--vt-matrix",
        default=None,
        metavar="PATH",
        help="Also write the kit's results as a support matrix: Markdown if PATH ends in "
        ".md, else JSON.",
    )


def backend_names(config: pytest.Config) -> list[str]:
    """The backends ``--vt-backend`` names, in order, without duplicates."""
    names: list[str] = []
    for value in config.getoption("vt_backend") or []:
        for name in value.split(","):
            if name.strip() and name.strip() not in names:
                names.append(name.strip())
    return names


def pytest_configure(config: pytest.Config) -> None:
    names = backend_names(config)
    if not names:
        if config.getoption("vt_matrix"):
            raise pytest.UsageError("--vt-matrix needs --vt-backend NAME: which backend?")
        return
    config.addinivalue_line("markers", "vt_conformance: a test of vt's backend conformance kit")
    config.pluginmanager.register(KitPlugin(config, names), "vt-conformance-kit")


class KitPlugin:
    """Adds the kit's tests for each backend and reports per backend."""

    def __init__(self, config: pytest.Config, names: list[str]) -> None:
        from .kit import Shared

        self.config = config
        self.names = names
        self.shared: Shared = Shared()
        self.collected: dict[str, Counter[str]] = {}
        self.items: dict[str, KitItem] = {}  # by nodeid
        self.guards = {f"vt-conformance[{n}]::executed" for n in names}
        self.outcome: dict[str, str] = {}  # nodeid -> passed / failed / skipped
        self.message: dict[str, str] = {}
        self.not_started: dict[str, str] = {}  # backend -> the registry's reason
        self.capabilities: dict[str, dict[str, object]] = {}  # effective, per started backend
        self.ops: dict[str, dict[str, str]] = {}  # how each started backend runs each op

    # ---- collection
    @pytest.hookimpl(tryfirst=True)  # before -k / -m deselect, so they apply to the kit
    def pytest_collection_modifyitems(
        self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        for name in self.names:
            label = f"vt-conformance[{name}]"
            node = BackendNode.from_parent(session, name=label, nodeid=label, backend=name)
            for item in session.genitems(node):
                items.append(item)
                if isinstance(item, KitItem):
                    self.items[item.nodeid] = item

    # ---- results
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self.items and report.nodeid not in self.guards:
            return
        if report.failed:
            self.outcome[report.nodeid] = "failed"
            self.message.setdefault(report.nodeid, _first_line(report))
        elif report.skipped:
            self.outcome.setdefault(report.nodeid, "skipped")
            self.message.setdefault(report.nodeid, _skip_reason(report))
        elif report.when == "call":
            self.outcome.setdefault(report.nodeid, "passed")
            detail = dict(report.user_properties).get("vt_detail", "")
            self.message.setdefault(report.nodeid, str(detail))

    def executed(self, backend: str) -> int:
        """Kit tests of ``backend`` whose body ran (passed or failed in the call phase)."""
        return sum(
            1
            for nodeid, item in self.items.items()
            if item.backend == backend and self.outcome.get(nodeid) in ("passed", "failed")
        )

    def results(self) -> list[CaseResult]:
        from .matrix import CaseResult

        out = []
        for nodeid, item in self.items.items():
            if nodeid not in self.outcome:
                continue  # deselected or not run
            result = {"passed": "pass", "failed": "fail", "skipped": "not declared"}
            out.append(
                CaseResult.of(item.backend, item.case, result[self.outcome[nodeid]],
                              self.message.get(nodeid, ""))
            )  # fmt: skip
        return out

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        from .matrix import summarize

        results = self.results()
        if not self.outcome:  # --collect-only, or everything deselected
            return
        tr = terminalreporter
        tr.section("vt conformance kit")
        for name in self.names:
            guard = f"vt-conformance[{name}]::executed"
            extra = 1 if self.outcome.get(guard) == "failed" else 0
            summary = summarize([r for r in results if r.backend == name], extra_failed=extra)
            tr.write_line(summary.line(name))
            if name in self.not_started:
                tr.write_line(f"  not started: {self.not_started[name]}")
                continue
            for line in summary.details():
                tr.write_line(f"  {line}")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        path = self.config.getoption("vt_matrix")
        if path:
            from .matrix import matrix_from_results

            command = f"pytest --vt-backend {','.join(self.names)}"
            matrix = matrix_from_results(
                self.names, self.results(), command, self.capabilities, self.not_started, self.ops
            )
            Path(path).write_text(matrix.render(Path(path).suffix == ".md"))

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.shared.close()


def _first_line(report: pytest.TestReport) -> str:
    """The kit's one-line message (its reports lead with it), else pytest's last E line."""
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    line = errors[-1] if errors else lines[0] if lines else "failed"
    return line.split("]: ", 1)[1] if line.startswith("vt conformance [") else line


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


class BackendNode(pytest.Collector):
    """One backend's kit tests; starting the backend is this node's setup."""

    def __init__(self, *, backend: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.backend = backend
        self.ctx: KitContext | None = None
        self.add_marker("vt_conformance")

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        from .kit import all_cases

        by_category: dict[str, list[KitCase]] = {}
        for case in all_cases():
            by_category.setdefault(case.category, []).append(case)
        plugin = _plugin(self.config)
        plugin.collected[self.backend] = Counter({k: len(v) for k, v in by_category.items()})
        nodes: list[pytest.Item | pytest.Collector] = [
            CategoryNode.from_parent(self, name=label, cases=by_category.get(cat, []))
            for cat, label in _CATEGORY_NODES.items()
        ]
        nodes.append(ExecutedItem.from_parent(self, name="executed"))
        return nodes

    def setup(self) -> None:
        from ..errors import VtError
        from .kernels_suite import op_support
        from .kit import KitContext

        try:
            plugin = _plugin(self.config)
            self.ctx = KitContext.start(self.backend, plugin.shared)
            plugin.capabilities[self.backend] = self.ctx.backend.capabilities.summary()
            plugin.ops[self.backend] = op_support(self.ctx.backend)
            return
        except VtError as exc:
            reason = str(exc)
        # Outside the except block, so the report shows the reason alone, not a chain.
        _plugin(self.config).not_started[self.backend] = reason
        pytest.fail(f"vt conformance [{self.backend}]: {reason}", pytrace=False)

    def teardown(self) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx is not None:
            ctx.close()


class CategoryNode(pytest.Collector):
    def __init__(self, *, cases: list[KitCase], **kw: Any) -> None:
        super().__init__(**kw)
        self.cases = cases

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        return [KitItem.from_parent(self, name=c.id, case=c) for c in self.cases]


class KitItem(pytest.Item):
    """One kit case against the parent backend."""

    def __init__(self, *, case: KitCase, **kw: Any) -> None:
        super().__init__(**kw)
        self.case = case
        self.backend = self.getparent(BackendNode).backend  # type: ignore[union-attr]

    def runtest(self) -> None:
        from .kit import KitFailure, NotDeclared, run_case

        node = self.getparent(BackendNode)
        assert node is not None and node.ctx is not None
        try:
            detail = run_case(self.case, node.ctx)
        except NotDeclared as exc:
            pytest.skip(f"vt conformance [{self.backend}] {self.case.title}: {exc}")
        except KitFailure:
            raise
        except Exception as exc:
            # The backend raised: name the case, keep the frames from the kit down (the
            # traceback starts here, so pytest's own frames are not in it).
            frames = traceback.format_list(traceback.extract_tb(exc.__traceback__)[1:][-8:])
            raise KitFailure(
                f"{self.case.title}: {type(exc).__name__}: {exc}\n" + "".join(frames).rstrip()
            ) from exc
        self.user_properties.append(("vt_detail", detail))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        from .kit import KitFailure

        if isinstance(excinfo.value, KitFailure):
            return f"vt conformance [{self.backend}]: {excinfo.value}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"vt conformance [{self.backend}] {self.case.title}"


class ExecutedItem(pytest.Item):
    """Fails when the kit proved nothing for the backend: a test that executed nothing."""

    def runtest(self) -> None:
        node = self.getparent(BackendNode)
        assert node is not None
        plugin = _plugin(self.config)
        name = node.backend
        collected = plugin.collected.get(name, Counter())
        for category, label in _CATEGORY_NODES.items():
            if not collected[category]:
                raise _Nothing(f"vt conformance [{name}]: zero {label} collected for the backend")
        if not plugin.executed(name):
            raise _Nothing(
                f"vt conformance [{name}]: no kit test executed for the backend (all "
                "deselected or skipped); a run that proves nothing fails"
            )

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, _Nothing):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        backend = self.getparent(BackendNode).backend  # type: ignore[union-attr]
        return self.path, None, f"vt conformance [{backend}] executed something"


class _Nothing(AssertionError):
    pass


def _plugin(config: pytest.Config) -> KitPlugin:
    plugin = config.pluginmanager.get_plugin("vt-conformance-kit")
    assert isinstance(plugin, KitPlugin)
    return plugin
