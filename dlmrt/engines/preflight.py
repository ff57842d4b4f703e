"""Preflight: check a step graph against what TensorRT's ONNX parser needs, on the CPU, before a
build spends minutes finding the first problem. Every problem is reported at once.

Checked: the opset range of the TensorRT version; operators the parser does not implement (and
operators that are not ONNX at all); every node of a custom domain is a plugin the plan declares,
with its `plugin_namespace`, `plugin_version` and required fields; Q/DQ patterns (scales that are
constants, zero points that are zero, quantize nodes that feed dequantize nodes, FP4 blocks of 16)
and that the precision asked for is in the graph; and every dynamic dimension of every input is
covered by the plan's optimization profile.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from dlmrt.engines.plan import BuildPlan, GraphPlan
from dlmrt.engines.plugin_specs import KNOWN, PluginSpec
from dlmrt.core.errors import DlmrtError

# The parser's documented opset ceiling per TensorRT major version (its support matrix). NVFP4
# graphs need opset 23 (FLOAT4E2M1 in DequantizeLinear), which TensorRT 10.8+ parses for FP4.
MAX_OPSET = {10: 22, 11: 25}
MIN_OPSET = 9
FP4_OPSET = 23
# ONNX operators TensorRT's parser does not implement (ONNX-TensorRT's operator matrix).
UNSUPPORTED_OPS = frozenset({
    "Bernoulli", "BitShift", "BlackmanWindow", "Compress", "ConcatFromSequence", "ConvInteger", "DFT", "Det",
    "DynamicQuantizeLinear", "HammingWindow", "HannWindow", "Hardmax", "MatMulInteger", "MaxRoiPool",
    "MaxUnpool", "MelWeightMatrix", "Multinomial", "NegativeLogLikelihoodLoss", "Optional",
    "OptionalGetElement", "OptionalHasElement", "QLinearConv", "QLinearMatMul", "STFT", "SequenceAt",
    "SequenceConstruct", "SequenceEmpty", "SequenceErase", "SequenceInsert", "SequenceLength", "SequenceMap",
    "SoftmaxCrossEntropyLoss", "SplitToSequence", "StringNormalizer", "TfIdfVectorizer", "Unique",
})
# TensorRT's own quantize nodes (domain "trt"), which modelopt and dlmrt's NVFP4 writer emit.
TRT_DOMAIN = "trt"
TRT_OPS = frozenset({"TRT_FP4DynamicQuantize", "TRT_FP8QuantizeLinear", "TRT_FP8DequantizeLinear",
                     "TRT_INT4QuantizeLinear", "TRT_MXFP8DynamicQuantize"})
FP8_TYPES = {TensorProto.FLOAT8E4M3FN}
QUANTIZED_TYPES = {"fp8": FP8_TYPES, "nvfp4": {TensorProto.FLOAT4E2M1}}
SIXTEEN_BIT = {"bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16}
FP4_BLOCK = 16


class PreflightError(DlmrtError):
    """The graph would not build: its message lists every problem found."""


@dataclass(frozen=True)
class Problem:
    graph: str
    where: str  # a node, an input, or "model"
    what: str

    def __str__(self) -> str:
        return f"{self.graph}: {self.where}: {self.what}"


def check(plan: BuildPlan, models: dict[str, onnx.ModelProto], quantized: bool = True) -> list[Problem]:
    """Every problem of every graph of the plan (`models` maps graph name to the graph to parse);
    `quantized=False` checks an export before quantization (no Q/DQ expected yet)."""
    problems = []
    for graph in plan.graphs:
        problems += check_graph(plan, graph, models[graph.name], quantized)
    return problems


def require_clean(plan: BuildPlan, models: dict[str, onnx.ModelProto]) -> None:
    problems = check(plan, models)
    if problems:
        listing = "\n  ".join(map(str, problems))
        raise PreflightError(f"{len(problems)} problem{'s' * (len(problems) > 1)} would stop TensorRT "
                             f"{plan.tensorrt} from building {plan.model} for {plan.target} {plan.precision}:"
                             f"\n  {listing}")


def check_graph(plan: BuildPlan, graph: GraphPlan, model: onnx.ModelProto, quantized: bool = True) -> list[Problem]:
    findings = (*_opset(plan, model), *_operators(plan, model), *_quantization(plan, model, quantized),
                *_profile(graph, model))
    return [Problem(graph.name, where, what) for where, what in findings]


def _major(version: str) -> int:
    return int(version.split(".")[0])


def _opset(plan: BuildPlan, model: onnx.ModelProto):
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        yield "model", "imports no default-domain opset"
        return
    ceiling = MAX_OPSET.get(_major(plan.tensorrt), max(MAX_OPSET.values()))
    if plan.precision == "nvfp4":
        ceiling = max(ceiling, FP4_OPSET)
    if not MIN_OPSET <= opset <= ceiling:
        yield "model", (f"opset {opset} is outside what TensorRT {plan.tensorrt}'s parser reads "
                        f"({MIN_OPSET}..{ceiling}): export with --opset {min(max(opset, MIN_OPSET), ceiling)}")


def _operators(plan: BuildPlan, model: onnx.ModelProto):
    declared = {(p["namespace"], p["name"]) for p in plan.plugins} & set(KNOWN)
    functions = {(f.domain, f.name) for f in model.functions}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
    for node in model.graph.node:
        where = f"node {node.name or node.op_type!r} ({node.domain or 'ai.onnx'}::{node.op_type})"
        if node.domain in ("", "ai.onnx"):
            if node.op_type in UNSUPPORTED_OPS:
                yield where, "TensorRT's ONNX parser does not implement this operator"
            elif not onnx.defs.has(node.op_type, opset):
                yield where, f"not an ONNX operator at opset {opset}"
        elif node.domain == TRT_DOMAIN:
            if node.op_type not in TRT_OPS:
                yield where, f"not a TensorRT operator (known: {', '.join(sorted(TRT_OPS))})"
        elif (node.domain, node.op_type) in declared:
            for what in _plugin_node(node, KNOWN[(node.domain, node.op_type)]):
                yield where, what
        elif (node.domain, node.op_type) in functions:
            yield where, ("a custom-domain node with no plugin in the plan: TensorRT would inline its ONNX "
                          "function, which this check does not cover; declare the plugin")
        else:
            yield where, "a custom-domain node that is neither a declared plugin nor a function of the model"


def _plugin_node(node: onnx.NodeProto, plugin: PluginSpec):
    attributes = {a.name: a for a in node.attribute}

    def string(name: str) -> str | None:
        return attributes[name].s.decode() if name in attributes else None

    if string("plugin_namespace") != plugin.namespace:
        yield (f"plugin_namespace is {string('plugin_namespace')!r}, the registered plugin's is "
               f"{plugin.namespace!r}: the parser would not find the plugin")
    if string("plugin_version") != plugin.registry_version:
        yield (f"plugin_version is {string('plugin_version')!r}, the registered plugin is version "
               f"{plugin.registry_version!r}: re-export with this dlmrt")
    for name, kind in plugin.fields.items():
        if name not in attributes:
            yield f"lacks the plugin field {name!r}"
        elif attributes[name].type != kind:
            kind_name = onnx.AttributeProto.AttributeType.Name(attributes[name].type)
            yield f"plugin field {name!r} has the wrong type ({kind_name})"
    if (len(node.input), len(node.output)) != (plugin.inputs, plugin.outputs):
        yield (f"has {len(node.input)} inputs and {len(node.output)} outputs, the plugin (v{plugin.version}) takes "
               f"{plugin.inputs} and {plugin.outputs}: an export made by another dlmrt; re-export with this one")


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    values = {init.name: onnx.numpy_helper.to_array(init) for init in model.graph.initializer
              if init.data_type not in (TensorProto.FLOAT4E2M1,)}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attribute in node.attribute:
                if attribute.name == "value":
                    values[node.output[0]] = onnx.numpy_helper.to_array(attribute.t)
    return values


def _element_types(model: onnx.ModelProto) -> dict[str, int]:
    types = {init.name: init.data_type for init in model.graph.initializer}
    for value in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        types[value.name] = value.type.tensor_type.elem_type
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.domain in ("", "ai.onnx"):
            zero = next((a.i for a in node.attribute if a.name == "output_dtype"), None)
            if len(node.input) > 2 and node.input[2] in types:
                types[node.output[0]] = types[node.input[2]]
            elif zero:
                types[node.output[0]] = zero
    return types


def _quantization(plan: BuildPlan, model: onnx.ModelProto, quantized: bool):
    constants = _constants(model)
    types = _element_types(model)
    names = {init.name for init in model.graph.initializer} | set(constants)
    consumers = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].append(node)
    producers = {out: node for node in model.graph.node for out in node.output}
    quantized_types = set()
    for node in model.graph.node:
        where = f"node {node.name or node.op_type!r} ({node.op_type})"
        if node.domain not in ("", "ai.onnx"):
            if node.op_type == "TRT_FP4DynamicQuantize":
                quantized_types.add(TensorProto.FLOAT4E2M1)
                attrs = {a.name: a.i for a in node.attribute}
                if attrs.get("block_size") != FP4_BLOCK:
                    yield where, f"block_size is {attrs.get('block_size')}, NVFP4 blocks are {FP4_BLOCK}"
                if any(c.op_type != "DequantizeLinear" for out in node.output for c in consumers[out]):
                    yield where, "feeds something other than DequantizeLinear"
            continue
        if node.op_type == "QuantizeLinear":
            if len(node.input) < 2 or node.input[1] not in names:
                yield where, "its scale is not a constant (TensorRT needs constant Q/DQ scales)"
            zero_point = node.input[2] if len(node.input) > 2 else None
            if zero_point in constants and np.any(constants[zero_point].astype(np.float32)):
                yield where, "its zero point is not zero (TensorRT supports symmetric quantization only)"
            if len(node.input) > 2 and types.get(node.input[2]) is not None:
                quantized_types.add(types[node.input[2]])
            if any(c.op_type != "DequantizeLinear" for c in consumers[node.output[0]]):
                yield where, "feeds something other than DequantizeLinear"
        elif node.op_type == "DequantizeLinear":
            source = node.input[0]
            producer = producers.get(source)
            if source in names:
                quantized_types.add(types.get(source))
            elif producer is None or producer.op_type not in ("QuantizeLinear", "TRT_FP4DynamicQuantize"):
                yield where, f"dequantizes {source!r}, which is neither a constant nor a quantize node's output"
            scale = node.input[1] if len(node.input) > 1 else None
            scale_producer = producers.get(scale)
            if scale not in names and (scale_producer is None or scale_producer.op_type != "DequantizeLinear"):
                yield where, "its scale is neither a constant nor a dequantized block scale"
            block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
            if types.get(source) == TensorProto.FLOAT4E2M1 and block not in (0, FP4_BLOCK):
                yield where, f"block_size is {block}, NVFP4 blocks are {FP4_BLOCK}"
    quantized_types.discard(None)
    wanted = QUANTIZED_TYPES.get(plan.precision)
    if quantized and wanted is not None and not quantized_types & wanted:
        yield "model", (f"holds no {plan.precision} Q/DQ nodes: a {plan.precision} engine is built from the "
                        f"quantized graph (dlmrt build quantizes the export itself)")
    if plan.typing == "strongly-typed" and plan.precision in SIXTEEN_BIT:
        wanted_type = SIXTEEN_BIT[plan.precision]
        floats = {init.data_type for init in model.graph.initializer
                  if init.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)}
        if floats and wanted_type not in floats:
            yield "model", (f"its weights are {', '.join(TensorProto.DataType.Name(t) for t in sorted(floats))}, "
                            f"and a strongly typed {plan.precision} build takes the precision from the graph")


def _profile(graph: GraphPlan, model: onnx.ModelProto):
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        dynamic = [d.dim_param or "?" for d in dims if not d.HasField("dim_value")]
        if not dynamic:
            continue
        shapes = graph.shapes.get(value.name)
        if shapes is None:
            yield f"input {value.name!r}", (f"has dynamic dimensions ({', '.join(dynamic)}) that the "
                                            f"optimization profile does not cover")
            continue
        for axis, dim in enumerate(dims):
            if dim.HasField("dim_value") and any(shape[axis] != dim.dim_value for shape in shapes):
                yield f"input {value.name!r}", (f"axis {axis} is fixed at {dim.dim_value}, the profile gives "
                                                f"{[shape[axis] for shape in shapes]}")
        if any(len(shape) != len(dims) for shape in shapes):
            yield f"input {value.name!r}", f"has rank {len(dims)}, the profile's shapes do not"
