"""The running batch of a uniform-noise model (DiffusionGemma): rows denoise a canvas of W random
tokens per block, over a cache the encoder writes.

Design notes: docs/runtime-modules.md#uniform_noise.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dlmrt.ops.entropy_bound import pad_after_eos
from dlmrt.runtime.buckets import Bucket
from dlmrt.runtime.encode_step import EncodeStep
from dlmrt.runtime.uniform_state import UniformState
from dlmrt.runtime.uniform_step import UNIFORM_STEP
from dlmrt.runtime.running_batch import BlockOutcome, Row, RunningBatch
from dlmrt.runtime.settings import GenerationSettings
from dlmrt.runtime.text import completion

# K on CUDA when steps_per_sync is not set: a host read per 8 steps, and at most 7 steps run past
# the step at which the last row stopped (they change no token).
CUDA_STEPS_PER_SYNC = 8


@dataclass(kw_only=True)
class UniformRow(Row):
    prompt: list[int]
    blocks: int  # gen_length / W
    settled: list[int]  # the tokens of its finished blocks


@dataclass
class UniformBatch(RunningBatch):
    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.spec.eos_ids

    @functools.cached_property
    def _eos_ids(self) -> Tensor:
        return torch.tensor(self.spec.eos_ids, dtype=torch.long, device=self.spec.device)

    def check_call(self, prompts: Sequence[Sequence[int]], settings: GenerationSettings) -> None:
        self.backend.ladder.batch_for(len(prompts))
        self.backend.ladder.canvas_for(max(map(len, prompts)) + settings.gen_length, settings.block_length)

    # -- rows in ------------------------------------------------------------------------------------
    def _new_row(self, prompt: Sequence[int], settings: GenerationSettings, seed: int, **common) -> UniformRow:
        self.backend.ladder.canvas_for(len(prompt) + settings.gen_length, settings.block_length)
        params = {**settings.policy.row_params(), "seed": seed}
        return UniformRow(settings=settings, params=params, prompt=list(prompt), prompt_length=len(prompt),
                          blocks=settings.gen_length // settings.block_length, settled=[], **common)

    def _bucket_for(self, rows: Sequence[UniformRow]) -> Bucket:
        width, blocks = self.key.block_length, max(row.blocks for row in rows)
        total = self.backend.ladder.canvas_for(max(row.prompt_length for row in rows) + blocks * width, width)
        return Bucket(batch=self.backend.ladder.batch_for(len(rows)), canvas=total, block=width, noise="uniform",
                      prompt=total - blocks * width, schedule=Bucket.schedule_room(self.key.policy.steps))

    def _fits(self, rows: Sequence[UniformRow]) -> bool:
        width = self.key.block_length
        need = max(row.prompt_length for row in rows) + max(row.blocks for row in rows) * width
        return need <= self.backend.ladder.max_canvas

    def _place(self, joining: Sequence[UniformRow]) -> None:
        target, state = self._bucket_for([*self.rows, *joining]), self.state
        if (state is None or not self.rows or target.batch != state.bucket.batch
                or target.prompt > state.bucket.prompt or target.blocks > state.bucket.blocks):
            self._enter(target, UniformState.reset, UniformState.take_rows)
        free = sorted(set(range(self.state.bucket.batch)) - {row.slot for row in self.rows})
        for row, slot in zip(joining, free):
            row.slot = slot
        self._encode_prompts(joining)


    def _encode_prompts(self, joining: Sequence[UniformRow]) -> None:
        """The encoder's K/V of the joining rows' left-padded prompts, written to their prompt regions.
        It runs over the whole batch; every other row sees one pad token, and its K/V is not kept."""
        state = self.state
        rows, width = state.bucket.batch, state.bucket.prompt
        ids = torch.full((rows, width), self.spec.pad_id, dtype=torch.long)
        key_mask = torch.zeros(rows, width, dtype=torch.bool)
        key_mask[:, -1] = True
        for row in joining:  # positions count each row's own tokens
            ids[row.slot, width - row.prompt_length:] = torch.tensor(row.prompt)
            key_mask[row.slot, width - row.prompt_length:] = True
        state.prompt_ids.copy_(ids)
        state.prompt_key_mask.copy_(key_mask)
        state.prompt_positions.copy_((key_mask.long().cumsum(-1) - 1).clamp(min=0))
        self._encode(EncodeStep(None), self._slots(joining))
        for row in joining:
            state.place_row(row.slot, state.prompt_key_mask[row.slot], row.params)

    def _encode(self, program: EncodeStep, rows: Tensor) -> None:
        """Run the encoder step `program` and keep the K/V it adds for `rows`."""
        self.state.committing.zero_()
        self.state.committing[rows] = True
        executor = self.resources.executor
        self.compile_s += executor.prepare(self.state, program, 1)
        tick = time.perf_counter()
        executor.run(self.state, program, 1)
        self.executed += 1
        self.worked += 1
        self.backend_s += time.perf_counter() - tick

    def _slots(self, rows: Sequence[UniformRow]) -> Tensor:
        return torch.tensor([row.slot for row in rows], dtype=torch.long, device=self.spec.device)

    # -- one block ----------------------------------------------------------------------------------
    def _start_block(self) -> tuple[int, int]:
        self.state.start_blocks(self.spec.vocab_size)
        return self.key.policy.steps, 1

    def _calls(self, taken: int, steps: int) -> list[tuple[object, int]]:
        return [(UNIFORM_STEP, steps)]

    def _read_progress(self, steps: int) -> tuple[int, int]:
        return int(not self.state.done.all()), self.worked + steps

    def _steps_per_sync(self, budget_left: int, remaining: int, taken: int) -> int:
        if self.key.steps_per_sync is not None:
            return min(self.key.steps_per_sync, budget_left)
        return min(CUDA_STEPS_PER_SYNC if self.spec.device.type == "cuda" else 1, budget_left)

    def _read_drafts(self, rows: Sequence[UniformRow]) -> list[list[int | None]]:
        """The block's argmax, which the block's steps end on (-1, undecided, before its first step)."""
        drafts = self.state.argmax[self._slots(rows)].tolist()
        return [[None if token < 0 else token for token in draft] for draft in drafts]

    # -- rows out -----------------------------------------------------------------------------------
    def _read_block(self, rows: Sequence[UniformRow], cancelled: list[bool]) -> list[BlockOutcome]:
        state, pad, device = self.state, self.spec.pad_id, self.state.argmax.device
        stopping = {row.slot for row in rows if not row.settings.ignore_eos and self.eos}
        stops = torch.zeros(state.bucket.batch, dtype=torch.bool)
        stops[list(stopping)] = True
        cut = pad_after_eos(state.argmax, self._eos_ids, pad, state.finished)
        plain = state.argmax.masked_fill(state.finished[:, None], pad)  # padding rows took no step: not -1
        torch.where(stops.to(device)[:, None], cut, plain, out=state.block_tokens)
        host = torch.cat((state.block_tokens, state.forwards[:, None]), dim=1).tolist()  # the one host read a block
        outcomes = []
        for row, gone in zip(rows, cancelled):
            *tokens, row.forwards = host[row.slot]
            if gone:  # the block did not finish: none of it is kept
                outcomes.append(BlockOutcome(row.settled, "cancelled", pad))
                continue
            row.settled = row.settled + tokens
            reason = ("eos" if row.slot in stopping and any(t in self.eos for t in tokens)
                      else "length" if row.block == row.blocks - 1 else None)
            outcomes.append(BlockOutcome(row.settled, reason, pad))
        return outcomes

    def _advance(self, keep: list[UniformRow], leaving: list[int]) -> None:
        """Commit each continuing row's block to its cache slot, then free the slots `leaving`."""
        state, width = self.state, self.key.block_length
        for block in sorted({row.block for row in keep}):
            slot, rows = state.bucket.slot(block), self._slots([row for row in keep if row.block == block])
            self._encode(EncodeStep(block), rows)
            state.past_key_mask[rows, slot:slot + width] = True
        if keep:
            state.block[self._slots(keep)] += 1
            state.clear_rows(leaving)
            self._shrink()

    def _shrink(self) -> None:
        """Move the rows still running to a smaller bucket once they fit one."""
        target = self._bucket_for(self.rows)
        if target.batch < self.state.bucket.batch:
            self._enter(target, UniformState.reset, UniformState.take_rows)

    def _generated_tokens(self, settled: list[int], reason: str) -> int:
        return len(completion(settled, self.spec.eos_ids)) + (reason == "eos")  # the first EOS is decoded too
