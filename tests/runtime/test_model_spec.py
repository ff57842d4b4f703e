"""ModelSpec: one description of the model, whether the runtime has the torch model or its export."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("onnxruntime", reason="the exports need the 'onnx' extra")

from dlmrt.export.export_manifest import ExportManifest  # noqa: E402
from dlmrt.models.description import ModelDescription, SpecialTokens  # noqa: E402
from dlmrt.runtime.model_spec import ModelSpec  # noqa: E402
from shared_exports import ASSETS, DATA, SHARED_EXPORTS  # noqa: E402


def test_the_tiny_models_description_is_its_config():
    """Written out by hand from dlmrt/assets/tiny-llada/config.json."""
    raw = json.loads((ASSETS / "tiny-llada" / "config.json").read_text())
    spec = ModelSpec.of_model(SHARED_EXPORTS["tiny"].model())
    assert spec.model == ModelDescription(
        name="tiny-llada", model_type="llada", dtype="float32", vocab_size=raw["vocab_size"],
        hidden_size=raw["d_model"], num_layers=raw["n_layers"], num_kv_heads=raw["n_kv_heads"],
        head_dim=raw["d_model"] // raw["n_heads"], max_positions=raw["max_sequence_length"], block_causal=False,
        block_grid=None, residual=False)
    assert spec.tokens == SpecialTokens(raw["mask_token_id"], (raw["eos_token_id"],), raw["pad_token_id"])
    assert (spec.vocab_size, spec.hidden_size, spec.num_layers, spec.num_kv_heads, spec.head_dim) == (43, 128, 4, 2, 32)
    assert (spec.mask_id, spec.eos_ids, spec.pad_id) == (2, (1,), 0)
    assert spec.dtype is torch.float32 and spec.max_positions == 64 and spec.limits_hint == ""


@pytest.mark.parametrize("name, grid, shift", [("tiny", None, 0), ("llada21", 4, 0), ("dream", None, 1)])
def test_a_torch_model_and_its_export_describe_the_same_model(exports, name, grid, shift):
    model = SHARED_EXPORTS[name].model()
    directory = exports[name]
    manifest = ExportManifest.read(directory)
    torch_spec = ModelSpec.of_model(model)
    export_spec = ModelSpec.of_export(manifest, directory, torch.device("cpu"))
    assert export_spec.model == dataclasses.replace(torch_spec.model, block_grid=grid)
    assert export_spec.tokens == torch_spec.tokens
    assert export_spec.logits_shift == torch_spec.logits_shift == shift  # the family's, not in dlmrt.json
    assert "logits_shift" not in json.loads((directory / "dlmrt.json").read_text())["model"]
    # the runtime's own: an export runs up to the length it was made for
    assert export_spec.max_positions == SHARED_EXPORTS[name].options["max_length"] == manifest.limits.max_length
    assert torch_spec.max_positions == model.max_positions
    assert str(directory) in export_spec.limits_hint


def test_an_old_manifest_still_reads():
    manifest = ExportManifest.read(DATA / "export-v1")
    assert manifest.model == ModelDescription(
        name="llada21", model_type="llada2_moe", dtype="float32", vocab_size=64, hidden_size=32, num_layers=2,
        num_kv_heads=2, head_dim=8, max_positions=128, block_causal=True, block_grid=4, residual=False)
    assert json.loads((DATA / "export-v1" / "dlmrt.json").read_text()) == manifest.to_dict()


def test_a_model_without_token_ids_has_no_spec():
    model = SHARED_EXPORTS["llada"].model()
    model.tokens = None
    with pytest.raises(ValueError, match="has no special token ids"):
        ModelSpec.of_model(model)
