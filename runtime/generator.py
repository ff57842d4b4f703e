"""The Generator: the step loop, written once for every backend.

    gen = Generator(dlmrt.load(path))                       # TorchBackend
    result = gen.generate(prompts, GenerationSettings(gen_length=256, block_length=32,
                                                      policy=Threshold(0.9), cache="dual"))
    for update in gen.stream(prompts, settings):            # committed tokens, block by block
        ...

Each block runs at most `settings.block_steps()` steps; each step is one
`Backend.step` over a window of the canvas chosen by the cache mode:

| cache | bidirectional (llada) | block-causal (llada2_moe) |
|---|---|---|
| none | the whole canvas, every step | everything up to the block's end (LLaDA2's generate) |
| prefix | first step of a block: the whole canvas, refreshing the cache; then the block and what follows, over the cached prefix | the exact block cache: blocks not yet cached plus the current one, then the block alone; a finished block's K/V is written once |
| dual | first step: the whole canvas; then the block alone, over cached prefix and suffix | refused: nothing after a block is visible to it |

For bidirectional models `prefix` and `dual` are approximations (the cached
K/V is from the start of the block); for block-causal models `prefix` is exact.

Rows finish independently: a row stops after the block in which it committed
an end-of-sequence token (unless `ignore_eos`), the rest of its output is
filled with EOS, and at the next block boundary it leaves the batch, so it
costs no more compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from dlmrt.plugins.parallel_unmask import UnmaskParams
from dlmrt.runtime import layout as layouts
from dlmrt.runtime.backend import Backend, StepInputs
from dlmrt.runtime.kv_cache import KVCache
from dlmrt.runtime.metrics import GenerationMetrics, peak_memory_bytes, reset_peak_memory
from dlmrt.runtime.settings import GenerationSettings, check_request
from dlmrt.runtime.text import completion


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


class Generator:
    def __init__(self, model_or_backend):
        if isinstance(model_or_backend, Backend):
            self.backend = model_or_backend
        else:
            from dlmrt.runtime.torch_backend import TorchBackend

            self.backend = TorchBackend(model_or_backend)
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
        return GenerationStream(_Run(self.backend, prompts, settings, cancel, on_step))


class GenerationStream:
    def __init__(self, run: _Run):
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


class _PlannedStep(NamedTuple):
    inputs: StepInputs
    window_start: int
    cache_write: tuple[int, int] | None  # canvas range whose K/V this step writes to the cache


class _Run:
    """The state of one generate call: canvas, cache and per-row bookkeeping."""

    def __init__(self, backend: Backend, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
                 cancel: CancelToken | None, on_step: Callable[[], None] | None):
        self.backend, self.spec, self.settings = backend, backend.spec, settings
        self.cancel, self.on_step = cancel, on_step
        spec, device = self.spec, self.spec.device
        self.started = time.perf_counter()
        reset_peak_memory(device)
        self.layout = layouts.build(prompts, settings.gen_length, settings.block_length,
                                    block_causal=spec.block_causal, pad_id=spec.pad_id, mask_id=spec.mask_id)
        lay = self.layout
        self.canvas = lay.ids.to(device)
        self.key_mask = lay.key_mask.to(device)
        self.positions = lay.positions.to(device)
        self.prompt_lengths = lay.prompt_lengths.to(device)
        self.output_start = lay.output_start.to(device)
        self.batch = len(prompts)
        self.guided = settings.cfg_scale > 0
        self.rows = torch.arange(self.batch)  # original index of each active row
        index = torch.arange(lay.length, device=device)
        self.in_output = (index >= self.output_start[:, None]) & \
                         (index < self.output_start[:, None] + settings.gen_length)
        policy = settings.policy
        self.params = UnmaskParams(
            count=torch.zeros(self.batch, dtype=torch.long, device=device),
            threshold=torch.full((self.batch,), policy.threshold_value, dtype=torch.float32, device=device),
            factor=torch.full((self.batch,), policy.factor_value, dtype=torch.float32, device=device),
            temperature=torch.full((self.batch,), settings.temperature, dtype=torch.float32, device=device),
            seed=settings.seed + torch.arange(self.batch, dtype=torch.long, device=device),
            step=torch.zeros(self.batch, dtype=torch.long, device=device))
        model_rows = self.batch * (2 if self.guided else 1)
        self.z = self.certainty = None
        if spec.has_residual:
            self.z = torch.zeros(model_rows, lay.length, spec.hidden_size, dtype=spec.dtype, device=device)
            self.certainty = torch.zeros(model_rows, lay.length, dtype=spec.dtype, device=device)
        self.cache = KVCache(spec, model_rows, lay.length) if settings.cache != "none" else None
        self.block_causal_grid = lay.block_length if spec.block_causal else None

        self.tokens = torch.full((self.batch, settings.gen_length), spec.mask_id, dtype=torch.long)
        self.finish_reason: list[str | None] = [None] * self.batch
        self.row_metrics: list[GenerationMetrics | None] = [None] * self.batch
        self.row_forwards = [0] * self.batch
        self.row_backend_s = [0.0] * self.batch
        self.emitted = [0] * self.batch
        self.nfe = 0
        self.sequence_forwards = 0
        self.backend_s = 0.0
        self.eos = torch.tensor(spec.eos_ids, dtype=torch.long, device=device)
        self.stops_at_eos = not settings.ignore_eos and len(spec.eos_ids) > 0
        self.stop_ids = (*spec.eos_ids, spec.mask_id)  # a completion ends at EOS, or where decoding stopped
        self.steps_since_compaction = 0
        self.backend_s_since_compaction = 0.0

    # -- the loop ---------------------------------------------------------------------------
    def events(self) -> Iterator[BlockUpdate]:
        settings, lay = self.settings, self.layout
        budget = settings.block_steps()
        for block in range(lay.num_blocks):
            start, end = lay.block(block)
            remaining = (self.canvas[:, start:end] == self.spec.mask_id).sum(-1)
            schedule = settings.policy.schedule(remaining, lay.block_length, budget)
            planned = self._plan(start, end, first=True)
            for step in range(budget):
                if int(remaining.sum()) == 0:
                    break
                if self.cancel is not None and self.cancel.is_set():
                    yield from self._finish_all("cancelled")
                    return
                if step == 1:
                    planned = self._plan(start, end, first=False)
                self.params.count.copy_(schedule[:, step])
                remaining -= self._step(planned)
                self.params.step.add_(1)
            yield from self._end_block(block, end)
            if not len(self.rows):
                return
        yield from self._finish_all("length")  # only rows a step budget left unfinished get here

    def _step(self, planned: _PlannedStep) -> Tensor:
        tick = time.perf_counter()
        out = self.backend.step(planned.inputs)
        self.backend.synchronize()
        spent = time.perf_counter() - tick
        block_start = planned.window_start + planned.inputs.block_offset
        self.canvas[:, block_start:block_start + out.ids.shape[1]] = out.ids
        window = slice(planned.window_start, planned.window_start + planned.inputs.ids.shape[1])
        if self.z is not None:
            self.z[:, window] = out.z
            self.certainty[:, window] = out.certainty
        if planned.cache_write is not None:
            self.cache.write(out.kv, *planned.cache_write, window_start=planned.window_start)
        self.nfe += 1
        self.backend_s += spent
        self.steps_since_compaction += 1
        self.backend_s_since_compaction += spent
        if self.on_step is not None:
            self.on_step()
        return out.committed

    # -- windows and the cache ----------------------------------------------------------------
    def _plan(self, start: int, end: int, *, first: bool) -> _PlannedStep:
        """The inputs of a step of the block [start, end): the window and cache use by cache mode."""
        mode, length, cache = self.settings.cache, self.layout.length, self.cache
        if mode == "none":
            return self._inputs(0, end if self.spec.block_causal else length, start)
        if self.spec.block_causal:  # the exact block cache: each finished block is written once
            cached = cache.length
            return self._inputs(cached, end, start, past=cache.prefix(cached), past_index=slice(0, cached),
                                cache_write=(cached, start) if cached < start else None)
        if first:  # a full forward refreshes the cache at each block boundary
            return self._inputs(0, length, start, cache_write=(0, length))
        if mode == "prefix":
            return self._inputs(start, length, start, past=cache.prefix(start), past_index=slice(0, start))
        past, key_index = cache.around(start, end)
        return self._inputs(start, end, start, past=past, past_index=key_index)

    def _inputs(self, window_start: int, window_end: int, block_start: int, *,
                past: Tensor | None = None, past_index: slice | Tensor | None = None,
                cache_write: tuple[int, int] | None = None) -> _PlannedStep:
        window = slice(window_start, window_end)
        past_positions, key_mask = None, self.key_mask[:, window]
        if past is not None and past.shape[4] > 0:
            past_positions = self.positions[:, past_index]
            key_mask = torch.cat((self.key_mask[:, past_index], key_mask), dim=1)
        else:
            past = None
        inputs = StepInputs(
            ids=self.canvas[:, window], positions=self.positions[:, window], key_mask=key_mask,
            past_kv=past, past_positions=past_positions, block_offset=block_start - window_start,
            block_length=self.layout.block_length, params=self.params, prompt_lengths=self.prompt_lengths,
            z=None if self.z is None else self.z[:, window],
            certainty=None if self.certainty is None else self.certainty[:, window],
            return_kv=cache_write is not None, cfg_scale=self.settings.cfg_scale,
            confidence=self.settings.policy.confidence, sampling=self.settings.temperature > 0,
            grid=self.block_causal_grid)
        return _PlannedStep(inputs, window_start, cache_write)

    # -- rows finishing -----------------------------------------------------------------------
    def _end_block(self, block: int, end: int) -> Iterator[BlockUpdate]:
        eos_hit = (torch.isin(self.canvas[:, :end], self.eos) & self.in_output[:, :end]).any(-1)
        stopped = eos_hit if self.stops_at_eos else torch.zeros_like(eos_hit)
        finished = stopped | ~(self.canvas == self.spec.mask_id).any(-1)
        for active in range(len(self.rows)):
            reason = ("eos" if bool(eos_hit[active]) else "length") if bool(finished[active]) else None
            update = self._update(active, block, end, reason)
            if update.token_ids or reason:
                yield update
        if bool(finished.any()):
            decoded = self._decoded()
            self.canvas = torch.where(stopped[:, None] & (self.canvas == self.spec.mask_id),
                                      self.eos[:1], self.canvas)
            for active in finished.nonzero().flatten().tolist():
                self._close_row(active, int(decoded[active]))
            self._keep((~finished).nonzero().flatten())

    def _finish_all(self, reason: str) -> Iterator[BlockUpdate]:
        decoded = self._decoded()
        for active in range(len(self.rows)):
            yield self._update(active, -1, self.layout.length, reason)
            self._close_row(active, int(decoded[active]))
        self._keep(torch.zeros(0, dtype=torch.long, device=self.canvas.device))

    def _decoded(self) -> Tensor:
        """Per active row, the positions of its requested output the model has committed."""
        return ((self.canvas != self.spec.mask_id) & self.in_output).sum(-1)

    def _update(self, active: int, block: int, end: int, reason: str | None) -> BlockUpdate:
        row = int(self.rows[active])
        start = int(self.output_start[active])
        settled = self.canvas[active, start:min(end, start + self.settings.gen_length)].tolist()
        new = completion(settled[self.emitted[row]:], self.stop_ids)
        self.emitted[row] += len(new)
        if reason is not None:
            self.finish_reason[row] = reason
        return BlockUpdate(row, block, new, reason)

    def _close_row(self, active: int, decoded: int) -> None:
        row = int(self.rows[active])
        start = int(self.output_start[active])
        self.tokens[row] = self.canvas[active, start:start + self.settings.gen_length].cpu()
        self.row_forwards[row] += self.steps_since_compaction
        self.row_backend_s[row] += self.backend_s_since_compaction
        self.sequence_forwards += self.row_forwards[row]
        self.row_metrics[row] = GenerationMetrics(
            nfe=self.row_forwards[row], sequence_forwards=self.row_forwards[row], generated_tokens=decoded,
            prompt_tokens=int(self.prompt_lengths[active]), batch_size=1,
            latency_s=time.perf_counter() - self.started, backend_s=self.row_backend_s[row])

    def _keep(self, keep: Tensor) -> None:
        """Drop finished rows from every per-row state tensor."""
        for active in range(len(self.rows)):
            row = int(self.rows[active])
            if self.row_metrics[row] is None:
                self.row_forwards[row] += self.steps_since_compaction
                self.row_backend_s[row] += self.backend_s_since_compaction
        self.steps_since_compaction, self.backend_s_since_compaction = 0, 0.0
        if len(keep) == len(self.rows):
            return
        model_keep = torch.cat((keep, keep + len(self.rows))) if self.guided else keep
        for name in ("canvas", "key_mask", "positions", "prompt_lengths", "output_start", "in_output"):
            setattr(self, name, getattr(self, name)[keep])
        self.params = UnmaskParams(*(t[keep] for t in self.params))
        if self.z is not None:
            self.z, self.certainty = self.z[model_keep], self.certainty[model_keep]
        if self.cache is not None:
            self.cache.keep(model_keep)
        self.rows = self.rows[keep.cpu()]

    def result(self) -> GenerationResult:
        rows = [RowOutput(completion(self.tokens[row].tolist(), self.stop_ids), self.finish_reason[row],
                          self.row_metrics[row])
                for row in range(self.batch)]
        metrics = GenerationMetrics(
            nfe=self.nfe, sequence_forwards=self.sequence_forwards,
            generated_tokens=sum(r.metrics.generated_tokens for r in rows),
            prompt_tokens=int(self.layout.prompt_lengths.sum()), batch_size=self.batch,
            latency_s=time.perf_counter() - self.started, backend_s=self.backend_s,
            peak_memory_bytes=peak_memory_bytes(self.spec.device))
        return GenerationResult(self.tokens, rows, metrics)

