"""The decoding policies by name: what the command line, the server and eval know of each, importable
without torch (`dlmrt --help` stays fast). A policy's class, in `dlmrt.runtime.policies` (or
`dlmrt.runtime.uniform_policy`), imports on first use."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dlmrt.runtime.policies import Policy


@dataclass(frozen=True)
class PolicyEntry:
    class_name: str
    description: str  # one line, for help
    options: Mapping[str, type]  # the make_policy options it takes, with the type of their values
    module: str = "dlmrt.runtime.policies"  # where the class is

    @property
    def policy_class(self) -> type[Policy]:
        return getattr(importlib.import_module(self.module), self.class_name)

    @property
    def noise(self) -> str:
        """What a position not yet decoded holds in the models the policy decodes: "mask" or "uniform"."""
        return self.policy_class.noise


POLICIES: dict[str, PolicyEntry] = {
    "fixed": PolicyEntry("Fixed", "LLaDA's schedule, an even share of the block per step",
                         {"steps": int, "remasking": str}),
    "threshold": PolicyEntry("Threshold", "Fast-dLLM, every position at least --threshold confident",
                             {"threshold": float, "confidence": str}),
    "factor": PolicyEntry("Factor", "Fast-dLLM's factor rule", {"factor": float, "confidence": str}),
    "llada2": PolicyEntry("LLaDA2", "LLaDA2.x's own decoding",
                          {"threshold": float, "steps": int, "minimal_topk": int, "confidence": str}),
    "llada21": PolicyEntry("LLaDA21", "LLaDA2.1's decoding, with token editing",
                           {"threshold": float, "editing_threshold": float, "max_post_steps": int, "preset": str}),
    "dream": PolicyEntry("Dream", "Dream's own decoding", {"steps": int, "confidence": str}),
    "residual": PolicyEntry("ResidualPolicy", "threshold or factor for ORL models, carrying the residual",
                            {"threshold": float, "factor": float, "confidence": str}),
    "entropy_bound": PolicyEntry("EntropyBound", "DiffusionGemma's, for uniform-noise models",
                                 {"steps": int, "entropy_bound": float}, "dlmrt.runtime.uniform_policy"),
}


def unknown_policy(name: str) -> str:
    """What to say of a policy name the registry does not hold: the names it does, and the closest one."""
    import difflib

    close = difflib.get_close_matches(name, POLICIES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown policy {name!r} (known: {', '.join(POLICIES)}){hint}"


# LLaDA2.1's documented modes, as the llada21 options they set; an editing threshold of 1 turns editing off.
LLADA21_PRESETS: dict[str, dict[str, float | int]] = {
    "quality": {"threshold": 0.7, "editing_threshold": 0.5, "max_post_steps": 16},
    "speed": {"threshold": 0.5, "editing_threshold": 1.0, "max_post_steps": 16},
}
