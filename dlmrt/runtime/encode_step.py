"""A uniform-noise model's cache commit as a step program: the encoder over a bucket's static buffers,
its new K/V kept for the committing rows, so that the executor compiles or captures it like a step.

    EncodeStep(None)    the joining rows' prompts (`prompt_ids`, ...) into the prompt region
    EncodeStep(block)   block `block`'s tokens (`block_tokens`) into that block's slot

Design notes: docs/runtime-modules.md#encode_step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dlmrt.models.denoiser import LayerGroupKV
from dlmrt.runtime.uniform_state import UniformState

if TYPE_CHECKING:
    from dlmrt.runtime.backend import Backend


@dataclass(frozen=True)
class EncodeStep:
    block: int | None  # None: the prompts

    @property
    def binding_key(self) -> tuple[str, int | None]:
        return "encode", self.block  # the cache prefix it reads, and so its shapes, differ per block

    def bind(self, backend: Backend, state: UniformState) -> BoundEncoder:
        return BoundEncoder(state.encoder_inputs(self.block), state, backend)

    def step(self, state: UniformState, encode: BoundEncoder) -> None:
        state.keep_encoded(encode(), 0 if self.block is None else state.bucket.slot(self.block))

    def describe(self, state: UniformState) -> str:
        bucket = state.bucket
        what = "the prompts" if self.block is None else f"block {self.block}"
        return f"the encoder of {what}, a batch of {bucket.batch} x {bucket.block} after {bucket.storage} cached"


class BoundEncoder:
    """The `encode` graph bound once to a bucket's buffers, on any backend. A backend whose graphs write
    in place (ONNX Runtime, TensorRT) reads contiguous buffers: the inputs that are views of the state
    (the cache before the block) are copied into buffers of their own before each run, and the outputs
    are buffers of the prefix and the block's length, held here. The torch backend reads the views and
    returns tensors of its own."""

    def __init__(self, inputs: Mapping[str, Tensor], state: UniformState, backend: Backend):
        in_place = backend.outputs_in_place
        self.views = {name: tensor for name, tensor in inputs.items() if in_place and not tensor.is_contiguous()}
        self.copies = {name: tensor.clone(memory_format=torch.contiguous_format)
                       for name, tensor in self.views.items()}
        self.outputs = _output_buffers(inputs, state) if in_place else dict.fromkeys(_OUTPUTS)
        self._run = backend.bind("encode", {**inputs, **self.copies}, self.outputs)

    def __call__(self) -> LayerGroupKV:
        for name, view in self.views.items():
            self.copies[name].copy_(view)
        found = self._run()
        return LayerGroupKV(*(found[name] for name in _OUTPUTS))


_OUTPUTS = ("sliding", "full", "cache_positions")  # the exported encoder's (uniform_export.OUTPUTS)


def _output_buffers(inputs: Mapping[str, Tensor], state: UniformState) -> dict[str, Tensor]:
    """The encoder's outputs for a backend that writes in place: the cache of the prefix and the ids."""
    length = inputs["past_positions"].shape[1] + inputs["ids"].shape[1]
    sliding, full = state.cache_sliding, state.cache_full
    return {"sliding": sliding.new_empty((*sliding.shape[:4], length, sliding.shape[5])),
            "full": full.new_empty((*full.shape[:4], length, full.shape[5])),
            "cache_positions": state.cache_positions.new_empty((state.bucket.batch, length))}
