"""`dlmrt export`: the step graphs of a denoiser as ONNX, with a manifest (`dlmrt.json`).

    OUT_DIR/step_full.onnx     the step without a cached prefix
    OUT_DIR/step_cached.onnx   the step over a cached prefix
    OUT_DIR/dlmrt.json         model, graphs and their input/output contract, special token ids,
                               dimension limits, opset, and the sha256 of every file
                               (`export_manifest.ExportManifest` reads and writes it)
    OUT_DIR/tokenizer.json, tokenizer_config.json, generation_config.json   copied from the model
                               (those it has), so the directory is all a runtime needs

Batch, window, prefix and block lengths are dynamic up to the limits recorded in the manifest. The
`dlmrt::ParallelUnmask` node (and, in ORL graphs, the `dlmrt::ResidualContext` node) carries
`plugin_namespace`, and the model carries the ONNX local functions of the ops it holds, so ONNX
Runtime runs the files as they are. The directory is written atomically: an export killed midway
leaves no directory that loads.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path

import onnx
import torch

from dlmrt.core import limits
from dlmrt.core.errors import ArgumentError, UnsupportedFeatureError
from dlmrt.core.version import __version__
from dlmrt.export.export_writer import to_onnx, write_export
from dlmrt.models import Denoiser, checkpoint
from dlmrt.models.step_graph import GRAPHS, GUIDED_GRAPHS, StepGraph, input_names, output_names
from dlmrt.ops.parallel_unmask import MEASURE_CODES, onnx_function
from dlmrt.ops.residual_context import onnx_function as residual_function

DEFAULT_OPSET = 18
EXPORTABLE_FAMILIES = ("llada", "llada2_moe", "Dream", "sdar", "diffusion_gemma")
# The dlmrt custom ops a step graph may hold, by (domain, op_type): their onnx_function modules.
CUSTOM_OPS = {(f.DOMAIN, f.OP_TYPE): f for f in (onnx_function, residual_function)}


def graph_file(graph: str) -> str:
    return f"step_{graph}.onnx"


def check_exportable(model: Denoiser) -> None:
    """Refuse, before anything is written, what the exporter cannot trace into a static graph."""
    if model.model_type not in EXPORTABLE_FAMILIES:
        raise UnsupportedFeatureError(
            f"exporting {model.model_type} models is not supported (exportable families: "
            f"{', '.join(EXPORTABLE_FAMILIES)})")
    if model.tokens is None:
        raise ArgumentError(f"{model.name} has no mask token id: load it with dlmrt.load")


EXAMPLE_BATCH, EXAMPLE_LENGTH = 3, 8  # the example inputs' batch, and a length above their window and prefix


def _example_inputs(model: Denoiser, graph: str, batch: int = EXAMPLE_BATCH, window: int = 6, prefix: int = 5,
                    block: int = 4) -> dict[str, torch.Tensor]:
    device, dtype = model.device, model.dtype
    long = dict(dtype=torch.long, device=device)
    values = {
        "ids": torch.full((batch, window), model.tokens.mask_id, **long),
        "positions": (torch.arange(window, **long) + prefix).repeat(batch, 1),
        "key_mask": torch.ones(batch, window, dtype=torch.bool, device=device),
        "block_index": torch.arange(block, **long),
        "count": torch.ones(batch, **long),
        "threshold": torch.full((batch,), 0.9, device=device),
        "factor": torch.zeros(batch, device=device),
        "temperature": torch.zeros(batch, device=device),
        "seed": torch.zeros(batch, **long),
        "step": torch.zeros(batch, **long),
        "measure": torch.full((batch,), MEASURE_CODES["prob"], **long),
        "edit_threshold": torch.full((batch,), 0.9, device=device),
        "prompt_lengths": torch.full((batch,), 2, **long),
    }
    rows = 2 * batch if graph.endswith("_guided") else batch  # the model's rows
    if graph.startswith("cached"):
        values["past_kv"] = torch.zeros(model.num_layers, 2, rows, model.num_kv_heads, prefix, model.head_dim,
                                        dtype=dtype, device=device)
        values["past_positions"] = torch.arange(prefix, **long).repeat(batch, 1)
        values["past_key_mask"] = torch.ones(batch, prefix, dtype=torch.bool, device=device)
    if model.residual_config is not None:
        values["z"] = torch.zeros(rows, window, model.hidden_size, dtype=dtype, device=device)
        values["certainty"] = torch.zeros(rows, window, dtype=dtype, device=device)
    if graph.endswith("_guided"):
        values["cfg_scale"] = torch.ones(1, device=device)
    return values


def _dynamic_shapes(graph: str, names: list[str], max_batch: int, max_length: int) -> dict[str, dict]:
    # The graph's dimensions reach at least past the example inputs (torch.export needs the example
    # inside each range, and a range wider than one value); the manifest's limits are the ones a
    # backend enforces, so a graph built wider than asked takes nothing more.
    max_batch, max_length = max(max_batch, EXAMPLE_BATCH), max(max_length, EXAMPLE_LENGTH)
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    window = torch.export.Dim("window", min=1, max=max_length)
    block = torch.export.Dim("block", min=1, max=max_length)
    prefix = torch.export.Dim("prefix", min=1, max=max_length)
    rows = 2 * batch if graph.endswith("_guided") else batch
    shapes = {"ids": {0: batch, 1: window}, "positions": {0: batch, 1: window}, "key_mask": {0: batch, 1: window},
              "block_index": {0: block}, "past_kv": {2: rows, 4: prefix}, "past_positions": {0: batch, 1: prefix},
              "past_key_mask": {0: batch, 1: prefix}, "z": {0: rows, 1: window}, "certainty": {0: rows, 1: window},
              "cfg_scale": {}}
    return {name: shapes.get(name, {0: batch}) for name in names}


def attach_custom_op(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every dlmrt custom node (CUSTOM_OPS) its plugin attributes, and the model the functions of
    the ops it uses."""
    used = set()
    for node in model.graph.node:
        op = CUSTOM_OPS.get((node.domain, node.op_type))
        if op is None:
            continue
        used.add(op)
        present = {a.name for a in node.attribute}
        for name, value in (("plugin_namespace", op.DOMAIN), ("plugin_version", op.TENSORRT_PLUGIN_VERSION)):
            if name not in present:
                node.attribute.append(onnx.helper.make_attribute(name, value))
    known = {(f.domain, f.name) for f in model.functions}
    for op in sorted(used, key=lambda module: module.OP_TYPE):
        model.functions.extend(f for f in op.function_protos() if (f.domain, f.name) not in known)
    return model


def export_graph(model: Denoiser, graph: str, grid: int | None, opset: int, max_batch: int,
                 max_length: int) -> onnx.ModelProto:
    residual = model.residual_config is not None
    names = input_names(graph, residual)
    examples = _example_inputs(model, graph)
    return attach_custom_op(to_onnx(
        StepGraph(model, graph, grid), {name: examples[name] for name in names},
        _dynamic_shapes(graph, names, max_batch, max_length), opset, output_names(residual),
        {torch.ops.dlmrt.parallel_unmask.default: onnx_function.parallel_unmask_translation,
         torch.ops.dlmrt.residual_context.default: residual_function.residual_context_translation}))


def export(model: Denoiser, out_dir: str | Path, *, opset: int = DEFAULT_OPSET, block_length: int | None = None,
           max_batch: int = 64, max_length: int | None = None, guidance: bool = False,
           on_graph: Callable[[str], None] | None = None) -> Path:
    """Write the step graphs of `model` and their manifest to `out_dir` (atomically); with `guidance`,
    also the classifier-free-guidance graphs. A uniform-noise model (DiffusionGemma) gets its encoder,
    decoder and soft-token graphs instead (`dlmrt.export.uniform_export`)."""
    check_exportable(model)
    newest = onnx.defs.onnx_opset_version()
    if not 18 <= opset <= newest:
        raise ArgumentError(f"opset must lie in [18, {newest}]: the step graph needs opset 18 or newer, and the "
                            f"installed onnx {onnx.__version__} knows opsets up to {newest}; got {opset}")
    max_length = model.max_positions if max_length is None else max_length
    if not 0 < max_length <= model.max_positions:
        raise ArgumentError(f"max-length must lie in [1, {model.max_positions}] (the model's context), "
                            f"got {max_length}")
    if not 0 < max_batch <= limits.MAX_BATCH:
        raise ArgumentError(f"max-batch must lie in [1, {limits.MAX_BATCH}], got {max_batch}")
    if block_length is not None and not 0 < block_length <= max_length:
        raise ArgumentError(f"block-length must lie in [1, max-length = {max_length}], got {block_length}")
    if model.noise == "uniform":
        from dlmrt.export import uniform_export

        if guidance or block_length is not None:
            raise ArgumentError(f"{'--guidance' if guidance else '--block-length'} does not apply to {model.name}: "
                                f"a uniform-noise model has no guidance graphs, and its graphs take any block "
                                f"length up to max-length")
        return uniform_export.export(model, out_dir, opset=opset, max_batch=max_batch, max_length=max_length,
                                    on_graph=on_graph)
    grid = (block_length or model.default_block_length) if model.block_causal else None
    for op in CUSTOM_OPS.values():
        op.register_schema()
    names = GRAPHS + (GUIDED_GRAPHS if guidance else ())
    return write_export(model, out_dir, {graph: functools.partial(export_graph, model, graph, grid, opset, max_batch,
                                                                  max_length) for graph in names},
                        graph_file, block_grid=grid, opset=opset, max_batch=max_batch, max_length=max_length,
                        on_graph=on_graph)


def cached_export_dir(model_dir: str | Path, dtype: str, opset: int = DEFAULT_OPSET) -> Path:
    """Where `dlmrt generate --backend ort` keeps the export of a model directory: under
    `$DLMRT_HOME/exports`, keyed by the model's files (name, size, mtime), dtype, opset and dlmrt."""
    from dlmrt.core.home import home

    model_dir = Path(model_dir).resolve()
    checkpoint.read_config(model_dir)  # a missing or foreign directory gets the loader's own error, not a traceback
    key = hashlib.sha256(f"{model_dir}|{dtype}|{opset}|{__version__}".encode())
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            stat = path.stat()
            key.update(f"|{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return home() / "exports" / f"{model_dir.name}-{key.hexdigest()[:16]}"
