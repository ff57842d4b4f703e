"""Exact-match of a model on task-suite examples, decoded with the reference loop."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from dlmrt.export.models import Denoiser
from dlmrt.runtime import reference, text
from dlmrt.tasks import Example


def exact_match(model: Denoiser, examples: Sequence[Example], settings: reference.GenerationSettings,
                batch_size: int = 64, on_batch: Callable[[int], None] | None = None) -> dict[str, float]:
    """Fraction of exactly right answers per task. Rows are batched (left padding is exact)."""
    right: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        prompts = [text.encode(model, e.prompt) for e in batch]
        out = reference.generate(model, prompts, settings)
        for example, row in zip(batch, out.tokens.tolist()):
            answer = text.decode(model, text.completion(row, model.tokens.eos_ids))
            total[example.task] += 1
            right[example.task] += answer == example.answer
        if on_batch is not None:
            on_batch(len(batch))
    return {task: right[task] / total[task] for task in total}
