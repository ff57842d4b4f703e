"""Int8 and int4 step graphs for ONNX Runtime on a CPU, through onnxruntime's own quantizers.

    quantize_export(export_dir, out_dir, precision="int8")              # every graph, as a new export directory
    quantize_export(export_dir, out_dir, precision="int4", block_size=128, symmetric=False)
    quantize_export(export_dir, out_dir, precision="int8-dynamic")

Only the weight MatMuls (a constant 2-D weight: the projections, the MLPs and the LM head) are
quantized; attention, norms, the softmax and the `dlmrt::ParallelUnmask` node stay float32.

- int8, int4 (weight-only): `MatMulNBitsQuantizer` turns each into a `com.microsoft` MatMulNBits node,
  the weight stored in `bits`-bit integers in blocks of `block_size` along its input width, each block
  with a float32 scale (and, asymmetric, a zero point), dequantized inside the kernel. Activations stay
  float32. It saves memory and bandwidth; on a small CPU its kernels need not beat float32 (measured in
  docs/engines.md).
- int8-dynamic: `quantize_dynamic` stores each weight as int8 with one scale, and quantizes the activation
  to int8 at every call (DynamicQuantizeLinear), so the MatMul itself runs on int8 (MatMulInteger).

Nothing is calibrated. ONNX Runtime's CPU provider runs both operators; TensorRT builds neither, so these
are CPU exports (`dlmrt.export.cpu_quantized`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dlmrt.core.errors import ArgumentError
from dlmrt.quant.quantized_copy import quantized_copy
from dlmrt.export.cpu_quantized import MODE, PRECISIONS, quantized_matmuls

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
    widths = [k for k, _ in _weight_matmuls(model).values()]
    ragged = sorted({k for k in widths if k % block_size})
    if ragged:
        fit = [size for size in BLOCK_SIZES if all(k % size == 0 for k in widths)]
        raise ArgumentError(f"--precision {precision} with blocks of {block_size}: {graph}'s weights have input "
                            f"widths {', '.join(map(str, ragged))}, which do not divide into blocks of {block_size} "
                            f"(block sizes that fit: {', '.join(map(str, fit)) or 'none'})")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """onnxruntime's quantizers log a line for every node at INFO, and advice on the root logger."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def quantize_graph(in_path: Path, out_path: Path, *, precision: str, block_size: int, symmetric: bool) -> None:
    """One graph's weight MatMuls quantized into `out_path`."""
    import onnx

    model = onnx.load(in_path)
    operator, bits = PRECISIONS[precision]
    with _quiet():
        if operator == "MatMulNBits":
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

            check_widths(model, block_size, precision, in_path.name)
            quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=symmetric)
            quantizer.process()
            quantizer.model.save_model_to_file(str(out_path), use_external_data_format=False)
        else:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantize_dynamic(in_path, out_path, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                             nodes_to_quantize=list(_weight_matmuls(model)))


def quantize_export(export_dir: str | Path, out_dir: str | Path, *, precision: str,
                    block_size: int = DEFAULT_BLOCK_SIZE, symmetric: bool = True,
                    on_graph: Callable[[str], None] | None = None) -> Path:
    """An int8/int4 copy of the float32 export `export_dir` in `out_dir` (written atomically); its manifest
    records the quantization. `OrtBackend(out_dir)` runs it on a CPU. `block_size` and `symmetric` apply to
    the weight-only precisions."""
    import onnx
    import onnxruntime

    from dlmrt.export.export_manifest import ExportManifest

    if precision not in PRECISIONS:
        raise ArgumentError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if block_size not in BLOCK_SIZES:
        raise ArgumentError(f"the block size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size}")
    export_dir = Path(export_dir)
    manifest = ExportManifest.read(export_dir)  # quantized_copy checks its files
    if manifest.quantization is not None:
        raise ArgumentError(f"{export_dir} is already quantized ({manifest.quantization.get('mode')}): quantize a "
                            f"float32 export")
    if manifest.model.dtype != "float32":
        raise ArgumentError(f"--precision {precision} quantizes float32 weights; {export_dir} holds "
                            f"{manifest.model.dtype}: export with --dtype float32")
    operator, bits = PRECISIONS[precision]
    started, counts = time.perf_counter(), {}

    def quantize(graph: str, source: Path, target: Path) -> None:
        quantize_graph(source, target, precision=precision, block_size=block_size, symmetric=symmetric)
        counts[graph] = quantized_matmuls(onnx.load(target))[operator, bits]

    def describe() -> dict:
        weights = {"block_size": block_size, "symmetric": symmetric} if operator == "MatMulNBits" else \
            {"weights": "int8, one scale a tensor", "activations": "int8, quantized at each call"}
        return {"quantization": {"mode": MODE, "precision": precision, "operator": operator, "bits": bits, **weights,
                                 "tool": f"onnxruntime {onnxruntime.__version__}", "quantized_matmuls": counts,
                                 "seconds": round(time.perf_counter() - started, 2)}}

    return quantized_copy(export_dir, out_dir, quantize, describe, on_graph)
