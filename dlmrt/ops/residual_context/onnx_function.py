"""`dlmrt::ResidualContext` in ONNX: the node's schema, and a local function with the same semantics
built from standard opset-18 ops, so that ONNX Runtime (or any ONNX consumer) runs a graph holding
the node as it is, while TensorRT's parser maps the node to our plugin by its `plugin_namespace`.

The function mirrors `reference.py`: the softmax, entropy and product in float32, the results cast
to the embedding's type.

Inputs:  logits [B, T, V] float/float16/bfloat16, embedding [V, H] float/float16/bfloat16
Outputs: z [B, T, H] and certainty [B, T], both in the embedding's type
Attributes: plugin_namespace (string), plugin_version (string)
"""

import onnx
from onnxscript import script
from onnxscript import opset18 as op
from onnxscript.values import Opset

from dlmrt.ops.parallel_unmask.onnx_function import (_NodeOpset, model_of_node, plugin_attributes, plugin_node,
                                                         register_once)

DOMAIN = "dlmrt"
OP_TYPE = "ResidualContext"
VERSION = 1
PLUGIN_VERSION = "1"
TENSORRT_PLUGIN_VERSION = "1"  # the registry version of every tensorrt.plugin plugin (see ParallelUnmask's)
INPUTS = ("logits", "embedding")
OUTPUTS = ("z", "certainty")

dlmrt = Opset(DOMAIN, VERSION)
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_ELEMENT_TYPES = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16,
                  "bfloat16": onnx.TensorProto.BFLOAT16}


@script(dlmrt)
def ResidualContext(logits, embedding):
    logp = op.LogSoftmax(op.Cast(logits, to=1), axis=-1)
    p = op.Exp(logp)
    plogp = op.Where(p > 0.0, op.Mul(p, logp), op.CastLike(0.0, p))
    entropy = op.Neg(op.ReduceSum(plogp, [-1], keepdims=0))
    log_vocab = op.Cast(op.Log(op.Cast(op.Shape(logits, start=-1), to=11)), to=1)
    certainty = op.Clip(op.Sub(1.0, op.Div(entropy, log_vocab)), op.CastLike(0.0, p), op.CastLike(1.0, p))
    z = op.MatMul(p, op.Cast(embedding, to=1))
    return op.CastLike(z, embedding), op.CastLike(certainty, embedding)


def function_protos() -> list[onnx.FunctionProto]:
    """The op's function, for a model's `functions`."""
    return [ResidualContext.to_function_proto()]


def schema() -> onnx.defs.OpSchema:
    FormalParameter = onnx.defs.OpSchema.FormalParameter
    return onnx.defs.OpSchema(
        OP_TYPE, DOMAIN, VERSION,
        doc="The residual context of an ORL diffusion language model step (dlmrt).",
        inputs=[FormalParameter("logits", "L"), FormalParameter("embedding", "E")],
        outputs=[FormalParameter(name, "E") for name in OUTPUTS],
        type_constraints=[("L", _FLOATS, "the logits' type"), ("E", _FLOATS, "the embedding's and outputs' type")],
        attributes=plugin_attributes())


def register_schema() -> None:
    """Make the node known to onnx (checker, shape inference); safe to call more than once."""
    register_once(OP_TYPE, schema)


def node(inputs: list[str], outputs: list[str], name: str = "residual_context") -> onnx.NodeProto:
    return plugin_node(OP_TYPE, inputs, outputs, name, TENSORRT_PLUGIN_VERSION)


def standalone_model(logits_dtype: str = "float32", embedding_dtype: str = "float32",
                     opset: int = 18) -> onnx.ModelProto:
    """A model holding just the node (dynamic B, T, V, H) and its function: how tests and tools run it."""
    make = onnx.helper.make_tensor_value_info
    embedding_type = _ELEMENT_TYPES[embedding_dtype]
    graph = onnx.helper.make_graph(
        [node(list(INPUTS), list(OUTPUTS))], "residual_context",
        [make("logits", _ELEMENT_TYPES[logits_dtype], ["B", "T", "V"]), make("embedding", embedding_type, ["V", "H"])],
        [make("z", embedding_type, ["B", "T", "H"]), make("certainty", embedding_type, ["B", "T"])])
    return model_of_node(graph, function_protos(), opset)


register_schema()
_nodes = _NodeOpset(DOMAIN, VERSION)  # the same bare-node opset as ParallelUnmask's, now knowing this schema


def residual_context_translation(logits, embedding):
    """How torch.onnx.export writes `torch.ops.dlmrt.residual_context` (traced, not scripted): as one
    dlmrt node; `attach_custom_op` adds its function and plugin attributes after export."""
    return _nodes.ResidualContext(logits, embedding)
