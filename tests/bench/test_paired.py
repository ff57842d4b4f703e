"""dlmrt.bench.paired: the paired ratios, the median's bootstrap interval, the gate's rule and the
modes' sanity on synthetic rounds, and the interleaving of cases round by round (on recording fakes:
no test here times real work)."""

from __future__ import annotations

import numpy as np
import pytest

from dlmrt.bench import paired
from dlmrt.bench.case import Case
from dlmrt.bench.paired import Estimate, median_with_ci, paired_ratios, slower


# -- statistics -------------------------------------------------------------------------------------

def test_paired_ratios_divide_round_by_round():
    assert paired_ratios([2.0, 4.0, 6.0], [1.0, 2.0, 4.0]) == [2.0, 2.0, 1.5]
    with pytest.raises(ValueError, match="as many rounds"):
        paired_ratios([1.0, 2.0], [1.0])


@pytest.mark.parametrize("values, median", [([3.0, 1.0, 2.0], 2.0), ([10.0, 1.0, 3.0, 2.0], 2.5), ([4.0], 4.0)])
def test_the_estimate_is_the_median(values, median):
    found = median_with_ci(values)
    assert found.median == median
    assert found.low <= median <= found.high


def test_the_interval_is_deterministic_and_narrows_with_agreeing_rounds():
    values = [1.9, 2.0, 2.1, 1.8, 2.2, 2.05, 1.95, 2.0, 2.15]
    assert median_with_ci(values) == median_with_ci(values)
    assert median_with_ci([2.0] * 9) == Estimate(2.0, 2.0, 2.0)
    wide, narrow = median_with_ci(values), median_with_ci([2.0 + (v - 2.0) / 10 for v in values])
    assert narrow.high - narrow.low < (wide.high - wide.low) / 5


def test_five_rounds_give_the_best_round_as_the_upper_end():
    """Why the gate needs more than 5 rounds: with 5, a 95% interval's upper end is the best round."""
    values = [1.0, 1.1, 1.2, 1.3, 2.0]
    assert median_with_ci(values).high == 2.0
    assert median_with_ci([1.0, 1.1, 1.2, 1.3, 1.35, 1.4, 1.45, 1.5, 2.0]).high < 2.0


def test_the_interval_covers_the_true_median_of_a_known_distribution():
    """Ratios 1.5 times log-normal noise (median 1.5): the 95% interval of 15 rounds holds 1.5 in about
    95% of 200 samples; a point interval or a too narrow one would hold it far less often."""
    rng = np.random.default_rng(1)
    samples = 1.5 * np.exp(rng.normal(0.0, 0.1, size=(200, 15)))
    held = [found.low <= 1.5 <= found.high
            for found in (median_with_ci(sample, resamples=2000, seed=i) for i, sample in enumerate(samples))]
    assert 0.88 <= np.mean(held) <= 1.0


def test_confidence_outside_0_and_1_and_no_values_are_refused():
    with pytest.raises(ValueError, match="confidence"):
        median_with_ci([1.0, 2.0], confidence=1.0)
    with pytest.raises(ValueError, match="non-empty"):
        median_with_ci([])


# -- the rule -------------------------------------------------------------------------------------

def test_slower_fails_strictly_below_the_baseline_less_the_margin():
    limit = 2.0 * (1 - 0.15)
    assert not slower(limit, 2.0, 0.15)
    assert slower(np.nextafter(limit, 0.0), 2.0, 0.15)
    assert not slower(2.5, 2.0, 0.15)  # faster never fails
    assert slower(np.nextafter(2.0, 0.0), 2.0, 0.0)
    assert not slower(2.0, 2.0, 0.0)


@pytest.mark.parametrize("margin", [-0.01, 0.16, 0.5])
def test_a_margin_outside_0_to_15_percent_is_refused(margin):
    with pytest.raises(ValueError, match="margin"):
        slower(1.0, 2.0, margin)


def rounds_of(speedup: float, rounds: int = 9, noise: float = 0.01, seed: int = 0) -> tuple[list, list]:
    """Reference and case seconds of `rounds` rounds on a machine that drifts by up to 50% between
    rounds (shared by both cases of a round), the case `speedup` times faster with `noise` of its own."""
    rng = np.random.default_rng(seed)
    machine = rng.uniform(1.0, 1.5, rounds)
    reference = machine * 1.0
    case = machine / speedup * (1 + rng.normal(0.0, noise, rounds))
    return list(reference), list(case)


@pytest.mark.parametrize("seed", range(5))
def test_a_10_percent_slowdown_is_caught_through_drift_and_none_is_not(seed):
    baseline = 2.0
    same = median_with_ci(paired_ratios(*rounds_of(baseline, seed=seed)))
    shifted = median_with_ci(paired_ratios(*rounds_of(baseline * 0.9, seed=seed)))
    assert not slower(same.high, baseline, margin=0.05)
    assert slower(shifted.high, baseline, margin=0.05)
    # at the widest margin, a 10% drop passes and a 20% drop fails
    assert not slower(shifted.high, baseline, margin=0.15)
    assert slower(median_with_ci(paired_ratios(*rounds_of(baseline * 0.8, seed=seed))).high, baseline, 0.15)


def test_without_pairing_the_drift_hides_the_same_slowdown():
    """The case's median seconds over the reference's, unpaired, moves with the drift: what the
    per-round ratios cancel."""
    reference, case = rounds_of(2.0 * 0.9, seed=3)
    unpaired = np.median(reference) / np.median(case)
    paired_median = median_with_ci(paired_ratios(reference, case)).median
    assert abs(paired_median - 1.8) < 0.02
    assert abs(unpaired - 1.8) > abs(paired_median - 1.8)


# -- the modes' sanity ----------------------------------------------------------------------------

def modes(compile_speedup: float, ort_speedup: float, rounds: int = 9) -> dict[str, list[float]]:
    eager, compiled = rounds_of(compile_speedup, rounds, seed=1)
    _, ort = rounds_of(ort_speedup, rounds, seed=2)
    scale = np.asarray(eager) / np.asarray(rounds_of(1.0, rounds, seed=2)[0])  # ort on eager's machine
    return {paired.EAGER: eager, paired.COMPILE: compiled, paired.ORT: list(np.asarray(ort) * scale)}


def test_modes_that_hold_their_ratios_pass():
    assert paired.mode_findings(modes(1.3, 2.0), 2.0, recorded_compile_vs_eager=1.3) == []


def test_a_compile_that_fell_back_to_eager_is_a_finding():
    found = paired.mode_findings(modes(1.0, 2.0), 2.0, recorded_compile_vs_eager=1.3)
    assert len(found) == 1 and "below its recorded 1.30x by more than 15%: a compile that fell back" in found[0]


def test_a_noisy_compile_that_holds_its_ratio_passes():
    """Noise that widens compile's interval across 1 is no finding: only a confident drop is."""
    rounds = modes(1.3, 2.0)
    rounds[paired.COMPILE] = [s * f for s, f in zip(rounds[paired.COMPILE], [1, 1.6, 0.8, 1, 1.5, 0.9, 1, 1.4, 1])]
    found = median_with_ci(paired_ratios(rounds[paired.EAGER], rounds[paired.COMPILE]))
    assert found.low < 1 < found.high
    assert paired.mode_findings(rounds, 2.0, recorded_compile_vs_eager=1.3) == []


def test_without_a_recorded_ratio_compile_must_not_be_slower_than_eager():
    assert paired.mode_findings(modes(1.0, 2.0), None) == []
    found = paired.mode_findings(modes(0.8, 2.0), None)
    assert len(found) == 1 and found[0].endswith("slower than eager")


def test_an_ort_below_its_recorded_ratio_to_eager_is_a_finding():
    found = paired.mode_findings(modes(1.3, 1.5), recorded_ort_vs_eager=2.0)
    assert len(found) == 1 and "ort is" in found[0] and "below its recorded 2.00x" in found[0]


def test_absent_modes_and_an_unrecorded_ort_are_not_checked():
    rounds = modes(1.0, 1.0)
    assert paired.mode_findings({paired.EAGER: rounds[paired.EAGER]}, recorded_ort_vs_eager=2.0) == []
    assert paired.mode_findings({k: v for k, v in rounds.items() if k != paired.COMPILE}, None) == []


# -- interleaving ---------------------------------------------------------------------------------

class Recorder:
    """Fake cases that log each run and advance a fake clock by their own cost."""

    def __init__(self, costs: dict[str, float], monkeypatch):
        self.log: list[str] = []
        self.now = 0.0
        monkeypatch.setattr(paired.time, "perf_counter", lambda: self.now)
        self.cases = [Case(label, self.runner(label, cost)) for label, cost in costs.items()]

    def runner(self, label: str, cost: float):
        def run():
            self.log.append(label)
            self.now += cost
            return f"{label} #{self.log.count(label)}"
        return run


def test_two_cases_alternate_a_b_a_b_after_their_warmups(monkeypatch):
    fake = Recorder({"A": 1.0, "B": 0.5}, monkeypatch)
    found = paired.interleaved_rounds(fake.cases, rounds=6, warmups=2)
    assert fake.log[:4] == ["A", "A", "B", "B"]
    timed = fake.log[4:]
    assert len(timed) == 12
    assert all(sorted(timed[i:i + 2]) == ["A", "B"] for i in range(0, 12, 2))
    assert found.seconds == {"A": [1.0] * 6, "B": [0.5] * 6}
    assert found.results["A"] == [f"A #{i}" for i in range(3, 9)]


def test_every_case_runs_once_a_round_in_a_seeded_order_that_varies(monkeypatch):
    costs = {"reference": 4.0, "torch:eager": 3.0, "torch:compile": 2.0, "ort": 1.0, "canary": 0.125}
    fake = Recorder(costs, monkeypatch)
    advanced = []
    found = paired.interleaved_rounds(fake.cases, rounds=12, warmups=1, seed=7, advance=lambda: advanced.append(1))
    assert len(advanced) == 5 * 13
    timed = fake.log[5:]
    orders = [tuple(timed[i:i + 5]) for i in range(0, len(timed), 5)]
    assert all(sorted(order) == sorted(costs) for order in orders)
    assert len(set(orders)) > 1
    after_ort = {timed[i + 1] for i in range(len(timed) - 1) if timed[i] == "ort"}
    assert len(after_ort) > 1  # no case always runs right after ONNX Runtime
    assert {label: seconds[0] for label, seconds in found.seconds.items()} == costs
    again = Recorder(costs, monkeypatch)
    paired.interleaved_rounds(again.cases, rounds=12, warmups=1, seed=7)
    assert again.log == fake.log


def test_interleaving_refuses_no_rounds_and_twin_labels(monkeypatch):
    fake = Recorder({"A": 1.0}, monkeypatch)
    with pytest.raises(ValueError, match="rounds"):
        paired.interleaved_rounds(fake.cases, rounds=0)
    with pytest.raises(ValueError, match="distinct"):
        paired.interleaved_rounds(fake.cases * 2, rounds=1)
