"""User-facing errors: each message says what was wrong and what to do about it.

The CLI prints a DlmrtError as one line and exits with status 2; anything else
is a bug in dlmrt and keeps its traceback.
"""


class DlmrtError(Exception):
    """Base class for errors caused by the user's input, files or environment."""


class CheckpointError(DlmrtError):
    """A model directory, config field, tensor or tokenizer is missing or malformed."""


class UnsupportedFeatureError(CheckpointError):
    """The checkpoint asks for an architecture feature dlmrt does not implement."""


class ArgumentError(DlmrtError, ValueError):
    """A generation argument or prompt is invalid."""
