"""Whether every kernel's machine code is the same in this tree's kernel modules as in an
older commit's kernel source: a check for a change that only moves kernels between parts
or modules (the thirty-first session's groups), before device time is spent on it.

    python plugins/cuda/tools/sass_same.py OLD_COMMIT [--old-module a.cu,b.cu ...]
        [-D VT_Q_FLAGS=0xc00] [--arch sm_90]

No GPU needed (nvrtc and nvdisasm, as ``sass_count.py``). The old commit's parts are read
with ``git show`` and compiled as its modules were (``--old-module``, once a module: its
parts, comma-separated, in the source's order; by default all of them as one unit: a
kernel's code may differ between units, as inlining weighs each unit's call sites); this
tree's as each group of ``vt.gpu.modules.MODULE_GROUPS``. Each kernel's listing is
compared with its labels and nvrtc's numbered internal names taken out. Prints one JSON
object (``same``, ``differ``: the kernels whose code differs, ``missing``: the old
kernels no group declares) and exits 1 if any differs or is missing.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from sass_count import cubin, nvdisasm

_SECTION = re.compile(r"\.text\.(\w+):?\n(.*?)(?=\n\s*\.section|\Z)", re.S)


def listings(sass: str) -> dict[str, list[str]]:
    """Each kernel's instructions in an nvdisasm listing, addresses, labels (``.L_x_12``)
    and nvrtc's numbered internal names (``__internal_7_``) taken out."""
    out = {}
    for m in _SECTION.finditer(sass):
        lines = []
        for line in m.group(2).splitlines():
            line = re.sub(r"/\*[0-9a-fx]+\*/", "", line).strip()
            if line and not line.startswith((".", "//")):  # labels, directives, comments
                line = re.sub(r"\.L_x_\d+", "L", line)
                lines.append(re.sub(r"__internal_\d+_", "__internal_", line))
        out[m.group(1)] = lines
    return out


def machine_code(source: str, options: list[str]) -> dict[str, list[str]]:
    binary, _ = cubin(source, options)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "unit.cubin"
        path.write_bytes(binary)
        done = subprocess.run([nvdisasm(), "-c", str(path)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"sass_same: nvdisasm: {done.stderr}")
    return listings(done.stdout)


ROOT = "core/vt/gpu"


def show(commit: str, path: str) -> str:
    done = subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"sass_same: git show {commit}:{path}: {done.stderr.strip()}")
    return done.stdout


def old_parts(commit: str) -> list[str]:
    """``commit``'s KERNEL_PARTS (in vt.gpu.modules, or vt.gpu.backend before it)."""
    for module in ("modules.py", "backend.py"):
        try:
            text = show(commit, f"{ROOT}/{module}")
        except SystemExit:
            continue
        found = re.search(r"KERNEL_PARTS[^=]*=\s*\(([^)]*)\)", text)
        if found:
            return re.findall(r'"([\w.]+\.cu)"', found.group(1))
    raise SystemExit(f"sass_same: no KERNEL_PARTS in {commit}'s {ROOT}")


def main(argv: list[str] | None = None) -> int:
    from vt.gpu.modules import MODULE_GROUPS, group_of, kernel_source  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("commit")
    p.add_argument("--old-module", action="append", default=[], metavar="A.cu,B.cu")
    p.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--warp", type=int, default=32)
    a = p.parse_args(argv)
    options = [f"--gpu-architecture={a.arch}", f"-DVT_WARP={a.warp}", "-std=c++17"]
    options += [f"-D{d}" for d in a.defines]
    modules = [m.split(",") for m in a.old_module] or [old_parts(a.commit)]
    old: dict[str, list[str]] = {}
    for parts in modules:
        source = "".join(show(a.commit, f"{ROOT}/kernels/{part}") for part in parts)
        for name, code in machine_code(source, options).items():
            old.setdefault(name, code)
    new = {
        group: machine_code(kernel_source(parts), options) for group, parts in MODULE_GROUPS.items()
    }
    same, differ, missing = 0, [], []
    for name, code in sorted(old.items()):
        try:
            now = new[group_of(name)].get(name)
        except ValueError:
            now = None
        if now is None:
            missing.append(name)
        elif now == code:
            same += 1
        else:
            differ.append(name)
    print(json.dumps({"commit": a.commit, "options": options, "same": same, "differ": differ,
                      "missing": missing}))  # fmt: skip
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
