"""`reference.parallel_unmask` on bfloat16 or float16 logits without a float32 copy of the whole window.

The reference takes float32 logits `[B, W, V]`; upcasting a bf16 model's block at once makes a float32
tensor of B * W * V (1 GiB at batch 64, window 32, vocabulary 126k, and twice that in float64 for
sampling). Every quantity of the step but the commit is a function of one position's logits, so this
runs the reference's candidate, confidence and edit probability on a few positions at a time, each
slice upcast on its own, then commits the whole block once. Each position goes through the same torch
ops on the same float32 values as in the reference, so the ids, confidences and commits are the
reference's on the upcast logits, bit for bit (the tests hold it to that).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dlmrt.ops.parallel_unmask.reference import (EditParams, UnmaskParams, UnmaskResult, candidate_probability,
                                                     candidates, commit_step, confidence_of)

# float32 elements one slice of positions may hold (4 MiB; its float64 Gumbel scores twice that).
SLICE_ELEMENTS = 2**20


def positions_per_slice(batch: int, vocab: int, elements: int | None = None) -> int:
    return max(1, (SLICE_ELEMENTS if elements is None else elements) // max(1, batch * vocab))


def parallel_unmask(logits: Tensor, ids: Tensor, positions: Tensor, params: UnmaskParams, *, mask_id: int,
                    confidence: str | Tensor = "prob", sampling: bool | None = None,
                    edits: EditParams | None = None, elements: int | None = None) -> UnmaskResult:
    """`reference.parallel_unmask`, with logits `[B, W, V]` of any floating dtype upcast to float32 at most
    `elements` (SLICE_ELEMENTS) at a time, and never less than one position of every row."""
    batch, width, vocab = logits.shape
    if sampling is None:
        sampling = bool((params.temperature > 0).any())  # once for the block, not once a slice
    step = positions_per_slice(batch, vocab, elements)
    x0s, confs, probabilities = [], [], []
    for start in range(0, width, step):
        part, where = logits[:, start:start + step].float(), positions[:, start:start + step]
        x0 = candidates(part, params, where, mask_id, sampling)
        x0s.append(x0)
        confs.append(confidence_of(part, x0, confidence, params, where, mask_id))
        if edits is not None:
            probabilities.append(candidate_probability(part, x0))
    probability = None if edits is None else torch.cat(probabilities, dim=1)
    return commit_step(ids, torch.cat(x0s, dim=1), torch.cat(confs, dim=1), params, mask_id=mask_id, edits=edits,
                       probability=probability)
