"""`dlmrt.ops.parallel_unmask` beyond the commit rules: every rule on random inputs, the
confidence measures, sampling, random remasking, and what every step returns; against the
plain-Python reference in parallel_unmask_reference.py."""

from __future__ import annotations

import math

import pytest
import torch

from dlmrt.ops.parallel_unmask import UnmaskParams
from dlmrt.runtime.policies import Fixed, LLaDA2
from parallel_unmask_reference import (
    INF, MASK, V, commits, confidences, default_token, factor_params, ids_of, logits_of, make_params,
    policy_params, probs_row, ref_factor, ref_fixed, ref_llada2, ref_threshold, ref_x0, threshold_params, unmask,
)


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
        params = make_params(batch, count=n_k, threshold=[LLaDA2(threshold=t).row_params()["threshold"] for t in taus])
        result = unmask(logits, params, masked, confidence=measure)
        assert commits(result) == expected, n_k


# -- confidence measures ----------------------------------------------------------------



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
