"""How the command line reports a user's error: one line, exit status 2, no traceback."""

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
