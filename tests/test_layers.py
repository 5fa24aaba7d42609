"""core/vt's folders are layers: a lower layer never imports a higher one.

Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "core"

#: package -> the vt packages it must not import (prefix match).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "vt.protocol": ("vt.management", "vt.execution", "vt.frontends", "vt.model", "vt.testing"),
    "vt.management": ("vt.frontends", "vt.execution.runner", "vt.execution.readback"),
    "vt.execution": ("vt.management", "vt.frontends", "vt.testing"),
    "vt.model": ("vt.management", "vt.execution", "vt.frontends", "vt.testing"),
    "vt.reference": ("vt.management", "vt.execution", "vt.frontends", "vt.model"),
    "vt.gpu": ("vt.management", "vt.execution", "vt.frontends", "vt.model", "vt.testing"),
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(CORE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every vt module ``path`` imports, absolute."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("vt.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod == "vt" or mod.startswith("vt."):
                out.add(mod)
                out |= {f"{mod}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_higher_ones(package: str) -> None:
    root = CORE / Path(*package.split("."))
    assert root.is_dir(), package
    bad = []
    for path in sorted(root.rglob("*.py")):
        for mod in sorted(imports_of(path)):
            if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(CORE)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_every_module_sits_in_a_layer_or_is_cross_cutting() -> None:
    """Nothing new lands flat in core/vt besides the cross-cutting modules."""
    flat = {p.name for p in (CORE / "vt").glob("*.py")}
    assert flat == {"__init__.py", "errors.py", "envs.py"}
