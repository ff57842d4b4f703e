"""The CPU path's oneDNN linears: which layers are packed, their math, the same tokens, and that the packed
copy follows the model's weights as they change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dlmrt
from dlmrt.runtime import GenerationSettings, Generator, Threshold, onednn
from dlmrt.runtime.torch_backend import TorchBackend
from helpers import LLADA, random_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]
SETTINGS = GenerationSettings(8, 4, Threshold(0.3), cache="dual", ignore_eos=True)


@pytest.fixture
def pack_every_linear(monkeypatch):
    """The test models' linears are below the packing threshold: pack them all."""
    monkeypatch.setattr(onednn, "MIN_PACKED_WEIGHTS", 1)


def plain_tokens(model, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(onednn, "available", lambda model: False)
        return Generator(model, mode="eager").generate(PROMPTS, SETTINGS).tokens


@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_computes_the_linear(bias):
    linear = nn.Linear(96, 80, bias=bias)
    x = torch.randn(3, 7, 96)
    expected = x @ linear.weight.detach().T + (linear.bias.detach() if bias else 0)
    torch.testing.assert_close(onednn.PackedLinear(linear)(x), expected, rtol=1e-5, atol=1e-5)


def test_only_linears_worth_packing_are_packed_and_the_rest_is_shared():
    model = dlmrt.load()  # d_model 128: the MLP's 128 x 512 weights are packed, attention's 128 x 128 are not
    packed = onednn.PackedModel(model).model
    kinds = {name: type(module).__name__ for name, module in packed.named_modules()
             if isinstance(module, (nn.Linear, onednn.PackedLinear))}
    assert {name.rsplit(".", 1)[1] for name, kind in kinds.items() if kind == "PackedLinear"} == {
        "ff_proj", "up_proj", "ff_out"}
    assert {name.rsplit(".", 1)[1] for name, kind in kinds.items() if kind == "Linear"} == {
        "q_proj", "k_proj", "v_proj", "attn_out", "ff_out"}  # the last ff_out: the LM head (43 x 128)
    norm = "model.transformer.blocks.0.attn_norm.weight"
    assert packed.get_parameter(norm) is model.get_parameter(norm)


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_packed_steps_decode_the_plain_models_tokens(mode, pack_every_linear, monkeypatch):
    model = random_model(LLADA)
    backend = TorchBackend(model, mode=mode)
    with torch.profiler.profile() as profile:
        packed = Generator(backend).generate(PROMPTS, SETTINGS).tokens
    assert torch.equal(packed, plain_tokens(model, monkeypatch))
    calls = {event.key: event.count for event in profile.key_averages()}
    assert calls.get("dlmrt::onednn_linear", 0) > 0


def test_eager_steps_on_a_cpu_run_on_onednn():
    model = dlmrt.load()
    with torch.profiler.profile() as profile:
        result = Generator(model, mode="eager").generate(PROMPTS, SETTINGS)
    calls = {event.key: event.count for event in profile.key_averages()}
    # three packed MLP linears in each of the model's four layers, every forward of the steps
    assert calls["dlmrt::onednn_linear"] == 3 * 4 * result.metrics.forwards_executed


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_the_packed_copy_follows_weights_written_in_place(mode, pack_every_linear, monkeypatch):
    model = random_model(LLADA)
    generator = Generator(model, mode=mode)
    before = generator.generate(PROMPTS, SETTINGS).tokens
    with torch.no_grad():
        for block in model.blocks():
            block.ff_out.weight.mul_(-3.0)
    after = generator.generate(PROMPTS, SETTINGS).tokens
    assert not torch.equal(before, after)
    assert torch.equal(after, plain_tokens(model, monkeypatch))


def test_the_packed_copy_takes_tensors_the_model_was_given(pack_every_linear, monkeypatch):
    model = random_model(LLADA)
    generator = Generator(model, mode="eager")
    before = generator.generate(PROMPTS, SETTINGS).tokens
    for block in model.blocks():
        block.q_proj.weight = nn.Parameter(torch.randn_like(block.q_proj.weight))
        block.attn_norm.weight = nn.Parameter(block.attn_norm.weight.detach() * 4)
    after = generator.generate(PROMPTS, SETTINGS).tokens
    assert not torch.equal(before, after)
    assert torch.equal(after, plain_tokens(model, monkeypatch))
