"""The backend contract: a graph runner, under the batch layer's executor (`dlmrt.runtime.executor`).

Design notes: docs/runtime-modules.md#backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dlmrt.core.errors import ArgumentError
from dlmrt.runtime.model_spec import ModelSpec

if TYPE_CHECKING:
    from torch import Tensor

    from dlmrt.runtime.buckets import BucketLadder
    from dlmrt.runtime.uniform_state import CacheGroup


@dataclass(frozen=True)
class GraphOptions:
    """What every row of a batch agrees on, which a backend that builds its step graph per kind (torch)
    specializes the graph on; an exported graph takes every input, and its runner ignores them."""

    sampling: bool = False  # some row samples (temperature > 0)
    confidence: str | None = None  # the measure every row uses (None: each row's `measure`)
    editing: bool = False  # some row edits committed tokens


class Backend(ABC):
    """A graph runner: it binds a named graph to static buffers (`bind`) and runs what it bound. The
    batch layer's executor (`dlmrt.runtime.executor`) runs the step programs over it, in `mode`."""

    every_output = False  # whether a binding needs a buffer for every output (TensorRT does)
    outputs_in_place = True  # a graph writes its outputs into bound buffers; else it returns tensors of its own
    specializes = False  # whether it builds a graph per GraphOptions (else one binding serves every option)
    vocab_shard = None  # on a tensor-parallel rank, the vocabulary slice its logits hold (dlmrt.parallel)

    def __init__(self, spec: ModelSpec, ladder: BucketLadder, *, mode: str = "eager", on_failure: str = "raise",
                 on_compile: Callable[[str], None] | None = None):
        """`mode`, `on_failure` and `on_compile` say how the executor runs this backend's steps
        (`dlmrt.runtime.executor.Executor`)."""
        self.spec, self.ladder = spec, ladder
        self.mode, self.on_failure, self.on_compile = mode, on_failure, on_compile

    @abstractmethod
    def bind(self, graph: str, inputs: Mapping[str, Tensor], outputs: Mapping[str, Tensor | None],
             options: GraphOptions = GraphOptions()) -> Callable[[], Mapping[str, Tensor]]:
        """`graph` bound to the static buffers `inputs` by name; the callable runs it on them and returns
        the `outputs` by name: the buffers given, written in place (`outputs_in_place`), or where the
        backend returns tensors of its own (buffers None), those."""

    def cache_groups(self) -> tuple[CacheGroup, CacheGroup]:
        """A uniform-noise model's cache shapes: its sliding and its full layers'."""
        raise ArgumentError(f"{self.spec.name} is a mask model: it has no encoder cache")

    def around_steps(self, run: Callable[[], None]) -> Callable[[], None]:
        """`run` (K steps) as this backend enqueues it: e.g. on a stream of its own."""
        return run

    def synchronize(self) -> None:
        """Wait for queued device work (for timing)."""
        if self.spec.device.type == "cuda":
            torch.cuda.synchronize(self.spec.device)
