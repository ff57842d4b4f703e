"""One step of the step loop at given shapes, as the roofline and the step profile run it: the step
kind the loop would run, the StepGraph the torch backend would build for it, and inputs of its shapes.

The case decodes the first generated block of a batch of equal prompts (a block-causal model's first
block holds the prompt's last partial block), with the threshold policy's static options (greedy,
confidence `prob`, no editing, no logprobs), on the block's later steps (`step="later"`, most of a
block's steps) or its first (`step="first"`: the refresh forward of the bidirectional caches, or the
step that writes a block-causal model's cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dlmrt.core.errors import ArgumentError
from dlmrt.models import Denoiser
from dlmrt.models.step_graph import StepGraph
from dlmrt.ops.parallel_unmask import MEASURE_CODES
from dlmrt.runtime.device_step import StepKind, kinds_for_block
from dlmrt.runtime.layout import canvas_length

CACHES = ("none", "prefix", "dual")
STEPS = ("first", "later")


def default_cache(model: Denoiser) -> str:
    """The cache `dlmrt bench` decodes with by default: prefix for block-causal models (their exact block
    cache), none for uniform-noise ones (whose encoder cache is not a choice), else dual."""
    if model.block_causal:
        return "prefix"
    return "none" if model.noise == "uniform" else "dual"


@dataclass(frozen=True)
class StepCase:
    batch: int
    input_len: int
    output_len: int
    block_length: int
    cache: str
    step: str = "later"

    def __post_init__(self):
        if self.cache not in CACHES or self.step not in STEPS:
            raise ArgumentError(f"a step case's cache is one of {', '.join(CACHES)} and its step one of "
                                f"{', '.join(STEPS)}, got {self.cache!r} and {self.step!r}")

    def describe(self) -> str:
        return (f"batch {self.batch}, prompt {self.input_len}, {self.output_len} generated in blocks of "
                f"{self.block_length}, cache {self.cache}, the block's {self.step} step")


@dataclass(frozen=True)
class StepShapes:
    kind: StepKind
    canvas: int
    block_start: int  # the block's canvas position
    window_start: int  # the window's canvas position

    @property
    def past(self) -> int:
        """Cached positions the window attends to (0 without a cache)."""
        return self.canvas if self.kind.cached else 0


def step_shapes(model: Denoiser, case: StepCase) -> StepShapes:
    block_causal = model.block_causal
    canvas = canvas_length([[0] * case.input_len], case.output_len, case.block_length, block_causal=block_causal)
    if canvas > model.max_positions:
        raise ArgumentError(f"{case.input_len} prompt and {case.output_len} generated tokens need {canvas} "
                            f"positions, more than {model.name}'s context of {model.max_positions}")
    block_start = (case.input_len // case.block_length) * case.block_length if block_causal else case.input_len
    kinds = kinds_for_block(case.cache, block_causal, canvas, block_start, case.block_length,
                            first_block=True, confidence="prob", lookbehind=model.logits_shift)
    kind = kinds[STEPS.index(case.step)]
    window_start = kind.start if kind.start is not None else block_start - kind.before
    return StepShapes(kind, canvas, block_start, window_start)


def step_graph(model: Denoiser, shapes: StepShapes, block_length: int) -> StepGraph:
    """The StepGraph the torch backend builds for the kind (TorchBackend.step_graph)."""
    kind = shapes.kind
    return StepGraph(model, kind.graph(False), block_length if model.block_causal else None,
                     return_kv=kind.writes > 0, sampling=kind.sampling, confidence=kind.confidence,
                     editing=kind.editing, return_logits=kind.logprobs).eval()


def step_inputs(model: Denoiser, case: StepCase, shapes: StepShapes, device: str | torch.device) -> dict[str, Tensor]:
    """The step graph's inputs, by name, on `device`: random ids with the block masked, every position
    unpadded, the cache (zeros) holding every position outside the window."""
    rows, window, block = case.batch, shapes.kind.window, case.block_length
    inside = shapes.block_start - shapes.window_start
    ids = torch.randint(model.vocab_size, (rows, window), generator=torch.Generator().manual_seed(0))
    ids[:, inside:inside + block] = model.tokens.mask_id
    positions = torch.arange(shapes.window_start, shapes.window_start + window).expand(rows, window)
    long, real = dict(dtype=torch.long), dict(dtype=torch.float32)
    inputs = {"ids": ids, "positions": positions.contiguous(), "key_mask": torch.ones(rows, window, dtype=torch.bool),
              "block_index": torch.arange(inside, inside + block), "count": torch.ones(rows, **long),
              "threshold": torch.full((rows,), 0.9, **real), "factor": torch.zeros(rows, **real),
              "temperature": torch.zeros(rows, **real), "seed": torch.zeros(rows, **long),
              "step": torch.zeros(rows, **long), "measure": torch.full((rows,), MEASURE_CODES["prob"], **long),
              "edit_threshold": torch.full((rows,), float("inf"), **real),
              "prompt_lengths": torch.full((rows,), case.input_len, **long)}
    if shapes.kind.cached:
        cached = torch.arange(shapes.canvas)
        outside = (cached < shapes.window_start) | (cached >= shapes.window_start + window)
        inputs.update(past_positions=cached.expand(rows, -1).contiguous(),
                      past_key_mask=outside.expand(rows, -1).contiguous())
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
    made = dict(dtype=model.dtype, device=device)
    if shapes.kind.cached:
        inputs["past_kv"] = torch.zeros(model.num_layers, 2, rows, model.num_kv_heads, shapes.canvas, model.head_dim,
                                        **made)
    if model.residual_config is not None:
        inputs.update(z=torch.zeros(rows, window, model.hidden_size, **made),
                      certainty=torch.zeros(rows, window, **made))
    return inputs
