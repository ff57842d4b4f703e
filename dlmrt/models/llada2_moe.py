"""The LLaDA2.x family (`LLaDA2MoeModelLM`, model_type `llada2_moe`).

GQA with query/key RMSNorm and partial rotary embeddings; the first
`first_k_dense_replace` layers use a dense SwiGLU, the rest a mixture of
experts: sigmoid router scores, `expert_bias` added only to choose experts
(group-limited top-k: the `topk_group` groups with the best top-2 sums, then
the top `num_experts_per_tok` experts inside them), chosen experts weighted by
their unbiased scores, normalized and scaled by `routed_scaling_factor`, plus
shared experts as one MLP of width `moe_intermediate_size * num_shared_experts`.
Attention is block-causal (block diffusion): bidirectional inside a block,
causal across blocks of the absolute grid `position // block_length`.
Tensor names follow the public LLaDA2.x-mini checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlmrt.core import limits
from dlmrt.models import config as config_parsing
from dlmrt.models.denoiser import Denoiser, SpecialTokens
from dlmrt.models.experts import SwiGLUExperts, grouped_routed, grouped_runs
from dlmrt.models.layers import (PreNormLayer, RMSNorm, SwiGLU, apply_rotary, attend, in_fixed_shape_graph,
                                        output_logits, with_past)
from dlmrt.models.residual import ResidualConfig, build_adapter


@dataclass(frozen=True)
class LLaDA2MoeConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None
    num_experts: int | None = None
    num_experts_per_tok: int = 1
    moe_intermediate_size: int | None = None
    num_shared_experts: int | None = None
    first_k_dense_replace: int = 0
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    partial_rotary_factor: float = 1.0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    use_qk_norm: bool = False
    use_qkv_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.dim_per_head * self.partial_rotary_factor)

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts is not None and index >= self.first_k_dense_replace


SUPPORTED_FEATURES = {
    "hidden_act": ("silu",),
    "score_function": ("sigmoid",),
    "rope_scaling": (None,),
    "norm_head": (False,),
    "use_rmsnorm": (True,),
    "use_bias": (False,),
    "using_split_qkv_in_self_attention": (False,),
    "router_dtype": ("fp32",),
}


def parse_config(raw: dict, source: str) -> LLaDA2MoeConfig:
    c = config_parsing.parse(LLaDA2MoeConfig, raw, source, SUPPORTED_FEATURES)
    require = config_parsing.require
    config_parsing.require_sizes(c, source, {
        "hidden_size": limits.MAX_WIDTH, "num_hidden_layers": limits.MAX_LAYERS,
        "num_attention_heads": limits.MAX_HEADS, "num_key_value_heads": limits.MAX_HEADS,
        "intermediate_size": limits.MAX_WIDTH, "vocab_size": limits.MAX_VOCAB, "dim_per_head": limits.MAX_WIDTH,
        "max_position_embeddings": limits.MAX_POSITIONS, "num_experts": limits.MAX_EXPERTS,
        "num_experts_per_tok": limits.MAX_EXPERTS, "moe_intermediate_size": limits.MAX_WIDTH,
        "n_group": limits.MAX_EXPERTS, "topk_group": limits.MAX_EXPERTS})
    config_parsing.require_norm_and_rope(c, source)
    require(0 <= (c.num_shared_experts or 0) <= limits.MAX_EXPERTS, source,
            f"num_shared_experts must lie in [0, {limits.MAX_EXPERTS}]")
    config_parsing.require_divisible(source, "num_attention_heads", c.num_attention_heads,
                                     "num_key_value_heads", c.num_key_value_heads)
    require(0.0 < c.partial_rotary_factor <= 1.0 and c.rotary_dim % 2 == 0 and c.rotary_dim > 0, source,
            f"partial_rotary_factor ({c.partial_rotary_factor}) must give an even rotary size "
            f"in (0, head_dim]")
    if c.num_experts is not None:
        require(c.num_experts > 0 and c.moe_intermediate_size is not None and c.moe_intermediate_size > 0,
                source, "a MoE config needs num_experts > 0 and moe_intermediate_size > 0")
        require(0 < c.num_experts_per_tok <= c.num_experts, source,
                f"num_experts_per_tok must lie in [1, num_experts={c.num_experts}]")
        groups = c.n_group or 1
        config_parsing.require_divisible(source, "num_experts", c.num_experts, "n_group", groups)
        if groups > 1:
            chosen = c.topk_group or groups
            require(c.num_experts // groups >= 2, source, "group-limited routing needs >= 2 experts per group")
            require(0 < chosen <= groups, source, f"topk_group must lie in [1, n_group={groups}]")
            require(c.num_experts_per_tok <= chosen * (c.num_experts // groups), source,
                    "num_experts_per_tok exceeds the experts in the topk_group chosen groups")
    return c


def parameter_count(c: LLaDA2MoeConfig) -> int:
    """The weights of the embedding, the head and the layers' matrices (norms and biases left out)."""
    heads, kv, head = c.num_attention_heads, c.num_key_value_heads, c.dim_per_head
    attention = c.hidden_size * (heads + 2 * kv) * head + heads * head * c.hidden_size
    dense = 3 * c.hidden_size * c.intermediate_size
    moe = 0
    if c.num_experts is not None:
        experts = c.num_experts + (c.num_shared_experts or 0)
        moe = experts * 3 * c.hidden_size * c.moe_intermediate_size + c.num_experts * c.hidden_size
    layers = sum(attention + (moe if c.is_moe_layer(i) else dense) for i in range(c.num_hidden_layers))
    return c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + layers


class Attention(nn.Module):
    def __init__(self, c: LLaDA2MoeConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.dim_per_head
        self.query_key_value = nn.Linear(c.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim,
                                         bias=c.use_qkv_bias)
        self.dense = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)
        self.use_qk_norm = c.use_qk_norm
        if c.use_qk_norm:
            self.query_layernorm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.key_layernorm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        batch, length, _ = x.shape
        qkv = self.query_key_value(x).view(batch, length, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2))
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys, values = with_past(k, v, past)
        return self.dense(attend(q, keys, values, mask)), (k, v)


class Router(nn.Module):
    def __init__(self, c: LLaDA2MoeConfig):
        super().__init__()
        self.top_k, self.groups = c.num_experts_per_tok, c.n_group or 1
        self.top_groups = c.topk_group or self.groups
        self.scale, self.normalize = c.routed_scaling_factor, c.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        # The public model code keeps this buffer (and saves it) whatever
        # `moe_router_enable_expert_bias` says, so every checkpoint has it.
        self.register_buffer("expert_bias", torch.zeros(c.num_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Chosen experts `[N, k]` and their float32 weights `[N, k]` for tokens `[N, H]`."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        choice = scores + self.expert_bias.float()
        if self.groups > 1:
            tokens = choice.shape[0]
            by_group = choice.view(tokens, self.groups, -1)
            group_scores = by_group.topk(2, dim=-1).values.sum(-1)
            kept = group_scores.topk(self.top_groups, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = by_group.masked_fill(~keep[..., None], float("-inf")).view(tokens, -1)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize and self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * self.scale


class MoE(nn.Module):
    def __init__(self, c: LLaDA2MoeConfig):
        super().__init__()
        self.gate = Router(c)
        self.experts = SwiGLUExperts(c.num_experts, c.hidden_size, c.moe_intermediate_size)
        self.shared_experts = None
        if c.num_shared_experts:
            self.shared_experts = SwiGLU(c.hidden_size, c.moe_intermediate_size * c.num_shared_experts)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.gate(flat)
        y = self.routed(flat, experts, weights).to(x.dtype).view_as(x)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def routed(self, flat: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """The weighted sum `[N, H]` of the chosen experts that this module holds (float32; the activations'
        dtype from the grouped GEMM)."""
        first, count = self.experts.first, self.experts.num_experts
        sharded = count != self.gate.weight.shape[0]  # an expert-parallel rank's slice
        if not torch.compiler.is_exporting() and grouped_runs(flat):
            return grouped_routed(self.experts, flat, experts, weights, partial=sharded)
        routed = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
        if in_fixed_shape_graph():
            # A graph cannot pick experts by data: every expert runs on every token, weighted by a
            # routing matrix that is zero where the token did not choose it. Experts are added in
            # the same order as below, and adding zeros changes nothing, so the sums are the same.
            routing = torch.zeros(flat.shape[0], self.gate.weight.shape[0], dtype=torch.float32, device=flat.device)
            routing = routing.scatter(1, experts, weights)
            if sharded:
                routing = routing[:, first:first + count]
            for row in range(count):
                routed = routed + self.experts.expert(row, flat).float() * routing[:, row, None]
        else:
            # Only the experts some token chose run; each sees just its tokens.
            held = experts[(experts >= first) & (experts < first + count)] if sharded else experts
            for expert in held.unique().tolist():
                token, slot = (experts == expert).nonzero(as_tuple=True)
                out = self.experts.expert(expert - first, flat[token]).float() * weights[token, slot, None]
                routed.index_add_(0, token, out)
        return routed


def decoder_layer(c: LLaDA2MoeConfig, index: int) -> PreNormLayer:
    attention = Attention(c)
    mlp = MoE(c) if c.is_moe_layer(index) else SwiGLU(c.hidden_size, c.intermediate_size)
    return PreNormLayer(c.hidden_size, c.rms_norm_eps, "attention", attention, mlp)


class LLaDA2Moe(Denoiser):
    model_type = "llada2_moe"
    block_causal = True
    default_block_length = 32  # the public LLaDA2 generate's default

    def __init__(self, config: LLaDA2MoeConfig, residual_config: ResidualConfig | None,
                 tokens: SpecialTokens | None):
        super().__init__(config, residual_config, tokens)
        c = config
        self.hidden_size, self.num_layers = c.hidden_size, c.num_hidden_layers
        self.num_kv_heads, self.head_dim = c.num_key_value_heads, c.dim_per_head
        self.rotary_dim, self.rope_theta = c.rotary_dim, c.rope_theta
        self.max_positions = c.max_position_embeddings
        self.model = nn.Module()
        self.model.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList(decoder_layer(c, i) for i in range(c.num_hidden_layers))
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if residual_config is not None:
            self.model.residual_adapter = build_adapter(residual_config, c.hidden_size)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def input_embedding(self) -> nn.Embedding:
        return self.model.word_embeddings

    def residual_adapter(self) -> nn.Module:
        return self.model.residual_adapter

    def blocks(self) -> Sequence[nn.Module]:
        return self.model.layers

    def head(self, hidden: Tensor) -> Tensor:
        lm_head = None if self.config.tie_word_embeddings else self.lm_head
        return output_logits(hidden, self.model.norm, self.model.word_embeddings, lm_head)
