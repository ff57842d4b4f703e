"""Where each row's prompt and generated tokens sit on the shared canvas of a batch.

Design notes: docs/runtime-modules.md#layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Layout:
    ids: Tensor  # [B, L] pads, prompt, masks
    key_mask: Tensor  # [B, L] False on padding
    positions: Tensor  # [B, L]
    prompt_lengths: Tensor  # [B]
    output_start: Tensor  # [B] canvas index of each row's first generated token
    decode_end: Tensor  # [B] canvas index after the last position the row denoises
    first_block_start: int  # canvas index of the first generated block
    block_length: int

    @property
    def length(self) -> int:
        return self.ids.shape[1]


def _canvas(rows: Sequence[tuple[int, Sequence[int], int]], length: int, pad_id: int,
            mask_id: int) -> tuple[Tensor, Tensor]:
    """Ids and key mask from (prompt start, prompt, masked count) per row."""
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    key_mask = torch.zeros((len(rows), length), dtype=torch.bool)
    for row, (start, prompt, masked) in enumerate(rows):
        end = start + len(prompt)
        ids[row, start:end] = torch.tensor(list(prompt), dtype=torch.long)
        ids[row, end:end + masked] = mask_id
        key_mask[row, start:end + masked] = True
    return ids, key_mask


def canvas_length(prompts: Sequence[Sequence[int]], gen_length: int, block_length: int, *,
                  block_causal: bool) -> int:
    """The canvas a batch needs without extra padding."""
    lengths = [len(p) for p in prompts]
    if block_causal:
        blocks = max(-(-(n % block_length + gen_length) // block_length) for n in lengths)
        return (max(n // block_length for n in lengths) + blocks) * block_length
    return max(lengths) + gen_length


def build(prompts: Sequence[Sequence[int]], gen_length: int, block_length: int, *, block_causal: bool,
          pad_id: int, mask_id: int) -> Layout:
    """The layout of a batch on the canvas it needs (`canvas_length`)."""
    lengths = [len(p) for p in prompts]
    if block_causal:
        first_block = max(n // block_length for n in lengths)
        blocks = [-(-(n % block_length + gen_length) // block_length) for n in lengths]
        num_blocks = max(blocks)
        shifts = [(first_block - n // block_length) * block_length for n in lengths]
        rows = [(shift, prompt, nb * block_length - len(prompt) % block_length)
                for shift, prompt, nb in zip(shifts, prompts, blocks)]
        first_block_start = first_block * block_length
        output_start = [first_block_start + n % block_length for n in lengths]
        decode_end = [first_block_start + nb * block_length for nb in blocks]
        length = first_block_start + num_blocks * block_length
    else:
        width = max(lengths)
        rows = [(width - len(prompt), prompt, gen_length) for prompt in prompts]
        first_block_start = width
        output_start = [width] * len(prompts)
        length = width + gen_length
        decode_end = [length] * len(prompts)
    ids, key_mask = _canvas(rows, length, pad_id, mask_id)
    positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
    return Layout(ids=ids, key_mask=key_mask, positions=positions,
                  prompt_lengths=torch.tensor(lengths, dtype=torch.long),
                  output_start=torch.tensor(output_start, dtype=torch.long),
                  decode_end=torch.tensor(decode_end, dtype=torch.long),
                  first_block_start=first_block_start, block_length=block_length)
