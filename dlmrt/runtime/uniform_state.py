"""A uniform-noise request's decoding state, in static buffers owned per shape bucket.

Design notes: docs/runtime-modules.md#uniform_state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dlmrt.core import limits
from dlmrt.models.denoiser import LayerGroupKV
from dlmrt.runtime.buckets import Bucket
from dlmrt.runtime.model_spec import ModelSpec
from dlmrt.runtime.static_buffers import StaticBuffers, shifted_copy


@dataclass(frozen=True)
class CacheGroup:
    """One kind of layer's share of the cache: [layers, 2, B, heads, S, head_dim]."""

    layers: int
    heads: int
    head_dim: int


def zero_cache(groups: Sequence[CacheGroup], batch: int, length: int, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> LayerGroupKV:
    """A cache of `length` positions, all zeros (0 positions: the cache before the prompt)."""
    sliding, full = (torch.zeros(g.layers, 2, batch, g.heads, length, g.head_dim, dtype=dtype, device=device)
                     for g in groups)
    return LayerGroupKV(sliding, full, torch.zeros(batch, length, dtype=torch.long, device=device))


@dataclass
class UniformState(StaticBuffers):
    """The static buffers of one uniform-noise bucket (B rows, W block positions, S cache positions)."""

    bucket: Bucket
    block_ids: Tensor  # [B, W] int64: the block's tokens, what the next step's decoder reads (its "canvas")
    argmax: Tensor  # [B, W] int64: the block's draft (-1 before the first step)
    positions: Tensor  # [B, W] int64: the block's positions
    key_mask: Tensor  # [B, W] bool: the block's keys (all visible)
    z: Tensor  # [B, W, H] model dtype: the last step's soft tokens (zero before the first step)
    cache_sliding: Tensor  # [Ls, 2, B, Hs, S, Ds]
    cache_full: Tensor  # [Lf, 2, B, Hf, S, Df]
    cache_positions: Tensor  # [B, S] int64
    past_key_mask: Tensor  # [B, S] bool: the cache positions that hold K/V of a real token
    prompt_lengths: Tensor  # [B] int64
    # what the encoder reads (`dlmrt.runtime.encode_step`), written before each commit
    prompt_ids: Tensor  # [B, P] int64: the joining rows' left-padded prompts
    prompt_positions: Tensor  # [B, P] int64
    prompt_key_mask: Tensor  # [B, P] bool
    block_tokens: Tensor  # [B, W] int64: the finished block's tokens
    committing: Tensor  # [B] bool: the rows whose K/V a commit keeps
    # per-row policy parameters
    temperatures: Tensor  # [B, schedule] float32: the temperature of each step (the first `last_step + 1`)
    last_step: Tensor  # [B] int64: the schedule's last step (a block's steps beyond it reuse its temperature)
    entropy_bound: Tensor  # [B] float32
    seed: Tensor  # [B] int64
    stability_threshold: Tensor  # [B] int64
    confidence_threshold: Tensor  # [B] float32
    # per-row loop state
    block_step: Tensor  # [B] int64: steps taken in the current block (the random streams' counter)
    stable_run: Tensor  # [B] int64: consecutive steps with an unchanged argmax
    finished: Tensor  # [B] bool: rows that ended in an earlier block, and padding rows
    done: Tensor  # [B] bool: rows whose current block is done (or that are finished)
    forwards: Tensor  # [B] int64: decoder forwards that did work for the row
    block: Tensor  # [B] int64: each row's current block

    @staticmethod
    def estimated_bytes(spec: ModelSpec, bucket: Bucket, groups: Sequence[CacheGroup]) -> int:
        """The cache storage, and a step's largest transients: the block's logits in float32 (scaled,
        log-probabilities, probabilities) and float64 (the Gumbel-max sample)."""
        item = torch.tensor([], dtype=spec.dtype).element_size()
        cache = sum(g.layers * 2 * bucket.batch * g.heads * bucket.storage * g.head_dim * item for g in groups)
        return cache + bucket.batch * bucket.block * spec.vocab_size * (3 * 4 + 2 * 8)

    @classmethod
    def allocate(cls, spec: ModelSpec, bucket: Bucket, groups: Sequence[CacheGroup]) -> UniformState:
        limits.check_fits(cls.estimated_bytes(spec, bucket, groups),
                          f"a batch of {bucket.batch} over {bucket.storage} cached and {bucket.block} canvas "
                          f"positions ({spec.name})", spec.device,
                          "decode fewer prompts at once (--batch-size, --max-batch), or shorter ones")
        rows, width, storage, device = bucket.batch, bucket.block, bucket.storage, spec.device
        long = dict(dtype=torch.long, device=device)
        flag = dict(dtype=torch.bool, device=device)
        real = dict(dtype=torch.float32, device=device)
        sliding, full, cache_positions = zero_cache(groups, rows, storage, spec.dtype, device)
        return cls(
            bucket=bucket, block_ids=torch.zeros(rows, width, **long), argmax=torch.zeros(rows, width, **long),
            positions=torch.zeros(rows, width, **long), key_mask=torch.ones(rows, width, **flag),
            z=torch.zeros(rows, width, spec.hidden_size, dtype=spec.dtype, device=device),
            cache_sliding=sliding, cache_full=full, cache_positions=cache_positions,
            past_key_mask=torch.zeros(rows, storage, **flag), prompt_lengths=torch.zeros(rows, **long),
            prompt_ids=torch.zeros(rows, bucket.prompt, **long),
            prompt_positions=torch.zeros(rows, bucket.prompt, **long),
            prompt_key_mask=torch.zeros(rows, bucket.prompt, **flag), block_tokens=torch.zeros(rows, width, **long),
            committing=torch.zeros(rows, **flag),
            temperatures=torch.ones(rows, bucket.schedule, **real), last_step=torch.zeros(rows, **long),
            entropy_bound=torch.zeros(rows, **real),
            seed=torch.zeros(rows, **long), stability_threshold=torch.zeros(rows, **long),
            confidence_threshold=torch.zeros(rows, **real), block_step=torch.zeros(rows, **long),
            stable_run=torch.zeros(rows, **long), finished=torch.ones(rows, **flag), done=torch.ones(rows, **flag),
            forwards=torch.zeros(rows, **long), block=torch.zeros(rows, **long))

    def decoder_inputs(self) -> dict[str, Tensor]:
        """The exported decoder's inputs by name: the state's own buffers, read in place."""
        return {"canvas": self.block_ids, "positions": self.positions, "key_mask": self.key_mask,
                "past_key_mask": self.past_key_mask, "past_sliding": self.cache_sliding,
                "past_full": self.cache_full, "past_positions": self.cache_positions, "z": self.z}

    @property
    def cache(self) -> LayerGroupKV:
        """The whole storage, as the decoder reads it (masked by `past_key_mask`)."""
        return LayerGroupKV(self.cache_sliding, self.cache_full, self.cache_positions)

    def encoder_inputs(self, block: int | None) -> dict[str, Tensor]:
        """The exported encoder's inputs by name (`dlmrt.export.uniform_export`), as views of this
        state's buffers: the prompts over no cache (`block` None), or block `block`'s tokens over the
        storage before its slot."""
        if block is None:
            ids, positions, key_mask, end = self.prompt_ids, self.prompt_positions, self.prompt_key_mask, 0
        else:
            ids, positions, key_mask, end = self.block_tokens, self.positions, self.key_mask, self.bucket.slot(block)
        return {"ids": ids, "positions": positions, "key_mask": key_mask,
                "past_key_mask": self.past_key_mask[:, :end], "past_sliding": self.cache_sliding[..., :end, :],
                "past_full": self.cache_full[..., :end, :], "past_positions": self.cache_positions[:, :end]}

    def keep_encoded(self, cache: LayerGroupKV, start: int) -> None:
        """Store the encoder's K/V of cache positions [start, its length) for the `committing` rows, as a
        step does: on the device, whatever the rows (what the decoder may see of it is
        `past_key_mask`'s to say)."""
        end, rows = cache.positions.shape[1], self.committing
        for target, new in ((self.cache_sliding, cache.sliding), (self.cache_full, cache.full)):
            kept = target[..., start:end, :]  # [layers, 2, B, heads, end - start, head_dim]
            kept.copy_(torch.where(rows[:, None, None, None], new[..., start:, :], kept))
        kept = self.cache_positions[:, start:end]
        kept.copy_(torch.where(rows[:, None], cache.positions[:, start:], kept))

    # -- rows in and out (at block boundaries) ------------------------------------------------------
    def reset(self) -> None:
        """Empty the bucket for a new batch: every row inert padding."""
        self.clear_rows(range(self.bucket.batch))

    def place_row(self, slot: int, prompt_mask: Tensor, params: dict[str, Tensor]) -> None:
        """Take a row at its first block into `slot`: the key mask `[P]` of its left-padded prompt (whose
        K/V the encoder wrote) and its policy parameters by buffer name."""
        self.past_key_mask[slot].zero_()
        self.past_key_mask[slot, :self.bucket.prompt] = prompt_mask
        self.prompt_lengths[slot] = prompt_mask.sum()
        for name, value in params.items():
            getattr(self, name)[slot] = value
        self.finished[slot] = False
        for name in ("forwards", "block"):
            getattr(self, name)[slot] = 0

    def take_rows(self, source: UniformState, rows: Sequence[int]) -> None:
        """Fill this bucket with `rows` of `source`, in that order, each row's cache storage moved by
        the difference of the prompt regions (so that its blocks' slots stay `slot(block)`); the other
        rows become padding. `source` is another bucket's state (this one is emptied first)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.block_ids.device)
        count, shift = len(rows), self.bucket.prompt - source.bucket.prompt
        self.reset()
        for name, tensor in self.tensors().items():
            if name in _ENCODER_INPUTS:  # written before each commit; the prompt region's size may differ
                continue
            moved = getattr(source, name).index_select(2 if name in _CACHES else 0, index)
            if name in _CACHES:
                shifted_copy(tensor.narrow(2, 0, count), moved, shift, dim=4)
            elif name in _STORAGE_ROWS:
                shifted_copy(tensor[:count], moved, shift, dim=1)
            else:
                tensor[:count].copy_(moved)

    def clear_rows(self, slots: Sequence[int]) -> None:
        """Make rows `slots` inert padding: finished, done, and seeing no cached key."""
        for slot in slots:
            self.finished[slot] = self.done[slot] = True
            self.past_key_mask[slot].zero_()
            self.forwards[slot] = 0

    def start_blocks(self, vocab_size: int) -> None:
        """Point every row at its current block: fresh random canvas, no draft, no soft tokens."""
        from dlmrt.ops.entropy_bound import initial_canvas

        width = self.bucket.block
        offsets = torch.arange(width, device=self.block_ids.device)
        torch.add((self.prompt_lengths + self.block * width)[:, None], offsets, out=self.positions)
        self.block_ids.copy_(initial_canvas(self.seed, self.positions, vocab_size))
        self.argmax.fill_(-1)
        self.z.zero_()
        self.block_step.zero_()
        self.stable_run.zero_()
        self.done.copy_(self.finished)


_CACHES = ("cache_sliding", "cache_full")  # [layers, 2, B, heads, S, head_dim]
_ENCODER_INPUTS = ("prompt_ids", "prompt_positions", "prompt_key_mask", "block_tokens", "committing")
_STORAGE_ROWS = ("cache_positions", "past_key_mask")  # [B, S]
