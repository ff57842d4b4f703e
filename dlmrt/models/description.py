"""One description of a model, read by the export manifest and by the runtime.

`ModelDescription` holds what the denoiser, an export's manifest (`dlmrt.json`'s `model` section) and
the runtime's `ModelSpec` share: sizes, dtype, block grid, noise kind and the family's flags.
`SpecialTokens` holds the special token ids beside it (the manifest keeps them in a section of their
own). Who makes one:

- a denoiser, from its attributes as they stand (`Denoiser.description`): the loader names a model
  after its directory and `.to()` casts it after it was built, so nothing is cached;
- an export, from its manifest (`dlmrt.export.export_manifest`), which stores the description it was
  given and reads the same one back;
- the runtime never makes one: `dlmrt.runtime.model_spec.ModelSpec` holds it, with what is the
  runtime's own (device, limits, the graphs' capabilities).

Decisions:

- `dtype` is torch's name ("float32", "bfloat16"), the form the manifest writes and the build
  pipeline compares; the runtime converts it where it allocates (`ModelSpec.dtype`).
- `block_grid` is None for a torch model, which takes any grid per call; an export of a
  block-causal model fixes it (`dataclasses.replace(description, block_grid=...)`).
- `logits_shift` is the family's (Dream: 1). The manifest does not write it, so that its format stays
  as it was; it reads it back from the family of `model_type`.
- The field order is the manifest's key order.

This module imports nothing of dlmrt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

NOISE_KINDS = ("mask", "uniform")


class SpecialTokens(NamedTuple):
    mask_id: int | None  # None for uniform-noise families, which have no mask token
    eos_ids: tuple[int, ...]
    pad_id: int


@dataclass(frozen=True)
class ModelDescription:
    name: str
    model_type: str  # config.json's, the key of `dlmrt.models.FAMILIES`
    dtype: str  # torch's name: "float32", "bfloat16", ...
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int  # the model's context
    block_causal: bool
    block_grid: int | None  # the block length built into a block-causal export's graphs; None: any
    residual: bool  # an ORL model: its steps carry z and certainty
    noise: str = "mask"  # "uniform": a model with no mask token (DiffusionGemma)
    canvas_length: int | None = None  # a uniform-noise model's own canvas (its default block length)
    logits_shift: int = 0  # how many positions before its own a position's raw logits sit
