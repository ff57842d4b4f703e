"""Comparing speed-quality curves at matched quality: how many tokens per forward each model decodes
at the exact-match another reaches.

The TPF a model reaches at a target exact-match is that of its fastest setting on the grid whose
mean exact-match is at least the target (no interpolation between settings: every figure is a
measured point). A model with no such setting reaches none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dlmrt.eval.evaluation import SettingScore


@dataclass(frozen=True)
class MatchedPoint:
    model: str
    target: float  # mean exact-match, a fraction
    tpf: float | None
    setting: str | None  # the label of the setting that reaches it


def fastest_at(results: Sequence[SettingScore], target: float) -> SettingScore | None:
    """The setting with the highest TPF whose mean exact-match is at least `target`."""
    reaching = [r for r in results if r.score.mean >= target - 1e-12]
    return max(reaching, key=lambda r: r.score.metrics.tpf, default=None)


def targets(base: Sequence[SettingScore], below: float = 0.01) -> list[float]:
    """The base model's best mean exact-match, and `below` (a fraction) under it."""
    best = max(r.score.mean for r in base)
    return [best, best - below]


def matched(curves: Mapping[str, Sequence[SettingScore]], target_levels: Sequence[float]) -> list[MatchedPoint]:
    points = []
    for target in target_levels:
        for model, results in curves.items():
            fastest = fastest_at(results, target)
            points.append(MatchedPoint(model, target, None if fastest is None else fastest.score.metrics.tpf,
                                       None if fastest is None else fastest.setting.label))
    return points
