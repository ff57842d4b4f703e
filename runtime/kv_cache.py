"""The K/V cache of one request.

Allocated once per request, for its whole canvas (prompt plus generated blocks), so a step never
allocates cache memory; its valid length advances by whole blocks (or the whole canvas at a
refresh), and it is freed with the request. Rows of finished requests are dropped at block
boundaries.

A refresh of the whole canvas is not copied at once: the cache keeps a reference to the step's
K/V output and copies it only when a later step reads the cache. Under a confident policy a
block often finishes in its refresh step, and the copy is never needed. The reference stays
valid because the backend only overwrites that output in a step of the same shapes, and the
only such step is the next refresh, which replaces the whole cache anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dlmrt.runtime.backend import ModelSpec


class KVCache:
    def __init__(self, spec: ModelSpec, rows: int, capacity: int):
        self.shape = (spec.num_layers, 2, rows, spec.num_kv_heads, capacity, spec.head_dim)
        self.dtype, self.device = spec.dtype, spec.device
        self._storage: Tensor | None = None
        self._pending: Tensor | None = None  # a refresh not yet copied into the storage
        self.length = 0  # canvas positions [0, length) hold valid K/V

    @property
    def storage(self) -> Tensor:
        if self._storage is None:
            self._storage = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if self._pending is not None:
            self._storage.copy_(self._pending)
            self._pending = None
        return self._storage

    def write(self, window_kv: Tensor, start: int, end: int, *, window_start: int) -> None:
        """Store the K/V of canvas positions [start, end) from a step over a window at window_start."""
        if (start, end, window_start) == (0, self.shape[4], 0) and window_kv.shape == self.shape:
            self._pending, self.length = window_kv, end
            return
        self.storage[:, :, :, :, start:end] = window_kv[:, :, :, :, start - window_start:end - window_start]
        self.length = max(self.length, end)

    def prefix(self, end: int) -> Tensor:
        """K/V of positions [0, end), a view."""
        return self.storage[:, :, :, :, :end]

    def around(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """K/V of every cached position outside [start, end) (prefix then suffix), and their indices."""
        index = torch.cat((torch.arange(start), torch.arange(end, self.length))).to(self.device)
        return self.storage.index_select(4, index), index

    def keep(self, rows: Tensor) -> None:
        if self._storage is not None or self._pending is not None:
            self._storage = self.storage[:, :, rows]
            self.shape = tuple(self._storage.shape)
