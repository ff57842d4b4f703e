"""What both exporters share: tracing a module to ONNX, saving a graph, and writing the export directory.

The step graphs' exporter (`dlmrt.export.onnx_export`) and the uniform-noise graphs' exporter
(`dlmrt.export.uniform_export`) both import this module and nothing of each other but the dispatch
(`onnx_export.export` hands a uniform-noise model on), so neither depends on the other's internals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import onnx
import torch
from torch import nn

from dlmrt.core import atomic
from dlmrt.core.hashing import sha256_of
from dlmrt.core.version import __version__
from dlmrt.export.export_manifest import ExportLimits, ExportManifest, GraphEntry, TensorContract
from dlmrt.models import Denoiser, SpecialTokens, checkpoint

# Beyond this, weights go to external data files (protobuf caps a file at 2 GiB).
EXTERNAL_DATA_BYTES = 1 << 30


@contextlib.contextmanager
def _quiet_exporter():
    """Hide the exporter's log lines (e.g. that torchvision is not installed), which concern no user."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def to_onnx(module: nn.Module, inputs: Mapping[str, torch.Tensor], dynamic: dict[str, dict], opset: int,
            output_names: list[str], translations: Mapping | None = None) -> onnx.ModelProto:
    """`module` called on the keyword `inputs` (example tensors, in the graph's input order), traced to ONNX
    with the `dynamic` shapes kept dynamic, and the custom ops' `translations`."""
    with warnings.catch_warnings(), torch.no_grad(), _quiet_exporter():
        warnings.simplefilter("ignore")  # the exporter's notes on dimension names are not the user's concern
        program = torch.onnx.export(module.eval(), (), kwargs=dict(inputs), dynamo=True, dynamic_shapes=dynamic,
                                    opset_version=opset, input_names=list(inputs), output_names=output_names,
                                    verbose=False, custom_translation_table=translations)
    onnx_model = program.model_proto
    _check_dynamic(onnx_model, dynamic)
    onnx_model.producer_name, onnx_model.producer_version = "dlmrt", __version__
    return onnx_model


def _check_dynamic(onnx_model: onnx.ModelProto, dynamic: dict[str, dict]) -> None:
    """The exporter falls back to fixed shapes when it cannot keep a dimension dynamic: refuse that."""
    for value in onnx_model.graph.input:
        dims = value.type.tensor_type.shape.dim
        fixed = [axis for axis in dynamic.get(value.name, {}) if not dims[axis].dim_param]
        if fixed:
            raise RuntimeError(f"the ONNX exporter fixed axis {fixed[0]} of input {value.name!r} to "
                               f"{dims[fixed[0]].dim_value} instead of keeping it dynamic (a dlmrt bug)")


def save_graph(onnx_model: onnx.ModelProto, path: Path) -> None:
    """Save a graph; one over EXTERNAL_DATA_BYTES keeps its weights in `<name>.data` beside it
    (protobuf cannot hold 2 GiB)."""
    large = onnx_model.ByteSize() > EXTERNAL_DATA_BYTES
    onnx.save_model(onnx_model, path, save_as_external_data=large, all_tensors_to_one_file=True,
                    location=f"{path.name}.data")


def write_export(model: Denoiser, out_dir: str | Path, graphs: Mapping[str, Callable[[], onnx.ModelProto]],
                 file_of: Callable[[str], str], *, block_grid: int | None, opset: int, max_batch: int,
                 max_length: int, on_graph: Callable[[str], None] | None) -> Path:
    """Write an export directory atomically: each graph `graphs[name]()` makes (checked, as `file_of(name)`),
    the model's tokenizer and generation config, and the manifest, with the model's description and the
    `block_grid` its graphs were built with."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    with atomic.directory(out_dir, replaces=ExportManifest.present, what="a dlmrt export") as staging:
        entries = {}
        for graph, make in graphs.items():
            onnx_model = make()
            path = staging / file_of(graph)
            save_graph(onnx_model, path)
            onnx.checker.check_model(path, full_check=True)
            entries[graph] = GraphEntry(file=path.name, inputs=TensorContract.of_values(onnx_model.graph.input),
                                        outputs=TensorContract.of_values(onnx_model.graph.output))
            if on_graph is not None:
                on_graph(graph)
        if model.tokenizer is not None:  # so that an export directory is all a runtime needs
            atomic.write_text(staging / "tokenizer.json", model.tokenizer.to_str())
        checkpoint.copy_tokenizer_config(model, staging)  # the chat template, for `dlmrt serve`
        atomic.write_text(staging / "generation_config.json", json.dumps(model.generation_config, indent=2))
        files = {p.name: sha256_of(p) for p in sorted(staging.iterdir()) if p.is_file()}
        ExportManifest(
            model=dataclasses.replace(model.description, block_grid=block_grid),
            tokens=SpecialTokens(model.tokens.mask_id, tuple(model.tokens.eos_ids), model.tokens.pad_id),
            limits=ExportLimits(max_batch=max_batch, max_length=max_length), graphs=entries, files=files,
            opset=opset, dlmrt_version=__version__, torch_version=torch.__version__,
            onnx_version=onnx.__version__, exported_s=round(time.perf_counter() - started, 2),
        ).save(staging)
    return out_dir
