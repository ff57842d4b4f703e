"""The Dream family (`DreamModel`, model_type `Dream`): Dream-v0 and its fine-tunes.

A bidirectional Qwen2 encoder (`dlmrt.models.qwen`): RMSNorm, SwiGLU, full rotary
embeddings (rotate_half), GQA, biases on the query, key and value projections only.

Dream was adapted from an autoregressive model and keeps its output alignment: the raw
logits at position j predict token j + 1. `Dream.denoise` shifts them back by one, so that
like every family it returns the logits that predict each position's own token.

config.json fields, beyond the sizes and `rms_norm_eps`, `rope_theta`, `tie_word_embeddings`:
- refused unless neutral (they change the math and dlmrt does not implement them):
  `use_sliding_window` (must be false), `rope_scaling` (must be null), `hidden_act` (must be
  silu), `partial_rotary_factor` (must be 1), `head_dim` (must be hidden_size / heads when set;
  transformers' rotary reads both);
- accepted and ignored: `sliding_window` and `max_window_layers` (only read with a sliding
  window), `attention_dropout` (training only), `initializer_range` (initialization only),
  `use_cache`, `pad_token_id` (the embedding's padding_idx only affects training), and the
  special token ids, which the loader reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from dlmrt.core import limits
from dlmrt.core.errors import UnsupportedFeatureError
from dlmrt.models import config as config_parsing
from dlmrt.models.denoiser import DenoiserOutput
from dlmrt.models import qwen
from dlmrt.models.qwen import QwenConfig, QwenDenoiser, parameter_count

__all__ = ["Dream", "DreamConfig", "parse_config", "parameter_count"]


@dataclass(frozen=True, kw_only=True)
class DreamConfig(QwenConfig):
    head_dim: int | None = None

    @property
    def dim_per_head(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.dim_per_head


# Config values that select architecture variants dlmrt does not implement.
SUPPORTED_FEATURES = qwen.SUPPORTED_FEATURES


def parse_config(raw: dict, source: str) -> DreamConfig:
    c = config_parsing.parse(DreamConfig, raw, source, SUPPORTED_FEATURES)
    config_parsing.require_sizes(c, source, {
        "hidden_size": limits.MAX_WIDTH, "intermediate_size": limits.MAX_WIDTH,
        "num_hidden_layers": limits.MAX_LAYERS, "num_attention_heads": limits.MAX_HEADS,
        "kv_heads": limits.MAX_HEADS, "vocab_size": limits.MAX_VOCAB,
        "max_position_embeddings": limits.MAX_POSITIONS})
    config_parsing.require_norm_and_rope(c, source)
    config_parsing.require_divisible(source, "hidden_size", c.hidden_size, "num_attention_heads", c.num_attention_heads)
    config_parsing.require_divisible(source, "num_attention_heads", c.num_attention_heads,
                                     "num_key_value_heads", c.kv_heads)
    config_parsing.require(c.dim_per_head % 2 == 0, source,
                           "the head size hidden_size / num_attention_heads must be even for rotary embeddings")
    if c.head_dim is not None and c.head_dim != c.dim_per_head:
        raise UnsupportedFeatureError(
            f"{source}: head_dim={c.head_dim} is not supported by dlmrt: Dream's heads are hidden_size / "
            f"num_attention_heads = {c.dim_per_head} wide; remove head_dim or set it to {c.dim_per_head}")
    return c


def shifted_index(window_index: Tensor, shift: int) -> Tensor:
    """Which raw window position holds the logits of each wanted window position: `shift` before
    it, clamped to the window's first (the public Dream generate repeats position 0's logits)."""
    return (window_index - shift).clamp(min=0)


class Dream(QwenDenoiser):
    """Qwen2 blocks: biases on the query, key and value projections, no head norms. No residual
    pathway: the residual would have to follow the shifted logits."""

    model_type = "Dream"
    qkv_bias, output_bias, head_norms = True, False, False
    # The raw logits at position j predict token j + logits_shift. `denoise` returns them shifted
    # back, clamped at the window's start, which is exact when the window starts at the sequence's
    # start (position 0, padding included). Under a cached prefix, the first window position's
    # logits need the raw logits of the position before the window: a caller must start the
    # window `logits_shift` positions before the first position whose logits it reads.
    logits_shift: ClassVar[int] = 1

    def denoise(self, input_ids: Tensor, *, logits_range: tuple[int, int] | None = None,
                logits_index: Tensor | None = None, **kwargs: Any) -> DenoiserOutput:
        """As `Denoiser.denoise`, with each returned position's logits taken from the raw
        logits `logits_shift` positions before it (see the class's note on cached prefixes)."""
        if logits_index is None:
            start, end = logits_range or (0, input_ids.shape[1])
            logits_index = torch.arange(input_ids.shape[1], device=input_ids.device)[start:end]
        return super().denoise(input_ids, logits_index=shifted_index(logits_index, self.logits_shift), **kwargs)
