"""The reference generate loop: LLaDA's algorithm in plain eager torch.

Design notes: docs/runtime-modules.md#reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dlmrt.core.errors import ArgumentError
from dlmrt.models import Denoiser
from dlmrt.runtime.metrics import GenerationMetrics
from dlmrt.runtime.policies import Fixed, num_transfer_tokens
from dlmrt.runtime.settings import GenerationSettings, check_request
from dlmrt.runtime.model_spec import ModelSpec


@dataclass(frozen=True)
class ReferenceOutput:
    tokens: Tensor  # [B, gen_length] the generated ids, prompt excluded
    metrics: GenerationMetrics


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Ids `[B, P]` and key mask `[B, P]` (False on padding), prompts aligned on the right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = True
    return ids, mask


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
    """LLaDA's generate on `settings` with a `Fixed` policy and no cache."""
    policy = settings.policy
    if not isinstance(policy, Fixed) or settings.cache != "none":
        raise ArgumentError("the reference loop runs the fixed policy without a cache; use "
                            "dlmrt.runtime.Generator for other policies and cache modes")
    check_request(ModelSpec.of_model(model), prompts, settings)
    steps_per_block = policy.block_steps(settings)
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
    nfe, forward_s = 0, 0.0
    for block in range(settings.num_blocks):
        start = prompt_width + block * settings.block_length
        end = start + settings.block_length
        schedule = num_transfer_tokens((x[:, start:end] == mask_id).sum(1), steps_per_block)
        for step in range(steps_per_block):
            is_masked = x == mask_id
            tick = time.perf_counter()
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
            forward_s += time.perf_counter() - tick

            candidates = logits.index_fill(-1, torch.tensor([mask_id], device=device), float("-inf"))
            x0 = add_gumbel_noise(candidates, settings.temperature, generator).argmax(-1)
            if policy.remasking == "low_confidence":
                x0_p = F.softmax(logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1).to(torch.float64)
            else:
                x0_p = torch.rand(x0.shape, dtype=torch.float64, generator=generator, device=device)
            x0_p[:, end:] = float("-inf")
            x0 = torch.where(is_masked, x0, x)
            confidence = torch.where(is_masked, x0_p, float("-inf"))
            commit = torch.zeros_like(is_masked)
            for row in range(batch):  # top-k, ties broken by position (LLaDA's topk leaves them open)
                ranked = confidence[row].sort(descending=True, stable=True).indices
                commit[row, ranked[:int(schedule[row, step])]] = True
            x[commit] = x0[commit]
            if on_step is not None:
                on_step()

    metrics = GenerationMetrics(nfe=nfe, sequence_forwards=nfe * batch,
                                generated_tokens=batch * settings.gen_length,
                                prompt_tokens=int(prompt_mask.sum()), batch_size=batch,
                                latency_s=time.perf_counter() - started, backend_s=forward_s)
    return ReferenceOutput(tokens=x[:, prompt_width:].cpu(), metrics=metrics)
