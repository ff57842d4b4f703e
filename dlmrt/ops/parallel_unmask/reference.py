"""`dlmrt::ParallelUnmask`: one parallel unmasking step, written once in torch.

Given the logits of a block's positions, the block's current ids and a few
per-row policy parameters, it picks a candidate token for every position,
scores it, and commits some of the still-masked positions:

    x0      = argmax(logits)                     (temperature 0; never the mask token)
            = argmax(exp(logits) / (-log u)^T)   (temperature T > 0, LLaDA's Gumbel-max, float64)
    conf    = p(x0)                 "prob"     (LLaDA low_confidence, Fast-dLLM, LLaDA2)
            = p(top1) - p(top2)     "margin"   (Dream; the two most likely tokens other than the mask)
            = 1 - H(p) / log V      "entropy"  (Dream's negative entropy, rescaled into [0, 1])
            = u                     "random"   (LLaDA random remasking)
    k       = min(masked, max(count, #{conf >= threshold}, factor_prefix))
    commit  = the k most confident masked positions (ties: the earlier position first)

With `edits` (LLaDA2.1's token-to-token editing), a step also overwrites committed tokens:

    edit    = editable & not masked & (x0 != id) & (p(x0) >= edit_threshold)

with p the probability under every confidence measure, `editable` the positions the caller lets
a step change (LLaDA2.1: the block's generated positions, never the prompt or padding) and an
infinite threshold for a row that does not edit. An edit never puts a mask back. LLaDA2.1's
`p > tau_edit` is `strictly_above(tau_edit)`.

`factor_prefix` is Fast-dLLM's factor rule: the longest prefix of the
confidence-sorted masked positions with `(n + 1) * (1 - c_n) < factor`
(n = 1, 2, ...); a factor of 0 turns it off. Every policy is a setting of
(count, threshold, factor): the LLaDA schedule is `count = n_k, threshold = inf`;
Fast-dLLM's threshold rule is `count = 1, threshold = tau`; LLaDA2's rule is
`count = n_k` with a strict `>` threshold (pass `strictly_above(tau)`).

The random numbers are a pure function of (row seed, row step, position,
vocabulary index), a counter-based hash, so sampling does not depend on the
batch, the cache mode, or the device, and a graph can compute the same bits.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

CONFIDENCE_MEASURES = ("prob", "margin", "entropy", "random")
# A graph takes the measure as a per-row int64 input with these codes.
MEASURE_CODES = {measure: code for code, measure in enumerate(CONFIDENCE_MEASURES)}

_MASK32 = 0xFFFFFFFF
# Multipliers below 2**31, so that a 32-bit value times one stays inside int64.
_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)
# Vocabulary index used to draw the "random" confidence, beyond any real token.
_RANDOM_CONFIDENCE_SALT = 0x5BD1E995


class UnmaskParams(NamedTuple):
    """Per-row policy parameters, each `[B]`."""

    count: Tensor  # int64: commit at least this many masked positions (capped at the masked count)
    threshold: Tensor  # float32: also commit every masked position with confidence >= threshold
    factor: Tensor  # float32: also commit Fast-dLLM's factor prefix; 0 turns it off
    temperature: Tensor  # float32: 0 is greedy
    seed: Tensor  # int64
    step: Tensor  # int64: the row's step counter, so each step draws fresh numbers


class EditParams(NamedTuple):
    """Token editing: which committed positions a step may overwrite, and when."""

    threshold: Tensor  # [B] float32: overwrite where p(x0) >= threshold; inf turns editing off
    editable: Tensor  # [B, W] bool


class UnmaskResult(NamedTuple):
    ids: Tensor  # [B, W] the block's ids after committing
    confidence: Tensor  # [B, W] float32, -inf where the position was not masked
    commit: Tensor  # [B, W] bool, the masked positions committed by this step (edits are not counted)
    committed: Tensor  # [B] int64, how many


def strictly_above(threshold: float) -> float:
    """The float32 threshold `t` with `c >= t` exactly when `c > threshold` (for float32 c)."""
    value = torch.tensor(threshold, dtype=torch.float32)
    return float(torch.nextafter(value, torch.tensor(math.inf)))


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finalizer (xorshift-multiply) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * _MULTIPLIERS[0]) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MULTIPLIERS[1]) & _MASK32
    return x ^ (x >> 16)


def uniform(seed: Tensor, step: Tensor, positions: Tensor, index: Tensor) -> Tensor:
    """float64 numbers in (0, 1), `[B, W, *index.shape]`, from (seed [B], step [B], positions [B, W])."""
    h = _mix32(seed & _MASK32)
    h = _mix32(h ^ (step & _MASK32))
    h = _mix32(h[:, None] ^ (positions & _MASK32))
    h = _mix32(h.view(*h.shape, *([1] * index.dim())) ^ index)
    return (h.to(torch.float64) + 0.5) / 2.0**32


def _without_token(scores: Tensor, token: int, value: float) -> Tensor:
    """A copy of `scores [..., V]` with vocabulary entry `token` set to `value`. Built from device ops
    only (no tensor made on the host), so that a CUDA graph can capture it."""
    scores = scores.clone()
    scores[..., token] = value
    return scores


def candidate_scores(logits: Tensor, params: UnmaskParams, positions: Tensor, mask_id: int,
                     sampling: bool | None = None, offset: int = 0) -> Tensor:
    """The scores `[B, W, n]` whose argmax (the first maximum) is x0: the logits with the mask token at
    -inf (float32), or in float64 where `sampling`, the Gumbel-max scores of rows with temperature > 0
    and the logits of the others. `logits` may be the slice of the vocabulary starting at `offset`
    (a rank's shard): the noise is drawn with the global vocabulary indices and `mask_id` is global,
    so that a slice's scores are those of the whole vocabulary's, entry for entry."""
    vocab = logits.shape[-1]
    if 0 <= mask_id - offset < vocab:
        logits = _without_token(logits, mask_id - offset, float("-inf"))
    temperature = params.temperature
    if sampling is None:
        sampling = bool((temperature > 0).any())
    if not sampling:
        return logits
    index = torch.arange(offset, offset + vocab, device=logits.device)
    noise = uniform(params.seed, params.step, positions, index)
    t = temperature.to(torch.float64)[:, None, None]
    scores = logits.to(torch.float64).exp() / (-torch.log(noise)) ** t
    return torch.where(t > 0, scores, logits.to(torch.float64))


def candidates(logits: Tensor, params: UnmaskParams, positions: Tensor, mask_id: int,
               sampling: bool | None = None) -> Tensor:
    """x0 `[B, W]`: the argmax, or a Gumbel-max sample for rows with temperature > 0. The mask token
    is never a candidate: committing it would leave the position masked. `sampling=False` promises
    that every temperature is 0 (skipping the noise without reading the temperatures back)."""
    return candidate_scores(logits, params, positions, mask_id, sampling).argmax(-1)


def random_confidence(params: UnmaskParams, positions: Tensor) -> Tensor:
    """float32 `[B, W]`: the "random" confidence, which does not depend on the logits."""
    salt = torch.full((), _RANDOM_CONFIDENCE_SALT, dtype=torch.long, device=positions.device)
    u = uniform(params.seed, params.step, positions, salt)
    # 23 bits, so that the float32 value is exact and stays below 1
    return ((torch.floor(u * 2.0**23) + 0.5) / 2.0**23).to(torch.float32)


def confidence_of(logits: Tensor, x0: Tensor, measure: str | Tensor, params: UnmaskParams, positions: Tensor,
                  mask_id: int) -> Tensor:
    """float32 `[B, W]` confidence of each candidate; `measure` is a name for every row, or each row's
    code (MEASURE_CODES) as an int64 tensor `[B]`."""
    if isinstance(measure, Tensor):
        per_row = torch.empty(x0.shape, dtype=torch.float32, device=x0.device)
        for name, code in MEASURE_CODES.items():
            rows = measure == code
            per_row = torch.where(rows[:, None], confidence_of(logits, x0, name, params, positions, mask_id),
                                  per_row)
        return per_row
    if measure == "random":
        return random_confidence(params, positions)
    logp = F.log_softmax(logits, dim=-1)
    p = logp.exp()
    if measure == "prob":
        return p.gather(-1, x0[..., None]).squeeze(-1)
    if measure == "margin":  # between the two most likely tokens that could be committed
        top = _without_token(p, mask_id, 0.0).topk(2, dim=-1).values
        return top[..., 0] - top[..., 1]
    if measure == "entropy":
        entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
        return 1.0 - entropy / math.log(logits.shape[-1])
    raise ValueError(f"unknown confidence measure {measure!r} (known: {', '.join(CONFIDENCE_MEASURES)})")


def commit_count(ranked: Tensor, masked: Tensor, params: UnmaskParams) -> Tensor:
    """k `[B]`: how many masked positions to commit, from the confidences sorted in descending
    order (`-inf` for unmasked positions, which sort last) and the masked count `[B]`."""
    above = (ranked >= params.threshold[:, None]).sum(-1)
    n = torch.arange(1, ranked.shape[-1] + 1, device=ranked.device)
    accepted = (n + 1) * (1 - ranked) < params.factor[:, None]
    factor_prefix = accepted.long().cumprod(-1).sum(-1)
    wanted = torch.maximum(params.count, torch.maximum(above, factor_prefix))
    return torch.minimum(masked, wanted)


def candidate_probability(logits: Tensor, x0: Tensor) -> Tensor:
    """float32 `[B, W]`: p(x0), what token editing compares with its threshold."""
    return F.softmax(logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1)


def edit_rule(ids: Tensor, x0: Tensor, probability: Tensor, edits: EditParams, mask_id: int) -> Tensor:
    """`[B, W]` bool: the committed positions a step overwrites with x0, given p(x0) `[B, W]`."""
    return edits.editable & (ids != mask_id) & (x0 != ids) & (probability >= edits.threshold[:, None])


def commit_step(ids: Tensor, x0: Tensor, confidence: Tensor, params: UnmaskParams, *, mask_id: int,
                edits: EditParams | None = None, probability: Tensor | None = None) -> UnmaskResult:
    """The step's decision, from each position's candidate x0 and its confidence `[B, W]` (float32):
    the k most confident masked positions take x0, and with `edits` the committed positions that
    `edit_rule` picks (given `probability`, p(x0) `[B, W]`). Every form of the step (this module's
    `parallel_unmask`, the vocabulary-parallel step of `dlmrt.parallel.vocab`) ends here."""
    is_masked = ids == mask_id
    conf = torch.where(is_masked, confidence, float("-inf"))
    ranked, order = conf.sort(dim=-1, descending=True, stable=True)
    k = commit_count(ranked, is_masked.sum(-1), params)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(ids.shape[-1], device=ids.device)
                                            .expand_as(order))
    commit = (rank < k[:, None]) & is_masked
    if edits is not None:
        if probability is None:
            raise ValueError("token editing needs p(x0) (`probability`)")
        changed = commit | edit_rule(ids, x0, probability, edits, mask_id)
    else:
        changed = commit
    return UnmaskResult(torch.where(changed, x0, ids), conf, commit, k)


def parallel_unmask(logits: Tensor, ids: Tensor, positions: Tensor, params: UnmaskParams, *,
                    mask_id: int, confidence: str | Tensor = "prob", sampling: bool | None = None,
                    edits: EditParams | None = None) -> UnmaskResult:
    """One step: logits `[B, W, V]` (float32), ids and positions `[B, W]`, params `[B]` each.
    `sampling`: whether any row has temperature > 0, when the caller knows (saves a device sync).
    `edits`: token editing (None: a step never changes a committed token)."""
    x0 = candidates(logits, params, positions, mask_id, sampling)
    conf = confidence_of(logits, x0, confidence, params, positions, mask_id)
    probability = None if edits is None else candidate_probability(logits, x0)
    return commit_step(ids, x0, conf, params, mask_id=mask_id, edits=edits, probability=probability)
