"""How the command line reports a user's error: one line, exit status 2, no traceback (a missing extra too)."""

from __future__ import annotations

import functools

import click

from dlmrt.errors import DlmrtError


class UserError(click.ClickException):
    """A DlmrtError shown as one line, with exit status 2 (as click does for usage errors)."""

    exit_code = 2


def reports_errors(command):
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except DlmrtError as error:
            raise UserError(str(error)) from None
    return wrapper


def require_onnx_extra() -> None:
    """One clear line, instead of an ImportError, when the ONNX path is not installed."""
    import importlib.util

    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"the ONNX path needs {', '.join(missing)}: pip install 'dlmrt[onnx]' "
                        f"(or 'dlmrt[onnx-gpu]' on a GPU machine)")
