"""TorchBackend: the step graphs in PyTorch, run eagerly, compiled, or captured into CUDA graphs.

    TorchBackend(model)                   # mode "auto": cudagraph on CUDA, eager on a CPU
    TorchBackend(model, mode="eager")     # op by op

Design notes: docs/runtime-modules.md#torch_backend.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from dlmrt.core.errors import ArgumentError
from dlmrt.models import Denoiser
from dlmrt.models.residual import Residual
from dlmrt.models.step_graph import StepGraph
from dlmrt.ops.entropy_bound import RenoiseParams, RenoiseResult, entropy_bound_step
from dlmrt.ops.parallel_unmask import choice
from dlmrt.runtime import onednn
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.uniform_state import CacheGroup, UniformState
from dlmrt.runtime.device_state import BucketLadder, DeviceState
from dlmrt.runtime.device_step import GraphOutputs, StepKind, TokenLogprobs
from dlmrt.runtime.executor import MODES
from dlmrt.runtime.model_spec import ModelSpec

DEFAULT_MAX_BATCH = 64


def modes_for(device: torch.device) -> tuple[str, ...]:
    return MODES if device.type == "cuda" else ("eager", "compile")


def resolve_mode(mode: str, device: torch.device) -> str:
    """The mode to run: `auto` is cudagraph on CUDA and eager elsewhere; a mode this device cannot run is
    refused. On a CPU a compiled step is faster, but a one-off command pays more for compiling than it
    saves; the commands, which know their work, pick with `cpu_mode.auto_mode` (docs/device-loop.md)."""
    if mode == "auto":
        return "cudagraph" if device.type == "cuda" else "eager"
    runnable = modes_for(device)
    if mode not in runnable:
        known = "" if mode in MODES else f" (modes: auto, {', '.join(MODES)})"
        raise ArgumentError(f"mode {mode!r} cannot run on {device.type}{known}: modes that run here are auto, "
                            f"{', '.join(runnable)}")
    return mode


class _TorchGraph:
    """The step graph as `device_step.step` calls it: inputs by name in, what it reads out."""

    def __init__(self, graph: StepGraph, observe: Callable[[Mapping[str, Tensor]], None] | None = None):
        self.graph, self.observe = graph, observe

    def __call__(self, inputs: Mapping[str, Tensor]) -> GraphOutputs:
        if self.observe is not None:
            self.observe(inputs)
        out = self.graph(**inputs)
        z, certainty = (out[5], out[6]) if self.graph.residual else (None, None)
        if not self.graph.return_logits:
            return GraphOutputs(out[0], out[4], z, certainty)
        if self.graph.model.vocab_shard is not None:
            return GraphOutputs(out[0], out[4], z, certainty, logprobs=TokenLogprobs(*out[-3:]))
        return GraphOutputs(out[0], out[4], z, certainty, logits=out[-1])


class TorchBackend(Backend):
    def __init__(self, model: Denoiser, *, mode: str = "auto", max_batch: int = DEFAULT_MAX_BATCH,
                 max_length: int | None = None, batch_sizes: tuple[int, ...] | None = None,
                 canvas_lengths: tuple[int, ...] | None = None, unmask: str = "auto",
                 on_compile: Callable[[str], None] | None = None,
                 observe: Callable[[Mapping[str, Tensor]], None] | None = None):
        """`observe(inputs)` (eager mode only) sees each step graph's inputs by name, before the step
        runs, as the step consumes them: what ORL training records of a rollout. `unmask`: the unmasking
        step's kernels, "auto" (`choice.resolve`: the torch reference except where a GPU run measured
        Triton faster), "torch" or "triton"."""
        model.eval()
        spec = ModelSpec.of_model(model)
        resolved = resolve_mode(mode, spec.device)
        if observe is not None and resolved != "eager":
            raise ArgumentError(f"observing the step's inputs needs mode 'eager', not {resolved!r}: a compiled "
                                f"or captured step cannot call back into Python")
        # A bucket that fails to compile or capture runs eagerly when the mode was the default one.
        super().__init__(spec, BucketLadder(
            max_batch, max_length or spec.max_positions, batch_sizes, canvas_lengths,
            batch_hint="raise the limit with --max-batch (TorchBackend(max_batch=...))",
            canvas_hint="raise it with TorchBackend(max_length=...), up to the model's context"),
            mode=resolved, on_failure="fall back" if mode == "auto" else "explain", on_compile=on_compile)
        self.model, self.mode, self.observe = model, resolved, observe
        # "torch" or "triton"; a bucket that falls back to eager keeps it
        self.unmask = choice.resolve(unmask, spec.device, resolved, sharded=spec.vocab_ranks > 1)
        self._graphs: dict[tuple, _TorchGraph] = {}
        self._packed: onednn.PackedModel | None = None  # the model with its linears on oneDNN, on a CPU

    def _step_model(self) -> Denoiser:
        """The model a step runs: on a CPU, with its larger linears prepacked for oneDNN."""
        if not onednn.available(self.model):
            return self.model
        if self._packed is None:
            self._packed = onednn.PackedModel(self.model)
        return self._packed.model

    def prepare_steps(self, state, program, steps: int) -> float:
        if self._packed is not None:
            self._packed.refresh()  # the model's weights may have changed since the last steps (training)
        return super().prepare_steps(state, program, steps)

    # -- the graph runner ---------------------------------------------------------------------------
    def step_graph(self, state: DeviceState, kind: StepKind, model: Denoiser | None = None) -> _TorchGraph:
        model = model or self._step_model()
        grid = state.bucket.block if self.spec.block_causal else None
        graph = kind.graph(state.bucket.guided)
        key = (graph, grid, kind.writes > 0, kind.sampling, kind.confidence, kind.editing, kind.logprobs, id(model))
        if key not in self._graphs:
            self._graphs[key] = _TorchGraph(StepGraph(model, graph, grid, return_kv=kind.writes > 0,
                                                      sampling=kind.sampling, confidence=kind.confidence,
                                                      editing=kind.editing, unmask=self.unmask,
                                                      return_logits=kind.logprobs).eval(),
                                            self.observe)
        return self._graphs[key]

    def uniform_graphs(self, state: UniformState) -> _TorchUniformGraphs:
        return _TorchUniformGraphs(self.model)

    def binding_key(self, program) -> object:
        return program  # the torch step graph is specialized on the whole kind (sampling, confidence, ...)

    def eager_graphs(self, state, program, graphs):
        if isinstance(program, StepKind):
            return self.step_graph(state, program, self.model)
        return graphs

    def cache_groups(self) -> tuple[CacheGroup, CacheGroup]:
        return tuple(CacheGroup(*shape) for shape in self.model.cache_groups())

    @torch.no_grad()
    def encode(self, ids: Tensor, positions: Tensor, key_mask: Tensor, cache):
        return self.model.encode(ids, positions=positions, key_mask=key_mask, past=cache)


class _TorchUniformGraphs:
    """A uniform-noise model's decoder and soft tokens as `uniform_step.step` calls them."""

    def __init__(self, model: Denoiser):
        self.model = model

    def decode(self, state: UniformState) -> Tensor:
        key_mask = torch.cat((state.past_key_mask, state.key_mask), dim=1)
        return self.model.denoise(state.block_ids, positions=state.positions, key_mask=key_mask, past=state.cache,
                                  residual=Residual(state.z, None)).logits

    def soft_tokens(self, scaled_logits: Tensor) -> Tensor:
        return self.model.soft_tokens(scaled_logits).z

    def entropy_bound_step(self, logits: Tensor, canvas: Tensor, positions: Tensor, params: RenoiseParams,
                           finished: Tensor) -> RenoiseResult:
        if self.model.vocab_shard is not None:
            return self.model.vocab_shard.entropy_bound_step(logits, canvas, positions, params, finished)
        return entropy_bound_step(logits, canvas, positions, params, finished=finished)
