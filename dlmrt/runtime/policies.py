"""Decoding policies: which masked positions a step commits.

A policy is host-side bookkeeping plus a few per-row numbers the step graph
takes as inputs (see `dlmrt.ops.parallel_unmask`): the minimum commits of
each step (`count`, from a per-block schedule), and what `row_params()`
returns, by buffer name: a confidence `threshold`, Fast-dLLM's `factor`, the
confidence `measure`, and for token editing an `edit_threshold` and the
editing-only steps a block may take after its last mask (`max_post_steps`).
The static options of the step programs that come from the policy (the
confidence measure every row uses, whether steps edit) are its
`step_flags()`. Changing a policy or its parameters never needs a new graph or engine.

Each policy's per-step count, threshold and factor are tabled in docs/policies.md.

Every policy commits what is left of a block at the last step it may take, so a
block always finishes within its step budget.

Those are mask-based policies (`MaskPolicy`). A uniform-noise model (DiffusionGemma: no mask token, a
canvas of random tokens) takes `entropy_bound` instead (`EntropyBound`, in `dlmrt.runtime.uniform_policy`,
run by `dlmrt.runtime.uniform_noise` with the op `dlmrt.ops.entropy_bound`); each kind of policy refuses
the other kind of model.

`make_policy` builds a policy by its name in `dlmrt.runtime.policy_registry.POLICIES`.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from dlmrt.core import limits
from dlmrt.core.errors import ArgumentError
from dlmrt.ops.parallel_unmask import CONFIDENCE_MEASURES, MEASURE_CODES, strictly_above
from dlmrt.runtime.policy_registry import LLADA21_PRESETS, POLICIES, unknown_policy

if TYPE_CHECKING:
    from dlmrt.runtime.settings import GenerationSettings

REMASKING = ("low_confidence", "random")
# Options that only one policy takes, refused under any other (the others are ignored there): that
# policy, the options, and what the error says of them.
EXCLUSIVE_OPTIONS = (
    ("llada21", ("preset",), f"presets ({', '.join(LLADA21_PRESETS)}) belong"),
    ("llada21", ("editing_threshold", "max_post_steps"), "editing-threshold and max-post-steps belong"),
    ("entropy_bound", ("entropy_bound",), "entropy-bound belongs"),
)


def num_transfer_tokens(masked: Tensor, steps: int) -> Tensor:
    """`[B, steps]` commits per step: `masked // steps`, plus one in the first `masked % steps` steps."""
    base, remainder = masked // steps, masked % steps
    step = torch.arange(steps, device=masked.device)
    return base[:, None] + (step[None, :] < remainder[:, None]).long()


def _check_confidence(confidence: str) -> None:
    if confidence not in CONFIDENCE_MEASURES[:3]:
        raise ArgumentError(f"confidence must be one of prob, margin, entropy, got {confidence!r}")


def _check_total_steps(steps: int, settings: GenerationSettings, positive: str) -> None:
    """A whole run's step count: positive, bounded (LLaDA runs steps beyond one per token, which commit
    nothing), and an even share per block."""
    if steps <= 0:
        raise ArgumentError(f"steps {positive}, got {steps}")
    if steps > limits.MAX_POSITIONS:
        raise ArgumentError(f"steps must be at most {limits.MAX_POSITIONS}, got {steps}")
    if steps % settings.num_blocks:
        raise ArgumentError(f"steps ({steps}) must be divisible by the number of blocks "
                            f"(gen-length / block-length = {settings.num_blocks})")


def _check_threshold(threshold: float) -> None:
    if not 0 < threshold <= 1:
        raise ArgumentError(f"threshold must lie in (0, 1], got {threshold}")


class Policy(ABC):
    """What every decoding policy has, whichever noise the models it decodes carry."""

    name: ClassVar[str]
    # What a position not yet decoded holds in the models the policy decodes (Denoiser.noise).
    noise: ClassVar[str]
    # Fields the step reads from each row's own buffer, which neither the block's step budget nor the
    # step kind depends on: rows that differ only there share a batch.
    row_fields: ClassVar[tuple[str, ...]] = ()

    def shared(self) -> Policy:
        """This policy with its per-row fields at their defaults: what rows sharing a batch agree on."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in self.row_fields}
        return dataclasses.replace(self, **defaults)

    @abstractmethod
    def row_params(self) -> dict[str, Any]:
        """What the step reads from each row's own buffers, by buffer name: every such buffer, so that
        a row leaves nothing of a slot's last row. The batch writes them as they are."""

    def step_flags(self) -> dict[str, Any]:
        """The step options this policy fixes for a whole batch, by the keyword of the noise kind's
        step kinds (each value is a step program of its own)."""
        return {}

    @property
    def edits(self) -> bool:
        """Whether the policy overwrites committed tokens (token editing)."""
        return bool(self.step_flags().get("editing", False))

    def validate(self, settings: GenerationSettings) -> None:
        """Raise ArgumentError for parameters that cannot work, before any compute."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any], generation_config: Mapping[str, Any]) -> Policy:
        """The policy from the make_policy options given (those it takes, none None); the rest keep
        their defaults."""
        return cls(**options)


class MaskPolicy(Policy):
    """A policy for mask-based models: the per-row numbers the step graph of `dlmrt.ops.parallel_unmask`
    takes, and the schedule of minimum commits."""

    noise: ClassVar[str] = "mask"
    confidence: str

    def row_params(self) -> dict[str, float | int]:
        """Commit positions with confidence >= `threshold` (inf: none) and Fast-dLLM's `factor` prefix
        (0: none), by the confidence `measure`; overwrite committed tokens with p(x0) >=
        `edit_threshold` (inf: never), for up to `max_post_steps` editing-only steps once the block has
        no mask. This base is the rule that commits only the scheduled count, and never edits."""
        return {"threshold": math.inf, "factor": 0.0, "measure": MEASURE_CODES[self.confidence],
                "edit_threshold": math.inf, "max_post_steps": 0}

    def step_flags(self) -> dict[str, Any]:
        return {"confidence": self.confidence, "editing": False}

    @abstractmethod
    def block_steps(self, settings: GenerationSettings) -> int:
        """The most steps a block takes."""

    @abstractmethod
    def schedule(self, masked: Tensor, block_length: int, steps: int) -> Tensor:
        """`[B, steps]` minimum commits at each step, from the block's masked count `[B]`;
        the counts of each row must add up to at least its masked count."""


class _AtLeastOnePerStep(MaskPolicy):
    """Rules that commit at least one position per step: a block takes at most `block_length`
    steps, and its last allowed step commits whatever is left."""

    def block_steps(self, settings: GenerationSettings) -> int:
        return settings.block_length

    def schedule(self, masked: Tensor, block_length: int, steps: int) -> Tensor:
        counts = torch.ones(masked.shape[0], steps, dtype=torch.long, device=masked.device)
        counts[:, -1] = block_length
        return counts


@dataclass(frozen=True)
class Fixed(MaskPolicy):
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
        _check_total_steps(self.total_steps(settings), settings, "must be positive")
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
    row_fields: ClassVar[tuple[str, ...]] = ("threshold",)

    def row_params(self) -> dict[str, float | int]:
        return {**super().row_params(), "threshold": self.threshold}

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
    row_fields: ClassVar[tuple[str, ...]] = ("factor",)

    def row_params(self) -> dict[str, float | int]:
        return {**super().row_params(), "factor": self.factor}

    def validate(self, settings: GenerationSettings) -> None:
        problem = limits.float32_problem(self.factor) if isinstance(self.factor, (int, float)) else "must be a number"
        if problem or not self.factor > 0:
            raise ArgumentError(f"factor {problem or f'must be positive, got {self.factor}'}")
        _check_confidence(self.confidence)


@dataclass(frozen=True)
class LLaDA2(MaskPolicy):
    """LLaDA2.x's own generate: per step, n_k from the LLaDA schedule over the block length; if at
    least n_k masked positions have p > threshold all of them are committed, else the n_k most
    confident. `steps` is per block, capped at `gen_length // minimal_topk`."""

    threshold: float = 0.95
    steps: int = 32
    minimal_topk: int = 1
    confidence: str = "prob"
    name: ClassVar[str] = "llada2"
    row_fields: ClassVar[tuple[str, ...]] = ("threshold",)

    def row_params(self) -> dict[str, float | int]:
        return {**super().row_params(), "threshold": strictly_above(self.threshold)}

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
class LLaDA21(MaskPolicy):
    """LLaDA2.1's decoding with token-to-token editing (its public generate, per row).

    Each step commits every masked position of the block with p > threshold, or the
    `num_to_transfer` most confident when fewer pass; it also overwrites committed, generated
    positions of the block whose argmax differs from their token with p > edit_threshold. Once
    the block has no mask, up to `max_post_steps` editing-only steps follow, stopping at the first
    that edits nothing. An editing threshold of 1 turns editing off (no probability is above 1):
    then no editing-only step runs, which saves the forward the public generate spends finding that
    out and changes no token."""

    threshold: float = 0.95
    edit_threshold: float = 0.9
    max_post_steps: int = 16
    num_to_transfer: int = 1
    confidence: str = "prob"
    name: ClassVar[str] = "llada21"

    def row_params(self) -> dict[str, float | int]:
        params = {**super().row_params(), "threshold": strictly_above(self.threshold)}
        if self.edits:
            params.update(edit_threshold=strictly_above(self.edit_threshold), max_post_steps=self.max_post_steps)
        return params

    @property
    def _post_steps(self) -> int:
        return self.max_post_steps if self.edits else 0

    def step_flags(self) -> dict[str, Any]:
        return {**super().step_flags(), "editing": self.edit_threshold < 1}

    @classmethod
    def from_options(cls, options: Mapping[str, Any], generation_config: Mapping[str, Any]) -> Policy:
        """`preset` sets the defaults that the other options override; the option `editing_threshold` is
        the field `edit_threshold`."""
        preset = options.get("preset")
        if preset is not None and preset not in LLADA21_PRESETS:
            raise ArgumentError(f"unknown llada21 preset {preset!r} (known: {', '.join(LLADA21_PRESETS)})")
        chosen = {**LLADA21_PRESETS.get(preset, {}), **options}
        chosen.pop("preset", None)
        if "editing_threshold" in chosen:
            chosen["edit_threshold"] = chosen.pop("editing_threshold")
        return cls(**chosen)

    def validate(self, settings: GenerationSettings) -> None:
        _check_threshold(self.threshold)
        if not (isinstance(self.edit_threshold, (int, float)) and 0 < self.edit_threshold <= 1):
            raise ArgumentError(f"editing-threshold must lie in (0, 1] (1 turns editing off), got "
                                f"{self.edit_threshold}")
        for name, value, floor in (("max-post-steps", self.max_post_steps, 0),
                                   ("num-to-transfer", self.num_to_transfer, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < floor:
                raise ArgumentError(f"{name} must be an integer >= {floor}, got {value!r}")
            if value > limits.MAX_POSITIONS:
                raise ArgumentError(f"{name} must be at most {limits.MAX_POSITIONS}, got {value}")

    def block_steps(self, settings: GenerationSettings) -> int:
        """Every step commits at least one mask, so the masks take at most a block's length of steps."""
        return settings.block_length + self._post_steps

    def schedule(self, masked: Tensor, block_length: int, steps: int) -> Tensor:
        counts = torch.full((masked.shape[0], steps), self.num_to_transfer, dtype=torch.long, device=masked.device)
        counts[:, -1] = block_length
        return counts


def dream_schedule(masked: Tensor, steps: int, eps: float) -> Tensor:
    """`[B, steps]` commits per step of Dream's `diffusion_generate`: with t, s consecutive entries of
    float32 `linspace(1, eps, steps + 1)`, step i commits `int(m * (1 - s / t))` of the m positions still
    masked, and the last step all of them. Computed in float32 as Dream computes it, since its floor
    decides the count (with eps > 0 the product lands just below a whole number)."""
    timesteps = torch.linspace(1, eps, steps + 1, device=masked.device)
    left = masked.clone()
    counts = torch.empty(masked.shape[0], steps, dtype=torch.long, device=masked.device)
    for i in range(steps):
        ratio = 1 - timesteps[i + 1] / timesteps[i]
        counts[:, i] = left if i == steps - 1 else (left.to(torch.float32) * ratio).long()
        left = left - counts[:, i]
    return counts


@dataclass(frozen=True)
class Dream(MaskPolicy):
    """Dream's own decoding (`diffusion_generate`, at temperature 0 with top-k selection): `steps`
    forwards in all, `steps / num_blocks` per block, each committing the `dream_schedule` count of its
    most confident masked positions. A block as long as gen-length is Dream's whole canvas.

    Dream's algorithms are dlmrt's confidence measures: `maskgit_plus` is `prob`, `topk_margin` is
    `margin`, and `entropy` (sum p log p) is `entropy` (1 - H / log V, the same order). Dream counts
    the masked positions as the batch's mean; dlmrt counts each row's own, so that a row decodes as it
    would alone (the same for one row, and for rows with the same masked count)."""

    steps: int | None = None  # None: one token per step (gen_length)
    eps: float = 1e-3
    confidence: str = "prob"
    name: ClassVar[str] = "dream"

    def total_steps(self, settings: GenerationSettings) -> int:
        return settings.gen_length if self.steps is None else self.steps

    def validate(self, settings: GenerationSettings) -> None:
        _check_confidence(self.confidence)
        steps = self.total_steps(settings)
        if not isinstance(steps, int) or isinstance(steps, bool):
            raise ArgumentError(f"steps must be a positive integer, got {steps!r}")
        _check_total_steps(steps, settings, "must be a positive integer")
        if steps > settings.gen_length:  # Dream's schedule over more steps commits differently, not more slowly
            raise ArgumentError(f"steps ({steps}) must be at most gen-length ({settings.gen_length}): a block "
                                f"takes at most one step per position")
        if not (isinstance(self.eps, (int, float)) and 0 <= self.eps < 1):
            raise ArgumentError(f"eps must lie in [0, 1), got {self.eps}")

    def block_steps(self, settings: GenerationSettings) -> int:
        return self.total_steps(settings) // settings.num_blocks

    def schedule(self, masked: Tensor, block_length: int, steps: int) -> Tensor:
        return dream_schedule(masked, steps, self.eps)


@dataclass(frozen=True)
class ResidualPolicy(MaskPolicy):
    """ORL decoding: the residual `z` carried from step to step, with a threshold or factor rule.

    An ORL model carries `z` under every policy, because `z` is part of its input; this policy
    states the intent and refuses a model without the pathway."""

    rule: Threshold | Factor = field(default_factory=Threshold)
    name: ClassVar[str] = "residual"

    @property
    def confidence(self) -> str:
        return self.rule.confidence

    def row_params(self) -> dict[str, float | int]:
        return self.rule.row_params()

    def step_flags(self) -> dict[str, Any]:
        return self.rule.step_flags()

    def shared(self) -> MaskPolicy:
        return ResidualPolicy(self.rule.shared())

    @classmethod
    def from_options(cls, options: Mapping[str, Any], generation_config: Mapping[str, Any]) -> Policy:
        """The factor rule when a factor is given, else the threshold rule."""
        rule, rule_options = (Factor, ("factor", "confidence")) if "factor" in options else \
            (Threshold, ("threshold", "confidence"))
        return cls(rule(**{key: value for key, value in options.items() if key in rule_options}))

    def validate(self, settings: GenerationSettings) -> None:
        self.rule.validate(settings)

    def block_steps(self, settings: GenerationSettings) -> int:
        return self.rule.block_steps(settings)

    def schedule(self, masked: Tensor, block_length: int, steps: int) -> Tensor:
        return self.rule.schedule(masked, block_length, steps)


def make_policy(name: str, *, generation_config: Mapping[str, Any] | None = None,
                **options: int | float | str | None) -> Policy:
    """A policy from command-line style options (those of `POLICIES`; None or absent: the policy's
    default). Options the policy does not take are ignored, except those only one other policy takes
    (`EXCLUSIVE_OPTIONS`); unknown names get one clear error. `generation_config` (a model's
    generation_config.json) sets entropy_bound's defaults."""
    unknown = options.keys() - {option for entry in POLICIES.values() for option in entry.options}
    if unknown:
        raise TypeError(f"make_policy() got unexpected options {', '.join(sorted(unknown))}")
    for owner, exclusive, subject in EXCLUSIVE_OPTIONS:
        if name != owner and any(options.get(option) is not None for option in exclusive):
            raise ArgumentError(f"{subject} to policy {owner}, not {name!r}")
    entry = POLICIES.get(name)
    if entry is None:
        raise ArgumentError(unknown_policy(name))
    given = {key: value for key, value in options.items() if key in entry.options and value is not None}
    return entry.policy_class.from_options(given, generation_config or {})
