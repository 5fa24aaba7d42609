"""The ``vt`` command line. Each command group lives in its own module."""

from __future__ import annotations

import click

from ... import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vt")
def main() -> None:
    """vt: run GGUF language models on pluggable, capability-checked backends.

    \b
    Quick start:
      vt run "Why is the sky blue?"   fetch the default model and stream an answer
      vt backends                     list backend plugins, their status and capabilities
      vt audit                        prove each declared capability with probes
      vt serve                        an OpenAI-compatible HTTP server on :8000
    Each command's --help has its options and examples; docs/cli.md has them all.
    """


def _register() -> None:
    from . import backends_cmd, model_cmd, run_cmd, serve_cmd

    for module in (backends_cmd, model_cmd, run_cmd, serve_cmd):
        for command in module.COMMANDS:
            main.add_command(command)


_register()
