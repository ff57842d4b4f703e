"""`dlmrt.plugins.parallel_unmask` against a plain-Python reference of each decoding rule.

The reference below is written from the rule descriptions only (loops over rows and
positions, Python floats and lists), never from the module's helpers:

  threshold  (Fast-dLLM)  commit every masked position with confidence >= tau, and always
                          at least the most confident one
  factor     (Fast-dLLM)  commit the longest prefix of the confidence-sorted masked positions
                          with (n + 1) * (1 - c_n) < f, n = 1, 2, ..., and at least one
  fixed      (LLaDA)      commit the `count` most confident masked positions
  llada2                  with n_k from the schedule over the block length: if at least n_k
                          masked positions have c > tau (strictly) commit all of them, else
                          the n_k most confident; never more than are masked

Everywhere "most confident" breaks ties by the earlier position. Thresholds are compared
in float32, as torch compares a float32 tensor with a Python number.

The crafted tests fix the expected commit sets by hand as well, so that a mistake in the
reference cannot hide one in the module. Confidences are crafted through the logits: the
chosen token gets log(c) and the other tokens share the remaining mass; rows whose
maxima are m equal logits (the others -inf) give confidences of exactly 1/m in float32,
which is what the tests about exact ties use. The commit rules are fed the confidences
the module returns (exact float32 values), after those have been checked against a
float64 softmax computed here.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from dlmrt.plugins.parallel_unmask import UnmaskParams, parallel_unmask, strictly_above
from dlmrt.runtime.policies import Factor, Fixed, LLaDA2, Threshold, num_transfer_tokens

V = 8  # vocabulary of the crafted tests
MASK = V - 1  # the mask id: the last token of the vocabulary, in every test (see `unmask`)
INF = math.inf


# -- the reference ----------------------------------------------------------------------

def f32(x: float) -> float:
    """x rounded to float32, as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def ref_softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def ref_argmax(row: list[float], mask_id: int) -> int:
    """The first most likely token other than the mask token (which is never a candidate)."""
    best = None
    for v in range(len(row)):
        if v != mask_id and (best is None or row[v] > row[best]):
            best = v
    return best


def ref_x0(logits: torch.Tensor) -> torch.Tensor:
    """The greedy candidates of [B, W, V] logits whose mask token is the last one."""
    vocab = logits.shape[-1]
    return torch.tensor([[ref_argmax(row, vocab - 1) for row in rows] for rows in logits.tolist()])


def ref_confidence(row: list[float], measure: str, token: int | None = None) -> float:
    """The confidence of a candidate (the greedy one unless `token` is given) from its logits
    (the mask token, the last one, takes part in the distribution but is never the candidate, nor
    one of the two tokens of the margin)."""
    p = ref_softmax(row)
    if measure == "prob":
        return p[ref_argmax(row, len(row) - 1) if token is None else token]
    if measure == "margin":  # between the two most likely tokens other than the mask
        first, second = sorted(p[:-1], reverse=True)[:2]
        return first - second
    if measure == "entropy":
        entropy = 0.0
        for q in p:
            if q > 0:
                entropy -= q * math.log(q)
        return 1.0 - entropy / math.log(len(row))
    raise AssertionError(measure)


def ranked(conf: list[float], masked: list[bool]) -> list[int]:
    """The masked positions, most confident first, ties: the earlier position first."""
    order = []
    for w in range(len(conf)):
        if masked[w]:
            order.append(w)
    order.sort(key=lambda w: (-conf[w], w))
    return order


def ref_fixed(conf: list[float], masked: list[bool], count: int) -> set[int]:
    order = ranked(conf, masked)
    return set(order[:min(count, len(order))])


def ref_threshold(conf: list[float], masked: list[bool], tau: float) -> set[int]:
    order = ranked(conf, masked)
    tau = f32(tau)
    chosen = set()
    for w in order:
        if conf[w] >= tau:
            chosen.add(w)
    if not chosen and order:
        chosen.add(order[0])
    return chosen


def ref_factor(conf: list[float], masked: list[bool], factor: float, exact: bool = False) -> set[int]:
    """`exact`: the inputs are small dyadic numbers, so float64 and float32 agree even on the boundary."""
    order = ranked(conf, masked)
    factor = f32(factor)
    prefix = 0
    for n in range(1, len(order) + 1):
        value = (n + 1) * (1.0 - conf[order[n - 1]])
        # Keep the crafted inputs clear of the boundary, where float32 and float64 may disagree.
        assert exact or abs(value - factor) > 1e-5, f"test input too close to the factor boundary: n={n}"
        if value < factor:
            prefix = n
        else:
            break
    k = max(prefix, 1) if order else 0
    return set(order[:k])


def ref_llada2(conf: list[float], masked: list[bool], n_k: int, tau: float) -> set[int]:
    order = ranked(conf, masked)
    tau = f32(tau)
    above = set()
    for w in order:
        if conf[w] > tau:
            above.add(w)
    if len(above) >= n_k:
        return above
    return set(order[:min(n_k, len(order))])


def ref_schedule(total: int, steps: int) -> list[int]:
    """LLaDA's schedule: `total` commits spread evenly, the remainder in the first steps."""
    base, remainder = divmod(total, steps)
    return [base + (1 if i < remainder else 0) for i in range(steps)]


# -- building inputs and running the step -------------------------------------------------

def crafted_row(conf: float, token: int, vocab: int = V) -> list[float]:
    """Logits with softmax probability `conf` at `token` (the argmax) and the rest spread evenly."""
    rest = (1.0 - conf) / (vocab - 1)
    assert conf > rest, "the crafted token must be the argmax"
    other = math.log(rest) if rest > 0 else -INF
    row = [other] * vocab
    row[token] = math.log(conf)
    return row


def exact_row(m: int, token: int, vocab: int = V) -> list[float]:
    """Logits whose softmax is exactly 1/m (a power of two) at m tokens from `token` on."""
    row = [-INF] * vocab
    for j in range(m):
        row[(token + j) % vocab] = 0.0
    return row


def default_token(w: int) -> int:
    return (3 * w + 1) % (V - 1)  # never the mask token


def logits_of(rows: list[list]) -> torch.Tensor:
    """[B, W, V] float32 logits from rows of per-position specs: a confidence (crafted at the
    position's default token), a (confidence, token) pair, or a ready list of logits."""
    out = []
    for row in rows:
        positions = []
        for w, spec in enumerate(row):
            if isinstance(spec, list):
                positions.append(spec)
            elif isinstance(spec, tuple):
                positions.append(crafted_row(*spec))
            else:
                positions.append(crafted_row(spec, default_token(w)))
        out.append(positions)
    return torch.tensor(out, dtype=torch.float32)


def per_row(value, batch: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * batch


def make_params(batch: int, *, count=0, threshold=INF, factor=0.0, temperature=0.0, seed=0,
                step=0) -> UnmaskParams:
    return UnmaskParams(
        count=torch.tensor(per_row(count, batch), dtype=torch.long),
        threshold=torch.tensor(per_row(threshold, batch), dtype=torch.float32),
        factor=torch.tensor(per_row(factor, batch), dtype=torch.float32),
        temperature=torch.tensor(per_row(temperature, batch), dtype=torch.float32),
        seed=torch.tensor(per_row(seed, batch), dtype=torch.long),
        step=torch.tensor(per_row(step, batch), dtype=torch.long))


def policy_params(policy, counts: list[int], **kw) -> UnmaskParams:
    """The step parameters a policy maps to (its threshold and factor), with the given counts."""
    batch = len(counts)
    return make_params(batch, count=counts, threshold=[policy.threshold_value] * batch,
                       factor=[policy.factor_value] * batch, **kw)


def as_mask(masked, batch: int, width: int) -> list[list[bool]]:
    if masked is None:
        return [[True] * width for _ in range(batch)]
    if isinstance(masked[0], bool):
        return [list(masked) for _ in range(batch)]
    return [list(m) for m in masked]


def ids_of(masked: list[list[bool]], mask_id: int = MASK) -> torch.Tensor:
    """Masked positions hold the mask id, the others an id (50 + w) that no step may touch."""
    return torch.tensor([[mask_id if m else 50 + w for w, m in enumerate(row)] for row in masked],
                        dtype=torch.long)


def unmask(logits: torch.Tensor, params: UnmaskParams, masked=None, *, confidence: str = "prob",
           positions: torch.Tensor | None = None):
    """Run one step, the mask id being the vocabulary's last token, and check what holds for
    every step; returns the result."""
    batch, width, vocab = logits.shape
    masked = as_mask(masked, batch, width)
    ids = ids_of(masked, vocab - 1)
    if positions is None:
        positions = (torch.arange(width) + 7).expand(batch, width).clone()
    result = parallel_unmask(logits, ids.clone(), positions, params, mask_id=vocab - 1, confidence=confidence)
    check_step(result, logits, ids, params, masked, confidence)
    return result


def check_step(result, logits, ids, params, masked, confidence):
    batch, width, vocab = logits.shape
    mask_id = vocab - 1
    assert result.ids.shape == (batch, width) and result.ids.dtype == torch.long
    assert result.confidence.shape == (batch, width) and result.confidence.dtype == torch.float32
    assert result.commit.shape == (batch, width) and result.commit.dtype == torch.bool
    assert result.committed.shape == (batch,) and result.committed.dtype == torch.long
    assert result.committed.tolist() == result.commit.sum(-1).tolist()
    for b in range(batch):
        greedy = float(params.temperature[b]) == 0
        for w in range(width):
            row = logits[b, w].tolist()
            conf = float(result.confidence[b, w])
            new = int(result.ids[b, w])
            committed = bool(result.commit[b, w])
            if not masked[b][w]:
                assert conf == -INF, (b, w)
                assert not committed, f"row {b} position {w} was not masked but got committed"
                assert new == int(ids[b, w]), (b, w)
                continue
            assert math.isfinite(conf), (b, w)
            if not committed:
                assert new == mask_id, (b, w)
                if confidence != "random" and greedy:
                    assert conf == pytest.approx(ref_confidence(row, confidence), abs=1e-6), (b, w)
                continue
            if greedy:
                assert new == ref_argmax(row, mask_id), f"row {b} position {w}: not the argmax"
            else:
                assert 0 <= new < vocab and new != mask_id, (b, w)
            if confidence == "prob" or (confidence != "random" and greedy):
                token = new if confidence == "prob" else None
                assert conf == pytest.approx(ref_confidence(row, confidence, token), abs=1e-6), (b, w)


def commits(result) -> list[set[int]]:
    return [{w for w, c in enumerate(row) if c} for row in result.commit.tolist()]


def confidences(result) -> list[list[float]]:
    return result.confidence.tolist()


# -- threshold (Fast-dLLM) --------------------------------------------------------------

def threshold_params(taus: list[float], masked_counts: list[int], width: int, steps: int = 4):
    """Threshold(tau) per row at a step before the last: count 1, threshold tau, factor off."""
    counts = []
    for tau, masked in zip(taus, masked_counts):
        schedule = Threshold(tau).schedule(torch.tensor([masked]), width, steps)
        counts.append(int(schedule[0, 0]))
    assert counts == [1] * len(taus), "Threshold's schedule must ask for one commit per step"
    thresholds = [Threshold(tau).threshold_value for tau in taus]
    factors = [Threshold(tau).factor_value for tau in taus]
    assert factors == [0.0] * len(taus), "Threshold must leave the factor rule off"
    return make_params(len(taus), count=counts, threshold=thresholds, factor=factors)


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

def factor_params(factors: list[float], masked_counts: list[int], width: int, steps: int = 4):
    """Factor(f) per row at a step before the last: count 1, threshold off, factor f."""
    counts = [int(Factor(f).schedule(torch.tensor([m]), width, steps)[0, 0])
              for f, m in zip(factors, masked_counts)]
    assert counts == [1] * len(factors), "Factor's schedule must ask for one commit per step"
    assert all(Factor(f).threshold_value == INF for f in factors), "Factor must leave the threshold off"
    return make_params(len(factors), count=counts, threshold=[Factor(f).threshold_value for f in factors],
                       factor=[Factor(f).factor_value for f in factors])


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
    assert (policy.threshold_value, policy.factor_value) == (INF, 0.0)
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
    assert policy.threshold_value == strictly_above(tau) and policy.factor_value == 0.0
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


# -- every rule on random inputs -----------------------------------------------------------

def random_case(seed: int, batch: int = 4, width: int = 10, vocab: int = 6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, width, vocab, generator=g) * 2.5
    masked = (torch.rand(batch, width, generator=g) < 0.7).tolist()
    return logits, masked


@pytest.mark.parametrize("measure", ["prob", "margin", "entropy"])
@pytest.mark.parametrize("seed", range(4))
def test_every_rule_on_random_inputs(seed, measure):
    logits, masked = random_case(seed)
    batch, width, _ = logits.shape
    probe = unmask(logits, make_params(batch), masked, confidence=measure)
    conf = confidences(probe)
    # thresholds: a few fixed values and, in the last row, exactly one of the row's confidences
    candidates = [c for c in conf[-1] if c != -INF] or [0.5]
    taus = [0.2, 0.5, 0.8, candidates[len(candidates) // 2]]

    result = unmask(logits, threshold_params(taus, [sum(m) for m in masked], width), masked, confidence=measure)
    assert commits(result) == [ref_threshold(conf[b], masked[b], taus[b]) for b in range(batch)]

    factors = [0.37, 1.13, 2.71, 5.3]
    result = unmask(logits, factor_params(factors, [sum(m) for m in masked], width), masked, confidence=measure)
    assert commits(result) == [ref_factor(conf[b], masked[b], factors[b]) for b in range(batch)]

    counts = [0, 1, 3, width + 1]
    result = unmask(logits, policy_params(Fixed(), counts), masked, confidence=measure)
    assert commits(result) == [ref_fixed(conf[b], masked[b], counts[b]) for b in range(batch)]

    for n_k in (0, 1, 2, 4):
        expected = [ref_llada2(conf[b], masked[b], n_k, taus[b]) for b in range(batch)]
        params = make_params(batch, count=n_k, threshold=[LLaDA2(threshold=t).threshold_value for t in taus])
        result = unmask(logits, params, masked, confidence=measure)
        assert commits(result) == expected, n_k


# -- confidence measures ----------------------------------------------------------------

def probs_row(p: list[float]) -> list[float]:
    return [math.log(q) if q > 0 else -INF for q in p]


@pytest.mark.parametrize("p, expected", [
    ([0.5, 0.3, 0.15, 0.05], 0.2),
    ([0.05, 0.5, 0.3, 0.15], 0.2),
    ([0.4, 0.4, 0.2, 0.0], 0.0),
    ([0.25, 0.25, 0.25, 0.25], 0.0),
    ([1.0, 0.0, 0.0, 0.0], 1.0),
    ([0.1, 0.7, 0.2, 0.0], 0.5),
    ([0.5, 0.1, 0.05, 0.35], 0.4),  # the mask token (last) is never one of the two
])
def test_margin_is_top1_minus_top2_probability(p, expected):
    logits = torch.tensor([[probs_row(p)]], dtype=torch.float32)
    result = unmask(logits, make_params(1, count=1), confidence="margin")
    assert float(result.confidence[0, 0]) == pytest.approx(expected, abs=1e-6)
    assert result.ids[0, 0].item() == p.index(max(p))


LOG2 = math.log(2)


@pytest.mark.parametrize("p, expected", [
    ([0.25, 0.25, 0.25, 0.25], 0.0),  # H = log V
    ([1.0, 0.0, 0.0, 0.0], 1.0),  # H = 0
    ([0.5, 0.5, 0.0, 0.0], 0.5),  # H = log 2 = log V / 2
    ([0.5, 0.25, 0.25, 0.0], 0.25),  # H = 1.5 log 2
    ([0.125, 0.5, 0.125, 0.25], 1 - 1.75 / 2),  # H = 1.75 log 2
    ([0.7, 0.1, 0.1, 0.1], 1 - (0.7 * math.log(1 / 0.7) + 0.3 * math.log(10)) / (2 * LOG2)),
])
def test_entropy_is_one_minus_normalised_entropy(p, expected):
    logits = torch.tensor([[probs_row(p)]], dtype=torch.float32)
    result = unmask(logits, make_params(1, count=1), confidence="entropy")
    assert float(result.confidence[0, 0]) == pytest.approx(expected, abs=1e-6)


def test_prob_is_the_probability_of_the_candidate():
    logits = torch.tensor([[probs_row([0.6, 0.3, 0.1, 0.0]), probs_row([0.2, 0.2, 0.35, 0.25])]],
                          dtype=torch.float32)
    result = unmask(logits, make_params(1, count=2))
    assert result.confidence[0].tolist() == pytest.approx([0.6, 0.35], abs=1e-6)
    assert result.ids[0].tolist() == [0, 2]


@pytest.mark.parametrize("measure, expected", [("prob", 0), ("margin", 1), ("entropy", 0)])
def test_the_measure_decides_the_order(measure, expected):
    # position 0: p = (0.5, 0.45, 0.05, 0): prob 0.5, margin 0.05, entropy-confidence 0.38
    # position 1: p = (0.4, 0.2, 0.2, 0.2): prob 0.4, margin 0.2,  entropy-confidence 0.04
    logits = torch.tensor([[probs_row([0.5, 0.45, 0.05, 0.0]), probs_row([0.4, 0.2, 0.2, 0.2])]],
                          dtype=torch.float32)
    result = unmask(logits, make_params(1, count=1), confidence=measure)
    assert commits(result) == [{expected}]


def test_the_mask_token_is_never_a_candidate():
    # The mask token (the last one) is the most likely at every position.
    p = [0.2, 0.1, 0.15, 0.05, 0.0, 0.0, 0.0, 0.5]
    logits = torch.tensor([[probs_row(p)] * 3, [probs_row(p)] * 3], dtype=torch.float32)
    params = make_params(2, count=3, temperature=[0.0, 1.0], seed=3)
    result = unmask(logits, params)
    assert result.ids[0].tolist() == [0, 0, 0]
    assert result.confidence[0].tolist() == pytest.approx([0.2] * 3, abs=1e-6)  # p of the candidate
    many = sample(torch.tensor([[probs_row(p)] * 500]), temperature=2.0, seed=4)
    assert MASK not in many.ids[0].tolist()
    assert set(many.ids[0].tolist()) == {0, 1, 2, 3}


# -- sampling (temperature > 0) -----------------------------------------------------------

def flat_logits(batch: int, width: int, vocab: int = V) -> torch.Tensor:
    return torch.zeros(batch, width, vocab)


def sample(logits, *, temperature=1.0, seed=0, step=0, positions=None, confidence="prob"):
    batch, width, _ = logits.shape
    params = make_params(batch, count=width, temperature=temperature, seed=seed, step=step)
    return unmask(logits, params, confidence=confidence, positions=positions)


def test_sampling_is_reproducible():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 16, V, generator=g)
    kwargs = dict(temperature=[1.0, 0.5, 2.0], seed=[3, 4, 5], step=[0, 7, 2])
    first, second = sample(logits, **kwargs), sample(logits, **kwargs)
    assert torch.equal(first.ids, second.ids)
    assert torch.equal(first.confidence, second.confidence)
    assert torch.equal(first.commit, second.commit)


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).float().mean())


def test_sampling_changes_with_seed_step_and_position():
    width = 256
    logits = flat_logits(1, width)  # every candidate equally likely: agreement by chance is 1/7
    base = sample(logits, seed=0, step=0).ids
    assert set(base[0].tolist()) == set(range(V - 1))  # spread over the vocabulary, never the mask
    assert agreement(base, sample(logits, seed=1, step=0).ids) < 0.3
    assert agreement(base, sample(logits, seed=0, step=1).ids) < 0.3
    shifted = (torch.arange(width) + width)[None]
    assert agreement(base, sample(logits, seed=0, step=0, positions=shifted).ids) < 0.3
    # and the draw at each position depends on the position, not on where it sits in the block
    rolled = sample(logits, positions=torch.arange(width).roll(5)[None]).ids
    assert torch.equal(rolled, sample(logits, positions=torch.arange(width)[None]).ids.roll(5))


def test_temperature_zero_rows_stay_argmax_in_a_sampled_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 32, V, generator=g) * 0.5  # flat enough that sampling moves away
    temperatures = [1.0, 0.0, 2.0, 0.0]
    result = sample(logits, temperature=temperatures, seed=[9, 9, 9, 9])  # check_step: argmax rows
    greedy = ref_x0(logits)
    for b, t in enumerate(temperatures):
        if t == 0:
            assert torch.equal(result.ids[b], greedy[b])
        else:
            assert agreement(result.ids[b], greedy[b]) < 0.9


def test_sampling_is_batch_invariant():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 12, V, generator=g)
    masked = (torch.rand(4, 12, generator=g) < 0.7).tolist()
    positions = torch.stack([torch.arange(12) + offset for offset in (0, 40, 12, 3)])
    params = make_params(4, count=[2, 0, 5, 3], threshold=[0.3, INF, 0.6, INF], factor=[0.0, 1.0, 0.0, 0.0],
                         temperature=[1.0, 0.7, 0.0, 1.5], seed=[11, 12, 11, 13], step=[0, 4, 2, 9])
    for measure in ("prob", "margin", "random"):
        together = unmask(logits, params, masked, confidence=measure, positions=positions)
        for b in range(4):
            alone_params = UnmaskParams(*(t[b:b + 1] for t in params))
            alone = unmask(logits[b:b + 1], alone_params, [masked[b]], confidence=measure,
                           positions=positions[b:b + 1])
            assert torch.equal(alone.ids[0], together.ids[b]), (measure, b)
            assert torch.equal(alone.commit[0], together.commit[b]), (measure, b)
            assert torch.equal(alone.confidence[0], together.confidence[b]), (measure, b)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_follows_the_tempered_softmax(temperature):
    p = [0.6, 0.3, 0.1, 0.0]  # the last token is the mask token
    n = 6000
    logits = torch.tensor([[probs_row(p)] * n], dtype=torch.float32)
    result = sample(logits, temperature=temperature, seed=5)
    tempered = [q ** (1 / temperature) for q in p[:3]]
    expected = [q / sum(tempered) for q in tempered]
    counts = torch.bincount(result.ids[0], minlength=4).tolist()
    assert counts[3] == 0
    for token in range(3):
        sigma = math.sqrt(expected[token] * (1 - expected[token]) / n)
        assert abs(counts[token] / n - expected[token]) < 5 * sigma, (token, counts)
    # the "prob" confidence is the (untempered) probability of the sampled token
    for w in range(0, n, 97):
        assert float(result.confidence[0, w]) == pytest.approx(p[int(result.ids[0, w])], abs=1e-6)


# -- "random" confidence ------------------------------------------------------------------

def random_confidence(seeds, steps, positions, logits=None) -> torch.Tensor:
    batch, width = positions.shape
    if logits is None:
        logits = flat_logits(batch, width)
    params = make_params(batch, seed=seeds, step=steps)
    return unmask(logits, params, confidence="random", positions=positions).confidence


def test_random_confidence_is_reproducible_and_in_the_open_unit_interval():
    seeds, steps = list(range(8)), [0, 1, 2, 3, 0, 1, 2, 3]
    positions = torch.arange(512).expand(8, 512)
    first = random_confidence(seeds, steps, positions)
    g = torch.Generator().manual_seed(4)
    other_logits = torch.randn(8, 512, V, generator=g)
    assert torch.equal(first, random_confidence(seeds, steps, positions, other_logits))
    assert bool(((first > 0) & (first < 1)).all())
    assert float(first.mean()) == pytest.approx(0.5, abs=0.02)
    # another seed, step or position draws other numbers
    assert agreement(first, random_confidence([s + 100 for s in seeds], steps, positions)) == 0
    assert agreement(first, random_confidence(seeds, [s + 1 for s in steps], positions)) == 0
    assert agreement(first[:, 1:], random_confidence(seeds, steps, positions + 1)[:, :-1]) == 1
    assert agreement(first, random_confidence(seeds, steps, positions + 1)) == 0


def test_random_confidence_is_below_one_in_float32():
    # uniform() is in (0, 1) in float64, but (h + 0.5) / 2**32 rounds to 1.0 in float32 for the
    # 128 largest hashes h; this (seed, step, position) hits one of them.
    conf = random_confidence([11458], [0], torch.tensor([[671, 672, 673]]))
    assert bool(((conf > 0) & (conf < 1)).all()), conf.tolist()


def test_random_remasking_commits_the_count_highest_draws():
    logits = logits_of([[0.99, 0.2, 0.5, 0.3, 0.9, 0.4]] * 2)
    params = make_params(2, count=[2, 4], seed=[21, 21], step=[3, 3])
    result = unmask(logits, params, confidence="random")
    conf = confidences(result)
    assert conf[0] == conf[1]
    assert commits(result) == [ref_fixed(conf[0], [True] * 6, 2), ref_fixed(conf[1], [True] * 6, 4)]
    assert commits(result)[0] < commits(result)[1]
    # committed tokens are still the argmax of the logits
    assert result.ids[0].tolist() == [default_token(w) if w in commits(result)[0] else MASK for w in range(6)]


# -- what every step returns ----------------------------------------------------------------

@pytest.mark.parametrize("measure", ["prob", "margin", "entropy", "random"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_committed_count_and_ids(measure, temperature):
    logits, masked = random_case(10 + int(temperature), batch=5, width=9, vocab=7)
    params = make_params(5, count=[0, 1, 2, 4, 9], threshold=[INF, 0.4, 0.7, INF, 0.1],
                         factor=[1.0, 0.0, 2.0, 0.0, 0.0], temperature=temperature, seed=[1, 2, 3, 4, 5])
    result = unmask(logits, params, masked, confidence=measure)  # check_step checks the contract
    # the same step with every masked position committed gives the candidates x0
    all_params = params._replace(count=torch.full((5,), 9))
    x0 = unmask(logits, all_params, masked, confidence=measure).ids
    expected = torch.where(result.commit, x0, ids_of(masked, 6))
    assert torch.equal(result.ids, expected)
    assert result.committed.tolist() == result.commit.sum(-1).tolist()
    assert result.committed.tolist()[-1] == sum(masked[-1])
    if temperature == 0:
        assert torch.equal(torch.where(result.commit, ref_x0(logits), result.ids), result.ids)
