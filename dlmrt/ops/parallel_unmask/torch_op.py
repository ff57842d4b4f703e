"""`torch.ops.dlmrt.parallel_unmask`: the reference semantics as one torch op, so that an exported graph
holds a single `dlmrt::ParallelUnmask` node instead of the op's decomposition."""

from __future__ import annotations

import torch
from torch import Tensor

from dlmrt.ops.parallel_unmask.reference import EditParams, UnmaskParams, parallel_unmask


@torch.library.custom_op("dlmrt::parallel_unmask", mutates_args=())
def parallel_unmask_op(logits: Tensor, ids: Tensor, positions: Tensor, count: Tensor, threshold: Tensor,
                       factor: Tensor, temperature: Tensor, seed: Tensor, step: Tensor, measure: Tensor,
                       edit_threshold: Tensor, editable: Tensor, mask_id: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    params = UnmaskParams(count, threshold, factor, temperature, seed, step)
    result = parallel_unmask(logits, ids, positions, params, mask_id=mask_id, confidence=measure,
                             edits=EditParams(edit_threshold, editable))
    return result.ids, result.confidence, result.commit, result.committed


@parallel_unmask_op.register_fake
def _(logits, ids, positions, count, threshold, factor, temperature, seed, step, measure, edit_threshold, editable,
      mask_id):
    return (torch.empty_like(ids), torch.empty(ids.shape, dtype=torch.float32, device=ids.device),
            torch.empty(ids.shape, dtype=torch.bool, device=ids.device), torch.empty_like(count))
