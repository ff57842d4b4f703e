"""The vocabulary-parallel unmasking step and ORL residual (`dlmrt.parallel.vocab`) against the references
on the whole vocabulary (`parallel_unmask`, `residual_context`).

R ranks are simulated in this process, one after another (`SimulatedGroup`): each sees the contiguous
slice of the full logits that a vocabulary-parallel LM head would give it, and its collectives return
what every rank passed to them. Every rank must finish the step identically, with the reference's
candidates bit for bit, its confidences to float32 rounding, and its ids, commits and counts exactly
wherever no confidence lies within float32 rounding of a decision's boundary (`rows_decided_alike`,
which the crafted cases require of every row).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dlmrt.models.diffusion_gemma import DiffusionGemma
from dlmrt.parallel import vocab
from dlmrt.parallel.vocab import (STAT_COUNT, combine, renoise_exchange_bytes, shard_statistics, step_exchange_bytes,
                                  vocab_parallel_entropy_bound_step, vocab_parallel_residual,
                                  vocab_parallel_soft_tokens, vocab_parallel_unmask)
from dlmrt.ops.entropy_bound import RenoiseParams, entropy, entropy_bound_step, gumbel_sample
from dlmrt.ops.parallel_unmask import MEASURE_CODES, EditParams, UnmaskParams, parallel_unmask, strictly_above
from dlmrt.ops.parallel_unmask.reference import candidate_probability, candidates
from dlmrt.ops.residual_context.reference import residual_context
from parallel_unmask_reference import make_params

INF = math.inf
# Confidences are in [0, 1]: a few float32 ulps of 1.
CONFIDENCE_TOLERANCE = 4 * torch.finfo(torch.float32).eps
CASES = settings(max_examples=300, derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow])


# -- simulated ranks ------------------------------------------------------------------------

def even_split(vocab_size: int, world: int) -> list[tuple[int, int]]:
    """Contiguous slices, the first `vocab_size % world` one entry longer (43 over 2: 22 + 21)."""
    base, extra = divmod(vocab_size, world)
    sizes = [base + (r < extra) for r in range(world)]
    return split_at([sum(sizes[:r]) for r in range(1, world)], vocab_size)


def random_split(vocab_size: int, world: int, generator: torch.Generator) -> list[tuple[int, int]]:
    """Contiguous slices cut at `world - 1` random places."""
    return split_at(sorted((torch.randperm(vocab_size - 1, generator=generator)[:world - 1] + 1).tolist()), vocab_size)


# The tiny models' 43 tokens over 1 to 4 ranks, evenly and not
TINY_VOCABULARY_SHARDS = [[(0, 43)], [(0, 22), (22, 43)], [(0, 1), (1, 30), (30, 43)],
                          [(0, 11), (11, 22), (22, 33), (33, 43)]]


def split_at(cuts: list[int], vocab_size: int) -> list[tuple[int, int]]:
    edges = [0, *cuts, vocab_size]
    assert all(a < b for a, b in zip(edges, edges[1:])), edges
    return list(zip(edges, edges[1:]))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


class SimulatedGroup:
    """`world` ranks run one after another in this process. A collective can return only what every rank
    passes it, so the ranks run in rounds: a collective returns what the ranks passed to the same call in
    the round before (zeros in the first round), until a round passes exactly what the one before did.
    Then each rank's result is what real collectives give it; a step with n collectives one after another
    settles in n + 1 rounds. `calls[rank]`: (op, tensor) of each collective the rank issued, in order."""

    MAX_ROUNDS = 8

    def __init__(self, world: int):
        self.world = world
        self.calls: list[list[tuple[str, torch.Tensor]]] = []

    def run(self, step: Callable) -> list:
        """`step(rank, gather, all_reduce)` on every rank; the ranks' results in rank order."""
        previous = None
        for _ in range(self.MAX_ROUNDS):
            calls = [[] for _ in range(self.world)]
            results = [step(rank, self._collective("all_gather", rank, calls, previous),
                            self._collective("all_reduce", rank, calls, previous)) for rank in range(self.world)]
            if previous is not None and all(
                    len(a) == len(b) and all(x[0] == y[0] and _same(x[1], y[1]) for x, y in zip(a, b))
                    for a, b in zip(calls, previous)):
                self.calls = calls
                return results
            previous = calls
        raise AssertionError(f"the ranks' collectives did not settle in {self.MAX_ROUNDS} rounds")

    def _collective(self, op: str, rank: int, calls: list, previous: list | None) -> Callable:
        def call(tensor: torch.Tensor) -> torch.Tensor:
            index = len(calls[rank])
            calls[rank].append((op, tensor.clone()))
            if previous is None or any(len(c) <= index or c[index][0] != op for c in previous):
                inputs = [torch.zeros_like(tensor)] * self.world
            else:
                inputs = [c[index][1] for c in previous]
            return torch.stack(inputs) if op == "all_gather" else sum(inputs[1:], inputs[0].clone())
        return call


# -- the step against the reference --------------------------------------------------------

def decisions(conf: torch.Tensor, probability: torch.Tensor, ids: torch.Tensor, params: UnmaskParams,
              mask_id: int, edits: EditParams | None) -> list[torch.Tensor]:
    """Every comparison the step's commit rule makes, per row: the order of each pair of confidences,
    each against the threshold, the factor rule at each sorted place, and p(x0) against the edit
    threshold. Two sets of confidences that agree on all of them commit and edit the same positions."""
    conf = torch.where(ids == mask_id, conf, -INF)
    pairs = (conf[:, :, None] > conf[:, None, :]).long() - (conf[:, :, None] < conf[:, None, :]).long()
    ranked = conf.sort(dim=-1, descending=True, stable=True).values
    n = torch.arange(1, conf.shape[-1] + 1)
    factor = (n + 1) * (1 - ranked) < params.factor[:, None]
    above = conf >= params.threshold[:, None]
    edit = (probability >= edits.threshold[:, None]) & edits.editable if edits is not None else above
    return [pairs.flatten(1), factor, above, edit]


def rows_decided_alike(ref: list[torch.Tensor], ours: list[torch.Tensor]) -> torch.Tensor:
    """`[B]` bool: the rows where every comparison of `decisions` comes out the same."""
    return torch.stack([(a == b).all(-1) for a, b in zip(ref, ours)]).all(0)


def check_step(logits: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, params: UnmaskParams,
               shards: list[tuple[int, int]], *, mask_id: int, confidence="prob", sampling=None,
               edits: EditParams | None = None) -> torch.Tensor:
    """Runs the step on every simulated rank and checks it against the reference on the full logits;
    returns `[B]` bool, the rows decided exactly as the reference decides them (see the module's docstring)."""
    batch, width, vocab_size = logits.shape
    ref = parallel_unmask(logits, ids, positions, params, mask_id=mask_id, confidence=confidence, sampling=sampling,
                          edits=edits)
    group = SimulatedGroup(len(shards))

    def step(rank, gather, all_reduce):
        start, end = shards[rank]
        return vocab_parallel_unmask(logits[..., start:end], ids, positions, params, mask_id=mask_id, offset=start,
                                     vocab_size=vocab_size, gather=gather, confidence=confidence, sampling=sampling,
                                     edits=edits)

    results = group.run(step)
    # One collective per rank: an all_gather of its statistics, step_exchange_bytes in all.
    stats = []
    for rank, calls in enumerate(group.calls):
        assert [op for op, _ in calls] == ["all_gather"]
        sent = calls[0][1]
        assert sent.shape == (batch, width, STAT_COUNT) and sent.dtype == torch.float64
        start, end = shards[rank]
        assert _same(sent, shard_statistics(logits[..., start:end], start, vocab_size, mask_id, params, positions,
                                            sampling))
        assert step_exchange_bytes(batch, width, len(shards)) == (len(shards) - 1) * sent.nbytes
        stats.append(sent)
    # Every rank finishes the step identically.
    for result in results[1:]:
        for ours, first in zip(result, results[0]):
            assert _same(ours, first)
    out = results[0]
    # The candidates, bit for bit.
    combined = combine(torch.stack(stats))
    x0 = candidates(logits, params, positions, mask_id, sampling)
    assert torch.equal(combined.x0, x0)
    # The confidences, to float32 rounding; -inf at the same (unmasked) positions.
    assert out.confidence.dtype == torch.float32
    assert torch.equal(out.confidence == -INF, ref.confidence == -INF)
    finite = ref.confidence != -INF
    assert torch.allclose(out.confidence[finite], ref.confidence[finite], rtol=0, atol=CONFIDENCE_TOLERANCE)
    # The decisions: exactly the reference's wherever its comparisons come out the same.
    alike = rows_decided_alike(
        decisions(ref.confidence, candidate_probability(logits, x0), ids, params, mask_id, edits),
        decisions(out.confidence, combined.probability.float(), ids, params, mask_id, edits))
    assert torch.equal(out.ids[alike], ref.ids[alike])
    assert torch.equal(out.commit[alike], ref.commit[alike])
    assert torch.equal(out.committed[alike], ref.committed[alike])
    assert out.ids.dtype == ref.ids.dtype and out.committed.dtype == ref.committed.dtype
    return alike


def block(batch: int, width: int, mask_id: int, vocab_size: int, masked: float = 0.7, seed: int = 0):
    """ids (a `masked` share of them the mask token, the rest other tokens) and positions `[B, W]`."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab_size, (batch, width), generator=g)
    tokens = torch.where(tokens == mask_id, (tokens + 1) % vocab_size, tokens)
    ids = torch.where(torch.rand(batch, width, generator=g) < masked, mask_id, tokens)
    positions = torch.arange(width)[None] + torch.randint(0, 50, (batch, 1), generator=g)
    return ids, positions


# -- random cases --------------------------------------------------------------------------

def draw_shards(draw, vocab_sizes: list[int]) -> tuple[int, list[tuple[int, int]]]:
    """A vocabulary size and its split over 1 to 4 ranks, even or at random cuts."""
    vocab_size = draw(st.sampled_from(vocab_sizes) | st.integers(2, 50))
    world = draw(st.integers(1, min(4, vocab_size)))
    if draw(st.booleans()):
        return vocab_size, even_split(vocab_size, world)
    cuts = draw(st.lists(st.integers(1, vocab_size - 1), min_size=world - 1, max_size=world - 1, unique=True))
    return vocab_size, split_at(sorted(cuts), vocab_size)


@st.composite
def step_cases(draw):
    vocab_size, shards = draw_shards(draw, [2, 3, 5, 8, 43, 43, 64])
    edges = sorted({a for a, _ in shards} | {b - 1 for _, b in shards})  # the first and last entry of each shard
    mask_id = draw(st.sampled_from(edges) | st.integers(0, vocab_size - 1))
    batch, width = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = draw(st.sampled_from([0.3, 2.0, 8.0, 40.0]))
    logits = torch.randn(batch, width, vocab_size, generator=g) * scale
    if draw(st.booleans()):  # coarse values: ties within and across shards, and between positions
        logits = logits.round()
    if draw(st.booleans()):  # the row's maximum again at another entry, maybe in another shard
        top = logits.amax(-1, keepdim=True)
        other = torch.randint(vocab_size, (batch, width, 1), generator=g)
        logits = logits.scatter(-1, other, top)
    if draw(st.booleans()):  # the mask token is the most likely token at some positions
        top = logits.amax(-1)
        logits[..., mask_id] = torch.where(torch.rand(batch, width, generator=g) < 0.5, top + 1, top)
    if draw(st.booleans()):  # impossible tokens
        logits = logits.masked_fill(torch.rand(logits.shape, generator=g) < 0.3, -INF)
        logits[..., (mask_id + 1) % vocab_size] = 0.0  # at least one finite logit besides (or at) the mask
    ids, positions = block(batch, width, mask_id, vocab_size, draw(st.sampled_from([0.0, 0.5, 0.8, 1.0])),
                           draw(st.integers(0, 1000)))
    rows = st.lists
    params = UnmaskParams(
        count=torch.tensor(draw(rows(st.integers(0, width + 1), min_size=batch, max_size=batch))),
        threshold=torch.tensor(draw(rows(st.sampled_from([INF, 0.0, 0.3, 0.6, 0.9, strictly_above(0.5)]),
                                         min_size=batch, max_size=batch)), dtype=torch.float32),
        factor=torch.tensor(draw(rows(st.sampled_from([0.0, 0.5, 1.5, 4.0]), min_size=batch, max_size=batch)),
                            dtype=torch.float32),
        temperature=torch.tensor(draw(rows(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0]), min_size=batch,
                                           max_size=batch)), dtype=torch.float32),
        seed=torch.tensor(draw(rows(st.integers(0, 2**40), min_size=batch, max_size=batch))),
        step=torch.tensor(draw(rows(st.integers(0, 300), min_size=batch, max_size=batch))))
    if draw(st.booleans()):
        confidence = draw(st.sampled_from(sorted(MEASURE_CODES)))
    else:
        confidence = torch.tensor(draw(rows(st.sampled_from(sorted(MEASURE_CODES.values())), min_size=batch,
                                            max_size=batch)))
    sampling = draw(st.sampled_from([None, True, False]))
    edits = None
    if draw(st.booleans()):
        edits = EditParams(
            threshold=torch.tensor(draw(rows(st.sampled_from([INF, 0.0, 0.2, 0.7, strictly_above(0.5)]),
                                             min_size=batch, max_size=batch)), dtype=torch.float32),
            editable=torch.rand(batch, width, generator=g) < 0.7)
    return dict(logits=logits, ids=ids, positions=positions, params=params, shards=shards, mask_id=mask_id,
                confidence=confidence, sampling=sampling, edits=edits)


@CASES
@given(step_cases())
def test_random_steps_match_the_reference(case):
    alike = check_step(case.pop("logits"), case.pop("ids"), case.pop("positions"), case.pop("params"),
                       case.pop("shards"), **case)
    event("every row decided as the reference" if bool(alike.all()) else "a row on a float32 rounding boundary")


@pytest.mark.parametrize("measure", ["prob", "margin", "entropy", "random", "codes"])
@pytest.mark.parametrize("shards", [[(0, 43)], [(0, 22), (22, 43)], [(0, 11), (11, 22), (22, 33), (33, 43)],
                                    [(0, 2), (2, 3), (3, 43)], [(0, 3), (3, 30), (30, 43)]],
                         ids=["1", "22+21", "11+11+11+10", "mask alone", "mask last"])
def test_the_tiny_models_vocabulary(shards, measure):
    # vocabulary 43 and mask 2, as the shipped tiny models; every policy setting and measure in one batch
    vocab_size, mask_id, batch, width = 43, 2, 8, 12
    logits = torch.randn(batch, width, vocab_size, generator=torch.Generator().manual_seed(7)) * 3
    logits[1, :, mask_id] = 30.0  # the mask token the most likely everywhere in row 1
    ids, positions = block(batch, width, mask_id, vocab_size, masked=0.8)
    params = make_params(batch, count=[1, 2, 0, 4, 1, 12, 3, 0],
                         threshold=[0.3, INF, 0.9, INF, strictly_above(0.2), INF, 0.1, 0.5],
                         factor=[0.0, 0.0, 0.0, 1.5, 0.0, 0.0, 4.0, 0.0],
                         temperature=[0.0, 0.0, 1.0, 0.0, 0.7, 2.0, 0.0, 1.0], seed=[3, 1, 4, 1, 5, 9, 2, 6], step=5)
    confidence = torch.tensor([0, 1, 2, 3, 2, 1, 0, 0]) if measure == "codes" else measure
    edits = EditParams(torch.tensor([INF, 0.5, 0.0, 0.9, INF, 0.3, 0.6, 0.05]), torch.rand(batch, width) < 0.8)
    for sampling in (None, True):
        for e in (None, edits):
            assert check_step(logits, ids, positions, params, shards, mask_id=mask_id, confidence=confidence,
                              sampling=sampling, edits=e).all()


# -- ties ----------------------------------------------------------------------------------

def whole_block(logits: torch.Tensor, mask_id: int, **kw):
    """A step over a block of masked positions that commits every one of them (ids = x0)."""
    batch, width, vocab_size = logits.shape
    ids = torch.full((batch, width), mask_id)
    positions = torch.arange(width)[None].expand(batch, width)
    params = make_params(batch, count=width, **kw)
    return ids, positions, params


def step_ids(logits, shards, mask_id, **kw) -> list[list[int]]:
    ids, positions, params = whole_block(logits, mask_id, **kw)
    assert check_step(logits, ids, positions, params, shards, mask_id=mask_id).all()
    return vocab_parallel_unmask_on_rank(logits, ids, positions, params, shards, mask_id).ids.tolist()


def vocab_parallel_unmask_on_rank(logits, ids, positions, params, shards, mask_id, rank=0, **kw):
    group = SimulatedGroup(len(shards))
    vocab_size = logits.shape[-1]

    def step(r, gather, all_reduce):
        start, end = shards[r]
        return vocab_parallel_unmask(logits[..., start:end], ids, positions, params, mask_id=mask_id, offset=start,
                                     vocab_size=vocab_size, gather=gather, **kw)
    return group.run(step)[rank]


def test_equal_maxima_in_two_shards_the_lower_index_wins():
    vocab_size, mask_id = 8, 7
    # Different maxima at each position, so that no two positions' confidences tie: the reference's
    # float32 softmax gives a row's permutation a confidence an ulp apart (see rows_decided_alike).
    logits = torch.zeros(1, 4, vocab_size)
    logits[0, 0, [1, 5]] = 2.0  # across shards 0 and 1
    logits[0, 1, [5, 6]] = 2.5  # two in shard 1
    logits[0, 2, [3, 4]] = 3.0  # either side of the boundary
    logits[0, 3, [0, 3, 4, 6]] = 3.5  # two in each
    for shards in (even_split(vocab_size, 2), [(0, 4), (4, 6), (6, 8)], [(0, 1), (1, 2), (2, 5), (5, 8)]):
        assert step_ids(logits, shards, mask_id) == [[1, 5, 3, 0]]


def test_equal_maxima_in_higher_shards_only():
    vocab_size, mask_id = 12, 0
    logits = torch.zeros(1, 2, vocab_size)
    logits[0, 0, [7, 10]] = 1.5  # shards 2 and 3 of four: shard 2's wins
    logits[0, 1, [4, 11]] = 2.5
    assert step_ids(logits, even_split(vocab_size, 4), mask_id) == [[7, 4]]


@pytest.mark.parametrize("mask_id, shards", [(4, [(0, 4), (4, 8)]), (3, [(0, 4), (4, 8)]),
                                             (2, [(0, 2), (2, 3), (3, 8)]), (0, [(0, 1), (1, 8)]),
                                             (7, [(0, 4), (4, 7), (7, 8)])],
                         ids=["first of a shard", "last of a shard", "alone (middle)", "alone (first)",
                              "alone (last)"])
@pytest.mark.parametrize("measure", ["prob", "margin", "entropy"])
def test_the_mask_token_is_the_most_likely(mask_id, shards, measure):
    vocab_size = 8
    g = torch.Generator().manual_seed(mask_id)
    logits = torch.randn(2, 5, vocab_size, generator=g)
    logits[..., mask_id] = 6.0
    logits[0, 1, [1, 5]] = 3.0  # the runners-up tie across shards
    logits[1, :, :] = logits[1, :, :].round()
    logits[1, :, mask_id] = 6.0
    ids, positions, params = whole_block(logits, mask_id, temperature=[0.0, 1.0], seed=11)
    assert check_step(logits, ids, positions, params, shards, mask_id=mask_id, confidence=measure).all()
    out = vocab_parallel_unmask_on_rank(logits, ids, positions, params, shards, mask_id, confidence=measure)
    assert mask_id not in out.ids.tolist()[0]
    assert out.ids[0, 1].item() == 1


@pytest.mark.parametrize("mask_id", [0, 5])
@pytest.mark.parametrize("logit", [-1000.0, 800.0], ids=["exp underflows", "exp overflows"])
def test_sampling_scores_that_tie_everywhere(logit, mask_id):
    # exp(l) is 0 (or inf) in float64 for every token: every Gumbel-max score ties, and the reference
    # takes the first one (0, even where that is the mask token, whose score is exp(-inf) = 0).
    vocab_size = 43
    logits = torch.full((2, 3, vocab_size), logit)
    ids, positions, params = whole_block(logits, mask_id, temperature=1.0, seed=[1, 2])
    for shards in (even_split(vocab_size, 2), even_split(vocab_size, 3), [(0, 1), (1, 2), (2, 40), (40, 43)]):
        check_step(logits, ids, positions, params, shards, mask_id=mask_id)
        x0 = candidates(logits, params, positions, mask_id)
        assert x0.unique().tolist() == ([0] if logit < 0 or mask_id != 0 else [1])


def test_every_token_but_the_mask_impossible():
    # Degenerate, but the reference's answer: the argmax over -inf everywhere is entry 0.
    vocab_size = 9
    logits = torch.full((1, 2, vocab_size), -INF)
    for mask_id in (0, 4):
        logits[..., mask_id] = 1.0
        ids, positions, params = whole_block(logits, mask_id)
        for shards in (even_split(vocab_size, 3), [(0, 1), (1, 9)], [(0, 4), (4, 5), (5, 9)]):
            check_step(logits, ids, positions, params, shards, mask_id=mask_id)
        logits[..., mask_id] = -INF


def exact_rows(maxima: list[int], vocab_size: int, spread: list[list[int]]) -> torch.Tensor:
    """`[1, W, V]`: position w has logit 0 at the entries `spread[w]` (maxima[w] of them) and -inf
    elsewhere, so that p = 1 / maxima[w] exactly there, the other entries 0."""
    logits = torch.full((1, len(maxima), vocab_size), -INF)
    for w, entries in enumerate(spread):
        assert len(entries) == maxima[w]
        logits[0, w, entries] = 0.0
    return logits


@pytest.mark.parametrize("measure", ["prob", "margin"])
def test_exact_ties_between_positions_and_at_the_threshold(measure):
    # p(x0) is 1/2 at positions 1, 3 and 4 (their two tokens in different shards, or the same one), 1/4 at 0,
    # 1 at 2. Margins: 0 where two tokens tie, 1 at position 2. A threshold of exactly 1/2 takes the ties.
    vocab_size, mask_id = 12, 11
    logits = exact_rows([4, 2, 1, 2, 2], vocab_size, [[0, 3, 6, 9], [2, 8], [5], [4, 5], [1, 10]])
    ids, positions, _ = whole_block(logits, mask_id)
    for threshold, count in ((0.5, 1), (0.25, 2), (strictly_above(0.5), 2), (INF, 3)):
        params = make_params(1, count=count, threshold=threshold)
        for shards in (even_split(vocab_size, 2), even_split(vocab_size, 3), [(0, 5), (5, 6), (6, 12)]):
            assert check_step(logits, ids, positions, params, shards, mask_id=mask_id, confidence=measure).all()
            out = vocab_parallel_unmask_on_rank(logits, ids, positions, params, shards, mask_id, confidence=measure)
            if measure == "prob":
                assert out.confidence.tolist() == [[0.25, 0.5, 1.0, 0.5, 0.5]]
            else:
                assert out.confidence.tolist() == [[0.0, 0.0, 1.0, 0.0, 0.0]]


def test_edits_need_the_probability_of_x0():
    # p(x0) is exactly 1/2 at the committed positions, the edit threshold exactly 1/2 or just above.
    vocab_size, mask_id = 10, 9
    logits = exact_rows([2, 2, 2, 1], vocab_size, [[0, 5], [3, 4], [7, 8], [6]])
    ids = torch.tensor([[1, 3, 2, mask_id]])  # position 1 is x0 already: no edit
    positions = torch.arange(4)[None]
    params = make_params(1, count=1)
    for threshold, edited in ((0.5, [0, 3, 7, 6]), (strictly_above(0.5), [1, 3, 2, 6])):
        edits = EditParams(torch.tensor([threshold]), torch.ones(1, 4, dtype=torch.bool))
        for shards in (even_split(vocab_size, 2), [(0, 4), (4, 5), (5, 10)]):
            assert check_step(logits, ids, positions, params, shards, mask_id=mask_id, edits=edits).all()
            out = vocab_parallel_unmask_on_rank(logits, ids, positions, params, shards, mask_id, edits=edits)
            assert out.ids.tolist() == [edited] and out.commit.tolist() == [[False] * 3 + [True]]


# -- what is exchanged ---------------------------------------------------------------------

def test_step_exchange_bytes():
    assert step_exchange_bytes(4, 32, 1) == 0
    assert step_exchange_bytes(4, 32, 2) == 4 * 32 * STAT_COUNT * 8
    assert step_exchange_bytes(4, 32, 8) == 7 * 4 * 32 * STAT_COUNT * 8
    # independent of the vocabulary: a 150k vocabulary's step moves the same bytes as the tiny model's
    for vocab_size in (43, 1000):
        logits = torch.randn(2, 5, vocab_size)
        ids, positions = block(2, 5, 2, vocab_size)
        params = make_params(2, count=1)
        shards = even_split(vocab_size, 3)
        group = SimulatedGroup(3)
        group.run(lambda r, gather, all_reduce: vocab_parallel_unmask(
            logits[..., shards[r][0]:shards[r][1]], ids, positions, params, mask_id=2, offset=shards[r][0],
            vocab_size=vocab_size, gather=gather))
        for calls in group.calls:
            assert len(calls) == 1
            assert step_exchange_bytes(2, 5, 3) == 2 * calls[0][1].nbytes == 2 * 2 * 5 * STAT_COUNT * 8


def test_a_shard_that_does_not_fit_is_refused():
    params = make_params(1)
    positions = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="does not fit"):
        shard_statistics(torch.zeros(1, 1, 5), 40, 43, 2, params, positions)
    with pytest.raises(ValueError, match="does not fit"):
        shard_statistics(torch.zeros(1, 1, 0), 0, 43, 2, params, positions)


# -- the ORL residual ----------------------------------------------------------------------

def check_residual(logits: torch.Tensor, embedding: torch.Tensor, shards: list[tuple[int, int]]):
    vocab_size = logits.shape[-1]
    z_ref, certainty_ref = residual_context(logits, embedding)
    group = SimulatedGroup(len(shards))

    def step(rank, gather, all_reduce):
        start, end = shards[rank]
        return vocab_parallel_residual(logits[..., start:end], embedding[start:end], offset=start,
                                       vocab_size=vocab_size, gather=gather, all_reduce=all_reduce)

    results = group.run(step)
    batch, length, hidden = logits.shape[0], logits.shape[1], embedding.shape[1]
    for calls in group.calls:
        assert [op for op, _ in calls] == ["all_gather", "all_reduce"]
        assert calls[0][1].shape == (batch, length, vocab.NORMALIZER_STAT_COUNT)
        assert calls[1][1].shape == (batch, length, hidden) and calls[1][1].dtype == torch.float32
    for z, certainty in results:
        assert z.dtype == z_ref.dtype and certainty.dtype == certainty_ref.dtype
        assert z.shape == z_ref.shape and certainty.shape == certainty_ref.shape
        assert _same(z, results[0].z) and _same(certainty, results[0].certainty)
        if embedding.dtype == torch.float32:
            torch.testing.assert_close(z, z_ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(certainty, certainty_ref, rtol=0, atol=1e-6)
        else:  # rounded to the embedding's dtype after the sum: at most one step of it apart
            torch.testing.assert_close(z.float(), z_ref.float(), rtol=2 ** -7, atol=1e-6)
            torch.testing.assert_close(certainty.float(), certainty_ref.float(), rtol=2 ** -7, atol=1e-6)


@CASES
@given(vocab_size=st.sampled_from([2, 5, 43, 64]) | st.integers(2, 70), world=st.integers(1, 4),
       uneven=st.booleans(), seed=st.integers(0, 2**31), scale=st.sampled_from([0.1, 3.0, 30.0]),
       impossible=st.booleans())
def test_random_residuals_match_the_reference(vocab_size, world, uneven, seed, scale, impossible):
    world = min(world, vocab_size)
    g = torch.Generator().manual_seed(seed)
    shards = random_split(vocab_size, world, g) if uneven else even_split(vocab_size, world)
    logits = torch.randn(2, 6, vocab_size, generator=g) * scale
    if impossible:  # -inf logits, whole shards of them too
        logits = logits.masked_fill(torch.rand(logits.shape, generator=g) < 0.4, -INF)
        logits[0, 0, shards[0][0]:shards[0][1]] = -INF
        logits[..., -1] = 0.0
    embedding = torch.randn(vocab_size, 8, generator=g) * 0.5
    check_residual(logits, embedding, shards)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shards", TINY_VOCABULARY_SHARDS)
def test_residual_of_the_tiny_models_vocabulary(shards, dtype):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 24, 43, generator=g) * 4
    logits[0, 0] = 0.0  # uniform: certainty 0
    logits[0, 1, 5] = 1e4  # one token: certainty 1
    check_residual(logits, (torch.randn(43, 32, generator=g) * 0.05).to(dtype), shards)


# -- DiffusionGemma's uniform-noise step -----------------------------------------------------

def acceptance_comparisons(token_entropy: torch.Tensor, bound: torch.Tensor) -> list[torch.Tensor]:
    """Every comparison `accept_by_entropy` makes, per row: the order of each pair of entropies and each
    sorted place's sum before it against the bound (float64, as it sums)."""
    pairs = (token_entropy[:, :, None] > token_entropy[:, None, :]).long() - \
        (token_entropy[:, :, None] < token_entropy[:, None, :]).long()
    ranked = token_entropy.sort(dim=-1, stable=True).values.to(torch.float64)
    before = torch.nn.functional.pad(ranked.cumsum(-1)[..., :-1], (1, 0))
    return [pairs.flatten(1), before <= bound.to(torch.float64)[:, None]]


def check_renoise(logits: torch.Tensor, canvas: torch.Tensor, positions: torch.Tensor, params: RenoiseParams,
                  shards: list[tuple[int, int]], finished: torch.Tensor | None = None) -> torch.Tensor:
    """The vocabulary-parallel entropy-bound step on every simulated rank against `entropy_bound_step` on the
    full logits; returns `[B]` bool, the rows decided exactly as the reference decides them."""
    batch, width, vocab_size = logits.shape
    ref = entropy_bound_step(logits, canvas, positions, params, finished=finished)
    group = SimulatedGroup(len(shards))

    def step(rank, gather, all_reduce):
        start, end = shards[rank]
        return vocab_parallel_entropy_bound_step(logits[..., start:end], canvas, positions, params, offset=start,
                                                 vocab_size=vocab_size, gather=gather, finished=finished)

    results = group.run(step)
    stats = []
    for rank, calls in enumerate(group.calls):
        assert [op for op, _ in calls] == ["all_gather"]
        sent = calls[0][1]
        assert sent.shape == (batch, width, vocab.RENOISE_STAT_COUNT) and sent.dtype == torch.float64
        assert renoise_exchange_bytes(batch, width, len(shards)) == (len(shards) - 1) * sent.nbytes
        stats.append(sent)
    for rank, result in enumerate(results):
        start, end = shards[rank]
        assert torch.equal(result.scaled_logits, ref.scaled_logits[..., start:end])  # this rank's shard of them
        for name in ("canvas", "argmax", "accepted", "mean_entropy"):
            assert _same(getattr(result, name), getattr(results[0], name)), name
    out = results[0]
    # The argmax and the sample, bit for bit; the entropies to float32 rounding.
    assert torch.equal(out.argmax, ref.argmax)
    gathered = torch.stack(stats)
    sample = vocab._winner(gathered, vocab._SAMPLE_SCORE, vocab._SAMPLE_INDEX)
    assert torch.equal(sample, gumbel_sample(ref.scaled_logits, params.seed, params.step, positions))
    token_entropy = vocab._combine_normalizer(gathered).entropy.float()
    ref_entropy = entropy(ref.scaled_logits)
    torch.testing.assert_close(token_entropy, ref_entropy, rtol=CONFIDENCE_TOLERANCE, atol=CONFIDENCE_TOLERANCE)
    torch.testing.assert_close(out.mean_entropy, ref.mean_entropy, rtol=CONFIDENCE_TOLERANCE,
                               atol=CONFIDENCE_TOLERANCE)
    alike = rows_decided_alike(acceptance_comparisons(ref_entropy, params.entropy_bound),
                               acceptance_comparisons(token_entropy, params.entropy_bound))
    assert torch.equal(out.canvas[alike], ref.canvas[alike])
    assert torch.equal(out.accepted[alike], ref.accepted[alike])
    return alike


def renoise_params(batch: int, *, temperature=0.8, entropy_bound=1.0, seed=0, step=0) -> RenoiseParams:
    def row(value, dtype):
        return torch.tensor(value if isinstance(value, list) else [value] * batch, dtype=dtype)

    return RenoiseParams(row(temperature, torch.float32), row(entropy_bound, torch.float32), row(seed, torch.long),
                         row(step, torch.long))


@st.composite
def renoise_cases(draw):
    vocab_size, shards = draw_shards(draw, [2, 5, 43, 43, 64])
    batch, width = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(batch, width, vocab_size, generator=g) * draw(st.sampled_from([0.3, 2.0, 8.0, 40.0]))
    if draw(st.booleans()):
        logits = logits.round()
    if draw(st.booleans()):
        top = logits.amax(-1, keepdim=True)
        logits = logits.scatter(-1, torch.randint(vocab_size, (batch, width, 1), generator=g), top)
    if draw(st.booleans()):
        logits = logits.masked_fill(torch.rand(logits.shape, generator=g) < 0.3, -INF)
        logits[..., 0] = 0.0
    def rows(values):
        return draw(st.lists(values, min_size=batch, max_size=batch))

    params = renoise_params(batch, temperature=rows(st.sampled_from([0.4, 0.6125, 0.8, 1.0, 1.7])),
                            entropy_bound=rows(st.sampled_from([0.0, 0.3, 1.0, 2.5, 10.0, 1e9])),
                            seed=rows(st.integers(0, 2**40)), step=rows(st.integers(0, 60)))
    canvas = torch.randint(vocab_size, (batch, width), generator=g)
    positions = torch.arange(width)[None] + torch.randint(0, 50, (batch, 1), generator=g)
    finished = torch.rand(batch, generator=g) < 0.3 if draw(st.booleans()) else None
    return dict(logits=logits, canvas=canvas, positions=positions, params=params, shards=shards, finished=finished)


@CASES
@given(renoise_cases())
def test_random_entropy_bound_steps_match_the_reference(case):
    alike = check_renoise(**case)
    event("every row decided as the reference" if bool(alike.all()) else "a row on a float32 rounding boundary")


def test_entropy_bound_step_ties_and_the_tiny_models_vocabulary():
    vocab_size, batch, width = 43, 3, 16
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(batch, width, vocab_size, generator=g) * 3
    logits[0, 0, [5, 30]] = 20.0  # equal maxima in shards 0 and 1 (of 22 + 21): 5
    logits[0, 1, [21, 22]] = 21.0  # either side of the boundary: 21
    logits[0, 2, :] = 0.0  # every entry ties: 0
    logits[1, :, :] = -INF  # one possible token per position (entropy 0)
    logits[1, torch.arange(width), torch.arange(width) * 2] = 1.0
    params = renoise_params(batch, temperature=[0.8, 1.0, 0.5], entropy_bound=[2.0, 0.0, 5.0], seed=[7, 8, 9],
                            step=[0, 3, 11])
    canvas = torch.randint(vocab_size, (batch, width), generator=g)
    positions = torch.arange(width)[None].expand(batch, width) + 4
    for shards in ([(0, 43)], even_split(vocab_size, 2), even_split(vocab_size, 3), [(0, 1), (1, 22), (22, 43)]):
        for finished in (None, torch.tensor([False, True, False])):
            assert check_renoise(logits, canvas, positions, params, shards, finished).all()
    ref = entropy_bound_step(logits, canvas, positions, params)
    assert ref.argmax[0, :3].tolist() == [5, 21, 0]
    assert ref.accepted[1].all()  # entropies of 0 fit any bound


def check_soft_tokens(scaled: torch.Tensor, weight: torch.Tensor, shards: list[tuple[int, int]]):
    vocab_size = scaled.shape[-1]
    model = SimpleNamespace(input_embedding=lambda: SimpleNamespace(weight=weight), vocab_shard=None)
    z_ref, certainty_ref = DiffusionGemma.soft_tokens(model, scaled)
    group = SimulatedGroup(len(shards))

    def step(rank, gather, all_reduce):
        start, end = shards[rank]
        return vocab_parallel_soft_tokens(scaled[..., start:end], weight[start:end], offset=start,
                                          vocab_size=vocab_size, gather=gather, all_reduce=all_reduce)

    for z, certainty in group.run(step):
        assert z.dtype == z_ref.dtype and certainty.dtype == certainty_ref.dtype == torch.float32
        torch.testing.assert_close(certainty, certainty_ref, rtol=0, atol=1e-6)
        if weight.dtype == torch.float32:
            torch.testing.assert_close(z, z_ref, rtol=1e-6, atol=1e-6)
        else:  # p and the sum rounded to the weight's dtype: at most a step of it apart
            torch.testing.assert_close(z.float(), z_ref.float(), rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shards", TINY_VOCABULARY_SHARDS)
def test_soft_tokens(shards, dtype):
    g = torch.Generator().manual_seed(4)
    scaled = torch.randn(2, 16, 43, generator=g) * 4
    scaled[0, 0] = 0.0  # uniform: certainty 0
    scaled[0, 1, :] = -INF  # one possible token: certainty 1
    scaled[0, 1, 7] = 3.0
    check_soft_tokens(scaled, (torch.randn(43, 32, generator=g) * 0.05).to(dtype), shards)


# -- log-probabilities ---------------------------------------------------------------------

def check_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, alternatives: int, mask_id: int,
                         shards: list[tuple[int, int]]):
    """Against log_softmax over the whole vocabulary, in float64: the token's log-probability, and the top
    alternatives with the mask left out (as sets of (id, value) where values tie)."""
    logp = logits.double() - logits.double().logsumexp(-1, keepdim=True)
    chosen_ref = logp.gather(-1, tokens[..., None]).squeeze(-1)
    without_mask = logp.clone()
    without_mask[..., mask_id] = -INF
    ranked = without_mask.sort(dim=-1, descending=True, stable=True)
    group = SimulatedGroup(len(shards))

    def step(rank, gather, all_reduce):
        start, end = shards[rank]
        return vocab.vocab_parallel_token_logprobs(logits[..., start:end], tokens, alternatives, mask_id=mask_id,
                                                   offset=start, vocab_size=logits.shape[-1], gather=gather)

    results = group.run(step)
    for calls in group.calls:
        assert [(op, t.shape[-1], t.dtype) for op, t in calls] == [("all_gather", 4 + 2 * alternatives, torch.float64)]
    for chosen, top_logprob, top_token in results:
        assert all(_same(a, b) for a, b in zip((chosen, top_logprob, top_token), results[0]))
        torch.testing.assert_close(chosen.double(), chosen_ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(top_logprob.double(), ranked.values[..., :alternatives], rtol=0, atol=1e-5)
        # the ids: each is an entry whose log-probability is the value reported, and none is the mask
        assert (top_token != mask_id).all()
        torch.testing.assert_close(logp.gather(-1, top_token), top_logprob.double(), rtol=0, atol=1e-5)
        assert all(len(set(row.tolist())) == alternatives for row in top_token.flatten(0, -2))


@CASES
@given(vocab_size=st.integers(3, 70), world=st.integers(1, 4), uneven=st.booleans(), seed=st.integers(0, 2**31),
       scale=st.sampled_from([0.1, 3.0, 30.0]), alternatives=st.integers(1, 20), mask_first=st.booleans())
def test_random_token_logprobs_match_log_softmax(vocab_size, world, uneven, seed, scale, alternatives, mask_first):
    world, alternatives = min(world, vocab_size), min(alternatives, vocab_size - 1)
    g = torch.Generator().manual_seed(seed)
    shards = random_split(vocab_size, world, g) if uneven else even_split(vocab_size, world)
    mask_id = 0 if mask_first else vocab_size - 1
    logits = torch.randn(2, 5, vocab_size, generator=g) * scale
    logits[0, 0, mask_id] = 100.0  # the most likely token is the mask: never an alternative
    tokens = torch.randint(0, vocab_size, (2, 5), generator=g)
    check_token_logprobs(logits, tokens, alternatives, mask_id, shards)


def test_token_logprobs_of_a_shard_smaller_than_the_alternatives():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(1, 4, 43, generator=g) * 3
    check_token_logprobs(logits, torch.tensor([[2, 5, 40, 42]]), 20, 2, [(0, 1), (1, 3), (3, 30), (30, 43)])


# -- real ranks ----------------------------------------------------------------------------

def _rank_job(ranks, logits, ids, positions, params, shards, mask_id, embedding):
    """On each of `run_ranks`' processes: the step and the residual through Ranks' collectives (gloo)."""
    start, end = shards[ranks.rank]
    vocab_size = logits.shape[-1]
    ranks.count()
    step = vocab_parallel_unmask(logits[..., start:end], ids, positions, params, mask_id=mask_id, offset=start,
                                 vocab_size=vocab_size, gather=ranks.all_gather, confidence="margin")
    step_calls = list(ranks.log.calls)
    ranks.count()
    residual = vocab_parallel_residual(logits[..., start:end], embedding[start:end], offset=start,
                                       vocab_size=vocab_size, gather=ranks.all_gather, all_reduce=ranks.all_reduce)
    return [t.tolist() for t in step], step_calls, [t.tolist() for t in residual], list(ranks.log.calls)


@pytest.mark.slow
def test_on_real_ranks():
    from dlmrt.parallel.launch import run_ranks

    vocab_size, mask_id, batch, width = 43, 2, 3, 8
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(batch, width, vocab_size, generator=g) * 3
    ids, positions = block(batch, width, mask_id, vocab_size)
    params = make_params(batch, count=[1, 2, 3], threshold=[0.2, INF, 0.5], temperature=[0.0, 1.0, 0.5], seed=9)
    embedding = torch.randn(vocab_size, 16, generator=g) * 0.1
    shards = [(0, 15), (15, 30), (30, 43)]
    results = run_ranks(_rank_job, 3, args=(logits, ids, positions, params, shards, mask_id, embedding))
    ref = parallel_unmask(logits, ids, positions, params, mask_id=mask_id, confidence="margin")
    z_ref, certainty_ref = residual_context(logits, embedding)
    for step, step_calls, (z, certainty), residual_calls in results:
        assert step[0] == ref.ids.tolist() and step[2] == ref.commit.tolist() and step[3] == ref.committed.tolist()
        torch.testing.assert_close(torch.tensor(step[1]), ref.confidence, rtol=0, atol=CONFIDENCE_TOLERANCE)
        assert step == results[0][0]  # every rank finishes the step identically
        # Ranks.log records the tensor a rank passes: its share of step_exchange_bytes
        assert step_calls == [("all_gather", step_exchange_bytes(batch, width, 3) // 2)]
        assert [op for op, _ in residual_calls] == ["all_gather", "all_reduce"]
        torch.testing.assert_close(torch.tensor(z), z_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(torch.tensor(certainty), certainty_ref, rtol=0, atol=1e-6)
