"""The Dream family: its forward against the float64 reference, the logit shift, the config fields
it refuses, mismatched checkpoints, and parity with the public Dream code (tests/data/dream, made by
tests/data/make_dream.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dlmrt
from dlmrt.core.errors import CheckpointError, UnsupportedFeatureError
from dlmrt import models
from dlmrt.models import checkpoint
from dlmrt.models import PastKV, SpecialTokens

from qwen_testing import DREAM, TOKENS, check, left_padded, make_model, random_ids
from dream_reference import dream_forward, shift

PUBLIC_DIR = Path(__file__).parents[1] / "data" / "dream"



def dream_config(**changes) -> dict:
    return {**DREAM, **changes}


# -- the forward against the reference ---------------------------------------------------

CASES = {
    "gqa_untied": {},
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "mqa_3layers_theta1e6": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=1,
                                 num_hidden_layers=3, rope_theta=1e6, intermediate_size=96, vocab_size=40),
    "kv_heads_default": dict(num_key_value_heads=None, rms_norm_eps=1e-5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_batched_and_left_padded(case):
    raw = dream_config(**CASES[case])
    model = make_model(raw, seed=len(case))
    pad, length = 3, 10
    ids, key_mask = left_padded(raw, pad, length, seed=1)
    out = model.denoise(ids, key_mask=key_mask, return_kv=True)
    heads = raw["num_attention_heads"]
    kv_heads = raw["num_key_value_heads"] or heads
    assert out.logits.shape == (2, length, raw["vocab_size"])
    assert out.kv.shape == (raw["num_hidden_layers"], 2, 2, kv_heads, length, raw["hidden_size"] // heads)
    assert torch.equal(model(ids, key_mask=key_mask), out.logits)

    raw_logits, expected_kv = dream_forward(model.state_dict(), raw, ids, key_mask=key_mask)
    check(out.logits, shift(raw_logits))
    check(out.kv, expected_kv)

    # the padded row's real tokens, alone, give the same logits
    alone = model.denoise(ids[:1, pad:]).logits
    torch.testing.assert_close(out.logits[0, pad + 1:], alone[0, 1:], atol=1e-5, rtol=1e-5)

    # explicit positions that do not start at 0
    positions = torch.stack((torch.arange(length) + 3, torch.arange(length) * 2 + 17))
    raw_logits, _ = dream_forward(model.state_dict(), raw, ids, positions=positions)
    check(model.denoise(ids, positions=positions).logits, shift(raw_logits))


def test_reference_sees_every_bias_and_norm():
    """Each bias and norm weight moves the logits: the comparison above would catch one left out."""
    raw = dream_config()
    model = make_model(raw, seed=2)
    ids = random_ids(raw, 1, 6, seed=2)
    base = model(ids)
    for name, tensor in model.state_dict().items():
        if tensor.dim() != 1:
            continue
        with torch.no_grad():
            saved = tensor.clone()
            tensor.copy_(torch.ones_like(tensor) if name.endswith("norm.weight") else torch.zeros_like(tensor))
            assert (model(ids) - base).abs().max() > 1e-4, name
            tensor.copy_(saved)


# -- the logit shift ---------------------------------------------------------------------

def identity_model():
    """Raw logits at j are peaked at token j: blocks add nothing, embedding and head are the identity."""
    raw = dream_config(vocab_size=32)
    model = models.create(raw, tokens=TOKENS)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(32))
        model.lm_head.weight.copy_(torch.eye(32))
    return model


def test_shift_by_hand():
    model = identity_model()
    assert type(model).logits_shift == 1 and models.Denoiser.logits_shift == 0
    ids = torch.tensor([[5, 9, 12, 7, 20]])
    # position j shows what the raw logits of j - 1 predict; position 0 repeats its own
    assert model(ids).argmax(-1).tolist() == [[5, 5, 9, 12, 7]]
    assert model.denoise(ids, logits_range=(2, 4)).logits.argmax(-1).tolist() == [[9, 12]]
    assert model.denoise(ids, logits_range=(0, 1)).logits.argmax(-1).tolist() == [[5]]
    index = torch.tensor([4, 0, 1])
    assert model.denoise(ids, logits_index=index).logits.argmax(-1).tolist() == [[7, 5, 5]]


def test_window_selections_follow_the_shift():
    raw = dream_config()
    model = make_model(raw, seed=3)
    ids = random_ids(raw, 2, 9, seed=3)
    full = model(ids)
    torch.testing.assert_close(model.denoise(ids, logits_range=(3, 7)).logits, full[:, 3:7], atol=1e-6, rtol=0)
    index = torch.tensor([8, 0, 4])
    torch.testing.assert_close(model.denoise(ids, logits_index=index).logits, full[:, index], atol=1e-6, rtol=0)


def test_cached_prefix_needs_one_position_of_look_behind():
    raw = dream_config()
    model = make_model(raw, seed=4)
    ids = random_ids(raw, 2, 10, seed=4)
    positions = torch.arange(10).expand(2, 10)
    full = model.denoise(ids, return_kv=True)
    prefix = 6
    # the window starts one position before the first logits read: positions prefix .. 9 are exact
    start = prefix - model.logits_shift
    past = PastKV(full.kv[..., :start, :], positions[:, :start])
    window = model.denoise(ids[:, start:], positions=positions[:, start:], past=past).logits
    torch.testing.assert_close(window[:, model.logits_shift:], full.logits[:, prefix:], atol=1e-5, rtol=1e-5)
    # without it, the window's first position has its own raw logits, not the shifted ones
    raw_logits, _ = dream_forward(model.state_dict(), raw, ids)
    past = PastKV(full.kv[..., :prefix, :], positions[:, :prefix])
    window = model.denoise(ids[:, prefix:], positions=positions[:, prefix:], past=past).logits
    check(window[:, 0], raw_logits[:, prefix])
    assert (window[:, 0] - full.logits[:, prefix]).abs().max() > 1e-3


# -- the config --------------------------------------------------------------------------

REFUSED = {
    "use_sliding_window": dict(use_sliding_window=True, sliding_window=4096),
    "rope_scaling": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "hidden_act": dict(hidden_act="gelu"),
    "partial_rotary_factor": dict(partial_rotary_factor=0.5),
    "head_dim": dict(head_dim=16),
}


def write_directory(path: Path, raw: dict, weights: bytes | None = None) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    if weights is not None:
        (path / checkpoint.SINGLE_FILE).write_bytes(weights)
    return path


@pytest.mark.parametrize("field", list(REFUSED))
def test_unimplemented_fields_are_refused_before_the_weights_are_read(tmp_path, field):
    directory = write_directory(tmp_path / "model", dream_config(**REFUSED[field]), weights=b"not safetensors")
    with pytest.raises(UnsupportedFeatureError, match=field) as error:
        dlmrt.load(directory)
    assert "safetensors" not in str(error.value)
    # the same directory with a valid config fails on the weights instead
    (directory / "config.json").write_text(json.dumps(dream_config()))
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        dlmrt.load(directory)


def test_fields_without_effect_at_inference_are_accepted(tmp_path):
    model = make_model(dream_config(), seed=5)
    ids = random_ids(DREAM, 2, 7, seed=5)
    directory = checkpoint.save(model, tmp_path / "model")
    raw = json.loads((directory / "config.json").read_text())
    raw.update(sliding_window=4096, max_window_layers=1, attention_dropout=0.1, initializer_range=0.5,
               use_cache=True, head_dim=8, partial_rotary_factor=1.0)
    (directory / "config.json").write_text(json.dumps(raw))
    assert torch.equal(dlmrt.load(directory)(ids), model(ids))


def test_create_initializes_every_tensor():
    model = models.create(dream_config(), tokens=TOKENS)
    state = model.state_dict()
    biases = [name for name in state if name.endswith(".bias")]
    assert len(biases) == 3 * DREAM["num_hidden_layers"]
    assert all(torch.equal(state[name], torch.zeros_like(state[name])) for name in biases)
    assert all(torch.isfinite(t).all() for t in state.values())
    assert not any(name.endswith("o_proj.bias") or "mlp" in name and name.endswith(".bias") for name in state)


# -- checkpoints that disagree with their config -----------------------------------------

def test_tied_config_with_an_lm_head_is_refused(tmp_path):
    directory = checkpoint.save(make_model(dream_config(), seed=7), tmp_path / "model")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'lm_head.weight'"):
        dlmrt.load(directory)


# -- parity with the public Dream code ---------------------------------------------------

def test_public_checkpoint_logits_match_the_public_model():
    model = dlmrt.load(PUBLIC_DIR)
    assert model.tokens == SpecialTokens(63, (60,), 61)
    expected = load_file(str(PUBLIC_DIR / "expected_logits.safetensors"))
    ids, mask, positions = expected["input_ids"], expected["attention_mask"].bool(), expected["position_ids"]
    public = torch.cat((expected["raw_logits"][:, :1], expected["raw_logits"][:, :-1]), dim=1)
    with torch.no_grad():
        logits = model.denoise(ids, positions=positions, key_mask=mask).logits
    # compare where the shifted logits come from an unpadded position (the public padded rows attend to nothing)
    source = torch.arange(ids.shape[1]).sub(1).clamp(min=0)
    compared = mask[:, source]
    assert compared.sum() == 2 * ids.shape[1] - 4
    torch.testing.assert_close(logits[compared], public[compared], atol=1e-4, rtol=0)
