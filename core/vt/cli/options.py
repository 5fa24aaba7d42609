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
    """``--backend NAME`` (env VT_BACKEND, default ``auto``) for any command."""
    return click.option(
        "--backend",
        "-b",
        "backend",
        envvar="VT_BACKEND",
        default="auto",
        show_default=True,
        show_envvar=True,
        metavar="NAME",
        help=BACKEND_HELP,
    )(func)


def open_backend(name: str) -> tuple[Any, str]:
    """Create the backend ``--backend`` names, as a click error (exit 1) if it can't be used.

    Returns ``(backend, why)``; ``why`` says how it was chosen (``vt run`` prints it in its
    summary line).
    """
    from ..errors import VtError
    from ..registry import create_backend

    try:
        return create_backend(name)
    except VtError as exc:
        raise click.ClickException(str(exc)) from exc
