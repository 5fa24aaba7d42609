"""Lets the plugin's tests run from a source checkout where vt-cuda is not pip-installed;
gives each test its own VT_HOME (compiled kernels are cached there, vt.gpu.kernel_cache)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vt_cuda") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(autouse=True)
def _own_vt_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels compiled by a test are cached in its own VT_HOME, never the caller's."""
    monkeypatch.setenv("VT_HOME", str(tmp_path / "vt-home"))
