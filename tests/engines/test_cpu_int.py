"""Int8/int4 CPU exports (`dlmrt export --precision`, dlmrt.quant.cpu_int): every weight MatMul
becomes onnxruntime's MatMulNBits (int8, int4) or MatMulInteger (int8-dynamic), whose stored weights
dequantize (written out here from the operators' contracts) to within a step of the float weights; ONNX
Runtime runs the export on a CPU and decodes the tiny model's tasks as float32 does; what cannot run is
refused in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from dlmrt.cli.commands import main
from dlmrt.core.errors import ArgumentError
from dlmrt.quant.cpu_int import quantize_export
from dlmrt.export.export_manifest import MANIFEST_FILE, ExportManifest
from dlmrt.export.cpu_quantized import QuantizedExportError
from dlmrt.runtime import Fixed, GenerationSettings, Generator, text
from dlmrt.runtime.exported_model import ExportedModel
from dlmrt.runtime.ort_backend import OrtBackend

PROMPTS = ["add:762+139=", "rev:hello=", "sort:dcba=", "add:12+34="]


@pytest.fixture(scope="module", params=["int8", "int4", "int8-dynamic"])
def quantized(request, tiny_export, tmp_path_factory):
    """(precision, the quantized copy of the tiny model's export)."""
    return request.param, quantize_export(tiny_export, tmp_path_factory.mktemp("cpu-int") / "export",
                                          precision=request.param, block_size=32)


def dequantized(node, initializers: dict, bits: int) -> np.ndarray:
    """MatMulNBits' weight `[K, N]` from its stored blocks: B `[N, blocks, block_size * bits / 8]` uint8
    (int4: two values a byte, the low nibble first), one float32 scale a block, and without a zero-point
    input the middle of the range, 2**(bits - 1), as zero point."""
    attributes = {a.name: a.i for a in node.attribute}
    k, n, block_size = attributes["K"], attributes["N"], attributes["block_size"]
    packed = numpy_helper.to_array(initializers[node.input[1]]).reshape(n, -1)
    scales = numpy_helper.to_array(initializers[node.input[2]]).reshape(n, -1)
    values = packed if bits == 8 else np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)
    codes = values.astype(np.float32)[:, :scales.shape[1] * block_size].reshape(n, -1, block_size)
    return ((codes - 2 ** (bits - 1)) * scales[..., None]).reshape(n, -1)[:, :k].T


def dynamic_weight(node, initializers: dict) -> tuple[np.ndarray, float]:
    """MatMulInteger's weight `[K, N]` and its step: its inputs are (activation, weight, activation zero
    point, weight zero point), the weight int8 with one scale for the tensor (quantize_dynamic names it
    after the float weight: `W_quantized`, `W_scale`, `W_zero_point`)."""
    name = node.input[1].removesuffix("_quantized")
    step = float(numpy_helper.to_array(initializers[f"{name}_scale"]))
    zero = numpy_helper.to_array(initializers[f"{name}_zero_point"]).astype(np.float32)
    return (numpy_helper.to_array(initializers[node.input[1]]).astype(np.float32) - zero) * step, step


def test_every_weight_matmul_is_stored_within_a_step_of_the_float_weight(tiny_export, quantized):
    precision, export_dir = quantized
    bits = 4 if precision == "int4" else 8
    manifest = ExportManifest.load(export_dir)
    assert manifest.quantization["mode"] == "cpu_int" and manifest.quantization["precision"] == precision
    for graph, entry in manifest.graphs.items():
        source = onnx.load(tiny_export / entry.file)
        weights = {init.name: numpy_helper.to_array(init) for init in source.graph.initializer}
        float_matmuls = [node for node in source.graph.node
                         if node.op_type == "MatMul" and weights.get(node.input[1], np.empty(0)).ndim == 2]
        model = onnx.load(export_dir / entry.file)
        initializers = {init.name: init for init in model.graph.initializer}
        operator = manifest.quantization["operator"]
        quantized_nodes = [node for node in model.graph.node if node.op_type == operator]
        assert len(quantized_nodes) == len(float_matmuls) == manifest.quantization["quantized_matmuls"][graph] > 20
        assert not [node for node in model.graph.node if node.op_type == "MatMul"
                    and node.input[1] in initializers and len(initializers[node.input[1]].dims) == 2]
        by_output = {node.output[0]: node for node in quantized_nodes}
        for float_node in float_matmuls:
            weight = weights[float_node.input[1]]
            if operator == "MatMulInteger":  # its output is int32, scaled after: matched by the weight's name
                node = next(n for n in quantized_nodes if n.input[1] == f"{float_node.input[1]}_quantized")
                stored, step = dynamic_weight(node, initializers)
                error = np.abs(stored - weight) / step
            else:
                node = by_output[float_node.output[0]]
                # Symmetric: a block's largest magnitude maps to -2**(bits - 1) (its scale takes that value's sign),
                # so a step is that magnitude / 2**(bits - 1). Values round to the nearest step, except one of the
                # opposite sign near that magnitude, which clips to 2**(bits - 1) - 1: at most a step away.
                steps = np.abs(weight).reshape(-1, 32, weight.shape[1]).max(axis=1)[:, None, :] / 2 ** (bits - 1)
                error = np.abs(dequantized(node, initializers, bits) - weight).reshape(-1, 32, weight.shape[1]) / steps
            assert error.max() <= 1.0 + 1e-4, float_node.name
            assert np.mean(error <= 0.5 + 1e-4) > 0.99, float_node.name
            assert error.max() > 0  # the weights did change


def test_onnx_runtime_decodes_the_tiny_models_tasks_as_float32_does(tiny_export, quantized):
    precision, export_dir = quantized
    model = ExportedModel.load(export_dir)
    prompts = [text.encode(model, prompt) for prompt in PROMPTS]
    settings = GenerationSettings(16, 8, Fixed(steps=16))
    expected = Generator(OrtBackend(tiny_export)).generate(prompts, settings).tokens
    tokens = Generator(OrtBackend(export_dir)).generate(prompts, settings).tokens
    agreement = (tokens == expected).float().mean().item()
    assert agreement == 1.0 if precision != "int4" else agreement >= 0.95


def test_a_block_size_that_does_not_divide_the_weights_is_refused(tiny_export, tmp_path):
    with pytest.raises(ArgumentError, match="widths 128, which do not divide into blocks of 256 "
                                            r"\(block sizes that fit: 16, 32, 64, 128\)"):
        quantize_export(tiny_export, tmp_path / "out", precision="int4", block_size=256)
    assert not (tmp_path / "out").exists()


def test_a_quantized_export_runs_on_the_cpu_only(quantized):
    from dlmrt.engines.plan import PlanError, make_plan
    from dlmrt.engines.targets import TARGETS

    _, export_dir = quantized
    with pytest.raises(ArgumentError, match="export, a CPU format: run it with --device cpu"):
        OrtBackend(export_dir, device="cuda")
    with pytest.raises(PlanError, match="an ONNX Runtime CPU operator TensorRT does not build"):
        make_plan(export_dir, next(iter(TARGETS.values())), "bf16", tensorrt="10.9", store=export_dir)


def test_a_manifest_that_does_not_match_its_graphs_is_refused(quantized, tmp_path):
    precision, export_dir = quantized
    copy = shutil.copytree(export_dir, tmp_path / "edited")
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["quantization"]["precision"] = {"int8": "int4", "int4": "int8", "int8-dynamic": "int8"}[precision]
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(QuantizedExportError, match="its manifest records"):
        OrtBackend(copy)


@pytest.mark.parametrize("args, message", [
    (["--precision", "int8", "--verify"], "--verify compares at float32 tolerances"),
    (["--precision", "int4", "--dtype", "bfloat16"], "--precision int4 quantizes a float32 export: drop --dtype"),
    (["--asymmetric"], "--quant-block-size and --asymmetric apply with --precision int8 or int4"),
    (["--precision", "int3"], "Invalid value for '--precision'"),
])
def test_export_refuses_a_precision_it_cannot_make_before_exporting(args, message, tmp_path, monkeypatch):
    monkeypatch.setattr("dlmrt.export.onnx_export.export", lambda *a, **k: pytest.fail("exported"))
    result = CliRunner().invoke(main, ["export", "-o", str(tmp_path / "out"), *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
