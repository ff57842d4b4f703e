"""How the command line reports errors: a user's error is one line with exit status 2 (a missing extra
too); an internal error, the guard of last resort, is one line asking for a bug report, with exit
status 70 and its traceback only under `--debug` or DLMRT_DEBUG=1. A warning is one line too.

One line whatever the terminal's width: click prints its errors unwrapped, and a one-line message that
goes through rich (a problem `inspect` reports, a script's error) is printed with `print_line` or
`print_error`, unwrapped, so a long path never moves a break into it.

The guard wraps the installed `dlmrt` command (`guarded`), not the click group: tests invoke the
group, so any exception that is not a DlmrtError still fails them.
"""

from __future__ import annotations

import functools
import os
import warnings

import click

from dlmrt.core.errors import DlmrtError


class UserError(click.ClickException):
    """A DlmrtError shown as one line, with exit status 2 (as click does for usage errors)."""

    exit_code = 2


def print_line(console, message: str, style: str | None = None) -> None:
    """`message` on the rich `console` as one line, never wrapped at the terminal's width, and never read as
    rich markup (a path may hold brackets)."""
    console.print(message, style=style, soft_wrap=True, markup=False, highlight=False)


def print_error(console, message: str) -> None:
    """A script's error on the rich `console`: one line, `error:` in red, then `message` (as `print_line`)."""
    from rich.text import Text

    console.print(Text.assemble(("error:", "red"), " ", message), soft_wrap=True, highlight=False)


def reports_errors(command):
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except DlmrtError as error:
            raise UserError(str(error)) from None
    return wrapper


def require_trt_extra() -> None:
    """The engines' side reads ONNX (plugin specs, selection) before TensorRT is even asked for."""
    import importlib.util

    if importlib.util.find_spec("onnx") is None:
        raise UserError("--backend trt needs the tensorrt extra (TensorRT and onnx): pip install 'dlmrt[tensorrt]' "
                        "on a machine with an NVIDIA GPU")


def _missing(modules: tuple[str, ...]) -> list[str]:
    import importlib.util

    return [name for name in modules if importlib.util.find_spec(name) is None]


def require_onnx_extra() -> None:
    """One clear line, instead of an ImportError, when the ONNX path is not installed."""
    missing = _missing(("onnx", "onnxscript", "onnxruntime"))
    if missing:
        raise UserError(f"the ONNX path needs {', '.join(missing)}: pip install 'dlmrt[onnx]' "
                        f"(or 'dlmrt[onnx-gpu]' on a GPU machine)")


def require_serve_extra() -> None:
    """`dlmrt serve` on a base install: one line naming the extra, instead of an internal error."""
    missing = _missing(("fastapi", "uvicorn", "jinja2", "prometheus_client"))
    if missing:
        raise UserError(f"dlmrt serve needs {', '.join(missing)}: pip install 'dlmrt[serve]'")


def require_ray_extra() -> None:
    """`dlmrt serve --replicas` without Ray Serve: one line naming the extra, before anything starts."""
    missing = _missing(("ray",))
    if not missing:
        try:
            import ray.serve  # noqa: F401  (ray without its serve extra lacks its proxy's modules)
        except ImportError as error:
            missing = [f"ray[serve] ({error})"]
    if missing:
        raise UserError(f"dlmrt serve --replicas needs {', '.join(missing)}: pip install 'dlmrt[ray]'")


DEBUG_VARIABLE = "DLMRT_DEBUG"
INTERNAL_ERROR_STATUS = 70  # EX_SOFTWARE, sysexits.h
INTERRUPTED_STATUS = 130


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line on stderr: what a user should know, not where in dlmrt it was raised."""
    click.echo(f"{click.style('Warning:', fg='yellow')} {message}", err=True)


def guarded(command: click.Command, argv: list[str]) -> int:
    """Run the click `command` as the `dlmrt` executable and return its exit status: usage errors as
    click shows them (2), Ctrl-C as 130 (128 + SIGINT, the shell's convention), and any other exception
    as one line naming the subcommand (70), unless debugging was asked for."""
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning
            status = command.main(argv, standalone_mode=False)  # click's own exits come back as their status
        return status if isinstance(status, int) else 0
    except click.ClickException as error:
        error.show()
        return error.exit_code
    except click.Abort as abort:
        click.echo("Aborted!", err=True)
        return INTERRUPTED_STATUS if isinstance(abort.__cause__, KeyboardInterrupt) else 1
    except Exception as error:  # noqa: BLE001  (the guard of last resort)
        if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0") or "--debug" in argv:
            raise
        subcommand = next((a for a in argv if not a.startswith("-")), "")
        first_line = next(iter(str(error).strip().splitlines()), "")[:300]
        click.echo(f"dlmrt {subcommand}: internal error ({type(error).__name__}: {first_line}). This is a "
                   f"bug in dlmrt, not in your input: please report it with the command you ran, and the "
                   f"traceback that `{DEBUG_VARIABLE}=1 dlmrt ...` (or `dlmrt --debug ...`) prints.",
                   err=True)
        return INTERNAL_ERROR_STATUS
