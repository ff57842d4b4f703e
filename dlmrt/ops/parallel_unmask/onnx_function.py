"""`dlmrt::ParallelUnmask` in ONNX: the node's schema, and a local function with the same semantics
built from standard opset-18 ops, so that ONNX Runtime (or any ONNX consumer) runs a graph holding
the node as it is, while TensorRT's parser maps the node to our plugin by its `plugin_namespace`.

The function mirrors `reference.py` step by step (same hash, same float64 Gumbel-max, same tie
order: ONNX TopK puts the lower index first among equal values, as a stable descending sort does).
Helpers are functions of their own in the same domain; a model holding the node carries them all
(`function_protos()`).

Inputs:  logits [B, W, V] float, ids [B, W] int64, positions [B, W] int64, count [B] int64,
         threshold [B] float, factor [B] float, temperature [B] float, seed [B] int64, step [B] int64,
         measure [B] int64 (MEASURE_CODES), edit_threshold [B] float, editable [B, W] bool
Outputs: ids [B, W] int64, confidence [B, W] float, commit [B, W] bool, committed [B] int64
Attributes: mask_id (int), plugin_namespace (string), plugin_version (string)

Versions: `PLUGIN_VERSION` is the version of the op's interface. Plans and engine manifests record
it, so an engine built for another interface is refused; version 2 added token editing
(`edit_threshold`, `editable`). Graphs exported before it carry the version 1 function in their
own file, so ONNX Runtime still runs them. The node's `plugin_version` attribute is TensorRT's
registry version instead: `tensorrt.plugin` registers every plugin as version "1", and the parser
looks a plugin up by that attribute.
"""


import onnx
from onnxscript import BOOL, DOUBLE, FLOAT, INT64, script
from onnxscript import opset18 as op
from onnxscript.values import Opset

DOMAIN = "dlmrt"
OP_TYPE = "ParallelUnmask"
VERSION = 1
PLUGIN_VERSION = "2"
TENSORRT_PLUGIN_VERSION = "1"
INPUTS = ("logits", "ids", "positions", "count", "threshold", "factor", "temperature", "seed", "step", "measure",
          "edit_threshold", "editable")
OUTPUTS = ("new_ids", "confidence", "commit", "committed")

dlmrt = Opset(DOMAIN, VERSION)
MINUS_INF = float("-inf")


@script(dlmrt)
def ParallelUnmaskMix32(x: INT64) -> INT64:
    """The 32-bit xorshift-multiply finalizer of reference._mix32 (integer division is the shift:
    every value is non-negative)."""
    x = op.BitwiseXor(x, op.Div(x, 65536))
    x = op.BitwiseAnd(op.Mul(x, 2146121005), 4294967295)
    x = op.BitwiseXor(x, op.Div(x, 32768))
    x = op.BitwiseAnd(op.Mul(x, 739982445), 4294967295)
    return op.BitwiseXor(x, op.Div(x, 65536))


@script(dlmrt)
def ParallelUnmaskRowHash(seed: INT64, step: INT64, positions: INT64) -> INT64:
    """`[B, W]` hash of (seed [B], step [B], positions [B, W]) before the last index is mixed in."""
    h = ParallelUnmaskMix32(op.BitwiseAnd(seed, 4294967295))
    h = ParallelUnmaskMix32(op.BitwiseXor(h, op.BitwiseAnd(step, 4294967295)))
    return ParallelUnmaskMix32(op.BitwiseXor(op.Unsqueeze(h, [1]), op.BitwiseAnd(positions, 4294967295)))


@script(dlmrt)
def ParallelUnmaskUniform(row_hash: INT64, index: INT64) -> DOUBLE:
    """float64 in (0, 1) from a row hash `[B, W, 1...]` and an index broadcast against it."""
    h = ParallelUnmaskMix32(op.BitwiseXor(row_hash, index))
    return op.Div(op.Add(op.Cast(h, to=11), 0.5), 4294967296.0)


@script(dlmrt)
def ParallelUnmask(logits: FLOAT, ids: INT64, positions: INT64, count: INT64, threshold: FLOAT, factor: FLOAT,
                   temperature: FLOAT, seed: INT64, step: INT64, measure: INT64, edit_threshold: FLOAT,
                   editable: BOOL, mask_id: int) -> (INT64, FLOAT, BOOL, INT64):
    mask_token = op.Constant(value_int=mask_id)
    vocab = op.Shape(logits, start=-1)
    width = op.Shape(ids, start=-1)
    token = op.Range(0, op.Squeeze(vocab), 1)
    is_mask_token = op.Equal(token, mask_token)
    minus_inf = op.CastLike(MINUS_INF, logits)
    row_hash = ParallelUnmaskRowHash(seed, step, positions)

    # candidates: the argmax, or LLaDA's float64 Gumbel-max where the row's temperature is > 0
    candidate_logits = op.Where(is_mask_token, minus_inf, logits)
    if op.ReduceMax(temperature, keepdims=0) > 0.0:
        noise = ParallelUnmaskUniform(op.Unsqueeze(row_hash, [2]), token)
        t = op.Unsqueeze(op.Cast(temperature, to=11), [1, 2])
        as_double = op.Cast(candidate_logits, to=11)
        scores = op.Div(op.Exp(as_double), op.Pow(op.Neg(op.Log(noise)), t))
        x0 = op.ArgMax(op.Where(t > 0.0, scores, as_double), axis=-1, keepdims=0)
    else:
        x0 = op.ArgMax(candidate_logits, axis=-1, keepdims=0)

    # every confidence measure, then each row's
    logp = op.LogSoftmax(logits, axis=-1)
    p = op.Exp(logp)
    prob = op.Squeeze(op.GatherElements(p, op.Unsqueeze(x0, [-1]), axis=-1), [-1])
    top2, top2_index = op.TopK(op.Where(is_mask_token, op.CastLike(0.0, p), p), [2], axis=-1)
    margin = op.Sub(op.Squeeze(op.Slice(top2, [0], [1], [-1]), [-1]), op.Squeeze(op.Slice(top2, [1], [2], [-1]), [-1]))
    plogp = op.Where(p > 0.0, op.Mul(p, logp), op.CastLike(0.0, p))
    entropy = op.Neg(op.ReduceSum(plogp, [-1], keepdims=0))
    log_vocab = op.Cast(op.Log(op.Cast(vocab, to=11)), to=1)
    certainty = op.Sub(1.0, op.Div(entropy, log_vocab))
    drawn = ParallelUnmaskUniform(row_hash, 1540483477)
    random = op.Cast(op.Div(op.Add(op.Floor(op.Mul(drawn, 8388608.0)), 0.5), 8388608.0), to=1)
    code = op.Unsqueeze(measure, [1])
    conf = op.Where(code == 0, prob, op.Where(code == 1, margin, op.Where(code == 2, certainty, random)))

    # commit the k most confident masked positions
    is_masked = op.Equal(ids, mask_token)
    conf = op.Where(is_masked, conf, minus_inf)
    ranked, order = op.TopK(conf, width, axis=-1, largest=1, sorted=1)
    above = op.ReduceSum(op.Cast(op.GreaterOrEqual(ranked, op.Unsqueeze(threshold, [1])), to=7), [-1],
                         keepdims=0)
    n = op.Cast(op.Range(1, op.Add(op.Squeeze(width), 1), 1), to=1)
    accepted = op.Less(op.Mul(op.Add(n, 1.0), op.Sub(1.0, ranked)), op.Unsqueeze(factor, [1]))
    rejected_before = op.CumSum(op.Cast(op.Not(accepted), to=7), -1)
    factor_prefix = op.ReduceSum(op.Cast(op.Equal(rejected_before, 0), to=7), [-1], keepdims=0)
    masked = op.ReduceSum(op.Cast(is_masked, to=7), [-1], keepdims=0)
    k = op.Min(masked, op.Max(count, op.Max(above, factor_prefix)))
    slots = op.Expand(op.Range(0, op.Squeeze(width), 1), op.Shape(order))
    rank = op.ScatterElements(op.ConstantOfShape(op.Shape(order), value=[0]), order, slots, axis=-1)
    commit = op.And(op.Less(rank, op.Unsqueeze(k, [1])), is_masked)

    # token editing: overwrite committed positions whose candidate differs and is likely enough
    confident = op.GreaterOrEqual(prob, op.Unsqueeze(edit_threshold, [1]))
    edit = op.And(op.And(editable, op.Not(is_masked)), op.And(op.Not(op.Equal(x0, ids)), confident))
    return op.Where(op.Or(commit, edit), x0, ids), conf, commit, k


def function_protos() -> list[onnx.FunctionProto]:
    """The op's function and its helpers, for a model's `functions`."""
    return [f.to_function_proto() for f in (ParallelUnmaskMix32, ParallelUnmaskRowHash, ParallelUnmaskUniform,
                                             ParallelUnmask)]


def schema() -> onnx.defs.OpSchema:
    FormalParameter = onnx.defs.OpSchema.FormalParameter
    types = {"logits": "tensor(float)", "threshold": "tensor(float)", "factor": "tensor(float)",
             "temperature": "tensor(float)", "edit_threshold": "tensor(float)", "editable": "tensor(bool)",
             "confidence": "tensor(float)", "commit": "tensor(bool)"}
    return onnx.defs.OpSchema(
        OP_TYPE, DOMAIN, VERSION,
        doc="One parallel unmasking step of a diffusion language model (dlmrt).",
        inputs=[FormalParameter(name, types.get(name, "tensor(int64)")) for name in INPUTS],
        outputs=[FormalParameter(name, types.get(name, "tensor(int64)")) for name in OUTPUTS],
        attributes=[
            onnx.defs.OpSchema.Attribute("mask_id", onnx.defs.OpSchema.AttrType.INT, "the mask token id"),
            *plugin_attributes(),
        ])


def plugin_attributes() -> list[onnx.defs.OpSchema.Attribute]:
    """The attributes by which TensorRT's ONNX parser finds a dlmrt node's plugin, in every op's schema."""
    return [onnx.defs.OpSchema.Attribute(name, onnx.defs.OpSchema.AttrType.STRING, f"TensorRT plugin {what}",
                                         required=False)
            for name, what in (("plugin_namespace", "namespace"), ("plugin_version", "version"))]


def register_once(op_type: str, schema) -> None:
    """Make the dlmrt node `op_type` known to onnx (checker, shape inference) with `schema()`, unless it is."""
    if not onnx.defs.has(op_type, DOMAIN):
        onnx.defs.register_schema(schema())


def plugin_node(op_type: str, inputs: list[str], outputs: list[str], name: str, plugin_version: str,
                **attributes) -> onnx.NodeProto:
    """A dlmrt node with the attributes by which TensorRT's parser finds its plugin (`plugin_attributes`)."""
    return onnx.helper.make_node(op_type, inputs, outputs, name=name, domain=DOMAIN, plugin_namespace=DOMAIN,
                                 plugin_version=plugin_version, **attributes)


def model_of_node(graph: onnx.GraphProto, functions: list[onnx.FunctionProto], opset: int) -> onnx.ModelProto:
    """A model of `graph` (one dlmrt node) carrying the node's `functions`, so ONNX Runtime runs it."""
    return onnx.helper.make_model(
        graph, functions=functions,
        opset_imports=[onnx.helper.make_opsetid("", opset), onnx.helper.make_opsetid(DOMAIN, VERSION)])


def register_schema() -> None:
    """Make the node known to onnx (checker, shape inference); safe to call more than once."""
    register_once(OP_TYPE, schema)


def node(inputs: list[str], outputs: list[str], mask_id: int, name: str = "parallel_unmask") -> onnx.NodeProto:
    return plugin_node(OP_TYPE, inputs, outputs, name, TENSORRT_PLUGIN_VERSION, mask_id=mask_id)


def standalone_model(mask_id: int, opset: int = 18) -> onnx.ModelProto:
    """A model holding just the node (dynamic B, W, V) and its functions: how tests and tools run it."""
    make = onnx.helper.make_tensor_value_info
    elem = {"logits": onnx.TensorProto.FLOAT, "threshold": onnx.TensorProto.FLOAT,
            "factor": onnx.TensorProto.FLOAT, "temperature": onnx.TensorProto.FLOAT,
            "edit_threshold": onnx.TensorProto.FLOAT, "editable": onnx.TensorProto.BOOL,
            "confidence": onnx.TensorProto.FLOAT, "commit": onnx.TensorProto.BOOL}
    shape = {"logits": ["B", "W", "V"], "ids": ["B", "W"], "positions": ["B", "W"], "new_ids": ["B", "W"],
             "confidence": ["B", "W"], "commit": ["B", "W"], "editable": ["B", "W"]}
    value = lambda name: make(name, elem.get(name, onnx.TensorProto.INT64), shape.get(name, ["B"]))  # noqa: E731
    graph = onnx.helper.make_graph([node(list(INPUTS), list(OUTPUTS), mask_id)], "parallel_unmask",
                                   [value(n) for n in INPUTS], [value(n) for n in OUTPUTS])
    return model_of_node(graph, function_protos(), opset)


class _NodeOpset(Opset):
    """The dlmrt domain as bare nodes (by schema), apart from the functions registered on `dlmrt`."""


register_schema()
_nodes = _NodeOpset(DOMAIN, VERSION)


def parallel_unmask_translation(logits, ids, positions, count, threshold, factor, temperature, seed, step,
                                measure, edit_threshold, editable, mask_id: int):
    """How torch.onnx.export writes `torch.ops.dlmrt.parallel_unmask` (traced, not scripted): as one
    dlmrt node; `attach` adds its function and plugin attributes after export."""
    return _nodes.ParallelUnmask(logits, ids, positions, count, threshold, factor, temperature, seed, step,
                                 measure, edit_threshold, editable, mask_id=mask_id)
