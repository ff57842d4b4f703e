"""The running batch of a mask model: rows at different blocks share the step through one canvas column.

Design notes: docs/runtime-modules.md#mask_batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dlmrt.runtime import device_step
from dlmrt.runtime import layout as layouts
from dlmrt.runtime.buckets import Bucket
from dlmrt.runtime.running_batch import BlockOutcome, Row, RunningBatch, TokenLogprob
from dlmrt.runtime.settings import GenerationSettings


def automatic_steps(budget_left: int, remaining: int, taken: int, block_length: int,
                    tokens_per_forward: float | None) -> int:
    """K on CUDA: as many steps as the block is expected to need still, at the tokens per forward of
    its steps so far (once it has taken some) or of the last block, so that few steps are no-ops;
    one step while nothing is known. `remaining` is the most masked positions a row has left."""
    rate = (block_length - remaining) / taken if taken else tokens_per_forward
    if not rate or rate <= 0:
        return 1
    return max(1, min(budget_left, int(remaining / rate)))


@dataclass(kw_only=True)
class MaskRow(Row):
    layout: layouts.Layout  # the row alone, on its own canvas
    block_position: int  # where its current block starts, in the row's positions
    end_position: int  # after the last position it denoises
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of its output so far, where it asks


@dataclass
class MaskBatch(RunningBatch):
    column: int = 0  # canvas index of every row's current block
    tokens_per_forward: float | None = None  # what an automatic K plans with: the last block's

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (*self.spec.eos_ids, self.spec.mask_id)

    def check_call(self, prompts: Sequence[Sequence[int]], settings: GenerationSettings) -> None:
        ladder, block = self.backend.ladder, settings.block_length
        ladder.batch_for(len(prompts))
        ladder.canvas_for(layouts.canvas_length(prompts, settings.gen_length, block,
                                                block_causal=self.spec.block_causal), block)

    # -- rows in ------------------------------------------------------------------------------------
    def _new_row(self, prompt: Sequence[int], settings: GenerationSettings, seed: int, **common) -> MaskRow:
        spec, block = self.spec, settings.block_length
        alone = layouts.build([prompt], settings.gen_length, block, block_causal=spec.block_causal,
                              pad_id=spec.pad_id, mask_id=spec.mask_id)
        self.backend.ladder.canvas_for(alone.length, block)  # one clear error for a row no bucket holds
        params = {**settings.policy.row_params(), "temperature": settings.temperature, "seed": seed}
        # the row alone has no left padding: canvas index = position
        return MaskRow(settings=settings, params=params, layout=alone, block_position=alone.first_block_start,
                       prompt_length=int(alone.output_start[0]), end_position=int(alone.decode_end[0]), **common)

    def _extent(self, rows: Sequence[MaskRow]) -> tuple[int, int]:
        """The canvas rows need before their current block, and from its start on."""
        return (max(row.block_position for row in rows),
                max(row.end_position - row.block_position for row in rows))

    def _fits(self, rows: Sequence[MaskRow]) -> bool:
        return sum(self._extent(rows)) <= self.backend.ladder.max_canvas

    def _place(self, joining: Sequence[MaskRow]) -> None:
        left, right = self._extent([*self.rows, *joining])
        batch = self.backend.ladder.batch_for(len(self.rows) + len(joining))
        state = self.state
        if (state is None or not self.rows or state.bucket.batch != batch or self.column < left
                or state.bucket.canvas - self.column < right):
            self._move(batch, left, right)
        free = sorted(set(range(self.state.bucket.batch)) - {row.slot for row in self.rows})
        for row, slot in zip(joining, free):
            row.slot = slot
            self.state.place_row(slot, row.layout, self.column - row.block_position, row.params)

    def _move(self, batch: int, left: int, right: int) -> None:
        """Put the batch in the bucket of `batch` rows that holds `left + right` positions, the column
        `right` positions before its end; running rows move with it, to slots 0, 1, ..."""
        key = self.key
        canvas = self.backend.ladder.canvas_for(left + right, key.block_length)
        bucket = Bucket(batch=batch, canvas=canvas, block=key.block_length, guided=key.cfg_scale > 0,
                        cached=key.cache != "none")
        column = canvas - right
        self._enter(bucket, lambda state: state.reset(key.cfg_scale),
                    lambda state, old, slots: state.take_rows(old, slots, column - self.column))
        self.column = column

    # -- one block ----------------------------------------------------------------------------------
    def _start_block(self) -> tuple[int, int]:
        """Point the state at the column with each row's schedule, and choose the block's step kinds."""
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
        self._kinds = device_step.kinds_for_block(
            key.cache, self.spec.block_causal, state.bucket.canvas, self.column, state.bucket.block,
            first_block=any(row.block == 0 for row in self.rows),
            sampling=any(row.settings.temperature > 0 for row in self.rows),
            logprobs=any(row.settings.logprobs is not None for row in self.rows), lookbehind=self.spec.logits_shift,
            **key.policy.step_flags())
        return budget, block

    def _calls(self, taken: int, steps: int) -> list[tuple[object, int]]:
        first, later = self._kinds
        return [(first, 1), (later, steps - 1)] if taken == 0 else [(later, steps)]

    def _read_progress(self, steps: int) -> tuple[int, int]:
        status = self.state.status.tolist()
        return max(status[:-1]), status[-1]  # rows that are done or padding have no mask left

    def _steps_per_sync(self, budget_left: int, remaining: int, taken: int) -> int:
        if self.key.steps_per_sync is not None:
            return min(self.key.steps_per_sync, budget_left)
        if self.spec.device.type != "cuda":
            return 1
        return automatic_steps(budget_left, remaining, taken, self.key.block_length, self.tokens_per_forward)

    def _steps_ended(self, taken: int, remaining: int, worked: int) -> None:
        self._count_forwards(self.rows, worked)
        if taken:
            self.tokens_per_forward = (self.key.block_length - remaining) / taken

    def _count_forwards(self, rows: Sequence[MaskRow], worked: int) -> None:
        for row in rows:
            row.forwards += worked

    def _read_drafts(self, rows: Sequence[MaskRow]) -> list[list[int | None]]:
        block_end = self.column + self.key.block_length
        outputs = self._read_outputs(rows, [block_end] * len(rows), first=self.column)
        return [[None if token == self.spec.mask_id else token for token in output[:self._left(row)]]
                for row, output in zip(rows, outputs)]

    def _left(self, row: MaskRow) -> int:
        """The positions of its gen-length a row has from its current block's start (all, in its first block)."""
        return row.settings.gen_length - max(0, row.block_position - row.prompt_length)

    # -- rows out -----------------------------------------------------------------------------------
    def _read_block(self, rows: Sequence[MaskRow], cancelled: list[bool]) -> list[BlockOutcome]:
        block_end = self.column + self.key.block_length
        outputs = self._read_outputs(rows, [self.state.bucket.canvas if gone else block_end for gone in cancelled])
        edits = self.state.edits.tolist() if self.key.policy.edits else None
        self._read_logprobs(rows)
        outcomes = []
        for row, gone, output in zip(rows, cancelled, outputs):
            settled = output[:row.settings.gen_length]
            if gone:
                reason, stops = "cancelled", False
            else:
                eos_hit = any(t in self.eos for t in settled)
                stops = eos_hit and not row.settings.ignore_eos and bool(self.eos)
                finished = stops or row.block_position + self.key.block_length >= row.end_position
                reason = ("eos" if eos_hit else "length") if finished else None
            fill = self.spec.eos_ids[0] if stops else self.spec.mask_id
            logprobs = row.logprobs if row.settings.logprobs is not None else None
            outcomes.append(BlockOutcome(settled, reason, fill, edits[row.slot] if edits else 0, logprobs))
        return outcomes

    def _read_logprobs(self, rows: Sequence[MaskRow]) -> None:
        """Append the block's logprobs to each of `rows` that asks (three host reads a block, only then)."""
        asking = [row for row in rows if row.settings.logprobs is not None]
        if not asking:
            return
        state = self.state
        chosen, top, tokens = state.logprob.tolist(), state.top_logprob.tolist(), state.top_token.tolist()
        for row in asking:
            first = row.block_position - row.prompt_length  # the block's first position in the row's output
            alternatives = row.settings.logprobs
            for j in range(max(0, -first), min(self.key.block_length, row.settings.gen_length - first)):
                top_j = tuple(zip(tokens[row.slot][j][:alternatives], top[row.slot][j][:alternatives]))
                row.logprobs.append(TokenLogprob(chosen[row.slot][j], top_j))

    def _read_outputs(self, rows: Sequence[MaskRow], ends: list[int], first: int = 0) -> list[list[int]]:
        """Each row's canvas from its first generated position (or canvas index `first`, when later) to
        its end in `ends` (one host read)."""
        starts = [max(first, self.column - row.block_position + row.prompt_length) for row in rows]
        first = min(starts)
        ids = self.state.canvas[:, first:max(ends)].tolist()
        return [ids[row.slot][start - first:end - first] for row, start, end in zip(rows, starts, ends)]

    def _advance(self, keep: list[MaskRow], leaving: list[int]) -> None:
        for row in keep:
            row.block_position += self.key.block_length
        self.column += self.key.block_length
        if keep:  # an empty batch is reset when rows next join
            self.state.clear_rows(leaving)
            self._shrink()

    def _shrink(self) -> None:
        """Move the rows still running to a smaller bucket once they fit one."""
        if self.rows and self.backend.ladder.batch_for(len(self.rows)) < self.state.bucket.batch:
            self._move(self.backend.ladder.batch_for(len(self.rows)), *self._extent(self.rows))

    def _generated_tokens(self, settled: list[int], reason: str) -> int:
        return sum(t != self.spec.mask_id for t in settled)
