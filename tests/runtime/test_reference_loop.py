"""The reference loop follows LLaDA's algorithm: schedule, selection, batching, sampling, guidance, ORL."""

from __future__ import annotations

import pytest
import torch

from dlmrt.models import DenoiserOutput, Residual
from dlmrt.models.description import ModelDescription
from dlmrt.runtime import reference
from dlmrt.runtime import Fixed, GenerationSettings
from dlmrt.runtime.policies import num_transfer_tokens
from helpers import LLADA, LLADA2, ORL, TOKENS, config, random_model

MASK = TOKENS.mask_id


class CraftedDenoiser:
    """Logits that predict token 10 + position, with confidence rising along the canvas.

    Records the canvas of every call, so tests can count what each step committed.
    """

    vocab_size, max_positions, tokens, device, dtype = 40, 128, TOKENS, torch.device("cpu"), torch.float32
    name, block_causal, residual_config, logits_shift, noise = "crafted", False, None, 0, "mask"
    vocab_shard = None  # whole: not a tensor-parallel rank
    hidden_size = num_layers = num_kv_heads = head_dim = 1
    description = ModelDescription(name, "llada", "float32", vocab_size, hidden_size, num_layers, num_kv_heads,
                                   head_dim, max_positions, block_causal, block_grid=None, residual=False)

    def __init__(self, confidence=None):
        self.canvases = []
        self.confidence = confidence

    def denoise(self, ids, *, positions, key_mask, residual, block_length):
        self.canvases.append(ids.clone())
        batch, length = ids.shape
        logits = torch.zeros(batch, length, self.vocab_size)
        strength = self.confidence if self.confidence is not None else torch.linspace(1, 3, length)
        logits[:, torch.arange(length), (10 + torch.arange(length)) % self.vocab_size] = strength[:length]
        return DenoiserOutput(logits, None, None)


def commits_per_step(model, block_start, block_length):
    masked = [int((c[0, block_start:block_start + block_length] == MASK).sum()) for c in model.canvases]
    return masked


@pytest.mark.parametrize("gen_length, block_length, steps, expected", [
    # hand-computed: each block of 8 masked over 3 steps -> 3, 3, 2
    (16, 8, 6, [[3, 3, 2], [3, 3, 2]]),
    # 5 masked over 5 steps -> one per step
    (5, 5, 5, [[1, 1, 1, 1, 1]]),
    # more steps than tokens: 4 masked over 6 steps -> 1, 1, 1, 1, 0, 0
    (4, 4, 6, [[1, 1, 1, 1, 0, 0]]),
    # 7 masked over 2 steps -> 4, 3
    (14, 7, 4, [[4, 3], [4, 3]]),
])
def test_tokens_committed_per_step_follow_the_llada_schedule(gen_length, block_length, steps, expected):
    model = CraftedDenoiser()
    prompt = [5, 6, 7]
    out = reference.generate(model, [prompt], GenerationSettings(gen_length, block_length, Fixed(steps)))
    steps_per_block = steps // (gen_length // block_length)
    for block, counts in enumerate(expected):
        start = len(prompt) + block * block_length
        masked_before = commits_per_step(model, start, block_length)[block * steps_per_block:
                                                                      (block + 1) * steps_per_block]
        masked_after = masked_before[1:] + [0]
        assert [b - a for b, a in zip(masked_before, masked_after)] == counts
    assert out.metrics.nfe == steps
    assert out.tokens.tolist()[0] == [(10 + len(prompt) + i) % 40 for i in range(gen_length)]


def test_schedule_function_matches_hand_computed_values():
    got = num_transfer_tokens(torch.tensor([8, 5, 0, 13]), 3)
    assert got.tolist() == [[3, 3, 2], [2, 2, 1], [0, 0, 0], [5, 4, 4]]


def test_most_confident_positions_are_committed_first_and_never_beyond_the_block():
    confidence = torch.tensor([9.0, 9, 9, 1, 5, 3, 4, 2, 8, 8, 8, 8])  # prompt of 3, then two blocks of 4 + ...
    model = CraftedDenoiser(confidence)
    reference.generate(model, [[5, 6, 7]], GenerationSettings(gen_length=8, block_length=4, policy=Fixed(8)))
    order = []
    for before, after in zip(model.canvases, model.canvases[1:] + [None]):
        if after is None:
            break
        order.append(((before[0] == MASK) & (after[0] != MASK)).nonzero().flatten().tolist())
    # block 1 (positions 3..6): confidences 1, 5, 3, 4 -> 4, 6, 5, 3; block 2 is untouched meanwhile
    assert order[:4] == [[4], [6], [5], [3]]
    # block 2 (positions 7..10): confidences 2, 8, 8, 8 -> ties broken by topk, 7 last
    assert sorted(sum(order[4:7], [])) == [8, 9, 10]


@pytest.mark.parametrize("base", [LLADA, LLADA2], ids=["llada", "llada2_moe"])
@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
def test_batched_left_padded_prompts_match_each_prompt_alone(base, cfg_scale):
    model = random_model(base)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    settings = GenerationSettings(gen_length=8, block_length=4, policy=Fixed(8), cfg_scale=cfg_scale)
    batched = reference.generate(model, prompts, settings).tokens
    for row, prompt in enumerate(prompts):
        alone = reference.generate(model, [prompt], settings).tokens
        assert batched[row].tolist() == alone[0].tolist()
    assert (batched != MASK).all()


def test_sampling_is_reproducible_with_a_seed():
    model = random_model(LLADA)
    prompts = [[5, 6, 7], [8, 9]]
    for remasking in ("low_confidence", "random"):
        runs = [reference.generate(model, prompts, GenerationSettings(12, 4, Fixed(6, remasking),
                                                                      temperature=1.0, seed=seed)).tokens
                for seed in (3, 3, 4)]
        assert torch.equal(runs[0], runs[1])
        assert not torch.equal(runs[0], runs[2])


def test_greedy_decoding_commits_the_argmax():
    """At temperature 0 with one token per step, each committed token is the argmax of its step."""
    model = random_model(LLADA)
    settings = GenerationSettings(gen_length=6, block_length=6, policy=Fixed(6))
    out = reference.generate(model, [[5, 6, 7]], settings).tokens[0]
    canvas = torch.tensor([[5, 6, 7] + [MASK] * 6])
    for _ in range(6):
        logits = model(canvas)[0]
        masked = (canvas[0] == MASK).nonzero().flatten()
        probs = logits.softmax(-1)[masked].max(-1)
        position = masked[probs.values.argmax()]
        canvas[0, position] = probs.indices[probs.values.argmax()]
    assert out.tolist() == canvas[0, 3:].tolist()


def test_classifier_free_guidance_mixes_conditional_and_unconditional_logits():
    model = random_model(LLADA)
    prompt = [5, 6, 7]
    settings = GenerationSettings(gen_length=4, block_length=4, policy=Fixed(4), cfg_scale=2.0)
    out = reference.generate(model, [prompt], settings).tokens[0]
    canvas = torch.tensor([prompt + [MASK] * 4])
    for _ in range(4):
        unconditional = canvas.clone()
        unconditional[0, :3] = MASK
        cond, uncond = model(canvas)[0], model(unconditional)[0]
        logits = uncond + 3.0 * (cond - uncond)
        masked = (canvas[0] == MASK).nonzero().flatten()
        best = logits.softmax(-1)[masked].max(-1)
        pick = best.values.argmax()
        canvas[0, masked[pick]] = best.indices[pick]
    assert out.tolist() == canvas[0, 3:].tolist()


class Spy:
    """Wraps a model and records the residual each forward was given and returned."""

    def __init__(self, model):
        self.model, self.given, self.returned = model, [], []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def denoise(self, ids, **kwargs):
        self.given.append(kwargs["residual"])
        out = self.model.denoise(ids, **kwargs)
        self.returned.append(out.residual)
        return out


@pytest.mark.parametrize("cfg_scale", [0.0, 1.0])
def test_orl_models_carry_the_residual_from_step_to_step(cfg_scale):
    model = Spy(random_model(config(LLADA, residual_context=ORL)))
    reference.generate(model, [[5, 6, 7]], GenerationSettings(8, 4, Fixed(8), cfg_scale=cfg_scale))
    assert model.given[0] is None
    for given, previous in zip(model.given[1:], model.returned):
        assert isinstance(given, Residual) and given is previous
    assert model.returned[0].z.shape[0] == (2 if cfg_scale else 1)


def test_orl_residual_changes_the_decoding():
    base = random_model(LLADA)
    orl = random_model(config(LLADA, residual_context=ORL))
    with torch.no_grad():  # a random model is unsure of everything: sharpen it, and make the adapter loud
        base.model.transformer["ff_out"].weight.mul_(10)
        orl.residual_adapter().output_layer().weight.mul_(10)
    orl.load_state_dict(base.state_dict(), strict=False)
    settings = GenerationSettings(gen_length=12, block_length=12, policy=Fixed(12))
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    with_residual = reference.generate(orl, prompts, settings).tokens
    with torch.no_grad():
        orl.residual_adapter().output_layer().weight.zero_()
    zero_adapter = reference.generate(orl, prompts, settings).tokens
    assert torch.equal(zero_adapter, reference.generate(base, prompts, settings).tokens)
    assert not torch.equal(with_residual, zero_adapter)
