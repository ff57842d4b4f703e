"""Masked-diffusion SFT as in LLaDA: the objective the tiny models are trained with
(`scripts/train_tiny.py`), and the one the further-trained arm of the ORL comparison continues with.

The prompt stays clean; each row draws a masking ratio t ~ U(0, 1) and masks that share of the
response (answer, then EOS up to `gen_length`); the loss is the mean cross-entropy over masked
positions (LLaDA's 1/t weighting made the small models' training noisy). Half the rows instead mask
a random suffix of blocks entirely and part of the block before it, as semi-autoregressive decoding
sees them.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from dlmrt.core import tasks
from dlmrt.models import Denoiser


class MaskedBatch(NamedTuple):
    inputs: Tensor  # [B, width + gen_length] left-padded prompts, then the response with some positions masked
    key_mask: Tensor  # [B, width + gen_length]
    targets: Tensor  # [B, gen_length] the whole response
    masked: Tensor  # [B, gen_length] which response positions are masked
    width: int  # the prompts' padded width


def masked_batch(rng: random.Random, tokenizer, size: int, generator: torch.Generator, task_names: tuple[str, ...],
                 gen_length: int = 16, block_length: int = 8) -> MaskedBatch:
    """`size` training examples drawn with `rng`, masked with `generator`."""
    rows = [tasks.sample(rng.choice(task_names), "train", rng) for _ in range(size)]
    prompts = [tokenizer.encode(e.prompt).ids for e in rows]
    width = max(len(p) for p in prompts)
    ids = torch.full((size, width + gen_length), tasks.PAD_ID, dtype=torch.long)
    key_mask = torch.zeros_like(ids, dtype=torch.bool)
    for row, (prompt, example) in enumerate(zip(prompts, rows)):
        answer = tokenizer.encode(example.answer).ids
        response = answer + [tasks.EOS_ID] * (gen_length - len(answer))
        ids[row, width - len(prompt):width] = torch.tensor(prompt)
        ids[row, width:] = torch.tensor(response)
        key_mask[row, width - len(prompt):] = True

    t = torch.rand(size, 1, generator=generator) * (1 - 1e-3) + 1e-3
    masked = torch.rand(size, gen_length, generator=generator) < t
    # Semi-autoregressive view for half the rows: later blocks fully masked.
    blocks = gen_length // block_length
    suffix_start = torch.randint(1, blocks + 1, (size, 1), generator=generator) * block_length
    position = torch.arange(gen_length)[None]
    semi_ar = torch.rand(size, 1, generator=generator) < 0.5
    in_suffix = position >= suffix_start
    in_current = (position >= suffix_start - block_length) & ~in_suffix
    masked = torch.where(semi_ar, in_suffix | (in_current & masked), masked)
    masked[masked.sum(1) == 0, -1] = True

    inputs = ids.clone()
    inputs[:, width:] = torch.where(masked, tasks.MASK_ID, ids[:, width:])
    return MaskedBatch(inputs, key_mask, ids[:, width:], masked, width)


def masked_loss(model: Denoiser, batch: MaskedBatch) -> Tensor:
    """Mean cross-entropy over the masked response positions."""
    logits = model.denoise(batch.inputs, key_mask=batch.key_mask).logits[:, batch.width:]
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1),
                                reduction="none").view_as(batch.targets)
    return (per_token * batch.masked).sum() / batch.masked.sum()
