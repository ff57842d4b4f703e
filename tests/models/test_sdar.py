"""The SDAR family: its forward against the float64 reference (block-causal on the grid), the
config fields it refuses, mismatched checkpoints, and parity with the public SDAR code
(tests/data/sdar, made by tests/data/make_sdar.py)."""

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

from qwen_testing import FIRST_WORD, SDAR, TOKENS, check, left_padded, make_model, random_ids
from recorded import recorded
from sdar_reference import sdar_forward

PUBLIC_DIR = Path(__file__).parents[1] / "data" / "sdar"



def sdar_config(**changes) -> dict:
    return {**SDAR, **changes}


# -- the forward against the reference ---------------------------------------------------

CASES = {
    "gqa_untied": {},
    "head_dim_not_hidden_over_heads": dict(head_dim=12),
    "mha_tied_biases": dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True),
    "mqa_3layers_theta1e6_block3": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=1, head_dim=6,
                                        num_hidden_layers=3, rope_theta=1e6, intermediate_size=96, vocab_size=40,
                                        block_size=3),
    "kv_heads_null_no_block_size": dict(num_key_value_heads=None, rms_norm_eps=1e-5, block_size=None),
}


def config_of(case: str) -> dict:
    raw = sdar_config(**CASES[case])
    return {k: v for k, v in raw.items() if v is not None or k != "block_size"}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_batched_and_left_padded(case):
    raw = config_of(case)
    model = make_model(raw, seed=len(case))
    block = raw.get("block_size", 4)
    assert model.default_block_length == block
    pad, length = 3, 11
    ids, key_mask = left_padded(raw, pad, length, seed=1)
    out = model.denoise(ids, key_mask=key_mask, return_kv=True)
    heads = raw["num_attention_heads"]
    kv_heads = raw["num_key_value_heads"] or heads
    assert out.logits.shape == (2, length, raw["vocab_size"])
    assert out.kv.shape == (raw["num_hidden_layers"], 2, 2, kv_heads, length, raw["head_dim"])
    assert torch.equal(model(ids, key_mask=key_mask), out.logits)

    logits, expected_kv = sdar_forward(model.state_dict(), raw, ids, block, key_mask=key_mask)
    check(out.logits, logits)
    check(out.kv, expected_kv)

    # the padded row's real tokens, alone, give the same logits (its grid counts from its first real token)
    alone = model.denoise(ids[:1, pad:]).logits
    torch.testing.assert_close(out.logits[0, pad:], alone[0], atol=1e-5, rtol=1e-5)

    # explicit positions that do not start at 0, and a grid given by the call
    positions = torch.stack((torch.arange(length) + 3, torch.arange(length) * 2 + 17))
    logits, _ = sdar_forward(model.state_dict(), raw, ids, 5, positions=positions)
    check(model.denoise(ids, positions=positions, block_length=5).logits, logits)


def test_attention_is_block_causal_on_the_absolute_grid():
    raw = sdar_config()
    model = make_model(raw, seed=2)
    ids = random_ids(raw, 1, 12, seed=2)
    base = model(ids)
    later = ids.clone()
    later[0, 8] = FIRST_WORD if ids[0, 8] != FIRST_WORD else FIRST_WORD + 1  # block 2 of positions 8..11
    changed = (model(later) - base).abs().amax(-1)[0]
    assert changed[:8].max() == 0  # blocks 0 and 1 do not see block 2
    assert changed[8:].min() > 1e-4  # block 2 sees itself both ways


def test_cached_prefix_of_whole_blocks_is_exact():
    raw = sdar_config()
    model = make_model(raw, seed=3)
    ids = random_ids(raw, 2, 12, seed=3)
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        full = model.denoise(ids, return_kv=True)
    prefix = 8
    past = PastKV(full.kv[..., :prefix, :], positions[:, :prefix])
    window = model.denoise(ids[:, prefix:], positions=positions[:, prefix:], past=past)
    torch.testing.assert_close(window.logits, full.logits[:, prefix:], atol=1e-5, rtol=1e-5)
    logits, _ = sdar_forward(model.state_dict(), raw, ids[:, prefix:], 4, positions=positions[:, prefix:],
                             past=(full.kv[..., :prefix, :], positions[:, :prefix]))
    check(window.logits, logits)


def test_reference_sees_every_bias_and_norm():
    """Each bias and norm weight moves the logits: the comparison above would catch one left out."""
    raw = sdar_config(attention_bias=True)
    model = make_model(raw, seed=4)
    ids = random_ids(raw, 1, 6, seed=4)
    base = model(ids)
    for name, tensor in model.state_dict().items():
        if tensor.dim() != 1:
            continue
        with torch.no_grad():
            saved = tensor.clone()
            tensor.copy_(torch.ones_like(tensor) if name.endswith("norm.weight") else torch.zeros_like(tensor))
            assert (model(ids) - base).abs().max() > 1e-4, name
            tensor.copy_(saved)


# -- the config --------------------------------------------------------------------------

REFUSED = {
    "rope_scaling": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
    "use_sliding_window": dict(use_sliding_window=True, sliding_window=4096),
    "hidden_act": dict(hidden_act="gelu"),
    "partial_rotary_factor": dict(partial_rotary_factor=0.5),
    "num_experts": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16),
}


def write_directory(path: Path, raw: dict, weights: bytes | None = None) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    if weights is not None:
        (path / checkpoint.SINGLE_FILE).write_bytes(weights)
    return path


@pytest.mark.parametrize("field", list(REFUSED))
def test_unimplemented_fields_are_refused_before_the_weights_are_read(tmp_path, field):
    directory = write_directory(tmp_path / "model", sdar_config(**REFUSED[field]), weights=b"not safetensors")
    with pytest.raises(UnsupportedFeatureError, match=field) as error:
        dlmrt.load(directory)
    assert "safetensors" not in str(error.value)
    # the same directory with a valid config fails on the weights instead
    (directory / "config.json").write_text(json.dumps(sdar_config()))
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        dlmrt.load(directory)


@pytest.mark.parametrize("field", ["head_dim", "num_key_value_heads"])
def test_sizes_without_a_safe_default_are_required(tmp_path, field):
    raw = sdar_config()
    del raw[field]
    directory = write_directory(tmp_path / "model", raw, weights=b"not safetensors")
    with pytest.raises(CheckpointError, match=f"required field '{field}' is missing"):
        dlmrt.load(directory)


def test_fields_without_effect_at_inference_are_accepted(tmp_path):
    model = make_model(sdar_config(), seed=5)
    ids = random_ids(SDAR, 2, 7, seed=5)
    directory = checkpoint.save(model, tmp_path / "model")
    raw = json.loads((directory / "config.json").read_text())
    raw.update(sliding_window=4096, max_window_layers=1, attention_dropout=0.1, initializer_range=0.5,
               use_cache=True, partial_rotary_factor=1.0, num_experts=None, attn_implementation="flex_attention",
               fuse_cross_entropy=True, micro_forward=False, skip_checkpoint=False, ep_size=1, use_deepep=False,
               debug=False)
    (directory / "config.json").write_text(json.dumps(raw))
    assert torch.equal(dlmrt.load(directory)(ids), model(ids))


@pytest.mark.parametrize("attention_bias", [False, True])
def test_create_initializes_every_tensor(attention_bias):
    model = models.create(sdar_config(attention_bias=attention_bias), tokens=TOKENS)
    state = model.state_dict()
    biases = [name for name in state if name.endswith(".bias")]
    assert len(biases) == (4 * SDAR["num_hidden_layers"] if attention_bias else 0)
    assert all(torch.equal(state[name], torch.zeros_like(state[name])) for name in biases)
    assert all(torch.isfinite(t).all() for t in state.values())
    norms = [name for name in state if name.endswith("norm.weight")]
    assert len(norms) == 4 * SDAR["num_hidden_layers"] + 1
    assert all(torch.equal(state[name], torch.ones_like(state[name])) for name in norms)


# -- checkpoints that disagree with their config -----------------------------------------

def test_head_dim_disagreeing_with_the_weights_is_named(tmp_path):
    directory = checkpoint.save(make_model(sdar_config(), seed=7), tmp_path / "model")
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "head_dim": 16}))
    with pytest.raises(CheckpointError, match=r"q_norm.weight' in model.safetensors has shape \[8\]"):
        dlmrt.load(directory)


# -- parity with the public SDAR code ----------------------------------------------------

def test_public_checkpoint_logits_match_the_public_model():
    model = dlmrt.load(PUBLIC_DIR)
    assert model.tokens == SpecialTokens(63, (60,), 61)
    assert model.default_block_length == 4
    expected = load_file(str(PUBLIC_DIR / "expected_logits.safetensors"))
    ids, positions = expected["input_ids"], expected["position_ids"]
    # the public mask is the block-causal grid of block 4 from position 0, as dlmrt builds it
    grid = positions[0] // 4
    assert torch.equal(expected["attention_mask"][0].bool(), grid[None, :] <= grid[:, None])
    with torch.no_grad():
        logits = model.denoise(ids, positions=positions).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_public_generate_tokens_match_the_llada2_policy(cache):
    """The public generate is dlmrt's `llada2` policy (recorded.sdar_settings says why); it also decodes
    the rest of the last block, and dlmrt returns gen_length tokens."""
    from dlmrt.runtime.generator import Generator

    generator = Generator(dlmrt.load(PUBLIC_DIR), mode="eager")
    for case in recorded("sdar", "llada2", cache):
        assert case.found(generator.generate([case.prompt], case.settings)) == case.tokens, case.name
