"""The ORL residual-context pathway, shared by every family.

An ORL denoiser carries, for each position, the residual `z` of its last
prediction from one step to the next:

    z_i = sum_v p_i(v) E[v]          (optionally over the top-k of p_i, renormalized)
    w_i = 1 - H(p_i) / log V          (certainty from the normalized entropy)

and a still-masked position's input becomes `E[mask] + w_i * A(z_i)`, where
`A` is a small adapter whose output layer starts at zero. Before the first
step there is no residual (z = 0, w = 0), so the input is plain `E[mask]`;
with the pathway off the model is exactly its base model.

Switched on by a `residual_context` object in config.json:

    "residual_context": {"adapter": "mlp", "adapter_hidden_size": 64, "topk": 0}

Adapters live in `ADAPTERS`; register another beside `mlp` and `linear`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlmrt.core.errors import CheckpointError, UnsupportedFeatureError
from dlmrt.models import config as config_parsing
from dlmrt.ops.residual_context import torch_op  # noqa: F401  (registers torch.ops.dlmrt.residual_context)
from dlmrt.ops.residual_context.reference import distribution, residual_context


class Residual(NamedTuple):
    """Loop state of an ORL model: what each position predicted at the last step."""

    z: Tensor  # [B, T, H] probability-weighted token embedding
    certainty: Tensor  # [B, T] 1 - H(p) / log V, in [0, 1]


@dataclass(frozen=True)
class ResidualConfig:
    adapter: str = "mlp"
    adapter_hidden_size: int | None = None  # mlp only; defaults to hidden_size // 4
    topk: int = 0  # 0: the full distribution


class MLPAdapter(nn.Module):
    """`A(z) = out_proj(silu(in_proj(z)))` (tensors `in_proj.weight` [a, H], `out_proj.weight` [H, a])."""

    def __init__(self, hidden_size: int, config: ResidualConfig):
        super().__init__()
        inner = config.adapter_hidden_size or max(1, hidden_size // 4)
        self.in_proj = nn.Linear(hidden_size, inner, bias=False)
        self.out_proj = nn.Linear(inner, hidden_size, bias=False)

    def output_layer(self) -> nn.Linear:
        return self.out_proj

    def forward(self, z: Tensor) -> Tensor:
        return self.out_proj(F.silu(self.in_proj(z)))


class LinearAdapter(nn.Module):
    """`A(z) = proj(z)` (tensor `proj.weight` [H, H])."""

    def __init__(self, hidden_size: int, config: ResidualConfig):
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def output_layer(self) -> nn.Linear:
        return self.proj

    def forward(self, z: Tensor) -> Tensor:
        return self.proj(z)


ADAPTERS: dict[str, type[nn.Module]] = {"mlp": MLPAdapter, "linear": LinearAdapter}


def parse_config(raw: object, source: str) -> ResidualConfig | None:
    """The `residual_context` entry of config.json, or None when the pathway is off."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: field 'residual_context' must be an object or null, "
                              f"got {json.dumps(raw)}")
    config = config_parsing.parse(ResidualConfig, raw, f"{source} (residual_context)")
    if config.adapter not in ADAPTERS:
        raise UnsupportedFeatureError(
            f"{source}: residual_context.adapter={config.adapter!r} is not a known adapter "
            f"(known: {', '.join(sorted(ADAPTERS))})")
    config_parsing.require(config.topk >= 0, source, "residual_context.topk must be >= 0")
    return config


def build_adapter(config: ResidualConfig, hidden_size: int) -> nn.Module:
    return ADAPTERS[config.adapter](hidden_size, config)


def mix(embeds: Tensor, is_masked: Tensor, residual: Residual | None, adapter: nn.Module) -> Tensor:
    """Add `w * A(z)` to the (mask) embedding of each still-masked position."""
    if residual is None:
        return embeds
    update = residual.certainty[..., None].to(embeds.dtype) * adapter(residual.z.to(embeds.dtype))
    return torch.where(is_masked[..., None], embeds + update, embeds)


def next_residual(logits: Tensor, embedding: Tensor, topk: int) -> Residual:
    """The residual this step hands to the next, from its logits `[B, T, V]` and `E` `[V, H]`.

    Over the full distribution this is `dlmrt::ResidualContext`; while exporting it is that op (one
    node in the graph, a TensorRT plugin in an engine), in eager torch its reference, so that eager
    runs keep autograd and plain torch ops. The top-k variant stays in standard ops."""
    if not topk or topk >= logits.shape[-1]:
        if torch.compiler.is_exporting():
            return Residual(*torch.ops.dlmrt.residual_context(logits, embedding))
        return Residual(*residual_context(logits, embedding))
    p, certainty = distribution(logits)
    top_p, top_ids = p.topk(topk, dim=-1)
    top_p = top_p / top_p.sum(-1, keepdim=True)
    z = torch.einsum("btk,btkh->bth", top_p, embedding.float()[top_ids])
    return Residual(z.to(embedding.dtype), certainty.to(embedding.dtype))
