"""OrtBackend: the exported step graphs (`dlmrt export`) run by ONNX Runtime, with IO binding.

One session per graph (`full`, `cached`); inputs are bound from the Generator's torch tensors and
outputs to buffers allocated once per shape bucket, so a step copies nothing it does not have to
(strided views, such as a window of the canvas, are made contiguous first). The CPU provider is
used here; the CUDA provider where onnxruntime-gpu and a GPU are present.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.inliner
import torch

from dlmrt.errors import ArgumentError, CheckpointError
from dlmrt.export.models.denoiser import SpecialTokens
from dlmrt.export.onnx_export import FORMAT_VERSION, MANIFEST
from dlmrt.export.step_graph import graph_name
from dlmrt.hashing import sha256_of
from dlmrt.plugins.parallel_unmask import MEASURE_CODES
from dlmrt.runtime.backend import Backend, ModelSpec, StepInputs, StepOutputs, StepShapes

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.bool: np.bool_}


def read_manifest(export_dir: str | Path) -> dict:
    """The export's manifest (its files unchecked)."""
    export_dir = Path(export_dir)
    path = export_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{export_dir} is not a dlmrt export (no {MANIFEST}): create one with "
                              f"`dlmrt export MODEL_DIR -o {export_dir}`")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {manifest.get('format_version')}, this dlmrt reads "
                              f"{FORMAT_VERSION}: re-export the model")
    return manifest


def load_manifest(export_dir: str | Path) -> dict:
    """The export's manifest, after checking every file against its recorded sha256."""
    export_dir = Path(export_dir)
    manifest = read_manifest(export_dir)
    for name, expected in manifest["files"].items():
        file = export_dir / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing from the export: re-export the model")
        found = sha256_of(file)
        if found != expected:
            raise CheckpointError(f"{file} was changed after export (sha256 {found[:12]}..., the manifest records "
                                  f"{expected[:12]}...): re-export the model with `dlmrt export`")
    return manifest


def spec_from_manifest(manifest: dict, export_dir: Path) -> ModelSpec:
    model, tokens, limits = manifest["model"], manifest["tokens"], manifest["limits"]
    return ModelSpec(
        name=model["name"], vocab_size=model["vocab_size"], hidden_size=model["hidden_size"],
        num_layers=model["num_layers"], num_kv_heads=model["num_kv_heads"], head_dim=model["head_dim"],
        max_positions=limits["max_length"], mask_id=tokens["mask_id"], eos_ids=tuple(tokens["eos_ids"]),
        pad_id=tokens["pad_id"], block_causal=model["block_causal"], has_residual=model["residual"],
        dtype=getattr(torch, model["dtype"]), device=torch.device("cpu"), max_batch=limits["max_batch"],
        limits_hint=f"re-export with `dlmrt export ... -o {export_dir} --max-batch B --max-length N`",
        block_grid=model["block_grid"], supports_guidance="full_guided" in manifest["graphs"])


@dataclass
class ExportedModel:
    """What the CLI and `dlmrt.runtime.text` need of a model, read from an export directory."""

    name: str
    tokens: SpecialTokens
    block_causal: bool
    default_block_length: int | None
    tokenizer: Any = None
    generation_config: dict = field(default_factory=dict)

    @classmethod
    def load(cls, export_dir: str | Path) -> ExportedModel:
        from tokenizers import Tokenizer

        export_dir = Path(export_dir)
        manifest = read_manifest(export_dir)
        tokens, model = manifest["tokens"], manifest["model"]
        tokenizer_path = export_dir / "tokenizer.json"
        generation_path = export_dir / "generation_config.json"
        return cls(name=model["name"],
                   tokens=SpecialTokens(tokens["mask_id"], tuple(tokens["eos_ids"]), tokens["pad_id"]),
                   block_causal=model["block_causal"], default_block_length=model["block_grid"],
                   tokenizer=Tokenizer.from_file(str(tokenizer_path)) if tokenizer_path.is_file() else None,
                   generation_config=json.loads(generation_path.read_text()) if generation_path.is_file() else {})


class OrtBackend(Backend):
    def __init__(self, export_dir: str | Path, *, threads: int | None = None, optimization: str = "all",
                 providers: list[str] | None = None, optimized_model_dir: str | Path | None = None):
        import onnxruntime as ort

        self.export_dir = Path(export_dir)
        self.manifest = load_manifest(self.export_dir)
        self.spec = spec_from_manifest(self.manifest, self.export_dir)
        if optimization not in OPTIMIZATION_LEVELS:
            raise ArgumentError(f"optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}, got {optimization!r}")
        available = ort.get_available_providers()
        providers = providers or [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        if self.spec.dtype not in _NUMPY:
            raise ArgumentError(f"{self.export_dir} holds {self.manifest['model']['dtype']} graphs, which ONNX "
                                f"Runtime cannot run here (its CPU provider has no bfloat16 kernels): export in "
                                f"float32 or float16 for ONNX Runtime; bfloat16 exports are for TensorRT")
        self.sessions = {}
        for graph, entry in self.manifest["graphs"].items():
            options = ort.SessionOptions()
            options.graph_optimization_level = {
                "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[optimization]
            if threads is not None:
                options.intra_op_num_threads = threads
            source: str | bytes = str(self.export_dir / entry["file"])
            external = f"{entry['file']}.data" in self.manifest["files"]
            if optimized_model_dir is not None and not external:  # >2 GiB models are not re-serialized
                # Keyed by the graph's sha256 and the level: an optimized model saved by an earlier
                # session loads as it is, and a changed export never picks up a stale one.
                digest = self.manifest["files"][entry["file"]][:16]
                saved = Path(optimized_model_dir) / f"{graph}-{digest}-{optimization}.onnx"
                if saved.is_file():
                    source = str(saved)
                    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
                else:
                    saved.parent.mkdir(parents=True, exist_ok=True)
                    writing = saved.with_name(f".{saved.name}.{os.getpid()}.tmp")  # renamed once complete
                    options.optimized_model_filepath = str(writing)
                    # ORT's own inlining of nested functions writes a file it cannot read back;
                    # onnx's inliner gives every inlined value a unique name.
                    source = onnx.inliner.inline_local_functions(onnx.load(source)).SerializeToString()
            self.sessions[graph] = ort.InferenceSession(source, options, providers=providers)
            if options.optimized_model_filepath:
                os.replace(options.optimized_model_filepath, saved)
        self._buffers: dict[StepShapes, StepOutputs] = {}
        self._block_index: dict[tuple[int, int], torch.Tensor] = {}
        self._measure: dict[tuple[str, int], torch.Tensor] = {}
        self._scales: dict[float, torch.Tensor] = {}

    def prepare(self, shapes: StepShapes) -> None:
        if shapes in self._buffers:
            return
        s = self.spec
        rows = shapes.batch * (2 if shapes.guided else 1)
        z = certainty = None
        if s.has_residual:
            z = torch.empty(rows, shapes.window, s.hidden_size, dtype=s.dtype)
            certainty = torch.empty(rows, shapes.window, dtype=s.dtype)
        self._buffers[shapes] = StepOutputs(
            ids=torch.empty(shapes.batch, shapes.block, dtype=torch.long),
            confidence=torch.empty(shapes.batch, shapes.block, dtype=torch.float32),
            commit=torch.empty(shapes.batch, shapes.block, dtype=torch.bool),
            committed=torch.empty(shapes.batch, dtype=torch.long),
            kv=torch.empty(s.num_layers, 2, rows, s.num_kv_heads, shapes.window, s.head_dim, dtype=s.dtype),
            z=z, certainty=certainty)

    def step(self, inputs: StepInputs) -> StepOutputs:
        shapes = inputs.shapes()
        self.prepare(shapes)
        buffers = self._buffers[shapes]
        graph, feeds = self.feeds(inputs, shapes)
        session = self.sessions[graph]
        binding = session.io_binding()
        keep = []  # contiguous copies must outlive the run
        for name, tensor in feeds.items():
            tensor = tensor.contiguous()
            keep.append(tensor)
            binding.bind_input(name, "cpu", 0, _NUMPY[tensor.dtype], list(tensor.shape), tensor.data_ptr())
        outputs = {"new_ids": buffers.ids, "confidence": buffers.confidence, "commit": buffers.commit,
                   "committed": buffers.committed, "kv": buffers.kv}
        if self.spec.has_residual:
            outputs.update(next_z=buffers.z, next_certainty=buffers.certainty)
        for name, tensor in outputs.items():
            binding.bind_output(name, "cpu", 0, _NUMPY[tensor.dtype], list(tensor.shape), tensor.data_ptr())
        session.run_with_iobinding(binding)
        return buffers

    def feeds(self, inputs: StepInputs, shapes: StepShapes | None = None) -> tuple[str, dict[str, torch.Tensor]]:
        """The graph that runs this step, and its inputs by name (torch tensors, possibly strided);
        `shapes` are the inputs' shapes where the caller has them."""
        shapes = shapes or inputs.shapes()
        graph = graph_name(cached=inputs.past_kv is not None, guided=shapes.guided)
        window = inputs.ids.shape[1]
        feeds = {
            "ids": inputs.ids, "positions": inputs.positions, "key_mask": inputs.key_mask[:, -window:],
            "block_index": self._block(inputs.block_offset, inputs.block_length),
            **inputs.params._asdict(), "measure": self._measures(inputs.confidence, shapes.batch),
        }
        if inputs.past_kv is not None:
            feeds.update(past_kv=inputs.past_kv, past_positions=inputs.past_positions,
                         past_key_mask=inputs.key_mask[:, :-window])
        if self.spec.has_residual:
            feeds.update(z=inputs.z, certainty=inputs.certainty)
        if shapes.guided:
            feeds.update(prompt_lengths=inputs.prompt_lengths, cfg_scale=self._cfg_scale(inputs.cfg_scale))
        return graph, feeds

    def _block(self, offset: int, length: int) -> torch.Tensor:
        key = (offset, length)
        if key not in self._block_index:
            self._block_index[key] = torch.arange(offset, offset + length)
        return self._block_index[key]

    def _cfg_scale(self, scale: float) -> torch.Tensor:
        if scale not in self._scales:
            self._scales[scale] = torch.tensor([scale], dtype=torch.float32)
        return self._scales[scale]

    def _measures(self, confidence: str, batch: int) -> torch.Tensor:
        key = (confidence, batch)
        if key not in self._measure:
            self._measure[key] = torch.full((batch,), MEASURE_CODES[confidence], dtype=torch.long)
        return self._measure[key]
