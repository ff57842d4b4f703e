"""Building blocks shared by the denoiser families: norms, rotary embeddings, attention, MLPs.

Conventions: hidden states are `[B, T, H]`; queries `[B, Hq, T, D]`; keys and values
`[B, Hkv, S, D]` where `S = P + T` when a prefix of `P` cached keys is given.
Norms, rotary embeddings and softmax run in float32 whatever the weights' dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def in_fixed_shape_graph() -> bool:
    """Whether the code is being traced or captured into a graph of fixed shapes (ONNX export,
    torch.compile, CUDA graph capture), where data-dependent shapes and host reads are not allowed."""
    if torch.compiler.is_exporting() or torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class PreNormLayer(nn.Module):
    """`x + attention(input_layernorm(x))`, then `x + mlp(post_attention_layernorm(x))`: the Llama-style
    layer of the Qwen and LLaDA2 stacks. The attention sits under the name the family's checkpoints give it."""

    def __init__(self, hidden: int, eps: float, attention_name: str, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.attention_name = attention_name
        self.add_module(attention_name, attention)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: tuple[Tensor, Tensor] | None,
                keep: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """`keep` selects the positions whose hidden states the layer returns (after attention, before the MLP)."""
        attention = getattr(self, self.attention_name)
        attended, kv = attention(self.input_layernorm(x), cos, sin, mask, past)
        x = x + attended
        if keep is not None:
            x = keep(x)
        return x + self.mlp(self.post_attention_layernorm(x)), kv


def output_logits(hidden: Tensor, norm: nn.Module, embedding: nn.Embedding, lm_head: nn.Module | None) -> Tensor:
    """The final norm, then `lm_head`, or the input embedding's weight when the two are tied (`lm_head` None)."""
    hidden = norm(hidden)
    return F.linear(hidden, tied_head_weight(embedding)) if lm_head is None else lm_head(hidden)


def tied_head_weight(embedding: nn.Embedding) -> Tensor:
    """The weight of a head tied to `embedding`: all of it, or on a vocabulary-parallel rank its rows
    (`head_rows`, set by `dlmrt.parallel.tensor_parallel`)."""
    rows = getattr(embedding, "head_rows", None)
    return embedding.weight if rows is None else embedding.weight[rows]


class SwiGLU(nn.Module):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))`."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotary_tables(positions: Tensor, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin `[B, 1, T, rotary_dim]` (float32) for the half-split ("rotate_half") convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=positions.device,
                                             dtype=torch.float32) / rotary_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, rotary_dim / 2]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first `cos.shape[-1]` channels of each head; the rest pass through."""
    rotary_dim = cos.shape[-1]
    rot = x[..., :rotary_dim].float()
    first, second = rot.chunk(2, dim=-1)
    rotated = rot * cos + torch.cat((-second, first), dim=-1) * sin
    if rotary_dim == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def query_rows(table: Tensor, keep: Callable[..., Tensor]) -> Tensor:
    """`keep` (a selector of positions along a given axis) applied to the query axis of a `[B, 1, T, ...]`
    table: the rotary tables, the attention mask. A table broadcast over the queries (T = 1) stays as it is."""
    return table if table.shape[2] == 1 else keep(table, 2)


def attention_mask(query_positions: Tensor, key_positions: Tensor, key_mask: Tensor,
                   block_length: int | None) -> Tensor:
    """Boolean `[B, 1, T, S]` (True = may attend).

    Bidirectional attention sees every unpadded key. Block-causal attention
    (block diffusion) also hides keys whose block, on the absolute grid
    `position // block_length`, lies after the query's block.
    """
    allowed = key_mask.bool()[:, None, :]  # [B, 1, S]
    if block_length is not None:
        key_block = key_positions[:, None, :] // block_length
        query_block = query_positions[:, :, None] // block_length
        allowed = allowed & (key_block <= query_block)  # [B, T, S]
    return allowed[:, None]


# Up to this many attention scores a layer (batch x heads x queries x keys: 4 MiB of float32), float32
# attention compiled for a CPU runs as two batched matmuls around one fused softmax. At short lengths
# that is faster than SDPA's CPU flash kernel, whose many small tiles cost more than the scores' memory
# (docs/cpu.md). Eager keeps SDPA: there the dozen ops in its place would each cost a dispatch.
CPU_MATMUL_ATTENTION_MAX_SCORES = 1 << 20


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Scaled dot-product attention with grouped K/V heads; returns `[B, T, Hq * D]`."""
    batch, q_heads, length, head_dim = q.shape
    kv_heads = k.shape[1]
    if kv_heads != q_heads:
        group = q_heads // kv_heads
        k = k[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, q_heads, -1, head_dim)
        v = v[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, q_heads, -1, head_dim)
    compiled_small_on_cpu = (q.device.type == "cpu" and q.dtype == torch.float32
                             and torch.compiler.is_compiling() and not torch.compiler.is_exporting()
                             and batch * q_heads * length * k.shape[2] <= CPU_MATMUL_ATTENTION_MAX_SCORES)
    if compiled_small_on_cpu:
        out = attend_by_matmul(q, k, v, mask)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(batch, length, q_heads * head_dim)


def attend_by_matmul(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA's result, as `softmax(q k^T / sqrt(D) + bias) v`; a query that may attend to no key gets
    zeros, as from SDPA."""
    batch, heads, length, head_dim = q.shape
    keys = k.shape[2]
    bias = torch.where(mask, 0.0, float("-inf")).to(q.dtype).expand(batch, heads, length, keys)
    scores = torch.baddbmm(bias.reshape(batch * heads, length, keys), q.reshape(batch * heads, length, head_dim),
                           k.reshape(batch * heads, keys, head_dim).transpose(1, 2), alpha=head_dim ** -0.5)
    probs = scores.softmax(-1).view(batch, heads, length, keys).masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return torch.matmul(probs, v)


def with_past(k: Tensor, v: Tensor, past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """Keys and values over the cached prefix followed by the window."""
    if past is None:
        return k, v
    return torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
