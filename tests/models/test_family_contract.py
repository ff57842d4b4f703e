"""What every family in `FAMILIES` keeps, tested once over the registry: a family added without a
case here fails `test_every_family_has_a_case`. Each family's own forward, config fields and
public-code parity are in its own file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dlmrt
from dlmrt.core.errors import CheckpointError, UnsupportedFeatureError
from dlmrt import models
from dlmrt.models import checkpoint
from dlmrt.models import FAMILIES
from helpers import LLADA, LLADA2
from helpers import TOKENS as TASK_TOKENS
from qwen_testing import DREAM, SDAR
from qwen_testing import TOKENS as QWEN_TOKENS

GEMMA = json.loads((Path(__file__).parents[1] / "data" / "diffusion_gemma" / "config.json").read_text())
# model_type -> (a tiny config, its special tokens: None where config.json carries them)
CASES = {"llada": (LLADA, TASK_TOKENS), "llada2_moe": (LLADA2, TASK_TOKENS), "Dream": (DREAM, QWEN_TOKENS),
         "sdar": (SDAR, QWEN_TOKENS), "diffusion_gemma": (GEMMA, None)}


def test_every_family_has_a_case():
    assert set(CASES) == set(FAMILIES)


@pytest.fixture(params=list(CASES))
def saved(request, tmp_path):
    """(the family's config, a created model, its checkpoint directory)."""
    raw, tokens = CASES[request.param]
    model = models.create(raw, tokens=tokens, seed=1)
    return raw, model, checkpoint.save(model, tmp_path / "model")


def test_create_gives_finite_weights_and_zero_biases(saved):
    _, model, _ = saved
    state = model.state_dict()
    assert all(torch.isfinite(tensor).all() for tensor in state.values())
    assert all(not tensor.any() for name, tensor in state.items() if name.endswith(".bias"))


def test_a_saved_model_loads_as_it_was_saved(saved):
    raw, model, directory = saved
    loaded = dlmrt.load(directory)
    assert type(loaded) is FAMILIES[raw["model_type"]].model_class
    expected = model.state_dict()
    assert {name: tensor.shape for name, tensor in loaded.state_dict().items()} == \
        {name: tensor.shape for name, tensor in expected.items()}
    assert all(torch.equal(tensor, expected[name]) for name, tensor in loaded.state_dict().items())


def test_a_mismatched_checkpoint_names_each_tensor_in_one_error(saved):
    _, _, directory = saved
    path = directory / checkpoint.SINGLE_FILE
    state = load_file(str(path))
    reshaped = next(name for name, tensor in state.items() if tensor.dim() == 2)
    removed = list(state)[-1]
    rows, columns = state[reshaped].shape
    state[reshaped] = torch.zeros(rows + 1, columns)
    del state[removed]
    state["model.unexpected.weight"] = torch.zeros(1)
    save_file(state, str(path))
    with pytest.raises(CheckpointError) as error:
        dlmrt.load(directory)
    message = str(error.value)
    assert "do not match config.json" in message
    assert f"'{reshaped}'" in message and f"[{rows + 1}, {columns}]" in message and f"[{rows}, {columns}]" in message
    assert f"missing tensor '{removed}'" in message and "unexpected tensor 'model.unexpected.weight'" in message


@pytest.mark.parametrize("model_type", list(CASES))
def test_a_residual_context_is_refused_where_the_family_has_no_pathway(model_type):
    raw, tokens = CASES[model_type]
    with_residual = {**raw, "residual_context": {"adapter": "mlp", "adapter_hidden_size": 16}}
    if FAMILIES[model_type].model_class.supports_residual_context:
        assert models.build(with_residual, "config", tokens).residual_config is not None
    else:
        with pytest.raises(UnsupportedFeatureError, match="no residual pathway"):
            models.build(with_residual, "config", tokens)
