"""`dlmrt::ResidualContext`: the residual an ORL step hands to the next, written once in torch.

From the logits `[B, T, V]` of every position and the input embedding `E` `[V, H]`:

    p         = softmax(logits)                         (float32)
    z         = p @ E                                   [B, T, H]
    certainty = clamp(1 - H(p) / log V, 0, 1)           [B, T]

both returned in the embedding's dtype. `dlmrt/models/residual.py` builds its residual from these
functions (and adds the top-k variant, which is not part of the op).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def distribution(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(p, certainty) in float32: the softmax over the last axis and 1 - H(p) / log V in [0, 1]."""
    logp = F.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    return p, (1.0 - entropy / math.log(logits.shape[-1])).clamp(0.0, 1.0)


def residual_context(logits: Tensor, embedding: Tensor) -> tuple[Tensor, Tensor]:
    """(z [B, T, H], certainty [B, T]) in the embedding's dtype, from logits [B, T, V] and E [V, H]."""
    p, certainty = distribution(logits)
    return (p @ embedding.float()).to(embedding.dtype), certainty.to(embedding.dtype)
