"""The step loop of uniform-noise models (DiffusionGemma), block by block.

    result = Generator(dlmrt.load(path)).generate(prompts, GenerationSettings(
        gen_length=256, block_length=256, policy=EntropyBound()))

The Generator hands a request to this loop when its model has no mask token (`ModelSpec.noise`).
A block is the model's canvas. For each block:

1. the canvas starts as uniform random tokens (`dlmrt.plugins.entropy_bound.initial_canvas`);
2. each step runs the decoder over [cache; canvas], self-conditioned on the last step's soft tokens,
   then `entropy_bound_step`: scale by the step's temperature, sample, keep the low-entropy samples,
   refill the rest. A row whose argmax is stable and whose mean entropy is small stops: from then on
   its canvas and argmax stay as they were, so the steps that still run for other rows, or that run
   before the host next looks (K steps per read, `steps_per_sync`), change nothing of it;
3. the block's tokens are each row's last argmax, cut after the first EOS (pad after it), and the
   encoder commits them to the cache (the "cache commit"), unless no row goes on.

Rows finished at an EOS stay in the batch, inert (all pad), until every row is done. Every random
number is a counter-based function of (row seed, step, position), so a row decodes as it does
alone, on every backend.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dlmrt.plugins.entropy_bound import (RenoiseParams, entropy_bound_step, initial_canvas, pad_after_eos,
                                         should_stop, stability, temperature_schedule)
from dlmrt.runtime.metrics import GenerationMetrics, peak_memory_bytes, reset_peak_memory
from dlmrt.runtime.text import completion

if TYPE_CHECKING:
    from dlmrt.runtime.generator import BlockUpdate, CancelToken, GenerationResult
    from dlmrt.runtime.policies import EntropyBound
    from dlmrt.runtime.settings import GenerationSettings


class CanvasBackend(ABC):
    """What the loop asks of a backend that runs a uniform-noise model."""

    @abstractmethod
    def encode(self, ids: Tensor, positions: Tensor, key_mask: Tensor, cache: Any | None) -> Any:
        """The cache commit: `cache` extended by the causal encoder's K/V of `ids [B, T]`."""

    @abstractmethod
    def decode(self, canvas: Tensor, positions: Tensor, key_mask: Tensor, cache: Any,
               soft_tokens: Any | None) -> Tensor:
        """The decoder's float32 logits `[B, W, V]` over the canvas after the cache."""

    @abstractmethod
    def soft_tokens(self, scaled_logits: Tensor) -> Any:
        """The next step's self-conditioning from this step's temperature-scaled logits."""


class UniformNoiseRun:
    """One generate call of a uniform-noise model; `events()` yields a BlockUpdate per row and block."""

    def __init__(self, backend: CanvasBackend, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
                 cancel: CancelToken | None, on_step: Callable[[], None] | None):
        self.backend, self.spec, self.settings = backend, backend.spec, settings
        self.policy: EntropyBound = settings.policy
        self.cancel, self.on_step = cancel, on_step
        self.started = time.perf_counter()
        device = self.spec.device
        reset_peak_memory(device)
        self.batch = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts])
        width = int(lengths.max())
        self.prompt_lengths = lengths.tolist()
        ids = torch.full((self.batch, width), self.spec.pad_id, dtype=torch.long)
        key_mask = torch.zeros(self.batch, width, dtype=torch.bool)
        for row, prompt in enumerate(prompts):  # left padding: positions count each row's own tokens
            ids[row, width - len(prompt):] = torch.tensor(list(prompt))
            key_mask[row, width - len(prompt):] = True
        self.prompt_ids, self.key_mask = ids.to(device), key_mask.to(device)
        self.lengths = lengths.to(device)
        self.seeds = (settings.seed + torch.arange(self.batch, dtype=torch.long)).to(device)
        self.temperatures = temperature_schedule(self.policy.t_min, self.policy.t_max, self.policy.steps).to(device)
        # each step's counter, per row: made once, not in the step loop
        self.step_counters = torch.arange(self.policy.steps, device=device)[:, None].expand(-1, self.batch)
        self.bounds = torch.full((self.batch,), self.policy.entropy_bound, dtype=torch.float32, device=device)
        self.eos = torch.tensor(self.spec.eos_ids, dtype=torch.long, device=device)
        self.stops_at_eos = not settings.ignore_eos and len(self.spec.eos_ids) > 0
        self.tokens = torch.full((self.batch, settings.gen_length), self.spec.pad_id, dtype=torch.long)
        self.finished = torch.zeros(self.batch, dtype=torch.bool, device=device)
        self.finish_reason: list[str | None] = [None] * self.batch
        self.row_forwards = torch.zeros(self.batch, dtype=torch.long, device=device)
        self.encoder_forwards = self.executed = 0  # forwards of the encoder, and of the decoder
        self.backend_s = 0.0

    # -- the loop ------------------------------------------------------------------------------
    def events(self) -> Iterator[BlockUpdate]:
        from dlmrt.runtime.generator import BlockUpdate

        width = self.settings.block_length
        tick = time.perf_counter()
        cache = self.backend.encode(self.prompt_ids, (self.key_mask.long().cumsum(-1) - 1).clamp(min=0),
                                    self.key_mask, None)
        self.encoder_forwards += 1
        self.backend_s += time.perf_counter() - tick
        key_mask = self.key_mask
        blocks = self.settings.gen_length // width
        for block in range(blocks):
            positions = self.lengths[:, None] + block * width + torch.arange(width, device=self.lengths.device)
            key_mask = torch.cat((key_mask, key_mask.new_ones(self.batch, width)), dim=1)
            tokens = self._denoise(positions, key_mask, cache)
            if tokens is None:
                yield from self._finish_running("cancelled")
                return
            before = self.finished.clone()
            if self.stops_at_eos:
                tokens = pad_after_eos(tokens, self.eos, self.spec.pad_id, before)
                self.finished |= torch.isin(tokens, self.eos).any(-1)
            host_tokens, finished = tokens.tolist(), self.finished.tolist()  # the one read per block
            self.tokens[:, block * width:(block + 1) * width] = torch.tensor(host_tokens)
            last = block == blocks - 1
            for row in range(self.batch):
                if before[row]:
                    continue
                reason = ("eos" if finished[row] else "length" if last else None)
                self.finish_reason[row] = reason
                update = completion(host_tokens[row], self.spec.eos_ids)
                yield BlockUpdate(row, block, update, reason)
            if last or all(finished):
                for row in range(self.batch):
                    self.finish_reason[row] = self.finish_reason[row] or "eos"
                return
            tick = time.perf_counter()
            cache = self.backend.encode(tokens, positions, key_mask, cache)
            self.encoder_forwards += 1
            self.backend_s += time.perf_counter() - tick

    def _denoise(self, positions: Tensor, key_mask: Tensor, cache: Any) -> Tensor | None:
        """Up to `policy.steps` steps over one block; its tokens (each row's last argmax), or None when
        cancelled. Rows finished in an earlier block are inert from the start."""
        policy, backend = self.policy, self.backend
        canvas = initial_canvas(self.seeds, positions, self.spec.vocab_size)
        argmax = torch.full_like(canvas, -1)
        stable_run = torch.zeros_like(self.seeds)
        done = self.finished.clone()
        soft = None
        per_read = self.settings.steps_per_sync or 1
        for step in range(policy.steps):
            if step % per_read == 0:
                if self.cancel is not None and self.cancel.is_set():
                    return None
                if step and bool(done.all()):  # the one host read per K steps
                    break
            tick = time.perf_counter()
            logits = backend.decode(canvas, positions, key_mask, cache, soft)
            params = RenoiseParams(self.temperatures[step].expand(self.batch), self.bounds, self.seeds,
                                   self.step_counters[step])
            result = entropy_bound_step(logits, canvas, positions, params, finished=done)
            new_argmax = torch.where(done[:, None], argmax, result.argmax)
            stable_run = stability(new_argmax, argmax, stable_run)
            self.row_forwards += ~done
            done = done | should_stop(stable_run, result.mean_entropy, policy.stability_threshold,
                                      policy.confidence_threshold)
            canvas, argmax = result.canvas, new_argmax
            soft = backend.soft_tokens(result.scaled_logits)
            self.backend_s += time.perf_counter() - tick
            self.executed += 1
            if self.on_step is not None:
                self.on_step()
        return argmax

    def _finish_running(self, reason: str) -> Iterator[BlockUpdate]:
        from dlmrt.runtime.generator import BlockUpdate

        for row in range(self.batch):
            if self.finish_reason[row] is None:
                self.finish_reason[row] = reason
                yield BlockUpdate(row, -1, [], reason)

    # -- the result -------------------------------------------------------------------------------
    def result(self) -> GenerationResult:
        from dlmrt.runtime.generator import GenerationResult, RowOutput

        latency = time.perf_counter() - self.started
        forwards = self.row_forwards.tolist()
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
            forwards_executed=self.executed + self.encoder_forwards)
        return GenerationResult(self.tokens, rows, metrics)
