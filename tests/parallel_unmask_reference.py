"""A plain-Python reference of each decoding rule of `dlmrt.ops.parallel_unmask`, and the
helpers that build a step's inputs and run it (test_parallel_unmask*.py).

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

from dlmrt.ops.parallel_unmask import UnmaskParams, parallel_unmask
from dlmrt.runtime.policies import Factor, Threshold

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
    return make_params(batch, count=counts, threshold=[policy.row_params()["threshold"]] * batch,
                       factor=[policy.row_params()["factor"]] * batch, **kw)


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


def probs_row(p: list[float]) -> list[float]:
    return [math.log(q) if q > 0 else -INF for q in p]



def factor_params(factors: list[float], masked_counts: list[int], width: int, steps: int = 4):
    """Factor(f) per row at a step before the last: count 1, threshold off, factor f."""
    counts = [int(Factor(f).schedule(torch.tensor([m]), width, steps)[0, 0])
              for f, m in zip(factors, masked_counts)]
    assert counts == [1] * len(factors), "Factor's schedule must ask for one commit per step"
    assert all(Factor(f).row_params()["threshold"] == INF for f in factors), "Factor must leave the threshold off"
    return make_params(len(factors), count=counts, threshold=[Factor(f).row_params()["threshold"] for f in factors],
                       factor=[Factor(f).row_params()["factor"] for f in factors])


def threshold_params(taus: list[float], masked_counts: list[int], width: int, steps: int = 4):
    """Threshold(tau) per row at a step before the last: count 1, threshold tau, factor off."""
    counts = []
    for tau, masked in zip(taus, masked_counts):
        schedule = Threshold(tau).schedule(torch.tensor([masked]), width, steps)
        counts.append(int(schedule[0, 0]))
    assert counts == [1] * len(taus), "Threshold's schedule must ask for one commit per step"
    thresholds = [Threshold(tau).row_params()["threshold"] for tau in taus]
    factors = [Threshold(tau).row_params()["factor"] for tau in taus]
    assert factors == [0.0] * len(taus), "Threshold must leave the factor rule off"
    return make_params(len(taus), count=counts, threshold=thresholds, factor=factors)
