"""The step graph as a torch module: the denoiser forward over a window, fused with
`dlmrt::ParallelUnmask` on the block inside it (DESIGN.md, "Step graph").

Two graphs cover every cache mode:

- `full`: no cached prefix. The whole canvas (cache none, and the refresh forward of the
  bidirectional caches), or for block-causal models everything up to the block's end;
- `cached`: a window over a cached prefix (prefix and dual caches, the exact block cache).

Both return the window's K/V, so either can write the cache. The block is given as window indices
(`block_index`), so one graph serves every block position and block length. Classifier-free
guidance is not part of the graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dlmrt.export.models import Denoiser
from dlmrt.export.models.denoiser import PastKV
from dlmrt.export.models.residual import Residual
from dlmrt.plugins.parallel_unmask import torch_op  # noqa: F401  (registers torch.ops.dlmrt.parallel_unmask)

GRAPHS = ("full", "cached")
POLICY_INPUTS = ("count", "threshold", "factor", "temperature", "seed", "step", "measure")


def input_names(graph: str, residual: bool) -> list[str]:
    names = ["ids", "positions", "key_mask", "block_index", *POLICY_INPUTS]
    if graph == "cached":
        names += ["past_kv", "past_positions", "past_key_mask"]
    if residual:
        names += ["z", "certainty"]
    return names


def output_names(residual: bool) -> list[str]:
    return ["new_ids", "confidence", "commit", "committed", "kv", *(["next_z", "next_certainty"] if residual else [])]


class StepGraph(nn.Module):
    def __init__(self, model: Denoiser, graph: str, grid: int | None):
        super().__init__()
        self.model, self.graph, self.grid = model, graph, grid
        self.residual = model.residual_config is not None

    def forward(self, ids: Tensor, positions: Tensor, key_mask: Tensor, block_index: Tensor, count: Tensor,
                threshold: Tensor, factor: Tensor, temperature: Tensor, seed: Tensor, step: Tensor,
                measure: Tensor, past_kv: Tensor | None = None, past_positions: Tensor | None = None,
                past_key_mask: Tensor | None = None, z: Tensor | None = None,
                certainty: Tensor | None = None) -> tuple[Tensor, ...]:
        past = None
        if self.graph == "cached":
            past = PastKV(past_kv, past_positions)
            key_mask = torch.cat((past_key_mask, key_mask), dim=1)
        residual = Residual(z, certainty) if self.residual else None
        out = self.model.denoise(ids, positions=positions, key_mask=key_mask, past=past, residual=residual,
                                 return_kv=True, block_length=self.grid, logits_index=block_index)
        unmasked = torch.ops.dlmrt.parallel_unmask(
            out.logits.float(), ids.index_select(1, block_index), positions.index_select(1, block_index),
            count, threshold, factor, temperature, seed, step, measure, self.model.tokens.mask_id)
        extra = (out.residual.z, out.residual.certainty) if self.residual else ()
        return (*unmasked, out.kv, *extra)
