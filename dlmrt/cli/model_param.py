"""The model a command runs, given as a positional MODEL (vLLM's habit: `dlmrt serve MODEL`) or as
`--model MODEL` (the older spelling, kept so that scripts keep working)."""

from __future__ import annotations

import functools
from pathlib import Path

import click
from click.core import ParameterSource


def model_param(dest: str = "model_dir", *, help: str, metavar: str = "MODEL", path: bool = True):
    """Adds `[MODEL]` and `--model MODEL`, both optional, into the callback's `dest`; both at once is a
    usage error unless they agree."""
    kind = click.Path(path_type=Path) if path else click.STRING
    positional = f"{dest}_positional"

    def decorate(callback):
        @functools.wraps(callback)
        def merged(*args, **kwargs):
            given = kwargs.pop(positional)
            if given is not None:
                if kwargs[dest] is not None and kwargs[dest] != given:
                    raise click.UsageError(f"give the model once: {metavar} {given} or --model {kwargs[dest]}, "
                                           f"not both")
                kwargs[dest] = given
                click.get_current_context().set_parameter_source(dest, ParameterSource.COMMANDLINE)
            return callback(*args, **kwargs)

        merged = click.argument(positional, metavar=f"[{metavar}]", type=kind, required=False)(merged)
        return click.option("--model", dest, type=kind, default=None, metavar=metavar,
                            help=f"{help} Also accepted as the argument MODEL, without --model.")(merged)

    return decorate
