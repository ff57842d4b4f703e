"""The backend contract: a graph runner under the one executor (`dlmrt.runtime.executor`).

Design notes: docs/runtime-modules.md#backend.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING

import torch

from dlmrt.core.errors import ArgumentError
from dlmrt.runtime.model_spec import ModelSpec

if TYPE_CHECKING:
    from torch import Tensor

    from dlmrt.models.denoiser import LayerGroupKV
    from dlmrt.runtime.uniform_state import CacheGroup, UniformState
    from dlmrt.runtime.uniform_step import UniformGraphs
    from dlmrt.runtime.device_state import Bucket, BucketLadder, DeviceState
    from dlmrt.runtime.device_step import StepKind
    from dlmrt.runtime.executor import StepProgram


class Backend(ABC):
    def __init__(self, spec: ModelSpec, ladder: BucketLadder, *, mode: str = "eager", on_failure: str = "raise",
                 on_compile: Callable[[str], None] | None = None):
        from dlmrt.runtime.executor import Executor

        self.spec, self.ladder = spec, ladder
        self.executor = Executor(self, mode, on_failure, on_compile)
        self._states: dict[Bucket, DeviceState | UniformState] = {}
        self._owners: dict[Bucket, weakref.ref] = {}

    def prepare(self, bucket: Bucket, owner: object) -> DeviceState | UniformState:
        """The static state of `bucket` (allocated on first use) for `owner`, a running request: a
        DeviceState for a mask model's bucket, a UniformState for a uniform-noise model's.
        A bucket runs one request at a time; it is free again once `release` was called or its owner
        is gone."""
        holder = self._owners.get(bucket)
        if holder is not None and holder() is not None and holder() is not owner:
            raise ArgumentError("this backend is already decoding a batch of the same shape: finish or close the "
                                "other generate stream first, or give each concurrent stream its own backend")
        if bucket not in self._states:
            self._states[bucket] = self._allocate(bucket)
        self._owners[bucket] = weakref.ref(owner)
        return self._states[bucket]

    def _allocate(self, bucket: Bucket) -> DeviceState | UniformState:
        from dlmrt.runtime.uniform_state import UniformState
        from dlmrt.runtime.device_state import DeviceState

        if bucket.noise == "uniform":
            return UniformState.allocate(self.spec, bucket, self.cache_groups())
        return DeviceState.allocate(self.spec, bucket)

    def release(self, state: DeviceState | UniformState) -> None:
        self._owners.pop(state.bucket, None)

    # -- the executor's ------------------------------------------------------------------------------------
    def prepare_steps(self, state, program: StepProgram, steps: int) -> float:
        """Make `steps` back-to-back steps of `program` runnable on `state` (bound, compiled or captured on
        first use). Returns the seconds this call spent doing so."""
        return self.executor.prepare(state, program, steps)

    def run(self, state, program: StepProgram, steps: int) -> None:
        """Enqueue `steps` steps of `program` on `state`, in place, without reading anything back."""
        self.executor.run(state, program, steps)

    # -- the graph runner's ------------------------------------------------------------------------------
    @abstractmethod
    def step_graph(self, state: DeviceState, kind: StepKind) -> Callable:
        """The masked step graph of `kind` on `state`, as `device_step.step` calls it: inputs by name in,
        GraphOutputs out."""

    def uniform_graphs(self, state: UniformState) -> UniformGraphs:
        """A uniform-noise model's decoder and soft tokens on `state`, as `uniform_step.step` calls them."""
        raise ArgumentError(f"the {type(self).__name__} does not run uniform-noise models: use the torch or ort "
                            f"backend for {self.spec.name}")

    def cache_groups(self) -> tuple[CacheGroup, CacheGroup]:
        """A uniform-noise model's cache shapes: its sliding and its full layers'."""
        raise ArgumentError(f"{self.spec.name} is a mask model: it has no encoder cache")

    def encode(self, ids: Tensor, positions: Tensor, key_mask: Tensor, cache: LayerGroupKV | None) -> LayerGroupKV:
        """A uniform-noise model's cache commit: `cache` extended by the causal encoder's K/V of `ids`."""
        raise ArgumentError(f"{self.spec.name} is a mask model: it has no encoder")

    def binding_key(self, program: StepProgram) -> Hashable:
        """What a state's bound graphs for `program` depend on."""
        return program.binding_key

    def around_steps(self, run: Callable[[], None]) -> Callable[[], None]:
        """`run` (K eager steps) as this backend enqueues it: e.g. on a stream of its own."""
        return run

    def eager_graphs(self, state, program: StepProgram, graphs: object) -> object:
        """The graphs an eager fallback runs, after `graphs` failed to compile or capture."""
        return graphs

    def synchronize(self) -> None:
        """Wait for queued device work (for timing)."""
        if self.spec.device.type == "cuda":
            torch.cuda.synchronize(self.spec.device)


class BindingBackend(Backend):
    """A backend that runs exported graphs on static buffers it binds by name (ONNX Runtime, TensorRT)."""

    every_output = False  # whether a binding needs a buffer for every output (TensorRT does)

    @abstractmethod
    def bind(self, graph: str, inputs: Mapping[str, Tensor], outputs: Mapping[str, Tensor]) -> Callable[[], None]:
        """`graph` bound to static buffers by name; the callable runs it on them, in place."""

    def step_graph(self, state: DeviceState, kind: StepKind) -> Callable:
        from dlmrt.runtime.device_step import BoundStepGraph

        return BoundStepGraph(self, state, kind)

    def uniform_graphs(self, state: UniformState) -> UniformGraphs:
        from dlmrt.runtime.uniform_step import BoundUniformGraphs

        if self.spec.noise != "uniform":
            return super().uniform_graphs(state)
        return BoundUniformGraphs(state, self.spec.vocab_size, self.bind)
