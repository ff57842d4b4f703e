"""The LLaDA family (`LLaDAModelLM`, model_type `llada`): the LLaDA-8B architecture.

A bidirectional Llama-style encoder: RMSNorm, SwiGLU, full rotary embeddings,
MHA or GQA. Modules sit under the public checkpoints' tensor names
(`model.transformer.blocks.{i}.q_proj.weight`, ...), so a LLaDA-8B-Instruct
directory loads unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from dlmrt.core import limits
from dlmrt.models import config as config_parsing
from dlmrt.models.denoiser import Denoiser, SpecialTokens
from dlmrt.models.layers import RMSNorm, apply_rotary, attend, output_logits, query_rows, with_past
from dlmrt.models.residual import ResidualConfig, build_adapter


@dataclass(frozen=True)
class LLaDAConfig:
    d_model: int
    n_heads: int
    n_layers: int
    vocab_size: int
    mlp_hidden_size: int | None = None
    mlp_ratio: int = 4
    n_kv_heads: int | None = None
    multi_query_attention: bool | None = None
    embedding_size: int | None = None
    max_sequence_length: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    weight_tying: bool = False
    include_qkv_bias: bool = False

    @property
    def kv_heads(self) -> int:
        if self.n_kv_heads is not None:
            return self.n_kv_heads
        return 1 if self.multi_query_attention else self.n_heads

    @property
    def mlp_width(self) -> int:
        return self.mlp_hidden_size if self.mlp_hidden_size is not None else self.mlp_ratio * self.d_model


# Config values that select architecture variants dlmrt does not implement.
SUPPORTED_FEATURES = {
    "block_type": ("llama",),
    "activation_type": ("silu",),
    "layer_norm_type": ("rms",),
    "layer_norm_with_affine": (True,),
    "attention_layer_norm": (False,),
    "alibi": (False,),
    "rope": (True,),
    "include_bias": (False,),
    "bias_for_layer_norm": (False, None),
    "scale_logits": (False,),
    "input_emb_norm": (False,),
    "block_group_size": (1,),
    "clip_qkv": (None,),
}


def parse_config(raw: dict, source: str) -> LLaDAConfig:
    c = config_parsing.parse(LLaDAConfig, raw, source, SUPPORTED_FEATURES)
    config_parsing.require_sizes(c, source, {
        "d_model": limits.MAX_WIDTH, "n_heads": limits.MAX_HEADS, "n_layers": limits.MAX_LAYERS,
        "vocab_size": limits.MAX_VOCAB, "embedding_size": limits.MAX_VOCAB, "mlp_ratio": limits.MAX_WIDTH,
        "mlp_width": limits.MAX_WIDTH, "kv_heads": limits.MAX_HEADS, "max_sequence_length": limits.MAX_POSITIONS})
    config_parsing.require_norm_and_rope(c, source)
    config_parsing.require_divisible(source, "d_model", c.d_model, "n_heads", c.n_heads)
    config_parsing.require_divisible(source, "n_heads", c.n_heads, "n_kv_heads", c.kv_heads)
    config_parsing.require((c.d_model // c.n_heads) % 2 == 0, source,
                           "the head size d_model / n_heads must be even for rotary embeddings")
    config_parsing.require(c.embedding_size is None or c.embedding_size >= c.vocab_size, source,
                           f"embedding_size ({c.embedding_size}) must be at least vocab_size ({c.vocab_size})")
    return c


def parameter_count(c: LLaDAConfig) -> int:
    """The weights of the embedding, the head and the blocks' matrices (norms and biases left out)."""
    head_dim = c.d_model // c.n_heads
    block = 2 * c.d_model * c.d_model + 2 * c.d_model * c.kv_heads * head_dim + 3 * c.d_model * c.mlp_width
    rows = c.embedding_size or c.vocab_size
    return rows * c.d_model * (1 if c.weight_tying else 2) + c.n_layers * block


class LLaDABlock(nn.Module):
    def __init__(self, c: LLaDAConfig):
        super().__init__()
        self.heads, self.kv_heads = c.n_heads, c.kv_heads
        self.head_dim = c.d_model // c.n_heads
        self.attn_norm = RMSNorm(c.d_model, c.rms_norm_eps)
        self.q_proj = nn.Linear(c.d_model, c.d_model, bias=c.include_qkv_bias)
        self.k_proj = nn.Linear(c.d_model, c.kv_heads * self.head_dim, bias=c.include_qkv_bias)
        self.v_proj = nn.Linear(c.d_model, c.kv_heads * self.head_dim, bias=c.include_qkv_bias)
        self.attn_out = nn.Linear(c.d_model, c.d_model, bias=False)
        self.ff_norm = RMSNorm(c.d_model, c.rms_norm_eps)
        self.ff_proj = nn.Linear(c.d_model, c.mlp_width, bias=False)  # the SwiGLU gate
        self.up_proj = nn.Linear(c.d_model, c.mlp_width, bias=False)
        self.ff_out = nn.Linear(c.mlp_width, c.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: tuple[Tensor, Tensor] | None,
                keep: Callable[..., Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """`keep(t, dim=1)` selects the positions whose hidden states the layer returns: only their queries
        are computed (every position's keys and values still are)."""
        batch, length, _ = x.shape
        h = self.attn_norm(x)
        k = self.k_proj(h).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        k = apply_rotary(k, cos, sin)
        if keep is not None:
            x, h = keep(x), keep(h)
            cos, sin, mask = (query_rows(table, keep) for table in (cos, sin, mask))
        q = self.q_proj(h).view(batch, h.shape[1], self.heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        keys, values = with_past(k, v, past)
        x = x + self.attn_out(attend(q, keys, values, mask))
        h = self.ff_norm(x)
        x = x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))
        return x, (k, v)


class LLaDA(Denoiser):
    model_type = "llada"

    def __init__(self, config: LLaDAConfig, residual_config: ResidualConfig | None,
                 tokens: SpecialTokens | None):
        super().__init__(config, residual_config, tokens)
        c = config
        self.hidden_size, self.num_layers = c.d_model, c.n_layers
        self.num_kv_heads, self.head_dim = c.kv_heads, c.d_model // c.n_heads
        self.rotary_dim, self.rope_theta = self.head_dim, c.rope_theta
        self.max_positions = c.max_sequence_length
        rows = c.embedding_size or c.vocab_size
        transformer = nn.ModuleDict({
            "wte": nn.Embedding(rows, c.d_model),
            "blocks": nn.ModuleList(LLaDABlock(c) for _ in range(c.n_layers)),
            "ln_f": RMSNorm(c.d_model, c.rms_norm_eps),
        })
        if not c.weight_tying:
            transformer["ff_out"] = nn.Linear(c.d_model, rows, bias=False)
        if residual_config is not None:
            transformer["residual_adapter"] = build_adapter(residual_config, c.d_model)
        self.model = nn.Module()
        self.model.transformer = transformer

    def input_embedding(self) -> nn.Embedding:
        return self.model.transformer["wte"]

    def residual_adapter(self) -> nn.Module:
        return self.model.transformer["residual_adapter"]

    def blocks(self) -> Sequence[nn.Module]:
        return self.model.transformer["blocks"]

    def head(self, hidden: Tensor) -> Tensor:
        t = self.model.transformer
        return output_logits(hidden, t["ln_f"], t["wte"], None if self.config.weight_tying else t["ff_out"])
