"""The backend contract: run one step graph on buffers allocated once per shape bucket.

A step is the denoiser forward over a window of the canvas fused with the
parallel unmasking of the block inside that window (DESIGN.md, "Step graph"):

    inputs   ids [B, W], positions [B, W], key_mask [B, P + W], past K/V [L, 2, B', Hkv, P, D]
             and its positions [B', P], the block's offset in the window, per-row policy
             parameters [B], prompt lengths [B] (for guidance), and for ORL models z [B', W, H]
             with its certainty [B', W]
    outputs  the block's ids after unmasking, its confidence and commit mask [B, block], the
             per-row commit count [B], the window's K/V [L, 2, B', Hkv, W, D] (on request), and
             for ORL models the next z and certainty [B', W, ...]

B' is B, or 2B with classifier-free guidance (the unconditional rows follow the
conditional ones). The loop never knows which backend runs the step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from dlmrt.plugins.parallel_unmask import UnmaskParams


@dataclass(frozen=True)
class ModelSpec:
    """What the loop needs to know about the model behind a backend."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    mask_id: int
    eos_ids: tuple[int, ...]
    pad_id: int
    block_causal: bool
    has_residual: bool
    dtype: torch.dtype
    device: torch.device
    # What a compiled backend was built for (None: no limit), and how to lift its limits.
    max_batch: int | None = None
    limits_hint: str = ""
    block_grid: int | None = None  # the block-causal grid a compiled graph was built with
    supports_guidance: bool = True


class StepShapes(NamedTuple):
    """A shape bucket: buffers are allocated once per distinct value."""

    batch: int  # conditional rows
    window: int
    prefix: int
    block: int
    return_kv: bool
    guided: bool  # classifier-free guidance doubles the model's rows


@dataclass
class StepInputs:
    ids: Tensor
    positions: Tensor
    key_mask: Tensor
    past_kv: Tensor | None  # None when the prefix is empty
    past_positions: Tensor | None
    block_offset: int  # where the block starts inside the window
    block_length: int
    params: UnmaskParams
    prompt_lengths: Tensor
    z: Tensor | None
    certainty: Tensor | None
    return_kv: bool
    cfg_scale: float
    confidence: str
    sampling: bool  # whether any row has temperature > 0
    grid: int | None  # the block-causal grid, for block-diffusion models

    def shapes(self) -> StepShapes:
        prefix = 0 if self.past_kv is None else self.past_kv.shape[4]
        return StepShapes(self.ids.shape[0], self.ids.shape[1], prefix, self.block_length,
                          self.return_kv, self.cfg_scale > 0)


class StepOutputs(NamedTuple):
    ids: Tensor  # [B, block]
    confidence: Tensor  # [B, block]
    commit: Tensor  # [B, block]
    committed: Tensor  # [B]
    kv: Tensor | None  # [L, 2, B', Hkv, W, D]
    z: Tensor | None  # [B', W, H]
    certainty: Tensor | None  # [B', W]


class Backend(ABC):
    spec: ModelSpec

    @abstractmethod
    def prepare(self, shapes: StepShapes) -> None:
        """Allocate what a step of these shapes needs (called before the first such step)."""

    @abstractmethod
    def step(self, inputs: StepInputs) -> StepOutputs:
        """Run one step; the outputs live in the backend's buffers until the next step of the
        same shapes."""

    def synchronize(self) -> None:
        """Wait for queued device work (for timing)."""
        if self.spec.device.type == "cuda":
            torch.cuda.synchronize(self.spec.device)
