"""Each consistency rule on minimal backend classes."""

from __future__ import annotations

import numpy as np
import pytest
import vt
from vt import Capabilities, VmmCaps, rules
from vt.rules import RULES, RULES_BY_ID, check

HA = dict(unified_memory=True, device_memory_is_host_addressable=True)


class Bare(vt.Backend):
    name = "bare"


class WithHostView(vt.Backend):
    name = "hv"

    def host_view(self, buf: vt.Buffer) -> np.ndarray:
        return buf.handle


class Complete(WithHostView):
    """Overrides every method a capability can require."""

    name = "complete"


for _methods in rules.IMPLEMENTATION.values():
    for _m in _methods:
        if not Complete.overrides(_m):
            setattr(Complete, _m, lambda self, *a, **k: None)


def ids(cls: type[vt.Backend], **caps: object) -> list[str]:
    return [v.rule for v in check(cls, Capabilities(**caps))]


def test_rule_ids_are_unique_stable_and_explained() -> None:
    assert len(RULES_BY_ID) == len(RULES)
    assert set(RULES_BY_ID) == {
        "async-readback-needs-events",
        "async-readback-needs-pinned",
        "async-readback-needs-d2h-path",
        "declared-without-implementation",
        "vmm-granularity-power-of-two",
        "host-addressable-implies-unified",
        "backend-name-valid",
        "duplicate-backend-name",
    }
    for rule in RULES:
        assert rule.why and len(rule.why) < 100 and "\n" not in rule.why


def test_nothing_declared_breaks_nothing() -> None:
    assert ids(Bare) == []


def test_everything_declared_and_implemented_breaks_nothing() -> None:
    full = dict(
        HA,
        host_memory_is_device_addressable=True,
        supports_async_sampled_token_readback=True,
        async_d2h_copy=True,
        events=True,
        pinned_host_memory=True,
        graphs=True,
        vmm=VmmCaps(granularity=2 << 20, segments_may_alias=True),
    )
    assert ids(Complete, **full) == []


def test_async_readback_without_events() -> None:
    assert ids(WithHostView, supports_async_sampled_token_readback=True, **HA) == [
        "async-readback-needs-events"
    ]


def test_the_rocm_bug_async_readback_without_any_d2h_path() -> None:
    # Discrete memory, events and pinned memory, but no async copy: the '!!!!' bug.
    violations = check(
        Complete,
        Capabilities(
            supports_async_sampled_token_readback=True, events=True, pinned_host_memory=True
        ),
    )
    assert [v.rule for v in violations] == ["async-readback-needs-d2h-path"]
    assert "'complete'" in violations[0].message and "async_d2h_copy" in violations[0].message


def test_async_readback_on_discrete_memory_needs_pinned() -> None:
    caps = dict(supports_async_sampled_token_readback=True, events=True, async_d2h_copy=True)
    assert ids(Complete, **caps) == ["async-readback-needs-pinned"]
    # Host-addressable memory is read in place: no pinned buffer or copy needed.
    assert ids(Complete, **caps, **HA) == []
    assert ids(Complete, supports_async_sampled_token_readback=True, events=True, **HA) == []


@pytest.mark.parametrize(
    ("field", "value", "missing"),
    [
        ("device_memory_is_host_addressable", True, "host_view"),
        ("events", True, "record_event"),
        ("pinned_host_memory", True, "alloc_pinned"),
        ("async_d2h_copy", True, "copy_d2h_async"),
        ("vmm", VmmCaps(granularity=4096), "vmm_reserve"),
        ("graphs", True, "begin_capture, end_capture, launch_graph, destroy_graph"),
    ],
)
def test_declared_without_implementation(field: str, value: object, missing: str) -> None:
    caps = {field: value}
    if field == "device_memory_is_host_addressable":
        caps["unified_memory"] = True
    violations = check(Bare, Capabilities(**caps))
    assert [v.rule for v in violations] == ["declared-without-implementation"]
    assert field in violations[0].message and missing in violations[0].message


def test_events_partially_overridden_names_the_base_no_ops() -> None:
    class HalfEvents(vt.Backend):
        name = "half"

        def record_event(self, event: vt.Event, stream: vt.Stream) -> None:
            pass

    (violation,) = check(HalfEvents, Capabilities(events=True))
    assert "record_event" not in violation.message
    assert "query_event" in violation.message and "synchronize_event" in violation.message


@pytest.mark.parametrize("granularity", [0, -4096, 3000, (2 << 20) + 1])
def test_vmm_granularity_must_be_a_positive_power_of_two(granularity: int) -> None:
    violations = check(Complete, Capabilities(vmm=VmmCaps(granularity=granularity)))
    assert [v.rule for v in violations] == ["vmm-granularity-power-of-two"]
    assert str(granularity) in violations[0].message


@pytest.mark.parametrize("granularity", [1, 4096, 64 << 10, 2 << 20])
def test_vmm_granularity_powers_of_two_pass(granularity: int) -> None:
    assert ids(Complete, vmm=VmmCaps(granularity=granularity)) == []


def test_host_addressable_without_unified() -> None:
    assert ids(WithHostView, device_memory_is_host_addressable=True) == [
        "host-addressable-implies-unified"
    ]
    assert ids(WithHostView, unified_memory=True) == []  # unified alone is fine


@pytest.mark.parametrize("name", ["auto", "base", "", "My GPU", "cpu,gpu", "Cpu"])
def test_backend_names_must_be_plain(name: str) -> None:
    cls = type("Named", (vt.Backend,), {"name": name})
    violations = check(cls, Capabilities())
    assert [v.rule for v in violations] == ["backend-name-valid"]
    assert repr(name) in violations[0].message


def test_unnamed_subclass_keeps_base_name_and_is_flagged() -> None:
    class Unnamed(vt.Backend):
        pass

    assert ids(Unnamed) == ["backend-name-valid"]


def test_rules_are_pure_and_return_all_violations() -> None:
    caps = Capabilities(supports_async_sampled_token_readback=True, vmm=VmmCaps(granularity=6))
    first = check(Bare, caps)
    assert first == check(Bare, caps)
    assert {v.rule for v in first} == {
        "async-readback-needs-events",
        "async-readback-needs-pinned",
        "async-readback-needs-d2h-path",
        "declared-without-implementation",
        "vmm-granularity-power-of-two",
    }


def test_graphs_half_implemented_names_what_is_missing() -> None:
    class CaptureOnly(vt.Backend):
        name = "capture-only"

        def begin_capture(self, stream: vt.Stream) -> None:
            pass

        def end_capture(self, stream: vt.Stream) -> vt.Graph:
            return vt.Graph(None)

    (violation,) = check(CaptureOnly, Capabilities(graphs=True))
    assert violation.rule == "declared-without-implementation"
    assert violation.message == (
        "'capture-only' declares graphs=True but does not override launch_graph, destroy_graph"
    )
    # Not declaring graphs is always fine: the runner then launches every kernel.
    assert check(CaptureOnly, Capabilities()) == []
