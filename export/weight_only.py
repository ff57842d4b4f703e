"""What a weight-only export holds (`dlmrt export --precision int8|int4`, made by
dlmrt.engines.quant.weight_only), and the check that its graphs are what its manifest records.

    if is_weight_only(manifest): check_quantized(export_dir, manifest)
"""

from __future__ import annotations

import collections
from pathlib import Path

from dlmrt.core.errors import DlmrtError

MODE = "weight_only"  # the manifest's quantization["mode"]
QUANTIZED_OP = "MatMulNBits"  # onnxruntime's com.microsoft operator


class QuantizedExportError(DlmrtError):
    """A weight-only export whose graphs are not what its manifest records."""


def quantized_matmuls(model, bits: int) -> int:
    return sum(1 for node in model.graph.node if node.op_type == QUANTIZED_OP and
               any(a.name == "bits" and a.i == bits for a in node.attribute))


def is_weight_only(manifest) -> bool:
    return manifest.quantization is not None and manifest.quantization.get("mode") == MODE


def check_quantized(export_dir: Path, manifest) -> None:
    """A weight-only export's graphs hold the MatMulNBits nodes its manifest records, of its bit width."""
    import onnx

    quantization = manifest.quantization
    for graph, entry in manifest.graphs.items():
        expected = quantization.get("quantized_matmuls", {}).get(graph)
        model = onnx.load(export_dir / entry.file, load_external_data=False)
        found = quantized_matmuls(model, quantization.get("bits"))
        others = collections.Counter(node.op_type for node in model.graph.node)[QUANTIZED_OP] - found
        if found != expected or others:
            raise QuantizedExportError(
                f"{export_dir}: its manifest records {expected} {quantization.get('precision')} MatMulNBits nodes in "
                f"{entry.file}, which holds {found}" + (f" and {others} of another bit width" if others else "") +
                f": re-export it (`dlmrt export --precision {quantization.get('precision')}`)")
