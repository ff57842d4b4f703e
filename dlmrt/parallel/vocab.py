"""The vocabulary-parallel unmasking step and ORL residual: the step's decisions from a sharded LM head.

With tensor parallelism the LM head is vocabulary-parallel: rank r holds the logits of its
contiguous slice [offset_r, offset_r + n_r) of the vocabulary only (slices may be uneven; each holds
at least one entry). The step never gathers the `[B, W, V]` logits. Each rank reduces its shard to
`STAT_COUNT` float64 numbers per position (`shard_statistics`), one all_gather exchanges them, and
every rank finishes the step identically from the gathered `[R, B, W, STAT_COUNT]` (`combine`, then
the reference's own `commit_step`):

    max_logit       m_r = max_v l_v                           (every entry, the mask token too)
    sum_exp         S_r = sum_v exp(l_v - m_r)
    sum_exp_logit   A_r = sum_v exp(l_v - m_r) (l_v - m_r)      (0 log 0 = 0)
    score, index    the shard's best candidate: its score under `candidate_scores` (the reference's
                    argmax or Gumbel-max scores, the noise drawn with global vocabulary indices) and
                    its global vocabulary index (exact in float64 below 2**53)
    candidate_logit l_x0 of that candidate
    top1, top2      the two largest logits other than the mask token (-inf where there are fewer)

Combined, with M = max_r m_r:  S = sum_r exp(m_r - M) S_r,  log Z = M + log S,
H = log S - sum_r exp(m_r - M) (A_r + (m_r - M) S_r) / S,  p(x0) = exp(l_x0 - M) / S,
margin = (exp(top1 - M) - exp(top2 - M)) / S over the two largest of every shard's top1, top2.
x0 is the candidate of the shard with the highest score, the lowest rank among equal ones: the
shards are contiguous and in rank order, so that is the first maximum over the whole vocabulary,
`argmax`'s tie rule in the reference.

The candidate is bit for bit the reference's (the scores are the same function of each entry). The
confidences are computed in float64 and rounded once to float32, so they equal the reference's
float32 values to float32 rounding (not always bit for bit); a commit or an edit can differ from the
reference's only where a confidence lies within that rounding of another, of a threshold or of the
factor rule's boundary, as the reference's own CPU and CUDA results can.

The ORL residual (`vocab_parallel_residual`) exchanges the first three statistics over the window
and sums each rank's share of z = softmax(l) @ E with one all_reduce of `[B, T, H]`.

DiffusionGemma's uniform-noise step (`vocab_parallel_entropy_bound_step`, the reference's
`entropy_bound_step`) exchanges RENOISE_STAT_COUNT statistics of the scaled logits per position (the
normalizer's three, the argmax and the Gumbel-max sample of each shard, value and global index) and
ends in the reference's `renoise`; its self-conditioning (`vocab_parallel_soft_tokens`, the family's
`soft_tokens`) is computed like the ORL residual.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from dlmrt.ops.entropy_bound.reference import RenoiseParams, RenoiseResult, gumbel_scores, renoise, scale
from dlmrt.ops.parallel_unmask.reference import (CONFIDENCE_MEASURES, MEASURE_CODES, EditParams, UnmaskParams,
                                                     UnmaskResult, candidate_scores, commit_step, random_confidence)

if TYPE_CHECKING:
    from dlmrt.models.residual import Residual

# The statistics of one position of one shard, in this order along the last axis.
STATS = ("max_logit", "sum_exp", "sum_exp_logit", "score", "index", "candidate_logit", "top1", "top2")
STAT_COUNT = len(STATS)
_MAX, _SUM, _SUM_LOGIT, _SCORE, _INDEX, _CANDIDATE, _TOP1, _TOP2 = range(STAT_COUNT)
# The residual exchanges the normalizer's statistics only (the first three).
NORMALIZER_STAT_COUNT = 3

Gather = Callable[[Tensor], Tensor]  # t [*shape] -> every rank's t, stacked in rank order: [R, *shape]
AllReduce = Callable[[Tensor], Tensor]  # t -> the sum of t over the ranks


class Combined(NamedTuple):
    """What every rank knows after the exchange, per position `[B, W]`."""

    x0: Tensor  # int64: the candidate, as the reference's `candidates` picks it
    log_normalizer: Tensor  # float64: log sum_v exp(l_v), over the whole vocabulary
    probability: Tensor  # float64: p(x0)
    margin: Tensor  # float64: p(top1) - p(top2), the two most likely tokens other than the mask
    entropy: Tensor  # float64: H(p) in nats


def _check_shard(size: int, offset: int, vocab_size: int) -> None:
    if size < 1 or offset < 0 or offset + size > vocab_size:
        raise ValueError(f"a vocabulary shard of {size} entries at offset {offset} does not fit a vocabulary "
                         f"of {vocab_size} (each rank holds at least one entry)")


def _normalizer_statistics(logits: Tensor) -> Tensor:
    """float64 `[..., 3]`: (m, S, A) of a shard `[..., n]` (see the module's docstring)."""
    logits = logits.to(torch.float64)
    top = logits.amax(-1, keepdim=True)
    shift = torch.where(top == float("-inf"), torch.zeros_like(top), top)  # a shard of -inf only: S = A = 0
    centred = logits - shift
    e = centred.exp()
    sum_exp = e.sum(-1)
    sum_exp_logit = torch.where(e > 0, e * centred, torch.zeros_like(e)).sum(-1)  # 0 * -inf is 0
    return torch.stack([top.squeeze(-1), sum_exp, sum_exp_logit], dim=-1)


class _Normalizer(NamedTuple):
    shift: Tensor  # M (0 where every logit is -inf)
    sum_exp: Tensor  # S = sum_v exp(l_v - M)
    entropy: Tensor  # H


def _combine_normalizer(stats: Tensor) -> _Normalizer:
    """M, S and H from the gathered `[R, ..., >= 3]` statistics of every shard."""
    top, sum_exp, sum_exp_logit = stats[..., _MAX], stats[..., _SUM], stats[..., _SUM_LOGIT]
    highest = top.amax(0)
    shift = torch.where(highest == float("-inf"), torch.zeros_like(highest), highest)
    local_shift = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    rescale = (top - shift).exp()  # 0 for a shard of -inf only
    total = (rescale * sum_exp).sum(0)
    weighted = (rescale * (sum_exp_logit + (local_shift - shift) * sum_exp)).sum(0)  # sum_v e_v (l_v - M)
    return _Normalizer(shift, total, total.log() - weighted / total)


def shard_statistics(logits: Tensor, offset: int, vocab_size: int, mask_id: int, params: UnmaskParams,
                     positions: Tensor, sampling: bool | None = None) -> Tensor:
    """float64 `[B, W, STAT_COUNT]`: what the step needs of a rank's logits shard `[B, W, n]` (float32), the
    vocabulary entries [offset, offset + n) of `vocab_size`. `mask_id` is a global index (in one shard
    at most); `sampling` as for `parallel_unmask` (None: whether any temperature is > 0)."""
    _check_shard(logits.shape[-1], offset, vocab_size)
    scores = candidate_scores(logits, params, positions, mask_id, sampling, offset)
    best = scores.argmax(-1, keepdim=True)  # the first maximum, as the reference's argmax
    score = scores.gather(-1, best).squeeze(-1).to(torch.float64)
    wide = logits.to(torch.float64)
    candidate_logit = wide.gather(-1, best).squeeze(-1)
    local_mask = mask_id - offset
    if 0 <= local_mask < logits.shape[-1]:
        wide = wide.clone()
        wide[..., local_mask] = float("-inf")
    if logits.shape[-1] >= 2:
        top = wide.topk(2, dim=-1).values
    else:
        top = torch.cat([wide, torch.full_like(wide, float("-inf"))], dim=-1)
    index = (best.squeeze(-1) + offset).to(torch.float64)
    return torch.cat([_normalizer_statistics(logits),
                      torch.stack([score, index, candidate_logit, top[..., 0], top[..., 1]], dim=-1)], dim=-1)


def combine(stats: Tensor) -> Combined:
    """The step's per-position quantities from every rank's statistics `[R, B, W, STAT_COUNT]` (rank order)."""
    normalizer = _combine_normalizer(stats)
    winner = stats[..., _SCORE].argmax(0, keepdim=True)  # equal scores: the lowest rank, the lowest index
    x0 = stats[..., _INDEX].gather(0, winner).squeeze(0).to(torch.long)
    candidate_logit = stats[..., _CANDIDATE].gather(0, winner).squeeze(0)
    shift, total = normalizer.shift, normalizer.sum_exp
    tops = stats[..., _TOP1:_TOP2 + 1].movedim(0, -2).flatten(-2)  # [B, W, 2R]
    top = tops.topk(2, dim=-1).values
    margin = ((top[..., 0] - shift).exp() - (top[..., 1] - shift).exp()) / total
    return Combined(x0=x0, log_normalizer=shift + total.log(), probability=(candidate_logit - shift).exp() / total,
                    margin=margin, entropy=normalizer.entropy)


def combined_confidence(combined: Combined, measure: str | Tensor, params: UnmaskParams, positions: Tensor,
               vocab_size: int) -> Tensor:
    """float32 `[B, W]`: the reference's `confidence_of`, from the combined statistics. `measure`: a name,
    or each row's code (MEASURE_CODES) as an int64 tensor `[B]` (NaN for a row with an unknown code)."""
    if isinstance(measure, Tensor):
        per_row = torch.full(combined.x0.shape, float("nan"), dtype=torch.float32, device=combined.x0.device)
        for name, code in MEASURE_CODES.items():
            measured = combined_confidence(combined, name, params, positions, vocab_size)
            per_row = torch.where((measure == code)[:, None], measured, per_row)
        return per_row
    if measure == "random":
        return random_confidence(params, positions)
    if measure == "prob":
        return combined.probability.to(torch.float32)
    if measure == "margin":
        return combined.margin.to(torch.float32)
    if measure == "entropy":
        return (1.0 - combined.entropy / math.log(vocab_size)).to(torch.float32)
    raise ValueError(f"unknown confidence measure {measure!r} (known: {', '.join(CONFIDENCE_MEASURES)})")


def step_exchange_bytes(batch: int, width: int, world: int) -> int:
    """The bytes a rank sends to the other ranks in a step's one all_gather, which is also what it
    receives from them: its `[B, W, STAT_COUNT]` float64 statistics to each of the world - 1 others
    (0 on one rank). The tensor a rank passes to the all_gather (what `Ranks.log` records) is
    `step_exchange_bytes(B, W, world) / (world - 1)` = 8 * STAT_COUNT * B * W bytes."""
    return (world - 1) * batch * width * STAT_COUNT * 8


def vocab_parallel_unmask(logits: Tensor, ids: Tensor, positions: Tensor, params: UnmaskParams, *, mask_id: int,
                          offset: int, vocab_size: int, gather: Gather, confidence: str | Tensor = "prob",
                          sampling: bool | None = None, edits: EditParams | None = None) -> UnmaskResult:
    """`parallel_unmask` of the whole vocabulary's logits, on a rank holding the shard `[B, W, n]` at
    `offset` of `vocab_size`: the same ids, commit and committed on every rank, the confidences to
    float32 rounding (see the module's docstring). `gather` is the rank group's all_gather (in rank
    order, `Ranks.all_gather`); the step calls it once, with `[B, W, STAT_COUNT]` float64."""
    stats = shard_statistics(logits, offset, vocab_size, mask_id, params, positions, sampling)
    combined = combine(gather(stats))
    conf = combined_confidence(combined, confidence, params, positions, vocab_size)
    probability = None if edits is None else combined.probability.to(torch.float32)
    return commit_step(ids, combined.x0, conf, params, mask_id=mask_id, edits=edits, probability=probability)



def vocab_parallel_token_logprobs(logits: Tensor, tokens: Tensor, alternatives: int, *, mask_id: int, offset: int,
                                  vocab_size: int, gather: Gather) -> tuple[Tensor, Tensor, Tensor]:
    """`log_softmax` over the whole vocabulary, read as the step's logprobs are (`device_step.token_logprobs`),
    on a rank holding the shard `[B, W, n]` at `offset` of `vocab_size`: each position's log-probability of
    `tokens [B, W]` (float32), and its `alternatives` most likely tokens other than the mask, their
    log-probabilities (float32) and ids (int64), most likely first. One all_gather of `[B, W, 4 + 2K]` float64:
    the normalizer's statistics, the token's logit where this shard holds it, and this shard's K best."""
    n = logits.shape[-1]
    _check_shard(n, offset, vocab_size)
    wide = logits.to(torch.float64)
    local = tokens - offset
    held = (local >= 0) & (local < n)
    token_logit = torch.where(held, wide.gather(-1, local.clamp(0, n - 1)[..., None]).squeeze(-1), float("-inf"))
    if offset <= mask_id < offset + n:  # never an alternative
        wide = wide.index_fill(-1, torch.tensor([mask_id - offset], device=wide.device), float("-inf"))
    best = wide.topk(min(alternatives, n), dim=-1)
    missing = alternatives - best.values.shape[-1]  # a shard smaller than K: padding that never wins
    values = torch.nn.functional.pad(best.values, (0, missing), value=float("-inf"))
    ids = torch.nn.functional.pad((best.indices + offset).to(torch.float64), (0, missing), value=-1.0)
    gathered = gather(torch.cat([_normalizer_statistics(logits), token_logit[..., None], values, ids], dim=-1))
    normalizer = _combine_normalizer(gathered)
    log_normalizer = normalizer.shift + normalizer.sum_exp.log()
    every_value = gathered[..., 4:4 + alternatives].movedim(0, -2).flatten(-2)  # [B, W, R * K]
    every_id = gathered[..., 4 + alternatives:].movedim(0, -2).flatten(-2)
    top = every_value.topk(alternatives, dim=-1)
    chosen = gathered[..., 3].amax(0) - log_normalizer
    return (chosen.to(torch.float32), (top.values - log_normalizer[..., None]).to(torch.float32),
            every_id.gather(-1, top.indices).to(torch.long))


def _mixture(logits: Tensor, embedding: Tensor, offset: int, vocab_size: int, gather: Gather, all_reduce: AllReduce,
             p_dtype: torch.dtype) -> tuple[Tensor, _Normalizer]:
    """sum_v p_v E_v `[B, T, H]` float32 over the whole vocabulary (p = softmax(logits) rounded to `p_dtype`,
    as the reference rounds it before its matmul) and the normalizer, from a rank's shards."""
    _check_shard(logits.shape[-1], offset, vocab_size)
    if embedding.shape[0] != logits.shape[-1]:
        raise ValueError(f"the embedding shard has {embedding.shape[0]} rows for {logits.shape[-1]} logits")
    normalizer = _combine_normalizer(gather(_normalizer_statistics(logits)))
    p = (logits.to(torch.float64) - normalizer.shift[..., None]).exp() / normalizer.sum_exp[..., None]
    return all_reduce(p.to(p_dtype).float() @ embedding.float()), normalizer


def vocab_parallel_residual(logits: Tensor, embedding: Tensor, *, offset: int, vocab_size: int, gather: Gather,
                            all_reduce: AllReduce) -> Residual:
    """`residual_context` (the ORL residual) of the whole vocabulary, on a rank holding the logits shard
    `[B, T, n]` at `offset` of `vocab_size` and the embedding rows of the same slice `[n, H]`: z `[B, T, H]`
    and certainty `[B, T]` in the embedding's dtype. One all_gather of `[B, T, 3]` float64, then one
    all_reduce (a sum) of this rank's share of z, `[B, T, H]` float32."""
    from dlmrt.models.residual import Residual  # here: the model families may import this module

    z, normalizer = _mixture(logits, embedding, offset, vocab_size, gather, all_reduce, torch.float32)
    certainty = (1.0 - normalizer.entropy / math.log(vocab_size)).clamp(0.0, 1.0)
    return Residual(z.to(embedding.dtype), certainty.to(torch.float32).to(embedding.dtype))


# -- DiffusionGemma's uniform-noise step ---------------------------------------------------------

# The statistics of one position of one shard for the entropy-bound step, in this order.
RENOISE_STATS = ("max_logit", "sum_exp", "sum_exp_logit", "argmax_value", "argmax_index", "sample_score",
                 "sample_index")
RENOISE_STAT_COUNT = len(RENOISE_STATS)
_ARGMAX_VALUE, _ARGMAX_INDEX, _SAMPLE_SCORE, _SAMPLE_INDEX = range(NORMALIZER_STAT_COUNT, RENOISE_STAT_COUNT)


def _best(scores: Tensor, offset: int) -> tuple[Tensor, Tensor]:
    """The first maximum of `scores [..., n]` as (its value, its global index), both float64 `[...]`."""
    best = scores.argmax(-1, keepdim=True)
    return scores.gather(-1, best).squeeze(-1).to(torch.float64), (best.squeeze(-1) + offset).to(torch.float64)


def _winner(stats: Tensor, value: int, index: int) -> Tensor:
    """int64 `[...]`: the global index of the best of every shard's best (equal values: the lowest rank)."""
    return stats[..., index].gather(0, stats[..., value].argmax(0, keepdim=True)).squeeze(0).to(torch.long)


def renoise_statistics(logits: Tensor, offset: int, vocab_size: int, params: RenoiseParams,
                       positions: Tensor) -> tuple[Tensor, Tensor]:
    """(float64 `[B, W, RENOISE_STAT_COUNT]`, the scaled logits shard): what `entropy_bound_step` needs of a
    rank's logits shard `[B, W, n]` (float32) at `offset` of `vocab_size`: the normalizer's statistics of
    the scaled logits, their argmax and the Gumbel-max sample of the shard (values and global indices)."""
    _check_shard(logits.shape[-1], offset, vocab_size)
    scaled = scale(logits, params)
    argmax = _best(scaled, offset)
    sample = _best(gumbel_scores(scaled, params.seed, params.step, positions, offset), offset)
    return torch.cat([_normalizer_statistics(scaled), torch.stack([*argmax, *sample], dim=-1)], dim=-1), scaled


def renoise_exchange_bytes(batch: int, width: int, world: int) -> int:
    """As `step_exchange_bytes`, for `vocab_parallel_entropy_bound_step`'s one all_gather."""
    return (world - 1) * batch * width * RENOISE_STAT_COUNT * 8


def vocab_parallel_entropy_bound_step(logits: Tensor, canvas: Tensor, positions: Tensor, params: RenoiseParams, *,
                                      offset: int, vocab_size: int, gather: Gather,
                                      finished: Tensor | None = None) -> RenoiseResult:
    """`entropy_bound_step` of the whole vocabulary's logits, on a rank holding the shard `[B, W, n]` at
    `offset` of `vocab_size`, with one all_gather of `[B, W, RENOISE_STAT_COUNT]` float64. The canvas,
    argmax, accepted positions and mean entropy are every rank's alike; `scaled_logits` is this rank's
    shard of the reference's `[B, W, n]` (what `vocab_parallel_soft_tokens` takes). The argmax and the
    sample are the reference's bit for bit, the entropies equal to float32 rounding: the accepted set can
    differ only where a sum of entropies lies within that rounding of the bound (or two entropies of
    each other)."""
    stats, scaled = renoise_statistics(logits, offset, vocab_size, params, positions)
    gathered = gather(stats)
    token_entropy = _combine_normalizer(gathered).entropy.to(torch.float32)
    return renoise(token_entropy, _winner(gathered, _SAMPLE_SCORE, _SAMPLE_INDEX),
                   _winner(gathered, _ARGMAX_VALUE, _ARGMAX_INDEX), scaled, canvas, positions, params, vocab_size,
                   finished)


def vocab_parallel_soft_tokens(scaled_logits: Tensor, weight: Tensor, *, offset: int, vocab_size: int,
                               gather: Gather, all_reduce: AllReduce) -> Residual:
    """DiffusionGemma's `soft_tokens` (its self-conditioning: z = softmax(scaled logits) @ E in E's dtype,
    certainty 1 - H / log V in float32, not clamped) from a rank's shard of the scaled logits `[B, T, n]`
    at `offset` and the embedding rows of the same slice `[n, H]`; one all_gather of `[B, T, 3]` float64
    and one all_reduce of `[B, T, H]` float32."""
    from dlmrt.models.residual import Residual

    z, normalizer = _mixture(scaled_logits, weight, offset, vocab_size, gather, all_reduce, weight.dtype)
    certainty = (1.0 - normalizer.entropy / math.log(vocab_size)).to(torch.float32)
    return Residual(z.to(weight.dtype), certainty)
