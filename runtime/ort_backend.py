"""OrtBackend: the exported step graphs (`dlmrt export`) run by ONNX Runtime, with IO binding.

One session per graph (`full`, `cached`, and the guided ones). A step is `device_step.step`, as for
every backend, with the session as its step graph: for each bucket and step kind an IO binding is
made once, with the state's static buffers (or the window buffers `device_step.gather` refills) as
inputs and static output buffers, so a step binds and copies nothing. The whole-canvas refresh
writes its K/V straight into the cache storage, and a step that writes no cache binds no K/V
output. The CPU provider is used here; the CUDA provider where onnxruntime-gpu and a GPU are present.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
import torch

from dlmrt.errors import ArgumentError
from dlmrt.export.export_manifest import ExportManifest
from dlmrt.runtime import device_step
from dlmrt.runtime.backend import Backend, ModelSpec
from dlmrt.runtime.device_state import BucketLadder, DeviceState
from dlmrt.runtime.device_step import GraphOutputs, StepKind

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.bool: np.bool_}


class _Binding:
    """One IO binding of a session to a bucket's buffers, for one step kind."""

    def __init__(self, session, state: DeviceState, kind: StepKind, inputs: dict[str, torch.Tensor],
                 outputs: dict[str, torch.Tensor]):
        self.session, self.state, self.outputs = session, state, outputs  # the state stays alive with its binding
        self.results = device_step.graph_outputs(outputs, kind)
        self.binding = session.io_binding()
        for name, tensor in inputs.items():
            _bind(self.binding.bind_input, name, tensor)
        for name, tensor in outputs.items():
            _bind(self.binding.bind_output, name, tensor)

    def __call__(self, inputs) -> GraphOutputs:
        self.session.run_with_iobinding(self.binding)
        return self.results


def _bind(bind, name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous: a dlmrt bug (bindings read static buffers as they are)")
    bind(name, "cpu", 0, _NUMPY[tensor.dtype], list(tensor.shape), tensor.data_ptr())


class OrtBackend(Backend):
    def __init__(self, export_dir: str | Path, *, threads: int | None = None, optimization: str = "all",
                 providers: list[str] | None = None, optimized_model_dir: str | Path | None = None):
        import onnxruntime as ort

        self.export_dir = Path(export_dir)
        self.manifest = ExportManifest.load(self.export_dir)
        spec = ModelSpec.of_export(self.manifest, self.export_dir, torch.device("cpu"))
        limits = self.manifest.limits
        super().__init__(spec, BucketLadder(limits.max_batch, limits.max_length, batch_hint=spec.limits_hint,
                                            canvas_hint=spec.limits_hint))
        if optimization not in OPTIMIZATION_LEVELS:
            raise ArgumentError(f"optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}, got {optimization!r}")
        available = ort.get_available_providers()
        providers = providers or [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        if self.spec.dtype not in _NUMPY:
            raise ArgumentError(f"{self.export_dir} holds {self.manifest.model.dtype} graphs, which ONNX "
                                f"Runtime cannot run here (its CPU provider has no bfloat16 kernels): export in "
                                f"float32 or float16 for ONNX Runtime; bfloat16 exports are for TensorRT")
        self.sessions = {}
        for graph, entry in self.manifest.graphs.items():
            options = ort.SessionOptions()
            options.graph_optimization_level = {
                "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[optimization]
            if threads is not None:
                options.intra_op_num_threads = threads
            source: str | bytes = str(self.export_dir / entry.file)
            external = f"{entry.file}.data" in self.manifest.files
            if optimized_model_dir is not None and not external:  # >2 GiB models are not re-serialized
                # Keyed by the graph's sha256 and the level: an optimized model saved by an earlier
                # session loads as it is, and a changed export never picks up a stale one.
                digest = self.manifest.graph_sha256(graph)[:16]
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
        self._bindings: dict[tuple, _Binding] = {}

    def feeds(self, state: DeviceState, kind: StepKind) -> tuple[str, dict[str, torch.Tensor]]:
        """The graph the next step of `kind` runs, and its inputs by name, gathered from the state
        (the bound buffers themselves: copy them to keep them)."""
        device_step.allocate(state, kind)
        device_step.gather(state, kind)
        return kind.graph(state.bucket.guided), device_step.graph_inputs(state, kind)

    def run(self, state: DeviceState, kind: StepKind, steps: int) -> None:
        binding = self._binding(state, kind)
        for _ in range(steps):
            device_step.step(state, kind, binding)

    def _binding(self, state: DeviceState, kind: StepKind) -> _Binding:
        key = (id(state), kind.binding_key)
        if key not in self._bindings:
            device_step.allocate(state, kind)
            session = self.sessions[kind.graph(state.bucket.guided)]
            self._bindings[key] = _Binding(session, state, kind, device_step.graph_inputs(state, kind),
                                           device_step.output_buffers(self.spec, state, kind))
        return self._bindings[key]
