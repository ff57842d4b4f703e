"""The commit rules of `dlmrt.ops.parallel_unmask` (threshold, factor, fixed, llada2), each
against the plain-Python reference in parallel_unmask_reference.py and hand-computed commit sets."""

from __future__ import annotations

import math

import pytest
import torch

from dlmrt.ops.parallel_unmask import UnmaskParams, strictly_above
from dlmrt.runtime.policies import Factor, Fixed, LLaDA2, Threshold, num_transfer_tokens
from parallel_unmask_reference import (
    INF, MASK, as_mask, commits, confidences, default_token, exact_row, f32, factor_params, logits_of, make_params,
    policy_params, ref_factor, ref_fixed, ref_llada2, ref_schedule, ref_threshold, threshold_params, unmask,
)


# -- threshold (Fast-dLLM) --------------------------------------------------------------



def check_threshold(result, masked, taus):
    conf = confidences(result)
    return [ref_threshold(conf[b], masked[b], taus[b]) for b in range(len(taus))]


@pytest.mark.parametrize("tau, expected", [
    (0.75, {0, 2, 4}),
    (0.85, {0, 4}),
    (0.5, {0, 2, 3, 4}),
    (0.96, {4}),  # none above: the most confident alone
])
def test_threshold_commits_masked_positions_at_or_above_tau(tau, expected):
    confs = [0.9, 0.3, 0.8, 0.6, 0.95, 0.2]
    logits = logits_of([confs])
    result = unmask(logits, threshold_params([tau], [6], 6))
    assert commits(result) == [expected] == check_threshold(result, as_mask(None, 1, 6), [tau])
    assert result.committed.tolist() == [len(expected)]


def test_threshold_tie_exactly_at_tau_is_committed():
    # Exact float32 confidences: 1/2 at positions 1, 3 and 4, 1/4 at 0, 1/8 at 2, 1 at 5.
    rows = [[exact_row(4, 1), exact_row(2, 0), exact_row(8, 0), exact_row(2, 3), exact_row(2, 5),
             exact_row(1, 6)]]
    logits = logits_of(rows)
    masked = [[True, True, True, True, True, False]]
    for tau, expected in ((0.5, {1, 3, 4}), (0.25, {0, 1, 3, 4})):
        result = unmask(logits, threshold_params([tau], [5], 6), masked)
        assert confidences(result)[0][:5] == [0.25, 0.5, 0.125, 0.5, 0.5]
        assert commits(result) == [expected] == check_threshold(result, masked, [tau])
        assert result.ids[0].tolist() == [1 if 0 in expected else MASK, 0, MASK, 3, 5, 55]


def test_threshold_tie_at_an_arbitrary_float32_confidence():
    # Positions 0 and 3 share their logits, hence their (not exactly 0.75) confidence; a
    # threshold of exactly that float32 value includes both of them.
    confs = [(0.75, 2), 0.9, 0.5, (0.75, 2), 0.74]
    logits = logits_of([confs])
    probe = unmask(logits, make_params(1))
    tied = confidences(probe)[0][0]
    assert confidences(probe)[0][3] == tied and tied != 0.75  # the test's own premise
    assert math.isclose(tied, 0.75, abs_tol=1e-6)
    result = unmask(logits, threshold_params([tied], [5], 5))
    assert commits(result) == [{0, 1, 3}] == check_threshold(result, as_mask(None, 1, 5), [tied])
    # One float32 step above excludes them again.
    above = float(torch.nextafter(torch.tensor(tied), torch.tensor(2.0)))
    result = unmask(logits, threshold_params([above], [5], 5))
    assert commits(result) == [{1}]


@pytest.mark.parametrize("confs, expected", [
    ([0.3, 0.6, 0.45, 0.2], {1}),
    ([0.3, (0.6, 4), 0.45, (0.6, 4), 0.2], {1}),  # tied at the top: the earlier position
    ([0.2, 0.2, 0.2], {0}),
])
def test_threshold_all_below_commits_exactly_the_most_confident(confs, expected):
    logits = logits_of([confs])
    width = len(confs)
    result = unmask(logits, threshold_params([0.9], [width], width))
    assert commits(result) == [expected] == check_threshold(result, as_mask(None, 1, width), [0.9])


@pytest.mark.parametrize("left, conf", [(0, 0.2), (3, 0.2), (5, 0.99)])
def test_threshold_block_with_one_masked_position_left(left, conf):
    confs = [0.99] * 6
    confs[left] = conf
    masked = [[w == left for w in range(6)]]
    result = unmask(logits_of([confs]), threshold_params([0.9], [1], 6), masked)
    assert commits(result) == [{left}] == check_threshold(result, masked, [0.9])
    assert result.ids[0].tolist() == [default_token(w) if w == left else 50 + w for w in range(6)]


def test_threshold_never_commits_unmasked_positions():
    confs = [0.99, 0.4, 0.98, 0.3, 1.0, 0.35]
    masked = [[False, True, False, True, False, True]]
    logits = logits_of([confs])
    result = unmask(logits, threshold_params([0.9], [3], 6), masked)
    assert commits(result) == [{1}] == check_threshold(result, masked, [0.9])
    assert [c == -INF for c in confidences(result)[0]] == [True, False, True, False, True, False]
    # With a threshold every masked position passes, still none of the unmasked ones.
    result = unmask(logits, threshold_params([0.25], [3], 6), masked)
    assert commits(result) == [{1, 3, 5}]


def test_threshold_rows_with_different_thresholds_in_one_batch():
    confs = [0.9, 0.3, 0.8, 0.6, 0.95, 0.2]
    taus = [0.5, 0.75, 0.92, 0.99]
    logits = logits_of([confs] * len(taus))
    result = unmask(logits, threshold_params(taus, [6] * len(taus), 6))
    expected = [{0, 2, 3, 4}, {0, 2, 4}, {4}, {4}]
    assert commits(result) == expected == check_threshold(result, as_mask(None, 4, 6), taus)
    assert result.committed.tolist() == [4, 3, 1, 1]
    # Each row alone gives the same answer.
    for b, tau in enumerate(taus):
        alone = unmask(logits[b:b + 1], threshold_params([tau], [6], 6))
        assert commits(alone) == [expected[b]]


def test_no_masked_position_commits_nothing():
    logits = logits_of([[0.9, 0.99, 0.5]] * 3)
    masked = [[False] * 3] * 3
    params = make_params(3, count=[1, 5, 0], threshold=[0.5, INF, 0.1], factor=[0.0, 0.0, 4.0])
    result = unmask(logits, params, masked)
    assert commits(result) == [set(), set(), set()]
    assert result.committed.tolist() == [0, 0, 0]


# -- factor (Fast-dLLM) -----------------------------------------------------------------



@pytest.mark.parametrize("confs, masked, factor, expected", [
    # sorted 0.99, 0.95, 0.9, 0.7: 2*0.01, 3*0.05, 4*0.1 < 1, then 5*0.3 >= 1
    ([0.99, 0.7, 0.95, 0.5, 0.9], None, 1.0, {0, 2, 4}),
    # the same with a smaller factor stops after two: 4*0.1 >= 0.3
    ([0.99, 0.7, 0.95, 0.5, 0.9], None, 0.3, {0, 2}),
    # the most confident position is not masked: the prefix runs over masked ones only
    ([0.99, 0.7, 0.95, 0.5, 0.9], [False, True, True, True, True], 1.0, {2, 4}),
])
def test_factor_prefix_stops_early(confs, masked, factor, expected):
    width = len(confs)
    masked = as_mask(masked, 1, width)
    result = unmask(logits_of([confs]), factor_params([factor], [sum(masked[0])], width), masked)
    assert commits(result) == [expected] == [ref_factor(confidences(result)[0], masked[0], factor)]


@pytest.mark.parametrize("confs, masked, factor", [
    ([0.99, 0.98, 0.97, 0.99], None, 1.0),  # 5 * 0.03 < 1 at n = 4
    ([0.6, 0.9, 0.7, 0.8], None, 4.0),  # 5 * 0.4 < 4
    ([0.99, 0.2, 0.98, 0.15], [True, False, True, False], 1.0),  # every masked one, no unmasked one
])
def test_factor_commits_everything(confs, masked, factor):
    width = len(confs)
    masked = as_mask(masked, 1, width)
    result = unmask(logits_of([confs]), factor_params([factor], [sum(masked[0])], width), masked)
    expected = {w for w in range(width) if masked[0][w]}
    assert commits(result) == [expected] == [ref_factor(confidences(result)[0], masked[0], factor)]


@pytest.mark.parametrize("confs, factor, expected", [
    ([0.3, 0.45, 0.4], 1.0, {1}),  # 2 * 0.55 >= 1
    ([0.9, 0.95, 0.8], 0.05, {1}),  # 2 * 0.05 >= 0.05
    ([0.3, (0.45, 2), (0.45, 2)], 1.0, {1}),  # the top is tied: the earlier one
])
def test_factor_commits_at_least_one_when_even_the_top_fails(confs, factor, expected):
    width = len(confs)
    result = unmask(logits_of([confs]), factor_params([factor], [width], width))
    assert commits(result) == [expected] == [ref_factor(confidences(result)[0], [True] * width, factor)]


def test_factor_ties_straddling_the_end_of_the_prefix():
    # sorted: 0.9 (pos 3), then 0.8 at positions 0, 2, 4 (identical rows), then 0.5:
    # 2*0.1, 3*0.2, 4*0.2 < 0.9 but 5*0.2 >= 0.9, so the prefix ends inside the tie and keeps
    # the two earlier tied positions.
    confs = [(0.8, 5), 0.5, (0.8, 5), 0.9, (0.8, 5)]
    result = unmask(logits_of([confs]), factor_params([0.9], [5], 5))
    conf = confidences(result)[0]
    assert conf[0] == conf[2] == conf[4]  # the test's own premise: exact ties
    assert commits(result) == [{3, 0, 2}] == [ref_factor(conf, [True] * 5, 0.9)]


@pytest.mark.parametrize("factor, expected", [
    # sorted: 1 (position 2), 1/2 (0), 1/2 (4), 1/4 (3): (n + 1) * (1 - c_n) = 0, 1.5, 2, 3.75
    (1.5, {2}),  # 3 * (1 - 1/2) = 1.5 is not < 1.5
    (1.5000001, {2, 0}),  # one float32 step more takes it (and the tie at 4 stays out: 2)
    (2.0, {2, 0}),
    (2.0000002, {2, 0, 4}),
    (3.75, {2, 0, 4}),
    (3.7500002, {0, 2, 3, 4}),
])
def test_factor_boundary_is_strict(factor, expected):
    # Exact confidences: 1 at position 2, 1/2 at 0 and 4, 1/4 at 3 (and at 1, not masked).
    rows = [[exact_row(2, 0), exact_row(4, 1), exact_row(1, 2), exact_row(4, 3), exact_row(2, 5)]]
    masked = [[True, False, True, True, True]]
    params = factor_params([factor], [4], 5)
    result = unmask(logits_of(rows), params, masked)
    conf = confidences(result)[0]
    assert [conf[w] for w in (0, 2, 3, 4)] == [0.5, 1.0, 0.25, 0.5]
    assert commits(result) == [expected] == [ref_factor(conf, masked[0], float(params.factor[0]), exact=True)]


def test_factor_rows_with_different_factors_in_one_batch():
    confs = [0.99, 0.7, 0.95, 0.5, 0.9]
    factors = [0.01, 0.3, 1.0, 2.0, 3.5]
    result = unmask(logits_of([confs] * 5), factor_params(factors, [5] * 5, 5))
    # 0.01: not even 2*0.01; 2.0: 5*0.3 < 2 but 6*0.5 >= 2; 3.5: 6*0.5 < 3.5
    expected = [{0}, {0, 2}, {0, 2, 4}, {0, 1, 2, 4}, {0, 1, 2, 3, 4}]
    conf = confidences(result)
    assert commits(result) == expected == [ref_factor(conf[b], [True] * 5, f) for b, f in enumerate(factors)]


# -- fixed (LLaDA schedule) -------------------------------------------------------------

FIXED_CONFS = [0.5, 0.9, 0.3, 0.7, 0.95, 0.6]  # ranked: 4, 1, 3, 5, 0, 2


@pytest.mark.parametrize("count, expected", [
    (0, set()),
    (1, {4}),
    (2, {4, 1}),
    (4, {4, 1, 3, 5}),
    (6, {0, 1, 2, 3, 4, 5}),
    (9, {0, 1, 2, 3, 4, 5}),  # more than are masked: all of them
])
def test_fixed_commits_the_count_most_confident(count, expected):
    policy = Fixed()
    assert (policy.row_params()["threshold"], policy.row_params()["factor"]) == (INF, 0.0)
    params = policy_params(policy, [count])
    result = unmask(logits_of([FIXED_CONFS]), params)
    assert commits(result) == [expected] == [ref_fixed(confidences(result)[0], [True] * 6, count)]
    assert result.committed.tolist() == [len(expected)]


@pytest.mark.parametrize("count, expected", [(0, set()), (1, {3}), (2, {3, 5}), (3, {0, 3, 5}), (5, {0, 2, 3, 5})])
def test_fixed_count_over_a_partly_masked_block(count, expected):
    masked = [[True, False, True, True, False, True]]  # 4 masked; 4 and 1 are the confident ones
    result = unmask(logits_of([FIXED_CONFS]), policy_params(Fixed(), [count]), masked)
    assert commits(result) == [expected] == [ref_fixed(confidences(result)[0], masked[0], count)]


@pytest.mark.parametrize("count, expected", [(1, {1}), (2, {1, 3}), (3, {1, 3, 0}), (4, {0, 1, 3, 4}),
                                             (5, {0, 1, 3, 4, 5})])
def test_fixed_ties_go_to_the_earlier_position(count, expected):
    # 0.9 at positions 1 and 3 and 0.6 at positions 0, 4 and 5, each group with identical logits.
    confs = [(0.6, 2), (0.9, 6), 0.2, (0.9, 6), (0.6, 2), (0.6, 2)]
    result = unmask(logits_of([confs]), policy_params(Fixed(), [count]))
    conf = confidences(result)[0]
    assert conf[1] == conf[3] and conf[0] == conf[4] == conf[5]  # the test's own premise
    assert commits(result) == [expected] == [ref_fixed(conf, [True] * 6, count)]


def test_fixed_ties_among_exact_confidences():
    rows = [[exact_row(2, 3), exact_row(1, 2), exact_row(2, 0), exact_row(2, 5), exact_row(4, 1)]]
    result = unmask(logits_of(rows), policy_params(Fixed(), [3]))
    assert confidences(result)[0] == [0.5, 1.0, 0.5, 0.5, 0.25]
    assert commits(result) == [{0, 1, 2}]
    assert result.ids[0].tolist() == [3, 2, 0, MASK, MASK]


def test_fixed_rows_with_different_counts_in_one_batch():
    counts = [0, 1, 3, 6, 100]
    result = unmask(logits_of([FIXED_CONFS] * 5), policy_params(Fixed(), counts))
    conf = confidences(result)
    assert commits(result) == [ref_fixed(conf[b], [True] * 6, c) for b, c in enumerate(counts)]
    assert result.committed.tolist() == [0, 1, 3, 6, 6]


@pytest.mark.parametrize("masked, steps", [(0, 1), (5, 1), (5, 5), (7, 3), (32, 5), (3, 8), (64, 64)])
def test_num_transfer_tokens_is_the_llada_schedule(masked, steps):
    schedule = num_transfer_tokens(torch.tensor([masked, masked // 2]), steps)
    assert schedule.tolist() == [ref_schedule(masked, steps), ref_schedule(masked // 2, steps)]
    assert Fixed(steps=steps).schedule(torch.tensor([masked]), 64, steps).tolist() == [ref_schedule(masked, steps)]


@pytest.mark.parametrize("policy", [Threshold(0.9), Factor(1.0), Fixed(steps=4)], ids=["threshold", "factor", "fixed"])
def test_last_scheduled_step_commits_the_rest(policy):
    # Whatever the confidences, the counts of a block's schedule add up to its masked count.
    width, steps = 6, 4
    masked = [[True, False, True, True, False, True]]
    schedule = policy.schedule(torch.tensor([4]), width, steps)
    assert int(schedule.sum()) >= 4
    logits = logits_of([[0.2, 0.2, 0.3, 0.25, 0.2, 0.2]])
    canvas = masked[0][:]
    for step in range(steps):
        result = unmask(logits, policy_params(policy, [int(schedule[0, step])]), [canvas])
        for w in commits(result)[0]:
            canvas[w] = False
    assert not any(canvas)


# -- llada2 -----------------------------------------------------------------------------

def llada2_params(tau: float, n_k: int) -> UnmaskParams:
    policy = LLaDA2(threshold=tau)
    assert policy.row_params()["threshold"] == strictly_above(tau) and policy.row_params()["factor"] == 0.0
    return policy_params(policy, [n_k])


def test_llada2_confidence_equal_to_tau_is_not_above():
    # Exactly 0.5 at positions 0, 2 and 3, exactly 0.25 at 1: nothing is above 0.5.
    rows = [[exact_row(2, 0), exact_row(4, 1), exact_row(2, 3), exact_row(2, 5)]]
    logits = logits_of(rows)
    result = unmask(logits, llada2_params(0.5, 1))
    assert confidences(result)[0] == [0.5, 0.25, 0.5, 0.5]
    assert commits(result) == [{0}] == [ref_llada2(confidences(result)[0], [True] * 4, 1, 0.5)]
    # n_k = 0 and nothing above: nothing at all.
    result = unmask(logits, llada2_params(0.5, 0))
    assert commits(result) == [set()] == [ref_llada2(confidences(result)[0], [True] * 4, 0, 0.5)]
    # Fast-dLLM's >= would take all three; just below 0.5 so would LLaDA2's >.
    assert commits(unmask(logits, threshold_params([0.5], [4], 4))) == [{0, 2, 3}]
    below = float(torch.nextafter(torch.tensor(0.5), torch.tensor(0.0)))
    assert commits(unmask(logits, llada2_params(below, 1))) == [{0, 2, 3}]


def test_llada2_tie_at_an_arbitrary_float32_tau_is_not_above():
    confs = [(0.8, 4), 0.9, (0.8, 4), 0.3]
    logits = logits_of([confs])
    tau = confidences(unmask(logits, make_params(1)))[0][0]
    result = unmask(logits, llada2_params(tau, 2))
    conf = confidences(result)[0]
    assert conf[0] == conf[2] == tau
    # only position 1 is above: fewer than n_k = 2, so the two most confident
    assert commits(result) == [{1, 0}] == [ref_llada2(conf, [True] * 4, 2, tau)]


@pytest.mark.parametrize("n_k, tau, expected", [
    (2, 0.85, {0, 2, 4, 5}),  # four above >= n_k: all four
    (4, 0.85, {0, 2, 4, 5}),  # exactly n_k above
    (0, 0.85, {0, 2, 4, 5}),  # a step with n_k = 0 still takes what is above
    (0, 0.99, set()),
    (1, 0.92, {2, 4}),
    (3, 0.92, {2, 4, 0}),  # two above < n_k = 3: the three most confident
    (5, 0.85, {0, 1, 2, 4, 5}),
    (3, 0.99, {2, 4, 0}),  # none above
    (9, 0.99, {0, 1, 2, 3, 4, 5}),  # n_k beyond the masked count: all of them
])
def test_llada2_all_above_or_top_n_k(n_k, tau, expected):
    confs = [0.9, 0.5, 0.97, 0.2, 0.95, 0.88]  # ranked: 2, 4, 0, 5, 1, 3
    result = unmask(logits_of([confs]), llada2_params(tau, n_k))
    assert commits(result) == [expected] == [ref_llada2(confidences(result)[0], [True] * 6, n_k, tau)]


@pytest.mark.parametrize("n_k, expected", [(1, {1, 5}), (3, {1, 5, 3}), (6, {1, 3, 5})])
def test_llada2_over_a_partly_masked_block(n_k, expected):
    confs = [0.99, 0.96, 0.98, 0.3, 0.97, 0.95]
    masked = [[False, True, False, True, False, True]]
    result = unmask(logits_of([confs]), llada2_params(0.9, n_k), masked)
    assert commits(result) == [expected] == [ref_llada2(confidences(result)[0], masked[0], n_k, 0.9)]


@pytest.mark.parametrize("block_length, steps", [(32, 32), (32, 5), (8, 3), (4, 6), (16, 1)])
def test_llada2_schedule_is_over_the_block_length(block_length, steps):
    policy = LLaDA2(steps=steps)
    schedule = policy.schedule(torch.tensor([block_length, 3, 0]), block_length, steps)
    assert schedule.tolist() == [ref_schedule(block_length, steps)] * 3


@pytest.mark.parametrize("tau", [0.1, 0.3, 0.5, 0.75, 0.9, 0.95, 1.0])
def test_strictly_above_is_a_strict_float32_comparison(tau):
    t = torch.tensor(tau, dtype=torch.float32)
    down, up = torch.tensor(0.0), torch.tensor(2.0)
    values = [torch.nextafter(torch.nextafter(t, down), down), torch.nextafter(t, down), t,
              torch.nextafter(t, up), torch.nextafter(torch.nextafter(t, up), up)]
    bound = strictly_above(tau)
    for c in values:
        c = float(c)
        assert (c >= bound) == (c > f32(tau)), (tau, c)
        assert (c >= bound) == bool(torch.tensor(c, dtype=torch.float32) > tau), (tau, c)
