"""FP8 step graphs: nvidia-modelopt's ONNX post-training quantization (`quantize_mode="fp8"`).

    report = quantize_onnx("step_full.onnx", "step_full.fp8.onnx", calibration_feeds(export, "full"))
    quantize_export(export_dir, fp8_dir)      # every graph of an export, as a new export directory

The result is a Q/DQ graph: each MatMul reads its two inputs (activation and weight, or the two
activations in attention) through QuantizeLinear -> DequantizeLinear pairs with FLOAT8E4M3FN zero
points, and everything else stays in float32. TensorRT builds FP8 GEMMs from that pattern (compute
capability 8.9+); ONNX Runtime's CPU provider runs it as is, which is how accuracy is measured here.

Calibration runs in ONNX Runtime's CPU provider only. Only MatMul and Gemm nodes are quantized, so
the `dlmrt::ParallelUnmask` node and its local functions pass through; this module checks that
they did. Two things modelopt does are worked around, not relied on:
- it moves a graph below opset 19 (the first with float8 Q/DQ) to 19 with onnx's version
  converter, which drops the model's local functions; the graph is moved to 19 here first, the
  functions with it;
- it writes inferred shapes into its input file, so it only ever sees a temporary copy.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from dlmrt.core import atomic
from dlmrt.core.errors import DlmrtError, MissingExtraError
from dlmrt.quant.calibration import CalibrationError, calibration_feeds
from dlmrt.quant.quantized_copy import quantized_copy

FP8_OPSET = 19  # float8 QuantizeLinear/DequantizeLinear
FP8_TYPE = onnx.TensorProto.FLOAT8E4M3FN
# modelopt would also quantize Adds; the attention mask's Add holds -inf, which gets an infinite
# scale and turns every score into nan. FP8 GEMMs need Q/DQ on the MatMul inputs only.
QUANTIZED_OPS = ("MatMul", "Gemm")
INSTALL_HINT = "pip install 'dlmrt[quant]'"
CUSTOM_DOMAIN = "dlmrt"


class FP8Error(DlmrtError, RuntimeError):
    """modelopt's FP8 quantization failed, or gave a graph that is not the FP8 Q/DQ graph expected."""


@dataclass(frozen=True)
class FP8Report:
    in_path: str
    out_path: str
    calibration_feeds: int
    calibration_method: str
    matmuls: int
    fp8_matmuls: int  # MatMuls whose two inputs both come through FP8 Q/DQ
    qdq_pairs: int
    custom_nodes: list[str]  # op types of the nodes in the dlmrt domain, kept as they were
    modelopt_version: str
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def _modelopt_quantize() -> Callable:
    try:
        from modelopt.onnx.quantization import quantize
    except ImportError as error:
        raise MissingExtraError(f"FP8 quantization needs nvidia-modelopt with its ONNX dependencies "
                                f"({error}): {INSTALL_HINT}") from None
    return quantize


def _modelopt_version() -> str:
    import modelopt

    return modelopt.__version__


def with_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """`model` at default-domain `opset` (never lowered), its local functions kept and moved along."""
    current = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if current >= opset:
        return model
    functions = copy.deepcopy(list(model.functions))
    converted = onnx.version_converter.convert_version(model, opset)
    for function in functions:
        for imported in function.opset_import:
            if imported.domain in ("", "ai.onnx"):
                imported.version = opset  # the checker wants a function's imports to match the model's
    del converted.functions[:]
    converted.functions.extend(functions)
    known = {o.domain for o in converted.opset_import}
    converted.opset_import.extend(o for o in model.opset_import if o.domain not in known)
    return converted


@contextlib.contextmanager
def _working_directory(path: str):
    """Run in `path` (the process's working directory changes meanwhile): ONNX Runtime's symbolic
    shape inference, which modelopt tries first, leaves a copy of the model (its weights in a file
    named by a uuid) in the working directory whenever it cannot infer every shape, as with the
    dlmrt::ParallelUnmask node."""
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


class _FeedsReader:
    """The calibration data reader modelopt (and ONNX Runtime's calibrator) iterate over."""

    def __init__(self, feeds: Sequence[dict[str, np.ndarray]]):
        self.feeds = list(feeds)
        self._next = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._next >= len(self.feeds):
            return None
        self._next += 1
        return self.feeds[self._next - 1]

    def get_first(self) -> dict[str, np.ndarray]:
        return self.feeds[0]

    def rewind(self) -> None:
        self._next = 0

    def __len__(self) -> int:
        return len(self.feeds)


def _check_feeds(model: onnx.ModelProto, feeds: Sequence[dict[str, np.ndarray]], path: Path) -> None:
    if not feeds:
        raise CalibrationError(f"no calibration inputs for {path}: give at least one feed dict "
                               f"(dlmrt.quant.calibration.calibration_feeds makes them)")
    expected = {value.name for value in model.graph.input}
    for index, feed in enumerate(feeds):
        if set(feed) != expected:
            missing, extra = sorted(expected - set(feed)), sorted(set(feed) - expected)
            raise CalibrationError(f"calibration input {index} does not match {path.name}'s inputs (missing "
                                   f"{missing}, unexpected {extra}): calibrate with the feeds of this graph")


def _custom_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.domain == CUSTOM_DOMAIN]


def check_fp8_graph(model: onnx.ModelProto, original: onnx.ModelProto | None = None) -> dict[str, int]:
    """Counts of the graph's MatMuls, of those with FP8 Q/DQ on both inputs, and of Q/DQ pairs;
    FP8Error unless at least one MatMul is quantized and every Q/DQ zero point is FLOAT8E4M3FN.
    With `original`, also that its dlmrt nodes (attributes included) and functions are unchanged."""
    producers = {output: node for node in model.graph.node for output in node.output}
    types = {init.name: init.data_type for init in model.graph.initializer}
    fp8_dq = 0
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            zero_point = node.input[2] if len(node.input) > 2 else None
            if types.get(zero_point) != FP8_TYPE:
                raise FP8Error(f"{node.op_type} node {node.name!r} has a zero point of type "
                               f"{onnx.TensorProto.DataType.Name(types.get(zero_point, 0))}, not FLOAT8E4M3FN: "
                               f"the graph is not an FP8 Q/DQ graph")
            fp8_dq += node.op_type == "DequantizeLinear"

    def through_qdq(name: str) -> bool:
        dq = producers.get(name)
        if dq is None or dq.op_type != "DequantizeLinear":
            return False
        source = producers.get(dq.input[0])
        return (source is not None and source.op_type == "QuantizeLinear") or types.get(dq.input[0]) == FP8_TYPE

    matmuls = [node for node in model.graph.node if node.op_type == "MatMul"]
    quantized = [node for node in matmuls if all(through_qdq(name) for name in node.input)]
    if not quantized:
        raise FP8Error(f"none of the graph's {len(matmuls)} MatMuls reads its inputs through FP8 Q/DQ: "
                       f"the quantization did not apply (check modelopt's log)")
    if original is not None:
        _check_custom_op_kept(model, original)
    return {"matmuls": len(matmuls), "fp8_matmuls": len(quantized), "qdq_pairs": fp8_dq}


def _check_custom_op_kept(model: onnx.ModelProto, original: onnx.ModelProto) -> None:
    def signature(m: onnx.ModelProto):
        return [(n.op_type, [a.SerializeToString() for a in n.attribute]) for n in _custom_nodes(m)]

    if signature(model) != signature(original):
        raise FP8Error("the quantized graph lost or changed its dlmrt::ParallelUnmask node: a modelopt change "
                       "this dlmrt does not handle (it expects nvidia-modelopt 0.47)")
    wanted = {(f.domain, f.name): len(f.node) for f in original.functions}
    found = {(f.domain, f.name): len(f.node) for f in model.functions}
    if found != wanted:
        raise FP8Error(f"the quantized graph's local functions differ from the original's (found {sorted(found)}, "
                       f"expected {sorted(wanted)}): a modelopt change this dlmrt does not handle")


def _run_once(path: Path, feed: dict[str, np.ndarray]) -> None:
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        session.run(None, feed)
    except Exception as error:  # onnxruntime raises its own exception types
        raise FP8Error(f"ONNX Runtime's CPU provider cannot run the FP8 graph {path}: {error}") from None


def quantize_onnx(in_path: str | Path, out_path: str | Path, feeds: Sequence[dict[str, np.ndarray]], *,
                  calibration_method: str = "max") -> FP8Report:
    """Write the FP8 Q/DQ form of the ONNX graph `in_path` to `out_path`, calibrated on `feeds`
    (dicts of the graph's inputs, e.g. from `calibration_feeds`) in ONNX Runtime's CPU provider.

    calibration_method: "max" (each activation's scale from its largest magnitude) or "entropy"
    (ONNX Runtime's histogram search). The result is checked (`check_fp8_graph`, custom node and
    functions unchanged) and run once by ONNX Runtime; `in_path` is left as it was."""
    quantize = _modelopt_quantize()
    in_path, out_path = Path(in_path), Path(out_path)
    if calibration_method not in ("max", "entropy"):
        raise CalibrationError(f"calibration method must be 'max' or 'entropy', got {calibration_method!r}")
    original = onnx.load(in_path, load_external_data=False)
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in original.graph.initializer):
        raise FP8Error(f"{in_path} keeps its weights in an external data file (a model over 1 GiB), which this "
                       f"FP8 path does not handle yet: quantize a smaller export, or build FP8 with TensorRT's "
                       f"own tools")
    _check_feeds(original, feeds, in_path)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlmrt-fp8-") as work:
        source, target = Path(work) / "model.onnx", Path(work) / "model.fp8.onnx"
        onnx.save_model(with_opset(original, FP8_OPSET), source)
        log = io.StringIO()
        try:
            # modelopt and ONNX Runtime's calibrator print progress bars and notes: kept for errors only.
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), _working_directory(work):
                quantize(str(source), quantize_mode="fp8", calibration_data_reader=_FeedsReader(feeds),
                         op_types_to_quantize=list(QUANTIZED_OPS),
                         calibration_method=calibration_method, calibration_eps=["cpu"],
                         high_precision_dtype="fp32", output_path=str(target), log_level="ERROR")
        except Exception as error:
            raise FP8Error(f"modelopt's FP8 quantization of {in_path} failed: {type(error).__name__}: {error}\n"
                           f"{log.getvalue()[-2000:]}") from error
        quantized = onnx.load(target)
        counts = check_fp8_graph(quantized, original)
        _run_once(target, feeds[0])
        out_path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(out_path, target.read_bytes())
    return FP8Report(in_path=str(in_path), out_path=str(out_path), calibration_feeds=len(feeds),
                     calibration_method=calibration_method, custom_nodes=[n.op_type for n in _custom_nodes(quantized)],
                     modelopt_version=_modelopt_version(), seconds=round(time.perf_counter() - started, 2), **counts)


def quantize_export(export_dir: str | Path, out_dir: str | Path, *,
                    prompts: str | Path | Sequence[str] | None = None, count: int = 32, seed: int = 0,
                    calibration_method: str = "max",
                    on_graph: Callable[[str], None] | None = None) -> tuple[Path, dict[str, FP8Report]]:
    """An FP8 copy of the export `export_dir` in `out_dir` (written atomically): every graph
    calibrated on its own step-loop feeds (`calibration_feeds(export_dir, graph, prompts, count,
    seed)`) and quantized; the manifest records the quantization. OrtBackend(out_dir) runs it.
    `on_graph(graph)` follows each quantized graph."""
    from dlmrt.export.export_manifest import ExportManifest

    _modelopt_quantize()  # the missing extra is reported before any calibration runs
    export_dir = Path(export_dir)
    manifest = ExportManifest.read(export_dir)  # quantized_copy checks its files
    reports = {}

    def quantize_graph(graph: str, source: Path, target: Path) -> None:
        report = quantize_onnx(source, target, calibration_feeds(export_dir, graph, prompts, count, seed),
                               calibration_method=calibration_method)
        reports[graph] = replace(report, out_path=str(Path(out_dir) / target.name))

    def describe() -> dict:
        return {"opset": max(manifest.opset, FP8_OPSET), "quantization": {
            "mode": "fp8", "tool": f"nvidia-modelopt {_modelopt_version()}", "source": str(export_dir.resolve()),
            "calibration_method": calibration_method,
            "graphs": {g: {k: v for k, v in r.to_dict().items() if k not in ("in_path", "out_path")}
                       for g, r in reports.items()}}}

    quantized_copy(export_dir, out_dir, quantize_graph, describe, on_graph)
    return Path(out_dir), reports

