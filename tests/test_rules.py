"""Each consistency rule on minimal backend classes."""

from __future__ import annotations

import numpy as np
import pytest
import vt
from vt import Capabilities, VmmCaps
from vt.management.rules import RULES, RULES_BY_ID, check
from vt.protocol.mixins import IMPLEMENTATION, derive_capabilities

HA = dict(unified_memory=True, device_memory_is_host_addressable=True)


class Bare(vt.Backend):
    name = "bare"


class WithHostView(vt.Backend, vt.HostAddressable):
    name = "hv"

    def _host_view(self, buf: vt.Buffer) -> np.ndarray:
        return buf.handle


class Complete(
    WithHostView, vt.Events, vt.PinnedHostMemory, vt.AsyncD2HCopy, vt.Graphs, vt.VirtualMemory
):
    """Implements every hook of every capability mixin."""

    name = "complete"


for _mixin, _hooks in IMPLEMENTATION.values():
    for _m in _hooks:
        if _m not in Complete.__dict__ and _m != "_host_view":
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
        ("device_memory_is_host_addressable", True, "vt.HostAddressable"),
        ("events", True, "vt.Events"),
        ("pinned_host_memory", True, "vt.PinnedHostMemory"),
        ("async_d2h_copy", True, "vt.AsyncD2HCopy"),
        ("vmm", VmmCaps(granularity=4096), "vt.VirtualMemory"),
        ("graphs", True, "vt.Graphs"),
    ],
)
def test_declared_without_implementation(field: str, value: object, missing: str) -> None:
    caps = {field: value}
    if field == "device_memory_is_host_addressable":
        caps["unified_memory"] = True
    violations = check(Bare, Capabilities(**caps))
    assert [v.rule for v in violations] == ["declared-without-implementation"]
    assert field in violations[0].message and missing in violations[0].message


def test_events_partially_implemented_names_the_missing_hooks() -> None:
    class HalfEvents(vt.Backend, vt.Events):
        name = "half"

        def _record_event(self, event: vt.Event, stream: vt.Stream) -> None:
            pass

    (violation,) = check(HalfEvents, Capabilities(events=True))
    assert "_record_event" not in violation.message
    assert "_query_event" in violation.message and "_synchronize_event" in violation.message
    # Derived, not declared: half an implementation is simply no events.
    assert derive_capabilities(HalfEvents, Capabilities()).events is False


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
    class CaptureOnly(vt.Backend, vt.Graphs):
        name = "capture-only"

        def _begin_capture(self, stream: vt.Stream) -> None:
            pass

        def _end_capture(self, stream: vt.Stream) -> vt.Graph:
            return vt.Graph(None)

    (violation,) = check(CaptureOnly, Capabilities(graphs=True))
    assert violation.rule == "declared-without-implementation"
    assert violation.message == (
        "'capture-only' declares graphs=True but does not implement _launch_graph, _destroy_graph"
    )
    # Not declaring graphs is always fine: the runner then launches every kernel.
    assert check(CaptureOnly, Capabilities()) == []


# --------------------------------------------------------------------------- derivation


def test_code_capabilities_are_derived_from_the_mixins_with_provenance() -> None:
    caps = derive_capabilities(Complete, Capabilities(**HA))
    assert caps.events and caps.pinned_host_memory and caps.async_d2h_copy and caps.graphs
    assert caps.supports_async_sampled_token_readback
    assert caps.source_of("events").source is vt.Source.derived
    assert caps.source_of("events").detail == "implements vt.Events"
    bare = derive_capabilities(Bare, Capabilities())
    assert not (bare.events or bare.graphs or bare.supports_async_sampled_token_readback)
    assert bare.source_of("graphs").detail == "does not implement vt.Graphs"
    assert check(Complete, caps) == [] and check(Bare, bare) == []


def test_a_declared_false_turns_implemented_code_off() -> None:
    """A device that lacks a feature the backend's code has (no copy engine, old driver)."""
    caps = derive_capabilities(Complete, Capabilities(async_d2h_copy=False, graphs=False))
    assert not caps.async_d2h_copy and not caps.graphs and caps.events
    assert caps.source_of("async_d2h_copy").source is vt.Source.declared
    # Discrete memory without an async copy: no async readback, derived (the '!!!!' bug).
    assert caps.supports_async_sampled_token_readback is False
    assert check(Complete, caps) == []


def test_async_readback_follows_from_events_pinned_and_a_d2h_path() -> None:
    discrete = derive_capabilities(Complete, Capabilities())
    assert discrete.supports_async_sampled_token_readback  # pinned + async D2H copy
    assert "async D2H copy" in discrete.source_of("supports_async_sampled_token_readback").detail
    no_pinned = derive_capabilities(Complete, Capabilities(pinned_host_memory=False))
    assert not no_pinned.supports_async_sampled_token_readback


def test_vmm_is_a_physical_fact_and_needs_the_mixin() -> None:
    assert derive_capabilities(Complete, Capabilities()).vmm is None  # nothing declared
    caps = derive_capabilities(Bare, Capabilities(vmm=VmmCaps(granularity=4096)))
    assert [v.rule for v in check(Bare, caps)] == ["declared-without-implementation"]
