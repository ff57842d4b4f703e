"""Fused kernels a GPU runs, for a step on meta tensors, which would run other code without them.

`fused_attention`: attention as the fused kernel (memory-efficient attention, the one a CUDA device
runs for a boolean mask) rather than the math decomposition meta tensors take, which holds the scores
of every head in memory. The mask becomes an additive bias first, as on CUDA.

`grouped_experts`: LLaDA2's routed experts as grouped GEMMs. The family's eager MoE picks the experts
its tokens chose (`unique().tolist()`), which meta tensors cannot answer, and its fixed-shape path runs
every expert on every token, which is not what a fused kernel does. While `grouped_experts` is entered,
each `llada2_moe.MoE` runs its router as it is, then its routed experts as
`torch._grouped_mm(x [tokens * top_k, H], w [E, H, I], offs)`, the op a fused MoE path calls, over
stand-in weights stacked per layer, inside the groups of the expert modules they stand for
(`layers.*.mlp.experts.*.gate_proj`, ...), so that a profile of the eager model joins the same rows.
`op_costs` counts the grouped GEMM's weights as the experts its rows are expected to touch. Around the
GEMMs, the tokens are gathered in expert order and their weighted outputs added back (`layers.*.mlp`):
the least a MoE path that does not fuse them into its GEMMs moves.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dlmrt.bench.step_scopes import GroupScopes, group_name
from dlmrt.core.errors import ArgumentError
from dlmrt.export.models import llada2_moe


class fused_attention(TorchFunctionMode):  # noqa: N801  (used as a context manager, like torch's modes)
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value = args[:3]
        mask = kwargs.get("attn_mask")
        if len(args) > 3 or set(kwargs) - {"attn_mask"} or (mask is not None and mask.dtype != torch.bool):
            raise NotImplementedError("fused_attention stands in for SDPA with a boolean mask, and nothing else")
        bias = None
        if mask is not None:
            blocked, allowed = (torch.full((), value, dtype=query.dtype, device=query.device)
                                for value in (float("-inf"), 0.0))
            bias = torch.where(mask.logical_not(), blocked, allowed).expand(
                query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, False)[0]


def moe_layers(model: nn.Module) -> list[tuple[str, llada2_moe.MoE]]:
    return [(path, module) for path, module in model.named_modules() if isinstance(module, llada2_moe.MoE)]


@contextlib.contextmanager
def grouped_experts(model: nn.Module, scopes: GroupScopes) -> Iterator[list[Tensor]]:
    """Yields the stand-in weights (the roofline counts them as weights)."""
    layers = moe_layers(model)
    if layers and next(model.parameters()).device.type != "meta":
        raise RuntimeError("grouped_experts stands in for the experts' weights on the meta device only")
    if layers and next(model.parameters()).dtype != torch.bfloat16:
        raise ArgumentError("a MoE model's roofline runs its experts as grouped GEMMs, which are bfloat16 only: "
                            "give --dtype bfloat16")
    stand_ins = []
    try:
        for path, moe in layers:
            expert = moe.experts[0]
            hidden, inner = expert.gate_proj.in_features, expert.gate_proj.out_features
            made = dict(dtype=expert.gate_proj.weight.dtype, device="meta")
            weights = (torch.empty(len(moe.experts), hidden, inner, **made),
                       torch.empty(len(moe.experts), hidden, inner, **made),
                       torch.empty(len(moe.experts), inner, hidden, **made))
            stand_ins += weights
            moe.forward = functools.partial(_grouped_forward, moe, weights, scopes, group_name(f"{path}.experts.0"))
        yield stand_ins
    finally:
        for _, moe in layers:
            moe.__dict__.pop("forward", None)


def _grouped_forward(moe: llada2_moe.MoE, weights: tuple[Tensor, Tensor, Tensor], scopes: GroupScopes,
                     experts: str, x: Tensor) -> Tensor:
    gate_w, up_w, down_w = weights
    flat = x.reshape(-1, x.shape[-1])
    chosen, routing = moe.gate(flat)  # [N, k] each
    top_k = chosen.shape[1]
    order = chosen.flatten().argsort()  # the (token, slot) pairs, by expert
    per_expert = torch.zeros(len(moe.experts), dtype=torch.int32, device=x.device).scatter_add_(
        0, chosen.flatten(), torch.ones(chosen.numel(), dtype=torch.int32, device=x.device))
    offs = per_expert.cumsum(0, dtype=torch.int32)
    rows = flat.index_select(0, order // top_k)
    with scopes.scope(f"{experts}.gate_proj"):
        gate = torch._grouped_mm(rows, gate_w, offs=offs)
    with scopes.scope(f"{experts}.up_proj"):
        up = torch._grouped_mm(rows, up_w, offs=offs)
    with scopes.scope(experts):  # SwiGLU's own ops
        inner = F.silu(gate) * up
    with scopes.scope(f"{experts}.down_proj"):
        out = torch._grouped_mm(inner, down_w, offs=offs)
    weighted = out * routing.flatten().index_select(0, order).to(out.dtype)[:, None]
    routed = torch.zeros_like(flat).index_add_(0, order // top_k, weighted)
    y = routed.view_as(x)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(x)
    return y
