"""The uniform-noise step on the device: a pure, in-place function of a canvas bucket's buffers.

    step(state, graphs)   decode [cache; canvas], then dlmrt::EntropyBoundStep, written back in place

Design notes: docs/runtime-modules.md#uniform_step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from dlmrt.ops.entropy_bound import RenoiseParams, RenoiseResult, entropy_bound_step, should_stop, stability
from dlmrt.runtime.uniform_state import UniformState

if TYPE_CHECKING:
    from dlmrt.runtime.backend import Backend


class UniformGraphs(Protocol):
    def decode(self, state: UniformState) -> Tensor: ...

    def soft_tokens(self, scaled_logits: Tensor) -> Tensor: ...

    def entropy_bound_step(self, logits: Tensor, canvas: Tensor, positions: Tensor, params: RenoiseParams,
                           finished: Tensor) -> RenoiseResult:
        """`dlmrt::EntropyBoundStep` on what `decode` returned: the whole vocabulary's logits, or on a
        tensor-parallel rank its slice (`dlmrt.parallel.vocab`)."""


class BoundUniformGraphs:
    """Exported `decode` and `soft_tokens` graphs bound once to a bucket's buffers, for a backend whose
    graphs write their outputs in place (ONNX Runtime, TensorRT). `bind(graph, inputs, outputs)` binds a
    graph to buffers by name and returns a callable that runs it on them; a step then copies nothing but
    the scaled logits into place."""

    def __init__(self, state: UniformState, vocab_size: int,
                 bind: Callable[[str, Mapping[str, Tensor], Mapping[str, Tensor]], Callable[[], object]]):
        rows, width = state.block_ids.shape
        device = state.block_ids.device
        # Every bound buffer is held here, so that it lives as long as the bindings that write it.
        self.state = state
        self.logits = torch.empty(rows, width, vocab_size, dtype=torch.float32, device=device)
        self.scaled = torch.empty_like(self.logits)
        self.z = torch.empty_like(state.z)
        self.certainty = torch.empty(rows, width, dtype=torch.float32, device=device)
        self._decode = bind("decode", state.decoder_inputs(), {"logits": self.logits})
        self._soft_tokens = bind("soft_tokens", {"scaled_logits": self.scaled},
                                 {"z": self.z, "certainty": self.certainty})

    def decode(self, state: UniformState) -> Tensor:
        self._decode()
        return self.logits

    def soft_tokens(self, scaled_logits: Tensor) -> Tensor:
        self.scaled.copy_(scaled_logits)
        self._soft_tokens()
        return self.z

    def entropy_bound_step(self, logits: Tensor, canvas: Tensor, positions: Tensor, params: RenoiseParams,
                           finished: Tensor) -> RenoiseResult:
        return entropy_bound_step(logits, canvas, positions, params, finished=finished)


@dataclass(frozen=True)
class UniformStep:
    """The uniform-noise step as a step program (`dlmrt.runtime.executor.StepProgram`): one kind per model."""

    binding_key: str = "uniform"

    def bind(self, backend: Backend, state: UniformState) -> UniformGraphs:
        if backend.outputs_in_place:
            return BoundUniformGraphs(state, backend.spec.vocab_size, backend.bind)
        return backend.uniform_graphs(state)  # the torch modules, called on the step's own tensors

    def step(self, state: UniformState, graphs: UniformGraphs) -> None:
        step(state, graphs)

    def describe(self, state: UniformState) -> str:
        bucket = state.bucket
        return f"a batch of {bucket.batch} x {bucket.block} after {bucket.storage} cached"


UNIFORM_STEP = UniformStep()


def step(state: UniformState, graphs: UniformGraphs) -> None:
    """One denoising step of every row of `state`, in place."""
    logits = graphs.decode(state)
    temperature = state.temperatures.gather(1, torch.minimum(state.block_step, state.last_step)[:, None])[:, 0]
    params = RenoiseParams(temperature, state.entropy_bound, state.seed, state.block_step)
    result = graphs.entropy_bound_step(logits, state.block_ids, state.positions, params, state.done)
    argmax = torch.where(state.done[:, None], state.argmax, result.argmax)
    state.stable_run.copy_(stability(argmax, state.argmax, state.stable_run))
    state.forwards.add_((~state.done).long())
    state.done.logical_or_(should_stop(state.stable_run, result.mean_entropy, state.stability_threshold,
                                       state.confidence_threshold))
    state.block_ids.copy_(result.canvas)
    state.argmax.copy_(argmax)
    state.z.copy_(graphs.soft_tokens(result.scaled_logits))
    state.block_step.add_(1)
