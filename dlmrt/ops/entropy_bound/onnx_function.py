"""`dlmrt::EntropyBoundStep` in ONNX: the node's schema, and a local function with the same semantics
built from standard opset-18 ops, so that ONNX Runtime (or any ONNX consumer) runs a graph holding
the node as it is, while TensorRT's parser can map the node to a plugin by its `plugin_namespace`.

The function mirrors `reference.py` step by step: the float32 division by the temperature, the
entropies from LogSoftmax (0 log 0 = 0), the acceptance by ascending entropy (ONNX TopK with
largest=0 puts the lower index first among equal values, as a stable ascending sort does) with the
sums before each position from an exclusive float64 CumSum in that order, the float64 Gumbel-max
sample and the uniform refill from ParallelUnmask's hash functions (`ParallelUnmaskRowHash`,
`ParallelUnmaskUniform`, `ParallelUnmaskMix32`, reused: a model holding the node carries them,
`function_protos()`), and the `finished` rows keeping their canvas and accepting nothing.

Inputs:  logits [B, W, V] float, canvas [B, W] int64, positions [B, W] int64, temperature [B] float,
         entropy_bound [B] float, seed [B] int64, step [B] int64, finished [B] bool
Outputs: next_canvas [B, W] int64, argmax [B, W] int64, scaled_logits [B, W, V] float,
         accepted [B, W] bool, mean_entropy [B] float
Attributes: plugin_namespace (string), plugin_version (string)

`PLUGIN_VERSION` is the version of the op's interface (as ParallelUnmask's); `TENSORRT_PLUGIN_VERSION`
the registry version of every tensorrt.plugin plugin, which the node's `plugin_version` carries.
"""

import onnx
from onnxscript import BOOL, FLOAT, INT64, script
from onnxscript import opset18 as op
from onnxscript.values import Opset

from dlmrt.ops.parallel_unmask.onnx_function import (ParallelUnmaskMix32, ParallelUnmaskRowHash,
                                                         ParallelUnmaskUniform, _NodeOpset, model_of_node,
                                                         plugin_attributes, plugin_node, register_once)

DOMAIN = "dlmrt"
OP_TYPE = "EntropyBoundStep"
VERSION = 1
PLUGIN_VERSION = "1"
TENSORRT_PLUGIN_VERSION = "1"  # the registry version of every tensorrt.plugin plugin (see ParallelUnmask's)
INPUTS = ("logits", "canvas", "positions", "temperature", "entropy_bound", "seed", "step", "finished")
OUTPUTS = ("next_canvas", "argmax", "scaled_logits", "accepted", "mean_entropy")

dlmrt = Opset(DOMAIN, VERSION)


@script(dlmrt)
def EntropyBoundStep(logits: FLOAT, canvas: INT64, positions: INT64, temperature: FLOAT, entropy_bound: FLOAT,
                     seed: INT64, step: INT64, finished: BOOL) -> (INT64, INT64, FLOAT, BOOL, FLOAT):
    vocab = op.Shape(logits, start=-1)
    width = op.Shape(canvas, start=-1)
    token = op.Range(0, op.Squeeze(vocab), 1)
    scaled = op.Div(logits, op.Unsqueeze(temperature, [1, 2]))

    # the entropies, and the positions accepted by ascending entropy (ties: the earlier first)
    logp = op.LogSoftmax(scaled, axis=-1)
    p = op.Exp(logp)
    plogp = op.Where(p > 0.0, op.Mul(p, logp), op.CastLike(0.0, p))
    entropy = op.Neg(op.ReduceSum(plogp, [-1], keepdims=0))
    ranked, order = op.TopK(entropy, width, axis=-1, largest=0, sorted=1)
    before = op.CumSum(op.Cast(ranked, to=11), op.Constant(value_int=-1), exclusive=1)
    take = op.LessOrEqual(before, op.Unsqueeze(op.Cast(entropy_bound, to=11), [1]))
    zeros = op.ConstantOfShape(op.Shape(order), value=[0])
    accepted = op.Cast(op.ScatterElements(zeros, order, op.Cast(take, to=7), axis=-1), to=9)

    # the Gumbel-max sample in float64, and the uniform refill at the next step counter
    noise = ParallelUnmaskUniform(op.Unsqueeze(ParallelUnmaskRowHash(seed, step, positions), [2]), token)
    sample = op.ArgMax(op.Sub(op.Cast(scaled, to=11), op.Log(op.Neg(op.Log(noise)))), axis=-1, keepdims=0)
    drawn = ParallelUnmaskUniform(ParallelUnmaskRowHash(seed, op.Add(step, 1), positions), 461845907)  # the salt
    refill = op.Min(op.Cast(op.Floor(op.Mul(drawn, op.Cast(vocab, to=11))), to=7), op.Sub(vocab, 1))

    stopped = op.Unsqueeze(finished, [1])
    next_canvas = op.Where(stopped, canvas, op.Where(accepted, sample, refill))
    accepted = op.And(accepted, op.Not(stopped))
    argmax = op.ArgMax(scaled, axis=-1, keepdims=0)
    return next_canvas, argmax, scaled, accepted, op.ReduceMean(entropy, [-1], keepdims=0)


def function_protos() -> list[onnx.FunctionProto]:
    """The op's function and the hash functions it calls, for a model's `functions`."""
    return [f.to_function_proto() for f in (ParallelUnmaskMix32, ParallelUnmaskRowHash, ParallelUnmaskUniform,
                                             EntropyBoundStep)]


_TYPES = {"logits": "tensor(float)", "temperature": "tensor(float)", "entropy_bound": "tensor(float)",
          "finished": "tensor(bool)", "scaled_logits": "tensor(float)", "accepted": "tensor(bool)",
          "mean_entropy": "tensor(float)"}


def schema() -> onnx.defs.OpSchema:
    FormalParameter = onnx.defs.OpSchema.FormalParameter
    return onnx.defs.OpSchema(
        OP_TYPE, DOMAIN, VERSION,
        doc="One DiffusionGemma denoising step: entropy-bound acceptance with uniform refills (dlmrt).",
        inputs=[FormalParameter(name, _TYPES.get(name, "tensor(int64)")) for name in INPUTS],
        outputs=[FormalParameter(name, _TYPES.get(name, "tensor(int64)")) for name in OUTPUTS],
        attributes=plugin_attributes())


def register_schema() -> None:
    """Make the node known to onnx (checker, shape inference); safe to call more than once."""
    register_once(OP_TYPE, schema)


def node(inputs: list[str], outputs: list[str], name: str = "entropy_bound_step") -> onnx.NodeProto:
    return plugin_node(OP_TYPE, inputs, outputs, name, TENSORRT_PLUGIN_VERSION)


def standalone_model(opset: int = 18) -> onnx.ModelProto:
    """A model holding just the node (dynamic B, W, V) and its functions: how tests and tools run it."""
    make = onnx.helper.make_tensor_value_info
    elem = {"logits": onnx.TensorProto.FLOAT, "temperature": onnx.TensorProto.FLOAT,
            "entropy_bound": onnx.TensorProto.FLOAT, "finished": onnx.TensorProto.BOOL,
            "scaled_logits": onnx.TensorProto.FLOAT, "accepted": onnx.TensorProto.BOOL,
            "mean_entropy": onnx.TensorProto.FLOAT}
    shape = {"logits": ["B", "W", "V"], "scaled_logits": ["B", "W", "V"], "canvas": ["B", "W"],
             "positions": ["B", "W"], "next_canvas": ["B", "W"], "argmax": ["B", "W"], "accepted": ["B", "W"]}
    value = lambda name: make(name, elem.get(name, onnx.TensorProto.INT64), shape.get(name, ["B"]))  # noqa: E731
    graph = onnx.helper.make_graph([node(list(INPUTS), list(OUTPUTS))], "entropy_bound_step",
                                   [value(n) for n in INPUTS], [value(n) for n in OUTPUTS])
    return model_of_node(graph, function_protos(), opset)


register_schema()
_nodes = _NodeOpset(DOMAIN, VERSION)  # the same bare-node opset as ParallelUnmask's, now knowing this schema


def entropy_bound_step_translation(logits, canvas, positions, temperature, entropy_bound, seed, step, finished):
    """How torch.onnx.export would write a `torch.ops.dlmrt.entropy_bound_step` (traced, not scripted): as
    one dlmrt node; `attach_custom_op` adds its function and plugin attributes after export."""
    return _nodes.EntropyBoundStep(logits, canvas, positions, temperature, entropy_bound, seed, step, finished)
