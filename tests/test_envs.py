"""vt.envs: one declaration per VT_* variable, one boolean parser, values read when used."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from vt import envs
from vt.envs import EnvError

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bVT_[A-Z][A-Z0-9_]*\b")
READS = re.compile(r"os\.environ|getenv\(|envvar=")

#: VT_ names that are not vt settings, and why.
NOT_SETTINGS = {
    "VT_GPU_CHECKS_OUT": "where plugins/cuda/tests/gpu_checks.py writes its results (a test "
    "script's own output path, not a setting of vt)",
    "VT_MMA_SW1_BLOCKS": "a kernel define docs/gpu.md's runs 166-173 measured, replaced by the "
    "kernel swiglu_mma1w_q8a in the thirty-eighth session (history, not a setting)",
}

#: Files that still read VT_* variables themselves instead of through vt.envs (their owners
#: switch them); the list may only shrink.
#: Files that still read VT_* themselves (each entry says which); may only shrink.
PENDING: dict[str, str] = {}


def _kernel_macros() -> set[str]:
    """Preprocessor names of the GPU kernels (VT_WARP, VT_HIP, ...): not environment."""
    out: set[str] = set()
    for source in ROOT.glob("core/**/*.cu"):
        out |= set(re.findall(r"#\s*(?:define|ifdef|ifndef)\s+(VT_\w+)", source.read_text()))
    return out | {"VT_WARP"}  # passed as -DVT_WARP=N by vt.gpu


def _sources() -> list[Path]:
    files = [ROOT / "README.md", *ROOT.glob("docs/**/*.md")]
    for top in ("core", "plugins"):
        for suffix in ("py", "md", "toml", "txt"):
            files += ROOT.glob(f"{top}/**/*.{suffix}")
    return [f for f in files if "build" not in f.parts and ".egg-info" not in str(f)]


def test_every_vt_variable_mentioned_in_core_plugins_or_docs_is_declared() -> None:
    ignored = _kernel_macros() | set(NOT_SETTINGS)
    undeclared: dict[str, set[str]] = {}
    for path in _sources():
        for name in set(NAME.findall(path.read_text(errors="replace"))):
            if name not in envs.VARIABLES and name not in ignored:
                undeclared.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert not undeclared, f"declare these in core/vt/envs.py: {undeclared}"


def test_only_vt_envs_reads_vt_variables_apart_from_known_pending_callers() -> None:
    readers = set()
    for top in ("core/vt", "plugins"):
        for path in ROOT.glob(f"{top}/**/*.py"):
            rel = str(path.relative_to(ROOT))
            if "tests" in path.parts or rel == "core/vt/envs.py":
                continue
            text = path.read_text()
            if READS.search(text) and set(NAME.findall(text)) & set(envs.VARIABLES):
                readers.add(rel)
    new = readers - set(PENDING)
    assert not new, f"read VT_* through vt.envs.get() instead: {sorted(new)}"
    stale = set(PENDING) - readers
    assert not stale, f"these no longer read VT_* themselves; drop them from PENDING: {stale}"


def test_docs_table_is_the_generated_one() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text.split("## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    assert table == envs.markdown_table(), "regenerate it with: python -m vt.envs"
    for name in envs.VARIABLES:
        assert f"`{name}`" in table


def test_the_tests_clear_every_declared_variable_but_vt_home(
    request: pytest.FixtureRequest,
) -> None:
    here = Path(__file__).with_name("conftest.py")
    (conftest,) = [
        p
        for p in request.config.pluginmanager.get_plugins()
        if getattr(p, "__file__", "") == str(here)
    ]
    assert set(conftest.VT_ENV) == set(envs.VARIABLES) - {"VT_HOME"}


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", True), ("ON", True), (" yes ", True), ("true", True), ("0", False), ("Off", False)],
)
def test_one_boolean_spelling(text: str, value: bool) -> None:
    assert envs.parse_bool(text) is value
    assert envs.get("VT_GRAPHS", {"VT_GRAPHS": text}) is value
    assert envs.parse_bool("maybe") is None


@pytest.mark.parametrize("name", ["VT_GRAPHS", "VT_ASYNC_RUNNER", "VT_VERIFY", "VT_DEBUG"])
def test_a_bad_boolean_is_an_error_naming_the_variable(name: str) -> None:
    with pytest.raises(EnvError, match=f"{name}='maybe' is not a boolean; use 0 or 1"):
        envs.get(name, {name: "maybe"})
    assert isinstance(EnvError("x"), ValueError)  # callers that caught ValueError still do


def test_defaults_and_types() -> None:
    assert envs.get("VT_GRAPHS", {}) is True and envs.get("VT_DEBUG", {}) is False
    assert envs.get("VT_VERIFY", {}) is True and envs.get("VT_ASYNC_RUNNER", {}) is True
    assert envs.get("VT_BACKEND", {}) == "auto" and envs.get("VT_CAPS", {}) == ""
    assert envs.get("VT_HOME", {}) == Path("~/.cache/vt").expanduser()
    assert envs.get("VT_HOME", {"VT_HOME": "/x/y"}) == Path("/x/y")
    assert envs.get("VT_MODEL_WHEEL", {}) is None
    assert envs.get("VT_CPU_VMM_GRANULARITY", {"VT_CPU_VMM_GRANULARITY": "0x10000"}) == 65536
    with pytest.raises(EnvError, match="VT_CPU_VMM_GRANULARITY='big' is not an integer"):
        envs.get("VT_CPU_VMM_GRANULARITY", {"VT_CPU_VMM_GRANULARITY": "big"})


def test_blank_is_unset_except_for_vt_plugins() -> None:
    assert envs.get("VT_GRAPHS", {"VT_GRAPHS": " "}) is True
    assert envs.bool_with_reason("VT_GRAPHS", {"VT_GRAPHS": ""}) == (True, "default")
    assert envs.get("VT_PLUGINS", {}) is None  # every plugin
    assert envs.get("VT_PLUGINS", {"VT_PLUGINS": ""}) == []  # only cpu (the registry says)
    assert envs.get("VT_PLUGINS", {"VT_PLUGINS": " a, ,b "}) == ["a", "b"]


def test_values_are_read_when_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VT_GRAPHS", "off")
    assert envs.VT_GRAPHS is False
    assert envs.bool_with_reason("VT_GRAPHS") == (False, "VT_GRAPHS=off")
    monkeypatch.setenv("VT_GRAPHS", "1")
    assert envs.VT_GRAPHS is True
    with pytest.raises(AttributeError):
        envs.VT_NOT_A_SETTING  # noqa: B018
