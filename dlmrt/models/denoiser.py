"""The denoiser contract every family implements.

A denoiser maps token ids `[B, T]` (plus positions, a key mask, an optional
cached prefix of K/V and, for ORL models, the residual of the last step) to
logits `[B, T, V]`, and on request to the window's K/V and the next residual.
It knows nothing about decoding policies. Families differ in their blocks and
attention pattern (bidirectional, or block-causal on an absolute grid), never
in this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from dlmrt.core.errors import ArgumentError
from dlmrt.models import residual as residual_context
from dlmrt.models.description import ModelDescription, SpecialTokens
from dlmrt.models.layers import attention_mask, rotary_tables
from dlmrt.models.residual import Residual, ResidualConfig


class PastKV(NamedTuple):
    """Keys and values of a cached prefix, for every layer."""

    kv: Tensor  # [L, 2, B, Hkv, P, D], rotary already applied to K
    positions: Tensor  # [B, P]


class LayerGroupKV(NamedTuple):
    """An encoder-decoder family's K/V cache (DiffusionGemma's encoder writes it). Sliding and full
    layers differ in K/V heads and head size, so each kind of layer has its own tensor; rotary is
    already applied to K."""

    sliding: Tensor  # [Ls, 2, B, Hs, P, Ds]
    full: Tensor  # [Lf, 2, B, Hf, P, Df]
    positions: Tensor  # [B, P]


class DenoiserOutput(NamedTuple):
    logits: Tensor  # [B, T, V], in the weights' dtype
    kv: Tensor | None  # [L, 2, B, Hkv, T, D] of the window, when asked
    residual: Residual | None  # the next residual, for ORL models


def window_positions(input_ids: Tensor, positions: Tensor | None, key_mask: Tensor | None,
                     past_positions: Tensor | None, prefix: int, caller: str) -> tuple[Tensor, Tensor, Tensor]:
    """The window's positions and key mask, defaulted, and the keys' positions: a window `[B, T]` after a
    cached prefix of `prefix` keys at `past_positions` (None without a cache). By default every key is
    unpadded and each row counts its unpadded tokens from 0; with a cache, positions are required."""
    batch, length = input_ids.shape
    if key_mask is None:
        key_mask = torch.ones(batch, prefix + length, dtype=torch.bool, device=input_ids.device)
    if positions is None:
        if past_positions is not None:
            raise ArgumentError(f"{caller}: positions are required when a cached prefix is given")
        positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
    key_positions = positions if past_positions is None else torch.cat((past_positions, positions), dim=1)
    return positions, key_mask, key_positions


class Denoiser(nn.Module, ABC):
    """Base class: subclasses build their modules under the checkpoint's tensor names."""

    model_type: ClassVar[str]
    block_causal: ClassVar[bool] = False
    # Block size of the block-causal grid when a call does not give one.
    default_block_length: ClassVar[int | None] = None
    # Whether the family implements the ORL residual pathway (`residual_adapter` and the mix).
    supports_residual_context: ClassVar[bool] = True
    # How many positions before its own a position's raw logits sit (the family's `denoise` undoes
    # it): with a cached prefix, a window then needs this many positions of look-behind.
    logits_shift: ClassVar[int] = 0
    # What a position not yet decoded holds: "mask" (the mask token, every mask-based policy) or
    # "uniform" (a uniformly random token, refilled each step: DiffusionGemma).
    noise: ClassVar[str] = "mask"
    # Checkpoint tensors under these prefixes belong to parts dlmrt does not run (an image tower):
    # the loader skips them, with a note, rather than calling them unexpected.
    ignored_tensor_prefixes: ClassVar[tuple[str, ...]] = ()
    # A tensor-parallel rank's slice of the vocabulary (`dlmrt.parallel.tensor_parallel.VocabShard`): its
    # head's logits cover only that slice. None: the whole vocabulary.
    vocab_shard = None

    def __init__(self, config: Any, residual_config: ResidualConfig | None, tokens: SpecialTokens | None):
        super().__init__()
        self.config = config
        self.residual_config = residual_config
        self.tokens = tokens
        self.raw_config: dict[str, Any] = {}
        self.tokenizer = None  # a tokenizers.Tokenizer when the checkpoint has tokenizer.json
        self.tokenizer_config: bytes | None = None  # tokenizer_config.json as read (its chat template)
        self.generation_config: dict[str, Any] = {}  # generation_config.json, as read
        self.name = self.model_type

    # -- what a family provides ---------------------------------------------------------
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    max_positions: int
    canvas_length: int | None = None  # a uniform-noise family's own canvas

    @abstractmethod
    def input_embedding(self) -> nn.Embedding: ...

    @abstractmethod
    def residual_adapter(self) -> nn.Module:
        """The ORL adapter module (only called when the pathway is on)."""

    @abstractmethod
    def blocks(self) -> Sequence[nn.Module]:
        """Each block maps `(x, cos, sin, mask, past_kv)` to `(x, (k, v))`."""

    @abstractmethod
    def head(self, hidden: Tensor) -> Tensor:
        """Final norm and output projection."""

    # -- the contract -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Width of the logits (rows of the input embedding)."""
        return self.input_embedding().num_embeddings

    @property
    def description(self) -> ModelDescription:
        """What the export manifest and the runtime know of this model (`dlmrt.models.description`)."""
        return ModelDescription(
            name=self.name, model_type=self.model_type, dtype=str(self.dtype).removeprefix("torch."),
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, max_positions=self.max_positions,
            block_causal=self.block_causal, block_grid=None, residual=self.residual_config is not None,
            noise=self.noise, canvas_length=self.canvas_length, logits_shift=self.logits_shift)

    @property
    def dtype(self) -> torch.dtype:
        return self.input_embedding().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.input_embedding().weight.device

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Tensor:
        """Logits `[B, T, V]` for token ids `[B, T]`; keyword arguments as for `denoise`."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ArgumentError(
                f"input_ids must be an integer tensor of shape [batch, length], got "
                f"{input_ids.dtype} of shape {list(input_ids.shape)}")
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.vocab_size):
            raise ArgumentError(
                f"input_ids must lie in [0, {self.vocab_size}) for this model, got values in "
                f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        return self.denoise(input_ids, **kwargs).logits

    def denoise(self, input_ids: Tensor, *, positions: Tensor | None = None,
                key_mask: Tensor | None = None, past: PastKV | None = None,
                residual: Residual | None = None, return_kv: bool = False,
                block_length: int | None = None,
                logits_range: tuple[int, int] | None = None,
                logits_index: Tensor | None = None) -> DenoiserOutput:
        """One denoising forward.

        positions: `[B, T]`; by default each row counts its unpadded tokens from 0.
        key_mask: `[B, P + T]`, False for padding (left padding in batches).
        past: a cached prefix; positions are then required.
        residual: the last step's residual (ORL models); None before the first step.
        block_length: the block-causal grid, for block-diffusion families.
        logits_range: return logits only for window positions [start, end) (the next residual
            of an ORL model still covers the whole window).
        logits_index: the same as window indices `[n]` (int64), for graphs whose block moves.
        """
        length = input_ids.shape[1]
        positions, key_mask, key_positions = window_positions(
            input_ids, positions, key_mask, None if past is None else past.positions,
            0 if past is None else past.kv.shape[4], "denoise")
        grid = (block_length or self.default_block_length) if self.block_causal else None
        mask = attention_mask(positions, key_positions, key_mask, grid)
        cos, sin = rotary_tables(positions, self.rotary_dim, self.rope_theta)

        x = self.input_embedding()(input_ids)
        if self.residual_config is not None:
            x = residual_context.mix(x, input_ids == self.tokens.mask_id, residual,
                                     self.residual_adapter())

        def wanted(t: Tensor, dim: int = 1) -> Tensor:
            if logits_index is not None:
                return t.index_select(dim, logits_index)
            start, end = logits_range or (0, length)
            return t.narrow(dim, start, end - start)

        # Only the wanted positions' hidden states leave the last layer, so its MLP (and LLaDA's queries)
        # run on them alone; its keys and values cover every position. An ORL model's next residual
        # needs them all.
        pruned = self.residual_config is None and (logits_index is not None or logits_range is not None)
        blocks = self.blocks()
        window_kv = []
        for index, block in enumerate(blocks):
            layer_past = None if past is None else (past.kv[index, 0], past.kv[index, 1])
            last = pruned and index == len(blocks) - 1
            x, kv = block(x, cos, sin, mask, layer_past, keep=wanted if last else None)
            if return_kv:
                window_kv.append(torch.stack(kv))
        kv = torch.stack(window_kv) if return_kv else None

        if self.residual_config is None:
            return DenoiserOutput(self.head(x if pruned else wanted(x)), kv, None)
        logits = self.head(x)
        if self.vocab_shard is not None:
            next_residual = self.vocab_shard.residual(logits, self.input_embedding().weight)
        else:
            next_residual = residual_context.next_residual(
                logits, self.input_embedding().weight, self.residual_config.topk)
        return DenoiserOutput(wanted(logits), kv, next_residual)
