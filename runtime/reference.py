"""The reference generate loop: LLaDA's algorithm in plain eager torch.

Deliberately simple (a full forward every step, Python loops over rows). It is
the oracle every faster backend and policy is checked against, so it follows
ML-GSAI/LLaDA's `generate` step by step:

- the canvas is the (left-padded) prompt followed by `gen_length` mask tokens,
  decoded in `gen_length / block_length` semi-autoregressive blocks of
  `steps / num_blocks` steps each;
- at each step of a block, each row commits `masked // steps` of the block's
  masked positions, plus one during the first `masked % steps` steps;
- x0 is the argmax of the logits, with Gumbel noise `exp(l) / (-log u)^T` in
  float64 when the temperature T > 0; confidence is softmax(logits)[x0]
  (`low_confidence`) or uniform noise (`random`); positions after the current
  block get -inf; the most confident masked positions are committed;
- classifier-free guidance runs the prompt-masked canvas beside the real one
  and mixes `uncond + (cfg + 1) * (cond - uncond)`.

Batches are left-padded with a key mask; positions count each row's real
tokens from 0, so a row decodes exactly as it would alone. ORL models carry
their residual from each step to the next. Block-causal models attend on the
absolute grid of `block_length`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dlmrt.errors import ArgumentError
from dlmrt.export.models import Denoiser
from dlmrt.runtime.metrics import GenerationMetrics

REMASKING = ("low_confidence", "random")


@dataclass(frozen=True)
class GenerationSettings:
    gen_length: int = 128
    block_length: int = 128
    steps: int = 128
    remasking: str = "low_confidence"
    temperature: float = 0.0
    cfg_scale: float = 0.0
    seed: int = 0

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    def validate(self) -> None:
        for name in ("gen_length", "block_length", "steps"):
            if getattr(self, name) <= 0:
                raise ArgumentError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.gen_length % self.block_length:
            raise ArgumentError(f"gen-length ({self.gen_length}) must be divisible by block-length "
                                f"({self.block_length})")
        if self.steps % self.num_blocks:
            raise ArgumentError(f"steps ({self.steps}) must be divisible by the number of blocks "
                                f"(gen-length / block-length = {self.num_blocks})")
        if self.remasking not in REMASKING:
            raise ArgumentError(f"remasking must be one of {', '.join(REMASKING)}, got {self.remasking!r}")
        if not self.temperature >= 0:
            raise ArgumentError(f"temperature must be >= 0, got {self.temperature}")
        if not self.cfg_scale >= 0:
            raise ArgumentError(f"cfg-scale must be >= 0, got {self.cfg_scale}")


@dataclass(frozen=True)
class ReferenceOutput:
    tokens: Tensor  # [B, gen_length] the generated ids, prompt excluded
    metrics: GenerationMetrics


def check_prompts(prompts: Sequence[Sequence[int]], model: Denoiser, gen_length: int) -> None:
    """Reject prompts the model cannot take, before any compute."""
    if not prompts:
        raise ArgumentError("no prompt given")
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ArgumentError(f"prompt {row} is empty")
        bad = [t for t in prompt if not 0 <= t < model.vocab_size]
        if bad:
            raise ArgumentError(f"prompt {row} has token ids outside the vocabulary [0, "
                                f"{model.vocab_size}): {bad[:5]}")
        if model.tokens.mask_id in prompt:
            raise ArgumentError(f"prompt {row} contains the mask token id {model.tokens.mask_id} "
                                f"(at position {list(prompt).index(model.tokens.mask_id)})")
        if len(prompt) + gen_length > model.max_positions:
            raise ArgumentError(f"prompt {row} ({len(prompt)} tokens) + gen-length ({gen_length}) "
                                f"exceeds the model's context of {model.max_positions} positions")


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Ids `[B, P]` and key mask `[B, P]` (False on padding), prompts aligned on the right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = True
    return ids, mask


def num_transfer_tokens(masked: Tensor, steps: int) -> Tensor:
    """`[B, steps]` commits per step: `masked // steps`, plus one in the first `masked % steps` steps."""
    base, remainder = masked // steps, masked % steps
    step = torch.arange(steps, device=masked.device)
    return base[:, None] + (step[None, :] < remainder[:, None]).long()


def add_gumbel_noise(logits: Tensor, temperature: float, generator: torch.Generator) -> Tensor:
    """LLaDA's sampling: argmax of `exp(logits) / (-log u)^T` is a Gumbel-max sample at temperature T."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand(logits.shape, dtype=torch.float64, generator=generator, device=logits.device)
    return logits.exp() / (-torch.log(noise)) ** temperature


@torch.no_grad()
def generate(model: Denoiser, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
             on_step: Callable[[], None] | None = None) -> ReferenceOutput:
    settings.validate()
    check_prompts(prompts, model, settings.gen_length)
    started = time.perf_counter()
    mask_id = model.tokens.mask_id
    device = model.device
    prompt_ids, prompt_mask = left_pad(prompts, model.tokens.pad_id)
    batch, prompt_width = prompt_ids.shape
    length = prompt_width + settings.gen_length

    x = torch.full((batch, length), mask_id, dtype=torch.long, device=device)
    x[:, :prompt_width] = prompt_ids
    key_mask = torch.ones((batch, length), dtype=torch.bool, device=device)
    key_mask[:, :prompt_width] = prompt_mask
    positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
    is_prompt = torch.zeros_like(key_mask)
    is_prompt[:, :prompt_width] = prompt_mask
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    guided = settings.cfg_scale > 0
    if guided:
        positions, key_mask = positions.repeat(2, 1), key_mask.repeat(2, 1)

    residual = None
    nfe = 0
    for block in range(settings.num_blocks):
        start = prompt_width + block * settings.block_length
        end = start + settings.block_length
        schedule = num_transfer_tokens((x[:, start:end] == mask_id).sum(1), settings.steps_per_block)
        for step in range(settings.steps_per_block):
            is_masked = x == mask_id
            if guided:
                unconditional = x.masked_fill(is_prompt, mask_id)
                out = model.denoise(torch.cat((x, unconditional)), positions=positions, key_mask=key_mask,
                                    residual=residual, block_length=settings.block_length)
                cond, uncond = out.logits.float().chunk(2)
                logits = uncond + (settings.cfg_scale + 1) * (cond - uncond)
            else:
                out = model.denoise(x, positions=positions, key_mask=key_mask, residual=residual,
                                    block_length=settings.block_length)
                logits = out.logits.float()
            residual = out.residual
            nfe += 1

            x0 = add_gumbel_noise(logits, settings.temperature, generator).argmax(-1)
            if settings.remasking == "low_confidence":
                x0_p = F.softmax(logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1).to(torch.float64)
            else:
                x0_p = torch.rand(x0.shape, dtype=torch.float64, generator=generator, device=device)
            x0_p[:, end:] = float("-inf")
            x0 = torch.where(is_masked, x0, x)
            confidence = torch.where(is_masked, x0_p, float("-inf"))
            commit = torch.zeros_like(is_masked)
            for row in range(batch):
                chosen = confidence[row].topk(int(schedule[row, step])).indices
                commit[row, chosen] = True
            x[commit] = x0[commit]
            if on_step is not None:
                on_step()

    metrics = GenerationMetrics(nfe=nfe, generated_tokens=batch * settings.gen_length,
                                prompt_tokens=int(prompt_mask.sum()), batch_size=batch,
                                latency_s=time.perf_counter() - started)
    return ReferenceOutput(tokens=x[:, prompt_width:].cpu(), metrics=metrics)
