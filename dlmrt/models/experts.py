"""Routed SwiGLU experts stacked per projection, and their grouped forward.

    experts = SwiGLUExperts(num_experts, hidden, inner)  # gate_proj, up_proj [E, I, H], down_proj [E, H, I]
    experts.expert(e, x)                                  # expert e alone: one F.linear per projection
    if grouped_runs(x):
        routed = grouped_routed(experts, x, chosen, weights, partial=False)  # one grouped GEMM per projection

Each stack's row `e` is expert `e`'s `nn.Linear` weight. Checkpoints name every expert's matrices apart
(`experts.5.gate_proj.weight [I, H]`); the state dict is written and read under those names (views of the
stacks when written), so a checkpoint saved before the experts were stacked loads as it is.

The grouped forward sorts the (token, slot) pairs by expert and runs `torch._grouped_mm` with the experts'
row offsets: shapes fixed by the token count, no host read, so CUDA graphs capture it. It runs where
the grouped kernel does (bfloat16 on a CUDA device of compute capability 9.0 or later) and on meta
tensors (the roofline counts it there). On a CPU the family's loop over experts stays: its per-expert
matmuls go through oneDNN when the runtime packs them (`dlmrt.runtime.onednn`), which sums in another
order than the grouped kernel, so only that loop keeps today's bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class StackedLinear(nn.Module):
    """One bias-free linear layer per expert: `weight [experts, out, in]`. Both forms run through the
    module's call, so that hooks and an export's module metadata see each expert's product here."""

    def __init__(self, experts: int, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))

    def forward(self, x: Tensor, expert: int | None = None, offsets: Tensor | None = None) -> Tensor:
        """`x` through row `expert`'s weight; or, given `offsets [E]` (int32, the end of each expert's
        rows), rows sorted by expert through the grouped GEMM."""
        if offsets is not None:
            return torch._grouped_mm(x, self.weight.transpose(1, 2), offs=offsets)
        return F.linear(x, self.weight[expert])


class SwiGLUExperts(nn.Module):
    """`experts` SwiGLU MLPs, stacked. `first` is the global index of row 0 (an expert-parallel rank's
    slice): the state dict names each expert by its global index."""

    def __init__(self, experts: int, hidden: int, inner: int, first: int = 0):
        super().__init__()
        self.num_experts, self.first = experts, first
        self.gate_proj = StackedLinear(experts, hidden, inner)
        self.up_proj = StackedLinear(experts, hidden, inner)
        self.down_proj = StackedLinear(experts, inner, hidden)
        self._register_state_dict_hook(_per_expert_names)
        self.register_load_state_dict_pre_hook(_stacked_names)

    def expert(self, index: int, x: Tensor) -> Tensor:
        """Expert `index` (a row of the stacks) on `x`, in the op order of `layers.SwiGLU`."""
        return self.down_proj(F.silu(self.gate_proj(x, index)) * self.up_proj(x, index), index)

    def forward(self, rows: Tensor, offsets: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(rows, offsets=offsets)) * self.up_proj(rows, offsets=offsets),
                              offsets=offsets)


def _per_expert_names(module: SwiGLUExperts, state: dict, prefix: str, local_metadata) -> None:
    stacks = {name: state.pop(f"{prefix}{name}.weight") for name in PROJECTIONS}
    for row in range(module.num_experts):
        for name in PROJECTIONS:
            state[f"{prefix}{module.first + row}.{name}.weight"] = stacks[name][row]


def _stacked_names(module: SwiGLUExperts, state: dict, prefix: str, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs) -> None:
    for name in PROJECTIONS:
        keys = [f"{prefix}{module.first + row}.{name}.weight" for row in range(module.num_experts)]
        if all(key in state for key in keys):
            state[f"{prefix}{name}.weight"] = torch.stack([state.pop(key) for key in keys])


def grouped_runs(x: Tensor) -> bool:
    """Whether the grouped forward runs for activations `x`: on meta tensors, or where the grouped kernel
    does (bfloat16 on compute capability 9.0 or later)."""
    if x.device.type == "meta":
        return True
    return x.device.type == "cuda" and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9


def grouped_routed(experts: SwiGLUExperts, flat: Tensor, chosen: Tensor, weights: Tensor, partial: bool) -> Tensor:
    """The weighted sum `[N, H]` (in `flat`'s dtype) of the experts chosen for tokens `flat [N, H]` (`chosen`,
    `weights [N, k]`, global expert indices). `partial`: `experts` holds some of the experts (a rank's
    slice); pairs routed to the others contribute nothing."""
    tokens, top_k = chosen.shape
    local = chosen - experts.first
    inside = (local >= 0) & (local < experts.num_experts)
    key = torch.where(inside, local, experts.num_experts).flatten() if partial else local.flatten()
    ordered, order = key.sort(stable=True)  # pairs of other ranks' experts sort last
    bounds = torch.arange(1, experts.num_experts + 1, device=key.device, dtype=key.dtype)
    offsets = torch.searchsorted(ordered, bounds, out_int32=True)
    out = experts(flat.index_select(0, order // top_k), offsets)
    # Back in (token, slot) order, then one batched product with the weights: the same summation order
    # whatever the routing (an index_add's atomics on CUDA would not be), in the weights' precision of
    # the activations' dtype, accumulated in float32 by the GEMM.
    pairs = out.new_empty(out.shape).index_copy_(0, order, out).view(tokens, top_k, -1)
    if partial:  # the grouped GEMM leaves rows past the last offset unwritten
        pairs = pairs.masked_fill(~inside[..., None], 0.0)
    return torch.bmm(weights[:, None].to(out.dtype), pairs).view(tokens, -1)
