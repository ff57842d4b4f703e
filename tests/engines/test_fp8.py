"""FP8 step graphs: calibration feeds from the real step loop, modelopt's ONNX PTQ, and the FP8 graph
in ONNX Runtime against the fp32 one."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="the ONNX path needs the 'onnx' extra")

import onnx  # noqa: E402

from dlmrt.core import tasks  # noqa: E402
from dlmrt.quant.calibration import CalibrationError, calibration_feeds, load_prompts  # noqa: E402
from dlmrt.core.errors import MissingExtraError  # noqa: E402
from dlmrt.export.export_manifest import ExportManifest  # noqa: E402
from dlmrt.export.onnx_export import graph_file  # noqa: E402
from dlmrt.runtime import Fixed, GenerationSettings, Generator, Threshold, text  # noqa: E402
from dlmrt.runtime.exported_model import ExportedModel  # noqa: E402
from dlmrt.runtime.ort_backend import OrtBackend  # noqa: E402

needs_modelopt = pytest.mark.skipif(importlib.util.find_spec("modelopt") is None,
                                    reason="FP8 quantization needs nvidia-modelopt: pip install 'dlmrt[quant]'")
CALIBRATION_COUNT = 8
# Measured on the tiny model as retrained with the `same` task (8 calibration steps a graph, max
# calibration; 64 test prompts; fixed and threshold policies; no cache and dual cache): 97.85% to
# 98.05% of the tokens equal fp32's, exact-match 0 to 1.6 points below fp32's 98.4%. (The earlier
# three-task model gave 99.87% to 100%.) A broken FP8 graph (an infinite scale on the attention mask)
# gave 73% and 0%.
MIN_AGREEMENT = 0.97
MAX_EXACT_MATCH_DROP = 0.07


@pytest.fixture(scope="module")
def fp8_export(tiny_export, tmp_path_factory):
    """(FP8 export directory, reports by graph) of the tiny model."""
    from dlmrt.quant.fp8 import quantize_export

    return quantize_export(tiny_export, tmp_path_factory.mktemp("fp8") / "tiny-fp8", count=32)


@pytest.mark.parametrize("graph", ["full", "cached"])
def test_calibration_feeds_have_the_graph_inputs(tiny_export, graph):
    feeds = calibration_feeds(tiny_export, graph, count=CALIBRATION_COUNT)
    assert len(feeds) == CALIBRATION_COUNT
    contract = ExportManifest.read(tiny_export).graphs[graph].inputs
    for feed in feeds:
        assert list(feed) == [value.name for value in contract]
        for value in contract:
            array = feed[value.name]
            assert isinstance(array, np.ndarray) and array.dtype.name == value.dtype, value
            assert len(array.shape) == len(value.shape), value
            assert all(found == wanted for found, wanted in zip(array.shape, value.shape) if isinstance(wanted, int))
    steps = {int(feed["step"][0]) for feed in feeds}
    assert len(steps) > 1  # the steps of a block, not one step repeated
    if graph == "cached":
        assert all(feed["past_kv"].shape[4] > 0 for feed in feeds)


def test_calibration_feeds_come_from_the_given_prompts(tiny_export, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("sort:9713=\n\nrev:abcd=\n")
    feeds = calibration_feeds(tiny_export, "full", path, count=2)
    model = ExportedModel.load(tiny_export)
    first = feeds[0]["ids"]
    assert first.shape[0] == 2
    real = first[0][feeds[0]["key_mask"][0]]  # the row's tokens, past its left padding
    assert real[:len("sort:9713=")].tolist() == text.encode(model, "sort:9713=")
    assert load_prompts(path) == ["sort:9713=", "rev:abcd="]


@pytest.mark.parametrize("content, message", [
    ("", r"holds no prompts"),
    ('{"prompt": "add:001+002="}\n{"prompt": \n', r"prompts.jsonl:2 is not valid JSON"),
    ('{"prompt": "add:001+002="}\n{"answer": "3"}\n', r'prompts.jsonl:2 has no "prompt" string'),
])
def test_a_malformed_prompt_file_is_refused(tiny_export, tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(CalibrationError, match=message):
        calibration_feeds(tiny_export, "full", path)


def test_calibration_options_are_checked(tiny_export, tmp_path):
    with pytest.raises(CalibrationError, match=r"has no 'full_guided' graph \(it has full, cached\)"):
        calibration_feeds(tiny_export, "full_guided")
    with pytest.raises(CalibrationError, match="count must be positive"):
        calibration_feeds(tiny_export, count=0)
    with pytest.raises(CalibrationError, match=r"missing.txt cannot be read \(No such file or directory\)"):
        calibration_feeds(tiny_export, prompts=tmp_path / "missing.txt")


def test_without_modelopt_the_error_names_the_extra(tiny_export, tmp_path, monkeypatch):
    from dlmrt.quant.fp8 import quantize_onnx

    monkeypatch.setitem(sys.modules, "modelopt.onnx.quantization", None)  # import fails as if not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'dlmrt\[quant\]'"):
        quantize_onnx(tiny_export / graph_file("full"), tmp_path / "out.onnx", [])


@needs_modelopt
@pytest.mark.parametrize("graph", ["full", "cached"])
def test_the_fp8_graph_has_qdq_around_every_matmul(fp8_export, graph):
    directory, reports = fp8_export
    model = onnx.load(directory / graph_file(graph))
    producers = {output: node for node in model.graph.node for output in node.output}
    types = {init.name: init.data_type for init in model.graph.initializer}
    matmuls = [node for node in model.graph.node if node.op_type == "MatMul"]
    assert matmuls
    for node in matmuls:
        for name in node.input:
            dq = producers[name]
            assert dq.op_type == "DequantizeLinear", node.name
            assert types[dq.input[2]] == onnx.TensorProto.FLOAT8E4M3FN
            q = producers[dq.input[0]]
            assert q.op_type == "QuantizeLinear" and types[q.input[2]] == onnx.TensorProto.FLOAT8E4M3FN
    assert reports[graph].fp8_matmuls == reports[graph].matmuls == len(matmuls)
    assert {o.domain: o.version for o in model.opset_import}[""] >= 19


@needs_modelopt
def test_the_custom_node_and_its_functions_survive(fp8_export, tiny_export):
    directory, _ = fp8_export
    for graph in ("full", "cached"):
        original, quantized = (onnx.load(d / graph_file(graph)) for d in (tiny_export, directory))
        nodes = [n for n in quantized.graph.node if n.domain == "dlmrt"]
        assert [n.op_type for n in nodes] == ["ParallelUnmask"]
        before = [n for n in original.graph.node if n.domain == "dlmrt"][0]
        assert list(nodes[0].attribute) == list(before.attribute)
        assert [(f.name, len(f.node)) for f in quantized.functions] == \
            [(f.name, len(f.node)) for f in original.functions]


@needs_modelopt
def test_the_check_refuses_a_graph_without_fp8(tiny_export):
    from dlmrt.quant.fp8 import FP8Error, check_fp8_graph

    with pytest.raises(FP8Error, match="none of the graph's 37 MatMuls reads its inputs through FP8 Q/DQ"):
        check_fp8_graph(onnx.load(tiny_export / graph_file("full")))


@needs_modelopt
def test_the_input_export_is_left_unchanged(fp8_export, tiny_export):
    OrtBackend(tiny_export)  # checks every file against the manifest's sha256


@needs_modelopt
def test_ort_runs_the_fp8_graphs_close_to_fp32(fp8_export, tiny_export):
    directory, _ = fp8_export
    manifest = ExportManifest.load(directory)  # the copied files' hashes were taken afresh
    assert manifest.quantization["mode"] == "fp8" and manifest.opset == 19
    model = ExportedModel.load(tiny_export)
    examples = tasks.examples("test", 16, seed=1)
    prompts = [text.encode(model, example.prompt) for example in examples]
    fp32, fp8 = Generator(OrtBackend(tiny_export)), Generator(OrtBackend(directory))
    for cache in ("none", "dual"):
        for policy in (Fixed(16), Threshold(0.9)):
            settings = GenerationSettings(16, 8, policy, cache=cache)
            runs = {}
            for name, generator in (("fp32", fp32), ("fp8", fp8)):
                results = [generator.generate(prompts[i:i + 8], settings) for i in range(0, len(prompts), 8)]
                tokens = torch.cat([r.tokens for r in results])
                rows = [row for r in results for row in r.rows]
                right = sum(tasks.is_correct(e, text.decode(model, row.token_ids)) for row, e in zip(rows, examples))
                runs[name] = (tokens, right / len(examples))
            agreement = (runs["fp8"][0] == runs["fp32"][0]).float().mean().item()
            assert agreement >= MIN_AGREEMENT, (cache, policy, agreement)
            assert runs["fp8"][1] >= runs["fp32"][1] - MAX_EXACT_MATCH_DROP, (cache, policy, runs)


@needs_modelopt
def test_the_fp8_graph_computes_something_else_than_fp32(fp8_export, tiny_export):
    """Near fp32, yet not fp32: the Q/DQ nodes are in effect. The window's K/V (measured: 2.9% mean
    relative difference) shows it on a continuous output."""
    import onnxruntime as ort

    directory, _ = fp8_export
    feed = calibration_feeds(tiny_export, "full", count=1)[0]
    kv = {}
    for name, d in (("fp32", tiny_export), ("fp8", directory)):
        session = ort.InferenceSession(str(d / graph_file("full")), providers=["CPUExecutionProvider"])
        kv[name] = session.run(["kv"], feed)[0]
    relative = np.abs(kv["fp8"] - kv["fp32"]).mean() / np.abs(kv["fp32"]).mean()
    assert 0.005 < relative < 0.1
