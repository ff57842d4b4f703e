"""Which running batch decodes a backend's model: a MaskBatch, or a UniformBatch for a uniform-noise model.

Apart from `dlmrt.runtime.running_batch` (the loop both share), so that neither noise kind's batch and
the loop import each other.
"""

from __future__ import annotations

from collections.abc import Callable

from dlmrt.runtime.backend import Backend
from dlmrt.runtime.mask_batch import MaskBatch
from dlmrt.runtime.running_batch import BlockProgress, RunningBatch
from dlmrt.runtime.uniform_noise import UniformBatch


def open_batch(backend: Backend, on_step: Callable[[], None] | None = None,
               on_progress: Callable[[list[BlockProgress]], None] | None = None,
               agree: Callable[[list[bool]], list[bool]] | None = None) -> RunningBatch:
    """An empty running batch of the backend's model: a MaskBatch, or a UniformBatch for a
    uniform-noise model. `on_progress` is told the progress of the rows added with `provisional`;
    `agree` (tensor parallelism: dlmrt.parallel.lockstep) turns the cancel flags read here into the
    ones every rank acts on."""
    kind = UniformBatch if backend.spec.noise == "uniform" else MaskBatch
    return kind(backend, on_step, on_progress, agree=agree)
