"""The conformance kit on the cuda backend with a variant of ``bench_variant.py``'s flags.

    python plugins/cuda/tools/kit_variant.py --add-fused rms_norm_swiglu --norm-late 1 [-- ARGS]

Sets the variant in this process (``bench_variant.apply``), then runs pytest from the
current directory with ``--vt-backend cuda`` and ARGS, so every backend the kit creates has
the variant's settings: what a variant must pass before it becomes a default. Run it from
an empty directory, as the kit's own step does (``h200_checks.sh kitvar`` with
``KITVARS``). Exits with pytest's status.
"""

from __future__ import annotations

import sys

import bench_variant


def main(argv: list[str]) -> int:
    """Apply the leading variant flags; run the kit with the arguments after ``--``."""
    rest = bench_variant.apply(list(argv))
    if rest and rest[0] != "--":
        print(f"kit_variant: not a bench_variant.py flag: {rest[0]!r}", file=sys.stderr)
        return 2
    import pytest

    return int(pytest.main(["-q", "-p", "no:cacheprovider", "-rfE", "--vt-backend", "cuda",
                            *rest[1:]]))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
