"""Denoiser families, registered by Hugging Face `model_type`.

`build` makes a family's module tree on the meta device (no weights, nothing
random) for the loader to fill; `create` makes a randomly initialized model,
for training a new one and for tests. Add a family by adding a row to FAMILIES.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dlmrt.core import limits
from dlmrt.core.errors import CheckpointError, UnsupportedFeatureError
from dlmrt.models import diffusion_gemma, dream, experts, llada, llada2_moe, residual, sdar
from dlmrt.models.denoiser import Denoiser, DenoiserOutput, PastKV, SpecialTokens
from dlmrt.models.layers import RMSNorm
from dlmrt.models.residual import Residual

__all__ = ["FAMILIES", "Denoiser", "DenoiserOutput", "Family", "PastKV", "Residual", "SpecialTokens",
           "build", "create", "family_of"]


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the Hugging Face class in config.json's "architectures"
    parse_config: Callable[[dict, str], Any]
    model_class: type[Denoiser]
    parameter_count: Callable[[Any], int]  # of a parsed config: what the weights' memory is estimated from


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llada", "LLaDAModelLM", llada.parse_config, llada.LLaDA, llada.parameter_count),
    Family("llada2_moe", "LLaDA2MoeModelLM", llada2_moe.parse_config, llada2_moe.LLaDA2Moe,
           llada2_moe.parameter_count),
    Family("Dream", "DreamModel", dream.parse_config, dream.Dream, dream.parameter_count),
    Family("sdar", "SDARForCausalLM", sdar.parse_config, sdar.SDAR, sdar.parameter_count),
    Family("diffusion_gemma", "DiffusionGemmaForBlockDiffusion", diffusion_gemma.parse_config,
           diffusion_gemma.DiffusionGemma, diffusion_gemma.parameter_count),
)}


def family_of(raw: Mapping[str, Any], source: str) -> Family:
    model_type = raw.get("model_type")
    if model_type is None:
        raise CheckpointError(f"{source}: required field 'model_type' is missing "
                              f"(expected one of: {', '.join(FAMILIES)})")
    if not isinstance(model_type, str):
        raise CheckpointError(f"{source}: field 'model_type' must be a string (one of: {', '.join(FAMILIES)}), "
                              f"got {type(model_type).__name__}")
    if model_type not in FAMILIES:
        raise UnsupportedFeatureError(f"{source}: model_type {model_type[:80]!r} is not supported "
                                      f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


_INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                 "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


@contextlib.contextmanager
def _initializers_skipped():
    """nn.init's fills made no-ops while a tree is built on the meta device, which holds no values to fill.
    A random fill of a meta tensor runs through torch's Python references, which import torch._dynamo:
    0.9 s of every command's start, where eager decoding never needs it."""
    saved = {name: getattr(nn.init, name) for name in _INITIALIZERS}
    try:
        for name in _INITIALIZERS:
            setattr(nn.init, name, _unfilled)
        yield
    finally:
        for name, initializer in saved.items():
            setattr(nn.init, name, initializer)


def _unfilled(tensor, *args, **kwargs):
    return tensor


def build(raw: Mapping[str, Any], source: str, tokens: SpecialTokens | None, *,
          dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
          token_origins: Mapping[str, str] | None = None) -> Denoiser:
    """The family's module tree on the meta device, config checked, and refused before it is built
    when its weights in `dtype` cannot fit on `device`; weights come from the loader. `token_origins`
    says where each special id came from ("mask", "eos", "pad" -> a file), for the errors."""
    family = family_of(raw, source)
    config = family.parse_config(dict(raw), source)
    residual_config = residual.parse_config(raw.get("residual_context"), source)
    if residual_config is not None and not family.model_class.supports_residual_context:
        raise UnsupportedFeatureError(f"{source}: the {family.model_type} family has no residual pathway, but "
                                      f"config.json sets residual_context; remove it")
    weights = family.parameter_count(config) * torch.tensor([], dtype=dtype).element_size()
    limits.check_fits(weights, f"{source}: the model's weights in {str(dtype).removeprefix('torch.')}", device,
                      f"load it in a smaller dtype (--dtype bfloat16), on a larger device, or check the config's "
                      f"sizes (or set {limits.MEMORY_LIMIT_VARIABLE})")
    if residual_config is not None and tokens is None:
        raise CheckpointError(f"{source}: residual_context needs the mask token id (set mask_token_id)")
    with torch.device("meta"), _initializers_skipped():
        model = family.model_class(config, residual_config, tokens)
    if tokens is not None:
        origins = token_origins or {}
        for name, value in (("mask", tokens.mask_id), ("pad", tokens.pad_id),
                            *(("eos", e) for e in tokens.eos_ids)):
            if value is not None and not 0 <= value < model.vocab_size:
                raise CheckpointError(f"{origins.get(name, source)}: the {name} token id {value} lies outside the "
                                      f"vocabulary [0, {model.vocab_size}) of {source}")
        clashes = [name for name, value in (("pad", tokens.pad_id), *(("eos", e) for e in tokens.eos_ids))
                   if value == tokens.mask_id]
        if clashes:
            raise CheckpointError(f"{origins.get(clashes[0], source)}: the {' and '.join(dict.fromkeys(clashes))} "
                                  f"token id equals the mask token id {tokens.mask_id}: a masked position would read "
                                  f"as {'padding' if clashes[0] == 'pad' else 'end of sequence'}; set a distinct id")
    model.raw_config = dict(raw)
    return model


def create(raw: Mapping[str, Any], *, tokens: SpecialTokens | None = None, seed: int = 0,
           dtype: torch.dtype = torch.float32, init_std: float = 0.02, device: str | torch.device = "cpu") -> Denoiser:
    """A new model with random weights (normal(0, init_std) matrices, unit norms, zero adapter output),
    initialized on `device` (seeded per device: a CUDA model is not the CPU model moved).

    Only for training, tests and benchmarks: loading a checkpoint never initializes randomly.
    """
    model = build(raw, "config", tokens, device=device)  # initialized in float32, then cast
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.fill_(float("nan"))  # what the loop below misses stays NaN, and is caught after it
        for module in model.modules():
            if isinstance(module, (RMSNorm, diffusion_gemma.GemmaRMSNorm)):
                if module.weight is not None:
                    module.weight.fill_(1.0)
            elif isinstance(module, diffusion_gemma.Router):
                module.scale.fill_(1.0)
                module.per_expert_scale.fill_(1.0)
            elif isinstance(module, diffusion_gemma.Experts):
                module.gate_up_proj.normal_(0.0, init_std, generator=generator)
                module.down_proj.normal_(0.0, init_std, generator=generator)
            elif isinstance(module, experts.SwiGLUExperts):
                for row in range(module.num_experts):  # expert by expert: the draws of one SwiGLU each
                    for name in experts.PROJECTIONS:
                        getattr(module, name).weight[row].normal_(0.0, init_std, generator=generator)
            elif isinstance(module, (nn.Linear, nn.Embedding, llada2_moe.Router)):
                module.weight.normal_(0.0, init_std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
                if isinstance(module, llada2_moe.Router):
                    module.expert_bias.zero_()
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.fill_(1.0)
        if model.residual_config is not None:
            model.residual_adapter().output_layer().weight.zero_()
        missed = [name for name, tensor in model.state_dict().items() if not torch.isfinite(tensor).all()]
        if missed:
            raise RuntimeError(f"models.create left {missed[:5]} uninitialized: a dlmrt bug")
    return model.to(dtype).eval()
