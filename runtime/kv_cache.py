"""The K/V cache of one request.

Allocated once when the request starts, for its whole canvas (prompt plus
generated blocks), so a step never allocates cache memory; its valid length
advances by whole blocks (or the whole canvas at a refresh), and it is freed
with the request. Rows of finished requests are dropped at block boundaries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dlmrt.runtime.backend import ModelSpec


class KVCache:
    def __init__(self, spec: ModelSpec, rows: int, capacity: int):
        self.storage = torch.zeros(spec.num_layers, 2, rows, spec.num_kv_heads, capacity, spec.head_dim,
                                   dtype=spec.dtype, device=spec.device)
        self.length = 0  # canvas positions [0, length) hold valid K/V

    def write(self, window_kv: Tensor, start: int, end: int, *, window_start: int) -> None:
        """Store the K/V of canvas positions [start, end) from a step over a window at window_start."""
        self.storage[:, :, :, :, start:end] = window_kv[:, :, :, :, start - window_start:end - window_start]
        self.length = max(self.length, end)

    def prefix(self, end: int) -> Tensor:
        """K/V of positions [0, end), a view."""
        return self.storage[:, :, :, :, :end]

    def around(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """K/V of every cached position outside [start, end) (prefix then suffix), and their indices."""
        index = torch.cat((torch.arange(start), torch.arange(end, self.length))).to(self.storage.device)
        return self.storage.index_select(4, index), index

    def keep(self, rows: Tensor) -> None:
        self.storage = self.storage[:, :, rows]
