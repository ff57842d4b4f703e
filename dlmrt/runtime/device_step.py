"""The step on the device: a pure, in-place function of a bucket's static buffers.

    step(state, kind, graph)   gather the window from the state, run the step graph on it, write back

Design notes: docs/runtime-modules.md#device_step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from dlmrt.core import limits
from dlmrt.models.step_graph import LOGITS_OUTPUT, POLICY_INPUTS, graph_name
from dlmrt.runtime.backend import GraphOptions
from dlmrt.runtime.device_state import DeviceState

if TYPE_CHECKING:
    from dlmrt.runtime.backend import Backend
    from dlmrt.runtime.model_spec import ModelSpec


@dataclass(frozen=True)
class StepKind:
    """What one kind of step reads and writes. Each kind is one graph per bucket."""

    window: int  # window length
    start: int | None  # the window's fixed canvas start, or None: it starts `before` positions before the block
    before: int = 0
    cached: bool = False  # over the K/V cache
    writes: int = 0  # the leading window positions whose K/V the step writes into the cache
    sampling: bool = False  # some row samples (temperature > 0)
    confidence: str | None = None  # the measure every row uses (None: each row's `measure`)
    editing: bool = False  # some row edits committed tokens
    logprobs: bool = False  # some row asks for its committed tokens' log-probabilities

    def graph(self, guided: bool) -> str:
        return graph_name(cached=self.cached, guided=guided)

    @property
    def binding_key(self) -> tuple:
        """What a backend's binding of a bucket's buffers to a graph depends on: the window buffers,
        the graph, the K/V it writes, and whether the logits are bound (not `before`, `sampling`,
        `confidence` or `editing`, which only the gather or the graph's inputs see)."""
        return self.window, self.start, self.cached, self.writes, self.logprobs

    @property
    def options(self) -> GraphOptions:
        """What a backend that builds its step graph may specialize it on."""
        return GraphOptions(self.sampling, self.confidence, self.editing)

    def whole_canvas(self, canvas: int) -> bool:
        return self.start == 0 and self.window == canvas

    # -- the step program (dlmrt.runtime.executor.StepProgram) --------------------------------------------
    def bind(self, backend: Backend, state: DeviceState) -> BoundStepGraph:
        allocate(state, self, backend.spec)
        return BoundStepGraph(backend, state, self)

    def step(self, state: DeviceState, graph: Callable[[], GraphOutputs]) -> None:
        step(state, self, graph)

    def describe(self, state: DeviceState) -> str:
        return f"a batch of {state.bucket.batch} x {state.bucket.canvas}"


class TokenLogprobs(NamedTuple):
    """At each block position of a step: its token's log-probability under the step's logits, and the most
    likely tokens other than the mask with theirs, most likely first."""

    chosen: Tensor  # [B, block] float32
    top_logprob: Tensor  # [B, block, K] float32
    top_token: Tensor  # [B, block, K] int64


class GraphOutputs(NamedTuple):
    """What `apply` reads of a step graph's outputs (the rest are not needed)."""

    ids: Tensor  # [B, block]
    kv: Tensor | None  # [layers, 2, B', kv heads, W, head dim], on steps that write the cache
    z: Tensor | None  # [B', W, H]
    certainty: Tensor | None
    # On steps whose kind asks for logprobs: the block's logits [B, block, V] float32, from which `apply` reads
    # them; or, from a model whose ranks each hold a slice of the vocabulary, the logprobs of `ids` themselves
    logits: Tensor | None = None
    logprobs: TokenLogprobs | None = None


def kinds_for_block(cache: str, block_causal: bool, canvas: int, block_start: int, block: int, first_block: bool,
                    *, sampling: bool = False, confidence: str | None = None, editing: bool = False,
                    logprobs: bool = False, lookbehind: int = 0) -> tuple[StepKind, StepKind]:
    """The kinds of a block's first step and of its later steps."""
    def kind(window, start, **extra):
        return StepKind(window, start, sampling=sampling, confidence=confidence, editing=editing, logprobs=logprobs,
                        **extra)

    end = block_start + block
    if cache == "none":
        every = kind(end if block_causal else canvas, 0)
        return every, every
    if block_causal:  # the exact block cache: a finished block's K/V is written once, in the next block's first step
        later = kind(block, None, cached=True)
        if first_block:
            return kind(end, 0, writes=block_start), later
        return kind(2 * block, None, before=block, cached=True, writes=block), later
    refresh = kind(canvas, 0, writes=canvas)
    if cache == "prefix":
        return refresh, kind(canvas - block_start + lookbehind, block_start - lookbehind, cached=True)
    return refresh, kind(block + lookbehind, None, before=lookbehind, cached=True)


def allocate(state: DeviceState, kind: StepKind, spec: ModelSpec) -> None:
    """Allocate the window and logprob buffers `kind` needs (before a step of it is compiled or captured)."""
    if not kind.whole_canvas(state.bucket.canvas):
        state.window(kind.window)
    if kind.logprobs:
        state.allocate_logprobs(limits.recorded_alternatives(spec.vocab_size))


def output_buffers(spec: ModelSpec, state: DeviceState, kind: StepKind, *, every_output: bool = False,
                   allocate: bool = True) -> dict[str, Tensor | None]:
    """Static buffers for the step graph's outputs that a step reads, by name, for a backend whose graphs
    write them in place (ONNX Runtime, TensorRT); with `allocate` False the same names, each None. The
    whole-canvas refresh writes its K/V straight into the cache storage. A step that writes no cache
    gets no K/V buffer, and one that asks for no logprobs no logits buffer, unless `every_output`
    (TensorRT needs an address for every output): then a scratch one. A model whose ranks each hold a
    vocabulary slice returns the logprobs themselves (TokenLogprobs' fields) in place of the logits."""
    bucket = state.bucket
    rows, model_rows, block = bucket.batch, bucket.model_rows, bucket.block
    shapes: dict[str, tuple | Tensor] = {"new_ids": ((rows, block), torch.long),
                                         "confidence": ((rows, block), torch.float32),
                                         "commit": ((rows, block), torch.bool), "committed": ((rows,), torch.long)}
    if kind.writes and kind.writes == bucket.canvas:
        shapes["kv"] = state.kv
    elif kind.writes or every_output:
        shapes["kv"] = ((spec.num_layers, 2, model_rows, spec.num_kv_heads, kind.window, spec.head_dim), spec.dtype)
    if spec.supports_logprobs and (kind.logprobs or every_output):
        if spec.vocab_ranks > 1:
            alternatives = limits.recorded_alternatives(spec.vocab_size)
            shapes.update(chosen=((rows, block), torch.float32),
                          top_logprob=((rows, block, alternatives), torch.float32),
                          top_token=((rows, block, alternatives), torch.long))
        else:
            shapes[LOGITS_OUTPUT] = ((rows, block, spec.vocab_size), torch.float32)
    if spec.has_residual:
        shapes["next_z"] = ((model_rows, kind.window, spec.hidden_size), spec.dtype)
        shapes["next_certainty"] = ((model_rows, kind.window), spec.dtype)
    if not allocate:
        return dict.fromkeys(shapes)
    device = state.canvas.device
    return {name: shape if isinstance(shape, Tensor) else torch.empty(shape[0], dtype=shape[1], device=device)
            for name, shape in shapes.items()}


def graph_outputs(outputs: Mapping[str, Tensor], kind: StepKind) -> GraphOutputs:
    """What `apply` reads of a step graph's outputs by name."""
    logits = logprobs = None
    if kind.logprobs and "top_token" in outputs:
        logprobs = TokenLogprobs(*(outputs[name] for name in TokenLogprobs._fields))
    elif kind.logprobs:
        logits = outputs[LOGITS_OUTPUT]
    return GraphOutputs(outputs["new_ids"], outputs["kv"] if kind.writes else None, outputs.get("next_z"),
                        outputs.get("next_certainty"), logits, logprobs)


class BoundStepGraph:
    """The step graph of `kind` bound once to a bucket's buffers (`Backend.bind`): `graph_inputs` in,
    `output_buffers` out; a call runs it and returns what `apply` reads. It holds every buffer it binds,
    so that they live as long as the binding."""

    def __init__(self, backend: Backend, state: DeviceState, kind: StepKind):
        self.state, self.kind = state, kind
        self.inputs = graph_inputs(state, kind)
        self.outputs = output_buffers(backend.spec, state, kind, every_output=backend.every_output,
                                      allocate=backend.outputs_in_place)
        # buffers written in place are the same tensors at every step: what apply reads of them, made once
        self.results = graph_outputs(self.outputs, kind) if backend.outputs_in_place else None
        self.run = backend.bind(kind.graph(state.bucket.guided), self.inputs, self.outputs, kind.options)

    def __call__(self) -> GraphOutputs:
        found = self.run()
        return self.results if self.results is not None else graph_outputs(found, self.kind)


def graph_inputs(state: DeviceState, kind: StepKind) -> dict[str, Tensor]:
    """The step graph's inputs by name: buffers of the state (or its window buffers for `kind`), the
    same tensors at every step, which `gather` refills."""
    bucket = state.bucket
    if kind.whole_canvas(bucket.canvas):
        ids, positions, key_mask, z, certainty = state.canvas, state.positions, state.key_mask, state.z, state.certainty
    else:
        window = state.window(kind.window)
        ids, positions, key_mask, z, certainty = (window.ids, window.positions, window.key_mask, window.z,
                                                  window.certainty)
    inputs = {"ids": ids, "positions": positions, "key_mask": key_mask, "block_index": state.block_index,
              **{name: getattr(state, name) for name in POLICY_INPUTS}}
    if state.edit_threshold is not None:
        inputs.update(edit_threshold=state.edit_threshold, prompt_lengths=state.prompt_lengths)
    if kind.cached:
        inputs.update(past_kv=state.kv, past_positions=state.positions, past_key_mask=state.past_key_mask)
    if z is not None:
        inputs.update(z=z, certainty=certainty)
    if bucket.guided:
        inputs.update(prompt_lengths=state.prompt_lengths, cfg_scale=state.cfg_scale)
    return inputs


def gather(state: DeviceState, kind: StepKind) -> None:
    """Refill the inputs `graph_inputs` names for the next step of `kind`: this step's minimum
    commits from the block's schedule, the window, the block inside it, and the cache positions the
    window attends to."""
    device = state.canvas.device
    torch.gather(state.schedule, 1, state.block_step.clamp(max=state.bucket.block - 1)[:, None],
                 out=state.count[:, None])
    block = torch.arange(state.bucket.block, device=device)
    if kind.whole_canvas(state.bucket.canvas):
        torch.add(block, state.block_start, out=state.block_index)
        return
    window = state.window(kind.window)
    if kind.start is None:
        torch.add(torch.arange(kind.window, device=device), state.block_start - kind.before, out=window.index)
        torch.add(block, kind.before, out=state.block_index)
    else:
        torch.add(torch.arange(kind.window, device=device), kind.start, out=window.index)
        torch.add(block, state.block_start - kind.start, out=state.block_index)
    torch.index_select(state.canvas, 1, window.index, out=window.ids)
    torch.index_select(state.positions, 1, window.index, out=window.positions)
    torch.index_select(state.key_mask, 1, window.index, out=window.key_mask)
    if state.z is not None:
        torch.index_select(state.z, 1, window.index, out=window.z)
        torch.index_select(state.certainty, 1, window.index, out=window.certainty)
    if kind.cached:
        canvas_index = torch.arange(state.bucket.canvas, device=device)
        in_window = (canvas_index >= window.index[0]) & (canvas_index <= window.index[-1])
        torch.logical_and(state.key_mask, state.cache_valid & ~in_window, out=state.past_key_mask)


def apply(state: DeviceState, kind: StepKind, active: Tensor, outputs: GraphOutputs) -> None:
    """Write a step's results into the state: the block's ids and the window's residual for the rows
    that were active, the K/V the step writes, and the counters."""
    bucket = state.bucket
    block_positions = torch.arange(bucket.block, device=state.canvas.device) + state.block_start
    old_block = state.canvas.index_select(1, block_positions)
    new_block = torch.where(active[:, None], outputs.ids, old_block)
    state.canvas.index_copy_(1, block_positions, new_block)
    whole = kind.whole_canvas(bucket.canvas)
    if state.z is not None:
        model_active = (active.repeat(2) if bucket.guided else active)[:, None]
        if whole:
            state.z.copy_(torch.where(model_active[..., None], outputs.z, state.z))
            state.certainty.copy_(torch.where(model_active, outputs.certainty, state.certainty))
        else:
            window = state.window(kind.window)
            state.z.index_copy_(1, window.index, torch.where(model_active[..., None], outputs.z, window.z))
            state.certainty.index_copy_(1, window.index,
                                        torch.where(model_active, outputs.certainty, window.certainty))
    if kind.writes:
        if whole and kind.writes == bucket.canvas:
            if outputs.kv is not state.kv:  # a backend may write the K/V straight into the storage
                state.kv.copy_(outputs.kv)
            state.cache_valid.fill_(True)
        else:
            written = state.window(kind.window).index[:kind.writes]
            state.kv.index_copy_(4, written, outputs.kv[:, :, :, :, :kind.writes])
            state.cache_valid.index_fill_(0, written, True)
    if kind.logprobs:
        found = outputs.logprobs if outputs.logprobs is not None else token_logprobs(
            outputs.logits, new_block, state.top_logprob.shape[-1], state.mask_id)
        record_logprobs(state, found, active[:, None] & (new_block != old_block))
    state.step.add_(active)
    state.block_step.add_(1)
    was_masked = old_block == state.mask_id
    edited = ((new_block != old_block) & ~was_masked).sum(-1)
    state.edits.add_(edited)
    # an editing-only step spends one of the row's post steps; one that edits nothing ends them
    editing_only = active & ~was_masked.any(-1)
    state.post_steps.sub_(editing_only.long())
    state.post_steps.masked_fill_(editing_only & (edited == 0), 0)
    _write_work_left(state, (new_block == state.mask_id).sum(-1))
    state.status[-1:].add_(active.any().long())


def token_logprobs(logits: Tensor, tokens: Tensor, alternatives: int, mask_id: int) -> TokenLogprobs:
    """`log_softmax` of `logits [B, block, V]` at `tokens [B, block]`, and the `alternatives` most likely
    tokens other than the mask (never a token of the text)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, tokens[..., None]).squeeze(-1)
    logp[..., mask_id] = float("-inf")
    top_logprob, top_token = logp.topk(alternatives, dim=-1)
    return TokenLogprobs(chosen, top_logprob, top_token)


def record_logprobs(state: DeviceState, found: TokenLogprobs, changed: Tensor) -> None:
    """Keep the step's logprobs where it put a token (`changed`, [B, block]). Every row's tokens are recorded
    (a row that did not ask is read by no one): one batched pass, no per-row branch."""
    state.logprob.copy_(torch.where(changed, found.chosen, state.logprob))
    state.top_logprob.copy_(torch.where(changed[..., None], found.top_logprob, state.top_logprob))
    state.top_token.copy_(torch.where(changed[..., None], found.top_token, state.top_token))


def _write_work_left(state: DeviceState, masked: Tensor) -> None:
    """Each row's work left in its block: its masked positions, or 1 while it may still edit."""
    state.status[:-1].copy_(torch.where(masked > 0, masked, (state.post_steps > 0).long()))


def step(state: DeviceState, kind: StepKind, run_graph: Callable[[], GraphOutputs]) -> None:
    """One step of `kind` on `state`, in place; `run_graph` runs the step graph bound to `graph_inputs`."""
    active = state.status[:-1] > 0
    gather(state, kind)
    apply(state, kind, active, run_graph())


def start_block(state: DeviceState, block_start: int, schedule: Tensor) -> None:
    """Point the state at the block starting at canvas index `block_start`, with its schedule
    `[B, steps]` of minimum commits (padded to the block length by committing everything)."""
    bucket = state.bucket
    state.block_start.fill_(block_start)
    state.block_step.zero_()
    steps = min(schedule.shape[1], bucket.block)
    state.schedule[:, :steps].copy_(schedule[:, :steps])
    state.schedule[:, steps:].fill_(bucket.block)
    state.post_steps.copy_(state.max_post_steps)
    block = state.canvas[:, block_start:block_start + bucket.block]
    _write_work_left(state, (block == state.mask_id).sum(-1))

