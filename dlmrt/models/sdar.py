"""The SDAR family (`SDARForCausalLM`, model_type `sdar`): SDAR-1.7B/4B/8B-Chat and their fine-tunes.

A Qwen3 stack (`dlmrt.models.qwen`) run as a block diffusion model: RMSNorm, SwiGLU,
full rotary embeddings (rotate_half), GQA with an explicit `head_dim` (not hidden_size / heads
in SDAR-4B), and an RMSNorm over each query and key head (`q_norm`, `k_norm`) before the
rotary embedding.
Attention is block-causal: bidirectional inside a block, causal across the blocks of the
absolute grid `position // block_length`, as the public generate builds its mask. The logits
are not shifted: position j's logits predict token j. Modules sit under the public
checkpoints' tensor names (`model.layers.{i}.self_attn.q_norm.weight`, ...).

config.json fields:
- used: the sizes (`hidden_size`, `intermediate_size`, `num_hidden_layers`, `num_attention_heads`,
  `num_key_value_heads` (null: as many as the query heads), `head_dim`, `vocab_size`,
  `max_position_embeddings`), `rms_norm_eps`, `rope_theta`, `tie_word_embeddings`,
  `attention_bias` (biases on the query, key, value and output projections), and `block_size`,
  the grid when a call gives none (4, the public generate's default, when absent);
- refused unless neutral (they change the math and dlmrt does not implement them):
  `rope_scaling` (must be null), `use_sliding_window` (must be false), `hidden_act` (must be
  silu), `partial_rotary_factor` (must be 1), `num_experts` (must be absent, null or 0: the MoE
  SDAR variants are not implemented);
- accepted and ignored: `sliding_window` and `max_window_layers` (only read with a sliding
  window), `attention_dropout`, `initializer_range`, `use_cache`, `attn_implementation`,
  `fuse_cross_entropy`, `micro_forward`, `skip_checkpoint`, `ep_size`, `use_deepep`, `debug`
  (training or kernel choices only), `pad_token_id` (the embedding's padding_idx only affects
  training), and the special token ids, which the loader reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dlmrt.core import limits
from dlmrt.models import config as config_parsing
from dlmrt.models.denoiser import SpecialTokens
from dlmrt.models import qwen
from dlmrt.models.qwen import QwenConfig, QwenDenoiser, parameter_count
from dlmrt.models.residual import ResidualConfig

__all__ = ["SDAR", "SDARConfig", "parse_config", "parameter_count"]

DEFAULT_BLOCK_SIZE = 4  # the public generate's default block length


@dataclass(frozen=True, kw_only=True)
class SDARConfig(QwenConfig):
    num_key_value_heads: int | None = field()  # required: the public code has no safe default
    head_dim: int
    attention_bias: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def head_size(self) -> int:
        return self.head_dim


# Config values that select architecture variants dlmrt does not implement.
SUPPORTED_FEATURES = {**qwen.SUPPORTED_FEATURES, "num_experts": (None, 0)}


def parse_config(raw: dict, source: str) -> SDARConfig:
    c = config_parsing.parse(SDARConfig, raw, source, SUPPORTED_FEATURES)
    config_parsing.require_sizes(c, source, {
        "hidden_size": limits.MAX_WIDTH, "intermediate_size": limits.MAX_WIDTH,
        "num_hidden_layers": limits.MAX_LAYERS, "num_attention_heads": limits.MAX_HEADS,
        "kv_heads": limits.MAX_HEADS, "head_dim": limits.MAX_WIDTH, "vocab_size": limits.MAX_VOCAB,
        "max_position_embeddings": limits.MAX_POSITIONS, "block_size": limits.MAX_POSITIONS})
    config_parsing.require_norm_and_rope(c, source)
    config_parsing.require_divisible(source, "num_attention_heads", c.num_attention_heads,
                                     "num_key_value_heads", c.kv_heads)
    config_parsing.require(c.head_dim % 2 == 0, source, f"head_dim ({c.head_dim}) must be even for rotary embeddings")
    return c


class SDAR(QwenDenoiser):
    """Qwen3 blocks: RMSNorm over each query and key head; `attention_bias` puts biases on all
    four projections."""

    model_type = "sdar"
    block_causal = True
    default_block_length = DEFAULT_BLOCK_SIZE  # per model: the config's block_size
    head_norms = True

    def __init__(self, config: SDARConfig, residual_config: ResidualConfig | None,
                 tokens: SpecialTokens | None):
        self.qkv_bias = self.output_bias = config.attention_bias
        super().__init__(config, residual_config, tokens)
        self.default_block_length = config.block_size
