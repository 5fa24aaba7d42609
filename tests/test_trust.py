"""Verified before trusted (``vt.management.trust``): probes before a model runs, cached per
identity.

What users rely on: a backend is probed once per (backend, version, device, capabilities)
and then read from ``$VT_HOME/verified``; a liar is refused at open with the failing probe
and a ``VT_CAPS`` workaround that works; ``--no-verify`` / ``VT_VERIFY=0`` skip it and say
so; a broken or unwritable cache never stops a run.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import vt
from click.testing import CliRunner, Result
from vt.frontends.cli import main
from vt.management import audit, trust
from vt.management.registry import Entry, Status
from vt.management.trust import BackendIdentity, VerificationRecord, open_verified_backend
from vt.testing.tiny import write_tiny_gguf

InstallDist = Callable[..., Path]
TEST_PLUGINS = Path(__file__).parent / "plugins"
LIARS = {
    "vt_test_liars": TEST_PLUGINS / "vt_test_liars.py",
    "vt_test_backends": TEST_PLUGINS / "vt_test_backends.py",
}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A VT_HOME of this test's own."""
    root = tmp_path / "vt-home"
    monkeypatch.setenv("VT_HOME", str(root))
    return root


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the backends vt.management.audit.probe_backend ran on, in order."""
    seen: list[str] = []
    real = audit.probe_backend

    def counting(backend: vt.Backend) -> list[audit.Check]:
        seen.append(backend.name)
        return real(backend)

    monkeypatch.setattr(audit, "probe_backend", counting)
    return seen


@pytest.fixture
def liars(install_dist: InstallDist) -> Path:
    return install_dist("vt-test-liars", {"liars": "vt_test_liars"}, LIARS, version="2.0")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("trust") / "tiny.gguf", tied=False)


def open_and_close(name: str, **kw: object) -> trust.Verification:
    backend, _, verification = open_verified_backend(name, **kw)  # type: ignore[arg-type]
    backend.close()
    return verification


def cached_files(home: Path) -> list[Path]:
    return sorted((home / "verified").glob("*.json"))


def vt_cli(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


# --------------------------------------------------------------------------- the cache


def test_first_open_probes_and_the_second_reads_the_cache(home: Path, probes: list[str]) -> None:
    first = open_and_close("cpu")
    assert first.status == "verified" and probes == ["cpu"]
    assert first.summary().startswith("verified in ") and first.summary().endswith(" s")
    second = open_and_close("cpu")
    assert second.status == "cached" and second.summary() == "verified (cached)"
    assert probes == ["cpu"]  # not probed again
    (path,) = cached_files(home)
    assert path == first.path == second.path and path.name.startswith("cpu-")
    record = VerificationRecord.model_validate_json(path.read_text())
    assert record.ok and record.identity.backend == "cpu" and record.identity.distribution
    assert {c.id for c in record.checks} >= {"memory-roundtrip", "event-ordering"}
    assert not list((home / "verified").glob(".*"))  # no temporary file left behind


def test_vt_caps_changes_the_key(home: Path, probes: list[str], monkeypatch) -> None:
    open_and_close("cpu")
    monkeypatch.setenv("VT_CAPS", "cpu:graphs=0")
    vt.management.registry.reset()
    changed = open_and_close("cpu")
    assert changed.status == "verified" and probes == ["cpu", "cpu"]
    assert changed.record is not None and changed.record.identity.capabilities["graphs"] is False
    assert len(cached_files(home)) == 2
    monkeypatch.delenv("VT_CAPS")
    vt.management.registry.reset()
    assert open_and_close("cpu").status == "cached" and len(probes) == 2


def test_a_new_plugin_version_verifies_again(
    home: Path, probes: list[str], install_dist: InstallDist
) -> None:
    site = install_dist("vt-test-backends", {"threads_plugin": "vt_test_backends"})
    assert open_and_close("discrete").status == "verified"
    assert open_and_close("discrete").status == "cached"
    (site / "vt_test_backends-1.0.dist-info").rename(site / "vt_test_backends-1.1.dist-info")
    meta = site / "vt_test_backends-1.1.dist-info" / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 1.0", "Version: 1.1"))
    vt.management.registry.reset()
    again = open_and_close("discrete")
    assert again.status == "verified" and again.record is not None
    assert again.record.identity.version == "1.1" and probes == ["discrete", "discrete"]


def test_every_part_of_the_identity_is_in_the_key() -> None:
    base = BackendIdentity(
        backend="cpu",
        distribution="vt",
        version="0.1.0",
        device="host CPU",
        capabilities={"events": True},
        vt_version="0.1.0",
    )
    changes = {
        "backend": "cpu2",
        "distribution": "vt-other",
        "version": "0.1.1",
        "device": "another CPU",
        "capabilities": {"events": False},
        "vt_version": "0.2.0",
    }
    keys = {base.key()} | {base.model_copy(update={k: v}).key() for k, v in changes.items()}
    assert len(keys) == 1 + len(changes)


def test_a_corrupt_cache_file_is_ignored_and_rewritten(
    home: Path, probes: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    path = open_and_close("tt_stub").path
    assert path is not None
    for junk in ("{not json", json.dumps({"format": 1, "identity": "?"}), ""):
        path.write_text(junk)
        with caplog.at_level(logging.WARNING, logger="vt.management.trust"):
            assert open_and_close("tt_stub").status == "verified"
        assert "verifying again" in caplog.text
        assert VerificationRecord.model_validate_json(path.read_text()).ok  # rewritten
        caplog.clear()
    assert probes == ["tt_stub"] * 4


def test_a_record_of_another_identity_is_not_trusted(home: Path, probes: list[str]) -> None:
    path = open_and_close("tt_stub").path
    assert path is not None
    record = VerificationRecord.model_validate_json(path.read_text())
    other = record.identity.model_copy(update={"device": "a different card"})
    path.write_text(record.model_copy(update={"identity": other}).model_dump_json())
    assert open_and_close("tt_stub").status == "verified" and len(probes) == 2


def test_an_unwritable_vt_home_warns_and_still_runs(
    tmp_path: Path, monkeypatch, probes: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("VT_HOME", str(blocker / "vt"))  # fails even as root
    with caplog.at_level(logging.WARNING, logger="vt.management.trust"):
        first = open_and_close("tt_stub")
    assert first.status == "verified" and first.cache_error
    assert first.summary().endswith("(not cached)")
    assert "cannot cache the verification of backend 'tt_stub'" in caplog.text
    assert "VT_HOME" in caplog.text
    assert open_and_close("tt_stub").status == "verified" and len(probes) == 2


def test_two_processes_verifying_at_once_both_succeed(home: Path) -> None:
    # Threads stand in for processes: each probes its own instance and replaces the file.
    results: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            backend, _ = vt.management.registry.Registry().create_backend("tt_stub")
            entry = vt.management.registry.Registry().get("tt_stub")
            assert entry is not None
            try:
                results.append(trust.verify_backend(backend, entry).status)
            finally:
                backend.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 8
    (path,) = cached_files(home)
    assert VerificationRecord.model_validate_json(path.read_text()).ok
    assert not list((home / "verified").glob(".*"))


# --------------------------------------------------------------------------- skipping


def test_vt_verify_0_skips_and_says_so(home: Path, probes: list[str], monkeypatch) -> None:
    monkeypatch.setenv("VT_VERIFY", "0")
    skipped = open_and_close("cpu")
    assert skipped.status == "skipped"
    assert skipped.summary() == "verification skipped (VT_VERIFY=0)"
    assert open_and_close("cpu", verify=True).status == "verified"  # the argument wins
    assert probes == ["cpu"]
    monkeypatch.setenv("VT_VERIFY", "maybe")
    with pytest.raises(vt.VtError, match="VT_VERIFY='maybe' is not a boolean"):
        open_and_close("cpu")


def test_verify_false_skips_and_says_so(home: Path, probes: list[str]) -> None:
    skipped = open_and_close("cpu", verify=False)
    assert skipped.summary() == "verification skipped (verify=False)"
    assert probes == [] and not cached_files(home)


def test_llm_verifies_before_loading_and_reports_it(home: Path, tiny: Path) -> None:
    with vt.LLM(model=tiny, backend="tt_stub") as llm:
        assert llm.verification.status == "verified"
    with vt.LLM(model=tiny, backend="tt_stub") as llm:
        assert llm.verification.summary() == "verified (cached)"
    with vt.LLM(model=tiny, backend="tt_stub", verify=False) as llm:
        assert llm.verification.summary() == "verification skipped (verify=False)"


# --------------------------------------------------------------------------- refusing liars


def test_a_liar_is_refused_with_the_probe_and_a_working_workaround(
    home: Path, liars: Path, probes: list[str], monkeypatch
) -> None:
    with pytest.raises(vt.BackendVerificationError) as info:
        open_and_close("fake-events")
    err = info.value
    assert isinstance(err, vt.BackendUnavailableError)  # callers catching that still do
    message = str(err)
    assert "backend 'fake-events' (vt-test-liars 2.0) failed verification" in message
    assert "probe event-ordering: work recorded before the event had not finished" in message
    # Async readback needs events, so the workaround turns it off as well.
    fix = "fake-events:events=0,fake-events:async_readback=0"
    assert err.workaround == fix and f"VT_CAPS={fix} corrects the declaration" in message
    assert {c.id for c in err.failed} >= {"event-ordering"}
    # The failure is cached: refused again at once, without probing.
    with pytest.raises(vt.BackendVerificationError, match=r"failed verification \(cached on"):
        open_and_close("fake-events")
    assert probes == ["fake-events"]
    # ... and the workaround changes the key, verifies again, and passes.
    monkeypatch.setenv("VT_CAPS", fix)
    vt.management.registry.reset()
    assert open_and_close("fake-events").status == "verified"
    assert probes == ["fake-events", "fake-events"]


def test_the_workaround_keeps_the_callers_vt_caps(home: Path, liars: Path, monkeypatch) -> None:
    monkeypatch.setenv("VT_CAPS", "cpu:graphs=0")
    with pytest.raises(vt.BackendVerificationError) as info:
        open_and_close("cpu-stale-view")
    assert "VT_CAPS=cpu:graphs=0,cpu-stale-view:host_addressable=0 corrects" in str(info.value)


@pytest.mark.parametrize(
    ("name", "probe", "fix"),
    [
        ("cpu-fake-events", "event-ordering", "events=0,cpu-fake-events:async_readback=0"),
        ("cpu-aliasing", "vmm-segments-distinct", "vmm.segments_may_alias=1"),
        ("cpu-stale-view", "host-view-roundtrip", "host_addressable=0"),
        ("fake-events", "event-ordering", "events=0,fake-events:async_readback=0"),
    ],
)
def test_vt_run_refuses_a_liar_at_open(
    home: Path, liars: Path, tiny: Path, name: str, probe: str, fix: str
) -> None:
    res = vt_cli("run", "--model", str(tiny), "--backend", name, "--raw", "-n", "4", "Hi")
    assert res.exit_code == 1 and res.stdout == ""
    assert f"backend {name!r} (vt-test-liars 2.0) failed verification" in res.stderr
    assert f"probe {probe}: " in res.stderr
    assert f"VT_CAPS={name}:{fix} corrects the declaration" in res.stderr


@pytest.mark.parametrize(
    ("name", "fix"),
    [
        ("cpu-fake-events", "events=0,async_readback=0"),
        ("cpu-aliasing", "vmm.segments_may_alias=1"),
        ("cpu-stale-view", "host_addressable=0"),
    ],
)
def test_with_the_workaround_a_liar_runs_like_cpu(
    home: Path, liars: Path, tiny: Path, name: str, fix: str, monkeypatch
) -> None:
    args = ["run", "--model", str(tiny), "--raw", "-n", "12", "--ignore-eos", "--json", "Hi"]
    honest = vt_cli(*args, "--backend", "cpu")
    assert honest.exit_code == 0, honest.output
    monkeypatch.setenv("VT_CAPS", ",".join(f"{name}:{item}" for item in fix.split(",")))
    vt.management.registry.reset()  # as a new process would: discovery reads VT_CAPS
    fixed = vt_cli(*args, "--backend", name)
    assert fixed.exit_code == 0, fixed.output
    assert json.loads(fixed.stdout)["ids"] == json.loads(honest.stdout)["ids"]
    assert json.loads(fixed.stdout)["verification"].startswith("verified in ")


def test_a_core_failure_has_no_vt_caps_workaround() -> None:
    caps = vt.Capabilities()
    failed = [audit.Check(id="memory-roundtrip", kind="probe", result="fail", detail="x")]
    assert trust.workaround("b", caps, failed) is None
    vmm = [
        audit.Check(id=i, kind="probe", result="fail", detail="x")
        for i in ("vmm-segments-distinct", "vmm-over-reserve")
    ]
    assert trust.workaround("b", caps, vmm) == "b:vmm=off"  # off covers the full-map fix


def test_every_probe_id_is_mapped_or_core() -> None:
    """A new probe must say which VT_CAPS setting stops it (or be core) for the refusal."""
    core = {"memory-roundtrip", "host-view-refused", "sync-readback"}
    ids: set[str] = set()
    for name in ("cpu", "tt_stub"):
        backend, _ = vt.management.registry.create_backend(name)
        try:
            ids |= {c.id for c in audit.probe_backend(backend)}
        finally:
            backend.close()
    unmapped = {i for i in ids - core if not trust._settings_for(i)}
    assert not unmapped, (
        f"add these probe ids to vt.management.trust.PROBE_SETTINGS: {sorted(unmapped)}"
    )


# --------------------------------------------------------------------------- the CLI


def test_vt_run_summary_says_verified_then_cached(home: Path, tiny: Path) -> None:
    args = ["run", "--model", str(tiny), "--backend", "cpu", "--raw", "-n", "2", "Hi"]
    first, second = vt_cli(*args), vt_cli(*args)
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    assert " | verified in " in first.stderr
    assert " | verified (cached) | readback " in second.stderr


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--no-verify"], {}, "verification skipped (--no-verify)"),
        ([], {"VT_VERIFY": "0"}, "verification skipped (VT_VERIFY=0)"),
    ],
)
def test_vt_run_skips_verification_and_says_so(
    home: Path, tiny: Path, probes: list[str], args: list[str], env: dict, said: str
) -> None:
    res = vt_cli("run", "--model", str(tiny), "-b", "cpu", "--raw", "-n", "2", *args, "Hi", env=env)
    assert res.exit_code == 0, res.output
    assert f" | {said} | readback " in res.stderr
    assert probes == [] and not cached_files(home)


def test_vt_bench_reports_and_skips_verification(home: Path, tiny: Path) -> None:
    args = ["bench", "--model", str(tiny), "-b", "tt_stub", "--prompt-tokens", "4"]
    args += ["--gen-tokens", "2", "--repeat", "1"]
    res = vt_cli(*args)
    assert res.exit_code == 0, res.output
    assert "verified in " in res.stdout.splitlines()[1]  # the backend line
    res = vt_cli(*args, "--no-verify", "--json")
    assert res.exit_code == 0, res.output
    verification = json.loads(res.stdout)["verification"]
    assert verification["status"] == "skipped" and verification["reason"] == "--no-verify"


def test_vt_serve_has_the_option_and_prints_the_verification(home: Path, tiny: Path) -> None:
    from vt.frontends.cli.serve_cmd import startup_lines
    from vt.frontends.server import Server

    assert "--no-verify" in vt_cli("serve", "--help").output
    with vt.LLM(model=tiny, backend="tt_stub", max_slots=1) as llm:
        server = Server(llm, port=0)
        try:
            lines = startup_lines(llm, server, 1, 16)
            unset = startup_lines(llm, server, 1, None)  # the runner's resolved value
        finally:
            server.sock.close()
    assert " | verified in " in lines[1]
    assert f" | {llm.runner.max_batch_tokens} tokens per step | " in unset[0]


def test_the_real_home_is_not_touched() -> None:
    """The suite's VT_HOME is a temporary directory (tests/conftest.py)."""
    assert trust.verified_dir() != Path.home() / ".cache" / "vt" / "verified"


def test_entry_fields_feed_the_identity() -> None:
    backend, _ = vt.management.registry.create_backend("tt_stub")
    try:
        entry = Entry(
            name="tt_stub", status=Status.available, distribution="d", version="9", device="x"
        )
        identity = trust.identify(backend, entry)
    finally:
        backend.close()
    assert (identity.distribution, identity.version, identity.device) == ("d", "9", "x")
    assert identity.capabilities == backend.capabilities.summary()


def test_turning_host_addressability_off_is_verified_as_such(home: Path, monkeypatch) -> None:
    """VT_CAPS=cpu:host_addressable=0: vt's core refuses host_view from then on, and the
    probe that wants it refused passes (the stale-view workaround relies on it)."""
    monkeypatch.setenv("VT_CAPS", "cpu:host_addressable=0")
    verification = open_and_close("cpu")
    assert verification.record is not None
    (check,) = [c for c in verification.record.checks if c.id == "host-view-refused"]
    assert check.result == "pass"
