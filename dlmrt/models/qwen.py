"""The Qwen2/Qwen3 stack that the Qwen-based families share (Dream, SDAR).

RMSNorm, SwiGLU, full rotary embeddings (rotate_half) and GQA, under the public checkpoints'
tensor names (`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`, `mlp.gate_proj`,
`input_layernorm`, `post_attention_layernorm`, `model.norm`, `lm_head`). What differs between
the families is the attention's options: which projections have biases, and Qwen3's RMSNorm over
each query and key head. A family's config extends `QwenConfig`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from dlmrt.core.errors import UnsupportedFeatureError
from dlmrt.models.denoiser import Denoiser, SpecialTokens
from dlmrt.models.layers import PreNormLayer, RMSNorm, SwiGLU, apply_rotary, attend, output_logits, with_past
from dlmrt.models.residual import ResidualConfig


@dataclass(frozen=True, kw_only=True)
class QwenConfig:
    """The config.json fields the Qwen-based families name alike. A family's config adds its own and a
    `head_size` property, how wide its heads are: Dream derives it, SDAR reads head_dim."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None  # None: as many as the query heads (the public default)
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads if self.num_key_value_heads is not None else self.num_attention_heads

# Config values that select Qwen variants dlmrt does not implement; a family's list adds its own.
SUPPORTED_FEATURES = {
    "use_sliding_window": (False,),
    "rope_scaling": (None,),
    "hidden_act": ("silu",),
    "partial_rotary_factor": (1.0, 1),
}


def parameter_count(c: QwenConfig) -> int:
    """The weights of the embedding, the head and the layers' matrices (norms and biases left out)."""
    heads, kv, head = c.num_attention_heads, c.kv_heads, c.head_size
    attention = c.hidden_size * (heads + 2 * kv) * head + heads * head * c.hidden_size
    layer = attention + 3 * c.hidden_size * c.intermediate_size
    return c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.num_hidden_layers * layer


class Attention(nn.Module):
    def __init__(self, c: QwenConfig, *, qkv_bias: bool, output_bias: bool, head_norms: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.kv_heads, c.head_size
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=output_bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if head_norms else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if head_norms else nn.Identity()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        batch, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, length, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys, values = with_past(k, v, past)
        return self.o_proj(attend(q, keys, values, mask)), (k, v)


class QwenDenoiser(Denoiser):
    """A Qwen stack as a denoiser; a family gives its attention's options."""

    supports_residual_context = False
    qkv_bias: bool
    output_bias: bool
    head_norms: bool

    def __init__(self, config: QwenConfig, residual_config: ResidualConfig | None, tokens: SpecialTokens | None):
        super().__init__(config, residual_config, tokens)
        c = config
        self.hidden_size, self.num_layers = c.hidden_size, c.num_hidden_layers
        self.num_kv_heads, self.head_dim = c.kv_heads, c.head_size
        self.rotary_dim, self.rope_theta = c.head_size, c.rope_theta
        self.max_positions = c.max_position_embeddings
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList(self._layer(c) for _ in range(c.num_hidden_layers))
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def _layer(self, c: QwenConfig) -> PreNormLayer:
        attention = Attention(c, qkv_bias=self.qkv_bias, output_bias=self.output_bias, head_norms=self.head_norms)
        return PreNormLayer(c.hidden_size, c.rms_norm_eps, "self_attn", attention,
                            SwiGLU(c.hidden_size, c.intermediate_size))

    def input_embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def residual_adapter(self) -> nn.Module:
        raise UnsupportedFeatureError(f"the {self.model_type} family has no residual pathway")

    def blocks(self) -> Sequence[nn.Module]:
        return self.model.layers

    def head(self, hidden: Tensor) -> Tensor:
        lm_head = None if self.config.tie_word_embeddings else self.lm_head
        return output_logits(hidden, self.model.norm, self.model.embed_tokens, lm_head)
