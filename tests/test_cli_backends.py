"""``vt backends`` and ``vt audit``: CliRunner in-process, and real ``vt`` subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
import vt
from click.testing import CliRunner
from venv_support import venv_seeing_this_environment
from vt.frontends.cli import main
from vt.frontends.cli.options import backend_option, open_backend
from vt.management.registry import reset
from vt.testing.tiny import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "vt-example-backend"
CAPS_KEYS = {
    "unified_memory",
    "device_memory_is_host_addressable",
    "host_memory_is_device_addressable",
    "supports_async_sampled_token_readback",
    "async_d2h_copy",
    "events",
    "pinned_host_memory",
    "graphs",
    "vmm",
}


@pytest.fixture
def site(install_dist) -> Path:
    install_dist("vt-test-backends", {"threads_plugin": "vt_test_backends"}, version="1.2.3")
    install_dist("vt-misc", {"misc": "vt_test_misc"})
    install_dist("vt-rule-breaker", {"rule_breaker": "vt_test_rule_breaker"})
    install_dist("vt-import-error", {"import_error": "vt_test_import_error"})
    return install_dist(
        "vt-example-backend",
        {"example": "vt_example_backend"},
        modules={"vt_example_backend": EXAMPLE / "vt_example_backend.py"},
    )


def invoke(args: list[str], **env: str):
    return CliRunner().invoke(main, args, env=env, catch_exceptions=False)


def test_backends_table(site) -> None:
    result = invoke(["backends"], VT_PLUGINS="threads_plugin,misc,rule_breaker,import_error")
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.splitlines()[0].split() == ["NAME", "DISTRIBUTION", "STATUS", "PRIO", "CAPABILITIES"]
    threads = next(line for line in out.splitlines() if line.startswith("threads "))
    assert "vt-test-backends 1.2.3" in threads and "available" in threads
    assert (
        "unified host-addressable async-readback async-d2h events pinned graphs vmm(65536B)"
        in threads
    )
    assert "reason: no absent device found (driver not loaded)" in out
    assert "reason: probe raised OSError: device node /dev/flaky0 vanished" in out
    assert "reason: async-readback-needs-events:" in out
    assert "RuntimeError: this plugin is broken on purpose" in out
    assert out.rstrip().splitlines()[-1].startswith("auto picked 'threads' (priority 5)")


def test_backends_table_shows_overridden_provenance(site) -> None:
    result = invoke(["backends"], VT_PLUGINS="threads_plugin", VT_CAPS="threads:events=0")
    assert "events=off (env: VT_CAPS threads:events=0)" in result.output
    assert "discrete" in result.output


def test_backends_json(site) -> None:
    result = invoke(["backends", "--json"], VT_PLUGINS="threads_plugin,rule_breaker,misc")
    assert result.exit_code == 0
    items = {item["name"]: item for item in json.loads(result.output)}
    for item in items.values():
        assert {"name", "status", "reason", "distribution", "capabilities", "violations"} <= set(
            item
        )
    threads = items["threads"]
    assert threads["status"] == "available" and threads["distribution"] == "vt-test-backends"
    assert set(threads["capabilities"]) == CAPS_KEYS
    assert threads["capabilities"]["vmm"] == {"granularity": 65536, "segments_may_alias": False}
    assert threads["auto"] is True and items["discrete"]["auto"] is False
    assert items["discrete"]["capabilities"]["vmm"] is None
    assert items["hasty"]["status"] == "rejected"
    assert items["hasty"]["violations"][0]["rule"] == "async-readback-needs-events"
    assert items["absent"]["reason"] == "no absent device found (driver not loaded)"
    assert items["flaky"]["capabilities"] is None


def test_backends_with_nothing_available_still_lists_and_explains(site) -> None:
    result = invoke(["backends"], VT_PLUGINS="misc")
    assert result.exit_code == 0
    assert "auto: no backend is available" in result.output


def test_vt_debug_shows_a_broken_plugins_own_traceback(site) -> None:
    plugins = "threads_plugin,import_error"
    quiet = invoke(["backends"], VT_PLUGINS=plugins).output
    assert "Traceback" not in quiet and "traceback" not in quiet
    result = invoke(["backends"], VT_PLUGINS=plugins, VT_DEBUG="1")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    start = lines.index("    traceback (VT_DEBUG):")
    assert lines[start - 2].startswith("import_error ")  # under its entry, after the reason
    assert lines[start + 1] == "      Traceback (most recent call last):"
    block = "\n".join(lines[start:])
    assert 'raise RuntimeError("this plugin is broken on purpose")' in block
    assert "      RuntimeError: this plugin is broken on purpose" in block
    items = {
        i["name"]: i for i in json.loads(invoke(["backends", "--json"], VT_PLUGINS=plugins).output)
    }
    assert "vt_test_import_error.py" in items["import_error"]["traceback"]
    assert "traceback" not in items["threads"]  # only where there is one


def test_bad_vt_debug_is_a_clear_error(site) -> None:
    result = invoke(["backends"], VT_PLUGINS="threads_plugin", VT_DEBUG="loud")
    assert result.exit_code == 1
    assert "Error: VT_DEBUG='loud' is not a boolean; use 0 or 1" in result.output


def test_backends_lists_both_backends_of_one_name_and_auto_says_why(site, install_dist) -> None:
    install_dist("evil-dist", {"evil": "vt_test_evil_cpu"}, version="1.0")
    plugins = "cpu,evil,threads_plugin"
    items = json.loads(invoke(["backends", "--json"], VT_PLUGINS=plugins).output)
    cpus = [i for i in items if i["name"] == "cpu"]
    assert [(i["distribution"], i["plugin"], i["status"]) for i in cpus] == [
        ("vt", "cpu", "rejected"),
        ("evil-dist", "evil", "rejected"),
    ]
    assert all(i["violations"][0]["rule"] == "duplicate-backend-name" for i in cpus)
    assert not any(i["auto"] for i in cpus)
    out = invoke(["backends"], VT_PLUGINS=plugins).output
    rows = [line.split()[:3] for line in out.splitlines() if line.startswith("cpu ")]
    assert rows == [["cpu", "vt", cpus[0]["version"]], ["cpu", "evil-dist", "1.0"]]
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("auto picked 'threads'")
    assert (
        f"cpu: registered by two distributions (vt {cpus[0]['version']}, evil-dist 1.0); "
        "choose one with VT_PLUGINS" in last
    )
    result = invoke(["audit", "--backend", "cpu"], VT_PLUGINS=plugins)
    assert result.exit_code == 1 and "duplicate-backend-name" in result.output


def test_backends_marks_the_emulator_and_auto_passes_it(site) -> None:
    out = invoke(["backends"], VT_PLUGINS="cpu,tt_stub").output
    assert "    emulator: auto never picks it; use --backend tt_stub" in out
    assert "passed over tt_stub (emulator: only chosen by name)" in out.rstrip().splitlines()[-1]
    items = {
        i["name"]: i
        for i in json.loads(invoke(["backends", "--json"], VT_PLUGINS="cpu,tt_stub").output)
    }
    assert items["tt_stub"]["emulated"] is True and items["cpu"]["emulated"] is False
    # Only the emulator: listing still works (exit 0), using auto is an error (exit 1).
    reset()  # the process-wide registry saw the VT_PLUGINS above
    only = invoke(["backends"], VT_PLUGINS="tt_stub")
    assert only.exit_code == 0
    assert "but the emulator tt_stub, which auto never picks" in only.output
    result = invoke(["audit", "--backend", "auto"], VT_PLUGINS="tt_stub")
    assert result.exit_code == 1
    assert "--backend tt_stub or VT_BACKEND=tt_stub" in result.output


def test_bad_vt_caps_is_a_clear_error(site) -> None:
    result = invoke(["backends"], VT_PLUGINS="threads_plugin", VT_CAPS="events=perhaps")
    assert result.exit_code == 1
    assert "Error: VT_CAPS item 'events=perhaps': 'perhaps' is not a boolean" in result.output


def test_audit_named_backend_passes(site) -> None:
    result = invoke(["audit", "--backend", "threads"], VT_PLUGINS="threads_plugin")
    assert result.exit_code == 0, result.output
    assert "PASS  probe  event-ordering" in result.output
    assert "PASS  rule   async-readback-needs-events" in result.output
    assert result.output.rstrip().endswith("audit passed")


def test_audit_json_shape(site) -> None:
    result = invoke(["audit", "--backend", "discrete", "--json"], VT_PLUGINS="threads_plugin")
    assert result.exit_code == 0
    report = json.loads(result.output)
    assert report["ok"] is True
    (backend,) = report["backends"]
    assert backend["name"] == "discrete" and backend["status"] == "available"
    for check in backend["checks"]:
        assert set(check) == {"id", "kind", "result", "detail"}
        assert check["kind"] in ("rule", "probe") and check["result"] in ("pass", "fail", "skip")
    skipped = [c for c in backend["checks"] if c["result"] == "skip"]
    assert skipped and all(c["detail"] for c in skipped)


def test_audit_of_an_unavailable_backend_fails_with_the_reason(site) -> None:
    result = invoke(["audit", "--backend", "absent"], VT_PLUGINS="misc")
    assert result.exit_code == 1
    assert "FAIL  probe  available: unavailable: no absent device found" in result.output
    assert result.output.rstrip().endswith("audit FAILED")


def test_audit_of_everything_fails_on_a_broken_plugin(site) -> None:
    result = invoke(["audit", "--json"], VT_PLUGINS="threads_plugin,import_error")
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["ok"] is False
    assert {b["name"]: b["ok"] for b in report["backends"]} == {
        "threads": True,
        "discrete": True,
        "import_error": False,
    }


def test_the_example_distribution_is_discovered_and_passes_its_audit(site) -> None:
    result = invoke(["audit", "--backend", "example"], VT_PLUGINS="example")
    assert result.exit_code == 0, result.output
    assert "PASS  probe  host-view-roundtrip" in result.output
    listing = json.loads(invoke(["backends", "--json"], VT_PLUGINS="example").output)
    assert listing[0]["distribution"] == "vt-example-backend"
    assert listing[0]["capabilities"]["device_memory_is_host_addressable"] is True


def test_help_texts_explain() -> None:
    out = invoke(["backends", "--help"]).output
    for word in ("available", "unavailable", "rejected", "broken", "VT_PLUGINS", "VT_CAPS"):
        assert word in out
    out = invoke(["audit", "--help"]).output
    assert "Exit status is 0 only" in out and "--backend NAME" in out and "--json" in out


def _leaf_commands(group: click.Group, prefix: list[str]) -> list[list[str]]:
    out = []
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            out += _leaf_commands(command, [*prefix, name])
        else:
            out.append([*prefix, name])
    return out


@pytest.mark.parametrize("path", _leaf_commands(main, []), ids=" ".join)
def test_every_command_help_has_examples(path: list[str]) -> None:
    result = invoke([*path, "--help"])
    assert result.exit_code == 0
    examples = result.output.split("Examples:")[1]  # a section, with at least one `vt ...`
    assert f"vt {' '.join(path)}" in examples.split("Options:")[0]


def test_run_help_names_its_environment_variables() -> None:
    out = invoke(["run", "--help"]).output
    for name in ("VT_BACKEND", "VT_ASYNC_RUNNER", "VT_GRAPHS", "VT_HOME", "VT_DEBUG"):
        assert name in out


@click.command()
@backend_option
def _which(backend: str) -> None:
    instance, why = open_backend(backend)
    click.echo(f"{instance.name}|{why}")


def test_backend_option_default_env_and_errors(site, monkeypatch) -> None:
    monkeypatch.setenv("VT_PLUGINS", "threads_plugin,misc")
    runner = CliRunner()
    assert runner.invoke(_which, []).output.startswith("threads|auto picked 'threads'")
    assert runner.invoke(_which, [], env={"VT_BACKEND": "discrete"}).output.startswith("discrete|")
    assert runner.invoke(_which, ["-b", "discrete"]).output.startswith("discrete|")
    result = runner.invoke(_which, ["--backend", "absent"])
    assert result.exit_code == 1
    assert "Error: backend 'absent' is unavailable: no absent device found" in result.output
    help_text = runner.invoke(_which, ["--help"]).output
    assert "VT_BACKEND" in help_text and "default: auto" in help_text


# --------------------------------------------------------------------------- subprocesses


def vt_command() -> list[str]:
    script = Path(sys.executable).parent / "vt"
    return [str(script)] if script.exists() else [shutil.which("vt") or "vt"]


def run_vt(args: list[str], pythonpath: Path | None = None, **env: str):
    full = {k: v for k, v in os.environ.items() if not k.startswith("VT_")}
    if pythonpath is not None:
        full["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(pythonpath), full.get("PYTHONPATH")])
        )
    full.update(env)
    return subprocess.run(
        vt_command() + args, env=full, capture_output=True, text=True, timeout=120
    )


def test_subprocess_broken_plugin_leaves_cpu_available(site) -> None:
    proc = run_vt(["backends", "--json"], site)
    assert proc.returncode == 0, proc.stderr
    items = {item["name"]: item for item in json.loads(proc.stdout)}
    assert items["import_error"]["status"] == "broken"
    assert "this plugin is broken on purpose" in items["import_error"]["reason"]
    assert items["hasty"]["status"] == "rejected"
    assert items["cpu"]["status"] == "available"
    assert items["threads"]["status"] == "available"


def test_subprocess_selection_by_env_and_unknown_name(site) -> None:
    proc = run_vt(["audit", "--backend", "absent"], site, VT_PLUGINS="misc")
    assert proc.returncode == 1
    assert "no absent device found" in proc.stdout
    proc = run_vt(["backends", "--json"], site, VT_PLUGINS="")
    assert proc.returncode == 0
    assert [item["name"] for item in json.loads(proc.stdout)] == ["cpu"]
    proc = run_vt(["audit", "--backend", "nope"], site)
    assert proc.returncode == 1
    assert "unknown backend 'nope'; installed backends: absent, cpu" in proc.stdout


def test_pip_install_example_into_a_venv_and_run_a_model(tmp_path: Path) -> None:
    """A real ``pip install`` of the example distribution into a fresh venv: vt finds it,
    its audit passes, and ``vt run --backend example`` produces text from a model."""
    python = venv_seeing_this_environment(tmp_path / "venv")
    source = shutil.copytree(EXAMPLE, tmp_path / "src")  # setuptools writes build/ in place
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(source)],
        check=True,
        timeout=300,
    )
    run = [str(python), "-c", "from vt.frontends.cli import main; main()"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VT_")}
    env["VT_HOME"] = str(tmp_path / "home")
    proc = subprocess.run(
        [*run, "backends", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    items = {item["name"]: item for item in json.loads(proc.stdout)}
    assert items["example"]["status"] == "available"
    assert items["example"]["distribution"] == "vt-example-backend"
    assert items["example"]["version"] == "0.1.0"
    assert set(items["example"]["ops"]) == set(vt.OPS)  # every op, from the reference
    proc = subprocess.run(
        [*run, "audit", "--backend", "example"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    proc = subprocess.run(
        [*run, "run", "--backend", "example", "--model", str(model), "--json", "--raw",
         "--temperature", "0", "--max-tokens", "4", "hello"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["ids"]) == 4 and out["backend"] == "example"
