"""Expert parallelism (EP): each rank keeps a contiguous slice of every MoE layer's experts.

    check_expert_split(model, world)   # before any rank starts: E divisible by the world, else ArgumentError
    shard_experts(model, ranks)        # in place, on each rank: drop the other ranks' experts

The router stays replicated: every rank routes every token over the full expert set, so the choice
is identical everywhere. Rank r owns experts [r * E/R, (r + 1) * E/R) of each MoE layer and computes
the weighted sum of its experts over the tokens that chose them (eager: only the local experts some
token chose, on just those tokens; in a fixed-shape graph (`in_fixed_shape_graph()`): every local
expert on every token, weighted by the local columns of the routing matrix; LLaDA2 where the grouped
GEMM runs (`dlmrt.models.experts`): the pairs routed to local experts, grouped by expert, the
others masked). One `ranks.all_reduce`
(sum) of that partial output then gives every rank the full routed output. Tokens are not
dispatched: each rank holds all of them (the activations are replicated, as under TP).

The sharded modules replace the originals in place, each holding stacks of E/R rows, copied (the
full stacks are freed): LLaDA2's `MoE` becomes `ExpertParallelMoE` (its state dict names each expert
by its global index, `experts.5.gate_proj.weight`, so a rank's names are the full model's),
DiffusionGemma's `Experts` becomes `ExpertParallelExperts`. Both keep `start`, `stop` (this rank's
experts), `num_experts` (E) and `ranks`. In a fixed-shape graph each rank runs E/R experts on every
token (the single-process graph runs E).

Collectives, per forward of N = batch x length tokens through a model with L MoE layers and hidden
size H, activations of `b` bytes per value (4 for float32, 2 for bfloat16):

    L all_reduce calls of N x H x b bytes each (what `ranks.log` records: the tensor handed in)

LLaDA2: L = num_hidden_layers - first_k_dense_replace. DiffusionGemma: L = num_hidden_layers (every
layer has a MoE; `encode` and `denoise` both run it). A ring all-reduce sends about
2 (R - 1) / R x N x H x b bytes per rank for each call.

LLaDA2's shared experts, the contract with tensor parallelism: the MoE module keeps
`shared_experts` and adds their output to its partial sum *before* the one all-reduce, so the layer
still issues a single collective. `shared_is_partial` says how:

- False (the default, EP only: the shared experts are replicated): only rank 0 adds
  `shared_experts(x)`; the others add nothing, and the sum over ranks counts it once.
- True (set by TP code that has split the shared experts, gate/up column-parallel (their output
  features split), down row-parallel (its input features split), with no all-reduce of their own):
  every rank adds its `shared_experts(x)`, a partial output whose sum over ranks is the shared
  experts' output.

DiffusionGemma's routed output goes through `post_feedforward_layernorm_2`, a nonlinearity, so the
all-reduce sits inside `Experts.forward`, before that norm; its dense MLP is outside this module.

Numerics: the experts' outputs are summed per rank, then across ranks, in another order than the
single-process model's, so float32 logits agree to about 1e-5, not bitwise. The all-reduce carries
the activations' dtype (LLaDA2 sums each rank's experts in float32 and rounds that partial once to
the activations' dtype before the sum, as the single-process model rounds the full sum once). In
bfloat16 that is one more rounding per rank; a routing choice near a tie may then flip downstream.

A world of 1 leaves the model as it is (no collectives).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from dlmrt.core.errors import ArgumentError
from dlmrt.models import diffusion_gemma, llada2_moe
from dlmrt.models.experts import PROJECTIONS, SwiGLUExperts
from dlmrt.models.layers import in_fixed_shape_graph
from dlmrt.parallel.ranks import Ranks


def _moe_modules(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module, int]]:
    """(parent, attribute, module, experts) for each unsharded MoE module of the model."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, (ExpertParallelMoE, ExpertParallelExperts)):
                raise ArgumentError("the model's experts are already sharded (shard_experts was called twice)")
            if isinstance(child, llada2_moe.MoE):
                yield parent, name, child, child.experts.num_experts
            elif isinstance(child, diffusion_gemma.Experts):
                yield parent, name, child, child.gate_up_proj.shape[0]


def allowed_expert_worlds(experts: int) -> list[int]:
    """The --ep values that split `experts` evenly: its divisors."""
    return [world for world in range(1, experts + 1) if experts % world == 0]


def check_expert_split(model: nn.Module, world: int) -> None:
    """Raise ArgumentError (one line) unless every MoE layer's expert count is divisible by `world`."""
    if world < 1:
        raise ArgumentError(f"--ep must be at least 1, got {world}")
    if world == 1:
        return
    counts = sorted({experts for *_, experts in _moe_modules(model)})
    if not counts:
        raise ArgumentError(f"--ep {world}: this {type(model).__name__} model has no MoE layers to split; "
                            f"the allowed --ep value is 1")
    for experts in counts:
        if experts % world:
            allowed = ", ".join(str(w) for w in allowed_expert_worlds(experts))
            raise ArgumentError(f"--ep {world} does not divide the {experts} experts of each MoE layer evenly; "
                                f"allowed --ep values: {allowed}")


def shard_experts(model: nn.Module, ranks: Ranks) -> nn.Module:
    """Keep, in place, only this rank's contiguous slice of each MoE layer's experts (see the module
    docstring for the collectives and the shared-experts contract). Returns `model`."""
    check_expert_split(model, ranks.world)
    if ranks.world == 1:
        return model
    for parent, name, module, experts in list(_moe_modules(model)):
        part = ranks.shard(experts)
        if isinstance(module, llada2_moe.MoE):
            sharded = ExpertParallelMoE(module, ranks, part)
        else:
            sharded = ExpertParallelExperts(module, ranks, part)
        setattr(parent, name, sharded)
    return model


class ExpertParallelMoE(llada2_moe.MoE):
    """LLaDA2's MoE holding experts [start, stop) of `num_experts`: stacks of E/R rows, copied (the full
    stacks are freed), whose state dict names each expert by its global index (`experts.5.gate_proj.weight`),
    as the full model's does; its output is the all-reduced sum of the ranks' partial outputs."""

    def __init__(self, moe: llada2_moe.MoE, ranks: Ranks, part: slice):
        nn.Module.__init__(self)
        self.gate = moe.gate
        full = moe.experts
        self.num_experts, self.start, self.stop = full.num_experts, part.start, part.stop
        self.experts = SwiGLUExperts(part.stop - part.start, full.gate_proj.in_features, full.gate_proj.out_features,
                                     first=part.start)
        for name in PROJECTIONS:
            weight = getattr(full, name).weight
            getattr(self.experts, name).weight = nn.Parameter(weight.detach()[part].clone(),
                                                              requires_grad=weight.requires_grad)
        self.shared_experts = moe.shared_experts
        self.shared_is_partial = False  # see the module docstring: TP sets it
        self.ranks = ranks

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.gate(flat)
        y = self.routed(flat, experts, weights).to(x.dtype).view_as(x)
        if self.shared_experts is not None and (self.shared_is_partial or self.ranks.rank == 0):
            y = y + self.shared_experts(x)
        return self.ranks.all_reduce(y)


class ExpertParallelExperts(diffusion_gemma.Experts):
    """DiffusionGemma's stacked experts, rows [start, stop) of `num_experts` (`gate_up_proj [E/R, 2I, H]`,
    `down_proj [E/R, H, I]`, copies: the full stacks are freed); returns the all-reduced routed sum."""

    def __init__(self, experts: diffusion_gemma.Experts, ranks: Ranks, part: slice):
        nn.Module.__init__(self)
        self.num_experts, self.start, self.stop = experts.gate_up_proj.shape[0], part.start, part.stop
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            setattr(self, name, nn.Parameter(full.detach()[part].clone(), requires_grad=full.requires_grad))
        self.ranks = ranks

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        if in_fixed_shape_graph():
            routing = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
            routing = routing.scatter(1, experts, weights)[:, self.start:self.stop]
            for column in range(self.stop - self.start):
                out = out + (self.expert(column, x) * routing[:, column, None]).to(x.dtype)
        else:
            local = (experts >= self.start) & (experts < self.stop)
            for index in experts[local].unique().tolist():
                token, slot = (experts == index).nonzero(as_tuple=True)
                out.index_add_(0, token, (self.expert(index - self.start, x[token]) * weights[token, slot, None])
                               .to(x.dtype))
        return self.ranks.all_reduce(out)
