"""Instructions of one of vt's kernels in the machine code nvrtc makes for it, by opcode.

    python plugins/cuda/tools/sass_count.py swiglu_gemv2_q -D VT_Q_FLAGS=0xc00 [-D NAME=V]

No GPU needed: compiles vt's kernel source with nvrtc for ``--arch`` (sm_90), disassembles
the cubin with nvdisasm and prints one JSON object: the kernel's registers a thread (ptxas's
verbose log), its instruction count and the count per opcode (``FADD``, ``I2F``, ...), so a
change to a kernel's arithmetic can be weighed before device time is spent on it
(docs/gpu.md, run 73: the gemv kernels are bound by their instructions more than by the
memory; run 82: more registers, a slower attention). ``-D`` as ``bench_variant.py --kdefine``
(``VT_Q_FLAGS=0xc00``: the module of compact Q8_0's layout). Needs ``pip install
cuda-bindings nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvdisasm`` (or nvdisasm on PATH).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: An instruction line of nvdisasm: ``/*04d0*/  @!P0 I2F.S8 R30, R20 ;``: its opcode.
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def section(sass: str, kernel: str) -> str:
    """``kernel``'s section of an nvdisasm listing."""
    start = sass.find(f".text.{kernel} ")
    if start < 0:
        start = sass.find(f".text.{kernel}\n")
    if start < 0:
        raise KeyError(f"no kernel {kernel!r} in the machine code")
    end = sass.find("//--------------------- .text.", start + 1)
    return sass[start : end if end > 0 else None]


def opcodes(sass: str, kernel: str) -> collections.Counter[str]:
    """Opcodes of ``kernel``'s section of an nvdisasm listing."""
    counts: collections.Counter[str] = collections.Counter()
    for line in section(sass, kernel).splitlines():
        m = _OPCODE.match(line)
        if m:
            counts[m.group(1)] += 1
    return counts


def nvdisasm() -> str:
    """nvdisasm from PATH or from the nvidia-cuda-nvdisasm wheel."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # noqa: PLC0415 - the namespace package of NVIDIA's wheels
    except ImportError:
        nvidia = None
    for root in getattr(nvidia, "__path__", []):
        for path in sorted(Path(root).glob("*/bin/nvdisasm")):
            return str(path)
    raise SystemExit("sass_count: no nvdisasm: pip install nvidia-cuda-nvdisasm")


def cubin(source: str, options: list[str]) -> tuple[bytes, str]:
    """The cubin nvrtc makes of ``source``, and its log (ptxas's, with ``--verbose``)."""
    from cuda.bindings import nvrtc  # noqa: PLC0415

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"vt_kernels.cu", 0, [], [])
    opts = [o.encode() for o in options]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    text = log.decode(errors="replace")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise SystemExit(f"sass_count: nvrtc: {err}\n{text}")
    _, n = nvrtc.nvrtcGetCUBINSize(prog)
    out = b" " * n
    nvrtc.nvrtcGetCUBIN(prog, out)
    return out, text


def registers(log: str, kernel: str) -> int | None:
    """Registers a thread of ``kernel`` by ptxas's verbose log (None if it does not say)."""
    m = re.search(
        rf"entry function '{re.escape(kernel)}'.*?\n[^\n]*?Used (\d+) registers", log, re.S
    )
    return int(m.group(1)) if m else None


def main(argv: list[str] | None = None) -> int:
    from vt.gpu.modules import kernel_source  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kernel", help="the kernel's name, e.g. swiglu_gemv2_q")
    p.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--warp", type=int, default=32)
    p.add_argument("--listing", metavar="FILE", help="also write the kernel's machine code there")
    a = p.parse_args(argv)
    options = [f"--gpu-architecture={a.arch}", f"-DVT_WARP={a.warp}", "-std=c++17",
               "--ptxas-options=--verbose"]  # fmt: skip
    options += [f"-D{d}" for d in a.defines]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vt_kernels.cubin"
        binary, log = cubin(kernel_source(), options)
        path.write_bytes(binary)
        sass = subprocess.run([nvdisasm(), "-c", str(path)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    try:
        counts = opcodes(sass, a.kernel)
    except KeyError as exc:
        raise SystemExit(f"sass_count: {exc.args[0]} (nvrtc compiled it with {options})") from None
    if a.listing:
        Path(a.listing).write_text(section(sass, a.kernel))
    total = sum(counts.values())
    print(json.dumps({"kernel": a.kernel, "arch": a.arch, "defines": a.defines,
                      "registers": registers(log, a.kernel), "instructions": total,
                      "opcodes": dict(counts.most_common())}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
