"""Static buffers: the tensors a compiled or captured step reads and writes in place.

A bucket's state is a dataclass of tensors allocated once; a warm-up, compile or capture run changes
them, so it saves them first (`snapshot`) and puts them back after (`restore`).
"""

from __future__ import annotations

from dataclasses import fields

from torch import Tensor


class StaticBuffers:
    """A dataclass mixin: its tensor fields are the buffers."""

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor field by name (scratch buffers kept outside the fields are not included)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}

    def snapshot(self) -> dict[str, Tensor]:
        """A copy of every buffer, for `restore` after a warm-up, compile or capture run."""
        return {name: tensor.clone() for name, tensor in self.tensors().items()}

    def restore(self, saved: dict[str, Tensor]) -> None:
        for name, tensor in saved.items():
            getattr(self, name).copy_(tensor)


def shifted_copy(target: Tensor, source: Tensor, shift: int, dim: int) -> None:
    """target[..., i + shift, ...] = source[..., i, ...] along `dim`, where both exist."""
    first = max(0, -shift)
    count = min(source.shape[dim], target.shape[dim] - shift) - first
    if count > 0:
        target.narrow(dim, first + shift, count).copy_(source.narrow(dim, first, count))
