"""Denoiser families, registered by Hugging Face `model_type`.

`build` makes a family's module tree on the meta device (no weights, nothing
random) for the loader to fill; `create` makes a randomly initialized model,
for training a new one and for tests. Add a family by adding a row to FAMILIES.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dlmrt.errors import CheckpointError, UnsupportedFeatureError
from dlmrt.export.models import llada, llada2_moe, residual
from dlmrt.export.models.denoiser import Denoiser, DenoiserOutput, PastKV, SpecialTokens
from dlmrt.export.models.layers import RMSNorm
from dlmrt.export.models.residual import Residual

__all__ = ["FAMILIES", "Denoiser", "DenoiserOutput", "Family", "PastKV", "Residual", "SpecialTokens",
           "build", "create", "family_of"]


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the Hugging Face class in config.json's "architectures"
    parse_config: Callable[[dict, str], Any]
    model_class: type[Denoiser]


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llada", "LLaDAModelLM", llada.parse_config, llada.LLaDA),
    Family("llada2_moe", "LLaDA2MoeModelLM", llada2_moe.parse_config, llada2_moe.LLaDA2Moe),
)}


def family_of(raw: Mapping[str, Any], source: str) -> Family:
    model_type = raw.get("model_type")
    if model_type is None:
        raise CheckpointError(f"{source}: required field 'model_type' is missing "
                              f"(expected one of: {', '.join(FAMILIES)})")
    if model_type not in FAMILIES:
        raise UnsupportedFeatureError(f"{source}: model_type {model_type!r} is not supported "
                                      f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def build(raw: Mapping[str, Any], source: str, tokens: SpecialTokens | None) -> Denoiser:
    """The family's module tree on the meta device, config checked; weights come from the loader."""
    family = family_of(raw, source)
    config = family.parse_config(dict(raw), source)
    residual_config = residual.parse_config(raw.get("residual_context"), source)
    if residual_config is not None and tokens is None:
        raise CheckpointError(f"{source}: residual_context needs the mask token id (set mask_token_id)")
    with torch.device("meta"):
        model = family.model_class(config, residual_config, tokens)
    if tokens is not None:
        for name, value in (("mask", tokens.mask_id), ("pad", tokens.pad_id),
                            *(("eos", e) for e in tokens.eos_ids)):
            if not 0 <= value < model.vocab_size:
                raise CheckpointError(f"{source}: the {name} token id {value} lies outside the "
                                      f"vocabulary [0, {model.vocab_size})")
    model.raw_config = dict(raw)
    return model


def create(raw: Mapping[str, Any], *, tokens: SpecialTokens | None = None, seed: int = 0,
           dtype: torch.dtype = torch.float32, init_std: float = 0.02, device: str | torch.device = "cpu") -> Denoiser:
    """A new model with random weights (normal(0, init_std) matrices, unit norms, zero adapter output),
    initialized on `device` (seeded per device: a CUDA model is not the CPU model moved).

    Only for training, tests and benchmarks: loading a checkpoint never initializes randomly.
    """
    model = build(raw, "config", tokens)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, init_std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, llada2_moe.Router):
                module.expert_bias.zero_()
        if model.residual_config is not None:
            model.residual_adapter().output_layer().weight.zero_()
    return model.to(dtype).eval()
