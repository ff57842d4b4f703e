"""One timed case of a benchmark: a label, the generate call it times, and the runtime whose threads run it."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from dlmrt.runtime.metrics import GenerationMetrics


class Case(NamedTuple):
    label: str
    run: Callable[[], GenerationMetrics]
    # The runtime whose threads run the case. ONNX Runtime's threads spin after a run and slow torch
    # down for a second after (to half speed on 2 cores), so cases of one pool never alternate with
    # another's.
    pool: str = "torch"
