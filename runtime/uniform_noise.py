"""The step loop of uniform-noise models (DiffusionGemma), block by block.

    result = Generator(dlmrt.load(path)).generate(prompts, GenerationSettings(
        gen_length=256, block_length=256, policy=EntropyBound()))

The Generator hands a request to this loop when its model has no mask token (`ModelSpec.noise`).
The request is laid out in a shape bucket's static buffers (`dlmrt.runtime.canvas_state`), and the
encoder writes the prompt's K/V into the bucket's cache storage. A block is the model's canvas. For
each block:

1. the canvas starts as uniform random tokens (`CanvasState.start_block`);
2. the backend runs K steps of `dlmrt.runtime.canvas_step` back to back on the device (the decoder
   over [cache; canvas], self-conditioned on the last step's soft tokens, then
   `entropy_bound_step`), and the host reads one flag, whether every row is done, before it decides
   on the next K (`steps_per_sync`). A row whose argmax is stable and whose mean entropy is small
   stops: from then on its canvas and argmax stay as they were, so the steps that still run for
   other rows change nothing of it;
3. the block's tokens are each row's last argmax, cut after the first EOS (pad after it), read once
   by the host; the encoder commits them to the cache storage (the "cache commit"), unless no row
   goes on.

Rows finished at an EOS stay in the batch, inert (all pad), until every row is done. Every random
number is a counter-based function of (row seed, step, position), so a row decodes as it does
alone, on every backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dlmrt.export.models.denoiser import LayerGroupKV
from dlmrt.plugins.entropy_bound import pad_after_eos, temperature_schedule
from dlmrt.runtime.canvas_state import CanvasBucket, CanvasState
from dlmrt.runtime.canvas_step import UNIFORM_STEP
from dlmrt.runtime.metrics import GenerationMetrics, peak_memory_bytes, reset_peak_memory
from dlmrt.runtime.text import completion

if TYPE_CHECKING:
    from dlmrt.runtime.backend import Backend
    from dlmrt.runtime.generator import BlockUpdate, CancelToken, GenerationResult
    from dlmrt.runtime.policies import EntropyBound
    from dlmrt.runtime.settings import GenerationSettings

# K on CUDA when steps_per_sync is not set: a host read per 8 steps, and at most 7 steps run past
# the step at which the last row stopped (they change no token).
CUDA_STEPS_PER_SYNC = 8


class UniformNoiseRun:
    """One generate call of a uniform-noise model; `events()` yields a BlockUpdate per row and block."""

    def __init__(self, backend: Backend, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
                 cancel: CancelToken | None, on_step: Callable[[], None] | None):
        self.backend, self.spec, self.settings = backend, backend.spec, settings
        self.policy: EntropyBound = settings.policy
        self.cancel, self.on_step = cancel, on_step
        self.started = time.perf_counter()
        device = self.spec.device
        reset_peak_memory(device)
        self.batch = rows = len(prompts)
        width, gen_length, ladder = settings.block_length, settings.gen_length, backend.ladder
        self.prompt_lengths = [len(p) for p in prompts]
        total = ladder.canvas_for(max(self.prompt_lengths) + gen_length, width)
        bucket = CanvasBucket(batch=ladder.batch_for(rows), prompt=total - gen_length, width=width,
                              blocks=gen_length // width, schedule=CanvasBucket.schedule_room(self.policy.steps))
        ids = torch.full((bucket.batch, bucket.prompt), self.spec.pad_id, dtype=torch.long)
        key_mask = torch.zeros(bucket.batch, bucket.prompt, dtype=torch.bool)
        key_mask[rows:, -1] = True  # a padding row: one pad token of its own
        for row, prompt in enumerate(prompts):  # left padding: positions count each row's own tokens
            ids[row, bucket.prompt - len(prompt):] = torch.tensor(list(prompt))
            key_mask[row, bucket.prompt - len(prompt):] = True
        self.prompt_ids, self.prompt_mask = ids.to(device), key_mask.to(device)
        policy = self.policy
        schedule = torch.ones(bucket.schedule)
        schedule[:policy.steps] = temperature_schedule(policy.t_min, policy.t_max, policy.steps)
        params = {"temperatures": schedule.expand(rows, -1),
                  "last_step": torch.full((rows,), policy.steps - 1, dtype=torch.long),
                  "entropy_bound": torch.full((rows,), policy.entropy_bound, dtype=torch.float32),
                  "seed": settings.seed + torch.arange(rows, dtype=torch.long),
                  "stability_threshold": torch.full((rows,), policy.stability_threshold, dtype=torch.long),
                  "confidence_threshold": torch.full((rows,), policy.confidence_threshold, dtype=torch.float32)}
        self.state: CanvasState = backend.prepare(bucket, owner=self)
        self.state.load(self.prompt_mask, rows, {name: value.to(device) for name, value in params.items()})
        self.eos = torch.tensor(self.spec.eos_ids, dtype=torch.long, device=device)
        self.stops_at_eos = not settings.ignore_eos and len(self.spec.eos_ids) > 0
        self.tokens = torch.full((rows, gen_length), self.spec.pad_id, dtype=torch.long)
        self.finish_reason: list[str | None] = [None] * rows
        self.row_forwards = [0] * rows
        self.encoder_forwards = self.executed = 0  # forwards of the encoder, and of the decoder
        self.backend_s = self.compile_s = 0.0

    # -- the loop ------------------------------------------------------------------------------
    def events(self) -> Iterator[BlockUpdate]:
        try:
            yield from self._blocks()
        finally:
            self.row_forwards = self.state.forwards[:self.batch].tolist()
            self.backend.release(self.state)

    def _blocks(self) -> Iterator[BlockUpdate]:
        from dlmrt.runtime.generator import BlockUpdate

        state, bucket = self.state, self.state.bucket
        positions = (self.prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        self._encode(self.prompt_ids, positions, self.prompt_mask, None, 0)
        for block in range(bucket.blocks):
            state.start_block(block, self.spec.vocab_size)
            if not self._denoise():
                yield from self._finish_running("cancelled")
                return
            if self.stops_at_eos:
                tokens = pad_after_eos(state.argmax, self.eos, self.spec.pad_id, state.finished)
                state.finished.logical_or_(torch.isin(tokens, self.eos).any(-1))
            else:  # padding rows took no step: pad, not their draft's -1
                tokens = state.argmax.masked_fill(state.finished[:, None], self.spec.pad_id)
            host_tokens, finished = tokens[:self.batch].tolist(), state.finished[:self.batch].tolist()  # once a block
            width = bucket.width
            self.tokens[:, block * width:(block + 1) * width] = torch.tensor(host_tokens)
            last = block == bucket.blocks - 1
            for row in range(self.batch):
                if self.finish_reason[row] is not None:
                    continue
                reason = ("eos" if finished[row] else "length" if last else None)
                self.finish_reason[row] = reason
                yield BlockUpdate(row, block, completion(host_tokens[row], self.spec.eos_ids), reason)
            if last or all(finished):
                for row in range(self.batch):
                    self.finish_reason[row] = self.finish_reason[row] or "eos"
                return
            slot = bucket.slot(block)
            key_mask = torch.cat((state.past_key_mask[:, :slot], state.key_mask), dim=1)
            self._encode(tokens, state.positions, key_mask, state.cache_before(block), slot)
            state.past_key_mask[:, slot:slot + width] = True

    def _encode(self, ids: Tensor, positions: Tensor, key_mask: Tensor, cache: LayerGroupKV | None,
                start: int) -> None:
        """Run the encoder and store the K/V it adds from cache position `start` on."""
        tick = time.perf_counter()
        self.state.write_cache(self.backend.encode(ids, positions, key_mask, cache), start)
        self.encoder_forwards += 1
        self.backend_s += time.perf_counter() - tick

    def _steps_per_sync(self) -> int:
        if self.settings.steps_per_sync is not None:
            return self.settings.steps_per_sync
        return CUDA_STEPS_PER_SYNC if self.spec.device.type == "cuda" else 1

    def _denoise(self) -> bool:
        """Up to `policy.steps` steps over the current block, K at a time; False when cancelled.
        Rows finished in an earlier block are inert from the start."""
        steps, per_read, taken = self.policy.steps, self._steps_per_sync(), 0
        while taken < steps:
            if self.cancel is not None and self.cancel.is_set():
                return False
            count = min(per_read, steps - taken)
            self.compile_s += self.backend.prepare_steps(self.state, UNIFORM_STEP, count)
            tick = time.perf_counter()
            self.backend.run(self.state, UNIFORM_STEP, count)
            all_done = bool(self.state.done.all())  # the one host read per K steps
            self.backend_s += time.perf_counter() - tick
            taken += count
            self.executed += count
            if self.on_step is not None:
                for _ in range(count):
                    self.on_step()
            if all_done:
                break
        return True

    def _finish_running(self, reason: str) -> Iterator[BlockUpdate]:
        from dlmrt.runtime.generator import BlockUpdate

        for row in range(self.batch):
            if self.finish_reason[row] is None:
                self.finish_reason[row] = reason
                yield BlockUpdate(row, -1, [], reason)

    # -- the result -------------------------------------------------------------------------------
    def result(self) -> GenerationResult:
        from dlmrt.runtime.generator import GenerationResult, RowOutput

        latency = time.perf_counter() - self.started - self.compile_s
        forwards = self.row_forwards
        rows = []
        for row in range(self.batch):
            ids = completion(self.tokens[row].tolist(), self.spec.eos_ids)
            generated = len(ids) + (self.finish_reason[row] == "eos")  # the first EOS is decoded too
            rows.append(RowOutput(ids, self.finish_reason[row] or "length", GenerationMetrics(
                nfe=forwards[row], sequence_forwards=forwards[row], generated_tokens=generated,
                prompt_tokens=self.prompt_lengths[row], batch_size=1, latency_s=latency, backend_s=self.backend_s)))
        metrics = GenerationMetrics(
            nfe=self.executed + self.encoder_forwards, sequence_forwards=sum(forwards),
            generated_tokens=sum(r.metrics.generated_tokens for r in rows), prompt_tokens=sum(self.prompt_lengths),
            batch_size=self.batch, latency_s=latency, backend_s=self.backend_s,
            peak_memory_bytes=peak_memory_bytes(self.spec.device),
            forwards_executed=self.executed + self.encoder_forwards, compile_s=self.compile_s)
        return GenerationResult(self.tokens, rows, metrics)
