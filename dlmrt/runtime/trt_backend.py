"""TrtBackend: the TensorRT engines `dlmrt build` stored for this GPU, run on the device loop's buffers.

    TrtBackend(export_dir)                                   # this GPU's engine, its default precision
    TrtBackend(export_dir, engines=STORE, precision="fp8")

Design notes: docs/runtime-modules.md#trt_backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from dlmrt.engines import builder, profiles, targets
from dlmrt.engines.select import select
from dlmrt.engines.store import EngineStore
from dlmrt.core.errors import ArgumentError, DlmrtError, MissingExtraError
from dlmrt.export.export_manifest import CANVAS_GRAPHS, ExportManifest
from dlmrt.ops import register_tensorrt_plugins
from dlmrt.runtime.backend import Backend, GraphOptions
from dlmrt.runtime.model_spec import ModelSpec
from dlmrt.runtime.uniform_state import CacheGroup
from dlmrt.runtime.buckets import BucketLadder


class EngineRunError(DlmrtError):
    """TensorRT refused an engine, a shape or an address."""


def import_tensorrt():
    if builder.installed_tensorrt() is None:
        raise MissingExtraError("--backend trt needs TensorRT, which is not installed: pip install "
                                "'dlmrt[tensorrt]' on a machine with an NVIDIA GPU")
    import tensorrt

    return tensorrt


class TrtBackend(Backend):
    every_output = True  # TensorRT needs an address for every output

    def __init__(self, export_dir: str | Path, engines: str | Path | None = None, *, precision: str | None = None,
                 tensorrt=None, plugins: Callable[[], None] = register_tensorrt_plugins,
                 capability: tuple[int, int] | None = None, device: str | torch.device = "cuda"):
        """`tensorrt`, `plugins`, `capability` and `device` default to the real TensorRT, its plugin
        registration and the running GPU; the tests hand in a fake of them."""
        self.export_dir = Path(export_dir)
        manifest = ExportManifest.read(self.export_dir)
        trt = tensorrt if tensorrt is not None else import_tensorrt()
        device = torch.device(device)
        if capability is None:
            gpu = targets.running_gpu()
            if gpu is None:
                raise ArgumentError("--backend trt runs TensorRT engines on a CUDA GPU, and none is visible: "
                                    "use --backend torch or --backend ort here")
            capability = gpu[0]
        needed = CANVAS_GRAPHS if manifest.model.noise == "uniform" else ("full", "cached")
        self.selected = select(EngineStore(engines), self.export_dir, capability=capability,
                               tensorrt_version=trt.__version__, precision=precision, graphs=needed)
        record = self.selected.manifest
        spec = ModelSpec.of_export(manifest, self.export_dir, device)
        guided = all(graph in record["graphs"] for graph in ("full_guided", "cached_guided"))
        spec = dataclasses.replace(spec, supports_guidance=spec.supports_guidance and guided)
        self.rebuild_hint = f"rebuild with larger ranges (`dlmrt build {self.export_dir} --batch MIN:OPT:MAX " \
                            f"--prefix MIN:OPT:MAX ...`)"
        highest = {name: profiles.parse_range(text, name, least=0).max for name, text in record["ranges"].items()}
        longest = min(manifest.limits.max_length, *(highest[name] for name in ("window", "prefix") if name in highest))
        super().__init__(spec, BucketLadder(highest["batch"], longest, batch_hint=self.rebuild_hint,
                                            canvas_hint=self.rebuild_hint),
                         mode="cudagraph" if device.type == "cuda" else "eager")
        plugins()  # before deserializing: the engines hold the dlmrt plugins
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engines, self._contexts = {}, {}
        for graph in record["graphs"]:
            engine = runtime.deserialize_cuda_engine(self.selected.engine(graph).read_bytes())
            if engine is None:
                raise EngineRunError(f"TensorRT {trt.__version__} could not deserialize "
                                     f"{self.selected.engine(graph)} (its log above says why): rebuild it")
            self._engines[graph] = engine
            self._contexts[graph] = engine.create_execution_context()
        self._trt = trt
        self._current: dict[str, _EngineBinding] = {}  # per graph: the binding its context is set up for

    def bind(self, graph: str, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
             options: GraphOptions = GraphOptions()) -> _EngineBinding:
        outputs = dict(outputs)
        return _EngineBinding(self, graph, dict(inputs), outputs, outputs)

    # -- a uniform-noise model's cache -----------------------------------------------------------------
    def cache_groups(self) -> tuple[CacheGroup, CacheGroup]:
        shapes = (tuple(self._engines["decode"].get_tensor_shape(name)) for name in ("past_sliding", "past_full"))
        return tuple(CacheGroup(layers, heads, head) for layers, _, _, heads, _, head in shapes)


class _EngineBinding:
    """Static buffers bound to one graph's execution context: `inputs` and `outputs` by name; a call
    enqueues the engine on them and returns `results`."""

    def __init__(self, backend: TrtBackend, graph: str, inputs: dict[str, torch.Tensor],
                 outputs: dict[str, torch.Tensor], results=None):
        self.backend, self.graph = backend, graph
        self.inputs, self.outputs, self.results = inputs, outputs, results  # the buffers stay alive with it
        self.context, engine = backend._contexts[graph], backend._engines[graph]
        names = [engine.get_tensor_name(index) for index in range(engine.num_io_tensors)]
        input_mode = backend._trt.TensorIOMode.INPUT
        wanted = {name: engine.get_tensor_mode(name) == input_mode for name in names}
        missing = [name for name, is_input in wanted.items() if name not in (inputs if is_input else outputs)]
        if missing:
            raise EngineRunError(f"the {graph} engine in {backend.selected.entry} has tensors the export's step "
                                 f"does not ({', '.join(missing)}): rebuild it from this export with `dlmrt build`")
        self.shapes = {name: tuple(inputs[name].shape) for name, is_input in wanted.items() if is_input}
        self.addresses = {name: (inputs[name] if is_input else outputs[name]).data_ptr()
                          for name, is_input in wanted.items()}
        for name, shape in self.shapes.items():
            declared = tuple(engine.get_tensor_shape(name))
            low, high = engine.get_tensor_profile_shape(name, 0)[::2] if -1 in declared else (declared, declared)
            if len(shape) != len(low) or any(not lo <= size <= hi for size, lo, hi in zip(shape, low, high)):
                raise ArgumentError(f"{graph} input {name} of shape {list(shape)} lies outside the engine's "
                                    f"profile ({list(low)} to {list(high)}): {backend.rebuild_hint}")
        self.make_current()
        for name, tensor in outputs.items():
            found = tuple(self.context.get_tensor_shape(name)) if name in wanted else None
            if found is not None and found != tuple(tensor.shape):
                raise EngineRunError(f"the {graph} engine's {name} output has shape {list(found)}, the step "
                                     f"expects {list(tensor.shape)}: rebuild it from this export")

    def make_current(self) -> None:
        if self.backend._current.get(self.graph) is self:
            return
        for name, shape in self.shapes.items():
            if not self.context.set_input_shape(name, shape):
                raise EngineRunError(f"TensorRT refused shape {list(shape)} for {self.graph} input {name}")
        for name, address in self.addresses.items():
            if not self.context.set_tensor_address(name, address):
                raise EngineRunError(f"TensorRT refused the address of {self.graph} tensor {name}")
        self.backend._current[self.graph] = self

    def __call__(self, inputs=None):
        self.make_current()
        device = self.backend.spec.device
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        if not self.context.execute_async_v3(stream):
            raise EngineRunError(f"TensorRT failed to enqueue the {self.graph} engine (its log above says why)")
        return self.results

