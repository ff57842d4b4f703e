"""Decoding policies: which masked positions a step commits.

A policy is host-side bookkeeping plus three per-row numbers the step graph
takes as inputs (see `dlmrt.plugins.parallel_unmask`): the minimum commits of
each step (`count`, from a per-block schedule), a confidence `threshold` and
Fast-dLLM's `factor`. Changing a policy or its parameters never needs a new
graph or engine.

| policy | count per step | threshold | factor |
|---|---|---|---|
| `fixed` | LLaDA schedule over the block's masked count | off | off |
| `threshold` | 1 | tau (>=) | off |
| `factor` | 1 | off | f |
| `llada2` | LLaDA schedule over the block length | tau (strictly >) | off |
| `residual` | as its inner `threshold` or `factor` rule | | |

Every policy commits what is left of a block at the last step it may take, so a
block always finishes within its step budget.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from dlmrt import limits
from dlmrt.errors import ArgumentError
from dlmrt.plugins.parallel_unmask import CONFIDENCE_MEASURES, strictly_above

if TYPE_CHECKING:
    from dlmrt.runtime.settings import GenerationSettings

REMASKING = ("low_confidence", "random")


def num_transfer_tokens(masked: Tensor, steps: int) -> Tensor:
    """`[B, steps]` commits per step: `masked // steps`, plus one in the first `masked % steps` steps."""
    base, remainder = masked // steps, masked % steps
    step = torch.arange(steps, device=masked.device)
    return base[:, None] + (step[None, :] < remainder[:, None]).long()


def _check_confidence(confidence: str) -> None:
    if confidence not in CONFIDENCE_MEASURES[:3]:
        raise ArgumentError(f"confidence must be one of prob, margin, entropy, got {confidence!r}")


def _check_threshold(threshold: float) -> None:
    if not 0 < threshold <= 1:
        raise ArgumentError(f"threshold must lie in (0, 1], got {threshold}")


class Policy(ABC):
    name: ClassVar[str]
    confidence: str

    threshold_value: float = math.inf
    factor_value: float = 0.0

    def validate(self, settings: GenerationSettings) -> None:
        """Raise ArgumentError for parameters that cannot work, before any compute."""

    @abstractmethod
    def block_steps(self, settings: GenerationSettings) -> int:
        """The most steps a block takes."""

    @abstractmethod
    def schedule(self, masked: Tensor, block_length: int, steps: int) -> Tensor:
        """`[B, steps]` minimum commits at each step, from the block's masked count `[B]`;
        the counts of each row must add up to at least its masked count."""


class _AtLeastOnePerStep(Policy):
    """Rules that commit at least one position per step: a block takes at most `block_length`
    steps, and its last allowed step commits whatever is left."""

    def block_steps(self, settings: GenerationSettings) -> int:
        return settings.block_length

    def schedule(self, masked: Tensor, block_length: int, steps: int) -> Tensor:
        counts = torch.ones(masked.shape[0], steps, dtype=torch.long, device=masked.device)
        counts[:, -1] = block_length
        return counts


@dataclass(frozen=True)
class Fixed(Policy):
    """LLaDA's schedule: `steps` in all, `steps / num_blocks` per block, the block's masked
    count spread evenly over them; `low_confidence` (max probability) or `random` remasking."""

    steps: int | None = None  # None: one token per step (gen_length)
    remasking: str = "low_confidence"
    name: ClassVar[str] = "fixed"

    @property
    def confidence(self) -> str:
        return "prob" if self.remasking == "low_confidence" else "random"

    def total_steps(self, settings: GenerationSettings) -> int:
        return settings.gen_length if self.steps is None else self.steps

    def validate(self, settings: GenerationSettings) -> None:
        steps = self.total_steps(settings)
        if steps <= 0:
            raise ArgumentError(f"steps must be positive, got {steps}")
        if steps > limits.MAX_POSITIONS:  # LLaDA runs steps beyond one per token (they commit nothing); a bound
            raise ArgumentError(f"steps must be at most {limits.MAX_POSITIONS}, got {steps}")
        if steps % settings.num_blocks:
            raise ArgumentError(f"steps ({steps}) must be divisible by the number of blocks "
                                f"(gen-length / block-length = {settings.num_blocks})")
        if self.remasking not in REMASKING:
            raise ArgumentError(f"remasking must be one of {', '.join(REMASKING)}, got {self.remasking!r}")

    def block_steps(self, settings: GenerationSettings) -> int:
        return self.total_steps(settings) // settings.num_blocks

    def schedule(self, masked: Tensor, block_length: int, steps: int) -> Tensor:
        return num_transfer_tokens(masked, steps)


@dataclass(frozen=True)
class Threshold(_AtLeastOnePerStep):
    """Fast-dLLM: commit every masked position of the block with confidence >= threshold, and
    always at least the most confident one."""

    threshold: float = 0.9
    confidence: str = "prob"
    name: ClassVar[str] = "threshold"

    @property
    def threshold_value(self) -> float:  # type: ignore[override]
        return self.threshold

    def validate(self, settings: GenerationSettings) -> None:
        _check_threshold(self.threshold)
        _check_confidence(self.confidence)


@dataclass(frozen=True)
class Factor(_AtLeastOnePerStep):
    """Fast-dLLM's factor rule: commit the longest prefix of the confidence-sorted masked
    positions with `(n + 1) * (1 - c_n) < factor`, and at least one."""

    factor: float = 1.0
    confidence: str = "prob"
    name: ClassVar[str] = "factor"

    @property
    def factor_value(self) -> float:  # type: ignore[override]
        return self.factor

    def validate(self, settings: GenerationSettings) -> None:
        problem = limits.float32_problem(self.factor) if isinstance(self.factor, (int, float)) else "must be a number"
        if problem or not self.factor > 0:
            raise ArgumentError(f"factor {problem or f'must be positive, got {self.factor}'}")
        _check_confidence(self.confidence)


@dataclass(frozen=True)
class LLaDA2(Policy):
    """LLaDA2.x's own generate: per step, n_k from the LLaDA schedule over the block length; if at
    least n_k masked positions have p > threshold all of them are committed, else the n_k most
    confident. `steps` is per block, capped at `gen_length // minimal_topk`."""

    threshold: float = 0.95
    steps: int = 32
    minimal_topk: int = 1
    confidence: str = "prob"
    name: ClassVar[str] = "llada2"

    @property
    def threshold_value(self) -> float:  # type: ignore[override]
        return strictly_above(self.threshold)

    def validate(self, settings: GenerationSettings) -> None:
        _check_threshold(self.threshold)
        _check_confidence(self.confidence)
        if self.steps <= 0:
            raise ArgumentError(f"steps must be positive, got {self.steps}")
        if self.minimal_topk <= 0:
            raise ArgumentError(f"minimal-topk must be positive, got {self.minimal_topk}")
        if self.block_steps(settings) <= 0:
            raise ArgumentError(f"gen-length ({settings.gen_length}) // minimal-topk "
                                f"({self.minimal_topk}) leaves no step")

    def block_steps(self, settings: GenerationSettings) -> int:
        return min(self.steps, settings.gen_length // self.minimal_topk)

    def schedule(self, masked: Tensor, block_length: int, steps: int) -> Tensor:
        full = torch.full_like(masked, block_length)
        return num_transfer_tokens(full, steps)


@dataclass(frozen=True)
class Residual(Policy):
    """ORL decoding: the residual `z` carried from step to step, with a threshold or factor rule.

    An ORL model carries `z` under every policy, because `z` is part of its input; this policy
    states the intent and refuses a model without the pathway."""

    rule: Threshold | Factor = field(default_factory=Threshold)
    name: ClassVar[str] = "residual"

    @property
    def confidence(self) -> str:
        return self.rule.confidence

    @property
    def threshold_value(self) -> float:  # type: ignore[override]
        return self.rule.threshold_value

    @property
    def factor_value(self) -> float:  # type: ignore[override]
        return self.rule.factor_value

    def validate(self, settings: GenerationSettings) -> None:
        self.rule.validate(settings)

    def block_steps(self, settings: GenerationSettings) -> int:
        return self.rule.block_steps(settings)

    def schedule(self, masked: Tensor, block_length: int, steps: int) -> Tensor:
        return self.rule.schedule(masked, block_length, steps)


POLICIES = ("fixed", "threshold", "factor", "llada2", "residual")


def make_policy(name: str, *, steps: int | None = None, remasking: str = "low_confidence",
                threshold: float | None = None, factor: float | None = None,
                confidence: str = "prob", minimal_topk: int = 1) -> Policy:
    """A policy from command-line style parameters; unknown names get one clear error."""
    if name == "fixed":
        return Fixed(steps=steps, remasking=remasking)
    if name == "threshold":
        return Threshold(0.9 if threshold is None else threshold, confidence)
    if name == "factor":
        return Factor(1.0 if factor is None else factor, confidence)
    if name == "llada2":
        return LLaDA2(0.95 if threshold is None else threshold, 32 if steps is None else steps,
                      minimal_topk, confidence)
    if name == "residual":
        if factor is not None:
            return Residual(Factor(factor, confidence))
        return Residual(Threshold(0.9 if threshold is None else threshold, confidence))
    raise ArgumentError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
