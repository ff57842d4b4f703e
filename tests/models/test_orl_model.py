"""The ORL tiny model shipped in dlmrt/assets: a residual model of the tiny model's shape whose export
holds the dlmrt::ResidualContext op. That it gives the same tokens on every backend and mode is the
parity matrix's `llada-orl` subject (tests/parity_matrix.py)."""

from __future__ import annotations

import json

import pytest

import dlmrt
from dlmrt.core import hashing


@pytest.fixture(scope="module")
def orl():
    return dlmrt.load(dlmrt.TINY_ORL_MODEL_DIR)


@pytest.fixture(scope="module")
def orl_export(exports):
    pytest.importorskip("onnxruntime", reason="the ONNX path needs the 'onnx' extra")
    return exports["tiny_orl"]


def test_it_is_the_tiny_model_with_a_residual_pathway(orl):
    base = dlmrt.load()
    assert orl.residual_config is not None and base.residual_config is None
    base_names = set(base.state_dict())
    assert base_names < set(orl.state_dict())
    assert all("residual_adapter" in name for name in set(orl.state_dict()) - base_names)
    assert sum(f.stat().st_size for f in dlmrt.TINY_ORL_MODEL_DIR.iterdir()) < 10 * 2**20
    assert orl.residual_adapter().output_layer().weight.abs().max() > 0  # the adapter was trained


def test_its_report_names_the_base_it_started_from_and_its_weights():
    report = json.loads((dlmrt.TINY_ORL_MODEL_DIR / "training_report.json").read_text())
    assert report["method"] == "orl" and report["config"]["residual"] is True
    assert report["base_weights_sha256"] == hashing.sha256_of(dlmrt.TINY_MODEL_DIR / "model.safetensors")
    assert report["weights_sha256"] == hashing.sha256_of(dlmrt.TINY_ORL_MODEL_DIR / "model.safetensors")


def test_every_exported_graph_holds_the_residual_context_op(orl_export):
    import onnx

    files = sorted(orl_export.glob("*.onnx"))
    assert files
    for path in files:
        nodes = [n for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "ResidualContext"]
        assert len(nodes) == 1 and nodes[0].domain == "dlmrt", path.name
