"""Option types the commands share: numbers a step tensor holds, and lengths within dlmrt's limits."""

from __future__ import annotations

import click

from dlmrt.core import limits


class Float32(click.ParamType):
    """A number the step's float32 tensors hold: finite, at most FLOAT32_MAX in magnitude."""

    name = "float"

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        problem = limits.float32_problem(number)
        if problem:
            self.fail(problem, param, ctx)
        return number


FLOAT32 = Float32()
LENGTH = click.IntRange(1, limits.MAX_POSITIONS)  # lengths and step counts
