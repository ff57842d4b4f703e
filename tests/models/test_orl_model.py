"""The ORL tiny model shipped in dlmrt/assets: a residual model of the tiny model's shape that gives
the same tokens on every backend and mode, and whose export holds the dlmrt::ResidualContext op."""

from __future__ import annotations

import json

import pytest
import torch

import dlmrt
from dlmrt.core import hashing, tasks
from dlmrt.runtime import CACHE_MODES, Factor, GenerationSettings, Generator, ResidualPolicy, Threshold, text

POLICIES = [ResidualPolicy(Threshold(0.7)), ResidualPolicy(Threshold(0.9)), ResidualPolicy(Factor(2.0))]


@pytest.fixture(scope="module")
def orl():
    return dlmrt.load(dlmrt.TINY_ORL_MODEL_DIR)


@pytest.fixture(scope="module")
def prompts(orl):
    return [text.encode(orl, e.prompt) for e in tasks.examples("test", 2, seed=11)]


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


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_the_torch_modes_and_device_loop_give_the_same_tokens(orl, prompts, policy):
    expected = Generator(orl, mode="eager").generate(prompts, GenerationSettings(16, 8, policy)).tokens
    compiled = Generator(orl, mode="compile")
    for steps_per_sync in (1, 4, 8):
        settings = GenerationSettings(16, 8, policy, steps_per_sync=steps_per_sync)
        assert torch.equal(compiled.generate(prompts, settings).tokens, expected), steps_per_sync


@pytest.mark.parametrize("cache", CACHE_MODES)
def test_onnx_runtime_gives_the_tokens_of_torch(orl, orl_export, prompts, cache):
    from dlmrt.runtime.ort_backend import OrtBackend

    ort, eager = Generator(OrtBackend(orl_export)), Generator(orl, mode="eager")
    for policy in POLICIES:
        settings = GenerationSettings(16, 8, policy, cache=cache)
        assert torch.equal(ort.generate(prompts, settings).tokens, eager.generate(prompts, settings).tokens), policy


def test_every_exported_graph_holds_the_residual_context_op(orl_export):
    import onnx

    files = sorted(orl_export.glob("*.onnx"))
    assert files
    for path in files:
        nodes = [n for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "ResidualContext"]
        assert len(nodes) == 1 and nodes[0].domain == "dlmrt", path.name


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_the_engines_give_the_tokens_of_torch(orl, orl_export, prompts, cache, tmp_path):
    """TrtBackend binds z and the certainty like every other buffer: through the recording fake of
    TensorRT (the engines run the exported graphs), as on a GPU with TensorRT."""
    from dlmrt.engines import build, targets
    from dlmrt.engines.plan import make_plan
    from dlmrt.engines.profiles import DimRange
    from dlmrt.engines.store import EngineStore
    from dlmrt.runtime.trt_backend import TrtBackend
    from fake_tensorrt import FakeTensorRT, engine_builder

    version = "10.13.0"
    store = EngineStore(tmp_path / "engines")
    plan = make_plan(orl_export, targets.target_named("sm_90"), "bf16", tensorrt=version, store=store.root,
                     ranges={"batch": DimRange(1, 4, 8)})
    build.run(plan, store, device="NVIDIA H200", tensorrt_version=version, engine_builder=engine_builder)
    trt = FakeTensorRT(version)
    engines = Generator(TrtBackend(orl_export, store.root, tensorrt=trt, plugins=trt.register_plugins,
                                   capability=(9, 0), device="cpu"))
    eager = Generator(orl, mode="eager")
    for policy in POLICIES:
        settings = GenerationSettings(16, 8, policy, cache=cache)
        assert torch.equal(engines.generate(prompts, settings).tokens, eager.generate(prompts, settings).tokens), policy
