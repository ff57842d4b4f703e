"""The Generator: the step loop, written once for every backend.

    gen = Generator(dlmrt.load(path))                       # TorchBackend
    result = gen.generate(prompts, GenerationSettings(gen_length=256, block_length=32,
                                                      policy=Threshold(0.9), cache="dual"))
    for update in gen.stream(prompts, settings):            # committed tokens, block by block
        ...

Design notes: docs/runtime-modules.md#generator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dlmrt.core.errors import ArgumentError
from dlmrt.runtime.backend import Backend
from dlmrt.runtime.metrics import GenerationMetrics, peak_memory_bytes, reset_peak_memory
from dlmrt.runtime.batches import open_batch
from dlmrt.runtime.running_batch import BlockUpdate, CancelToken
from dlmrt.runtime.settings import GenerationSettings, check_request
from dlmrt.runtime.text import completion

__all__ = ["BlockUpdate", "CancelToken", "GenerationResult", "GenerationStream", "Generator", "RowOutput"]


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


class _Run:
    """One generate call: a RunningBatch whose rows all join at the first block."""

    def __init__(self, backend: Backend, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
                 cancel: CancelToken | None, on_step: Callable[[], None] | None):
        self.spec, self.settings, self.size = backend.spec, settings, len(prompts)
        self.started = time.perf_counter()
        reset_peak_memory(self.spec.device)
        self.batch = open_batch(backend, on_step=on_step)
        self.batch.check_call(prompts, settings)
        for row, prompt in enumerate(prompts):
            self.batch.add(row, prompt, settings, seed=settings.seed + row, cancel=cancel)
        self.prompt_tokens = sum(len(prompt) for prompt in prompts)

    def events(self) -> Iterator[BlockUpdate]:
        try:
            while self.batch.active:
                yield from self.batch.run_block()
        finally:
            self.batch.close()

    def result(self) -> GenerationResult:
        batch = self.batch
        finished = [batch.finished[row] for row in range(self.size)]
        rows = [RowOutput(completion(f.tokens, batch.stop_ids), f.finish_reason, f.metrics) for f in finished]
        metrics = GenerationMetrics(
            nfe=batch.worked, sequence_forwards=sum(r.metrics.sequence_forwards for r in rows),
            generated_tokens=sum(r.metrics.generated_tokens for r in rows), prompt_tokens=self.prompt_tokens,
            batch_size=self.size, edits=sum(r.metrics.edits for r in rows),
            latency_s=time.perf_counter() - self.started - batch.compile_s, backend_s=batch.backend_s,
            peak_memory_bytes=peak_memory_bytes(self.spec.device), forwards_executed=batch.executed,
            compile_s=batch.compile_s)
        return GenerationResult(torch.tensor([f.tokens for f in finished], dtype=torch.long), rows, metrics)
