"""Comparing speed-quality curves at matched quality: how many tokens per forward each model decodes
at the exact-match another reaches, over the seeds each model was trained with.

The TPF a model reaches at a target exact-match is that of its fastest setting on the grid whose
mean exact-match is at least the target (no interpolation between settings: every figure is a
measured point). A model with no such setting reaches none. A model trained with several seeds is
one curve per seed, and each target gives one TPF per seed: their mean and range are what the
comparison reports, and a model counts as faster than another only where the ranges do not overlap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean

from dlmrt.eval.evaluation import SettingScore

Curve = Sequence[SettingScore]  # one model's results over the grid, in the grid's order


@dataclass(frozen=True)
class MatchedPoint:
    model: str
    target: float  # mean exact-match, a fraction
    tpfs: tuple[float | None, ...]  # one per seed; None where that seed reaches no setting at the target
    settings: tuple[str | None, ...]  # the label of the setting each seed reaches it with

    @property
    def reached(self) -> list[float]:
        return [tpf for tpf in self.tpfs if tpf is not None]

    @property
    def mean(self) -> float | None:
        """Over the seeds that reach the target."""
        return fmean(self.reached) if self.reached else None

    @property
    def low(self) -> float:
        """The slowest seed; a seed that does not reach the target counts as 0."""
        return 0.0 if None in self.tpfs else min(self.reached)

    @property
    def high(self) -> float:
        return max(self.reached, default=0.0)

    def beats(self, other: MatchedPoint) -> bool:
        """Faster beyond the seeds' spread: this model's slowest seed is faster than the other's fastest."""
        return self.low > other.high


def fastest_at(results: Curve, target: float) -> SettingScore | None:
    """The setting with the highest TPF whose mean exact-match is at least `target`."""
    reaching = [r for r in results if r.score.mean >= target - 1e-12]
    return max(reaching, key=lambda r: r.score.metrics.tpf, default=None)


def mean_exact_match(seeds: Sequence[Curve]) -> list[float]:
    """Each setting's exact-match, the mean over the seeds."""
    return [fmean(curve[index].score.mean for curve in seeds) for index in range(len(seeds[0]))]


def targets(reference: Sequence[Curve], below: Sequence[float] = (0.0, 0.01)) -> list[float]:
    """The reference model's best exact-match (of its seeds' mean, setting by setting), less each of
    `below` (fractions)."""
    best = max(mean_exact_match(reference))
    return [best - offset for offset in below]


def matched(curves: Mapping[str, Sequence[Curve]], target_levels: Sequence[float]) -> list[MatchedPoint]:
    """For each target, then each model: the TPF each of its seeds reaches."""
    points = []
    for target in target_levels:
        for model, seeds in curves.items():
            fastest = [fastest_at(curve, target) for curve in seeds]
            points.append(MatchedPoint(model, target,
                                       tuple(None if f is None else f.score.metrics.tpf for f in fastest),
                                       tuple(None if f is None else f.setting.label for f in fastest)))
    return points


def rule_of(result: SettingScore) -> str:
    """The commit rule a setting belongs to: its policy, and for a confidence rule what 'confident' means."""
    policy = result.setting.policy
    return f"{policy.name} ({policy.confidence})"


def by_rule(curves: Mapping[str, Sequence[Curve]]) -> dict[str, dict[str, list[Curve]]]:
    """Each commit rule's part of every curve: {rule: {model: seeds}}, rules in the grid's order."""
    first = next(iter(curves.values()))[0]
    rules = dict.fromkeys(rule_of(r) for r in first)
    return {rule: {model: [[r for r in curve if rule_of(r) == rule] for curve in seeds]
                   for model, seeds in curves.items()}
            for rule in rules}
