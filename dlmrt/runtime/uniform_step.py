"""The uniform-noise step on the device: a pure, in-place function of a canvas bucket's buffers.

    step(state, graphs)   decode [cache; canvas], then dlmrt::EntropyBoundStep, written back in place

Design notes: docs/runtime-modules.md#uniform_step.
"""

from __future__ import annotations

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
    """The `decode` and `soft_tokens` graphs bound once to a bucket's buffers, on any backend:
    `bind(graph, inputs, outputs)` binds a graph to buffers by name and returns a callable that runs it
    on them and returns its outputs by name. A backend whose graphs write in place (ONNX Runtime,
    TensorRT) gets output buffers, held here; the torch backend returns tensors of its own. A step
    copies nothing but the scaled logits into place. On a tensor-parallel rank the logits are its
    vocabulary slice, and `dlmrt::EntropyBoundStep` runs over the ranks (`dlmrt.parallel.vocab`)."""

    def __init__(self, state: UniformState, backend: Backend):
        rows, width = state.block_ids.shape
        device, in_place = state.block_ids.device, backend.outputs_in_place

        def buffer(*shape: int, like: Tensor | None = None) -> Tensor | None:
            if not in_place:
                return None
            return torch.empty_like(like) if like is not None else torch.empty(*shape, dtype=torch.float32,
                                                                               device=device)
        # Every bound buffer is held here, so that it lives as long as the bindings that write it.
        self.state = state
        shard = backend.vocab_shard
        vocab = backend.spec.vocab_size if shard is None else shard.rows.stop - shard.rows.start
        self.scaled = torch.empty(rows, width, vocab, dtype=torch.float32, device=device)
        self.outputs = {"logits": buffer(*self.scaled.shape), "z": buffer(like=state.z),
                        "certainty": buffer(rows, width)}
        self._decode = backend.bind("decode", state.decoder_inputs(), {"logits": self.outputs["logits"]})
        self._soft_tokens = backend.bind("soft_tokens", {"scaled_logits": self.scaled},
                                         {name: self.outputs[name] for name in ("z", "certainty")})
        self._vocab_shard = shard

    def decode(self, state: UniformState) -> Tensor:
        return self._decode()["logits"]

    def soft_tokens(self, scaled_logits: Tensor) -> Tensor:
        self.scaled.copy_(scaled_logits)
        return self._soft_tokens()["z"]

    def entropy_bound_step(self, logits: Tensor, canvas: Tensor, positions: Tensor, params: RenoiseParams,
                           finished: Tensor) -> RenoiseResult:
        if self._vocab_shard is not None:
            return self._vocab_shard.entropy_bound_step(logits, canvas, positions, params, finished)
        return entropy_bound_step(logits, canvas, positions, params, finished=finished)


@dataclass(frozen=True)
class UniformStep:
    """The uniform-noise step as a step program (`dlmrt.runtime.executor.StepProgram`): one kind per model."""

    binding_key: str = "uniform"

    def bind(self, backend: Backend, state: UniformState) -> UniformGraphs:
        return BoundUniformGraphs(state, backend)

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
