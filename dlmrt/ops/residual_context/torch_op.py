"""`torch.ops.dlmrt.residual_context`: the reference semantics as one torch op, so that an exported graph
holds a single `dlmrt::ResidualContext` node instead of the op's decomposition."""

from __future__ import annotations

import torch
from torch import Tensor

from dlmrt.ops.residual_context.reference import residual_context


@torch.library.custom_op("dlmrt::residual_context", mutates_args=())
def residual_context_op(logits: Tensor, embedding: Tensor) -> tuple[Tensor, Tensor]:
    return residual_context(logits, embedding)


@residual_context_op.register_fake
def _(logits, embedding):
    batch, length, _ = logits.shape
    return (logits.new_empty(batch, length, embedding.shape[1], dtype=embedding.dtype),
            logits.new_empty(batch, length, dtype=embedding.dtype))
