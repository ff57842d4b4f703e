"""Bad checkpoints and bad arguments: one clear error naming what was wrong, never a random weight. (Missing
and unexpected tensors are every family's contract: tests/models/test_family_contract.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import dlmrt
from dlmrt.core.errors import ArgumentError, CheckpointError, UnsupportedFeatureError
from dlmrt.models import checkpoint
from dlmrt.runtime import (Factor, Fixed, GenerationSettings, Generator, LLaDA2, ResidualPolicy, Threshold,
                           make_policy, reference)
from helpers import LLADA, LLADA2, random_model


@pytest.fixture
def llada_dir(tmp_path):
    return checkpoint.save(random_model(LLADA), tmp_path / "model")


def edit_config(directory, **changes):
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            del raw[key]
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def edit_weights(directory, edit):
    path = directory / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        dlmrt.load(tmp_path / "nowhere")


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        dlmrt.load(tmp_path)


def test_config_that_is_not_json(llada_dir):
    (llada_dir / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON"):
        dlmrt.load(llada_dir)


@pytest.mark.parametrize("changes, error, message", [
    ({"model_type": "gpt2"}, UnsupportedFeatureError,
     r"model_type 'gpt2' is not supported \(supported: llada, llada2_moe, Dream, sdar, diffusion_gemma\)"),
    ({"model_type": ...}, CheckpointError, "required field 'model_type' is missing"),
    ({"n_layers": ...}, CheckpointError, r"config.json: required field 'n_layers' is missing \(expected an integer\)"),
    ({"n_heads": "4"}, CheckpointError, r"field 'n_heads' must be an integer, got \"4\" \(str\)"),
    ({"rope_theta": "big"}, CheckpointError, r"field 'rope_theta' must be a number"),
    ({"weight_tying": 0}, CheckpointError, r"field 'weight_tying' must be true or false, got 0 \(int\)"),
    ({"n_kv_heads": 2.5}, CheckpointError, r"field 'n_kv_heads' must be an integer or null, got 2.5"),
    ({"n_kv_heads": 3}, CheckpointError, r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
    ({"alibi": True}, UnsupportedFeatureError, r"alibi=true is not supported by dlmrt \(supported: false\)"),
    ({"residual_context": {"adapter": "transformer"}}, UnsupportedFeatureError,
     "residual_context.adapter='transformer' is not a known adapter"),
    ({"residual_context": True}, CheckpointError, "field 'residual_context' must be an object or null, got true"),
    ({"mask_token_id": 1000}, CheckpointError, r"the mask token id 1000 lies outside the vocabulary \[0, 43\)"),
], ids=["unknown model_type", "no model_type", "missing field", "str for int", "str for float", "int for bool",
        "float for int", "inconsistent", "unsupported feature", "unknown adapter", "residual not an object",
        "token id"])
def test_bad_config(llada_dir, changes, error, message):
    edit_config(llada_dir, **changes)
    with pytest.raises(error, match=message):
        dlmrt.load(llada_dir)


def test_shape_disagreeing_with_config(llada_dir):
    edit_config(llada_dir, mlp_hidden_size=64)
    with pytest.raises(CheckpointError) as caught:
        dlmrt.load(llada_dir)
    message = str(caught.value)
    assert "tensor 'model.transformer.blocks.0.ff_proj.weight' in model.safetensors has shape [48, 32], " \
           "but config.json implies [64, 32]" in message
    assert "up_proj" in message and "ff_out" in message  # every problem, at once


def test_truncated_safetensors(llada_dir):
    path = llada_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a valid safetensors file, it may be truncated"):
        dlmrt.load(llada_dir)


def test_no_weights_and_pickle_only(llada_dir):
    (llada_dir / "model.safetensors").rename(llada_dir / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"has no model.safetensors or model.safetensors.index.json; "
                                              r"dlmrt reads safetensors only \(no pickle\)"):
        dlmrt.load(llada_dir)


def test_index_naming_a_missing_shard(tmp_path):
    directory = checkpoint.save(random_model(LLADA), tmp_path / "m", max_shard_bytes=20_000)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {shard.name}, which is missing"):
        dlmrt.load(directory)


def test_index_disagreeing_with_shards(tmp_path):
    directory = checkpoint.save(random_model(LLADA), tmp_path / "m", max_shard_bytes=20_000)
    index_path = directory / checkpoint.INDEX_FILE
    index = json.loads(index_path.read_text())
    name = "model.transformer.ln_f.weight"
    index["weight_map"][name] = next(f for f in sorted(set(index["weight_map"].values()))
                                     if f != index["weight_map"][name])
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is listed in model.safetensors.index.json but missing"):
        dlmrt.load(directory)


def test_unknown_dtype(llada_dir):
    with pytest.raises(ArgumentError, match="dtype 'int8' is not supported"):
        dlmrt.load(llada_dir, dtype="int8")


@pytest.fixture(scope="module")
def model():
    return random_model(LLADA)


@pytest.mark.parametrize("settings, expected", [
    (dict(gen_length=10, block_length=4), r"gen-length \(10\) must be divisible by block-length \(4\)"),
    (dict(gen_length=8, block_length=4, policy=Fixed(5)), r"steps \(5\) must be divisible by the number of blocks"),
    (dict(gen_length=0, block_length=4), "gen-length must be positive"),
    (dict(gen_length=8, block_length=0), "block-length must be positive"),
    (dict(gen_length=8, block_length=-8), "block-length must be positive"),
    (dict(gen_length=8, block_length=8, policy=Fixed(8, "greedy")), "remasking must be one of"),
    (dict(gen_length=8, block_length=8, temperature=-1.0), "temperature must be >= 0"),
])
def test_bad_generation_settings(model, settings, expected):
    for generate in (reference.generate, lambda m, p, s: Generator(m, mode="eager").generate(p, s)):
        with pytest.raises(ArgumentError, match=expected):
            generate(model, [[5, 6]], GenerationSettings(**settings))


@pytest.mark.parametrize("settings, expected", [
    (dict(policy=Threshold(0.0)), r"threshold must lie in \(0, 1\], got 0.0"),
    (dict(policy=Threshold(1.5)), r"threshold must lie in \(0, 1\], got 1.5"),
    (dict(policy=Threshold(float("nan"))), r"threshold must lie in \(0, 1\], got nan"),
    (dict(policy=LLaDA2(threshold=-0.1)), r"threshold must lie in \(0, 1\]"),
    (dict(policy=ResidualPolicy(Threshold(2.0))), r"threshold must lie in \(0, 1\]"),
    (dict(policy=Factor(0.0)), "factor must be positive, got 0.0"),
    (dict(policy=Threshold(0.9, "logit")), "confidence must be one of prob, margin, entropy, got 'logit'"),
    (dict(max_block_steps=0), "the step budget per block must be positive, got 0"),
    (dict(cache="full"), "cache must be one of none, prefix, dual, got 'full'"),
    (dict(policy=ResidualPolicy()), "policy 'residual' needs an ORL model"),
])
def test_bad_policy_settings(model, settings, expected):
    with pytest.raises(ArgumentError, match=expected):
        Generator(model, mode="eager").generate([[5, 6]], GenerationSettings(8, 8, **settings))


def test_block_causal_models_need_whole_blocks_only_under_the_fixed_policy():
    model = random_model(LLADA2)
    with pytest.raises(ArgumentError, match=r"gen-length \(10\) must be divisible by block-length \(4\)"):
        Generator(model, mode="eager").generate([[5, 6]], GenerationSettings(10, 4, Fixed(10)))
    assert len(Generator(model, mode="eager").generate([[5, 6]], GenerationSettings(10, 4, LLaDA2(), ignore_eos=True))
               .tokens[0]) == 10


def test_dual_cache_is_refused_for_block_causal_models():
    with pytest.raises(ArgumentError, match="cache mode 'dual' does not apply to llada2_moe: it is block-causal"):
        Generator(random_model(LLADA2), mode="eager").generate([[5, 6]], GenerationSettings(8, 8, cache="dual"))


def test_unknown_policy_name():
    with pytest.raises(ArgumentError, match=r"unknown policy 'greedy' \(known: fixed, threshold, factor, llada2, "
                                            r"llada21, dream, residual, entropy_bound\)"):
        make_policy("greedy")


def test_a_misspelt_policy_name_gets_the_closest_one():
    with pytest.raises(ArgumentError, match=r"unknown policy 'treshold' \(known: .*\); did you mean 'threshold'\?$"):
        make_policy("treshold")


@pytest.mark.parametrize("prompts, expected", [
    ([[5, 99]], r"prompt 0 has token ids outside the vocabulary \[0, 43\): \[99\]"),
    ([[5], [-1]], r"prompt 1 has token ids outside the vocabulary"),
    ([[]], "prompt 0 is empty"),
    ([], "no prompt given"),
    ([[5, 2]], "prompt 0 contains the mask token id 2"),
    ([[5] * 60], r"prompt 0 \(60 tokens\) \+ gen-length \(8\) needs 68 positions, more than the model's "
                 r"context of 64"),
])
def test_bad_prompts(model, prompts, expected):
    for generate in (reference.generate, lambda m, p, s: Generator(m, mode="eager").generate(p, s)):
        with pytest.raises(ArgumentError, match=expected):
            generate(model, prompts, GenerationSettings(8, 8))


def test_forward_rejects_ids_outside_vocabulary(model):
    with pytest.raises(ArgumentError, match=r"input_ids must lie in \[0, 43\)"):
        model(torch.tensor([[1, 43]]))
