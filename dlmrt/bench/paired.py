"""Paired timing for the regression gate: cases interleaved round by round, per-round ratios, the
median ratio with a bootstrap confidence interval, and the rules that fail a ratio.

    rounds = interleaved_rounds(cases, rounds=9, warmups=1)
    speed = median_with_ci(paired_ratios(rounds.seconds["reference"], rounds.seconds["torch:eager"]))
    if slower(speed.high, baseline_ratio, margin=0.15): ...

The statistics, and why:

- **Pairing.** Every round runs every case once, in an order shuffled per round with a fixed seed,
  so a ratio within a round compares cases timed seconds apart, on the same machine state. What
  drifts over the run (another process's load, the clock, a neighbour's cache) cancels in the ratio,
  and the rounds' ratios are paired samples whose spread is the noise of one round, not of the run.
  Shuffling keeps any order effect (which case runs after which) from biasing one case.
- **The median ratio** of the rounds is the estimate: one disturbed round moves it little.
- **Its uncertainty** is a percentile bootstrap: resample the rounds with replacement, take each
  resample's median, and the interval is the central `confidence` share of those medians. It
  assumes nothing about the noise's shape, and it is deterministic (seeded). With few rounds it is
  wide: with 5 rounds the upper end of a 95% interval is the best round, so 9 or more rounds are
  what give the median its edge over the best round.
- **The rule.** A ratio is slower when even its interval's upper end lies below the baseline ratio
  less a margin of at most MAX_MARGIN: the run must show, with confidence, a drop larger than the
  margin. A noisy run widens the interval and passes; it cannot fail the gate by chance alone.
- **Modes side by side.** The same rounds time eager, compile and ONNX Runtime, so their ratios to
  one another are paired too, and each is held like a ratio to the reference: compile and ONNX
  Runtime must keep their recorded ratios to eager, and compile must not be slower than eager. A
  silent fallback to eager shows there even when every ratio to the reference looks fine, as long
  as compile's recorded gain exceeds the margin (1.18x at 15%; the tiny model's is 1.27-1.31x
  single-threaded). Requiring the interval to lie wholly above 1 instead failed a sound compile
  (1.27x) in 1 run of 5 on an oversubscribed machine, where noise widened it to 0.91-2.61x.

Pairing cancels what slows every case alike, not what slows them unevenly, as threads that wait on
one another do. Measured on 2 shared cores (tiny-threshold-dual, 9 rounds) while another process
kept one core busy: with torch's 2 threads, a descheduled thread stalls the other at every parallel
region, runs took 2 to 18 times their quiet time at random, and the ratios to the reference came
out at 1.85x (1.25-3.46x) for eager and 10.7x for ONNX Runtime; with torch on one thread, at 2.08x
(2.04-2.17x) and 2.85x (2.84-2.92x), against 2.13x and 3.39x with the core free, ONNX Runtime
still on 2 threads and 16% low. So on a shared machine, time the cases single-threaded (torch and
ONNX Runtime), and ONNX Runtime without spinning threads (OrtBackend's `spinning`), which slow the
case run after it.

Times are seconds per run of a case's fixed work (for a generate case: the same prompts decoded to
the same tokens every round), so a ratio of seconds, base over case, is the case's speed over the
base's (its tokens/s ratio).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dlmrt.bench.case import Case

# The most a ratio may drop before it fails: larger margins hid 30% slowdowns.
MAX_MARGIN = 0.15
EAGER, COMPILE, ORT = "torch:eager", "torch:compile", "ort"


@dataclass(frozen=True)
class Rounds:
    """Per case label: the seconds of each timed round's run, and what the run returned, in round order;
    and what each untimed warm-up run returned (where compiling shows)."""
    seconds: dict[str, list[float]]
    results: dict[str, list[object]]
    warmups: dict[str, list[object]]


def interleaved_rounds(cases: Sequence[Case], rounds: int, warmups: int = 1, seed: int = 0,
                       advance: Callable[[], None] | None = None) -> Rounds:
    """Every case run `warmups` times untimed (where it compiles), then `rounds` rounds in which every
    case runs once, in an order shuffled per round (seeded). Each run is timed by the wall clock
    around `case.run()`. `advance` is called after every run (a progress bar's)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    labels = [case.label for case in cases]
    if len(set(labels)) != len(labels):
        raise ValueError(f"case labels must be distinct, got {labels}")
    warmed: dict[str, list[object]] = {label: [] for label in labels}
    for case in cases:
        for _ in range(warmups):
            warmed[case.label].append(case.run())
            if advance is not None:
                advance()
    order = list(cases)
    shuffle = random.Random(seed).shuffle
    seconds: dict[str, list[float]] = {label: [] for label in labels}
    results: dict[str, list[object]] = {label: [] for label in labels}
    for _ in range(rounds):
        shuffle(order)
        for case in order:
            started = time.perf_counter()
            result = case.run()
            seconds[case.label].append(time.perf_counter() - started)
            results[case.label].append(result)
            if advance is not None:
                advance()
    return Rounds(seconds, results, warmed)


def paired_ratios(a_seconds: Sequence[float], b_seconds: Sequence[float]) -> list[float]:
    """Round by round, a's seconds over b's: how many times faster b ran than a in that round."""
    if len(a_seconds) != len(b_seconds) or not a_seconds:
        raise ValueError(f"paired ratios need as many rounds of each case (at least one), got "
                         f"{len(a_seconds)} and {len(b_seconds)}")
    return [a / b for a, b in zip(a_seconds, b_seconds)]


class Estimate(NamedTuple):
    """A median and its confidence interval."""
    median: float
    low: float
    high: float


def median_with_ci(values: Sequence[float], confidence: float = 0.95, resamples: int = 10_000,
                   seed: int = 0) -> Estimate:
    """The median of `values` and the percentile bootstrap interval of the median: the central
    `confidence` share of the medians of `resamples` resamples of `values` with replacement."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}")
    data = np.asarray(values, dtype=float)
    if data.ndim != 1 or data.size == 0:
        raise ValueError("median_with_ci needs a non-empty sequence of numbers")
    picks = np.random.default_rng(seed).integers(0, data.size, size=(resamples, data.size))
    medians = np.median(data[picks], axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(medians, [tail, 1 - tail])
    return Estimate(float(np.median(data)), float(low), float(high))


def slower(ci_high: float, baseline_ratio: float, margin: float) -> bool:
    """A ratio regressed: even its interval's upper end is below the baseline ratio less `margin`
    (a share of it, at most MAX_MARGIN)."""
    if not 0 <= margin <= MAX_MARGIN:
        raise ValueError(f"the margin must lie within 0 and {MAX_MARGIN}, got {margin}")
    return ci_high < baseline_ratio * (1 - margin)


def mode_findings(seconds: Mapping[str, Sequence[float]], recorded_ort_vs_eager: float | None,
                  margin: float = MAX_MARGIN, confidence: float = 0.95, *,
                  recorded_compile_vs_eager: float | None = None) -> list[str]:
    """The modes' sanity within the same rounds, one line per failure: torch:compile's and ort's speed
    over torch:eager must not be `slower` than their recorded ratios, and torch:compile must not be
    slower than torch:eager with confidence (its whole interval below 1) even without one. A mode absent from
    `seconds`, or ort without a recorded ratio, is not checked."""
    findings = []
    if EAGER in seconds and COMPILE in seconds:
        found = median_with_ci(paired_ratios(seconds[EAGER], seconds[COMPILE]), confidence)
        measured = f"{COMPILE} is {found.median:.2f}x {EAGER} ({found.low:.2f}-{found.high:.2f}x) in the same rounds"
        if recorded_compile_vs_eager is not None and slower(found.high, recorded_compile_vs_eager, margin):
            findings.append(f"{measured}, below its recorded {recorded_compile_vs_eager:.2f}x by more than "
                            f"{margin:.0%}: a compile that fell back to eager?")
        elif found.high < 1:
            findings.append(f"{measured}: slower than eager")
    if EAGER in seconds and ORT in seconds and recorded_ort_vs_eager is not None:
        found = median_with_ci(paired_ratios(seconds[EAGER], seconds[ORT]), confidence)
        if slower(found.high, recorded_ort_vs_eager, margin):
            findings.append(f"{ORT} is {found.median:.2f}x {EAGER} ({found.low:.2f}-{found.high:.2f}x) in the same "
                            f"rounds, below its recorded {recorded_ort_vs_eager:.2f}x by more than {margin:.0%}")
    return findings
