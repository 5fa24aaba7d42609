"""Lets the plugin's tests run from a source checkout where vt-cuda is not pip-installed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("vt_cuda") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
