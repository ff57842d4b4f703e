"""The decoding policy of uniform-noise models (DiffusionGemma: no mask token, a canvas of random
tokens): `entropy_bound`, run by `dlmrt.runtime.uniform_noise` with the op `dlmrt.ops.entropy_bound`.
The mask-based policies, and what every policy has (`Policy`), are in `dlmrt.runtime.policies`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dlmrt.core import limits
from dlmrt.core.errors import ArgumentError
from dlmrt.ops.entropy_bound import temperature_schedule
from dlmrt.runtime.device_state import Bucket
from dlmrt.runtime.policies import Policy

if TYPE_CHECKING:
    from dlmrt.runtime.settings import GenerationSettings


@dataclass(frozen=True)
class EntropyBound(Policy):
    """DiffusionGemma's decoding (`DiffusionGemmaGenerationMixin.generate`), for uniform-noise models.

    Each block (the model's canvas) starts as uniform random tokens and takes at most `steps` decoder
    steps. Step s scales the logits by the temperature `t_min + (t_max - t_min) * (steps - s) / steps`,
    samples every position, keeps the samples of the lowest-entropy positions while the entropies
    before them sum to at most `entropy_bound`, and refills the rest with random tokens. A row's
    block ends early once its argmax has not changed for `stability_threshold` steps and its mean
    entropy is below `confidence_threshold`; its tokens are the last argmax, and everything after the
    first EOS becomes pad. Defaults are the public generation defaults."""

    steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    name: ClassVar[str] = "entropy_bound"
    noise: ClassVar[str] = "uniform"
    row_fields: ClassVar[tuple[str, ...]] = ("entropy_bound", "t_min", "t_max", "stability_threshold",
                                             "confidence_threshold")

    @classmethod
    def from_options(cls, options: Mapping[str, Any], generation_config: Mapping[str, Any]) -> Policy:
        """The model's generation_config sets the defaults that the options override."""
        return cls(**{**entropy_bound_defaults(generation_config), **options})

    def row_params(self) -> dict[str, Any]:
        """The temperature of each step of a block (the bucket's schedule room past the last step holds
        1), the last step, and the acceptance and stop rules' bounds."""
        temperatures = torch.ones(Bucket.schedule_room(self.steps))
        temperatures[:self.steps] = temperature_schedule(self.t_min, self.t_max, self.steps)
        return {"temperatures": temperatures, "last_step": self.steps - 1, "entropy_bound": self.entropy_bound,
                "stability_threshold": self.stability_threshold, "confidence_threshold": self.confidence_threshold}

    def validate(self, settings: GenerationSettings) -> None:
        steps = self.steps
        if not isinstance(steps, int) or isinstance(steps, bool) or not 0 < steps <= limits.MAX_POSITIONS:
            raise ArgumentError(f"steps must be an integer in [1, {limits.MAX_POSITIONS}], got {self.steps!r}")
        for name in ("entropy_bound", "t_min", "t_max", "confidence_threshold"):
            value = getattr(self, name)
            problem = limits.float32_problem(value) if isinstance(value, (int, float)) else "must be a number"
            if problem:
                raise ArgumentError(f"{name.replace('_', '-')} {problem}")
        if not self.entropy_bound > 0:
            raise ArgumentError(f"entropy-bound must be positive, got {self.entropy_bound}")
        if not 0 <= self.t_min < self.t_max:
            raise ArgumentError(f"the temperatures must satisfy 0 <= t-min < t-max, got t-min {self.t_min} and "
                                f"t-max {self.t_max}")
        if not self.confidence_threshold > 0:
            raise ArgumentError(f"confidence-threshold must be positive, got {self.confidence_threshold}")
        if not isinstance(self.stability_threshold, int) or self.stability_threshold < 0:
            raise ArgumentError(f"stability-threshold must be a non-negative integer, got {self.stability_threshold!r}")


def entropy_bound_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """EntropyBound's fields that a DiffusionGemma generation_config.json sets, under its own names
    (`max_denoising_steps`, `t_min`, `t_max`, `sampler_config.entropy_bound`, `stability_threshold`,
    `confidence_threshold`); null or absent entries keep the public defaults."""
    sampler = generation_config.get("sampler_config")
    found = {"steps": generation_config.get("max_denoising_steps"), "t_min": generation_config.get("t_min"),
             "t_max": generation_config.get("t_max"),
             "entropy_bound": sampler.get("entropy_bound") if isinstance(sampler, Mapping) else None,
             "stability_threshold": generation_config.get("stability_threshold"),
             "confidence_threshold": generation_config.get("confidence_threshold")}
    return {key: value for key, value in found.items() if value is not None}
