"""OrtBackend: the exported step graphs (`dlmrt export`) run by ONNX Runtime, with IO binding.

One session per graph (`full`, `cached`, and the guided ones). A step is `device_step.step`, as for
every backend, with the session as its step graph: for each bucket and step kind an IO binding is
made once, with the state's static buffers (or the window buffers `device_step.gather` refills) as
inputs and static output buffers, so a step binds and copies nothing. The whole-canvas refresh
writes its K/V straight into the cache storage, and a step that writes no cache binds no K/V
output.

    OrtBackend(export_dir)                  # the CPU provider
    OrtBackend(export_dir, device="cuda")   # the CUDA provider (`dlmrt[onnx-gpu]`), over CUDA graphs

On CUDA the buffers live on the GPU and are bound there; ONNX Runtime runs on the backend's own
CUDA stream (its `user_compute_stream`), ordered after and before the torch stream the loop runs
on by stream waits, so no run synchronizes with the host. With `enable_cuda_graph` each binding (a
bucket and step kind, whose shapes and addresses never change) carries its own graph annotation,
as onnxruntime-genai gives each batch size one: ONNX Runtime captures a graph per annotation on its
first runs and replays it after.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
import torch

from dlmrt.core.errors import ArgumentError, MissingExtraError
from dlmrt.export.export_manifest import ExportManifest
from dlmrt.runtime import device_step
from dlmrt.runtime.backend import Backend, ModelSpec
from dlmrt.runtime.device_state import BucketLadder, DeviceState
from dlmrt.runtime.device_step import GraphOutputs, StepKind
from dlmrt.runtime.ort_cache import OptimizedModelCache

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.bool: np.bool_}


# ONNX Runtime's run options: no host synchronization at the end of a run (the loop reads nothing
# back per step), and the CUDA graph a run captures or replays (0 is ONNX Runtime's own).
NO_SYNC, GRAPH_ANNOTATION = "disable_synchronize_execution_providers", "gpu_graph_id"


class _Binding:
    """One IO binding of a session to a bucket's buffers, for one step kind."""

    def __init__(self, session, state: DeviceState, kind: StepKind, inputs: dict[str, torch.Tensor],
                 outputs: dict[str, torch.Tensor], run_options):
        self.session, self.state, self.outputs = session, state, outputs  # the state stays alive with its binding
        self.results = device_step.graph_outputs(outputs, kind)
        self.run_options = run_options
        self.binding = io_binding(session, inputs, outputs)

    def __call__(self, inputs) -> GraphOutputs:
        self.session.run_with_iobinding(self.binding, self.run_options)
        return self.results


def io_binding(session, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]):
    """An IO binding of `session` to static buffers, by name: runs read and write them in place."""
    binding = session.io_binding()
    for name, tensor in inputs.items():
        _bind(binding.bind_input, name, tensor)
    for name, tensor in outputs.items():
        _bind(binding.bind_output, name, tensor)
    return binding


def _bind(bind, name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous: a dlmrt bug (bindings read static buffers as they are)")
    bind(name, tensor.device.type, tensor.device.index or 0, _NUMPY[tensor.dtype], list(tensor.shape),
         tensor.data_ptr())


def cuda_provider(device: torch.device, stream: torch.cuda.Stream, cuda_graph: bool) -> tuple[str, dict[str, str]]:
    """The CUDA execution provider on `device`, running on `stream`, capturing CUDA graphs or not.
    TF32 is off, as in torch's float32 matmuls, so a float32 export gives torch's tokens."""
    return "CUDAExecutionProvider", {"device_id": str(device.index or 0), "has_user_compute_stream": "1",
                                     "user_compute_stream": str(stream.cuda_stream),
                                     "enable_cuda_graph": "1" if cuda_graph else "0", "use_tf32": "0"}


def session_options(optimization: str, threads: int | None, *, spinning: bool = True):
    """ONNX Runtime session options at an optimization level (OPTIMIZATION_LEVELS), with `threads` intra-op
    threads (None: ONNX Runtime's default). `spinning=False` lets the intra-op threads sleep between runs
    instead of spinning, for a loop that runs torch ops between them (spinning threads take the cores
    those ops need)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: its notes on saved optimized models concern no user
    options.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[optimization]
    if threads is not None:
        options.intra_op_num_threads = threads
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class OrtBackend(Backend):
    def __init__(self, export_dir: str | Path, *, device: str | torch.device = "cpu", cuda_graph: bool | None = None,
                 threads: int | None = None, optimization: str = "all",
                 optimized_model_dir: str | Path | None = None):
        """`cuda_graph` (default: on CUDA) annotates every binding with a CUDA graph of its own; on the
        CPU the annotations are inert (the CPU provider captures nothing), which is how they are tested."""
        import onnxruntime as ort

        self.export_dir = Path(export_dir)
        self.manifest = ExportManifest.load(self.export_dir)
        device = torch.device(device)
        spec = ModelSpec.of_export(self.manifest, self.export_dir, device)
        limits = self.manifest.limits
        super().__init__(spec, BucketLadder(limits.max_batch, limits.max_length, batch_hint=spec.limits_hint,
                                            canvas_hint=spec.limits_hint))
        if optimization not in OPTIMIZATION_LEVELS:
            raise ArgumentError(f"optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}, got {optimization!r}")
        if self.spec.dtype not in _NUMPY:
            raise ArgumentError(f"{self.export_dir} holds {self.manifest.model.dtype} graphs, which ONNX "
                                f"Runtime cannot run here (its CPU provider has no bfloat16 kernels): export in "
                                f"float32 or float16 for ONNX Runtime; bfloat16 exports are for TensorRT")
        self.cuda_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
        self.stream = None
        providers: list = ["CPUExecutionProvider"]
        if device.type == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available():
                raise MissingExtraError("ONNX Runtime on CUDA needs onnxruntime-gpu and a visible GPU: pip install "
                                        "'dlmrt[onnx-gpu]' (in place of dlmrt[onnx]) on a machine with an NVIDIA GPU")
            self.stream = torch.cuda.Stream(device)
            providers.insert(0, cuda_provider(device, self.stream, self.cuda_graph))
        elif device.type != "cpu":
            raise ArgumentError(f"OrtBackend runs on cpu or cuda, not {device.type}")
        cache = OptimizedModelCache(optimized_model_dir) if optimized_model_dir is not None else None
        self.sessions = {}
        for graph, entry in self.manifest.graphs.items():
            options = session_options(optimization, threads)
            source: str | bytes = str(self.export_dir / entry.file)
            self.manifest.check_graph(graph, onnx.load(source, load_external_data=False), source)
            external = f"{entry.file}.data" in self.manifest.files
            writing = saved = None
            if cache is not None and not external:  # >2 GiB models are not re-serialized
                saved = cache.path(graph, self.manifest.graph_sha256(graph), optimization, device.type)
                sealed = cache.load(saved)
                if sealed is not None:
                    source = sealed
                    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
                else:
                    writing = cache.writing_path(saved)
                    options.optimized_model_filepath = str(writing)
                    # ORT's own inlining of nested functions writes a file it cannot read back;
                    # onnx's inliner gives every inlined value a unique name.
                    source = onnx.inliner.inline_local_functions(onnx.load(source)).SerializeToString()
            self.sessions[graph] = ort.InferenceSession(source, options, providers=providers)
            if writing is not None:
                cache.keep(writing, saved)
        self._bindings: dict[tuple, _Binding] = {}
        self._annotations = {graph: 0 for graph in self.sessions}  # the last graph annotation of each session

    def feeds(self, state: DeviceState, kind: StepKind) -> tuple[str, dict[str, torch.Tensor]]:
        """The graph the next step of `kind` runs, and its inputs by name, gathered from the state
        (the bound buffers themselves: copy them to keep them)."""
        device_step.allocate(state, kind)
        device_step.gather(state, kind)
        return kind.graph(state.bucket.guided), device_step.graph_inputs(state, kind)

    def run(self, state: DeviceState, kind: StepKind, steps: int) -> None:
        binding = self._binding(state, kind)
        if self.stream is None:
            for _ in range(steps):
                device_step.step(state, kind, binding)
            return
        loop_stream = torch.cuda.current_stream(self.spec.device)
        self.stream.wait_stream(loop_stream)
        with torch.cuda.stream(self.stream):
            for _ in range(steps):
                device_step.step(state, kind, binding)
        loop_stream.wait_stream(self.stream)

    def _binding(self, state: DeviceState, kind: StepKind) -> _Binding:
        key = (id(state), kind.binding_key)
        if key not in self._bindings:
            device_step.allocate(state, kind)
            graph = kind.graph(state.bucket.guided)
            self._bindings[key] = _Binding(self.sessions[graph], state, kind, device_step.graph_inputs(state, kind),
                                           device_step.output_buffers(self.spec, state, kind),
                                           self._run_options(graph))
        return self._bindings[key]

    def _run_options(self, graph: str):
        import onnxruntime as ort

        options = ort.RunOptions()
        options.add_run_config_entry(NO_SYNC, "1")
        if self.cuda_graph:
            self._annotations[graph] += 1
            options.add_run_config_entry(GRAPH_ANNOTATION, str(self._annotations[graph]))
        return options
