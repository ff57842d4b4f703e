"""Optimization profiles: the min/opt/max shape of every dynamic input of a step graph.

The export names its dynamic dimensions `batch`, `window`, `block` and `prefix` (a guided graph's
model rows are `2*batch`). A build sets each dimension's range once, as trtexec users know it
(`--batch 1:4:8` is min 1, opt 4, max 8), or takes it from the export's limits; the per-input shapes
follow from the graph's contract.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from dlmrt.core.errors import DlmrtError
from dlmrt.export.export_manifest import ExportLimits, TensorContract

DIMENSIONS = ("batch", "window", "block", "prefix")
_EXPRESSION = re.compile(r"^(?:(\d+)\*)?([A-Za-z_]\w*)$")


class ProfileError(DlmrtError):
    """A dimension range that is malformed, empty, or outside what the export allows."""


@dataclass(frozen=True)
class DimRange:
    min: int
    opt: int
    max: int

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"

    def as_list(self) -> list[int]:
        return [self.min, self.opt, self.max]


def parse_range(text: str, dimension: str, least: int = 1) -> DimRange:
    """`MIN:OPT:MAX`, or one number for a fixed size; MIN at least `least` (0 where a dimension may be
    empty, as a uniform-noise encoder's prefix is on the prompt)."""
    parts = text.split(":")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        values *= 3
    if len(values) != 3:
        raise ProfileError(f"--{dimension} {text!r}: expected MIN:OPT:MAX (like 1:4:8) or one size")
    low, opt, high = values
    if not least <= low <= opt <= high or high < 1:
        raise ProfileError(f"--{dimension} {text}: need {least} <= MIN <= OPT <= MAX")
    return DimRange(low, opt, high)


def default_ranges(limits: ExportLimits, opt_batch: int, opt_window: int, min_prefix: int = 1) -> dict[str, DimRange]:
    """Ranges that cover everything the export allows, tuned for `opt_batch` rows of `opt_window`;
    `min_prefix` 0 for graphs that also run with no cached prefix (a uniform-noise model's encoder)."""
    batch, length = limits.max_batch, limits.max_length
    window = min(opt_window, length)
    return {"batch": DimRange(1, min(opt_batch, batch), batch), "window": DimRange(1, window, length),
            "block": DimRange(1, window, length), "prefix": DimRange(min_prefix, max(1, length // 2), length)}


def check_within_limits(ranges: dict[str, DimRange], limits: ExportLimits) -> None:
    bound = {"batch": limits.max_batch, "window": limits.max_length, "block": limits.max_length,
             "prefix": limits.max_length}
    for name, dim in ranges.items():
        if dim.max > bound[name]:
            limit = "max-batch" if name == "batch" else "max-length"
            raise ProfileError(f"--{name} {dim}: the export takes {name} up to {bound[name]} (its {limit}); "
                               f"re-export with a larger --{limit} or lower the maximum")


def evaluate(dim: str | int, ranges: dict[str, DimRange]) -> list[int]:
    """[min, opt, max] of one axis: a fixed size, a named dimension, or `k*name`."""
    if isinstance(dim, int):
        return [dim] * 3
    match = _EXPRESSION.match(dim.replace(" ", ""))
    if match is None or match.group(2) not in ranges:
        raise ProfileError(f"dimension {dim!r} is not one dlmrt knows how to profile "
                           f"(known: {', '.join(ranges)})")
    factor = int(match.group(1) or 1)
    return [factor * value for value in ranges[match.group(2)].as_list()]


def input_shapes(contract: Sequence[TensorContract], ranges: dict[str, DimRange]) -> dict[str, list[list[int]]]:
    """{input: [min_shape, opt_shape, max_shape]} for every input with a dynamic axis."""
    shapes = {}
    for tensor in contract:
        dims = tensor.shape
        if all(isinstance(dim, int) for dim in dims):
            continue
        per_axis = [evaluate(dim, ranges) for dim in dims]
        shapes[tensor.name] = [[axis[i] for axis in per_axis] for i in range(3)]
    return shapes


def trtexec_flags(shapes: dict[str, list[list[int]]]) -> list[str]:
    """The same profile as trtexec's --minShapes/--optShapes/--maxShapes."""
    flags = []
    for index, flag in enumerate(("--minShapes", "--optShapes", "--maxShapes")):
        joined = ",".join(f"{name}:{'x'.join(map(str, shape[index]))}" for name, shape in shapes.items())
        flags.append(f"{flag}={joined}")
    return flags
