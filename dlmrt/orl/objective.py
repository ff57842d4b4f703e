"""The ORL training objective on recorded states.

    loss = CE + aec_weight * L_AEC

- CE: mean cross-entropy of the model's prediction at the state (canvas, and for ORL models the
  recorded `z` and certainty, held fixed) against the verified output, over the masked positions.
- L_AEC, adjacent entropy contraction: `max(0, H_next - (1 - rho) * H_source)^2` per state, where
  H_next is the mean entropy of the prediction over the block's unresolved (masked) positions and
  H_source the mean, over the same positions, of the entropy the previous step predicted there
  (recorded, so no gradient flows into it). States without a previous step have no term.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from dlmrt.models import Denoiser
from dlmrt.orl.rollout import IGNORE, States, entropy


class Loss(NamedTuple):
    total: Tensor
    cross_entropy: Tensor
    contraction: Tensor  # L_AEC, before its weight


def contraction(next_entropy: Tensor, source_entropy: Tensor, unresolved: Tensor, rho: float) -> Tensor:
    """L_AEC from per-position entropies `[N, T]` and the unresolved positions `[N, T]`: the mean over
    states that have a source of `max(0, mean H_next - (1 - rho) * mean H_source)^2`."""
    has_source = unresolved & ~source_entropy.isnan()
    counts = has_source.sum(1)
    rows = counts > 0
    if not rows.any():
        return next_entropy.sum() * 0.0
    mean_next = (next_entropy * has_source).sum(1)[rows] / counts[rows]
    mean_source = source_entropy.nan_to_num().mul(has_source).sum(1)[rows] / counts[rows]
    return F.relu(mean_next - (1 - rho) * mean_source.detach()).square().mean()


def orl_loss(model: Denoiser, states: States, *, rho: float, aec_weight: float) -> Loss:
    logits = model.denoise(states.ids, positions=states.positions, key_mask=states.key_mask,
                           residual=states.residual()).logits.float()
    masked = (states.ids == model.tokens.mask_id) & (states.targets != IGNORE)
    targets = states.targets.masked_fill(~masked, IGNORE)
    cross_entropy = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    in_block = torch.zeros_like(masked).scatter_(1, states.block, True)
    aec = contraction(entropy(logits), states.source_entropy, masked & in_block, rho)
    return Loss(cross_entropy + aec_weight * aec, cross_entropy, aec)
