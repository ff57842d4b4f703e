"""On-policy rollouts: the current model decodes training prompts with dlmrt's own step loop (the
Generator over an eager TorchBackend), and every step's input is recorded as the step consumed it:
the canvas, positions and key mask, the block it decides on, and for an ORL model the exact `z` and
certainty it was given. Only the states of rows whose output is verified right are kept
(`dlmrt.core.tasks.is_correct`), and their targets are that output: for a task with several right
answers, the one this rollout chose.

Each kept state also carries the source entropy of the adjacent-entropy-contraction term: at every
position, the entropy of the prediction the row's previous step made there (NaN before a row's first
step). For an ORL model that is the step whose `z` this step consumed.

Rollouts run on one fixed bucket (canvas x `batch`): extra left padding and padded rows are inert
(`dlmrt.runtime.device_state`), so every state has the same shape and batches of states stack.
`ignore_eos` keeps every row in its bucket row until the end, which is what ties a recorded row to
its prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from dlmrt.models import Denoiser, Residual
from dlmrt.runtime import GenerationSettings, Generator, text
from dlmrt.runtime import layout as layouts
from dlmrt.runtime.torch_backend import TorchBackend
from dlmrt.core.tasks import Example, is_correct

IGNORE = -100  # cross-entropy's ignore index: positions with no target


@dataclass
class States:
    """Recorded step inputs, one row per (verified example, step it did work in)."""

    ids: Tensor  # [N, T] the canvas the step saw
    positions: Tensor  # [N, T]
    key_mask: Tensor  # [N, T]
    block: Tensor  # [N, block] canvas indices of the block the step decided on
    source_entropy: Tensor  # [N, T] nats; NaN where the row had no previous step
    targets: Tensor  # [N, T] the right output at output positions, IGNORE elsewhere
    z: Tensor | None = None  # [N, T, H], ORL models only
    certainty: Tensor | None = None  # [N, T]

    def __len__(self) -> int:
        return self.ids.shape[0]

    def select(self, index: Tensor) -> States:
        return States(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                         for f in fields(self)})

    def residual(self) -> Residual | None:
        return None if self.z is None else Residual(self.z, self.certainty)


@dataclass(frozen=True)
class RolloutResult:
    states: States
    exact_match: float  # of all rolled-out rows
    tpf: float  # tokens per forward of the rollout


def entropy(logits: Tensor) -> Tensor:
    """Entropy in nats of softmax(logits) over the last dimension, in float32."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


class _Recorder:
    """The backend's `observe` callback: keeps each step's inputs and the entropy of its prediction.

    It runs its own forward for that entropy: the step graph returns logits for the block only (the
    next block's first step needs what was predicted there) and a certainty for ORL models only."""

    def __init__(self, model: Denoiser):
        self.model = model
        self.steps: list[dict[str, Tensor]] = []

    @torch.no_grad()
    def __call__(self, inputs: Mapping[str, Tensor]) -> None:
        step = {name: inputs[name].clone() for name in ("ids", "positions", "key_mask", "block_index")}
        residual = None
        if "z" in inputs:
            step["z"], step["certainty"] = inputs["z"].clone(), inputs["certainty"].clone()
            residual = Residual(step["z"], step["certainty"])
        logits = self.model.denoise(step["ids"], positions=step["positions"], key_mask=step["key_mask"],
                                    residual=residual).logits
        step["entropy"] = entropy(logits)
        self.steps.append(step)


def rollout(model: Denoiser, examples: Sequence[Example], settings: GenerationSettings, *, batch: int,
            canvas: int | None = None) -> RolloutResult:
    """Decode `examples` (at most `batch` at a time) with `settings` and keep the verified rows' states,
    all on one canvas of `canvas` positions (default: the fewest whole blocks that hold every prompt)."""
    settings = replace(settings, ignore_eos=True)
    prompts = [text.encode(model, e.prompt) for e in examples]
    if canvas is None:
        needed = layouts.canvas_length(prompts, settings.gen_length, settings.block_length,
                                       block_causal=model.block_causal)
        canvas = -(-needed // settings.block_length) * settings.block_length
    recorder = _Recorder(model)
    generator = Generator(TorchBackend(model, mode="eager", batch_sizes=(batch,), canvas_lengths=(canvas,),
                                       max_batch=batch, max_length=canvas, observe=recorder))
    chunks, right, generated, forwards = [], 0, 0, 0
    for start in range(0, len(examples), batch):
        recorder.steps = []
        result = generator.generate(prompts[start:start + batch], settings)
        outputs = [row.token_ids for row in result.rows]
        verified = torch.tensor([is_correct(e, text.decode(model, ids))
                                 for e, ids in zip(examples[start:start + batch], outputs)])
        right += int(verified.sum())
        generated += result.metrics.generated_tokens
        forwards += result.metrics.sequence_forwards
        chunks.append(_states(model, recorder.steps, outputs, verified, settings.gen_length))
    states = States(**{f.name: None if getattr(chunks[0], f.name) is None
                       else torch.cat([getattr(c, f.name) for c in chunks]) for f in fields(States)})
    return RolloutResult(states, right / len(examples), generated / max(forwards, 1))


def _states(model: Denoiser, steps: list[dict[str, Tensor]], outputs: Sequence[Sequence[int]], verified: Tensor,
            gen_length: int) -> States:
    """The kept states; a row's targets are its output up to end-of-sequence, then EOS."""
    rows = len(outputs)
    canvas = steps[0]["ids"].shape[1]
    mask_id, eos_id = model.tokens.mask_id, model.tokens.eos_ids[0]
    targets = torch.full((rows, canvas), IGNORE, dtype=torch.long)
    for row, output in enumerate(outputs):
        if verified[row]:
            targets[row, canvas - gen_length:] = torch.tensor([*output, *[eos_id] * (gen_length - len(output))])
    previous = torch.full((rows, canvas), float("nan"))
    kept: dict[str, list[Tensor]] = {f.name: [] for f in fields(States)}
    for step in steps:
        ids = step["ids"][:rows]
        block = step["block_index"].expand(rows, -1)
        active = (ids.gather(1, block) == mask_id).any(1)
        keep = active & verified
        recorded = {"ids": ids, "positions": step["positions"][:rows], "key_mask": step["key_mask"][:rows],
                    "block": block, "source_entropy": previous, "targets": targets}
        if "z" in step:
            recorded.update(z=step["z"][:rows], certainty=step["certainty"][:rows])
        for name, value in recorded.items():
            kept[name].append(value[keep])
        previous = torch.where(active[:, None], step["entropy"][:rows], previous)
    return States(**{name: torch.cat(values) if values else None for name, values in kept.items()})
