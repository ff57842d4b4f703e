"""TorchBackend: the step graphs in PyTorch, run eagerly, compiled, or captured into CUDA graphs.

    TorchBackend(model)                   # mode "auto": cudagraph on CUDA, eager on a CPU
    TorchBackend(model, mode="eager")     # op by op

Design notes: docs/runtime-modules.md#torch_backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor

from dlmrt.core.errors import ArgumentError
from dlmrt.export.export_manifest import CANVAS_GRAPHS as UNIFORM_GRAPHS
from dlmrt.models import Denoiser
from dlmrt.models.denoiser import LayerGroupKV
from dlmrt.models.residual import Residual
from dlmrt.models.step_graph import GRAPHS, GUIDED_GRAPHS, LOGITS_OUTPUT, StepGraph, output_names
from dlmrt.ops.parallel_unmask import choice
from dlmrt.runtime import onednn
from dlmrt.runtime.backend import Backend, GraphOptions
from dlmrt.runtime.uniform_state import CacheGroup
from dlmrt.runtime.buckets import BucketLadder
from dlmrt.runtime.device_step import TokenLogprobs
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


class _TorchBinding:
    """A step graph module bound to the step's input buffers by name; a call runs it on them and returns
    the outputs asked for by name (the module's own tensors)."""

    def __init__(self, graph: StepGraph, inputs: Mapping[str, Tensor], wanted: Iterable[str],
                 observe: Callable[[Mapping[str, Tensor]], None] | None):
        self.graph, self.inputs, self.observe = graph, dict(inputs), observe
        names = output_names(graph.residual)
        if graph.return_logits and graph.model.vocab_shard is not None:  # no rank holds all the logits
            names = [*names[:-1], *TokenLogprobs._fields]
        self.picks = tuple((name, names.index(name)) for name in wanted)

    def __call__(self) -> dict[str, Tensor]:
        if self.observe is not None:
            self.observe(self.inputs)
        out = self.graph(**self.inputs)
        return {name: out[index] for name, index in self.picks}


class TorchBackend(Backend):
    outputs_in_place = False  # a module returns tensors of its own
    specializes = True  # one step graph module per GraphOptions

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
        self.model, self.observe, self.vocab_shard = model, observe, model.vocab_shard
        # "torch" or "triton"; a bucket that falls back to eager keeps it
        self.unmask = choice.resolve(unmask, spec.device, resolved, sharded=spec.vocab_ranks > 1)
        self._graphs: dict[tuple, StepGraph] = {}
        self._packed: onednn.PackedModel | None = None  # the model with its linears on oneDNN, on a CPU

    def _step_model(self) -> Denoiser:
        """The model a step runs: on a CPU, with its larger linears prepacked for oneDNN."""
        if not onednn.available(self.model):
            return self.model
        if self._packed is None:
            self._packed = onednn.PackedModel(self.model)
        else:
            self._packed.refresh()
        return self._packed.model

    # -- the graph runner ---------------------------------------------------------------------------
    def bind(self, graph: str, inputs: Mapping[str, Tensor], outputs: Mapping[str, Tensor | None],
             options: GraphOptions = GraphOptions()) -> _TorchBinding:
        """The step graph module for `graph` on these inputs, specialized on what the step reads (K/V
        out only where `outputs` has a buffer for it, the block's logits likewise) and on `options`."""
        if graph in UNIFORM_GRAPHS:
            return _TorchUniformBinding(self.model, graph, inputs)
        if graph not in GRAPHS + GUIDED_GRAPHS:
            raise ValueError(f"the torch backend runs the graphs {GRAPHS + GUIDED_GRAPHS + UNIFORM_GRAPHS}, "
                             f"not {graph!r}")
        model = self._step_model()
        grid = inputs["block_index"].shape[0] if self.spec.block_causal else None
        return_kv, logits = "kv" in outputs, LOGITS_OUTPUT in outputs or "top_token" in outputs
        key = (graph, grid, return_kv, options, logits, id(model))
        if key not in self._graphs:
            self._graphs[key] = StepGraph(model, graph, grid, return_kv=return_kv, sampling=options.sampling,
                                          confidence=options.confidence, editing=options.editing,
                                          unmask=self.unmask, return_logits=logits).eval()
        return _TorchBinding(self._graphs[key], inputs, outputs, self.observe)

    def around_steps(self, run: Callable[[], None]) -> Callable[[], None]:
        if self._packed is None:
            return run
        packed = self._packed

        def refreshed() -> None:
            packed.refresh()  # the model's weights may have changed since the last steps (training)
            run()
        return refreshed

    def cache_groups(self) -> tuple[CacheGroup, CacheGroup]:
        return tuple(CacheGroup(*shape) for shape in self.model.cache_groups())


class _TorchUniformBinding:
    """A uniform-noise model's `encode`, `decode` or `soft_tokens` (the graphs `dlmrt.export.uniform_export`
    exports, by the same input and output names) run by the torch model on the bound buffers; a call
    returns the outputs by name (the model's own tensors)."""

    def __init__(self, model: Denoiser, graph: str, inputs: Mapping[str, Tensor]):
        self.model, self.inputs = model, dict(inputs)
        self.run = {"encode": self._encode, "decode": self._decode, "soft_tokens": self._soft_tokens}[graph]

    def __call__(self) -> dict[str, Tensor]:
        return self.run(**self.inputs)

    def _encode(self, ids, positions, key_mask, past_key_mask, past_sliding, past_full, past_positions):
        if past_positions.shape[1] == 0:  # a prompt is encoded over no cache at all, as the model's loop does
            cache = self.model.encode(ids, positions=positions, key_mask=key_mask)
        else:
            cache = self.model.encode(ids, positions=positions, key_mask=torch.cat((past_key_mask, key_mask), dim=1),
                                      past=LayerGroupKV(past_sliding, past_full, past_positions))
        return {"sliding": cache.sliding, "full": cache.full, "cache_positions": cache.positions}

    def _decode(self, canvas, positions, key_mask, past_key_mask, past_sliding, past_full, past_positions, z):
        logits = self.model.denoise(canvas, positions=positions, key_mask=torch.cat((past_key_mask, key_mask), dim=1),
                                    past=LayerGroupKV(past_sliding, past_full, past_positions),
                                    residual=Residual(z, None)).logits
        return {"logits": logits}

    def _soft_tokens(self, scaled_logits):
        return dict(zip(("z", "certainty"), self.model.soft_tokens(scaled_logits)))
