"""The DiffusionGemma family against the public Hugging Face implementation.

The expected values are what transformers' own DiffusionGemmaForBlockDiffusion computed on a tiny
random checkpoint it wrote (`tests/data/make_diffusion_gemma.py`): the encoder's cache after the
prompt and after a committed canvas, and the decoder's float32 logits over [cache; canvas] on a
first step, on a second step fed the first step's logits as self-conditioning, and on the next
canvas. The checkpoint's norm weights, router scales and layer scalars are all drawn away from 0
and 1, the encoder's scalars apart from the decoder's, so a `w` / `1 + w` or a swapped scalar fails.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlmrt.core.errors import CheckpointError, UnsupportedFeatureError
from dlmrt import models
from dlmrt.models import checkpoint
from dlmrt.models.diffusion_gemma import FULL, SLIDING, inverse_frequencies, RopeConfig

DATA = Path(__file__).parents[1] / "data" / "diffusion_gemma"
EXPECTED = load_file(str(DATA / "expected.safetensors"))
RECORDED = json.loads((DATA / "expected.json").read_text())
TOLERANCE = 1e-4  # float32, as the issue asks


def load(path: Path = DATA):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checkpoint.load(path)


@pytest.fixture(scope="module")
def model():
    return load()


def layer_cache(kv, model, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `index`'s (K, V) from a LayerGroupKV."""
    kind = model.config.layer_types[index]
    rank = model.config.layer_types[:index].count(kind)
    group = kv.sliding if kind == SLIDING else kv.full
    return group[rank, 0], group[rank, 1]


def assert_cache_matches(kv, model, prefix: str) -> None:
    for index in range(model.num_layers):
        k, v = layer_cache(kv, model, index)
        expected_k, expected_v = EXPECTED[f"{prefix}.{index}.k"], EXPECTED[f"{prefix}.{index}.v"]
        kept = expected_k.shape[2]  # the public cache keeps window - 1 positions on sliding layers
        if model.config.layer_types[index] == SLIDING:
            assert kept == model.sliding_window - 1
        torch.testing.assert_close(k[:, :, -kept:], expected_k, atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(v[:, :, -kept:], expected_v, atol=TOLERANCE, rtol=0)


def canvas_positions(start: int, batch: int, length: int) -> torch.Tensor:
    return torch.arange(start, start + length)[None].expand(batch, -1)


def decode_steps(model):
    """(first, second, next) decoder logits, each step as the public generate runs it."""
    prompt, canvas = EXPECTED["prompt"], EXPECTED["canvas"]
    batch, length = prompt.shape
    width = canvas.shape[1]
    with torch.no_grad():
        cache = model.encode(prompt)
        positions = canvas_positions(length, batch, width)
        first = model.denoise(canvas, positions=positions, past=cache).logits
        signal = model.soft_tokens(EXPECTED["first_logits"] / RECORDED["self_conditioning_temperature"])
        second = model.denoise(canvas, positions=positions, past=cache, residual=signal).logits
        committed = model.encode(canvas, positions=positions, past=cache)
        following = model.denoise(EXPECTED["next_canvas"], positions=canvas_positions(length + width, batch, width),
                                  past=committed).logits
    return first, second, following


def test_config_is_read_as_the_public_code_reads_it(model):
    assert model.config.layer_types == tuple(RECORDED["layer_types"])
    assert (model.config.full_head_dim, model.config.full_kv_heads) == (16, 1)
    assert model.sliding_window == RECORDED["sliding_window"] and model.canvas_length == 8
    assert model.tokens.mask_id is None and model.tokens.eos_ids == (1,) and model.tokens.pad_id == 0
    assert model.noise == "uniform" and model.softcap == 30.0


def test_encoder_cache_matches_the_public_cache(model):
    with torch.no_grad():
        cache = model.encode(EXPECTED["prompt"])
        assert_cache_matches(cache, model, "prompt_cache")
        batch, length = EXPECTED["prompt"].shape
        committed = model.encode(EXPECTED["canvas"], positions=canvas_positions(length, batch, 8), past=cache)
    assert_cache_matches(committed, model, "canvas_cache")
    assert committed.positions.shape == (batch, length + 8)


def test_decoder_logits_match_on_the_first_and_the_self_conditioned_step(model):
    first, second, following = decode_steps(model)
    torch.testing.assert_close(first, EXPECTED["first_logits"], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(second, EXPECTED["second_logits"], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(following, EXPECTED["next_logits"], atol=TOLERANCE, rtol=0)
    # self-conditioning must matter, or the second step would test nothing
    assert (second - first).abs().max() > 0.5


@pytest.mark.parametrize("mutation", ["one_plus_w_norms", "encoder_scalars_in_decoder", "no_softcap"])
def test_a_misread_weight_fails_parity(mutation):
    """The parity above can fail: each classic misreading moves the logits far beyond the tolerance."""
    model = load()
    with torch.no_grad():
        if mutation == "one_plus_w_norms":
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.add_(1.0)
        elif mutation == "encoder_scalars_in_decoder":
            for layer, holder in zip(model.model.decoder.layers, model.model.encoder.language_model.layers):
                layer.layer_scalar.copy_(holder.layer_scalar)
        else:
            model.softcap = None
    first, second, following = decode_steps(model)
    worst = max((first - EXPECTED["first_logits"]).abs().max(), (following - EXPECTED["next_logits"]).abs().max())
    assert worst > 10 * TOLERANCE


def test_proportional_rotary_rotates_the_leading_quarter_of_frequencies():
    inv_freq = inverse_frequencies(RopeConfig("proportional", 1e6, 0.25), 16)
    expected = [1e6 ** (-0 / 16), 1e6 ** (-2 / 16)] + [0.0] * 6  # int(0.25 * 16 // 2) = 2 rotated pairs
    torch.testing.assert_close(inv_freq, torch.tensor(expected, dtype=torch.float32))
    full = inverse_frequencies(RopeConfig("default", 1e4), 8)
    torch.testing.assert_close(full, torch.tensor([1e4 ** (-i / 8) for i in (0, 2, 4, 6)], dtype=torch.float32))


def test_the_image_tower_is_skipped_with_a_note():
    with pytest.warns(UserWarning, match=r"not loaded \(under model\.encoder\.embed_vision\., "
                                         r"model\.encoder\.vision_tower\.\).*text only"):
        checkpoint.load(DATA)


def rewrite(tmp_path: Path, *, drop: str | None = None, text_config: dict | None = None) -> Path:
    """A copy of the fixture checkpoint without tensor `drop`, or with text_config fields changed."""
    target = tmp_path / "model"
    shutil.copytree(DATA, target)
    if drop is not None:
        state = load_file(str(target / "model.safetensors"))
        del state[drop]
        save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    if text_config is not None:
        config = json.loads((target / "config.json").read_text())
        config["text_config"].update(text_config)
        (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("name", ["model.decoder.layers.2.layer_scalar",
                                  "model.encoder.language_model.layers.4.layer_scalar"])
def test_a_missing_layer_scalar_is_named(tmp_path, name):
    with pytest.raises(CheckpointError, match=rf"missing tensor '{name}' \(shape \[1\]"):
        load(rewrite(tmp_path, drop=name))


@pytest.mark.parametrize("fields, message", [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"] * 2},
     r"layer type 'chunked_attention' is not supported by dlmrt \(supported: sliding_attention, full_attention\)"),
    ({"rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 1e4},
                          FULL: {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0}}},
     r"rope_parameters\.full_attention: rope_type 'yarn' is not supported by dlmrt \(supported: default, "
     r"proportional\)"),
    ({"hidden_activation": "silu"}, r"hidden_activation=\"silu\" is not supported by dlmrt"),
    ({"layer_types": ["sliding_attention"] * 6}, r"the last layer must be full_attention"),
    ({"per_layer_config": {"2": {"head_dim": 16}, "5": {"head_dim": 32}}},
     r"different shapes .* dlmrt implements one shape"),
])
def test_unimplemented_config_is_refused_by_name_before_any_weight(tmp_path, fields, message):
    raw = json.loads((DATA / "config.json").read_text())
    raw["text_config"].update(fields)
    with pytest.raises(UnsupportedFeatureError if "not supported" in message or "implements" in message
                       else CheckpointError, match=message):
        models.build(raw, "config.json", None)


def test_create_and_save_round_trip(tmp_path):
    raw = json.loads((DATA / "config.json").read_text())
    model = models.create(raw, seed=3)
    path = checkpoint.save(model, tmp_path / "created")
    loaded = load(path)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        cache = model.encode(ids)
        torch.testing.assert_close(loaded.denoise(ids, positions=canvas_positions(4, 1, 4), past=loaded.encode(ids))
                                   .logits, model.denoise(ids, positions=canvas_positions(4, 1, 4), past=cache).logits)
