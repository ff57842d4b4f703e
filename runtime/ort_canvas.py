"""OrtCanvasBackend: a uniform-noise model's exported graphs (`dlmrt export` of DiffusionGemma) run by
ONNX Runtime on the CPU, as the `CanvasBackend` of the uniform-noise loop (`dlmrt.runtime.uniform_noise`).

    Generator(OrtCanvasBackend(export_dir)).generate(prompts, GenerationSettings(
        gen_length=256, block_length=256, policy=EntropyBound()))

One session per graph of `dlmrt.export.canvas_export`: `encode` (the cache commit; the prompt runs it
over an empty prefix), `decode` (the denoising step) and `soft_tokens` (the next step's
self-conditioning). The steps are `dlmrt.runtime.canvas_step`, as for every backend, with the two
step graphs bound once per bucket to its static buffers (IO binding): the decoder reads the canvas,
the soft tokens and the whole cache storage with its `past_key_mask`, and writes the logits into a
buffer of its own. The encoder runs once per block, on numpy arrays over the same memory.

`soft_tokens` runs the exported `soft_tokens` graph, so z = softmax(scaled logits) @ E uses the
embedding matrix exported beside it (hashed in the manifest), not one read out of the decoder graph.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import Tensor

from dlmrt.core.errors import ArgumentError
from dlmrt.export.export_manifest import ExportManifest
from dlmrt.export.models.denoiser import LayerGroupKV
from dlmrt.runtime import canvas_step
from dlmrt.runtime.ort_backend import OPTIMIZATION_LEVELS, io_binding, session_options
from dlmrt.runtime.backend import Backend, ModelSpec
from dlmrt.runtime.canvas_state import CacheGroup, CanvasState, encoder_inputs, zero_cache
from dlmrt.runtime.device_state import BucketLadder, DeviceState
from dlmrt.runtime.device_step import StepKind
from dlmrt.runtime.uniform_noise import CanvasBackend

_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class OrtCanvasBackend(Backend, CanvasBackend):
    def __init__(self, export_dir: str | Path, *, device: str | torch.device = "cpu", threads: int | None = None,
                 optimization: str = "all", observe: Callable[[str, dict[str, Tensor]], None] | None = None):
        """`threads`: ONNX Runtime's intra-op threads (default: its own choice). `observe(graph, inputs)`
        sees each graph run's inputs by name, before the run, as the run reads them (what calibration
        records)."""
        import onnxruntime as ort

        self.export_dir = Path(export_dir)
        self.manifest = ExportManifest.load(self.export_dir)
        model = self.manifest.model
        if model.noise != "uniform":
            raise ArgumentError(f"{self.export_dir} holds the step graphs of a mask model ({model.name}): run it "
                                f"with dlmrt.runtime.ort_backend.OrtBackend")
        device = torch.device(device)
        if device.type != "cpu":
            raise ArgumentError(f"OrtCanvasBackend runs uniform-noise exports on the CPU only, not on "
                                f"{device.type}: use --device cpu, or the torch backend")
        if model.dtype not in _DTYPES:
            raise ArgumentError(f"{self.export_dir} holds {model.dtype} graphs, which ONNX Runtime cannot run here "
                                f"(its CPU provider has no bfloat16 kernels): export in float32 for ONNX Runtime")
        if optimization not in OPTIMIZATION_LEVELS:
            raise ArgumentError(f"optimization must be one of {', '.join(OPTIMIZATION_LEVELS)}, got {optimization!r}")
        # The graphs take any canvas length up to the export's max length, which check_request holds every
        # request to as its context: the spec has no block grid.
        spec = ModelSpec.of_export(self.manifest, self.export_dir, device)
        limits = self.manifest.limits
        super().__init__(spec, BucketLadder(limits.max_batch, limits.max_length, batch_hint=spec.limits_hint,
                                            canvas_hint=spec.limits_hint))
        self.sessions = {}
        for graph, entry in self.manifest.graphs.items():
            # the step's sampling runs in torch between the decode and soft_tokens runs
            options = session_options(optimization, threads, spinning=False)
            source = str(self.export_dir / entry.file)
            self.manifest.check_graph(graph, onnx.load(source, load_external_data=False), source)
            self.sessions[graph] = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        # The fixed sizes of each cache group, from the decoder's contract: [layers, 2, B, heads, P, head size].
        inputs = {c.name: c.shape for c in self.manifest.graphs["decode"].inputs}
        self._cache_shapes = {name: inputs[name] for name in ("past_sliding", "past_full")}
        self._graphs: dict[int, canvas_step.BoundCanvasGraphs] = {}  # per state
        self.observe = observe

    # -- CanvasBackend --------------------------------------------------------------------------------
    def cache_groups(self) -> tuple[CacheGroup, CacheGroup]:
        return tuple(CacheGroup(layers, heads, head) for layers, _, _, heads, _, head in self._cache_shapes.values())

    def empty_cache(self, batch: int) -> LayerGroupKV:
        """The cache before the prompt: no positions."""
        return zero_cache(self.cache_groups(), batch, 0, self.spec.dtype)

    def encode(self, ids: Tensor, positions: Tensor, key_mask: Tensor, cache: LayerGroupKV | None) -> LayerGroupKV:
        if cache is None:  # the prompt
            cache = self.empty_cache(ids.shape[0])
        return LayerGroupKV(*self._run("encode", encoder_inputs(ids, positions, key_mask, cache)))

    def run_canvas(self, state: CanvasState, steps: int) -> None:
        key = id(state)
        if key not in self._graphs:
            self._graphs[key] = canvas_step.BoundCanvasGraphs(state, self.spec.vocab_size, self._bind)
        graphs = self._graphs[key]
        for _ in range(steps):
            canvas_step.step(state, graphs)

    # -- the mask models' step contract, which these graphs do not implement ------------------------------
    def run(self, state: DeviceState, kind: StepKind, steps: int) -> None:
        raise ArgumentError(f"{self.export_dir} holds a uniform-noise model's graphs, which run in the uniform-noise "
                            f"loop (Generator does so), not as mask-model steps")

    # -- running a graph ------------------------------------------------------------------------------
    def _bind(self, graph: str, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> Callable[[], None]:
        """`graph`'s session bound to static buffers (IO binding); the callable runs it on them."""
        session, binding = self.sessions[graph], io_binding(self.sessions[graph], inputs, outputs)

        def run() -> None:
            if self.observe is not None:
                self.observe(graph, inputs)
            session.run_with_iobinding(binding)
        return run

    def _run(self, graph: str, feeds: dict[str, Tensor]) -> list[Tensor]:
        if self.observe is not None:
            self.observe(graph, feeds)
        arrays = {name: np.ascontiguousarray(tensor.detach().cpu().numpy()) for name, tensor in feeds.items()}
        return [torch.from_numpy(array) for array in self.sessions[graph].run(None, arrays)]

