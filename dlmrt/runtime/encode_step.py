"""A uniform-noise model's cache commit as a step program: the encoder over a bucket's static buffers,
its new K/V kept for the committing rows, so that the executor compiles or captures it like a step.

    EncodeStep(None)    the joining rows' prompts (`prompt_ids`, ...) into the prompt region
    EncodeStep(block)   block `block`'s tokens (`block_tokens`) into that block's slot

Design notes: docs/runtime-modules.md#encode_step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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

    def bind(self, backend: Backend, state: UniformState) -> Callable[[], LayerGroupKV]:
        inputs = state.encoder_inputs(self.block)
        if backend.outputs_in_place:
            return BoundEncoder(inputs, state, backend.bind)
        return backend.uniform_graphs(state).encoder(inputs)

    def step(self, state: UniformState, encode: Callable[[], LayerGroupKV]) -> None:
        state.keep_encoded(encode(), 0 if self.block is None else state.bucket.slot(self.block))

    def describe(self, state: UniformState) -> str:
        bucket = state.bucket
        what = "the prompts" if self.block is None else f"block {self.block}"
        return f"the encoder of {what}, a batch of {bucket.batch} x {bucket.block} after {bucket.storage} cached"


class BoundEncoder:
    """The exported encoder bound once to contiguous copies of its inputs and to output buffers, for a
    backend whose graphs write their outputs in place (ONNX Runtime, TensorRT): a call refreshes the
    copies of the inputs that are views of the state (the cache before the block), then runs it."""

    def __init__(self, inputs: Mapping[str, Tensor], state: UniformState,
                 bind: Callable[[str, Mapping[str, Tensor], Mapping[str, Tensor]], Callable[[], object]]):
        self.views = {name: tensor for name, tensor in inputs.items() if not tensor.is_contiguous()}
        self.copies = {name: tensor.clone(memory_format=torch.contiguous_format)
                       for name, tensor in self.views.items()}
        bound = {**inputs, **self.copies}
        length = inputs["past_positions"].shape[1] + inputs["ids"].shape[1]
        sliding, full = state.cache_sliding, state.cache_full
        self.outputs = LayerGroupKV(sliding.new_empty((*sliding.shape[:4], length, sliding.shape[5])),
                                    full.new_empty((*full.shape[:4], length, full.shape[5])),
                                    state.cache_positions.new_empty((state.bucket.batch, length)))
        names = ("sliding", "full", "cache_positions")  # the export's encoder outputs (uniform_export.OUTPUTS)
        self._run = bind("encode", bound, dict(zip(names, self.outputs)))

    def __call__(self) -> LayerGroupKV:
        for name, view in self.views.items():
            self.copies[name].copy_(view)
        self._run()
        return self.outputs
