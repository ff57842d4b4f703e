"""The Generator: the step loop, written once for every backend.

    gen = Generator(dlmrt.load(path))                       # TorchBackend
    result = gen.generate(prompts, GenerationSettings(gen_length=256, block_length=32,
                                                      policy=Threshold(0.9), cache="dual"))
    for update in gen.stream(prompts, settings):            # committed tokens, block by block
        ...

A request is laid out on the canvas of a shape bucket (`dlmrt.runtime.device_state`) and copied
into the bucket's static buffers once. Each block then runs at most `settings.block_steps()` steps
of `dlmrt.runtime.device_step`, K at a time (`settings.steps_per_sync`): the backend runs K steps
back to back on the device, and the host reads one small status tensor (each row's masked positions
left in the block, and the forwards that did work) before it decides on the next K. Steps after a
row's block is done are no-ops, so K changes how many forwards run, never a token. Which window a
step covers follows from the cache mode (see `device_step`).

At a block boundary the host reads the block's tokens once: for streaming, and to see which rows
ended. A row stops after the block in which it committed an end-of-sequence token (unless
`ignore_eos`); the rest of its output is filled with EOS, and it stays in its bucket, inert, until
the rows still running fit a smaller bucket, which they then move to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor

from dlmrt.errors import ArgumentError
from dlmrt.plugins.parallel_unmask import MEASURE_CODES
from dlmrt.runtime import device_step
from dlmrt.runtime import layout as layouts
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.device_state import Bucket
from dlmrt.runtime.metrics import GenerationMetrics, peak_memory_bytes, reset_peak_memory
from dlmrt.runtime.settings import GenerationSettings, check_request
from dlmrt.runtime.text import completion
from dlmrt.runtime.uniform_noise import CanvasBackend, UniformNoiseRun


class CancelToken(Protocol):
    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class BlockUpdate:
    """Tokens of one row that became final when a block finished (cut at end-of-sequence)."""

    row: int
    block: int
    token_ids: list[int]
    finish_reason: str | None  # "eos", "length" or "cancelled" once the row is done


@dataclass(frozen=True)
class RowOutput:
    token_ids: list[int]  # the completion: up to the first EOS, or the first position left masked
    finish_reason: str
    metrics: GenerationMetrics


@dataclass(frozen=True)
class GenerationResult:
    tokens: Tensor  # [B, gen_length]: EOS after a row stopped; the mask id where cancelled
    rows: list[RowOutput]
    metrics: GenerationMetrics


def automatic_steps(budget_left: int, remaining: int, taken: int, block_length: int,
                    tokens_per_forward: float | None) -> int:
    """K on CUDA: as many steps as the block is expected to need still, at the tokens per forward of
    its steps so far (once it has taken some) or of the last block, so that few steps are no-ops;
    one step while nothing is known. `remaining` is the most masked positions a row has left."""
    rate = (block_length - remaining) / taken if taken else tokens_per_forward
    if not rate or rate <= 0:
        return 1
    return max(1, min(budget_left, int(remaining / rate)))


class Generator:
    def __init__(self, model_or_backend, **backend_options):
        """A Generator over a backend, or over a denoiser with `TorchBackend(model, **backend_options)`
        (e.g. `mode="eager"`)."""
        if isinstance(model_or_backend, Backend):
            if backend_options:
                raise ArgumentError(f"backend options ({', '.join(backend_options)}) apply to a model, not to "
                                    f"a backend that is already built")
            self.backend = model_or_backend
        else:
            from dlmrt.runtime.torch_backend import TorchBackend

            self.backend = TorchBackend(model_or_backend, **backend_options)
        self.spec = self.backend.spec

    def generate(self, prompts: Sequence[Sequence[int]], settings: GenerationSettings, *,
                 cancel: CancelToken | None = None,
                 on_step: Callable[[], None] | None = None) -> GenerationResult:
        stream = self.stream(prompts, settings, cancel=cancel, on_step=on_step)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompts: Sequence[Sequence[int]], settings: GenerationSettings, *,
               cancel: CancelToken | None = None,
               on_step: Callable[[], None] | None = None) -> GenerationStream:
        """An iterator of BlockUpdates; `.result` holds the GenerationResult once it is exhausted.
        Closing the iterator early stops the computation."""
        check_request(self.spec, prompts, settings)
        if self.spec.noise == "uniform":
            if not isinstance(self.backend, CanvasBackend):
                raise ArgumentError(f"the {type(self.backend).__name__} does not run uniform-noise models yet: use "
                                    f"the torch backend for {self.spec.name}")
            return GenerationStream(UniformNoiseRun(self.backend, prompts, settings, cancel, on_step))
        return GenerationStream(_Run(self.backend, prompts, settings, cancel, on_step))


class GenerationStream:
    def __init__(self, run: _Run | UniformNoiseRun):
        self._events = run.events()
        self._run = run
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[BlockUpdate]:
        return self

    def __next__(self) -> BlockUpdate:
        try:
            return next(self._events)
        except StopIteration:
            self.result = self._run.result()
            raise

    def close(self) -> None:
        self._events.close()


class _Run:
    """One generate call: its bucket's state on the device, and the per-row bookkeeping on the host."""

    def __init__(self, backend: Backend, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
                 cancel: CancelToken | None, on_step: Callable[[], None] | None):
        self.backend, self.spec, self.settings = backend, backend.spec, settings
        self.cancel, self.on_step = cancel, on_step
        spec, device = self.spec, self.spec.device
        self.started = time.perf_counter()
        reset_peak_memory(device)
        block = settings.block_length
        needed = layouts.canvas_length(prompts, settings.gen_length, block, block_causal=spec.block_causal)
        ladder = backend.ladder
        bucket = Bucket(batch=ladder.batch_for(len(prompts)), canvas=ladder.canvas_for(needed, block), block=block,
                        guided=settings.cfg_scale > 0, cached=settings.cache != "none")
        self.layout = layouts.build(prompts, settings.gen_length, block, block_causal=spec.block_causal,
                                    pad_id=spec.pad_id, mask_id=spec.mask_id, canvas=bucket.canvas)
        self.batch = len(prompts)
        policy = settings.policy
        rows = self.batch
        params = {"threshold": torch.full((rows,), policy.threshold_value, dtype=torch.float32),
                  "factor": torch.full((rows,), policy.factor_value, dtype=torch.float32),
                  "temperature": torch.full((rows,), settings.temperature, dtype=torch.float32),
                  "seed": settings.seed + torch.arange(rows, dtype=torch.long),
                  "measure": torch.full((rows,), MEASURE_CODES[policy.confidence], dtype=torch.long),
                  "edit_threshold": torch.full((rows,), policy.edit_threshold_value, dtype=torch.float32),
                  "max_post_steps": torch.full((rows,), policy.post_steps, dtype=torch.long)}
        self.state = backend.prepare(bucket, owner=self)
        self.state.load(self.layout, params, settings.cfg_scale)
        self.rows = list(range(self.batch))  # the request rows still running
        self.slots = list(range(self.batch))  # and the bucket row each runs in
        lay = self.layout
        self.output_start = lay.output_start.tolist()
        self.decode_end = lay.decode_end.tolist()
        self.prompt_lengths = lay.prompt_lengths.tolist()

        self.tokens = torch.full((self.batch, settings.gen_length), spec.mask_id, dtype=torch.long)
        self.finish_reason: list[str | None] = [None] * self.batch
        self.row_metrics: list[GenerationMetrics | None] = [None] * self.batch
        self.row_forwards = [0] * self.batch
        self.emitted = [0] * self.batch
        self.executed = 0  # forwards run
        self.worked = 0  # forwards that did work (the status counter, as last read)
        self.sequence_forwards = 0
        self.backend_s = self.compile_s = 0.0
        self.tokens_per_forward: float | None = None  # what an automatic K plans with: the last block's
        self.eos = set(spec.eos_ids)
        self.stops_at_eos = not settings.ignore_eos and len(spec.eos_ids) > 0
        self.stop_ids = (*spec.eos_ids, spec.mask_id)  # a completion ends at EOS, or where decoding stopped
        self.sampling = settings.temperature > 0
        self.editing = policy.edits

    # -- the loop ---------------------------------------------------------------------------
    def events(self) -> Iterator[BlockUpdate]:
        try:
            yield from self._blocks()
        finally:
            self.backend.release(self.state)

    def _blocks(self) -> Iterator[BlockUpdate]:
        lay = self.layout
        for block in range(lay.num_blocks):
            start, end = lay.block(block)
            if not self._run_block(block, start):
                yield from self._finish_all("cancelled")
                return
            yield from self._end_block(block, end)
            if not self.rows:
                return
        yield from self._finish_all("length")  # only rows a step budget left unfinished get here

    def _run_block(self, block: int, start: int) -> bool:
        """Run the block's steps until every row's block is done or the budget is spent; False when
        cancelled."""
        settings, state = self.settings, self.state
        masked = (state.canvas[:, start:start + state.bucket.block] == self.spec.mask_id).sum(-1)
        budget = settings.block_steps()
        device_step.start_block(state, start, settings.policy.schedule(masked, settings.block_length, budget))
        first, later = device_step.kinds_for_block(
            settings.cache, self.spec.block_causal, state.bucket.canvas, start, state.bucket.block,
            first_block=block == 0, sampling=self.sampling, confidence=settings.policy.confidence,
            editing=self.editing, lookbehind=self.spec.logits_shift)
        taken, remaining, worked_before = 0, settings.block_length, self.worked
        try:
            while taken < budget and remaining > 0:
                if self.cancel is not None and self.cancel.is_set():
                    return False
                steps = self._steps_per_sync(budget - taken, remaining, taken)
                calls = [(first, 1), (later, steps - 1)] if taken == 0 else [(later, steps)]
                calls = [(kind, count) for kind, count in calls if count]
                self.compile_s += sum(self.backend.prepare_steps(state, kind, count) for kind, count in calls)
                tick = time.perf_counter()
                for kind, count in calls:
                    self.backend.run(state, kind, count)
                status = state.status.tolist()  # the one host read per K steps
                self.backend_s += time.perf_counter() - tick
                taken += steps
                self.executed += steps
                remaining = max(status[:-1])  # rows that are done or padding have none
                self.worked = status[-1]
                if self.on_step is not None:
                    for _ in range(steps):
                        self.on_step()
            return True
        finally:
            for row in self.rows:
                self.row_forwards[row] += self.worked - worked_before
            if taken:
                self.tokens_per_forward = (settings.block_length - remaining) / taken

    def _steps_per_sync(self, budget_left: int, remaining: int, taken: int) -> int:
        """K: the steps to run before the next host read."""
        if self.settings.steps_per_sync is not None:
            return min(self.settings.steps_per_sync, budget_left)
        if self.spec.device.type != "cuda":
            return 1
        return automatic_steps(budget_left, remaining, taken, self.settings.block_length, self.tokens_per_forward)

    # -- rows finishing -----------------------------------------------------------------------
    def _read_outputs(self, end: int) -> list[list[int]]:
        """Each running row's canvas from its first output position to `end` (one host read)."""
        start = min(self.output_start[row] for row in self.rows)
        ids = self.state.canvas[:, start:end].tolist()
        return [ids[slot][self.output_start[row] - start:] for row, slot in zip(self.rows, self.slots)]

    def _end_block(self, block: int, end: int) -> Iterator[BlockUpdate]:
        gen_length = self.settings.gen_length
        outputs = self._read_outputs(end)
        edits = self.state.edits.tolist() if self.editing else [0] * self.state.bucket.batch
        keep, stopped = [], []
        for index, (row, slot, settled) in enumerate(zip(self.rows, self.slots, outputs)):
            settled = settled[:gen_length]
            eos_hit = any(t in self.eos for t in settled)
            stops = eos_hit and self.stops_at_eos
            finished = stops or end >= self.decode_end[row]
            reason = ("eos" if eos_hit else "length") if finished else None
            update = self._update(row, block, settled, reason)
            if update.token_ids or reason:
                yield update
            if not finished:
                keep.append(index)
                continue
            if stops:
                stopped.append(slot)
            fill = self.spec.eos_ids[0] if stops else self.spec.mask_id
            self.state.max_post_steps[slot] = 0  # a finished row never edits again
            self._close_row(row, settled, fill, edits[slot])
        for slot in stopped:  # the rest of a stopped row is EOS, so it never has a mask to commit again
            row_canvas = self.state.canvas[slot]
            row_canvas.masked_fill_(row_canvas == self.spec.mask_id, self.spec.eos_ids[0])
        self._keep(keep)

    def _finish_all(self, reason: str) -> Iterator[BlockUpdate]:
        outputs = self._read_outputs(self.layout.length)
        for row, settled in zip(self.rows, outputs):
            settled = settled[:self.settings.gen_length]
            yield self._update(row, -1, settled, reason)
            self._close_row(row, settled, self.spec.mask_id, self._edits_of(row))
        self.rows = []

    def _update(self, row: int, block: int, settled: list[int], reason: str | None) -> BlockUpdate:
        new = completion(settled[self.emitted[row]:], self.stop_ids)
        self.emitted[row] += len(new)
        if reason is not None:
            self.finish_reason[row] = reason
        return BlockUpdate(row, block, new, reason)

    def _edits_of(self, row: int) -> int:
        return int(self.state.edits[self.slots[self.rows.index(row)]]) if self.editing else 0

    def _close_row(self, row: int, settled: list[int], fill: int, edits: int) -> None:
        """Record a finished row: its `settled` output, then `fill` (EOS after a stop, else the mask)."""
        self.tokens[row] = torch.tensor(settled + [fill] * (self.settings.gen_length - len(settled)))
        decoded = sum(t != self.spec.mask_id for t in settled)
        self.sequence_forwards += self.row_forwards[row]
        self.row_metrics[row] = GenerationMetrics(
            nfe=self.row_forwards[row], sequence_forwards=self.row_forwards[row], generated_tokens=decoded,
            prompt_tokens=self.prompt_lengths[row], batch_size=1, edits=edits,
            latency_s=time.perf_counter() - self.started - self.compile_s, backend_s=self.backend_s)

    def _keep(self, keep: list[int]) -> None:
        """Keep running the rows at indices `keep` of `self.rows`. Finished rows stay in the bucket,
        inert, until the running ones fit a smaller bucket; then those move there."""
        self.rows = [self.rows[index] for index in keep]
        self.slots = [self.slots[index] for index in keep]
        bucket = self.state.bucket
        batch = self.backend.ladder.batch_for(len(self.rows)) if self.rows else bucket.batch
        if batch < bucket.batch:
            smaller = self.backend.prepare(replace(bucket, batch=batch), owner=self)
            smaller.take_rows(self.state, self.slots)
            self.backend.release(self.state)
            self.state, self.slots = smaller, list(range(len(self.rows)))

    def result(self) -> GenerationResult:
        rows = [RowOutput(completion(self.tokens[row].tolist(), self.stop_ids), self.finish_reason[row],
                          self.row_metrics[row])
                for row in range(self.batch)]
        metrics = GenerationMetrics(
            nfe=self.worked, sequence_forwards=self.sequence_forwards,
            generated_tokens=sum(r.metrics.generated_tokens for r in rows),
            prompt_tokens=sum(self.prompt_lengths), batch_size=self.batch,
            edits=sum(r.metrics.edits for r in rows),
            latency_s=time.perf_counter() - self.started - self.compile_s, backend_s=self.backend_s,
            peak_memory_bytes=peak_memory_bytes(self.spec.device), forwards_executed=self.executed,
            compile_s=self.compile_s)
        return GenerationResult(self.tokens, rows, metrics)
