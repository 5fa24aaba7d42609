"""Consistency rules: what a backend's capabilities must satisfy to be selectable.

Each rule has a stable id (scripts and docs refer to it), a one-line ``why`` and a pure
check ``(backend class, capabilities) -> list[Violation]``. The registry runs every rule on
each backend's *effective* capabilities; a single violation rejects the backend. The story
behind each rule is in ``docs/capabilities.md``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from ..protocol.backend import Backend
from ..protocol.capabilities import Capabilities
from ..protocol.mixins import IMPLEMENTATION, unimplemented


class Violation(BaseModel):
    """One broken rule: its id and what exactly is wrong."""

    model_config = ConfigDict(frozen=True)

    rule: str
    message: str


Check = Callable[[type[Backend], Capabilities], list[Violation]]


@dataclass(frozen=True)
class Rule:
    """A consistency rule. ``check`` is None for rules the registry applies across backends."""

    id: str
    why: str
    check: Check | None = None

    def __call__(self, cls: type[Backend], caps: Capabilities) -> list[Violation]:
        return [] if self.check is None else self.check(cls, caps)


def _name(cls: type[Backend]) -> str:
    return getattr(cls, "name", cls.__name__)


def _async_readback_needs_events(cls: type[Backend], caps: Capabilities) -> list[Violation]:
    if caps.supports_async_sampled_token_readback and not caps.events:
        return [
            Violation(
                rule="async-readback-needs-events",
                message=f"{_name(cls)!r} declares supports_async_sampled_token_readback "
                "but not events: the runner could not know when the sampled ids are ready",
            )
        ]
    return []


def _async_readback_needs_pinned(cls: type[Backend], caps: Capabilities) -> list[Violation]:
    if (
        caps.supports_async_sampled_token_readback
        and not caps.device_memory_is_host_addressable
        and not caps.pinned_host_memory
    ):
        return [
            Violation(
                rule="async-readback-needs-pinned",
                message=f"{_name(cls)!r} declares supports_async_sampled_token_readback, its "
                "device memory is not host-addressable, and it has no pinned_host_memory to "
                "copy the sampled ids into asynchronously",
            )
        ]
    return []


def _async_readback_needs_d2h_path(cls: type[Backend], caps: Capabilities) -> list[Violation]:
    if (
        caps.supports_async_sampled_token_readback
        and not caps.device_memory_is_host_addressable
        and not caps.async_d2h_copy
    ):
        return [
            Violation(
                rule="async-readback-needs-d2h-path",
                message=f"{_name(cls)!r} declares supports_async_sampled_token_readback with "
                "neither host-addressable device memory nor async_d2h_copy: the runner would "
                "have no way to read the sampled ids (this is the ROCm '!!!!' bug)",
            )
        ]
    return []


def _declared_without_implementation(cls: type[Backend], caps: Capabilities) -> list[Violation]:
    out = []
    for field in IMPLEMENTATION:
        if not getattr(caps, field):
            continue
        missing = unimplemented(cls, field)
        if missing:
            shown = field if field == "vmm" else f"{field}=True"
            out.append(
                Violation(
                    rule="declared-without-implementation",
                    message=f"{_name(cls)!r} declares {shown} but does not implement "
                    f"{', '.join(missing)}",
                )
            )
    return out


def _vmm_granularity_power_of_two(cls: type[Backend], caps: Capabilities) -> list[Violation]:
    if caps.vmm is None:
        return []
    g = caps.vmm.granularity
    if g <= 0 or g & (g - 1):
        return [
            Violation(
                rule="vmm-granularity-power-of-two",
                message=f"{_name(cls)!r} declares vmm granularity {g}, which is not a "
                "positive power of two",
            )
        ]
    return []


def _host_addressable_implies_unified(cls: type[Backend], caps: Capabilities) -> list[Violation]:
    if caps.device_memory_is_host_addressable and not caps.unified_memory:
        return [
            Violation(
                rule="host-addressable-implies-unified",
                message=f"{_name(cls)!r} declares device_memory_is_host_addressable without "
                "unified_memory; host-addressable device memory is a special case of unified "
                "memory",
            )
        ]
    return []


#: Names travel through VT_BACKEND, VT_PLUGINS and --backend: keep them plain.
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
RESERVED_NAMES = frozenset({"auto", "base"})


def _backend_name_valid(cls: type[Backend], caps: Capabilities) -> list[Violation]:
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        problem = f"name {name!r} must match {NAME_PATTERN.pattern}"
    elif name in RESERVED_NAMES:
        problem = f"name {name!r} is reserved; set the class attribute `name`"
    else:
        return []
    return [Violation(rule="backend-name-valid", message=f"{cls.__qualname__}: {problem}")]


RULES: tuple[Rule, ...] = (
    Rule(
        "async-readback-needs-events",
        "async readback overlaps the next step with the copy; only an event says it finished",
        _async_readback_needs_events,
    ),
    Rule(
        "async-readback-needs-pinned",
        "an async copy of device memory the host cannot read needs a pinned destination",
        _async_readback_needs_pinned,
    ),
    Rule(
        "async-readback-needs-d2h-path",
        "async readback needs host-addressable device memory or an async device-to-host copy",
        _async_readback_needs_d2h_path,
    ),
    Rule(
        "declared-without-implementation",
        "a declared capability whose mixin or hooks are missing is a lie",
        _declared_without_implementation,
    ),
    Rule(
        "vmm-granularity-power-of-two",
        "reservations and segments are rounded to the granularity; it must be 2**k > 0",
        _vmm_granularity_power_of_two,
    ),
    Rule(
        "host-addressable-implies-unified",
        "host-addressable device memory is strictly narrower than unified memory",
        _host_addressable_implies_unified,
    ),
    Rule(
        "backend-name-valid",
        "backend names are typed in VT_BACKEND and --backend; 'auto' is the selector",
        _backend_name_valid,
    ),
    # Applied by the registry across plugins, not per class.
    Rule(
        "duplicate-backend-name",
        "two plugins giving one name would make selection depend on load order",
    ),
)

RULES_BY_ID: dict[str, Rule] = {rule.id: rule for rule in RULES}


def check(cls: type[Backend], caps: Capabilities) -> list[Violation]:
    """Every violation of every per-backend rule by ``cls`` declaring ``caps``."""
    out: list[Violation] = []
    for rule in RULES:
        out.extend(rule(cls, caps))
    return out
