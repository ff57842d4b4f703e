"""Int8 and int4 weight-only step graphs for ONNX Runtime on a CPU: onnxruntime's own MatMulNBits quantizer.

    quantize_export(export_dir, out_dir, bits=8)                      # every graph, as a new export directory
    quantize_export(export_dir, out_dir, bits=4, block_size=128, symmetric=False)

Every MatMul whose weight is a constant (the projections, the MLPs and the LM head) becomes a
`com.microsoft` MatMulNBits node: the weight stored in `bits`-bit integers in blocks of `block_size`
along its input dimension, each block with a float32 scale (and, asymmetric, a zero point), dequantized
inside the kernel; activations, attention and the `dlmrt::ParallelUnmask` node stay float32. Nothing is
calibrated. ONNX Runtime's CPU provider runs MatMulNBits; TensorRT does not, so these are CPU exports.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from dlmrt.core import atomic
from dlmrt.core.errors import ArgumentError
from dlmrt.export.weight_only import MODE, quantized_matmuls

PRECISIONS = {"int8": 8, "int4": 4}  # `dlmrt export --precision`
BLOCK_SIZES = (16, 32, 64, 128, 256)  # what MatMulNBits takes
DEFAULT_BLOCK_SIZE = 32


def _weight_matmuls(model) -> dict[str, tuple[int, int]]:
    """The MatMuls with a constant 2-D weight, by node name: (input width K, output width N)."""
    weights = {init.name: tuple(init.dims) for init in model.graph.initializer}
    return {node.name: weights[node.input[1]] for node in model.graph.node
            if node.op_type == "MatMul" and len(weights.get(node.input[1], ())) == 2}


def check_widths(model, block_size: int, precision: str, graph: str) -> None:
    """Every weight's input width must divide into whole blocks: a ragged last block would be padded with
    zeros that the scale is then fitted to."""
    ragged = sorted({k for k, _ in _weight_matmuls(model).values() if k % block_size})
    if ragged:
        fit = [size for size in BLOCK_SIZES if all(k % size == 0 for k, _ in _weight_matmuls(model).values())]
        raise ArgumentError(f"--precision {precision} with blocks of {block_size}: {graph}'s weights have input "
                            f"widths {', '.join(map(str, ragged))}, which do not divide into blocks of {block_size} "
                            f"(block sizes that fit: {', '.join(map(str, fit)) or 'none'})")


def quantize_graph(in_path: Path, out_path: Path, *, bits: int, block_size: int, symmetric: bool,
                   precision: str) -> int:
    """One graph quantized into `out_path`; returns how many MatMuls became MatMulNBits."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger(MatMulNBitsQuantizer.__module__).setLevel(logging.WARNING)  # a line for every node, at INFO
    model = onnx.load(in_path)
    check_widths(model, block_size, precision, in_path.name)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric)
    quantizer.process()
    quantizer.model.save_model_to_file(str(out_path), use_external_data_format=False)
    return quantized_matmuls(onnx.load(out_path), bits)


def quantize_export(export_dir: str | Path, out_dir: str | Path, *, bits: int, block_size: int = DEFAULT_BLOCK_SIZE,
                    symmetric: bool = True, on_graph: Callable[[str], None] | None = None) -> Path:
    """A weight-only copy of the float32 export `export_dir` in `out_dir` (written atomically); its manifest
    records the quantization. `OrtBackend(out_dir)` runs it on a CPU."""
    import onnxruntime

    from dlmrt.export.export_manifest import ExportManifest

    precision = {value: name for name, value in PRECISIONS.items()}[bits]
    if block_size not in BLOCK_SIZES:
        raise ArgumentError(f"the block size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size}")
    export_dir = Path(export_dir)
    manifest = ExportManifest.load(export_dir)
    if manifest.quantization is not None:
        raise ArgumentError(f"{export_dir} is already quantized ({manifest.quantization.get('mode')}): quantize a "
                            f"float32 export")
    if manifest.model.dtype != "float32":
        raise ArgumentError(f"--precision {precision} quantizes float32 weights; {export_dir} holds "
                            f"{manifest.model.dtype}: export with --dtype float32")
    started, counts = time.perf_counter(), {}
    with atomic.directory(out_dir, replaces=ExportManifest.present, what="a dlmrt export") as staging:
        for graph, entry in manifest.graphs.items():
            counts[graph] = quantize_graph(export_dir / entry.file, staging / entry.file, bits=bits,
                                           block_size=block_size, symmetric=symmetric, precision=precision)
            if on_graph is not None:
                on_graph(graph)
        for name in manifest.files:
            if name not in {entry.file for entry in manifest.graphs.values()}:
                shutil.copy2(export_dir / name, staging / name)
        quantization = {"mode": MODE, "precision": precision, "bits": bits, "block_size": block_size,
                        "symmetric": symmetric, "tool": f"onnxruntime {onnxruntime.__version__} MatMulNBitsQuantizer",
                        "quantized_matmuls": counts, "seconds": round(time.perf_counter() - started, 2)}
        manifest.with_files(staging, quantization=quantization).save(staging)
    return Path(out_dir)
