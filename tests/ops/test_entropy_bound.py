"""`dlmrt.ops.entropy_bound` against a plain-Python reference and against the public DiffusionGemma code.

The reference below is written from the rule descriptions only (loops over rows and positions,
Python floats, math.log and math.exp, sorted()), never from the module's helpers:

  scaled    z = logits / T, each a float32 division (emulated: the float64 quotient rounded to
            float32, which is the correctly rounded float32 quotient)
  entropy   H = -sum p log p in float64, impossible tokens adding 0
  accept    positions by (H, position) ascending; take one while the entropies taken before it
            sum to at most the bound
  sample    argmax_v z_v - log(-log u_v), u from dlmrt's counter-based `uniform`
  refill    floor(u V) with u the `uniform` number of the position at index RANDOM_TOKEN_SALT
  stable    the public rule itself: equal to each of the last S argmax canvases (kept from -1)
  padding   every position after the first EOS

The acceptance rule is fed the entropies the module returns (exact float32 values), after those have
been checked against the float64 entropies computed here, so that bounds can equal sums exactly.
The crafted tests fix the expected sets by hand as well.

The public code's outputs are recorded in tests/data/entropy_bound by tests/data/make_entropy_bound.py.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dlmrt.ops.entropy_bound import (RANDOM_TOKEN_SALT, RenoiseParams, contains_eos, entropy, entropy_bound_step,
                                         gumbel_sample, initial_canvas, pad_after_eos, random_tokens, should_stop,
                                         stability, temperature_schedule)
from dlmrt.ops.parallel_unmask import uniform
from dlmrt.ops.parallel_unmask.reference import _RANDOM_CONFIDENCE_SALT

DATA = Path(__file__).resolve().parents[1] / "data" / "entropy_bound"
INF = math.inf


# -- the reference ----------------------------------------------------------------------

def f32(x: float) -> float:
    """x rounded to float32, as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def ref_scaled(row: list[float], temperature: float) -> list[float]:
    return [f32(f32(x) / f32(temperature)) for x in row]


def ref_entropy(row: list[float]) -> float:
    top = max(row)
    total = sum(math.exp(x - top) for x in row if x > -INF)
    h = 0.0
    for x in row:
        if x > -INF:
            logp = x - top - math.log(total)
            h -= math.exp(logp) * logp
    return h


def ref_argmax(row: list[float]) -> int:
    best = 0
    for v in range(1, len(row)):
        if row[v] > row[best]:
            best = v
    return best


def ref_accept(entropies: list[float], bound: float) -> list[bool]:
    order = sorted(range(len(entropies)), key=lambda i: (entropies[i], i))
    accepted = [False] * len(entropies)
    before = 0.0
    for i in order:
        if before <= bound:
            accepted[i] = True
        before += entropies[i]
    return accepted


def ref_gumbel(row: list[float], u: list[float]) -> int:
    scores = [x - math.log(-math.log(n)) if x > -INF else -INF for x, n in zip(row, u)]
    return ref_argmax(scores)


def ref_refill(u: float, vocab_size: int) -> int:
    return min(math.floor(u * vocab_size), vocab_size - 1)


def ref_stop_history(argmaxes, mean_entropies, threshold: int, confidence: float):
    """The public stopping rule for one row: stable when the argmax equals each of the last
    `threshold` argmax canvases (kept from -1), confident when the mean entropy is below."""
    history = [[-1] * len(argmaxes[0]) for _ in range(threshold)]
    out = []
    for canvas, h in zip(argmaxes, mean_entropies):
        stable = all(past == canvas for past in history)
        history = history[1:] + [canvas] if threshold else history
        out.append(stable and h < confidence)
    return out


def ref_pad(tokens: list[int], eos: list[int], pad: int, finished_before: bool) -> list[int]:
    if finished_before:
        return [pad] * len(tokens)
    out, seen = [], False
    for t in tokens:
        out.append(pad if seen else t)
        seen = seen or t in eos
    return out


# -- helpers ----------------------------------------------------------------------------

def params(temperature, bound, seed, step) -> RenoiseParams:
    return RenoiseParams(torch.tensor(temperature, dtype=torch.float32), torch.tensor(bound, dtype=torch.float32),
                         torch.tensor(seed, dtype=torch.long), torch.tensor(step, dtype=torch.long))


def positions_for(b: int, w: int, start: int = 17) -> torch.Tensor:
    return (start + torch.arange(w)).expand(b, w).contiguous()


def step(logits, p: RenoiseParams, canvas=None, positions=None, **kwargs):
    b, w, v = logits.shape
    canvas = torch.zeros(b, w, dtype=torch.long) if canvas is None else canvas
    positions = positions_for(b, w) if positions is None else positions
    return entropy_bound_step(logits, canvas, positions, p, **kwargs)


def random_logits(b, w, v, seed, low=0.3, high=6.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, w, v, generator=g) * (low + (high - low) * torch.rand(b, w, 1, generator=g))


def check_against_reference(logits, p: RenoiseParams):
    """Scaled logits, argmax, entropies, acceptance and mean entropy of a step against the reference;
    returns the module's result and its entropies."""
    result = step(logits, p)
    module_entropy = entropy(result.scaled_logits)
    for b in range(logits.shape[0]):
        t, bound = float(p.temperature[b]), float(p.entropy_bound[b])
        entropies = []
        for w in range(logits.shape[1]):
            z = ref_scaled(logits[b, w].tolist(), t)
            assert result.scaled_logits[b, w].tolist() == z
            assert int(result.argmax[b, w]) == ref_argmax(z)
            entropies.append(ref_entropy(z))
        assert module_entropy[b].tolist() == pytest.approx(entropies, rel=1e-5, abs=1e-6)
        assert float(result.mean_entropy[b]) == pytest.approx(sum(entropies) / len(entropies), rel=1e-5, abs=1e-6)
        assert result.accepted[b].tolist() == ref_accept(module_entropy[b].tolist(), bound)
    return result, module_entropy


# -- 1. crafted acceptance, temperature, argmax, mean entropy ------------------------------

def test_crafted_acceptance_order_bound_and_ties():
    v = 7
    ninf = -INF
    one = [0.0] + [ninf] * (v - 1)  # H = 0
    two = [0.0, 0.0] + [ninf] * (v - 2)  # H = log 2
    three = [0.0, 0.0, 0.0] + [ninf] * (v - 3)  # H = log 3
    five = [0.0] * 5 + [ninf] * (v - 5)  # H = log 5
    # sorted: 1 (0), 0 (log 2), 3 (log 2, a tie: after 0), 5 (log 3), 4 (log 5), 2 (log 5, after 4)
    row = torch.tensor([two, one, five, two, five, three])
    logits = row.expand(5, *row.shape).clone()
    h = entropy(logits[:1])[0]
    assert h[0] == h[3] and h[2] == h[4] and h[1] == 0  # exact ties
    h2, h3 = float(h[0]), float(h[5])
    assert h2 == pytest.approx(math.log(2), rel=1e-6) and h3 == pytest.approx(math.log(3), rel=1e-6)
    below = float(torch.nextafter(torch.tensor(h2), torch.tensor(0.0)))
    bounds = [h2,  # equal to the sum before position 3: taken (inclusive), not 5
              below,  # just below it: 1 and 0 only, the earlier of the tie first
              2 * h2,  # equal to a two-term sum (exact in float32): 5 taken as well
              0.0,  # the sums before 1 and 0 are both 0
              100.0]  # everything
    expected = [{1, 0, 3}, {1, 0}, {1, 0, 3, 5}, {1, 0}, {0, 1, 2, 3, 4, 5}]
    p = params([0.6, 1.0, 1.7, 0.4, 0.9], bounds, [1, 2, 3, 4, 5], [0, 1, 2, 3, 4])
    result, _ = check_against_reference(logits, p)
    for b, want in enumerate(expected):
        assert {i for i in range(6) if result.accepted[b, i]} == want, (b, bounds[b])


def test_crafted_one_accepted_and_all_accepted():
    logits = random_logits(3, 6, 9, seed=3, low=0.5, high=3.0)
    h = entropy(logits)
    assert (h.min(-1).values > 1e-3).all()
    p = params([1.0, 0.8, 0.5], [1e-4, 1e-4, 1e4], [7, 8, 9], [0, 0, 0])
    result, _ = check_against_reference(logits, p)
    assert result.accepted.sum(-1).tolist() == [1, 1, 6]
    assert result.accepted[0, int(h[0].argmin())] and result.accepted[1, int(entropy(logits[1:2] / 0.8)[0].argmin())]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_logits_against_the_reference(seed):
    b, w, v = 3, 8, 11
    logits = random_logits(b, w, v, seed=10 + seed)
    logits[0, 2, 3:] = -INF  # impossible tokens: 0 log 0 = 0
    temperature = [0.45, 0.8, 1.25]
    bounds = [0.05, 0.7, 3.0]
    result, h = check_against_reference(logits, params(temperature, bounds, [seed, 5, 6], [0, 3, 7]))
    counts = result.accepted.sum(-1)
    assert (counts >= 1).all()
    # the accepted positions are exactly the lowest-entropy ones
    for row in range(b):
        taken = h[row][result.accepted[row]]
        left = h[row][~result.accepted[row]]
        assert left.numel() == 0 or taken.max() <= left.min()


def test_temperature_scales_the_logits_and_the_entropy():
    logits = random_logits(2, 5, 6, seed=4)
    hot = step(logits, params([2.0, 2.0], [0.5, 0.5], [1, 1], [0, 0]))
    cold = step(logits, params([0.25, 0.25], [0.5, 0.5], [1, 1], [0, 0]))
    assert torch.equal(hot.scaled_logits, logits / 2.0) and torch.equal(cold.scaled_logits, logits / 0.25)
    assert (hot.mean_entropy > cold.mean_entropy).all()
    assert torch.equal(hot.argmax, cold.argmax) and torch.equal(hot.argmax, logits.argmax(-1))
    assert hot.scaled_logits.dtype == torch.float32 and hot.mean_entropy.dtype == torch.float32


# -- 2. sampling and refills ----------------------------------------------------------------

def test_samples_and_refills_are_drawn_from_the_uniform_numbers():
    b, w, v = 2, 6, 9
    logits = random_logits(b, w, v, seed=5, low=0.2, high=2.0)
    logits[1, 4, ::2] = -INF
    p = params([0.9, 0.6], [0.3, 0.3], [3, 11], [0, 5])
    positions = positions_for(b, w, start=40)
    result = step(logits, p, positions=positions)
    assert result.accepted.any() and not result.accepted.all()
    u = uniform(p.seed, p.step, positions, torch.arange(v))
    salt = torch.tensor(RANDOM_TOKEN_SALT)
    u_next = uniform(p.seed, p.step + 1, positions, salt)
    u_first = uniform(p.seed, torch.zeros_like(p.step), positions, salt)
    sample = gumbel_sample(result.scaled_logits, p.seed, p.step, positions)
    first = initial_canvas(p.seed, positions, v)
    for row in range(b):
        for i in range(w):
            x = ref_gumbel(result.scaled_logits[row, i].tolist(), u[row, i].tolist())
            assert int(sample[row, i]) == x
            refill = ref_refill(float(u_next[row, i]), v)
            assert int(result.canvas[row, i]) == (x if result.accepted[row, i] else refill)
            assert int(first[row, i]) == ref_refill(float(u_first[row, i]), v)
    assert torch.equal(random_tokens(p.seed, p.step + 1, positions, v), torch.tensor(
        [[ref_refill(float(u_next[row, i]), v) for i in range(w)] for row in range(b)]))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def test_samples_follow_the_scaled_softmax():
    w, v = 5000, 6
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    temperature = [0.8, 1.5, 0.5, 1.0]
    logits = base.expand(4, w, v).clone()
    p = params(temperature, [0.1] * 4, [21, 22, 23, 24], [3, 3, 9, 0])
    sample = gumbel_sample(logits / p.temperature[:, None, None], p.seed, p.step, positions_for(4, w, start=0))
    for row, t in enumerate(temperature):
        counts = torch.bincount(sample[row], minlength=v)
        statistic = chi_square(counts, torch.softmax(base.double() / t, -1))
        assert statistic < 25.0, (t, counts.tolist())  # chi-square, 5 degrees of freedom: p = 1.4e-4
        wrong = chi_square(counts, torch.softmax(base.double(), -1))  # the unscaled distribution
        assert t == 1.0 or wrong > 100.0


def test_refills_are_uniform_and_fresh():
    v = 11
    positions = positions_for(4, 5000, start=0)
    seed = torch.tensor([1, 2, 3, 4])
    tokens = random_tokens(seed, torch.tensor([1, 1, 7, 2]), positions, v)
    assert tokens.min() >= 0 and tokens.max() < v
    counts = torch.bincount(tokens.flatten(), minlength=v)
    assert chi_square(counts, torch.full((v,), 1.0 / v)) < 35.0  # 10 degrees of freedom: p = 1.2e-4
    again = random_tokens(seed, torch.tensor([2, 2, 8, 3]), positions, v)
    assert (tokens == again).float().mean() == pytest.approx(1 / v, abs=0.01)  # another step: independent
    assert RANDOM_TOKEN_SALT != _RANDOM_CONFIDENCE_SALT and 2**24 < RANDOM_TOKEN_SALT < 2**32


# -- 3. reproducibility and batch invariance --------------------------------------------------

def test_a_row_does_not_depend_on_its_batch():
    b, w, v = 3, 8, 11
    logits = random_logits(b, w, v, seed=6)
    p = params([0.5, 0.9, 1.3], [0.05, 0.8, 2.0], [100, 200, 300], [0, 4, 9])
    positions = torch.stack([torch.arange(w) + offset for offset in (0, 8, 64)])
    canvas = initial_canvas(p.seed, positions, v)
    together = entropy_bound_step(logits, canvas, positions, p)
    for row in range(b):
        alone = entropy_bound_step(logits[row:row + 1], canvas[row:row + 1], positions[row:row + 1],
                                   RenoiseParams(*(x[row:row + 1] for x in p)))
        for a, c in zip(alone, together):
            assert torch.equal(a[0], c[row])
    assert torch.equal(initial_canvas(p.seed[1:2], positions[1:2], v)[0], canvas[1])
    # the same seed gives the same result, another seed another canvas
    again = entropy_bound_step(logits.clone(), canvas.clone(), positions.clone(), p)
    assert all(torch.equal(a, c) for a, c in zip(again, together))
    other = entropy_bound_step(logits, canvas, positions, p._replace(seed=p.seed + 1))
    assert all((other.canvas[row] != together.canvas[row]).any() for row in range(b))
    assert torch.equal(other.accepted, together.accepted)  # acceptance draws nothing


def test_a_finished_row_keeps_its_canvas():
    logits = random_logits(2, 6, 9, seed=8)
    p = params([0.7, 0.7], [0.5, 0.5], [1, 2], [2, 2])
    canvas = torch.arange(12).reshape(2, 6) % 9
    free = step(logits, p, canvas=canvas)
    held = step(logits, p, canvas=canvas, finished=torch.tensor([True, False]))
    assert torch.equal(held.canvas[0], canvas[0]) and not held.accepted[0].any()
    assert torch.equal(held.canvas[1], free.canvas[1]) and torch.equal(held.accepted[1], free.accepted[1])
    assert torch.equal(held.argmax, free.argmax) and torch.equal(held.mean_entropy, free.mean_entropy)


# -- stopping and padding against the reference ----------------------------------------------

@pytest.mark.parametrize("threshold", [0, 1, 2, 3, 4])
def test_the_stability_count_is_the_public_history_rule(threshold):
    g = torch.Generator().manual_seed(threshold)
    steps, b, w = 40, 4, 2
    argmax = torch.randint(0, 2, (steps, b, w), generator=g)
    argmax[:, 0] = argmax[0, 0]  # a row that never changes
    argmax[5:12, 1] = argmax[5, 1]  # a long stable run
    mean_entropy = torch.where(torch.rand(steps, b, generator=g) < 0.8, 1e-3, 1.0).float()
    run, previous = torch.zeros(b, dtype=torch.long), torch.full((b, w), -1)
    stops = []
    for t in range(steps):
        run = stability(argmax[t], previous, run)
        stops.append(should_stop(run, mean_entropy[t], threshold, 0.005))
        previous = argmax[t]
    stops = torch.stack(stops)
    for row in range(b):
        want = ref_stop_history(argmax[:, row].tolist(), mean_entropy[:, row].tolist(), threshold, 0.005)
        assert stops[:, row].tolist() == want
    assert stops.any() and (threshold == 0 or not stops.all())


def test_pad_after_eos_against_the_reference():
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, 12, (16, 7), generator=g)
    eos, pad = [9, 10], 11
    finished = torch.rand(16, generator=g) < 0.25
    out = pad_after_eos(tokens, torch.tensor(eos), pad, finished)
    for row in range(16):
        assert out[row].tolist() == ref_pad(tokens[row].tolist(), eos, pad, bool(finished[row]))
    assert torch.equal(pad_after_eos(tokens, torch.tensor(eos), pad),
                       pad_after_eos(tokens, torch.tensor(eos), pad, torch.zeros(16, dtype=torch.bool)))
    assert contains_eos(tokens, torch.tensor(eos)).tolist() == [any(t in eos for t in r) for r in tokens.tolist()]


# -- 4. against the public code (recorded) -------------------------------------------------------

@pytest.fixture(scope="module")
def public():
    expected = json.loads((DATA / "expected.json").read_text())
    assert expected["versions"]["transformers"].startswith("5.")
    return expected, load_file(str(DATA / "logits.safetensors"))


def test_the_schedule_is_the_public_one(public):
    expected, _ = public
    for case in expected["schedules"]:
        ours = temperature_schedule(case["t_min"], case["t_max"], case["steps"])
        assert ours.dtype == torch.float32 and ours.shape == (case["steps"],)
        assert torch.equal(ours, torch.tensor(case["generate"], dtype=torch.float32)), case
        # the first step is t_max up to float32 rounding (t_min + (t_max - t_min) need not round back to
        # t_max); the last one still has one step remaining, so it is not t_min
        assert float(ours[0]) == pytest.approx(case["t_max"], rel=2**-22)
        assert float(ours[-1]) == pytest.approx(case["t_min"] + (case["t_max"] - case["t_min"]) / case["steps"],
                                                rel=2**-22)
        assert float(ours[-1]) > f32(case["t_min"])
        if "python_floats" in case:  # the float64 rule rounded once is not what generate uses
            assert not torch.equal(torch.tensor(case["python_floats"]).float(), ours)
    with pytest.raises(ValueError):
        temperature_schedule(0.4, 0.8, 0)


def test_acceptance_is_the_public_one(public):
    expected, tensors = public
    for case in expected["accept"]:
        logits = tensors[f"accept.{case['name']}"]
        b, w, _ = logits.shape
        schedule = temperature_schedule(case["t_min"], case["t_max"], case["steps"])
        temperature = schedule[case["steps"] - case["cur_step"]].expand(b)
        p = RenoiseParams(temperature, torch.full((b,), case["entropy_bound"]), torch.arange(b),
                          torch.full((b,), case["steps"] - case["cur_step"]))
        result = entropy_bound_step(logits, torch.tensor(case["current_canvas"]), positions_for(b, w), p)
        assert result.accepted.tolist() == case["accepted_mask"], case["name"]
        ours = entropy(result.scaled_logits)
        assert ours.flatten().tolist() == pytest.approx(sum(case["entropy"], []), rel=1e-5, abs=1e-6)
        assert torch.equal(torch.where(result.accepted, torch.tensor(case["denoiser_canvas"]),
                                       torch.tensor(case["current_canvas"])), torch.tensor(case["accepted_canvas"]))
    assert {tuple(c["accepted_per_row"]) for c in expected["accept"]} >= {(1, 1, 1), (5, 5)}


def test_stopping_is_the_public_one(public):
    expected, tensors = public
    stopping = expected["stopping"]
    argmax, logits = tensors["stopping.argmax"], tensors["stopping.logits"]
    steps, b, _ = argmax.shape
    for threshold, want in stopping["stop"].items():
        run, previous = torch.zeros(b, dtype=torch.long), torch.full_like(argmax[0], -1)
        for t in range(steps):
            run = stability(argmax[t], previous, run)
            mean_entropy = entropy(logits[t]).mean(-1)
            assert mean_entropy.tolist() == pytest.approx(stopping["mean_entropy"][t], rel=1e-5, abs=1e-9)
            stop = should_stop(run, mean_entropy, int(threshold), stopping["confidence_threshold"])
            assert stop.tolist() == want[t], (threshold, t)
            previous = argmax[t]


def test_eos_padding_is_the_public_one(public):
    expected, _ = public
    for case in expected["finalize"]:
        eos = torch.tensor(case["eos_token_id"]).reshape(-1)
        canvas = torch.tensor(case["canvas"])
        finished_before = torch.tensor(case["finished_before"])
        out = torch.tensor(case["output_ids"])
        n = len(case["prompt"])
        assert (out[:, :n] == torch.tensor(case["prompt"])).all()
        assert torch.equal(pad_after_eos(canvas, eos, case["pad_token_id"], finished_before), out[:, n:]), case["name"]
        assert (finished_before | contains_eos(canvas, eos)).tolist() == case["finished"]


# -- graph-friendliness ---------------------------------------------------------------------------

class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on an op that reads a value back to the host or makes a data-dependent shape."""

    BANNED = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique")
    INDEXING = ("aten::index", "aten::_index_put_impl", "aten::index_put")  # a bool mask index is a nonzero

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if any(name.startswith(banned) for banned in self.BANNED):
            raise AssertionError(f"host sync: {name}")
        if name.split(".")[0].rstrip("_") in self.INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            raise AssertionError(f"host sync: {name} with a mask")
        return func(*args, **(kwargs or {}))


def run_everything(logits, canvas, positions, p, eos):
    result = entropy_bound_step(logits, canvas, positions, p, finished=p.step > 3)
    run = stability(result.argmax, torch.full_like(canvas, -1), torch.zeros_like(p.seed))
    stop = should_stop(run, result.mean_entropy, 1, 0.005)
    padded = pad_after_eos(result.argmax, eos, 0, stop)
    return (*result, run, stop, padded, contains_eos(padded, eos), initial_canvas(p.seed, positions, logits.shape[-1]))


def test_no_host_syncs():
    logits = random_logits(2, 6, 9, seed=11)
    p = params([0.7, 1.1], [0.5, 0.2], [1, 2], [2, 5])
    with _NoHostSync():
        run_everything(logits, torch.zeros(2, 6, dtype=torch.long), positions_for(2, 6), p, torch.tensor([3, 4]))
    with pytest.raises(AssertionError, match="host sync"), _NoHostSync():
        bool(p.step.any())  # the check itself can fail


@pytest.mark.gpu
def test_a_cuda_graph_captures_the_step():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    logits = random_logits(3, 8, 11, seed=12)
    p = params([0.7, 1.1, 0.5], [0.5, 0.2, 2.0], [1, 2, 3], [2, 5, 0])
    canvas, positions, eos = torch.zeros(3, 8, dtype=torch.long), positions_for(3, 8), torch.tensor([3, 4])
    want = run_everything(logits, canvas, positions, p, eos)
    inputs = [x.cuda() for x in (logits, canvas, positions)]
    p_cuda, eos_cuda = RenoiseParams(*(x.cuda() for x in p)), eos.cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_everything(*inputs, p_cuda, eos_cuda)  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run_everything(*inputs, p_cuda, eos_cuda)
    graph.replay()
    torch.cuda.synchronize()
    for got, ref in zip(outputs, want):
        if got.is_floating_point():
            torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got.cpu(), ref)
