"""Generic fixtures for vt's tests."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vt import envs

#: Plugin modules vt's own tests install as fake distributions.
TEST_PLUGINS = Path(__file__).parent / "plugins"

#: Every VT_* variable vt declares (vt.envs), except VT_HOME: where the model cache lives.
VT_ENV = tuple(name for name in envs.VARIABLES if name != "VT_HOME")
# The caller's VT_* settings must not leak into any test, including module- and
# session-scoped fixtures that are set up before the function-scoped one below.
for _name in VT_ENV:
    os.environ.pop(_name, None)


@pytest.fixture(autouse=True, scope="session")
def _vt_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One VT_HOME for the session, never the caller's ~/.cache/vt: backends verified
    once stay verified (vt.management.trust's cache), and subprocesses inherit it."""
    with pytest.MonkeyPatch.context() as mp:
        home = tmp_path_factory.mktemp("vt-home")
        mp.setenv("VT_HOME", str(home))
        yield home


@pytest.fixture(autouse=True)
def _clean_vt_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tests see no VT_* variables from the caller and a fresh process-wide registry."""
    from vt.management import registry

    for name in VT_ENV:
        monkeypatch.delenv(name, raising=False)
    registry.reset()
    yield
    registry.reset()


InstallDist = Callable[..., Path]


@pytest.fixture
def install_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InstallDist]:
    """Install a fake distribution (modules + ``.dist-info``) on a fresh sys.path entry.

    ``install_dist(dist, entry_points={ep_name: module}, modules={module: source_path})``
    returns the directory, which also works as PYTHONPATH for a ``vt`` subprocess.
    ``modules`` defaults to ``tests/plugins/<module>.py`` for every entry point.
    """
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    loaded: set[str] = set()

    def install(
        dist: str,
        entry_points: dict[str, str],
        modules: dict[str, Path] | None = None,
        version: str = "1.0",
    ) -> Path:
        if modules is None:
            names = {value.split(":")[0] for value in entry_points.values()}
            modules = {m: TEST_PLUGINS / f"{m}.py" for m in names}
        for module, source in modules.items():
            (root / f"{module}.py").write_text(Path(source).read_text())
            loaded.add(module)
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = ["[vt]", *(f"{ep} = {module}" for ep, module in entry_points.items())]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        importlib.invalidate_caches()
        return root

    yield install
    for module in loaded:
        sys.modules.pop(module, None)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where ``model_support.tiny_path`` writes the tiny GGUFs (once per session)."""
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="module")
def llama(tiny_dir: Path) -> Any:
    """The tiny llama-architecture model (F32 weights), loaded once per test module."""
    from model_support import tiny_path
    from vt.model import load_gguf

    return load_gguf(tiny_path(tiny_dir, "llama"))
