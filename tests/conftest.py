"""Shared fixtures: random models of each family, written as real checkpoints."""

from __future__ import annotations

import pytest

from dlmrt.export import checkpoint
from helpers import LLADA, LLADA2, random_model


@pytest.fixture(params=["llada", "llada2_moe"])
def family_config(request) -> dict:
    return {"llada": LLADA, "llada2_moe": LLADA2}[request.param]


@pytest.fixture
def saved_model(tmp_path, family_config):
    """(model, directory) of a random model saved as a Hugging Face checkpoint."""
    model = random_model(family_config)
    directory = checkpoint.save(model, tmp_path / "model")
    return model, directory


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """The tiny model's step graphs (full and cached), exported once per test session."""
    import dlmrt
    from dlmrt.export import onnx_export

    return onnx_export.export(dlmrt.load(), tmp_path_factory.mktemp("tiny-export") / "tiny", max_batch=8,
                              max_length=64)
