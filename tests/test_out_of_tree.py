"""Out-of-tree plugins, each its own distribution, pip-installed into a fresh venv.

Issue 8's first check. The honest one is ``docs/examples/vt-example-backend``, built only
from ``docs/plugins.md``; the liars (``tests/dists``) are built the same way, from vt's
public API, numpy and the standard library, and declare capabilities that are consistent
but false, so they pass the load rules. What users rely on: ``vt run`` refuses each liar
when it opens the backend, before a model runs, naming the failing probe and the ``VT_CAPS``
setting that corrects the declaration; that setting makes the liar run like the honest one;
and the honest one runs.

One venv and one ``pip install`` for the whole module: about 9 s of its 13 s.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from venv_support import venv_seeing_this_environment
from vt.testing.tiny import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "vt-example-backend"
DISTS = Path(__file__).resolve().parent / "dists"


class Liar(NamedTuple):
    distribution: str
    probes: tuple[str, ...]  # the probes that must fail
    workaround: str  # the VT_CAPS value the refusal must offer


LIARS = {
    "liar-events": Liar(
        "vt-liar-events", ("event-ordering", "stream-wait-event"), "liar-events:events=0"
    ),
    "liar-vmm-alias": Liar(
        "vt-liar-vmm-alias",
        ("vmm-segments-distinct",),
        "liar-vmm-alias:vmm.segments_may_alias=1",
    ),
    "liar-stale-view": Liar(
        "vt-liar-stale-view", ("host-view-roundtrip",), "liar-stale-view:host_addressable=0"
    ),
}
LINUX_ONLY = {"liar-vmm-alias"}  # real virtual memory: memfd_create and MAP_FIXED
PARAMS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            name in LINUX_ONLY and not sys.platform.startswith("linux"),
            reason="this liar aliases memfd segments (memfd_create is Linux only)",
        ),
    )
    for name in LIARS
]
#: A sampled run, so that ids differ from step to step and a wrong read shows.
RUN = ["--raw", "--json", "--temperature", "1", "--seed", "3", "-n", "16", "--ignore-eos"]


class Venv(NamedTuple):
    python: Path
    model: Path
    env: dict[str, str]  # no VT_* of the caller; a VT_HOME of its own

    def vt(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """``vt ARGS`` in the venv (``python -c``: the venv has no ``vt`` script)."""
        return subprocess.run(
            [str(self.python), "-c", "from vt.frontends.cli import main; main()", *args],
            capture_output=True,
            text=True,
            env={**self.env, **env},
            timeout=120,
        )

    def run(self, backend: str, **env: str) -> subprocess.CompletedProcess[str]:
        return self.vt("run", "--backend", backend, "--model", str(self.model), *RUN, "Hi", **env)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    root = tmp_path_factory.mktemp("out-of-tree")
    python = venv_seeing_this_environment(root / "venv")
    # Copies: setuptools writes build/ and *.egg-info next to the sources.
    sources = [
        shutil.copytree(src, root / "src" / src.name)
        for src in (EXAMPLE, *(DISTS / dist.distribution for dist in LIARS.values()))
    ]
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", *map(str, sources)],
        check=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VT_")}
    env["VT_HOME"] = str(root / "vt-home")
    return Venv(python, write_tiny_gguf(root / "tiny.gguf", tied=False), env)


@pytest.fixture(scope="module")
def honest_ids(venv: Venv) -> list[int]:
    proc = venv.run("example")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["backend"] == "example" and out["verification"].startswith("verified in ")
    return out["ids"]


#: What a plugin may import (docs/plugins.md): vt's public API, numpy, the standard library.
PUBLIC_VT = {"vt", "vt.reference", "vt.gpu"}


@pytest.mark.parametrize("name", list(LIARS))
def test_a_liar_imports_only_what_a_plugin_may(name: str) -> None:
    dist = DISTS / LIARS[name].distribution
    (module,) = dist.glob("*.py")
    found: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = {
        m
        for m in found
        if m not in PUBLIC_VT and m != "numpy" and m.partition(".")[0] not in stdlib
    }
    assert "vt" in found and not bad, f"{module.name} imports {sorted(bad)}"


def test_every_distribution_is_found_and_passes_the_load_rules(venv: Venv) -> None:
    """The liars are consistent: only running them shows the lie."""
    proc = venv.vt("backends", "--json")
    assert proc.returncode == 0, proc.stderr
    items = {item["name"]: item for item in json.loads(proc.stdout)}
    dists = {"example": "vt-example-backend"} | {n: liar.distribution for n, liar in LIARS.items()}
    for name, dist in dists.items():
        if name in LINUX_ONLY and not sys.platform.startswith("linux"):
            continue
        assert items[name]["status"] == "available", items[name]
        assert (items[name]["distribution"], items[name]["version"]) == (dist, "0.1.0")


def test_the_honest_one_runs_a_model(honest_ids: list[int]) -> None:
    assert len(honest_ids) == 16 and len(set(honest_ids)) > 1


@pytest.mark.parametrize("name", PARAMS)
def test_vt_run_refuses_a_liar_at_open(venv: Venv, name: str) -> None:
    liar = LIARS[name]
    proc = venv.run(name)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert f"backend {name!r} ({liar.distribution} 0.1.0) failed verification" in proc.stderr
    for probe in liar.probes:
        assert f"probe {probe}: " in proc.stderr
    assert f"Workaround: VT_CAPS={liar.workaround} corrects the declaration" in proc.stderr


@pytest.mark.parametrize("name", PARAMS)
def test_the_offered_workaround_makes_a_liar_run_like_the_honest_one(
    venv: Venv, honest_ids: list[int], name: str
) -> None:
    proc = venv.run(name, VT_CAPS=LIARS[name].workaround)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["ids"] == honest_ids and out["verification"].startswith("verified in ")
