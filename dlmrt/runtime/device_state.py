"""A request's whole decoding state, in static buffers owned per shape bucket.

A bucket is a batch size and a canvas length (whole blocks) for one block length; every buffer of
its `DeviceState` is allocated once, and its address never changes, so a graph compiled or captured
on a bucket stays valid for every request that runs in it. Buckets form a ladder (`BucketLadder`):
batches of 1, 2, 4, 8, ... rows up to the largest, canvases of whole blocks. A request is padded up
to its bucket, and padding is inert:

- padded rows hold pad tokens, visible to themselves only and never masked, so they never commit and
  never touch a real row (rows are independent in every op of the step);
- padded canvas positions are extra left padding (key mask False), which no real position attends to
  and which counts no position (positions count each row's real tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dlmrt.core import limits
from dlmrt.runtime.buckets import Bucket
from dlmrt.runtime.model_spec import ModelSpec
from dlmrt.runtime.layout import Layout
from dlmrt.runtime.static_buffers import StaticBuffers, shifted_copy


@dataclass
class WindowBuffers:
    """The inputs of one window length, gathered from the state before each step that uses it (a
    window that is the whole canvas reads the state itself)."""

    index: Tensor  # [W] canvas index of each window position
    ids: Tensor  # [B, W]
    positions: Tensor  # [B, W]
    key_mask: Tensor  # [B, W]
    z: Tensor | None  # [B', W, H]
    certainty: Tensor | None  # [B', W]


@dataclass
class DeviceState(StaticBuffers):
    """The static buffers of one bucket (shapes: B rows, B' model rows, L canvas positions)."""

    bucket: Bucket
    mask_id: int
    pad_id: int
    canvas: Tensor  # [B, L] int64: pads, prompts, committed tokens and masks
    positions: Tensor  # [B, L] int64
    key_mask: Tensor  # [B, L] bool: False on padding
    prompt_lengths: Tensor  # [B] int64 (guidance masks each row's prompt)
    # per-row policy parameters (UnmaskParams, plus the confidence measure's code)
    count: Tensor  # [B] int64: this step's minimum commits, read from the schedule
    threshold: Tensor  # [B] float32
    factor: Tensor  # [B] float32
    temperature: Tensor  # [B] float32
    seed: Tensor  # [B] int64
    step: Tensor  # [B] int64: steps that did work for the row (its random stream)
    measure: Tensor  # [B] int64
    # token editing (LLaDA2.1): the threshold (inf: the row does not edit; None: the graphs predate
    # editing), the editing-only steps a row may take once its block has no mask, those it has left
    # in the current block, and the tokens it has overwritten
    max_post_steps: Tensor  # [B] int64
    post_steps: Tensor  # [B] int64
    edits: Tensor  # [B] int64
    schedule: Tensor  # [B, block] int64: the current block's minimum commits at each of its steps
    block_start: Tensor  # [] int64: canvas index of the current block
    block_step: Tensor  # [B] int64: steps taken in the current block
    cfg_scale: Tensor  # [1] float32
    # [B + 1] int64: each row's work left in its block (its masked positions, or 1 while it may still
    # take an editing-only step), then the forwards that did work
    status: Tensor
    block_index: Tensor  # [block] int64 scratch: the block's indices inside the step's window
    edit_threshold: Tensor | None = None  # [B] float32
    z: Tensor | None = None  # [B', L, H] ORL residual
    certainty: Tensor | None = None  # [B', L]
    kv: Tensor | None = None  # [layers, 2, B', kv heads, L, head dim]
    cache_valid: Tensor | None = None  # [L] bool: the cache positions that hold K/V
    past_key_mask: Tensor | None = None  # [B, L] bool scratch: the cache positions a step attends to
    # Once a row asks for logprobs (`allocate_logprobs`): each token the current block's steps put, its
    # log-probability at the step that put it, and the K most likely tokens there (the mask aside)
    logprob: Tensor | None = None  # [B, block] float32
    top_logprob: Tensor | None = None  # [B, block, K] float32
    top_token: Tensor | None = None  # [B, block, K] int64
    windows: dict[int, WindowBuffers] = field(default_factory=dict)

    @staticmethod
    def estimated_bytes(spec: ModelSpec, bucket: Bucket) -> int:
        """The bucket's largest buffers, and a step's largest transients: the K/V storage, the ORL
        residual, one layer's attention scores over the canvas and the block's float32 logits."""
        rows, length, item = bucket.model_rows, bucket.canvas, torch.tensor([], dtype=spec.dtype).element_size()
        kv = spec.num_layers * 2 * rows * spec.num_kv_heads * length * spec.head_dim * item if bucket.cached else 0
        residual = rows * length * spec.hidden_size * item if spec.has_residual else 0
        heads = max(1, spec.hidden_size // spec.head_dim)
        return kv + residual + rows * heads * length * length * 4 + rows * bucket.block * spec.vocab_size * 4

    @classmethod
    def allocate(cls, spec: ModelSpec, bucket: Bucket) -> DeviceState:
        limits.check_fits(cls.estimated_bytes(spec, bucket),
                          f"a batch of {bucket.batch} over {bucket.canvas} positions ({spec.name})", spec.device,
                          "decode fewer prompts at once (--batch-size, --max-batch), or shorter ones")
        rows, length, device = bucket.batch, bucket.canvas, spec.device
        long = dict(dtype=torch.long, device=device)
        real = dict(dtype=torch.float32, device=device)
        state = cls(
            bucket=bucket, mask_id=spec.mask_id, pad_id=spec.pad_id, canvas=torch.zeros(rows, length, **long),
            positions=torch.zeros(rows, length, **long),
            key_mask=torch.zeros(rows, length, dtype=torch.bool, device=device),
            prompt_lengths=torch.zeros(rows, **long), count=torch.zeros(rows, **long),
            threshold=torch.zeros(rows, **real), factor=torch.zeros(rows, **real),
            temperature=torch.zeros(rows, **real), seed=torch.zeros(rows, **long), step=torch.zeros(rows, **long),
            measure=torch.zeros(rows, **long), max_post_steps=torch.zeros(rows, **long),
            post_steps=torch.zeros(rows, **long), edits=torch.zeros(rows, **long),
            schedule=torch.zeros(rows, bucket.block, **long),
            block_start=torch.zeros((), **long), block_step=torch.zeros(rows, **long),
            cfg_scale=torch.zeros(1, **real), status=torch.zeros(rows + 1, **long),
            block_index=torch.zeros(bucket.block, **long))
        if spec.supports_editing:
            state.edit_threshold = torch.full((rows,), float("inf"), **real)
        model_rows = bucket.model_rows
        if spec.has_residual:
            state.z = torch.zeros(model_rows, length, spec.hidden_size, dtype=spec.dtype, device=device)
            state.certainty = torch.zeros(model_rows, length, dtype=spec.dtype, device=device)
        if bucket.cached:
            state.kv = torch.zeros(spec.num_layers, 2, model_rows, spec.num_kv_heads, length, spec.head_dim,
                                   dtype=spec.dtype, device=device)
            state.cache_valid = torch.zeros(length, dtype=torch.bool, device=device)
            state.past_key_mask = torch.zeros(rows, length, dtype=torch.bool, device=device)
        return state

    def allocate_logprobs(self, alternatives: int) -> None:
        """The logprob buffers, with `alternatives` most likely tokens a position (allocated on first use)."""
        if self.logprob is None:
            rows, block, device = self.bucket.batch, self.bucket.block, self.canvas.device
            self.logprob = torch.zeros(rows, block, dtype=torch.float32, device=device)
            self.top_logprob = torch.zeros(rows, block, alternatives, dtype=torch.float32, device=device)
            self.top_token = torch.zeros(rows, block, alternatives, dtype=torch.long, device=device)

    def window(self, length: int) -> WindowBuffers:
        """The gather buffers of a window of `length` positions (allocated on first use)."""
        if length not in self.windows:
            rows, model_rows, device = self.bucket.batch, self.bucket.model_rows, self.canvas.device
            z = certainty = None
            if self.z is not None:
                z = self.z.new_zeros(model_rows, length, self.z.shape[-1])
                certainty = self.certainty.new_zeros(model_rows, length)
            self.windows[length] = WindowBuffers(
                index=torch.zeros(length, dtype=torch.long, device=device),
                ids=self.canvas.new_zeros(rows, length), positions=self.positions.new_zeros(rows, length),
                key_mask=self.key_mask.new_zeros(rows, length), z=z, certainty=certainty)
        return self.windows[length]

    # -- rows in and out (at block boundaries) ------------------------------------------------------
    def reset(self, cfg_scale: float) -> None:
        """Empty the bucket for a new batch: every row inert padding, no valid K/V, no forward counted."""
        self._pad(0)
        self.status[-1].zero_()
        self.cfg_scale.fill_(cfg_scale)
        if self.cache_valid is not None:  # the storage keeps an earlier batch's K/V, masked out
            self.cache_valid.zero_()

    def place_row(self, slot: int, layout: Layout, origin: int, params: dict[str, float | int]) -> None:
        """Load the one-row `layout` into row `slot` (a padding row: a free slot), its canvas starting at
        canvas index `origin`, with its policy parameters; the rest of the row is padding. No residual
        before its first step."""
        length = layout.length
        if origin < 0 or origin + length > self.bucket.canvas:
            raise ValueError(f"a row of {length} positions at {origin} does not fit the bucket {self.bucket}")
        self._blank([slot])
        for name, value in (("canvas", layout.ids), ("key_mask", layout.key_mask), ("positions", layout.positions)):
            getattr(self, name)[slot, origin:origin + length].copy_(value[0])
        self.prompt_lengths[slot] = int(layout.prompt_lengths[0])
        for name, value in params.items():
            if getattr(self, name) is not None:
                getattr(self, name)[slot] = value
        for name in ("step", "block_step", "status", "post_steps", "edits"):
            getattr(self, name)[slot] = 0

    def take_rows(self, source: DeviceState, rows: Sequence[int], shift: int = 0) -> None:
        """Fill this bucket with `rows` of `source`, in that order, each row's canvas moved `shift`
        positions right (left when negative); the other rows become padding. `source` may be this
        state. What moves off the canvas must be padding (the caller places rows so)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.canvas.device)
        count = len(rows)
        moved = {name: getattr(source, name).index_select(0, index) for name in _ROW_BUFFERS
                 if getattr(source, name) is not None}
        status, forwards = source.status.index_select(0, index), source.status[-1].clone()
        halves = {name: [half.index_select(0, index) for half in source._model_halves(name)]
                  for name in ("z", "certainty", "kv")}
        shared = {name: getattr(source, name).clone() for name in ("block_start", "cfg_scale", "cache_valid")
                  if getattr(source, name) is not None}
        self._pad(0)
        self._blank(range(count))
        for name, value in moved.items():
            target = getattr(self, name)[:count]
            if name in _CANVAS_BUFFERS:
                shifted_copy(target, value, shift, dim=1)
            else:
                target.copy_(value)
        self.status[:count].copy_(status)
        self.status[-1].copy_(forwards)
        for name, parts in halves.items():
            for target, origin in zip(self._model_halves(name), parts):
                shifted_copy(target.narrow(0, 0, count), origin, shift, dim=4 if name == "kv" else 1)
        for name, value in shared.items():
            if name == "cache_valid":
                self.cache_valid.zero_()
                shifted_copy(self.cache_valid, value, shift, dim=0)
            else:
                getattr(self, name).copy_(value)

    def clear_rows(self, slots: Sequence[int]) -> None:
        """Make rows `slots` inert padding (rows that left the batch)."""
        for slot in slots:
            self._pad(slot, slot + 1)

    def _blank(self, slots) -> None:
        """Rows `slots` as a real row's padding: pad tokens no position sees. Their residual is already
        zero: every free slot is a padding row (`_pad`)."""
        for slot in slots:
            self.canvas[slot].fill_(self.pad_id)
            self.key_mask[slot].fill_(False)
            self.positions[slot].zero_()

    def _pad(self, start: int, end: int | None = None) -> None:
        """Make rows [start, end) inert: pad tokens that see only themselves, no mask to commit, and no
        residual. Their K/V is left as it is: zeroing the storage costs a pass over its largest buffer,
        and no step reads K/V before a forward wrote it (a batch starts, and a row joins, on a block
        whose first step writes every position it later reads; `cache_valid` masks the rest)."""
        end = self.bucket.batch if end is None else end
        self.canvas[start:end].fill_(self.pad_id)
        self.key_mask[start:end].fill_(True)
        self.positions[start:end].copy_(torch.arange(self.bucket.canvas, device=self.canvas.device))
        for name in (*_ZERO_IN_PADDING, "status"):
            if getattr(self, name) is not None:
                getattr(self, name)[start:end].zero_()
        for name in ("z", "certainty"):
            for half in self._model_halves(name):
                half.narrow(0, start, end - start).zero_()

    def _model_halves(self, name: str) -> list[Tensor]:
        """A model-row buffer as views with rows first: one per half (conditional, unconditional)."""
        tensor = getattr(self, name)
        if tensor is None:
            return []
        rows_first = tensor.transpose(0, 2) if name == "kv" else tensor
        return list(rows_first.split(self.bucket.batch)) if self.bucket.guided else [rows_first]


# Buffers with one entry per row on their first axis (the status has one more: the forward counter).
_ZERO_IN_PADDING = ("prompt_lengths", "count", "threshold", "factor", "temperature", "seed", "step", "measure",
                    "schedule", "block_step", "edit_threshold", "max_post_steps", "post_steps", "edits")
_CANVAS_BUFFERS = ("canvas", "key_mask", "positions")  # [B, L]: a row's canvas moves with it
_ROW_BUFFERS = (*_CANVAS_BUFFERS, *_ZERO_IN_PADDING)

