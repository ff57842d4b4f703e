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


class MissingExtraError(DlmrtError, ImportError):
    """An optional dependency (a `dlmrt[...]` extra) is needed and not installed."""


class KernelInputError(DlmrtError, ValueError):
    """Tensors handed to a kernel or plugin have the wrong dtype, shape, device or size."""


class ResourceError(DlmrtError):
    """What was asked for cannot fit in this machine's memory, or in the configured limit."""
