"""Fresh virtual environments for the tests that ``pip install`` real distributions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def venv_seeing_this_environment(root: Path) -> Path:
    """A fresh venv whose Python also sees every site directory of the running one.

    ``--system-site-packages`` would borrow the *base* interpreter's packages, which lack vt
    when the suite itself runs in a venv; a ``.pth`` that calls ``site.addsitedir`` on ours
    works in both cases and keeps editable installs (their own ``.pth`` hooks) working.
    Returns the venv's ``python``.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    lines = [f"import site; site.addsitedir({p!r})" for p in ours]
    (Path(purelib) / "_outer_site.pth").write_text("\n".join(lines) + "\n")
    return python
