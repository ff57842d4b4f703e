"""The backend contract: a graph runner under the one executor (`dlmrt.runtime.executor`).

Design notes: docs/runtime-modules.md#backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dlmrt.core.errors import ArgumentError

if TYPE_CHECKING:
    from pathlib import Path

    from torch import Tensor

    from dlmrt.export.export_manifest import ExportManifest
    from dlmrt.models.denoiser import LayerGroupKV
    from dlmrt.runtime.uniform_state import CacheGroup, UniformState
    from dlmrt.runtime.uniform_step import UniformGraphs
    from dlmrt.runtime.buckets import BucketLadder
    from dlmrt.runtime.device_state import DeviceState
    from dlmrt.runtime.device_step import StepKind
    from dlmrt.runtime.executor import StepProgram


@dataclass(frozen=True)
class ModelSpec:
    """What the loop needs to know about the model behind a backend."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    mask_id: int | None  # None for uniform-noise models
    eos_ids: tuple[int, ...]
    pad_id: int
    block_causal: bool
    has_residual: bool
    dtype: torch.dtype
    device: torch.device
    # How to lift the limits of what a compiled backend was built for.
    limits_hint: str = ""
    block_grid: int | None = None  # the block-causal grid a compiled graph was built with
    supports_guidance: bool = True
    supports_editing: bool = True  # the graphs take token editing's inputs (exports before it do not)
    supports_logprobs: bool = True  # the step graphs can return the block's logits (exports before it cannot)
    # Ranks the vocabulary is split over (tensor parallelism): each holds its slice of the logits, never the whole
    vocab_ranks: int = 1
    logits_shift: int = 0  # Denoiser.logits_shift: a window over a cache starts this many positions early
    noise: str = "mask"  # Denoiser.noise: "uniform" for models with no mask token (DiffusionGemma)

    @classmethod
    def of_export(cls, manifest: ExportManifest, export_dir: Path, device: torch.device) -> ModelSpec:
        """The spec of the graphs in an export directory, from its manifest alone."""
        from dlmrt.models import FAMILIES

        model, tokens = manifest.model, manifest.tokens
        return cls(
            name=model.name, vocab_size=model.vocab_size, hidden_size=model.hidden_size,
            num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
            max_positions=manifest.limits.max_length, mask_id=tokens.mask_id, eos_ids=tokens.eos_ids,
            pad_id=tokens.pad_id, block_causal=model.block_causal, has_residual=model.residual,
            dtype=getattr(torch, model.dtype), device=device,
            limits_hint=f"re-export with `dlmrt export ... -o {export_dir} --max-batch B --max-length N`",
            block_grid=model.block_grid, supports_guidance=manifest.supports_guidance,
            supports_editing=manifest.supports_editing, supports_logprobs=manifest.supports_logprobs,
            logits_shift=FAMILIES[model.model_type].model_class.logits_shift, noise=model.noise)


class Backend(ABC):
    def __init__(self, spec: ModelSpec, ladder: BucketLadder, *, mode: str = "eager", on_failure: str = "raise",
                 on_compile: Callable[[str], None] | None = None):
        from dlmrt.runtime.executor import Executor

        self.spec, self.ladder = spec, ladder
        self.executor = Executor(self, mode, on_failure, on_compile)

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
