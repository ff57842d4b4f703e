"""What an int8/int4 CPU export holds (`dlmrt export --precision`, made by dlmrt.quant.cpu_int), and
the check that its graphs are what its manifest records.

    if is_cpu_quantized(manifest): check_quantized(export_dir, manifest)

Each precision turns the weight MatMuls into one ONNX Runtime operator: MatMulNBits (int8, int4: the
weights in blocks of a few bits, activations float32) or MatMulInteger (int8-dynamic: int8 weights, and
activations quantized to int8 as each call runs, by DynamicQuantizeLinear).
"""

from __future__ import annotations

import collections
from pathlib import Path

from dlmrt.core.errors import DlmrtError

MODE = "cpu_int"  # the manifest's quantization["mode"]
# precision -> (the operator its weight MatMuls become, the bits of its weights)
PRECISIONS = {"int8": ("MatMulNBits", 8), "int4": ("MatMulNBits", 4), "int8-dynamic": ("MatMulInteger", 8)}
QUANTIZED_OPS = {op for op, _ in PRECISIONS.values()}


class QuantizedExportError(DlmrtError):
    """A CPU-quantized export whose graphs are not what its manifest records."""


def quantized_matmuls(model) -> collections.Counter:
    """(operator, bits) of every quantized MatMul of an ONNX graph, counted."""
    found = collections.Counter()
    for node in model.graph.node:
        if node.op_type in QUANTIZED_OPS:
            bits = next((a.i for a in node.attribute if a.name == "bits"), 8)  # MatMulInteger: 8
            found[node.op_type, bits] += 1
    return found


def is_cpu_quantized(manifest) -> bool:
    return manifest.quantization is not None and manifest.quantization.get("mode") == MODE


def check_quantized(export_dir: Path, manifest) -> None:
    """A CPU-quantized export's graphs hold exactly the quantized MatMuls its manifest records."""
    import onnx

    quantization = manifest.quantization
    precision = quantization.get("precision")
    operator, bits = PRECISIONS.get(precision, ("?", 0))
    for graph, entry in manifest.graphs.items():
        expected = collections.Counter({(operator, bits): quantization.get("quantized_matmuls", {}).get(graph)})
        found = quantized_matmuls(onnx.load(export_dir / entry.file, load_external_data=False))
        if found != expected:
            held = ", ".join(f"{count} {op} of {width} bits" for (op, width), count in found.items()) or "none"
            raise QuantizedExportError(
                f"{export_dir}: its manifest records {expected[operator, bits]} {operator} nodes of {bits} bits "
                f"({precision}) in {entry.file}, which holds {held}: re-export it (`dlmrt export --precision "
                f"{precision}`)")
