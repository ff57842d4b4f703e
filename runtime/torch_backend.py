"""TorchBackend: the step graph in PyTorch, run eagerly, compiled, or captured into CUDA graphs.

    TorchBackend(model)                   # mode "auto": cudagraph on CUDA, compile on a CPU
    TorchBackend(model, mode="eager")     # today's loop: op by op

Every mode runs the same function, K steps of `dlmrt.runtime.device_step.step` over a bucket's
static buffers, with the module the exporter traces (`dlmrt.export.step_graph.StepGraph`) as the step:

- `eager`: op by op, as written.
- `compile`: `torch.compile(fullgraph=True, dynamic=False)` of the step, one graph per bucket and
  step kind, run K times back to back. (The K-step function compiles as one graph too, but unrolling
  K steps multiplies the compile time by K, 157 s for a whole block of 32 on the benchmark's model,
  and buys nothing where a host read costs nothing.) On a CPU the linear layers run on oneDNN with
  prepacked weights (`dlmrt.runtime.onednn`). Inductor's compiled artifacts are kept under
  `$DLMRT_HOME/inductor` (unless TORCHINDUCTOR_CACHE_DIR is set), so a later process compiles faster.
- `cudagraph` (CUDA only): the K-step function is captured once per bucket, step kind and K into a
  `torch.cuda.CUDAGraph` after a warm-up on a side stream, all graphs sharing one memory pool; a
  replay reads the static buffers, which the host refills before it (block start, schedule).

A uniform-noise model's steps (`dlmrt.runtime.canvas_step`, over a canvas bucket's buffers) run in
the same three modes, one runner per bucket and K.

A bucket that fails to compile or capture falls back to `eager` when the mode was the default one
(`auto`), with one warning; a mode asked for by name fails with the error.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from dlmrt.core.errors import ArgumentError
from dlmrt.export.models import Denoiser
from dlmrt.export.models.residual import Residual
from dlmrt.export.step_graph import StepGraph, check_unmask
from dlmrt.runtime import canvas_step, cuda_graphs, device_step, onednn
from dlmrt.runtime.backend import Backend, ModelSpec
from dlmrt.runtime.canvas_state import CacheGroup, CanvasState
from dlmrt.runtime.device_state import BucketLadder, DeviceState
from dlmrt.runtime.device_step import GraphOutputs, StepKind
from dlmrt.runtime.uniform_noise import CanvasBackend

MODES = ("eager", "compile", "cudagraph")
DEFAULT_MAX_BATCH = 64
# Graphs dynamo may hold for the compiled step: one per bucket and step kind.
_RECOMPILE_LIMIT = 1024


def spec_of(model: Denoiser) -> ModelSpec:
    if model.tokens is None:
        raise ValueError(f"{model.name} has no special token ids (mask/eos/pad): load it with "
                         f"dlmrt.load or give them to the model")
    return ModelSpec(
        name=model.name, vocab_size=model.vocab_size, hidden_size=model.hidden_size,
        num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        max_positions=model.max_positions, mask_id=model.tokens.mask_id,
        eos_ids=tuple(model.tokens.eos_ids), pad_id=model.tokens.pad_id,
        block_causal=model.block_causal, has_residual=model.residual_config is not None,
        dtype=model.dtype, device=model.device, logits_shift=model.logits_shift, noise=model.noise)


def modes_for(device: torch.device) -> tuple[str, ...]:
    return MODES if device.type == "cuda" else ("eager", "compile")


def resolve_mode(mode: str, device: torch.device) -> str:
    """The mode to run: `auto` is cudagraph on CUDA and compile elsewhere (on a CPU the faster of eager
    and compile, measured by scripts/bench_device_loop.py); a mode this device cannot run is refused."""
    if mode == "auto":
        return "cudagraph" if device.type == "cuda" else "compile"
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
        z, certainty = (out[5], out[6]) if len(out) > 5 else (None, None)
        return GraphOutputs(out[0], out[4], z, certainty)


class TorchBackend(Backend, CanvasBackend):
    def __init__(self, model: Denoiser, *, mode: str = "auto", max_batch: int = DEFAULT_MAX_BATCH,
                 max_length: int | None = None, batch_sizes: tuple[int, ...] | None = None,
                 canvas_lengths: tuple[int, ...] | None = None, unmask: str = "torch",
                 on_compile: Callable[[str], None] | None = None,
                 observe: Callable[[Mapping[str, Tensor]], None] | None = None):
        """`observe(inputs)` (eager mode only) sees each step graph's inputs by name, before the step
        runs, as the step consumes them: what ORL training records of a rollout."""
        model.eval()
        spec = spec_of(model)
        super().__init__(spec, BucketLadder(
            max_batch, max_length or spec.max_positions, batch_sizes, canvas_lengths,
            batch_hint="raise the limit with --max-batch (TorchBackend(max_batch=...))",
            canvas_hint="raise it with TorchBackend(max_length=...), up to the model's context"))
        self.model = model
        self.mode = resolve_mode(mode, spec.device)
        if observe is not None and self.mode != "eager":
            raise ArgumentError(f"observing the step's inputs needs mode 'eager', not {self.mode!r}: a compiled "
                                f"or captured step cannot call back into Python")
        self.observe = observe
        check_unmask(unmask)
        self.unmask = unmask  # the unmasking step's kernels: "torch" (its reference) or "triton"
        self.falls_back = mode == "auto"  # to eager, when a bucket fails to compile or capture
        self._graphs: dict[tuple, _TorchGraph] = {}
        self._runners: dict[tuple, object] = {}  # (state, kind, steps) -> what `run` calls
        self._fallback_warned = False
        self._compiled = self._compiled_canvas = None
        self._compile_model: Denoiser | None = None
        self._pool = None
        self.on_compile = on_compile  # told what is compiled or captured, before it is

    # -- the K-step function ------------------------------------------------------------------------
    def _steps(self, state: DeviceState, kind: StepKind, steps: int, graph: _TorchGraph) -> None:
        """The unit every mode runs: `steps` steps of `kind`, back to back."""
        for _ in range(steps):
            device_step.step(state, kind, graph)

    def _graph(self, state: DeviceState, kind: StepKind, model: Denoiser) -> _TorchGraph:
        grid = state.bucket.block if self.spec.block_causal else None
        graph = kind.graph(state.bucket.guided)
        key = (graph, grid, kind.writes > 0, kind.sampling, kind.confidence, kind.editing, id(model))
        if key not in self._graphs:
            self._graphs[key] = _TorchGraph(StepGraph(model, graph, grid, return_kv=kind.writes > 0,
                                                      sampling=kind.sampling, confidence=kind.confidence,
                                                      editing=kind.editing, unmask=self.unmask).eval(),
                                            self.observe)
        return self._graphs[key]

    # -- Backend ------------------------------------------------------------------------------------
    def prepare_steps(self, state: DeviceState, kind: StepKind, steps: int) -> float:
        device_step.allocate(state, kind)
        bucket = state.bucket

        def eager():
            graph = self._graph(state, kind, self.model)
            return lambda: self._steps(state, kind, steps, graph)
        return self._prepare((id(state), kind, steps), f"a batch of {bucket.batch} x {bucket.canvas}", steps,
                             lambda: self._build(state, kind, steps), eager)

    def _prepare(self, key: tuple, shape: str, steps: int, build: Callable[[], Callable[[], None]],
                 eager: Callable[[], Callable[[], None]]) -> float:
        """Build the runner of `key` (a state's id, what it runs, and K) on first use, in this backend's
        mode; `eager` builds the fallback. Returns the seconds spent."""
        if key in self._runners:  # a runner holds its state, so the id stays its own
            return 0.0
        started = time.perf_counter()
        if self.mode != "eager" and self.on_compile is not None:
            self.on_compile(f"{_DO[self.mode]}: {steps} step(s) for {shape} (once per shape)")
        try:
            runner = build()
        except Exception as error:  # noqa: BLE001  (any compile or capture failure)
            if self.mode == "eager":
                raise
            if not self.falls_back:
                raise ArgumentError(f"mode {self.mode!r} failed to {_DO[self.mode]} the step for {shape}: "
                                    f"{type(error).__name__}: {_first_line(error)}; use --mode eager") from error
            if not self._fallback_warned:
                warnings.warn(f"dlmrt: the {self.mode} mode failed to {_DO[self.mode]} a step "
                              f"({type(error).__name__}: {_first_line(error)}); running eagerly instead",
                              RuntimeWarning, stacklevel=3)
                self._fallback_warned = True
            runner = eager()
        self._runners[key] = runner
        return time.perf_counter() - started

    @torch.no_grad()
    def run(self, state: DeviceState, kind: StepKind, steps: int) -> None:
        self.prepare_steps(state, kind, steps)
        self._runners[(id(state), kind, steps)]()

    # -- CanvasBackend: uniform-noise models ----------------------------------------------------------
    def cache_groups(self) -> tuple[CacheGroup, CacheGroup]:
        return tuple(CacheGroup(*shape) for shape in self.model.cache_groups())

    @torch.no_grad()
    def encode(self, ids: Tensor, positions: Tensor, key_mask: Tensor, cache):
        return self.model.encode(ids, positions=positions, key_mask=key_mask, past=cache)

    def prepare_canvas_steps(self, state: CanvasState, steps: int) -> float:
        bucket = state.bucket
        return self._prepare((id(state), "canvas", steps), f"a batch of {bucket.batch} x {bucket.width} after "
                             f"{bucket.storage} cached", steps, lambda: self._build_canvas(state, steps),
                             lambda: self._eager_canvas(state, steps))

    @torch.no_grad()
    def run_canvas(self, state: CanvasState, steps: int) -> None:
        self.prepare_canvas_steps(state, steps)
        self._runners[(id(state), "canvas", steps)]()

    def _eager_canvas(self, state: CanvasState, steps: int) -> Callable[[], None]:
        graphs = _TorchCanvasGraphs(self.model)

        def run():
            for _ in range(steps):
                canvas_step.step(state, graphs)
        return run

    # -- building a runner per mode -------------------------------------------------------------------
    @torch.no_grad()
    def _build(self, state: DeviceState, kind: StepKind, steps: int):
        if self.mode == "eager":
            graph = self._graph(state, kind, self.model)
            return lambda: self._steps(state, kind, steps, graph)
        if self.mode == "compile":
            return self._compile(state, kind, steps)
        return self._capture(state, kind, steps)

    def _compile(self, state: DeviceState, kind: StepKind, steps: int):
        if self._compiled is None:  # one compiled step function: dynamo keeps a graph per bucket and kind
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_inductor_cache()))
            self._compile_model = onednn.prepack_linears(self.model) if onednn.available(self.model) else self.model
            # Every backend compiles the same function, so dynamo's guards on the model's modules are what
            # keep one model's graph from running another's: they stay, though they cost ~2% of a step.
            self._compiled = torch.compile(device_step.step, fullgraph=True, dynamic=False)
        graph = self._graph(state, kind, self._compile_model)
        saved = state.snapshot()
        try:
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT,
                                            accumulated_recompile_limit=_RECOMPILE_LIMIT):
                self._compiled(state, kind, graph)  # compiles, then runs: undone below
        finally:
            state.restore(saved)

        def run():
            for _ in range(steps):
                self._compiled(state, kind, graph)
        return run

    def _capture(self, state: DeviceState, kind: StepKind, steps: int):
        graph = self._graph(state, kind, self.model)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return cuda_graphs.capture(lambda: self._steps(state, kind, steps, graph), state, self.spec.device, self._pool)

    @torch.no_grad()
    def _build_canvas(self, state: CanvasState, steps: int):
        if self.mode == "eager":
            return self._eager_canvas(state, steps)
        if self.mode == "cudagraph":
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            return cuda_graphs.capture(self._eager_canvas(state, steps), state, self.spec.device, self._pool)
        graphs = _TorchCanvasGraphs(self.model)
        if self._compiled_canvas is None:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_inductor_cache()))
            self._compiled_canvas = torch.compile(canvas_step.step, fullgraph=True, dynamic=False)
        saved = state.snapshot()
        try:
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT,
                                            accumulated_recompile_limit=_RECOMPILE_LIMIT):
                self._compiled_canvas(state, graphs)  # compiles, then runs: undone below
        finally:
            state.restore(saved)

        def run():
            for _ in range(steps):
                self._compiled_canvas(state, graphs)
        return run


class _TorchCanvasGraphs:
    """A uniform-noise model's decoder and soft tokens as `canvas_step.step` calls them."""

    def __init__(self, model: Denoiser):
        self.model = model

    def decode(self, state: CanvasState) -> Tensor:
        key_mask = torch.cat((state.past_key_mask, state.key_mask), dim=1)
        return self.model.denoise(state.canvas, positions=state.positions, key_mask=key_mask, past=state.cache,
                                  residual=Residual(state.z, None)).logits

    def soft_tokens(self, scaled_logits: Tensor) -> Tensor:
        return self.model.soft_tokens(scaled_logits).z


_DO = {"compile": "compile", "cudagraph": "capture"}


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else "no message"


def _inductor_cache():
    from dlmrt.core.home import home

    return home() / "inductor"
