"""`dlmrt::EntropyBoundStep`: one DiffusionGemma denoising step, written once in torch.

DiffusionGemma has no mask token. A block (its "canvas") starts as uniform random tokens; every
step reads the decoder's logits for the whole canvas, scales them by a temperature schedule,
samples every position, keeps the positions whose entropies fit under a bound and refills the
others with fresh random tokens:

    z       = logits / T_s                       T_s = t_min + (t_max - t_min) * (N - s) / N, s = 0..N-1
    H_i     = -sum_v p_iv log p_iv,  p_i = softmax(z_i)        (0 log 0 = 0)
    x_i     = argmax_v (z_iv - log(-log u_iv))                 (Gumbel-max, float64)
    order   = positions by ascending H (ties: the earlier position first)
    accept  = the j-th of `order` while H_(0) + ... + H_(j-1) <= bound       (so always at least one)
    next_i  = x_i where accepted, else floor(u'_i * V)          (a fresh uniform token)

The argmax of z is the block's draft; a row stops once its argmax has not changed for S steps and
the mean of H over the block is below a confidence threshold. When a block is done, every position
after its first EOS becomes pad (a row that finished in an earlier block: all of it).

Where this departs from the public code (transformers' generation_diffusion_gemma.py), and why:

- Random numbers: `uniform` of `dlmrt.ops.parallel_unmask`, a counter-based hash of (row seed,
  row step counter, position, index), instead of torch.randint and torch.multinomial on a global
  generator. A seed gives the same tokens on every backend, for every batch it is part of and in a
  captured graph. The sample at step counter s uses the indices 0..V-1 at counter s; the refill
  after step s uses the index `RANDOM_TOKEN_SALT` at counter s + 1, and the block's first canvas
  the same index at counter 0, so no two draws of a block share their numbers (and the positions,
  absolute ones, tell the blocks apart).
- Ties in entropy: a stable sort, so the earlier position is accepted first (torch.sort without
  `stable=True`, as the public code calls it, leaves the order of ties unspecified).
- The sums of entropies before each sorted position are taken in float64 (exact for a few float32
  values of similar size) and compared with the float32 bound, so that the result does not depend
  on how a backend orders a float32 scan. The public code compares cumsum - H in float32 (its
  cumsum accumulates in float64 on the CPU and float32 on CUDA); the two differ only where the bound
  lies within float32 rounding of such a sum. The entropies themselves come from log_softmax (the
  public code uses torch.distributions.Categorical): the same to float32 rounding.
- Stability: a per-row count of consecutive steps with an unchanged argmax instead of the last S
  argmax canvases; the same rule (see `stability`) in O(B*W) state instead of O(S*B*W).
- The schedule is computed once on the host (`temperature_schedule`), in float32 as the public
  generate loop computes it on the CPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from dlmrt.ops.parallel_unmask.reference import uniform

# Index under which a position draws its uniform random token: beyond any vocabulary (< 2**32), and not
# parallel_unmask's `_RANDOM_CONFIDENCE_SALT` (0x5BD1E995).
RANDOM_TOKEN_SALT = 0x1B873593


class RenoiseParams(NamedTuple):
    """Per-row step parameters, each `[B]`."""

    temperature: Tensor  # float32, > 0: the schedule's value for the row's step (`temperature_schedule`)
    entropy_bound: Tensor  # float32, >= 0: accept while the entropies before a position sum to at most this
    seed: Tensor  # int64
    step: Tensor  # int64: the row's step counter in its block, 0 on the first step (which sees `initial_canvas`)


class RenoiseResult(NamedTuple):
    canvas: Tensor  # [B, W] int64: the canvas the next step sees (accepted samples, fresh tokens elsewhere)
    argmax: Tensor  # [B, W] int64: the argmax of the scaled logits (the block's draft)
    scaled_logits: Tensor  # [B, W, V] float32: logits / temperature (DiffusionGemma's next self-conditioning)
    accepted: Tensor  # [B, W] bool: the positions that kept their sample
    mean_entropy: Tensor  # [B] float32: the mean over positions of the entropy of softmax(scaled_logits)


def temperature_schedule(t_min: float, t_max: float, steps: int) -> Tensor:
    """`[steps]` float32: the temperature of step i (0-based, the first step i = 0) of a block.

    The public rule reads the steps remaining, r = steps - i (steps down to 1):
    t_min + (t_max - t_min) * r / steps. So the first step uses t_max (up to float32 rounding: it
    is t_min + (t_max - t_min), which need not round back to float32(t_max)) and the last one
    t_min + (t_max - t_min) / steps, never t_min itself.

    Bit for bit the values of the public generate loop, which passes r as an int32 tensor, so that
    the rule runs as three float32 operations (each correctly rounded): q = r / steps, then
    float32(t_max - t_min) * q, then float32(t_min) + that, with t_max - t_min taken in Python
    floats. Evaluated in float64 and rounded once, about a quarter of the defaults' values
    (0.4, 0.8, 48) would be one float32 ulp off. They are computed here on the CPU, where those
    operations are IEEE float32; on CUDA the public loop multiplies r by float32(1 / steps) instead
    of dividing, which may round differently.
    """
    if steps <= 0:
        raise ValueError(f"steps must be positive (got {steps})")
    remaining = torch.arange(steps, 0, -1, dtype=torch.float32, device="cpu")  # exact below 2**24
    span = torch.tensor(t_max - t_min, dtype=torch.float32)
    low = torch.tensor(t_min, dtype=torch.float32)
    return low + span * (remaining / torch.tensor(float(steps), dtype=torch.float32))


def random_tokens(seed: Tensor, step: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """`[B, W]` int64 tokens, uniform over the vocabulary, from (seed [B], step [B], positions [B, W])."""
    salt = torch.full((), RANDOM_TOKEN_SALT, dtype=torch.long, device=positions.device)
    u = uniform(seed, step, positions, salt)
    return torch.floor(u * vocab_size).to(torch.long).clamp_(max=vocab_size - 1)


def initial_canvas(seed: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """The canvas a block's first step sees: random tokens at step counter 0."""
    return random_tokens(seed, torch.zeros_like(seed), positions, vocab_size)


def entropy(scaled_logits: Tensor) -> Tensor:
    """`[..., W]` float32 entropy of softmax over the last axis; impossible tokens (-inf) add 0."""
    logp = F.log_softmax(scaled_logits, dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


def accept_by_entropy(token_entropy: Tensor, entropy_bound: Tensor) -> Tensor:
    """`[B, W]` bool: the positions taken by ascending entropy (ties: the earlier first) while the
    entropies taken before a position sum to at most `entropy_bound [B]` (inclusive)."""
    ranked, order = token_entropy.sort(dim=-1, stable=True)
    total = ranked.to(torch.float64).cumsum(-1)
    before = F.pad(total[..., :-1], (1, 0))  # the sum over the positions sorted before each one
    take = before <= entropy_bound.to(torch.float64)[:, None]
    return torch.zeros_like(take).scatter(-1, order, take)


def gumbel_scores(scaled_logits: Tensor, seed: Tensor, step: Tensor, positions: Tensor, offset: int = 0) -> Tensor:
    """float64 `[B, W, n]`: the Gumbel-max scores z_v - log(-log u_v), whose argmax (the first maximum) is
    the sample. `scaled_logits` may be the slice of the vocabulary starting at `offset` (a rank's shard):
    the noise is drawn with the global vocabulary indices, so a slice's scores are the whole vocabulary's."""
    vocab = torch.arange(offset, offset + scaled_logits.shape[-1], device=scaled_logits.device)
    u = uniform(seed, step, positions, vocab)
    return scaled_logits.to(torch.float64) - torch.log(-torch.log(u))


def gumbel_sample(scaled_logits: Tensor, seed: Tensor, step: Tensor, positions: Tensor) -> Tensor:
    """`[B, W]` int64: a sample from softmax(scaled_logits) by Gumbel-max in float64."""
    return gumbel_scores(scaled_logits, seed, step, positions).argmax(-1)


def scale(logits: Tensor, params: RenoiseParams) -> Tensor:
    """The step's logits `[B, W, n]` divided by each row's temperature (float32)."""
    return logits / params.temperature[:, None, None]


def renoise(token_entropy: Tensor, sample: Tensor, argmax: Tensor, scaled_logits: Tensor, canvas: Tensor,
            positions: Tensor, params: RenoiseParams, vocab_size: int, finished: Tensor | None = None
            ) -> RenoiseResult:
    """The step's decision, from each position's entropy `[B, W]` (float32), sample and argmax `[B, W]`:
    which samples the next canvas keeps, and fresh tokens for the others. Every form of the step (this
    module's `entropy_bound_step`, the vocabulary-parallel one of `dlmrt.parallel.vocab`) ends here."""
    accepted = accept_by_entropy(token_entropy, params.entropy_bound)
    refill = random_tokens(params.seed, params.step + 1, positions, vocab_size)
    next_canvas = torch.where(accepted, sample, refill)
    if finished is not None:
        accepted = accepted & ~finished[:, None]
        next_canvas = torch.where(finished[:, None], canvas, next_canvas)
    return RenoiseResult(next_canvas, argmax, scaled_logits, accepted, token_entropy.mean(-1))


def entropy_bound_step(logits: Tensor, canvas: Tensor, positions: Tensor, params: RenoiseParams, *,
                       finished: Tensor | None = None) -> RenoiseResult:
    """One step: logits `[B, W, V]` float32 for the canvas `[B, W]` int64 the decoder read, the
    positions `[B, W]` int64 of the block, params `[B]` each.

    The next canvas does not depend on `canvas` (every position is either accepted or refilled);
    `canvas` is what a row in `finished [B]` (a row that stopped already) keeps, accepting nothing,
    as the public loop keeps a stopped row's canvas. Such a row's argmax and scaled logits, the
    previous step's in the public loop, are the caller's to keep."""
    scaled = scale(logits, params)
    sample = gumbel_sample(scaled, params.seed, params.step, positions)
    return renoise(entropy(scaled), sample, scaled.argmax(-1), scaled, canvas, positions, params, logits.shape[-1],
                   finished)


def stability(argmax: Tensor, previous_argmax: Tensor, stable_run: Tensor) -> Tensor:
    """The new `stable_run [B]` int64: how many consecutive steps up to this one left a row's argmax
    `[B, W]` unchanged: one more than before where the argmax equals `previous_argmax`, else 0. On a
    block's first step pass `previous_argmax` filled with -1 (no token), so that the count is 0.

    A row is stable when the count is at least S. That is the public rule, which calls a row stable
    when its argmax equals each of the last S argmax canvases, kept from -1 at the start of a block;
    S = 0 is always stable."""
    same = (argmax == previous_argmax).all(-1)
    return torch.where(same, stable_run + 1, torch.zeros_like(stable_run))


def should_stop(stable_run: Tensor, mean_entropy: Tensor, stability_threshold: int,
                confidence_threshold: float) -> Tensor:
    """`[B]` bool: stable for `stability_threshold` steps and mean entropy below the threshold (float32)."""
    return (stable_run >= stability_threshold) & (mean_entropy < confidence_threshold)


def contains_eos(tokens: Tensor, eos_ids: Tensor) -> Tensor:
    """`[B]` bool: whether a row of `tokens [B, W]` holds any of `eos_ids [E]`."""
    return torch.isin(tokens, eos_ids).any(-1)


def pad_after_eos(tokens: Tensor, eos_ids: Tensor, pad_id: int, finished_before: Tensor | None = None) -> Tensor:
    """`tokens [B, W]` with every position after a row's first EOS (one of `eos_ids [E]`) set to
    `pad_id`; the first EOS stays, and a row without EOS is unchanged. Rows in `finished_before [B]`
    (finished in an earlier block) become all pad."""
    is_eos = torch.isin(tokens, eos_ids).long()
    after_first = (is_eos.cumsum(-1) - is_eos) > 0
    if finished_before is not None:
        after_first = after_first | finished_before[:, None]
    return torch.where(after_first, torch.full_like(tokens, pad_id), tokens)
