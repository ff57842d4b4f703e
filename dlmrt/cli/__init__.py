"""The `dlmrt` command: one click group (`main`) and its subcommands; `run` is the installed entry point."""

from dlmrt.cli.commands import main, run

__all__ = ["main", "run"]
