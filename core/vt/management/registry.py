"""Backend discovery, validation and selection.

Discovery: every entry point in group ``vt`` is a plugin module; it is registered with a
pluggy :class:`~pluggy.PluginManager` under its entry-point name and asked, through the
``vt_register_backends`` hook, for its backend classes. Each backend is then probed,
its declared capabilities turned into *effective* ones (``VT_CAPS`` overrides, with
provenance) and checked against :mod:`vt.management.rules`.

Isolation: whatever one plugin does wrong (fails to import, raises in its hook or probe)
is recorded on that plugin's entries as ``broken``, with its own traceback, and every other
plugin keeps working. Errors are raised only when a broken, rejected or unavailable backend
is asked for by name.

Two backends with one name are both listed and both ``rejected`` with rule
``duplicate-backend-name``, naming both distributions: neither may be selected, because
which one wins would depend on load order. ``auto`` passes them (saying why) and picks the
next best, so a third-party ``cpu`` cannot silently replace vt's own.

An emulator (``emulated = True`` on the class, e.g. tt_stub) is never picked by ``auto``:
it would be a silent, slow stand-in for hardware. It runs only when asked for by name.
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata as metadata
import os
import traceback
from collections.abc import Mapping
from typing import Any

import pluggy
from pydantic import BaseModel, ConfigDict, PrivateAttr

from .. import envs
from ..errors import BackendUnavailableError, CapabilityError
from ..protocol.backend import Backend, Probe
from ..protocol.capabilities import BOOL_FIELDS, CAPABILITY_FIELDS, Capabilities, Source, VmmCaps
from ..protocol.mixins import derive_capabilities
from . import hookspecs
from .hookspecs import ENTRY_POINT_GROUP, PROJECT
from .rules import Violation, check

#: The plugin loaded when VT_PLUGINS is set but empty.
DEFAULT_PLUGIN = "cpu"

#: Short spellings accepted in VT_CAPS besides the full field names.
CAPS_ALIASES: dict[str, str] = {
    "unified": "unified_memory",
    "host_addressable": "device_memory_is_host_addressable",
    "device_addressable": "host_memory_is_device_addressable",
    "async_readback": "supports_async_sampled_token_readback",
    "pinned": "pinned_host_memory",
}


class Status(str, enum.Enum):
    available = "available"
    unavailable = "unavailable"  # the probe says the hardware or library is not there
    rejected = "rejected"  # the declaration breaks a rule
    broken = "broken"  # the plugin raised (import, hook or probe)


class Entry(BaseModel):
    """One backend (or, if it broke before registering any, one plugin) as discovered."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    status: Status
    reason: str = ""
    plugin: str = ""  # entry-point name
    distribution: str = ""
    version: str = ""
    priority: int = 0
    description: str = ""
    device: str = ""
    capabilities: Capabilities | None = None  # effective
    declared: Capabilities | None = None
    violations: list[Violation] = []
    ops: list[str] = []  # the ops the class implements natively (vt.protocol.ops)
    emulated: bool = False  # never picked by auto, only by name
    traceback: str = ""  # a broken plugin's own traceback (shown with VT_DEBUG=1)
    _cls: type[Backend] | None = PrivateAttr(default=None)

    @property
    def backend_class(self) -> type[Backend] | None:
        return self._cls

    def to_json(self) -> dict[str, Any]:
        """The shape ``vt backends --json`` prints (scripts depend on these keys)."""
        caps = self.capabilities
        return {
            "name": self.name,
            "status": self.status.value,
            "reason": self.reason,
            "plugin": self.plugin,
            "distribution": self.distribution,
            "version": self.version,
            "priority": self.priority,
            "description": self.description,
            "device": self.device,
            "capabilities": None if caps is None else caps.summary(),
            "provenance": {}
            if caps is None
            else {k: v.model_dump(mode="json") for k, v in caps.provenance.items()},
            "violations": [v.model_dump() for v in self.violations],
            "ops": self.ops,
            "emulated": self.emulated,
            **({"traceback": self.traceback} if self.traceback else {}),
        }


# --------------------------------------------------------------------------- VT_CAPS


class CapsOverride(BaseModel):
    """One ``[backend:]field=value`` item of VT_CAPS."""

    model_config = ConfigDict(frozen=True)

    backend: str | None
    field: str  # a capability field, or vmm.granularity / vmm.segments_may_alias
    value: Any
    text: str


def _parse_bool(text: str, item: str) -> bool:
    value = envs.parse_bool(text)
    if value is not None:
        return value
    raise CapabilityError(f"VT_CAPS item {item!r}: {text!r} is not a boolean (use 1/0, on/off)")


def parse_caps_overrides(spec: str) -> list[CapsOverride]:
    """Parse VT_CAPS, e.g. ``"supports_async_sampled_token_readback=0,cpu:vmm=off"``."""
    out = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        key, sep, text = item.partition("=")
        if not sep:
            raise CapabilityError(f"VT_CAPS item {item!r} is not of the form name=value")
        backend, _, field = key.strip().rpartition(":")
        field = CAPS_ALIASES.get(field.strip(), field.strip())
        value: Any
        if field in BOOL_FIELDS or field == "vmm.segments_may_alias":
            value = _parse_bool(text, item)
        elif field == "vmm":
            if envs.parse_bool(text) is not False and text.strip().lower() != "none":
                raise CapabilityError(
                    f"VT_CAPS item {item!r}: vmm can only be turned off (vmm=off); "
                    "use vmm.granularity=N or vmm.segments_may_alias=1 to adjust it"
                )
            value = None
        elif field == "vmm.granularity":
            try:
                value = int(text.strip(), 0)
            except ValueError:
                raise CapabilityError(
                    f"VT_CAPS item {item!r}: granularity must be an integer"
                ) from None
        else:
            known = ", ".join([*CAPABILITY_FIELDS, "vmm.granularity", "vmm.segments_may_alias"])
            raise CapabilityError(f"VT_CAPS item {item!r}: unknown capability {field!r} ({known})")
        out.append(
            CapsOverride(backend=backend.strip() or None, field=field, value=value, text=item)
        )
    return out


def apply_overrides(name: str, caps: Capabilities, overrides: list[CapsOverride]) -> Capabilities:
    """``caps`` with the overrides that apply to backend ``name``, provenance ``env``."""
    for ov in overrides:
        if ov.backend is not None and ov.backend != name:
            continue
        detail = f"VT_CAPS {ov.text}"
        if ov.field.startswith("vmm."):
            if caps.vmm is None:  # nothing to adjust on a backend without vmm
                continue
            sub = ov.field.split(".", 1)[1]
            vmm = VmmCaps.model_validate({**caps.vmm.model_dump(), sub: ov.value})
            caps = caps.with_value("vmm", vmm, Source.env, detail)
        else:
            caps = caps.with_value(ov.field, ov.value, Source.env, detail)
    return caps


# --------------------------------------------------------------------------- discovery


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# Frames of the machinery between vt and a plugin's code: left out of its traceback.
_MACHINERY = (__file__, os.path.dirname(importlib.__file__), os.path.dirname(pluggy.__file__))


def _plugin_traceback(exc: BaseException) -> str:
    """``exc``'s formatted traceback without the registry's, importlib's and pluggy's frames."""
    te: traceback.TracebackException | None = traceback.TracebackException.from_exception(exc)
    top = te
    while te is not None:  # a chained cause has its own stack
        frames = [f for f in te.stack if not f.filename.startswith(_MACHINERY + ("<frozen ",))]
        te.stack = traceback.StackSummary.from_list(frames)
        te = te.__cause__ or te.__context__
    assert top is not None
    return "".join(top.format())


def _dist_of(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "", ""
    return str(dist.metadata["Name"] or ""), str(dist.version or "")


def _wanted_plugins(env: Mapping[str, str] | None) -> list[str] | None:
    """Entry-point names VT_PLUGINS allows, or None for all."""
    names: list[str] | None = envs.get("VT_PLUGINS", env)
    return names if names is None else names or [DEFAULT_PLUGIN]


def _dist_text(entry: Entry) -> str:
    return f"{entry.distribution or '?'} {entry.version}".strip()


def _class_name(cls: type[Backend]) -> str:
    return cls.name if isinstance(cls.name, str) else repr(cls.name)


class _Found:
    """A backend class a plugin registered, not yet probed."""

    def __init__(self, ep: metadata.EntryPoint, cls: type[Backend]) -> None:
        self.ep, self.cls, self.name = ep, cls, _class_name(cls)


def _duplicate_groups(entries: list[Entry]) -> dict[str, list[Entry]]:
    by_name: dict[str, list[Entry]] = {}
    for entry in entries:
        if entry.backend_class is not None:  # a plugin that broke registered no name
            by_name.setdefault(entry.name, []).append(entry)
    return {name: group for name, group in by_name.items() if len(group) > 1}


def _registered_by(group: list[Entry]) -> str:
    first = group[0]
    if len({e.plugin for e in group}) == 1:  # one plugin registered the name twice
        return f"registered {len(group)} times by plugin {first.plugin!r} ({_dist_text(first)})"
    count = {2: "two", 3: "three"}.get(len(group), str(len(group)))
    return f"registered by {count} distributions ({', '.join(_dist_text(e) for e in group)})"


def _duplicate_fix(group: list[Entry]) -> str:
    plugins = list(dict.fromkeys(e.plugin for e in group))
    if len(plugins) == 1:  # VT_PLUGINS cannot tell them apart
        return f"plugin {plugins[0]!r} must register it once"
    leave_out = " or ".join(repr(p) for p in plugins)
    return f"set VT_PLUGINS to the plugins to load, leaving out {leave_out}, or uninstall one"


def _duplicate_why(group: list[Entry]) -> str:
    """Why ``auto`` passed a backend name registered more than once (``group``)."""
    hint = "; choose one with VT_PLUGINS" if len({e.plugin for e in group}) > 1 else ""
    return _registered_by(group) + hint


class Registry:
    """Discovered backends. Discovery runs once, on first use; use a fresh instance to redo it.

    ``env`` stands in for the process environment (VT_PLUGINS and VT_CAPS, read through
    :mod:`vt.envs` at discovery; VT_BACKEND at each ``select(None)``).
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env = env
        self._entries: list[Entry] | None = None
        # Discovery in two steps: the plugins' registered classes (and the plugins that
        # broke first), then each class's probe on first need, so a backend asked for by
        # name probes no other (a probe may import vendor bindings or open a device).
        self._found: list[Entry | _Found] | None = None
        self._probed: dict[int, Entry] = {}
        self._overrides: list[CapsOverride] = []
        self.plugin_manager = pluggy.PluginManager(PROJECT)
        self.plugin_manager.add_hookspecs(hookspecs)

    # ---- discovery
    def entries(self) -> list[Entry]:
        """Every backend (and every plugin that broke before registering one)."""
        if self._entries is None:
            entries = [self._entry(i) for i in range(len(self._discovered()))]
            entries.sort(key=lambda e: (e.name, e.plugin))
            self._mark_duplicates(entries)  # after sorting: messages list them in table order
            self._entries = entries
        return list(self._entries)

    def _discovered(self) -> list[Entry | _Found]:
        if self._found is None:
            self._overrides = parse_caps_overrides(envs.get("VT_CAPS", self._env))
            self._found = self._discover()
        return self._found

    def _entry(self, i: int) -> Entry:
        """The entry of the i-th discovered item, its backend probed once."""
        item = self._discovered()[i]
        if isinstance(item, Entry):
            return item
        entry = self._probed.get(i)
        if entry is None:
            entry = self._probed[i] = self._load_backend(item.ep, item.cls, self._overrides)
        return entry

    def get(self, name: str) -> Entry | None:
        for entry in self.entries():
            if entry.name == name:
                return entry
        return None

    def _discover(self) -> list[Entry | _Found]:
        eps = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
        wanted = _wanted_plugins(self._env)
        entries: list[Entry | _Found] = []
        if wanted is not None:
            present = {ep.name for ep in eps}
            for missing in [n for n in wanted if n not in present]:
                entries.append(
                    Entry(
                        name=missing,
                        plugin=missing,
                        status=Status.unavailable,
                        reason=f"VT_PLUGINS names plugin {missing!r} but no installed "
                        f"distribution provides it (installed: {', '.join(sorted(present))})",
                    )
                )
            eps = [ep for ep in eps if ep.name in wanted]
        # Register every module first so check_pending sees them all, then call hooks.
        loaded: list[tuple[metadata.EntryPoint, object]] = []
        for ep in eps:
            other = next((e for e, _ in loaded if e.name == ep.name), None)
            if other is not None:
                entries.append(
                    self._broken(
                        ep,
                        f"plugin name {ep.name!r} is also provided by distribution "
                        f"{_dist_of(other)[0] or '?'}; uninstall one of them",
                    )
                )
                continue
            try:
                module = ep.load()
                self.plugin_manager.register(module, name=ep.name)
            except (Exception, SystemExit) as exc:  # isolate every plugin failure
                entries.append(self._broken(ep, f"failed to load: {_error(exc)}", exc))
                continue
            loaded.append((ep, module))
        loaded = self._check_pending(loaded, entries)
        for ep, module in loaded:
            entries.extend(self._load_plugin(ep, module))
        return entries

    def _broken(
        self, ep: metadata.EntryPoint, reason: str, exc: BaseException | None = None
    ) -> Entry:
        dist, version = _dist_of(ep)
        return Entry(
            name=ep.name,
            plugin=ep.name,
            status=Status.broken,
            reason=reason,
            distribution=dist,
            version=version,
            traceback="" if exc is None else _plugin_traceback(exc),
        )

    def _check_pending(
        self, loaded: list[tuple[metadata.EntryPoint, object]], entries: list[Entry | _Found]
    ) -> list[tuple[metadata.EntryPoint, object]]:
        """Run pluggy's check_pending, unregistering (and marking broken) each offender."""
        pm = self.plugin_manager
        while True:
            try:
                pm.check_pending()
                return loaded
            except pluggy.PluginValidationError as exc:
                bad = exc.plugin
                pm.unregister(bad)
                for ep, module in loaded:
                    if module is bad:
                        entries.append(self._broken(ep, f"invalid plugin: {exc}"))
                loaded = [(ep, m) for ep, m in loaded if m is not bad]

    def _load_plugin(self, ep: metadata.EntryPoint, module: object) -> list[Entry | _Found]:
        pm = self.plugin_manager
        hook = pm.hook.vt_register_backends
        if not any(impl.plugin is module for impl in hook.get_hookimpls()):
            return [self._broken(ep, "plugin does not implement the vt_register_backends hook")]
        others = [p for p in pm.get_plugins() if p is not module]
        classes: list[type[Backend]] = []
        errors: list[str] = []

        def register(cls: type) -> None:
            if isinstance(cls, type) and issubclass(cls, Backend) and cls is not Backend:
                classes.append(cls)
            else:
                errors.append(f"register() expects a vt.Backend subclass, got {cls!r}")

        try:
            pm.subset_hook_caller("vt_register_backends", remove_plugins=others)(register=register)
        except Exception as exc:
            return [self._broken(ep, f"vt_register_backends raised {_error(exc)}", exc)]
        if errors:
            return [self._broken(ep, "; ".join(errors))]
        if not classes:
            return [self._broken(ep, "vt_register_backends registered no backend")]
        return [_Found(ep, cls) for cls in classes]

    def _load_backend(
        self, ep: metadata.EntryPoint, cls: type[Backend], overrides: list[CapsOverride]
    ) -> Entry:
        dist, version = _dist_of(ep)
        name = _class_name(cls)
        entry = Entry(
            name=name,
            plugin=ep.name,
            status=Status.available,
            distribution=dist,
            version=version,
            priority=int(cls.priority) if isinstance(cls.priority, int) else 0,
            description=str(cls.description or ""),
            emulated=bool(getattr(cls, "emulated", False)),  # vt.Backend grows it in v2
        )
        entry._cls = cls
        try:
            entry.ops = list(cls.op_names())
            probe = cls.probe()
            if not isinstance(probe, Probe):
                raise TypeError(f"probe() returned {type(probe).__name__}, not vt.Probe")
            declared = probe.capabilities if probe.capabilities is not None else Capabilities()
            if not isinstance(declared, Capabilities):
                raise TypeError(f"capabilities is {type(declared).__name__}, not vt.Capabilities")
        except Exception as exc:
            entry.status = Status.broken
            entry.reason = f"probe raised {_error(exc)}"
            entry.traceback = _plugin_traceback(exc)
            return entry
        entry.device = probe.device
        entry.declared = declared
        try:
            derived = derive_capabilities(cls, declared)
            entry.capabilities = apply_overrides(name, derived, overrides)
            entry.violations = check(cls, entry.capabilities)
        except Exception as exc:  # e.g. an override makes vmm invalid
            entry.status = Status.broken
            entry.reason = f"checking capabilities raised {_error(exc)}"
            entry.traceback = _plugin_traceback(exc)
            return entry
        if not probe.available:
            entry.status = Status.unavailable
            entry.reason = probe.reason or "the probe reported the backend unavailable"
        elif entry.violations:
            entry.status = Status.rejected
            entry.reason = "; ".join(f"{v.rule}: {v.message}" for v in entry.violations)
        else:
            entry.reason = probe.reason  # e.g. "emulated stub": informative, not a failure
        return entry

    def duplicates(self) -> dict[str, list[Entry]]:
        """Backend names registered more than once, with their entries (none is chosen)."""
        return _duplicate_groups(self.entries())

    @staticmethod
    def _mark_duplicates(entries: list[Entry]) -> None:
        for name, group in _duplicate_groups(entries).items():
            violation = Violation(
                rule="duplicate-backend-name",
                message=f"backend name {name!r} is {_registered_by(group)}; neither is chosen: "
                f"{_duplicate_fix(group)}",
            )
            for entry in group:
                entry.violations = [*entry.violations, violation]
                if entry.status in (Status.available, Status.rejected):
                    entry.status = Status.rejected
                    entry.reason = "; ".join(f"{v.rule}: {v.message}" for v in entry.violations)

    # ---- selection
    def select(self, name: str | None = None) -> tuple[Entry, str]:
        """The entry to use and a sentence saying why.

        ``None`` reads VT_BACKEND (unset means ``auto``); ``"auto"`` picks the
        highest-priority available backend that is not an emulator and whose name is not
        registered twice. A named backend that is not available raises
        :class:`vt.BackendUnavailableError` with its recorded reason: never a fallback.
        """
        how = "--backend"
        if name is None:
            name = envs.get("VT_BACKEND", self._env).strip() or "auto"
            how = "VT_BACKEND"
        if name == "auto":
            return self._auto()
        if self._entries is None:  # before a listing: probe only what carries this name
            found = self._discovered()
            named = [i for i, f in enumerate(found) if isinstance(f, _Found) and f.name == name]
            if named and not any(isinstance(f, Entry) and f.name == name for f in found):
                group = sorted((self._entry(i) for i in named), key=lambda e: e.plugin)
                return self._named(name, group, how)
        entry = self.get(name)
        if entry is None:
            known = ", ".join(sorted({e.name for e in self.entries()})) or "none"
            hint = ""
            if envs.is_set("VT_PLUGINS", self._env):
                plugins = envs.raw("VT_PLUGINS", self._env)
                hint = f" (VT_PLUGINS={plugins!r} limits which plugins load)"
            raise BackendUnavailableError(
                f"unknown backend {name!r}; installed backends: {known}{hint}"
            )
        return self._named(name, [e for e in self.entries() if e.name == name], how)

    @staticmethod
    def _named(name: str, group: list[Entry], how: str) -> tuple[Entry, str]:
        """select's answer for the entries registered under ``name`` (at least one)."""
        if _duplicate_groups(group):
            raise BackendUnavailableError(
                f"backend {name!r} is {_registered_by(group)}, and vt does not pick one: "
                f"{_duplicate_fix(group)} [duplicate-backend-name]"
            )
        bad = next((e for e in group if e.status is not Status.available), None)
        if bad is not None:
            raise BackendUnavailableError(f"backend {name!r} is {bad.status.value}: {bad.reason}")
        return group[0], f"{name!r} was asked for by {how}"

    def _auto(self) -> tuple[Entry, str]:
        entries = self.entries()
        dupes = self.duplicates()
        usable = [e for e in entries if e.status is Status.available and e.name not in dupes]
        emulators = [e for e in usable if e.emulated]
        ok = sorted((e for e in usable if not e.emulated), key=lambda e: (-e.priority, e.name))
        # Why auto passed over what it could otherwise have picked.
        passed = [f"{e.name} (emulator: only chosen by name)" for e in emulators]
        passed += [f"{name}: {_duplicate_why(group)}" for name, group in dupes.items()]
        down = [e for e in entries if e.status is not Status.available and e.name not in dupes]
        if not ok:
            detail = [f"{e.name} is {e.status.value}: {e.reason}" for e in down]
            message = "auto: no backend is available"
            if emulators:
                names = ", ".join(e.name for e in emulators)
                message += (
                    f" but the emulator {names}, which auto never picks; choose it by name "
                    f"(--backend {emulators[0].name} or VT_BACKEND={emulators[0].name})"
                )
            detail[:0] = passed[len(emulators) :]  # the duplicates' why, first
            raise BackendUnavailableError(message + (f" ({'; '.join(detail)})" if detail else ""))
        best = ok[0]
        why = (
            f"auto picked {best.name!r} (priority {best.priority}), the highest-priority "
            "available backend"
        )
        if len(ok) > 1:
            why += "; also available: " + ", ".join(f"{e.name} ({e.priority})" for e in ok[1:])
        for text in passed:
            why += f"; passed over {text}"
        if down:
            why += "; not available: " + ", ".join(f"{e.name} ({e.status.value})" for e in down)
        return best, why

    def create_backend(self, name: str | None = None) -> tuple[Backend, str]:
        """An instance of the selected backend, with its *effective* capabilities set."""
        entry, why = self.select(name)
        cls = entry.backend_class
        assert cls is not None  # available entries always have a class
        try:
            backend = cls()
        except Exception as exc:
            raise BackendUnavailableError(
                f"backend {entry.name!r} failed to start: {_error(exc)}"
            ) from exc
        backend.capabilities = entry.capabilities or Capabilities()
        return backend, why


# --------------------------------------------------------------------------- per process

_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry (discovery runs once)."""
    global _default
    if _default is None:
        _default = Registry()
    return _default


def reset() -> None:
    """Forget the process-wide registry (tests, or after changing VT_* variables)."""
    global _default
    _default = None


def entries() -> list[Entry]:
    return default_registry().entries()


def select(name: str | None = None) -> tuple[Entry, str]:
    return default_registry().select(name)


def create_backend(name: str | None = None) -> tuple[Backend, str]:
    return default_registry().create_backend(name)
