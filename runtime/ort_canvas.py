"""OrtCanvasBackend: a uniform-noise model's exported graphs (`dlmrt export` of DiffusionGemma) run by
ONNX Runtime on the CPU, as the `CanvasBackend` of the uniform-noise loop (`dlmrt.runtime.uniform_noise`).

    Generator(OrtCanvasBackend(export_dir)).generate(prompts, GenerationSettings(
        gen_length=256, block_length=256, policy=EntropyBound()))

One session per graph of `dlmrt.export.canvas_export`: `encode` (the cache commit; the prompt runs it
over an empty prefix), `decode` (the denoising step) and `soft_tokens` (the next step's
self-conditioning). The cache is a `LayerGroupKV` of CPU tensors, what the encoder graph returned;
tensors pass to and from ONNX Runtime as numpy arrays over the same memory. The loop's `[B, P + T]`
key mask is split into the graphs' `past_key_mask [B, P]` and `key_mask [B, T]`.

`soft_tokens` runs the exported `soft_tokens` graph, so z = softmax(scaled logits) @ E uses the
embedding matrix exported beside it (hashed in the manifest), not one read out of the decoder graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from torch import Tensor

from dlmrt.errors import ArgumentError
from dlmrt.export.export_manifest import ExportManifest
from dlmrt.export.models.diffusion_gemma import LayerGroupKV
from dlmrt.export.models.residual import Residual
from dlmrt.runtime.ort_backend import OPTIMIZATION_LEVELS, session_options
from dlmrt.runtime.backend import Backend, ModelSpec
from dlmrt.runtime.device_state import BucketLadder, DeviceState
from dlmrt.runtime.device_step import StepKind
from dlmrt.runtime.uniform_noise import CanvasBackend

_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class OrtCanvasBackend(Backend, CanvasBackend):
    def __init__(self, export_dir: str | Path, *, device: str | torch.device = "cpu", threads: int | None = None,
                 optimization: str = "all"):
        """`threads`: ONNX Runtime's intra-op threads (default: its own choice)."""
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
            options = session_options(optimization, threads)
            source = str(self.export_dir / entry.file)
            self.manifest.check_graph(graph, onnx.load(source, load_external_data=False), source)
            self.sessions[graph] = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        # The fixed sizes of each cache group, from the decoder's contract: [layers, 2, B, heads, P, head size].
        inputs = {c.name: c.shape for c in self.manifest.graphs["decode"].inputs}
        self._cache_shapes = {name: inputs[name] for name in ("past_sliding", "past_full")}

    # -- CanvasBackend --------------------------------------------------------------------------------
    def empty_cache(self, batch: int) -> LayerGroupKV:
        """The cache before the prompt: no positions."""
        groups = [torch.zeros(layers, 2, batch, heads, 0, head, dtype=self.spec.dtype)
                  for layers, _, _, heads, _, head in self._cache_shapes.values()]
        return LayerGroupKV(*groups, torch.zeros(batch, 0, dtype=torch.long))

    def encode(self, ids: Tensor, positions: Tensor, key_mask: Tensor, cache: LayerGroupKV | None) -> LayerGroupKV:
        if cache is None:  # the prompt: the first call of a request, so its limits are checked here
            self._check_batch(ids.shape[0])
            cache = self.empty_cache(ids.shape[0])
        sliding, full, cache_positions = self._run("encode", {"ids": ids, "positions": positions,
                                                              **self._cache_feeds(ids, key_mask, cache)})
        return LayerGroupKV(sliding, full, cache_positions)

    def decode(self, canvas: Tensor, positions: Tensor, key_mask: Tensor, cache: LayerGroupKV | None,
               soft_tokens: Residual | None) -> Tensor:
        if cache is None:  # a canvas with no context
            cache = self.empty_cache(canvas.shape[0])
        z = (torch.zeros(*canvas.shape, self.spec.hidden_size, dtype=self.spec.dtype) if soft_tokens is None
             else soft_tokens.z)  # zeros: the decoder's first step, no self-conditioning
        (logits,) = self._run("decode", {"canvas": canvas, "positions": positions, "z": z,
                                         **self._cache_feeds(canvas, key_mask, cache)})
        return logits

    def soft_tokens(self, scaled_logits: Tensor) -> Residual:
        z, certainty = self._run("soft_tokens", {"scaled_logits": scaled_logits.float()})
        return Residual(z, certainty)

    # -- the mask models' step contract, which these graphs do not implement ------------------------------
    def run(self, state: DeviceState, kind: StepKind, steps: int) -> None:
        raise ArgumentError(f"{self.export_dir} holds a uniform-noise model's graphs, which run in the uniform-noise "
                            f"loop (Generator does so), not as mask-model steps")

    # -- running a graph ------------------------------------------------------------------------------
    def _check_batch(self, batch: int) -> None:
        if batch > self.manifest.limits.max_batch:
            raise ArgumentError(f"{batch} prompts exceed the batch limit of {self.manifest.limits.max_batch} this "
                                f"export was made for: {self.spec.limits_hint}")

    @staticmethod
    def _cache_feeds(ids: Tensor, key_mask: Tensor, cache: LayerGroupKV) -> dict[str, Tensor]:
        prefix = cache.positions.shape[1]
        if key_mask.shape != (ids.shape[0], prefix + ids.shape[1]):
            raise ArgumentError(f"key_mask has shape {list(key_mask.shape)}, but a cache of {prefix} positions and "
                                f"{ids.shape[1]} ids need [{ids.shape[0]}, {prefix + ids.shape[1]}]")
        return {"key_mask": key_mask[:, prefix:], "past_key_mask": key_mask[:, :prefix],
                "past_sliding": cache.sliding, "past_full": cache.full, "past_positions": cache.positions}

    def _run(self, graph: str, feeds: dict[str, Tensor]) -> list[Tensor]:
        arrays = {name: np.ascontiguousarray(tensor.detach().cpu().numpy()) for name, tensor in feeds.items()}
        return [torch.from_numpy(array) for array in self.sessions[graph].run(None, arrays)]
