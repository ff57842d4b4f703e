"""Dream's decoding (policy `dream`) against the public `diffusion_generate` in the eager loop at every
K; on the other backends and modes, the parity matrix (tests/parity_matrix.py) holds it to the same.

The expected tokens are what the public Dream code's own `diffusion_generate` returned at temperature
0 on a random checkpoint that code wrote (`tests/data/make_dream.py`, recorded in
`tests/data/dream/expected.json` with the masked count after every step).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dlmrt
from dlmrt.core.errors import ArgumentError
from dlmrt.runtime import Dream, GenerationSettings, Generator, Threshold
from dlmrt.runtime.policies import dream_schedule
from recorded import DREAM, dream_name, dream_settings

DATA = Path(__file__).parents[1] / "data" / "dream"
CASES = DREAM["cases"]
EPS = DREAM["settings"]["eps"]
PROMPTS = [[5, 17, 42], [3, 9, 22, 31, 8], [40, 2]]
case_id, settings_of = dream_name, dream_settings


@pytest.fixture(scope="module")
def dream_model():
    return dlmrt.load(DATA)


def test_the_schedule_is_dreams_float32_floor():
    # hand-computed: linspace(1, 1e-3, 5) = 1, .75025, .5005, .25075, .001 over 8 masks:
    # int(8 * .24975) = 1, int(7 * .33289) = 2, int(5 * .49900) = 2, then the last 3
    assert dream_schedule(torch.tensor([8]), 4, 1e-3).tolist() == [[1, 2, 2, 3]]
    # one step per token: the first step commits nothing, the last two
    assert dream_schedule(torch.tensor([8]), 8, 1e-3).tolist() == [[0, 1, 1, 1, 1, 1, 1, 2]]
    for case in CASES:
        counts = dream_schedule(torch.tensor([case["gen_length"]]), case["steps"], EPS)[0].tolist()
        left = [case["gen_length"] - sum(counts[:i + 1]) for i in range(len(counts))]
        assert left == case["masks_after_step"], case_id(case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tokens_of_the_public_diffusion_generate(dream_model, loop, case):
    assert loop.run(dream_model, [case["prompt"]], settings_of(case)).tokens[0].tolist() == case["generated"]


def test_blocks_and_batches_decode_each_row_as_alone(dream_model, loop):
    settings = GenerationSettings(12, 4, Dream(6, confidence="entropy"), ignore_eos=True)
    batched = loop.run(dream_model, PROMPTS, settings).tokens
    for row, prompt in enumerate(PROMPTS):
        assert batched[row].tolist() == loop.run(dream_model, [prompt], settings).tokens[0].tolist()


def test_windows_over_the_cache_start_one_position_before_the_block():
    """Dream's logits at the block's first position come from the position before it, so every step
    over the cache recomputes that position (the kinds of Dream's steps, against LLaDA's)."""
    from dlmrt.runtime.device_step import kinds_for_block
    for cache, llada_later, dream_later in [("prefix", (16, 8, 0), (17, 7, 0)), ("dual", (4, None, 0), (5, None, 1))]:
        _, llada = kinds_for_block(cache, False, 24, 8, 4, True)
        _, dream = kinds_for_block(cache, False, 24, 8, 4, True, lookbehind=1)
        assert (llada.window, llada.start, llada.before) == llada_later
        assert (dream.window, dream.start, dream.before) == dream_later


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_threshold_decoding_runs_with_the_caches(dream_model, cache):
    settings = GenerationSettings(12, 4, Threshold(0.3), ignore_eos=True)
    cached = Generator(dream_model, mode="eager").generate(
        PROMPTS, GenerationSettings(12, 4, Threshold(0.3), cache=cache, ignore_eos=True))
    plain = Generator(dream_model, mode="eager").generate(PROMPTS, settings)
    assert not (cached.tokens == dream_model.tokens.mask_id).any()
    assert cached.metrics.nfe <= plain.metrics.nfe + len(PROMPTS) * 3  # a refresh per block at most


@pytest.mark.parametrize("steps, message", [(0, "steps must be a positive integer"),
                                            (5, r"steps \(5\) must be divisible by the number of blocks")])
def test_bad_dream_settings_get_one_clear_error(dream_model, steps, message):
    with pytest.raises(ArgumentError, match=message):
        Generator(dream_model, mode="eager").generate([[5, 6]], GenerationSettings(12, 4, Dream(steps)))
