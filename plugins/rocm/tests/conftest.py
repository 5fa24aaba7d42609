"""Each test of the ROCm plugin gets its own VT_HOME (compiled kernels are cached there,
vt.gpu.kernel_cache), never the caller's ~/.cache/vt."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _own_vt_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VT_HOME", str(tmp_path / "vt-home"))
