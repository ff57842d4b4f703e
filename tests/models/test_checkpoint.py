"""Hugging Face directories: save -> load round trips, shards, dtypes, special tokens."""

from __future__ import annotations

import json

import pytest
import torch

import dlmrt
from dlmrt.models import checkpoint
from helpers import LLADA, LLADA2, ORL, config, random_model

IDS = torch.tensor([[5, 9, 13, 2, 2, 2, 2, 20], [7, 7, 30, 31, 2, 2, 2, 2]])


def test_round_trip_gives_identical_logits(saved_model):
    model, directory = saved_model
    loaded = dlmrt.load(directory)
    assert torch.equal(loaded(IDS), model(IDS))
    assert loaded.tokens == model.tokens
    assert loaded.tokenizer.encode("add:1+2=").ids == model.tokenizer.encode("add:1+2=").ids


@pytest.mark.parametrize("base", [LLADA, LLADA2], ids=["llada", "llada2_moe"])
def test_round_trip_with_residual_pathway(tmp_path, base):
    model = random_model(config(base, residual_context=ORL))
    loaded = dlmrt.load(checkpoint.save(model, tmp_path / "orl"))
    residual = model.denoise(IDS).residual
    expected = model.denoise(IDS, residual=residual)
    actual = loaded.denoise(IDS, residual=residual)
    assert torch.equal(actual.logits, expected.logits)
    assert torch.equal(actual.residual.z, expected.residual.z)


def test_sharded_checkpoint_loads(tmp_path, family_config):
    model = random_model(family_config)
    directory = checkpoint.save(model, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((directory / checkpoint.INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (directory / checkpoint.SINGLE_FILE).exists()
    assert torch.equal(dlmrt.load(directory)(IDS), model(IDS))


def test_bf16_and_fp16_load(saved_model):
    model, directory = saved_model
    reference = model(IDS)
    for dtype, tolerance in (("bfloat16", 0.1), ("float16", 0.02)):
        loaded = dlmrt.load(directory, dtype=dtype)
        assert all(p.dtype == getattr(torch, dtype) for p in loaded.parameters())
        logits = loaded(IDS)
        assert logits.dtype == getattr(torch, dtype)
        torch.testing.assert_close(logits.float(), reference, atol=tolerance, rtol=tolerance)


def test_bf16_checkpoint_round_trip_and_auto_dtype(tmp_path):
    model = random_model(LLADA).to(torch.bfloat16)
    directory = checkpoint.save(model, tmp_path / "bf16")
    assert json.loads((directory / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = dlmrt.load(directory, dtype="auto")
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded(IDS), model(IDS))
    assert dlmrt.load(directory).dtype == torch.float32


def test_special_tokens_come_from_config_then_generation_config(tmp_path):
    raw = config(LLADA)
    del raw["mask_token_id"], raw["eos_token_id"], raw["pad_token_id"]
    model = random_model(LLADA)
    model.raw_config = raw
    directory = checkpoint.save(model, tmp_path / "m")
    generation = {"mask_token_id": 3, "eos_token_id": [1, 4], "pad_token_id": 0}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    (directory / "config.json").write_text(json.dumps(raw))
    loaded = dlmrt.load(directory)
    assert (loaded.tokens.mask_id, loaded.tokens.eos_ids, loaded.tokens.pad_id) == (3, (1, 4), 0)
    overridden = dlmrt.load(directory, mask_id=2, eos_id=5, pad_id=6)
    assert (overridden.tokens.mask_id, overridden.tokens.eos_ids, overridden.tokens.pad_id) == (2, (5,), 6)


def test_mask_id_falls_back_to_the_tokenizer(tmp_path):
    raw = config(LLADA)
    del raw["mask_token_id"]
    model = random_model(LLADA)
    directory = checkpoint.save(model, tmp_path / "m")
    (directory / "config.json").write_text(json.dumps(raw))
    (directory / "generation_config.json").unlink()
    assert dlmrt.load(directory).tokens.mask_id == model.tokenizer.token_to_id("<|mask|>")


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = random_model(LLADA)
    directory = checkpoint.save(model, tmp_path / "m")
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(random_model(LLADA, seed=7), directory)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_loading_a_model_leaves_the_compiler_unimported_and_the_initializers_as_they_were():
    """Start-up: a meta-device build skips nn.init's fills, whose meta path imports torch._dynamo (0.9 s)."""
    import subprocess
    import sys

    script = ("import sys, torch; from torch import nn; before = nn.init.normal_; import dlmrt; "
              "dlmrt.load(dlmrt.TINY_MODEL_DIR); assert 'torch._dynamo' not in sys.modules, 'compiler imported'; "
              "assert nn.init.normal_ is before; layer = nn.Linear(4, 4); assert layer.weight.abs().sum() > 0")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
