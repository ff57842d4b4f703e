"""The DiffusionGemma family (`DiffusionGemmaForBlockDiffusion`, model_type `diffusion_gemma`), text only.

A uniform-noise block-diffusion model: there is no mask token. One stack of Gemma-4 layers runs in
two modes over one set of weights:

- **encode** (the cache commit): causal attention, sliding-window causal on sliding layers, over the
  prompt and then each committed canvas; it writes the K/V cache and its logits are never used.
- **decode** (the denoising step): bidirectional attention over [cache; canvas]; it reads the cache
  and never writes it. Its input is `post_norm(E[x] * sqrt(H) + MLP(pre_norm(s)))`, where `s` is
  the self-conditioning signal: the last step's soft token `softmax(scaled logits) @ E * sqrt(H)`
  (zero on a canvas's first step). dlmrt carries it as the step's `Residual.z`, the same slot as
  ORL's residual context (`soft_tokens` computes it from the scaled logits).

The two modes differ only in the mask and in each layer's `layer_scalar`, the one buffer the
checkpoint holds twice (`model.encoder.language_model.layers.{i}.layer_scalar` and
`model.decoder.layers.{i}.layer_scalar`). Everything else is stored once, under `model.decoder.`.

The layers: sliding-window and full-attention layers (`layer_types`); full layers have their own
head size and K/V heads (`per_layer_config`, or `global_head_dim` / `num_global_key_value_heads`),
no `v_proj` (V is the RMS-normed raw key projection) and "proportional" rotary (the first
`partial_rotary_factor` of each head's frequencies, over the head size; the rest unrotated).
Gemma-4 RMSNorm multiplies by `w` (not `1 + w`); q and k norms have weights, the v norm has none;
attention scaling is 1. The MLP is a dense gated GELU (tanh) summed with a routed MoE whose router
reads the raw residual. Every layer's output is multiplied by its mode's `layer_scalar`. Logits are
soft-capped: `cap * tanh(logits / cap)`, in float32.

Attention on the sliding layers, with window W: the encoder's query at position i sees keys in
(i - W, i]; the decoder's canvas sees the cached keys after `canvas_start - W` (what a Hugging
Face cache keeps: the last W - 1) and the whole canvas.

Departures from the public code, on purpose:
- positions count each row's own tokens (left padding does not shift them), so a batched row
  decodes as it does alone; the public batched generate numbers padding as positions.
- the image tower (`model.encoder.vision_tower`, `model.encoder.embed_vision`) is not loaded:
  dlmrt runs text only, and says so once at load.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlmrt.core.errors import ArgumentError, UnsupportedFeatureError
from dlmrt.models.denoiser import Denoiser, DenoiserOutput, LayerGroupKV, SpecialTokens, window_positions
from dlmrt.models.layers import SwiGLU, in_fixed_shape_graph, tied_head_weight
from dlmrt.models.residual import Residual, ResidualConfig

from dlmrt.models.diffusion_gemma_config import (FULL, SLIDING, DiffusionGemmaConfig, RopeConfig,
                                                        parameter_count, parse_config)

__all__ = ["FULL", "SLIDING", "DiffusionGemma", "DiffusionGemmaConfig", "LayerGroupKV", "RopeConfig",
           "parameter_count", "parse_config"]

class GemmaRMSNorm(nn.Module):
    """Gemma-4 RMSNorm in float32: `x * (mean(x^2) + eps)^-1/2 * w`, or without `w` (scale=False)."""

    def __init__(self, size: int, eps: float, scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if scale else None

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            x32 = x32 * self.weight.float()
        return x32.to(x.dtype)


class GatedGELU(SwiGLU):
    """SwiGLU's projections with GELU (tanh): `down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))`."""

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> Tensor:
    """float32 `[head_dim / 2]`. "proportional": the first `partial_rotary_factor` of the frequencies
    `theta^(-2i / head_dim)`, then zeros (those channels pass unrotated); "default": all of them."""
    angles = int(rope.partial_rotary_factor * head_dim // 2)
    inv_freq = 1.0 / rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32) / head_dim)
    inv_freq = torch.cat((inv_freq, torch.zeros(head_dim // 2 - angles))) / rope.factor
    return inv_freq


def rotary(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin `[B, T, 1, D]`, rotate_half layout, float32."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    angles = torch.cat((freqs, freqs), dim=-1)[:, :, None]
    return angles.cos(), angles.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return (x * cos.to(x.dtype) + torch.cat((-second, first), dim=-1) * sin.to(x.dtype))


class Attention(nn.Module):
    def __init__(self, c: DiffusionGemmaConfig, layer_type: str):
        super().__init__()
        t = c.text
        self.layer_type = layer_type
        self.heads, self.kv_heads, self.head_dim = t.num_attention_heads, c.kv_heads(layer_type), c.head_dim(layer_type)
        self.q_proj = nn.Linear(t.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(t.hidden_size, self.kv_heads * self.head_dim, bias=False)
        if layer_type == SLIDING:  # full layers take V from the raw key projection
            self.v_proj = nn.Linear(t.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, t.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, t.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, t.rms_norm_eps)
        self.v_norm = GemmaRMSNorm(self.head_dim, t.rms_norm_eps, scale=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        batch, length, _ = x.shape
        shape = (batch, length, -1, self.head_dim)
        q = rotate(self.q_norm(self.q_proj(x).view(shape)), cos, sin).transpose(1, 2)
        raw_k = self.k_proj(x).view(shape)
        v = self.v_norm(self.v_proj(x).view(shape) if self.layer_type == SLIDING else raw_k).transpose(1, 2)
        k = rotate(self.k_norm(raw_k), cos, sin).transpose(1, 2)
        keys, values = (k, v) if past is None else (torch.cat((past[0], k), 2), torch.cat((past[1], v), 2))
        group = self.heads // self.kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1)), (k, v)


class Router(nn.Module):
    """Softmax over all experts of `proj(norm(x) * scale / sqrt(H))`, top-k renormalized, times each
    chosen expert's `per_expert_scale`."""

    def __init__(self, c: DiffusionGemmaConfig):
        super().__init__()
        t = c.text
        self.top_k = t.top_k_experts
        self.root_size = t.hidden_size ** -0.5
        self.norm = GemmaRMSNorm(t.hidden_size, t.rms_norm_eps, scale=False)
        self.proj = nn.Linear(t.hidden_size, t.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(t.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(t.num_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        scores = self.proj(self.norm(x) * self.scale * self.root_size)
        probabilities = F.softmax(scores, dim=-1, dtype=torch.float32)
        weights, experts = probabilities.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return experts, weights * self.per_expert_scale[experts]


class Experts(nn.Module):
    """Stacked expert weights, as the checkpoint stores them: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`."""

    def __init__(self, c: DiffusionGemmaConfig):
        super().__init__()
        t = c.text
        self.gate_up_proj = nn.Parameter(torch.empty(t.num_experts, 2 * t.moe_intermediate_size, t.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(t.num_experts, t.hidden_size, t.moe_intermediate_size))

    def expert(self, index: int, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.gate_up_proj[index]).chunk(2, dim=-1)
        return F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[index])

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        if in_fixed_shape_graph():
            # A graph cannot pick experts by data: every expert runs on every token, weighted by a
            # routing matrix that is zero where the token did not choose it.
            routing = torch.zeros(x.shape[0], self.gate_up_proj.shape[0], dtype=weights.dtype, device=x.device)
            routing = routing.scatter(1, experts, weights)
            for index in range(self.gate_up_proj.shape[0]):
                out = out + (self.expert(index, x) * routing[:, index, None]).to(x.dtype)
            return out
        for index in experts.unique().tolist():
            token, slot = (experts == index).nonzero(as_tuple=True)
            out.index_add_(0, token, (self.expert(index, x[token]) * weights[token, slot, None]).to(x.dtype))
        return out


class Layer(nn.Module):
    def __init__(self, c: DiffusionGemmaConfig, layer_type: str):
        super().__init__()
        t = c.text
        size, eps = t.hidden_size, t.rms_norm_eps
        self.self_attn = Attention(c, layer_type)
        self.mlp = GatedGELU(size, t.intermediate_size)
        self.router = Router(c)
        self.experts = Experts(c)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):
            setattr(self, name, GemmaRMSNorm(size, eps))
        self.register_buffer("layer_scalar", torch.ones(1))  # the decoder's; the encoder's are held apart

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: tuple[Tensor, Tensor] | None,
                layer_scalar: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        attended, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + self.post_attention_layernorm(attended)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.router(flat)
        routed = self.experts(self.pre_feedforward_layernorm_2(flat), experts, weights).view_as(x)
        x = x + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(routed))
        return x * layer_scalar, kv


class SelfConditioning(GatedGELU):
    """`post_norm(embedded + MLP(pre_norm(signal)))`, post_norm without weights; the MLP's matrices sit
    beside the norms, as the checkpoint names them."""

    def __init__(self, c: DiffusionGemmaConfig):
        t = c.text
        super().__init__(t.hidden_size, t.intermediate_size)
        self.pre_norm = GemmaRMSNorm(t.hidden_size, t.rms_norm_eps)
        self.post_norm = GemmaRMSNorm(t.hidden_size, t.rms_norm_eps, scale=False)

    def forward(self, embedded: Tensor, signal: Tensor) -> Tensor:
        return self.post_norm(embedded + super().forward(self.pre_norm(signal)))


def _layer_scalars(layers: int) -> nn.ModuleList:
    """Modules holding one `layer_scalar` buffer each, under `layers.{i}.layer_scalar`."""
    holders = nn.ModuleList(nn.Module() for _ in range(layers))
    for holder in holders:
        holder.register_buffer("layer_scalar", torch.ones(1))
    return holders


class DiffusionGemma(Denoiser):
    """The text stack of `DiffusionGemmaForBlockDiffusion`: `encode` writes the cache, `denoise` is
    the decoder step (its `residual` is the self-conditioning signal, see `soft_tokens`)."""

    model_type = "diffusion_gemma"
    noise: ClassVar[str] = "uniform"
    supports_residual_context = False
    # The checkpoint's image tower: dlmrt runs text only.
    ignored_tensor_prefixes: ClassVar[tuple[str, ...]] = ("model.encoder.vision_tower.",
                                                          "model.encoder.embed_vision.")

    def __init__(self, config: DiffusionGemmaConfig, residual_config: ResidualConfig | None,
                 tokens: SpecialTokens | None):
        super().__init__(config, residual_config, tokens)
        t = config.text
        self.hidden_size, self.num_layers = t.hidden_size, t.num_hidden_layers
        # The sliding layers' shape; the cache itself is a LayerGroupKV, one tensor per kind of layer.
        self.num_kv_heads, self.head_dim = t.num_key_value_heads, t.head_dim
        self.rotary_dim, self.rope_theta = t.head_dim, config.rope[config.layer_types[0]].theta
        self.max_positions = t.max_position_embeddings
        self.canvas_length = config.canvas_length
        self.default_block_length = config.canvas_length  # a block is a canvas
        self.sliding_window = t.sliding_window
        self.softcap = t.final_logit_softcapping
        self.model = nn.Module()
        self.model.decoder = decoder = nn.Module()
        decoder.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)
        decoder.layers = nn.ModuleList(Layer(config, layer_type) for layer_type in config.layer_types)
        decoder.norm = GemmaRMSNorm(t.hidden_size, t.rms_norm_eps)
        decoder.self_conditioning = SelfConditioning(config)
        self.model.encoder = nn.Module()
        self.model.encoder.language_model = nn.Module()
        self.model.encoder.language_model.layers = _layer_scalars(t.num_hidden_layers)
        self._device_constants: dict[tuple[Hashable, torch.device], Tensor] = {}  # see _host_constant

    # -- the Denoiser contract ------------------------------------------------------------
    def input_embedding(self) -> nn.Embedding:
        return self.model.decoder.embed_tokens

    def residual_adapter(self) -> nn.Module:
        raise UnsupportedFeatureError("the diffusion_gemma family has no ORL residual pathway (its decoder "
                                      "conditions on the last step's soft tokens instead)")

    def blocks(self) -> Sequence[nn.Module]:
        return self.model.decoder.layers

    def head(self, hidden: Tensor) -> Tensor:
        logits = F.linear(self.model.decoder.norm(hidden), tied_head_weight(self.input_embedding())).float()
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    # -- the two modes --------------------------------------------------------------------
    def _embed(self, input_ids: Tensor) -> Tensor:
        weight = self.input_embedding().weight
        return F.embedding(input_ids, weight) * self._embed_scale(weight)

    def _embed_scale(self, weight: Tensor) -> Tensor:
        """sqrt(H) in the weights' dtype, on their device."""
        return self._host_constant(("embed_scale", weight.dtype), weight.device,
                                   lambda: torch.tensor(math.sqrt(self.hidden_size), dtype=weight.dtype))

    def _host_constant(self, key: Hashable, device: torch.device, make: Callable[[], Tensor]) -> Tensor:
        """`make()`, a tensor the host computes (so the same numbers on every device), on `device`. Off
        the CPU a device keeps its copy, made on the model's first call there, so that later calls copy
        nothing from the host: a captured step (CUDA graphs) may not, and the executor's warm-up is such
        a first call. A traced or compiled call makes it in the graph, as on the CPU."""
        if device.type == "cpu" or torch.compiler.is_compiling() or torch.compiler.is_exporting():
            value = make()
            return value if value.device == device else value.to(device)
        if (key, device) not in self._device_constants:
            self._device_constants[key, device] = make().to(device)
        return self._device_constants[key, device]

    def _run(self, x: Tensor, positions: Tensor, masks: dict[str, Tensor], past: LayerGroupKV | None,
             scalars: Sequence[Tensor]) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        tables = {t: rotary(positions, self._host_constant(
            ("inverse_frequencies", t), positions.device,
            lambda t=t: inverse_frequencies(self.config.rope[t], self.config.head_dim(t)))) for t in masks}
        counters = {SLIDING: 0, FULL: 0}
        window_kv = []
        for layer, scalar in zip(self.model.decoder.layers, scalars):
            kind = layer.self_attn.layer_type
            layer_past = None
            if past is not None:
                group = past.sliding if kind == SLIDING else past.full
                layer_past = (group[counters[kind], 0], group[counters[kind], 1])
            counters[kind] += 1
            x, kv = layer(x, *tables[kind], masks[kind], layer_past, scalar)
            window_kv.append(kv)
        return x, window_kv

    def _defaults(self, input_ids: Tensor, positions: Tensor | None, key_mask: Tensor | None,
                  past: LayerGroupKV | None) -> tuple[Tensor, Tensor, Tensor]:
        past_positions = None if past is None else past.positions
        prefix = 0 if past is None else past.positions.shape[1]
        positions, key_mask, key_positions = window_positions(input_ids, positions, key_mask, past_positions, prefix,
                                                              "diffusion_gemma")
        return positions, key_mask.bool(), key_positions

    def cache_groups(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(layers, K/V heads, head size) of the sliding and of the full layers: the shapes of a LayerGroupKV."""
        return tuple((self.config.layer_types.count(kind), *self._kv_shape(kind)) for kind in (SLIDING, FULL))

    def _kv_shape(self, kind: str) -> tuple[int, int]:
        """(K/V heads, head size) a layer of `kind` caches: read off its attention, so that a tensor-parallel
        rank's cache holds its own heads only."""
        for layer in self.model.decoder.layers:
            if layer.self_attn.layer_type == kind:
                return layer.self_attn.kv_heads, layer.self_attn.head_dim
        return self.config.kv_heads(kind), self.config.head_dim(kind)

    def encode(self, input_ids: Tensor, *, positions: Tensor | None = None, key_mask: Tensor | None = None,
               past: LayerGroupKV | None = None) -> LayerGroupKV:
        """The cache commit: the causal pass over `input_ids [B, T]` (the prompt, or a committed canvas
        after the cache `past`), returning the cache extended by their K/V. key_mask: `[B, P + T]`."""
        positions, key_mask, key_positions = self._defaults(input_ids, positions, key_mask, past)
        query, key = positions[:, None, :, None], key_positions[:, None, None, :]
        causal = key_mask[:, None, None, :] & (key <= query)
        masks = {FULL: causal, SLIDING: causal & (key > query - self.sliding_window)}
        scalars = [holder.layer_scalar for holder in self.model.encoder.language_model.layers]
        _, window_kv = self._run(self._embed(input_ids), positions, masks, past, scalars)
        groups = []
        for kind in (SLIDING, FULL):
            new = [torch.stack(kv) for kv, layer in zip(window_kv, self.model.decoder.layers)
                   if layer.self_attn.layer_type == kind]
            stacked = torch.stack(new) if new else self._empty_group(kind, input_ids)
            if past is not None:
                stacked = torch.cat((past.sliding if kind == SLIDING else past.full, stacked), dim=4)
            groups.append(stacked)
        return LayerGroupKV(groups[0], groups[1], key_positions)

    def _empty_group(self, kind: str, input_ids: Tensor) -> Tensor:
        batch, length = input_ids.shape
        heads, head = self._kv_shape(kind)
        return torch.zeros(0, 2, batch, heads, length, head, dtype=self.dtype, device=input_ids.device)

    def soft_tokens(self, scaled_logits: Tensor) -> Residual:
        """The next step's self-conditioning from this step's temperature-scaled logits `[B, T, V]`:
        z = softmax(logits) @ E, with the distribution's certainty 1 - H / log V beside it."""
        weight = self.input_embedding().weight
        if self.vocab_shard is not None:  # a tensor-parallel rank's logits are its vocabulary slice
            return self.vocab_shard.soft_tokens(scaled_logits.float(), weight)
        p = F.softmax(scaled_logits.float(), dim=-1)
        z = p.to(weight.dtype) @ weight
        entropy = -(p * F.log_softmax(scaled_logits.float(), dim=-1)).nan_to_num().sum(-1)
        return Residual(z, 1.0 - entropy / math.log(scaled_logits.shape[-1]))

    def denoise(self, input_ids: Tensor, *, positions: Tensor | None = None, key_mask: Tensor | None = None,
                past: Any = None, residual: Residual | None = None, return_kv: bool = False,
                block_length: int | None = None, logits_range: tuple[int, int] | None = None,
                logits_index: Tensor | None = None) -> DenoiserOutput:
        """The decoder step over the canvas `input_ids [B, W]` after the cache `past` (a LayerGroupKV
        from `encode`, or None for a canvas with no context). `residual`: the last step's soft tokens
        (`soft_tokens`), None on the canvas's first step. Returns soft-capped float32 logits."""
        if return_kv:
            raise ArgumentError("diffusion_gemma: the decoder never writes the cache; the encoder does "
                                "(DiffusionGemma.encode)")
        if past is not None and not isinstance(past, LayerGroupKV):
            raise ArgumentError(f"diffusion_gemma: the cache must be the LayerGroupKV that encode returns, "
                                f"got {type(past).__name__}")
        positions, key_mask, key_positions = self._defaults(input_ids, positions, key_mask, past)
        batch, length = input_ids.shape
        visible = key_mask[:, None, None, :].expand(batch, 1, length, key_mask.shape[1])
        prefix = key_positions.shape[1] - length
        in_window = key_positions[:, None, None, :] > positions[:, None, :1, None] - self.sliding_window
        in_window = in_window | (torch.arange(key_positions.shape[1], device=input_ids.device) >= prefix)
        masks = {FULL: visible, SLIDING: visible & in_window}
        weight = self.input_embedding().weight
        embedded = self._embed(input_ids)
        signal = torch.zeros_like(embedded) if residual is None else residual.z.to(weight.dtype) * \
            self._embed_scale(weight)
        x = self.model.decoder.self_conditioning(embedded, signal)
        scalars = [layer.layer_scalar for layer in self.model.decoder.layers]
        x, _ = self._run(x, positions, masks, past, scalars)
        if logits_index is not None:
            x = x.index_select(1, logits_index)
        elif logits_range is not None:
            x = x[:, logits_range[0]:logits_range[1]]
        return DenoiserOutput(self.head(x), None, None)
