"""The `dlmrt` command line: one click group, one subcommand per verb, each in its own module."""

from __future__ import annotations

import sys

import click

from dlmrt import __version__
from dlmrt.cli.bench import bench_command
from dlmrt.cli.engines import build_command, inspect_command
from dlmrt.cli.errors import guarded
from dlmrt.cli.evaluate import evaluate
from dlmrt.cli.export import export_command
from dlmrt.cli.generate import generate
from dlmrt.cli.serve import serve_command
from dlmrt.core.home import keep_compiled_steps


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dlmrt")
@click.option("--debug", is_flag=True, help="Show the traceback of an internal error (or set DLMRT_DEBUG=1).")
def main(debug: bool) -> None:
    """dlmrt: fast inference for diffusion language models (LLaDA, LLaDA2.x, ORL)."""


def run() -> None:
    """The installed `dlmrt` command: the group under the guard of last resort."""
    keep_compiled_steps()  # so that a later process compiles nothing
    sys.exit(guarded(main, sys.argv[1:]))


for command in (generate, export_command, evaluate, bench_command, serve_command, build_command, inspect_command):
    main.add_command(command)
