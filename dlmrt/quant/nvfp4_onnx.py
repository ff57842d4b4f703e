"""An exported step graph rewritten in TensorRT's NVFP4 form, and a structural check of that form.

For each MatMul of a quantized Linear (`nvfp4.py` says which, and the exact format):

    weight   W_fp4 [N, K] FLOAT4E2M1 --DequantizeLinear(axis=-1, block_size=16)--> Transpose --> MatMul
             scales [N, K/16] FLOAT8E4M3FN --DequantizeLinear(global FP32 scalar)--^
    input    x --trt::TRT_FP4DynamicQuantize(global, axis=-1, block_size=16, scale_type=FP8)--> x_fp4, x_scales
             x_scales --DequantizeLinear(global)--> --+
             x_fp4 --DequantizeLinear(axis=-1, block_size=16)--> MatMul

The weight is stored in nn.Linear's [out, in] layout so that its blocks run along the last axis,
as modelopt writes NVFP4 weights (the exporter's folded [in, out] initializer is transposed back).
The input's global scale is its calibrated amax / (6 * 448); one quantize chain serves every
MatMul that reads the same input (q, k and v projections).

A MatMul is quantized when its weight is a 2-D float initializer and the exporter's node metadata
(`pkg.torch.onnx.name_scopes`, `class_hierarchy`) places it in an nn.Linear inside a transformer
block (`.blocks.N.` or `.layers.N.`), with K a multiple of 16; the report names every other
MatMul and why it was left alone. Stacked MoE experts (DiffusionGemma's `Experts`: `gate_up_proj
[E, 2I, H]`, `down_proj [E, H, I]`, every expert run in the fixed-shape graph) export as one
`Gemm(transB=1)` per expert and projection, whose weight is the expert's slice: a `Gather` of the
stacked initializer at a constant index, or that slice folded into a 2-D initializer. Such a Gemm
becomes the MatMul above, with the slice as its FP4 weight; the stacked initializer goes once no
node reads it. The model moves to opset 23 (the first whose DequantizeLinear
takes FLOAT4E2M1; block_size arrived in 21) and IR version 11, and imports the `trt` domain.

ONNX Runtime 1.32 cannot run the result (its CPU provider has no DequantizeLinear or Cast for
FLOAT4E2M1), so it is for TensorRT; check it with `check_nvfp4_graph` and `onnx.checker` (the
`trt` node has no registered schema, which the checker accepts for a custom domain).
"""

from __future__ import annotations

import ast
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from dlmrt.quant import nvfp4
from dlmrt.quant.nvfp4 import BLOCK_SIZE, QuantizationError
from dlmrt.export.export_writer import save_graph

OPSET = 23
IR_VERSION = 11
TRT_DOMAIN = "trt"
DYNAMIC_QUANTIZE = "TRT_FP4DynamicQuantize"
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
_BLOCK_MODULE = re.compile(r"\.(blocks|layers)\.\d+\.")
# Modules whose weight products are quantized: nn.Linear, and stacked experts (DiffusionGemma's, LLaDA2's).
_QUANTIZED_CLASSES = ("torch.nn.modules.linear.Linear", "dlmrt.models.diffusion_gemma.Experts",
                      "dlmrt.models.experts.StackedLinear")


@dataclass
class QuantizeReport:
    quantized: dict[str, str] = field(default_factory=dict)  # MatMul node -> module it came from
    input_amax: dict[str, float] = field(default_factory=dict)  # MatMul node -> calibrated input amax
    skipped: dict[str, str] = field(default_factory=dict)  # MatMul node -> why it stays as it was


def module_of(node: onnx.NodeProto) -> str | None:
    """The torch module (name in the step graph) whose forward wrote `node`, when it was an
    nn.Linear or stacked experts; None otherwise or when the exporter's metadata is missing."""
    meta = {p.key: p.value for p in node.metadata_props}
    try:
        scopes = ast.literal_eval(meta["pkg.torch.onnx.name_scopes"])
        classes = ast.literal_eval(meta["pkg.torch.onnx.class_hierarchy"])
    except (KeyError, ValueError, SyntaxError):
        return None
    if len(scopes) < 2 or len(classes) < 2 or classes[-2] not in _QUANTIZED_CLASSES:
        return None
    return scopes[-2]


@dataclass(frozen=True)
class _Weight:
    """A quantizable node's weight in nn.Linear's [out, in] layout, and the initializer it is read from."""

    out_in: np.ndarray
    dtype: int
    source: str  # the initializer (stacked, for an expert's slice)


def _weight(node: onnx.NodeProto, weights: Mapping[str, TensorProto],
            producers: Mapping[str, onnx.NodeProto]) -> _Weight | str:
    """The weight of a MatMul ([in, out] initializer) or of a plain Gemm(transB=1) ([out, in]
    initializer, or a constant-index Gather of a stacked [E, out, in] one); else why not."""
    if node.op_type == "MatMul":
        weight = weights.get(node.input[1])
        if weight is None or len(weight.dims) != 2 or weight.data_type not in _FLOATS:
            return "its second input is not a 2-D float weight initializer"
        return _Weight(numpy_helper.to_array(weight).astype(np.float32).T, weight.data_type, weight.name)
    attributes = _attributes(node)
    if len(node.input) > 2 or attributes.get("transA", 0) or attributes.get("transB", 0) != 1 or \
            attributes.get("alpha", 1.0) != 1.0:
        return "it is a Gemm other than x @ W^T (transB=1, no bias, alpha 1)"
    weight = weights.get(node.input[1])
    if weight is not None and len(weight.dims) == 2 and weight.data_type in _FLOATS:
        return _Weight(numpy_helper.to_array(weight).astype(np.float32), weight.data_type, weight.name)
    gather = producers.get(node.input[1])
    if gather is not None and gather.op_type == "Gather" and _attributes(gather).get("axis", 0) == 0:
        stacked, index = weights.get(gather.input[0]), weights.get(gather.input[1])
        if stacked is not None and len(stacked.dims) == 3 and stacked.data_type in _FLOATS and \
                index is not None and len(index.dims) == 0:
            expert = int(numpy_helper.to_array(index))
            return _Weight(numpy_helper.to_array(stacked)[expert].astype(np.float32), stacked.data_type, stacked.name)
    return "its weight is neither a 2-D float initializer nor one expert of a stacked initializer"


def _select(graph: onnx.GraphProto) -> tuple[list[onnx.NodeProto], dict[str, _Weight], dict[str, str],
                                              dict[str, str]]:
    """(nodes to quantize, their weights, their modules, {skipped node: reason})."""
    weights = {i.name: i for i in graph.initializer}
    producers = {out: n for n in graph.node for out in n.output}
    chosen, found, modules, skipped = [], {}, {}, {}
    for node in graph.node:
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        weight = _weight(node, weights, producers)
        module = module_of(node)
        if isinstance(weight, str):
            if node.op_type == "MatMul" or module is not None:  # a Gemm outside a Linear is no weight product
                skipped[node.name] = weight
        elif module is None or not _BLOCK_MODULE.search(module):
            skipped[node.name] = (f"{module or 'it'} is not an nn.Linear or stacked experts inside a transformer "
                                  f"block (the LM head, router and adapter stay in high precision)")
        elif weight.out_in.shape[1] % BLOCK_SIZE:
            skipped[node.name] = (f"its reduction dimension {weight.out_in.shape[1]} is not a multiple of "
                                  f"{BLOCK_SIZE}")
        else:
            chosen.append(node)
            found[node.name] = weight
            modules[node.name] = module
    return chosen, found, modules, skipped


def _calibrate(model: onnx.ModelProto, names: Sequence[str], feeds: Sequence[Mapping[str, np.ndarray]]
               ) -> dict[str, float]:
    """The largest |value| of each named tensor, running the graph with ONNX Runtime on `feeds`."""
    import onnxruntime as ort

    if not feeds:
        raise QuantizationError("NVFP4 calibration got no feeds: give at least one dict of the graph's inputs")
    required = {i.name for i in model.graph.input}
    missing = required - set(feeds[0])
    if missing:
        raise QuantizationError(f"the calibration feeds lack the graph inputs {sorted(missing)}: give every input "
                                f"of the step graph ({', '.join(sorted(required))})")
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    probe.graph.output.extend(helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), None)
                              for n in names)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "calibration.onnx"
        save_graph(probe, path)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        amax = dict.fromkeys(names, 0.0)
        for feed in feeds:
            for name, value in zip(names, session.run(list(names), dict(feed))):
                amax[name] = max(amax[name], float(np.abs(value).max(initial=0.0)))
    return amax


def _weight_nodes(node: onnx.NodeProto, weight: _Weight) -> tuple[list[onnx.NodeProto], list[TensorProto]]:
    """The quantized weight's initializers and its DQ -> DQ -> Transpose chain into `node`."""
    q = nvfp4.quantize(torch.from_numpy(np.ascontiguousarray(weight.out_in)))
    prefix = f"{node.name}.weight"
    codes, scales, scale = f"{prefix}.fp4", f"{prefix}.block_scales", f"{prefix}.global_scale"
    initializers = [
        numpy_helper.from_array(q.codes.numpy().view(ml_dtypes.float4_e2m1fn), codes),
        numpy_helper.from_array(q.block_scales.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), scales),
        numpy_helper.from_array(q.global_scale.numpy(), scale),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", [scales, scale], [f"{prefix}.scales"], name=f"{prefix}.scale_dq"),
        helper.make_node("DequantizeLinear", [codes, f"{prefix}.scales"], [f"{prefix}.dq"], name=f"{prefix}.dq",
                         axis=-1, block_size=BLOCK_SIZE, **_output_dtype(weight.dtype)),
        helper.make_node("Transpose", [f"{prefix}.dq"], [f"{prefix}.t"], name=f"{prefix}.transpose", perm=[1, 0]),
    ]
    node.input[1] = f"{prefix}.t"
    if node.op_type == "Gemm":  # x @ W^T with W = Transpose(dequantized [out, in]): a MatMul
        node.op_type = "MatMul"
        node.ClearField("attribute")
    return nodes, initializers


def _input_nodes(tensor: str, amax: float, dtype: int) -> tuple[list[onnx.NodeProto], list[TensorProto], str]:
    """The dynamic quantize -> DQ -> DQ chain of an activation; returns its output name last."""
    prefix = f"{tensor}.nvfp4"
    scale = f"{prefix}.global_scale"
    initializers = [numpy_helper.from_array(nvfp4.global_scale_from_amax(amax).numpy(), scale)]
    nodes = [
        helper.make_node(DYNAMIC_QUANTIZE, [tensor, scale], [f"{prefix}.fp4", f"{prefix}.block_scales"],
                         name=f"{prefix}.quantize", domain=TRT_DOMAIN, axis=-1, block_size=BLOCK_SIZE,
                         scale_type=TensorProto.FLOAT8E4M3FN),
        helper.make_node("DequantizeLinear", [f"{prefix}.block_scales", scale], [f"{prefix}.scales"],
                         name=f"{prefix}.scale_dq"),
        helper.make_node("DequantizeLinear", [f"{prefix}.fp4", f"{prefix}.scales"], [f"{prefix}.dq"],
                         name=f"{prefix}.dq", axis=-1, block_size=BLOCK_SIZE, **_output_dtype(dtype)),
    ]
    return nodes, initializers, f"{prefix}.dq"


def _output_dtype(dtype: int) -> dict:
    # The DQ output takes the scale's type (FP32) unless told: keep fp16/bf16 graphs in their type.
    return {} if dtype == TensorProto.FLOAT else {"output_dtype": dtype}


def _rewrite(graph: onnx.GraphProto, chosen: list[onnx.NodeProto], found: Mapping[str, _Weight],
             amax: dict[str, float]) -> None:
    names = {n.name for n in chosen}
    slices = {n.input[1] for n in chosen}  # where a weight was an expert's slice, the Gather's output
    inserted: dict[str, str] = {}  # activation -> its dequantized form
    nodes, initializers = [], []
    for node in graph.node:
        if node.name in names:
            weight = found[node.name]
            if node.input[0] not in inserted:
                chain, inits, output = _input_nodes(node.input[0], amax[node.input[0]], weight.dtype)
                nodes += chain
                initializers += inits
                inserted[node.input[0]] = output
            node.input[0] = inserted[node.input[0]]
            chain, inits = _weight_nodes(node, weight)
            nodes += chain
            initializers += inits
        nodes.append(node)
    graph.ClearField("node")
    read = {name for n in nodes for name in n.input} | {o.name for o in graph.output}
    graph.node.extend(n for n in nodes if not (n.op_type == "Gather" and n.output[0] in slices - read))
    used = {name for n in graph.node for name in n.input}
    replaced = {weight.source for weight in found.values()}
    kept = [i for i in graph.initializer if i.name in used or i.name not in replaced]
    graph.ClearField("initializer")
    graph.initializer.extend(kept + initializers)


def _set_opset(model: onnx.ModelProto) -> None:
    imports = {o.domain: o for o in model.opset_import}
    if imports.get("", helper.make_opsetid("", 0)).version < OPSET:
        if "" in imports:
            imports[""].version = OPSET
        else:
            model.opset_import.append(helper.make_opsetid("", OPSET))
    if TRT_DOMAIN not in imports:
        model.opset_import.append(helper.make_opsetid(TRT_DOMAIN, 1))
    # onnx's checker wants a model's functions on the model's default-domain version. The ops the
    # ParallelUnmask functions use changed between 18 and 23 only by taking more types.
    for function in model.functions:
        for opset in function.opset_import:
            if opset.domain == "" and opset.version < OPSET:
                opset.version = OPSET
    model.ir_version = max(model.ir_version, IR_VERSION)


def quantize_onnx(in_path: str | Path, out_path: str | Path,
                  feeds: Sequence[Mapping[str, np.ndarray]]) -> QuantizeReport:
    """Write `in_path` (a step graph from `dlmrt export`, fp32 for calibration on the CPU) to
    `out_path` in TensorRT's NVFP4 form; input global scales are calibrated by running the graph
    with ONNX Runtime on `feeds` (dicts of numpy arrays, one per graph input)."""
    model = onnx.load(str(in_path))
    chosen, found, modules, skipped = _select(model.graph)
    amax = _calibrate(model, sorted({n.input[0] for n in chosen}), feeds)
    report = QuantizeReport(modules, {n.name: amax[n.input[0]] for n in chosen}, skipped)
    _rewrite(model.graph, chosen, found, amax)
    _set_opset(model)
    problems = check_nvfp4_graph(model)
    if problems:
        raise RuntimeError(f"the NVFP4 graph fails its own check (a dlmrt bug): {problems[0]}")
    save_graph(model, Path(out_path))
    return report


# -- the structural check -----------------------------------------------------------------


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class _Graph:
    def __init__(self, model: onnx.ModelProto):
        graph = model.graph
        self.initializers = {i.name: i for i in graph.initializer}
        self.producer = {out: n for n in graph.node for out in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.outputs = {o.name for o in graph.output}

    def produced_by(self, name: str, op_type: str, domain: str = "") -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and (node.op_type, node.domain) == (op_type, domain) else None

    def dequantized(self, name: str) -> bool:
        """Whether `name` comes from a DequantizeLinear, directly or through a Transpose."""
        transpose = self.produced_by(name, "Transpose")
        return self.produced_by(transpose.input[0] if transpose else name, "DequantizeLinear") is not None


def _check_global_scale(g: _Graph, name: str, where: str) -> list[str]:
    scale = g.initializers.get(name)
    if scale is None:
        return [f"{where}: the global scale {name!r} is not an initializer"]
    if scale.data_type != TensorProto.FLOAT or list(scale.dims) not in ([], [1]):
        return [f"{where}: the global scale must be an FP32 scalar, got "
                f"{TensorProto.DataType.Name(scale.data_type)} of shape {list(scale.dims)}"]
    return []


def _check_blocked_dq(g: _Graph, dq: onnx.NodeProto, where: str) -> tuple[list[str], onnx.NodeProto | None]:
    """The data DQ's attributes and its scale DQ; returns the problems and the scale DQ."""
    attributes = _attributes(dq)
    problems = []
    if attributes.get("block_size") != BLOCK_SIZE:
        problems.append(f"{where}: block_size is {attributes.get('block_size')}, expected {BLOCK_SIZE}")
    if attributes.get("axis") != -1:
        problems.append(f"{where}: axis is {attributes.get('axis', 1)}, expected -1 (the reduction axis)")
    scale_dq = g.produced_by(dq.input[1], "DequantizeLinear")
    if scale_dq is None:
        problems.append(f"{where}: its block scales do not come from a DequantizeLinear (FP8 scale x FP32 "
                        f"global scale)")
    return problems, scale_dq


def _check_weight(g: _Graph, matmul: onnx.NodeProto) -> list[str]:
    where = f"MatMul {matmul.name} weight"
    transpose = g.produced_by(matmul.input[1], "Transpose")
    dq = transpose and g.produced_by(transpose.input[0], "DequantizeLinear")
    if dq is None:
        return [f"{where}: expected DequantizeLinear -> Transpose before the MatMul"]
    if _attributes(transpose).get("perm") != [1, 0]:
        return [f"{where}: the Transpose must have perm [1, 0]"]
    problems, scale_dq = _check_blocked_dq(g, dq, where)
    codes = g.initializers.get(dq.input[0])
    if codes is None or codes.data_type != TensorProto.FLOAT4E2M1 or len(codes.dims) != 2:
        problems.append(f"{where}: the quantized weight must be a 2-D FLOAT4E2M1 initializer")
    if scale_dq is None or problems:
        return problems
    rows, k = codes.dims
    scales = g.initializers.get(scale_dq.input[0])
    if scales is None or scales.data_type != TensorProto.FLOAT8E4M3FN:
        kind = "not an initializer" if scales is None else TensorProto.DataType.Name(scales.data_type)
        return [f"{where}: block scales must be an FLOAT8E4M3FN initializer, got {kind}"]
    if k % BLOCK_SIZE or list(scales.dims) != [rows, k // BLOCK_SIZE]:
        problems.append(f"{where}: block scales have shape {list(scales.dims)} for a [{rows}, {k}] weight, "
                        f"expected [{rows}, {k // BLOCK_SIZE}]")
    return problems + _check_global_scale(g, scale_dq.input[1], where)


def _check_input(g: _Graph, matmul: onnx.NodeProto) -> list[str]:
    where = f"MatMul {matmul.name} input"
    dq = g.produced_by(matmul.input[0], "DequantizeLinear")
    if dq is None:
        return [f"{where}: expected a DequantizeLinear pair after {DYNAMIC_QUANTIZE}"]
    problems, scale_dq = _check_blocked_dq(g, dq, where)
    quantize = g.produced_by(dq.input[0], DYNAMIC_QUANTIZE, TRT_DOMAIN)
    if quantize is None:
        return problems + [f"{where}: the FP4 data must come from {TRT_DOMAIN}::{DYNAMIC_QUANTIZE}"]
    attributes = _attributes(quantize)
    expected = {"axis": -1, "block_size": BLOCK_SIZE, "scale_type": TensorProto.FLOAT8E4M3FN}
    problems += [f"{where}: {DYNAMIC_QUANTIZE} {key} is {attributes.get(key)}, expected {value}"
                 for key, value in expected.items() if attributes.get(key) != value]
    if dq.input[0] != quantize.output[0]:
        problems.append(f"{where}: the data DQ must read {DYNAMIC_QUANTIZE}'s first output (the FP4 data)")
    if scale_dq is not None:
        if scale_dq.input[0] != quantize.output[1]:
            problems.append(f"{where}: the scale DQ must read {DYNAMIC_QUANTIZE}'s second output (the FP8 scales)")
        if scale_dq.input[1] != quantize.input[1]:
            problems.append(f"{where}: the scale DQ and {DYNAMIC_QUANTIZE} must share one global scale")
    return problems + _check_global_scale(g, quantize.input[1], where)


def _check_dangling(g: _Graph, model: onnx.ModelProto) -> list[str]:
    problems = []
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" or (node.domain, node.op_type) == (TRT_DOMAIN, DYNAMIC_QUANTIZE):
            unused = [o for o in node.output if o not in g.consumers and o not in g.outputs]
            if unused:
                problems.append(f"{node.op_type} {node.name}: its output {unused[0]!r} is used by nothing")
    for init in g.initializers.values():
        if init.data_type == TensorProto.FLOAT4E2M1 and not all(
                n.op_type == "DequantizeLinear" for n in g.consumers.get(init.name, [None])):
            problems.append(f"FP4 initializer {init.name} is not read (only) by a DequantizeLinear")
    return problems


def check_nvfp4_graph(model: onnx.ModelProto) -> list[str]:
    """What keeps `model` from being a well-formed NVFP4 graph for TensorRT; empty when fine.

    Every MatMul fed by a DequantizeLinear (on either side) must have both NVFP4 chains of the
    module docstring; no DequantizeLinear or dynamic quantize may hang unused."""
    g = _Graph(model)
    problems = []
    opsets = {o.domain: o.version for o in model.opset_import}
    if opsets.get("", 0) < OPSET:
        problems.append(f"the default-domain opset is {opsets.get('', 0)}, FLOAT4E2M1 needs {OPSET} or newer")
    if model.ir_version < IR_VERSION:
        problems.append(f"the IR version is {model.ir_version}, FLOAT4E2M1 needs {IR_VERSION} or newer")
    quantized = [n for n in model.graph.node if n.op_type == "MatMul" and any(g.dequantized(x) for x in n.input)]
    if quantized and TRT_DOMAIN not in opsets:
        problems.append(f"the model does not import the {TRT_DOMAIN!r} domain of {DYNAMIC_QUANTIZE}")
    for matmul in quantized:
        problems += _check_weight(g, matmul) + _check_input(g, matmul)
    return problems + _check_dangling(g, model)
