"""OrtBackend: the exported graphs (`dlmrt export`) run by ONNX Runtime, with IO binding.

    OrtBackend(export_dir)                  # the CPU provider
    OrtBackend(export_dir, device="cuda")   # the CUDA provider (`dlmrt[onnx-gpu]`), over CUDA graphs

Design notes: docs/runtime-modules.md#ort_backend.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
import torch

from dlmrt.core.errors import ArgumentError, MissingExtraError
from dlmrt.export.cpu_quantized import check_quantized, is_cpu_quantized
from dlmrt.export.export_manifest import ExportManifest
from dlmrt.runtime.backend import Backend, GraphOptions
from dlmrt.runtime.model_spec import ModelSpec
from dlmrt.runtime.uniform_state import CacheGroup
from dlmrt.runtime.buckets import BucketLadder
from dlmrt.runtime.ort_cache import OptimizedModelCache

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.bool: np.bool_}


# ONNX Runtime's run options: no host synchronization at the end of a run (the loop reads nothing
# back per step), and the CUDA graph a run captures or replays (0 is ONNX Runtime's own).
NO_SYNC, GRAPH_ANNOTATION = "disable_synchronize_execution_providers", "gpu_graph_id"


class _SessionBinding:
    """A session bound to static buffers by name (IO binding); a call runs it on them, in place."""

    def __init__(self, session, graph: str, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
                 run_options, observe: Callable[[str, Mapping[str, torch.Tensor]], None] | None):
        self.session, self.graph, self.inputs, self.outputs = session, graph, inputs, outputs
        self.run_options, self.observe = run_options, observe
        self.binding = io_binding(session, inputs, outputs)

    def __call__(self) -> Mapping[str, torch.Tensor]:
        if self.observe is not None:
            self.observe(self.graph, self.inputs)
        self.session.run_with_iobinding(self.binding, self.run_options)
        return self.outputs


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
                 optimized_model_dir: str | Path | None = None,
                 observe: Callable[[str, Mapping[str, torch.Tensor]], None] | None = None,
                 spinning: bool | None = None):
        """`cuda_graph` (default: on CUDA) annotates every binding with a CUDA graph of its own; on the
        CPU the annotations are inert (the CPU provider captures nothing), which is how they are tested.
        `observe(graph, inputs)` sees each graph run's inputs by name, before the run, as the run reads
        them (what calibration records). `spinning` (default: on, but off for uniform-noise models,
        whose loop runs torch ops between graph runs) lets the intra-op threads spin after a run; a
        benchmark that times torch cases between ONNX Runtime's turns it off, as the spinning threads
        slow the case after them (the tiny model's torch eager generate, 2 cores: 190 ms right after a
        spinning run, 113 ms after one that does not spin, 117 ms after 1.5 s idle)."""
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
        uniform = spec.noise == "uniform"
        if is_cpu_quantized(self.manifest):
            if device.type != "cpu":
                raise ArgumentError(f"{self.export_dir} is an {self.manifest.quantization['precision']} export, a "
                                    f"CPU format: run it with --device cpu, or export without --precision "
                                    f"for {device.type}")
            check_quantized(self.export_dir, self.manifest)
        if uniform and device.type != "cpu":
            raise ArgumentError(f"ONNX Runtime runs uniform-noise exports on the CPU only, not on {device.type}: "
                                f"use --device cpu, or the torch backend")
        if self.spec.dtype not in _NUMPY:
            raise ArgumentError(f"{self.export_dir} holds {self.manifest.model.dtype} graphs, which ONNX "
                                f"Runtime cannot run here (its CPU provider has no bfloat16 kernels): export in "
                                f"float32 or float16 for ONNX Runtime; bfloat16 exports are for TensorRT")
        self.cuda_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
        self.stream = None
        self.observe = observe
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
            options = session_options(optimization, threads, spinning=not uniform if spinning is None else spinning)
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
        self._annotations = {graph: 0 for graph in self.sessions}  # the last graph annotation of each session

    # -- the graph runner -------------------------------------------------------------------------------
    def bind(self, graph: str, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
             options: GraphOptions = GraphOptions()) -> _SessionBinding:
        return _SessionBinding(self.sessions[graph], graph, inputs, outputs, self._run_options(graph), self.observe)

    def around_steps(self, run: Callable[[], None]) -> Callable[[], None]:
        if self.stream is None:
            return run
        device, stream = self.spec.device, self.stream

        def on_own_stream() -> None:
            loop_stream = torch.cuda.current_stream(device)
            stream.wait_stream(loop_stream)
            with torch.cuda.stream(stream):
                run()
            loop_stream.wait_stream(stream)
        return on_own_stream

    def _run_options(self, graph: str):
        import onnxruntime as ort

        options = ort.RunOptions()
        options.add_run_config_entry(NO_SYNC, "1")
        if self.cuda_graph:
            self._annotations[graph] += 1
            options.add_run_config_entry(GRAPH_ANNOTATION, str(self._annotations[graph]))
        return options

    # -- a uniform-noise model's cache -----------------------------------------------------------------
    def cache_groups(self) -> tuple[CacheGroup, CacheGroup]:
        """The fixed sizes of each cache group, from the decoder's contract: [layers, 2, B, heads, P, head size]."""
        if self.spec.noise != "uniform":
            return super().cache_groups()
        inputs = {c.name: c.shape for c in self.manifest.graphs["decode"].inputs}
        return tuple(CacheGroup(layers, heads, head)
                     for layers, _, _, heads, _, head in (inputs[name] for name in ("past_sliding", "past_full")))
