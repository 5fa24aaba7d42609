"""Click options shared by vt's commands."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

BACKEND_HELP = (
    "Backend to run on: a name from `vt backends`, or `auto` for the highest-priority "
    "available one. A named backend that is unavailable, rejected or broken is an error, "
    "never a fallback."
)


def backend_option(func: F) -> F:
    """``--backend NAME`` for any command; unset (None), the registry reads VT_BACKEND
    through vt.envs, else ``auto``, and its reason then says VT_BACKEND chose it."""
    return click.option(
        "--backend",
        "-b",
        "backend",
        default=None,
        metavar="NAME",
        help=BACKEND_HELP + "  [default: auto; env: VT_BACKEND]",
    )(func)


VERIFY_HELP = (
    "Do not run the backend's probes before using it (see `vt audit`). By default they run "
    "once per backend version, device and capabilities, cached in $VT_HOME/verified; a "
    "failing probe refuses the backend.  [env: VT_VERIFY=0]"
)


def verify_option(func: F) -> F:
    """``--no-verify``: skip verifying the backend (``VT_VERIFY=0`` does the same)."""
    return click.option("--no-verify", "no_verify", is_flag=True, help=VERIFY_HELP)(func)


def verify_setting(no_verify: bool) -> bool | None:
    """The ``verify`` argument for ``--no-verify``: False, else None (follow VT_VERIFY)."""
    return False if no_verify else None


def flag_skipped(verification: Any, no_verify: bool) -> Any:
    """``verification``, saying ``--no-verify`` (not ``verify=False``) when the flag skipped it."""
    if no_verify and verification.status == "skipped":
        return verification.model_copy(update={"reason": "--no-verify"})
    return verification


def open_backend(name: str | None, *, no_verify: bool = False) -> tuple[Any, str]:
    """Create and verify the backend ``--backend`` names, as a click error (exit 1) if it
    can't be used (:func:`vt.management.trust.open_verified_backend`).

    Returns ``(backend, why)``; ``why`` says how it was chosen (``vt run`` prints it in its
    summary line).
    """
    from ...errors import VtError
    from ...management.trust import open_verified_backend

    try:
        backend, why, _ = open_verified_backend(name, verify=verify_setting(no_verify))
    except VtError as exc:
        raise click.ClickException(str(exc)) from exc
    return backend, why


def max_batch_tokens_option(func: F) -> F:
    """``--max-batch-tokens N`` (``vt serve``, ``vt bench``): the most tokens in one engine
    step; a longer prompt is prefilled in chunks of this size. Default: the backend's."""
    return click.option(
        "--max-batch-tokens",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Most tokens in one engine step; long prompts are prefilled in chunks of this "
        "size alongside the running requests' decode tokens.  [default: the backend's: "
        "256 on cpu, 512 on cuda and rocm]",
    )(func)
