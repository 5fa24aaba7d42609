"""Audit: rule checks, probes that prove (or catch) declared capabilities, and the report."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from vt import VmmCaps
from vt.management.audit import (
    PROBES,
    BackendAudit,
    Check,
    audit,
    probe_async_d2h,
    probe_backend,
    probe_events,
    probe_graphs,
    probe_host_view,
    probe_pinned,
    probe_readback,
    probe_vmm,
)
from vt.management.registry import Registry


def _load_backends():
    path = Path(__file__).parent / "plugins" / "vt_test_backends.py"
    spec = importlib.util.spec_from_file_location("vt_test_backends_direct", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


tb = _load_backends()


def started(cls, **changes):
    backend = cls()
    caps = backend.capabilities
    for field, value in changes.items():
        caps = caps.model_copy(update={field: value})
    backend.capabilities = caps
    return backend


def results(checks: list[Check]) -> dict[str, str]:
    return {c.id: c.result for c in checks}


def test_every_declared_capability_of_an_honest_backend_is_proven() -> None:
    checks = probe_backend(started(tb.ThreadBackend))
    assert all(c.kind == "probe" for c in checks)
    failed = [c for c in checks if c.result != "pass"]
    assert failed == []
    got = results(checks)
    for probe_id in (
        "memory-roundtrip",
        "host-view-roundtrip",
        "pinned-host-memory",
        "event-ordering",
        "stream-wait-event",
        "async-d2h-copy",
        "async-readback",
        "sync-readback",
        "vmm-segments-distinct",
        "graph-replay",
    ):
        assert got[probe_id] == "pass", probe_id
    by_id = {c.id: c.detail for c in checks}
    assert "pending right after record_event" in by_id["event-ordering"]
    assert "still poisoned before the ready event" in by_id["async-d2h-copy"]


def test_a_discrete_backend_proves_refusal_and_skips_what_it_does_not_declare() -> None:
    checks = probe_backend(started(tb.DiscreteBackend))
    got = results(checks)
    assert got["host-view-refused"] == "pass"
    assert got["sync-readback"] == "pass" and got["memory-roundtrip"] == "pass"
    for skipped in ("event-ordering", "pinned-host-memory", "async-d2h-copy", "async-readback"):
        assert got[skipped] == "skip"
    assert all(c.detail for c in checks if c.result == "skip")
    assert "not declared" in {c.id: c.detail for c in checks}["vmm"]


def test_a_synchronous_backend_with_honest_events_passes_and_says_what_it_saw() -> None:
    checks = probe_backend(started(tb.SyncEventsBackend))
    assert [c for c in checks if c.result == "fail"] == []
    detail = {c.id: c.detail for c in checks}
    assert "pending state was never observable" in detail["event-ordering"]
    assert "finished too fast" in detail["async-d2h-copy"]
    assert "side stream" in detail["async-readback"]


def test_events_that_complete_at_once_are_caught() -> None:
    backend = started(tb.FakeEventsBackend)
    got = results(probe_events(backend))
    assert got == {"event-ordering": "fail", "stream-wait-event": "fail"}
    assert results(probe_async_d2h(backend)) == {"async-d2h-copy": "fail"}
    assert results(probe_readback(backend))["async-readback"] == "fail"


def test_graph_replay_is_proven_and_undeclared_graphs_are_skipped() -> None:
    (check,) = probe_graphs(started(tb.ThreadBackend))
    assert (check.id, check.result) == ("graph-replay", "pass")
    assert "did not run at capture" in check.detail and "when they ran" in check.detail
    (check,) = probe_graphs(started(tb.ThreadBackend, graphs=False))
    assert (check.result, check.detail) == (
        "skip",
        "graphs not declared: the runner launches every kernel",
    )


def test_work_that_runs_at_capture_is_caught() -> None:
    (check,) = probe_graphs(started(tb.EagerGraphBackend))
    assert check.result == "fail"
    assert "ran at capture" in check.detail and "must only be recorded" in check.detail


def test_a_replay_of_the_captured_contents_is_caught() -> None:
    (check,) = probe_graphs(started(tb.StaleGraphBackend))
    assert check.result == "fail"
    assert check.detail.startswith("replay 1 is wrong")
    assert "copied the source as it was at capture" in check.detail


def test_host_view_that_should_raise_but_does_not_is_caught() -> None:
    (check,) = probe_host_view(started(tb.LeakyDiscreteBackend))
    assert (check.id, check.result) == ("host-view-refused", "fail")
    assert "must raise vt.HostAccessError" in check.detail


def test_declaring_host_addressable_memory_that_host_view_refuses_is_caught() -> None:
    backend = started(
        tb.DiscreteBackend, unified_memory=True, device_memory_is_host_addressable=True
    )
    (check,) = probe_host_view(backend)
    assert (check.id, check.result) == ("host-view-roundtrip", "fail")
    assert "HostAccessError" in check.detail


def test_pageable_memory_declared_pinned_is_caught() -> None:
    (check,) = probe_pinned(started(tb.FakePinnedBackend))
    assert check.result == "fail" and "pinned=False" in check.detail


def test_a_probe_that_raises_is_one_failed_check(monkeypatch) -> None:
    def boom(backend):
        raise RuntimeError("probe crashed")

    monkeypatch.setattr("vt.management.audit.PROBES", (boom, *PROBES[:1]))
    checks = probe_backend(started(tb.DiscreteBackend))
    assert (checks[0].id, checks[0].result) == ("boom", "fail")
    assert "RuntimeError: probe crashed" in checks[0].detail
    assert checks[1].result == "pass"


@pytest.mark.parametrize("alias", [False, True])
def test_vmm_probe(alias: bool) -> None:
    backend = started(tb.ThreadBackend, vmm=VmmCaps(granularity=64 << 10, segments_may_alias=alias))
    checks = {c.id: c for c in probe_vmm(backend)}
    assert all(c.result == "pass" for c in checks.values()), checks
    distinct = checks["vmm-segments-distinct"].detail
    assert ("one segment covers" if alias else "two segments") in distinct


def test_vmm_probe_catches_a_granularity_mismatch() -> None:
    backend = started(tb.ThreadBackend, vmm=VmmCaps(granularity=4096))
    check = probe_vmm(backend)[0]
    assert check.id == "vmm-granularity"
    assert check.result == "fail" and "declared vmm granularity 4096" in check.detail


def test_zero_executed_checks_is_not_ok() -> None:
    skipped = Check(id="x", kind="probe", result="skip", detail="could not run")
    assert not BackendAudit(name="b", status="available", checks=[skipped]).ok
    assert BackendAudit(
        name="b",
        status="available",
        checks=[skipped, skipped.model_copy(update={"result": "pass"})],
    ).ok


@pytest.fixture
def reg(install_dist) -> Registry:
    install_dist("vt-test-backends", {"threads_plugin": "vt_test_backends"})
    install_dist("vt-misc", {"misc": "vt_test_misc"})
    install_dist("vt-rule-breaker", {"rule_breaker": "vt_test_rule_breaker"})
    install_dist("vt-import-error", {"import_error": "vt_test_import_error"})
    return Registry(env={"VT_PLUGINS": "threads_plugin,misc"})


def test_audit_by_name_passes_for_honest_backends(reg: Registry) -> None:
    for name in ("threads", "discrete"):
        report = audit(name, reg)
        assert report.ok, report.model_dump_json(indent=1)
        (b,) = report.backends
        assert b.name == name and b.status == "available"
        kinds = {c.kind for c in b.checks}
        assert kinds == {"rule", "probe"}
        assert {c.id for c in b.checks if c.kind == "rule"} >= {"async-readback-needs-events"}


def test_audit_by_name_of_an_unavailable_backend_fails_with_its_reason(reg: Registry) -> None:
    report = audit("absent", reg)
    assert not report.ok
    available = next(c for c in report.backends[0].checks if c.id == "available")
    assert available.result == "fail"
    assert "unavailable: no absent device found" in available.detail


def test_audit_of_everything_skips_unavailable_but_fails_broken(reg: Registry) -> None:
    report = audit(None, reg)
    by_name = {b.name: b for b in report.backends}
    assert by_name["threads"].ok and by_name["discrete"].ok
    assert by_name["absent"].ok  # rules ran and passed; probes skipped, reason shown
    assert results(by_name["absent"].checks)["available"] == "skip"
    assert not by_name["flaky"].ok and by_name["flaky"].status == "broken"
    assert not report.ok


def test_audit_of_rejected_and_broken_plugins(install_dist, reg: Registry) -> None:
    reg = Registry(env={"VT_PLUGINS": "rule_breaker,import_error"})
    report = audit(None, reg)
    by_name = {b.name: b for b in report.backends}
    hasty = results(by_name["hasty"].checks)
    assert hasty["async-readback-needs-events"] == "fail" and hasty["available"] == "fail"
    assert hasty["probes"] == "skip"
    assert results(by_name["import_error"].checks) == {
        "rules": "skip",
        "available": "fail",
        "probes": "skip",
    }
    assert not report.ok


def test_audit_of_an_unknown_name_fails(reg: Registry) -> None:
    report = audit("nope", reg)
    assert not report.ok
    assert "unknown backend 'nope'" in report.backends[0].checks[0].detail


def test_audit_auto_audits_the_auto_pick(reg: Registry) -> None:
    report = audit("auto", reg)
    assert [b.name for b in report.backends] == ["threads"] and report.ok


def test_audit_runs_probes_with_effective_capabilities(install_dist) -> None:
    install_dist("vt-test-backends", {"threads_plugin": "vt_test_backends"})
    reg = Registry(
        env={"VT_PLUGINS": "threads_plugin", "VT_CAPS": "threads:events=0,threads:async_readback=0"}
    )
    (b,) = audit("threads", reg).backends
    got = results(b.checks)
    assert got["event-ordering"] == "skip" and got["async-readback"] == "skip"
    assert got["async-d2h-copy"] == "pass"  # fenced by synchronize instead of an event
    assert b.ok
