"""A running batch of a mask model: rows decoded block by block in one bucket's state, which rows
join and leave at block boundaries (continuous batching).

    batch = RunningBatch(backend, owner)
    batch.add(tag, prompt, settings, seed=0)      # joins at the next block boundary
    while batch.active:
        updates = batch.run_block()               # BlockUpdates; finished rows land in batch.finished

Rows at different blocks share the step through one canvas column. Each row carries its block
position (the position, counted in its own tokens, where its current block starts) and is placed on
the canvas so that its current block starts at the batch's column: a row that joins late sits
further right than one near its end. Positions, which the attention, the rotary embedding, the
block-causal grid and the sampler's random numbers read, are each row's own, and the canvas around
a row is padding no position sees, so a row decodes exactly as it would alone (see
docs/continuous-batching.md). The exported step graph keeps one window and one block index for
the whole batch, so the ONNX graphs and TensorRT engines serve a continuous batch as they are.

When rows join or leave, the batch moves to the bucket that holds it (the smallest batch and canvas
of the backend's ladder), and the column moves with it. Between those boundaries nothing moves:
every row advances one block, and so does the column.

Rows batch together when their settings agree on everything but what each row carries in its own
buffers (`batch_key`): gen-length, seed, ignore_eos, temperature, and the policy's threshold or
factor. The step kinds (window, cache, graph) and the block's step budget follow from the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from dlmrt.core.errors import ArgumentError
from dlmrt.plugins.parallel_unmask import MEASURE_CODES
from dlmrt.runtime import device_step
from dlmrt.runtime import layout as layouts
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.device_state import Bucket, DeviceState
from dlmrt.runtime.metrics import GenerationMetrics
from dlmrt.runtime.settings import GenerationSettings
from dlmrt.runtime.text import completion


class CancelToken(Protocol):
    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class BlockUpdate:
    """Tokens of one row that became final when a block finished (cut at end-of-sequence)."""

    row: object  # the row's tag: its index in a generate call's prompts, or a server's request
    block: int  # the row's block, or -1 when it was cancelled
    token_ids: list[int]
    finish_reason: str | None  # "eos", "length" or "cancelled" once the row is done


@dataclass(frozen=True)
class FinishedRow:
    tokens: list[int]  # gen_length ids: EOS after a stop, the mask id where decoding did not reach
    finish_reason: str
    metrics: GenerationMetrics


def batch_key(settings: GenerationSettings) -> GenerationSettings:
    """What rows must agree on to share a batch. A row's temperature is its own: the sampling step
    draws for the rows whose temperature is above 0 and takes the argmax for the others."""
    return replace(settings, gen_length=settings.block_length, seed=0, ignore_eos=False, temperature=0.0,
                   policy=settings.policy.shared())


def automatic_steps(budget_left: int, remaining: int, taken: int, block_length: int,
                    tokens_per_forward: float | None) -> int:
    """K on CUDA: as many steps as the block is expected to need still, at the tokens per forward of
    its steps so far (once it has taken some) or of the last block, so that few steps are no-ops;
    one step while nothing is known. `remaining` is the most masked positions a row has left."""
    rate = (block_length - remaining) / taken if taken else tokens_per_forward
    if not rate or rate <= 0:
        return 1
    return max(1, min(budget_left, int(remaining / rate)))


@dataclass
class _Row:
    tag: object
    settings: GenerationSettings
    layout: layouts.Layout  # the row alone, on its own canvas
    params: dict[str, float | int]
    cancel: CancelToken | None
    block_position: int  # where its current block starts, in the row's positions
    output_position: int  # its first generated position (its prompt length)
    end_position: int  # after the last position it denoises
    joined: float  # when it was added
    compile_at_join: float
    backend_at_join: float
    block: int = 0  # its current block
    slot: int = -1
    emitted: int = 0
    forwards: int = 0

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


@dataclass
class RunningBatch:
    backend: Backend
    on_step: Callable[[], None] | None = None
    rows: list[_Row] = field(default_factory=list)  # in the batch
    waiting: list[_Row] = field(default_factory=list)  # added, joining at the next block boundary
    finished: dict[object, FinishedRow] = field(default_factory=dict)
    key: GenerationSettings | None = None
    state: DeviceState | None = None
    column: int = 0  # canvas index of every row's current block
    executed: int = 0  # forwards run
    worked: int = 0  # forwards that did work (the status counter, as last read)
    backend_s: float = 0.0
    compile_s: float = 0.0
    tokens_per_forward: float | None = None  # what an automatic K plans with: the last block's

    def __post_init__(self):
        self.spec = self.backend.spec
        self.eos = set(self.spec.eos_ids)
        self.stop_ids = (*self.spec.eos_ids, self.spec.mask_id)  # a completion ends at EOS, or where decoding stopped

    @property
    def active(self) -> bool:
        return bool(self.rows or self.waiting)

    @property
    def capacity(self) -> int:
        return self.backend.ladder.batches()[-1]

    def accepts(self, settings: GenerationSettings) -> bool:
        return self.key is None or batch_key(settings) == self.key

    # -- rows in ------------------------------------------------------------------------------------
    def add(self, tag: object, prompt: Sequence[int], settings: GenerationSettings, *, seed: int,
            cancel: CancelToken | None = None) -> None:
        """Queue a row (a checked request: `check_request`) to join at the next block boundary."""
        if not self.accepts(settings):
            raise ArgumentError("a row's settings differ from the batch's in more than gen-length, seed, "
                                "ignore_eos, temperature and the policy's threshold or factor: run it in a "
                                "batch of its own")
        spec, block = self.spec, settings.block_length
        alone = layouts.build([prompt], settings.gen_length, block, block_causal=spec.block_causal,
                              pad_id=spec.pad_id, mask_id=spec.mask_id)
        self.backend.ladder.canvas_for(alone.length, block)  # one clear error for a row no bucket holds
        policy = settings.policy
        params = {"threshold": policy.threshold_value, "factor": policy.factor_value,
                  "temperature": settings.temperature, "seed": seed, "measure": MEASURE_CODES[policy.confidence],
                  "edit_threshold": policy.edit_threshold_value, "max_post_steps": policy.post_steps}
        start = alone.first_block_start  # the row alone has no left padding: canvas index = position
        self.key = batch_key(settings)
        self.waiting.append(_Row(tag, settings, alone, params, cancel, block_position=start,
                                 output_position=int(alone.output_start[0]), end_position=int(alone.decode_end[0]),
                                 joined=time.perf_counter(), compile_at_join=self.compile_s,
                                 backend_at_join=self.backend_s))

    def _extent(self, rows: Sequence[_Row]) -> tuple[int, int]:
        """The canvas rows need before their current block, and from its start on."""
        return (max(row.block_position for row in rows),
                max(row.end_position - row.block_position for row in rows))

    def _joining(self) -> list[_Row]:
        """The waiting rows that join now: in order, while the batch and the largest canvas hold them."""
        joining = []
        for row in self.waiting[:self.capacity - len(self.rows)]:
            left, right = self._extent([*self.rows, *joining, row])
            if left + right > self.backend.ladder.max_canvas:
                break
            joining.append(row)
        return joining

    def _place_waiting(self) -> None:
        joining = self._joining()
        if not joining:
            return
        self.waiting = self.waiting[len(joining):]
        every = [*self.rows, *joining]
        left, right = self._extent(every)
        ladder, state = self.backend.ladder, self.state
        batch = ladder.batch_for(len(every))
        if (state is None or not self.rows or state.bucket.batch != batch or self.column < left
                or state.bucket.canvas - self.column < right):
            self._move(batch, left, right)
        free = sorted(set(range(self.state.bucket.batch)) - {row.slot for row in self.rows})
        for row, slot in zip(joining, free):
            row.slot = slot
            self.state.place_row(slot, row.layout, self.column - row.block_position, row.params)
        self.rows = every

    def _move(self, batch: int, left: int, right: int) -> None:
        """Put the batch in the bucket of `batch` rows that holds `left + right` positions, the column
        `right` positions before its end; running rows move with it, to slots 0, 1, ..."""
        key = self.key
        canvas = self.backend.ladder.canvas_for(left + right, key.block_length)
        bucket = Bucket(batch=batch, canvas=canvas, block=key.block_length, guided=key.cfg_scale > 0,
                        cached=key.cache != "none")
        column = canvas - right
        old = self.state
        self.state = self.backend.prepare(bucket, owner=self) if old is None or bucket != old.bucket else old
        if old is None or not self.rows:
            self.state.reset(key.cfg_scale)
        else:
            self.state.take_rows(old, [row.slot for row in self.rows], column - self.column)
        if old is not None and old is not self.state:
            self.backend.release(old)
        for slot, row in enumerate(self.rows):
            row.slot = slot
        self.column = column

    def _shrink(self) -> None:
        """Move the rows still running to a smaller bucket once they fit one."""
        if self.rows and self.backend.ladder.batch_for(len(self.rows)) < self.state.bucket.batch:
            self._move(self.backend.ladder.batch_for(len(self.rows)), *self._extent(self.rows))

    # -- one block ----------------------------------------------------------------------------------
    def run_block(self) -> list[BlockUpdate]:
        """Admit waiting rows, run every row's current block, and retire the rows that finished."""
        self._place_waiting()
        if not self.rows:
            return []
        cancelled = not self._run_steps()
        return self._end_block(cancelled)

    def _start_block(self) -> int:
        """Point the state at the column with each row's schedule; returns the block's step budget."""
        state, key, block = self.state, self.key, self.key.block_length
        masked = (state.canvas[:, self.column:self.column + block] == self.spec.mask_id).sum(-1)
        budgets = {row.slot: row.settings.block_steps() for row in self.rows}
        budget = max(budgets.values())
        if len(set(budgets.values())) == 1:
            schedule = key.policy.schedule(masked, block, budget)
        else:  # rows whose gen-lengths give them other budgets (the fixed policy's steps)
            schedule = torch.full((state.bucket.batch, budget), block, dtype=torch.long, device=masked.device)
            for steps in set(budgets.values()):
                slots = torch.tensor([slot for slot, b in budgets.items() if b == steps], device=masked.device)
                schedule[slots, :steps] = key.policy.schedule(masked[slots], block, steps)
        device_step.start_block(state, self.column, schedule)
        return budget

    def _run_steps(self) -> bool:
        """Run the block's steps until every row's block is done or the budget is spent; False when
        every row was cancelled on the way."""
        key, state, spec = self.key, self.state, self.spec
        budget = self._start_block()
        first, later = device_step.kinds_for_block(
            key.cache, spec.block_causal, state.bucket.canvas, self.column, state.bucket.block,
            first_block=any(row.block == 0 for row in self.rows),
            sampling=any(row.settings.temperature > 0 for row in self.rows),
            confidence=key.policy.confidence, editing=key.policy.edits, lookbehind=spec.logits_shift)
        taken, remaining, worked_before = 0, key.block_length, self.worked
        try:
            while taken < budget and remaining > 0:
                if all(row.cancelled for row in self.rows):
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
                row.forwards += self.worked - worked_before
            if taken:
                self.tokens_per_forward = (key.block_length - remaining) / taken

    def _steps_per_sync(self, budget_left: int, remaining: int, taken: int) -> int:
        """K: the steps to run before the next host read."""
        if self.key.steps_per_sync is not None:
            return min(self.key.steps_per_sync, budget_left)
        if self.spec.device.type != "cuda":
            return 1
        return automatic_steps(budget_left, remaining, taken, self.key.block_length, self.tokens_per_forward)

    # -- rows out -----------------------------------------------------------------------------------
    def _end_block(self, every_row_cancelled: bool) -> list[BlockUpdate]:
        block_end = self.column + self.key.block_length
        cancelled = [every_row_cancelled or row.cancelled for row in self.rows]  # read once: another thread sets it
        outputs = self._read_outputs([self.state.bucket.canvas if gone else block_end for gone in cancelled])
        edits = self.state.edits.tolist() if self.key.policy.edits else None
        updates, keep, leaving = [], [], []
        for row, gone, output in zip(self.rows, cancelled, outputs):
            settled = output[:row.settings.gen_length]
            if gone:
                reason, stops = "cancelled", False
            else:
                eos_hit = any(t in self.eos for t in settled)
                stops = eos_hit and not row.settings.ignore_eos and bool(self.eos)
                finished = stops or row.block_position + self.key.block_length >= row.end_position
                reason = ("eos" if eos_hit else "length") if finished else None
            update = self._update(row, -1 if gone else row.block, settled, reason)
            if update.token_ids or reason:
                updates.append(update)
            if reason is None:
                keep.append(row)
                continue
            fill = self.spec.eos_ids[0] if stops else self.spec.mask_id
            self._finish(row, settled, fill, edits[row.slot] if edits else 0, reason)
            leaving.append(row.slot)
        for row in keep:
            row.block += 1
            row.block_position += self.key.block_length
        self.column = block_end
        self.rows = keep
        if keep:  # an empty batch is reset when rows next join
            self.state.clear_rows(leaving)
            self._shrink()
        return updates

    def _read_outputs(self, ends: list[int]) -> list[list[int]]:
        """Each row's canvas from its first generated position to its end in `ends` (one host read)."""
        starts = [self.column - row.block_position + row.output_position for row in self.rows]
        first = min(starts)
        ids = self.state.canvas[:, first:max(ends)].tolist()
        return [ids[row.slot][start - first:end - first] for row, start, end in zip(self.rows, starts, ends)]

    def _update(self, row: _Row, block: int, settled: list[int], reason: str | None) -> BlockUpdate:
        new = completion(settled[row.emitted:], self.stop_ids)
        row.emitted += len(new)
        return BlockUpdate(row.tag, block, new, reason)

    def _finish(self, row: _Row, settled: list[int], fill: int, edits: int, reason: str) -> None:
        """Record a finished row: its `settled` output, then `fill` (EOS after a stop, else the mask)."""
        decoded = sum(t != self.spec.mask_id for t in settled)
        metrics = GenerationMetrics(
            nfe=row.forwards, sequence_forwards=row.forwards, generated_tokens=decoded,
            prompt_tokens=row.output_position, batch_size=1, edits=edits,
            latency_s=time.perf_counter() - row.joined - (self.compile_s - row.compile_at_join),
            backend_s=self.backend_s - row.backend_at_join)
        tokens = settled + [fill] * (row.settings.gen_length - len(settled))
        self.finished[row.tag] = FinishedRow(tokens, reason, metrics)

    def close(self) -> None:
        """Give the bucket back (rows not finished are dropped)."""
        if self.state is not None:
            self.backend.release(self.state)
            self.state = None
