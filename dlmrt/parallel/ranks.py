"""`Ranks`: this process's place in a tensor-parallel group, and the collectives a step issues.

The collectives are torch's functional ones (`torch.distributed._functional_collectives`), which
dynamo traces into a compiled step (`torch.compile(fullgraph=True)`) and a CUDA graph captures. After
`count()`, each call in eager mode is also written to `log`, so that a test can count the bytes a step
moves; without it nothing is recorded, so a long run holds nothing per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor


@dataclass
class CollectiveLog:
    """What a rank handed to collectives while eager: one (op, bytes) entry per call."""

    calls: list[tuple[str, int]] = field(default_factory=list)

    def record(self, op: str, tensor: Tensor) -> None:
        if not torch.compiler.is_compiling():
            self.calls.append((op, tensor.numel() * tensor.element_size()))

    def bytes(self, op: str | None = None) -> int:
        return sum(size for name, size in self.calls if op is None or name == op)


@dataclass
class Ranks:
    """Rank `rank` of `world` on `group` (the default group when None)."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None
    log: CollectiveLog | None = None  # see count()

    @classmethod
    def current(cls) -> Ranks:
        """The ranks of the initialized default process group."""
        return cls(dist.get_rank(), dist.get_world_size())

    def count(self) -> CollectiveLog:
        """Record every collective from now on, in a fresh log."""
        self.log = CollectiveLog()
        return self.log

    def _group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """The sum of `tensor` over the ranks."""
        if self.log is not None:
            self.log.record("all_reduce", tensor)
        return funcol.all_reduce(tensor, "sum", self._group())

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Every rank's `tensor`, stacked in rank order: `[world, *tensor.shape]`."""
        if self.log is not None:
            self.log.record("all_gather", tensor)
        gathered = funcol.all_gather_single(tensor.contiguous(), 0, self._group())
        return gathered.view(self.world, *tensor.shape)

    def shard(self, size: int) -> slice:
        """This rank's contiguous part of `size` items (`size` divisible by the world)."""
        part = size // self.world
        return slice(self.rank * part, (self.rank + 1) * part)
