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


class BatchSizes(click.ParamType):
    """Batch sizes, comma-separated (`1,8,64`), each in [1, MAX_BATCH]: a tuple of ints."""

    name = "batch[,batch...]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        sizes = []
        for part in str(value).split(","):
            try:
                size = int(part)
            except ValueError:
                self.fail(f"{part.strip()!r} is not a batch size: give whole numbers, comma-separated", param, ctx)
            if not 1 <= size <= limits.MAX_BATCH:
                self.fail(f"a batch size lies in [1, {limits.MAX_BATCH}], got {size}", param, ctx)
            sizes.append(size)
        return tuple(sizes)


BATCH_SIZES = BatchSizes()
