"""Discovery, isolation, VT_PLUGINS / VT_CAPS / VT_BACKEND, and selection."""

from __future__ import annotations

import pytest
from vt import BackendUnavailableError, CapabilityError, Source
from vt.management.registry import Registry, Status, default_registry, parse_caps_overrides, reset

TEST_PLUGINS = "threads_plugin,rule_breaker,import_error,misc,duplicate"


@pytest.fixture
def dists(install_dist):
    install_dist("vt-test-backends", {"threads_plugin": "vt_test_backends"}, version="1.2.3")
    install_dist("vt-rule-breaker", {"rule_breaker": "vt_test_rule_breaker"})
    install_dist("vt-import-error", {"import_error": "vt_test_import_error"})
    install_dist("vt-misc", {"misc": "vt_test_misc"})
    install_dist("vt-duplicate", {"duplicate": "vt_test_duplicate"}, version="0.9")
    install_dist(
        "vt-hook-errors",
        {
            "raises_in_hook": "vt_test_hook_errors:raises_in_hook",
            "misspelled_hook": "vt_test_hook_errors:misspelled_hook",
            "registers_junk": "vt_test_hook_errors:registers_junk",
            "registers_nothing": "vt_test_hook_errors:registers_nothing",
            "no_hook": "vt_test_hook_errors:no_hook",
        },
    )


def registry(plugins: str = "threads_plugin", **env: str) -> Registry:
    return Registry(env={"VT_PLUGINS": plugins, **env})


def by_name(reg: Registry) -> dict[str, object]:
    return {e.name: e for e in reg.entries()}


def test_discovers_a_distribution_through_its_entry_point(dists) -> None:
    entries = by_name(registry())
    threads = entries["threads"]
    assert threads.status is Status.available
    assert (threads.distribution, threads.version, threads.plugin) == (
        "vt-test-backends",
        "1.2.3",
        "threads_plugin",
    )
    assert threads.priority == 5 and "worker-thread" in threads.description
    assert threads.capabilities.events and threads.capabilities.vmm.granularity == 64 << 10
    # Events need code: derived from the vt.Events mixin, not declared.
    assert threads.capabilities.source_of("events").source is Source.derived
    assert threads.capabilities.source_of("unified_memory").source is Source.declared
    assert entries["discrete"].status is Status.available


def test_rule_breaker_is_rejected_with_the_rule_id_and_never_selected(dists) -> None:
    reg = registry("threads_plugin,rule_breaker")
    hasty = reg.get("hasty")
    assert hasty.status is Status.rejected
    assert [v.rule for v in hasty.violations] == ["async-readback-needs-events"]
    assert "async-readback-needs-events" in hasty.reason
    # Highest priority (50) yet auto skips it.
    entry, why = reg.select("auto")
    assert entry.name == "threads" and "hasty (rejected)" in why
    with pytest.raises(BackendUnavailableError, match="'hasty' is rejected: async-readback"):
        reg.select("hasty")


def test_import_error_marks_only_that_plugin_broken(dists) -> None:
    entries = by_name(registry("threads_plugin,import_error"))
    broken = entries["import_error"]
    assert broken.status is Status.broken
    assert broken.distribution == "vt-import-error"
    assert "RuntimeError: this plugin is broken on purpose" in broken.reason
    assert entries["threads"].status is Status.available


@pytest.mark.parametrize(
    ("plugin", "fragment"),
    [
        ("raises_in_hook", "vt_register_backends raised ValueError: cannot enumerate devices"),
        ("misspelled_hook", "unknown hook 'vt_register_backend'"),
        ("registers_junk", "register() expects a vt.Backend subclass, got 'not a class'"),
        ("registers_nothing", "registered no backend"),
        ("no_hook", "does not implement the vt_register_backends hook"),
    ],
)
def test_hook_mistakes_are_isolated(dists, plugin: str, fragment: str) -> None:
    entries = by_name(registry(f"threads_plugin,{plugin}"))
    assert entries[plugin].status is Status.broken
    assert fragment in entries[plugin].reason
    assert entries["threads"].status is Status.available


def test_probe_that_raises_is_broken_and_unavailable_keeps_its_reason(dists) -> None:
    reg = registry("threads_plugin,misc")
    flaky, absent = reg.get("flaky"), reg.get("absent")
    assert flaky.status is Status.broken
    assert flaky.reason == "probe raised OSError: device node /dev/flaky0 vanished"
    assert absent.status is Status.unavailable
    assert absent.reason == "no absent device found (driver not loaded)"
    with pytest.raises(BackendUnavailableError, match=r"'absent' is unavailable: no absent"):
        reg.select("absent")
    with pytest.raises(BackendUnavailableError, match=r"'flaky' is broken: probe raised OSError"):
        reg.create_backend("flaky")
    assert reg.select("auto")[0].name == "threads"  # priority 1000 but unavailable


def test_a_backend_asked_for_by_name_probes_no_other(dists, monkeypatch) -> None:
    """select(name) before any listing probes only the backends registered under that name
    (a probe may import vendor bindings or open a device: `vt bench --backend cpu` on a ROCm
    machine imported hip-python before); the listing and auto still probe every one, once."""
    import vt_test_misc

    probed: list[str] = []
    for cls in (vt_test_misc.FlakyBackend, vt_test_misc.AbsentBackend):
        real = cls.probe.__func__

        def counted(c, real=real):
            probed.append(c.name)
            return real(c)

        monkeypatch.setattr(cls, "probe", classmethod(counted))
    reg = registry("threads_plugin,misc")
    assert reg.select("threads")[0].name == "threads"
    assert probed == []
    with pytest.raises(BackendUnavailableError, match=r"'absent' is unavailable: no absent"):
        reg.select("absent")
    with pytest.raises(BackendUnavailableError, match=r"'flaky' is broken: probe raised OSError"):
        registry("threads_plugin,misc").select("flaky")
    assert probed == ["absent", "flaky"]
    assert {"absent", "flaky", "threads"} <= {e.name for e in reg.entries()}
    assert probed == ["absent", "flaky", "flaky"]  # reg's listing: flaky, not absent again
    dup = registry("threads_plugin,duplicate")
    with pytest.raises(BackendUnavailableError, match=r"registered by two distributions .*"
                       r"\[duplicate-backend-name\]"):  # fmt: skip
        dup.select("threads")
    with pytest.raises(BackendUnavailableError, match=r"unknown backend 'nope'; installed"):
        dup.select("nope")


def test_duplicate_names_are_both_listed_and_rejected_naming_both_distributions(dists) -> None:
    reg = registry("threads_plugin,duplicate")
    dupes = [e for e in reg.entries() if e.name == "threads"]
    assert [(e.distribution, e.plugin) for e in dupes] == [
        ("vt-duplicate", "duplicate"),
        ("vt-test-backends", "threads_plugin"),
    ]
    for entry in dupes:
        assert entry.status is Status.rejected
        assert [v.rule for v in entry.violations] == ["duplicate-backend-name"]
        assert "vt-test-backends 1.2.3" in entry.reason and "vt-duplicate 0.9" in entry.reason
        assert "VT_PLUGINS" in entry.reason
    with pytest.raises(BackendUnavailableError, match="duplicate-backend-name"):
        reg.select("threads")
    entry, why = reg.select("auto")
    assert entry.name == "discrete"
    assert (
        "passed over threads: registered by two distributions (vt-duplicate 0.9, "
        "vt-test-backends 1.2.3); choose one with VT_PLUGINS" in why
    )
    assert "not available" not in why  # the duplicates are explained once, not as "rejected"


@pytest.fixture
def evil_cpu(install_dist) -> None:
    install_dist("vt-test-backends", {"threads_plugin": "vt_test_backends"}, version="1.2.3")
    install_dist("evil-dist", {"evil": "vt_test_evil_cpu"}, version="1.0")


def test_a_third_party_cpu_does_not_knock_out_auto_and_auto_says_why(evil_cpu) -> None:
    reg = registry("cpu,evil,threads_plugin")
    cpus = [e for e in reg.entries() if e.name == "cpu"]
    vt_version = cpus[0].version
    assert [(e.distribution, e.version) for e in cpus] == [("vt", vt_version), ("evil-dist", "1.0")]
    entry, why = reg.select("auto")  # evil's priority 10000 wins nothing
    assert entry.name == "threads"
    assert (
        f"cpu: registered by two distributions (vt {vt_version}, evil-dist 1.0); "
        "choose one with VT_PLUGINS" in why
    )
    with pytest.raises(BackendUnavailableError) as err:
        reg.select("cpu")
    message = str(err.value)
    assert f"(vt {vt_version}, evil-dist 1.0)" in message
    assert "VT_PLUGINS" in message and "'cpu' or 'evil'" in message
    # The workaround the message names: load only one of the two plugins.
    assert registry("cpu,threads_plugin").select("auto")[0].distribution == "vt"
    assert registry("cpu,threads_plugin").select("cpu")[0].distribution == "vt"


def test_auto_with_only_a_duplicated_name_says_why(evil_cpu) -> None:
    with pytest.raises(BackendUnavailableError) as err:
        registry("cpu,evil").select("auto")
    message = str(err.value)
    assert message.startswith("auto: no backend is available")
    assert "cpu: registered by two distributions (vt " in message
    assert "choose one with VT_PLUGINS" in message


def test_one_plugin_registering_a_name_twice_is_not_told_to_use_vt_plugins(
    install_dist, tmp_path
) -> None:
    source = tmp_path / "vt_test_twice.py"
    source.write_text(
        "import vt\n"
        "class A(vt.Backend):\n    name = 'twin'\n"
        "class B(vt.Backend):\n    name = 'twin'\n"
        "@vt.hookimpl\ndef vt_register_backends(register):\n    register(A)\n    register(B)\n"
    )
    install_dist("vt-twice", {"twice": "vt_test_twice"}, modules={"vt_test_twice": source})
    with pytest.raises(BackendUnavailableError) as err:
        registry("twice").select("twin")
    message = str(err.value)
    assert "registered 2 times by plugin 'twice' (vt-twice 1.0)" in message
    assert "VT_PLUGINS" not in message and "must register it once" in message


def test_auto_never_picks_an_emulator_and_says_so(install_dist, dists) -> None:
    install_dist("vt-emulator", {"emulator": "vt_test_emulator"})
    reg = registry("threads_plugin,emulator")
    chip = reg.get("fakechip")
    assert chip.status is Status.available and chip.emulated  # priority 500
    assert chip.to_json()["emulated"] is True and reg.get("threads").to_json()["emulated"] is False
    entry, why = reg.select("auto")
    assert entry.name == "threads"
    assert "passed over fakechip (emulator: only chosen by name)" in why
    assert reg.select("fakechip")[0] is chip  # by name it is fine
    assert registry("emulator", VT_BACKEND="fakechip").select(None)[0] is not None


def test_auto_with_only_emulators_says_how_to_pick_one(install_dist, dists) -> None:
    install_dist("vt-emulator", {"emulator": "vt_test_emulator"})
    with pytest.raises(BackendUnavailableError) as err:
        registry("emulator,misc").select("auto")
    message = str(err.value)
    assert message.startswith(
        "auto: no backend is available but the emulator fakechip, which auto never picks; "
        "choose it by name (--backend fakechip or VT_BACKEND=fakechip)"
    )
    assert "absent is unavailable: no absent device found" in message


def test_tt_stub_is_an_emulator() -> None:
    reg = Registry(env={"VT_PLUGINS": "cpu,tt_stub"})
    assert reg.get("tt_stub").emulated and not reg.get("cpu").emulated
    entry, why = reg.select("auto")
    assert entry.name == "cpu" and "tt_stub (emulator: only chosen by name)" in why
    with pytest.raises(BackendUnavailableError, match="but the emulator tt_stub"):
        Registry(env={"VT_PLUGINS": "tt_stub"}).select("auto")
    assert Registry(env={"VT_PLUGINS": "tt_stub"}).select("tt_stub")[0].name == "tt_stub"


@pytest.mark.parametrize(
    ("plugins", "name", "lines"),
    [
        ("import_error", "import_error", ['raise RuntimeError("this plugin is broken on']),
        ("raises_in_hook", "raises_in_hook", ["vt_test_hook_errors.py", "ValueError"]),
        ("misc", "flaky", ['raise OSError("device node /dev/flaky0 vanished")']),
    ],
)
def test_a_broken_plugin_keeps_its_own_traceback(dists, plugins, name, lines) -> None:
    reg = registry(f"threads_plugin,{plugins}")
    entry = reg.get(name)
    assert entry.status is Status.broken
    assert entry.traceback.startswith("Traceback (most recent call last):")
    for line in lines:
        assert line in entry.traceback
    # The plugin's frames, not vt's and pluggy's machinery between them.
    assert "registry.py" not in entry.traceback and "pluggy" not in entry.traceback
    assert entry.to_json()["traceback"] == entry.traceback
    assert "traceback" not in reg.get("threads").to_json()  # only when there is one


def test_a_broken_plugin_without_an_exception_has_no_traceback(dists) -> None:
    entry = registry("registers_nothing").get("registers_nothing")
    assert entry.status is Status.broken and entry.traceback == ""


def test_vt_plugins_limits_loading_and_reports_unknown_names(dists) -> None:
    reg = registry("misc,nonesuch")
    names = {e.name: e for e in reg.entries()}
    assert set(names) == {"flaky", "absent", "nonesuch"}
    assert names["nonesuch"].status is Status.unavailable
    assert "VT_PLUGINS names plugin 'nonesuch'" in names["nonesuch"].reason
    with pytest.raises(BackendUnavailableError, match="unknown backend 'threads'.*VT_PLUGINS"):
        reg.select("threads")


def test_empty_vt_plugins_loads_only_the_cpu_plugin(dists) -> None:
    entries = Registry(env={"VT_PLUGINS": ""}).entries()
    assert {e.plugin for e in entries} == {"cpu"}


def test_without_vt_plugins_every_entry_point_is_loaded(dists) -> None:
    plugins = {e.plugin for e in Registry(env={}).entries()}
    assert set(TEST_PLUGINS.split(",")) <= plugins
    assert {"cpu", "tt_stub", "rocm"} <= plugins


def test_vt_caps_overrides_with_env_provenance(dists) -> None:
    reg = registry(VT_CAPS="threads:vmm.segments_may_alias=1,events=off,async_readback=0")
    threads = reg.get("threads")
    caps = threads.capabilities
    assert caps.vmm.segments_may_alias and caps.vmm.granularity == 64 << 10
    assert not caps.events and not caps.supports_async_sampled_token_readback
    prov = caps.source_of("events")
    assert prov.source is Source.env and "events=off" in prov.detail
    assert caps.source_of("vmm").source is Source.env
    assert caps.source_of("unified_memory").source is Source.declared
    assert threads.declared.vmm.segments_may_alias is False  # the declaration is kept
    assert threads.status is Status.available


def test_rules_are_rechecked_on_effective_capabilities(dists) -> None:
    reg = registry("threads_plugin,rule_breaker", VT_CAPS="discrete:async_readback=1")
    discrete = reg.get("discrete")
    assert discrete.status is Status.rejected
    rules = {v.rule for v in discrete.violations}
    assert {"async-readback-needs-events", "async-readback-needs-d2h-path"} <= rules
    # A user may switch off a lying capability: the rejected backend becomes usable.
    fixed = registry("rule_breaker", VT_CAPS="hasty:supports_async_sampled_token_readback=0")
    assert fixed.get("hasty").status is Status.available


def test_vt_caps_turning_vmm_off(dists) -> None:
    caps = registry(VT_CAPS="vmm=off").get("threads").capabilities
    assert caps.vmm is None and caps.source_of("vmm").source is Source.env


def test_vt_caps_bad_granularity_is_a_rule_violation(dists) -> None:
    entry = registry(VT_CAPS="vmm.granularity=3000").get("threads")
    assert entry.status is Status.rejected
    assert [v.rule for v in entry.violations] == ["vmm-granularity-power-of-two"]


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("events", "not of the form name=value"),
        ("events=maybe", "'maybe' is not a boolean"),
        ("warp_drive=1", "unknown capability 'warp_drive'"),
        ("vmm=on", "vmm can only be turned off"),
        ("vmm.granularity=big", "granularity must be an integer"),
    ],
)
def test_vt_caps_errors_name_the_problem(spec: str, fragment: str) -> None:
    with pytest.raises(CapabilityError, match="VT_CAPS item") as err:
        parse_caps_overrides(spec)
    assert fragment in str(err.value)
    with pytest.raises(CapabilityError, match="VT_CAPS"):
        Registry(env={"VT_CAPS": spec, "VT_PLUGINS": "nothing"}).entries()


def test_parse_caps_accepts_spaces_aliases_and_prefixes() -> None:
    items = parse_caps_overrides(" pinned = yes , cpu:vmm=none,,vmm.granularity=0x1000 ")
    assert [(o.backend, o.field, o.value) for o in items] == [
        (None, "pinned_host_memory", True),
        ("cpu", "vmm", None),
        (None, "vmm.granularity", 4096),
    ]


def test_auto_picks_highest_priority_and_says_why(dists) -> None:
    entry, why = registry("threads_plugin,misc").select("auto")
    assert entry.name == "threads"
    assert "auto picked 'threads' (priority 5)" in why
    assert "also available: discrete (1)" in why
    assert "absent (unavailable)" in why and "flaky (broken)" in why


def test_none_reads_vt_backend_but_auto_does_not(dists) -> None:
    reg = registry(VT_BACKEND="discrete")
    entry, why = reg.select(None)
    assert entry.name == "discrete" and "VT_BACKEND" in why
    assert reg.select("auto")[0].name == "threads"
    assert registry().select(None)[0].name == "threads"  # unset VT_BACKEND means auto


def test_vt_backend_naming_an_unusable_backend_fails_without_fallback(dists) -> None:
    with pytest.raises(BackendUnavailableError, match="'absent' is unavailable"):
        registry("threads_plugin,misc", VT_BACKEND="absent").select(None)


def test_unknown_backend_lists_installed_ones(dists) -> None:
    with pytest.raises(BackendUnavailableError, match="unknown backend 'gpu9'.*discrete, threads"):
        registry().select("gpu9")


def test_auto_with_nothing_available_explains_each(dists) -> None:
    with pytest.raises(BackendUnavailableError) as err:
        registry("misc").select("auto")
    message = str(err.value)
    assert "no backend is available" in message
    assert "absent is unavailable: no absent device" in message
    assert "flaky is broken" in message


def test_create_backend_sets_effective_capabilities(dists) -> None:
    reg = registry(VT_CAPS="threads:events=0,threads:async_readback=0")
    backend, why = reg.create_backend("threads")
    assert type(backend).__name__ == "ThreadBackend"
    assert backend.capabilities is reg.get("threads").capabilities
    assert not backend.capabilities.events
    assert "'threads' was asked for by --backend" == why


def test_discovery_is_cached_and_fresh_registries_rediscover(dists, monkeypatch) -> None:
    reg = registry()
    assert reg.entries()[0] is reg.entries()[0]
    monkeypatch.setenv("VT_PLUGINS", "misc")
    assert default_registry() is default_registry()
    assert {e.name for e in default_registry().entries()} == {"flaky", "absent"}
    monkeypatch.setenv("VT_PLUGINS", "threads_plugin")
    assert {e.name for e in default_registry().entries()} == {"flaky", "absent"}  # cached
    reset()
    assert {e.name for e in default_registry().entries()} == {"threads", "discrete"}


def test_two_distributions_with_one_entry_point_name(install_dist) -> None:
    install_dist("vt-first", {"samename": "vt_test_misc"})
    install_dist("vt-second", {"samename": "vt_test_duplicate"})
    entries = Registry(env={"VT_PLUGINS": "samename"}).entries()
    broken = [e for e in entries if e.status is Status.broken]
    assert len(broken) == 1
    assert "plugin name 'samename' is also provided by distribution vt-" in broken[0].reason
    assert any(e.status is not Status.broken for e in entries)
