"""ModelSpec: what the loop knows of the model behind a backend.

It holds the model's description (`dlmrt.models.description.ModelDescription`) and special token ids
as the denoiser or the export's manifest gives them, and beside them only what is the runtime's own:
the device, the positions a step may reach here, how to lift a compiled backend's limits, what the
graphs support, and how many ranks the vocabulary is split over. It is built here alone: `of_model`
for a torch model, `of_export` for an export directory.

The loop reads the description's fields through the spec (`spec.vocab_size`, `spec.mask_id`, ...),
one way for every caller, so no caller needs to know which part of the spec holds a field.
`max_positions` is the runtime's own: the model's context for a torch model, but the length an
export was made for (its manifest's `limits.max_length`) for an export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dlmrt.models.description import ModelDescription, SpecialTokens

if TYPE_CHECKING:
    from pathlib import Path

    from dlmrt.export.export_manifest import ExportManifest
    from dlmrt.models.denoiser import Denoiser


@dataclass(frozen=True)
class ModelSpec:
    model: ModelDescription
    tokens: SpecialTokens
    device: torch.device
    max_positions: int  # the longest canvas a step may cover on this backend
    limits_hint: str = ""  # how to lift the limits of what a compiled backend was built for
    supports_guidance: bool = True
    supports_editing: bool = True  # the graphs take token editing's inputs (exports before it do not)
    supports_logprobs: bool = True  # the step graphs can return the block's logits (exports before it cannot)
    # Ranks the vocabulary is split over (tensor parallelism): each holds its slice of the logits, never the whole
    vocab_ranks: int = 1

    @classmethod
    def of_model(cls, model: Denoiser) -> ModelSpec:
        """The spec of a torch model."""
        if model.tokens is None:
            raise ValueError(f"{model.name} has no special token ids (mask/eos/pad): load it with "
                             f"dlmrt.load or give them to the model")
        tokens = model.tokens
        return cls(model=model.description, tokens=SpecialTokens(tokens.mask_id, tuple(tokens.eos_ids), tokens.pad_id),
                   device=model.device, max_positions=model.max_positions,
                   vocab_ranks=1 if model.vocab_shard is None else model.vocab_shard.ranks.world)

    @classmethod
    def of_export(cls, manifest: ExportManifest, export_dir: Path, device: torch.device) -> ModelSpec:
        """The spec of the graphs in an export directory, from its manifest alone."""
        return cls(model=manifest.model, tokens=manifest.tokens, device=device,
                   max_positions=manifest.limits.max_length,
                   limits_hint=f"re-export with `dlmrt export ... -o {export_dir} --max-batch B --max-length N`",
                   supports_guidance=manifest.supports_guidance, supports_editing=manifest.supports_editing,
                   supports_logprobs=manifest.supports_logprobs)

    # -- the description's fields, read through the spec ----------------------------------------------
    @property
    def name(self) -> str:
        return self.model.name

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.model.dtype)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.model.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.head_dim

    @property
    def block_causal(self) -> bool:
        return self.model.block_causal

    @property
    def block_grid(self) -> int | None:
        """The block-causal grid a compiled graph was built with (None: any)."""
        return self.model.block_grid

    @property
    def has_residual(self) -> bool:
        return self.model.residual

    @property
    def logits_shift(self) -> int:
        """Denoiser.logits_shift: a window over a cache starts this many positions early."""
        return self.model.logits_shift

    @property
    def noise(self) -> str:
        """Denoiser.noise: "uniform" for models with no mask token (DiffusionGemma)."""
        return self.model.noise

    # -- the special token ids -------------------------------------------------------------------------
    @property
    def mask_id(self) -> int | None:
        """None for uniform-noise models."""
        return self.tokens.mask_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.tokens.eos_ids

    @property
    def pad_id(self) -> int:
        return self.tokens.pad_id
