"""A fused kernel a GPU runs, for a step on meta tensors, which would run other code without it.

`fused_attention`: attention as the fused kernel (memory-efficient attention, the one a CUDA device
runs for a boolean mask) rather than the math decomposition meta tensors take, which holds the scores
of every head in memory. The mask becomes an additive bias first, as on CUDA.

LLaDA2's routed experts need no stand-in: on meta tensors the family runs its own grouped forward
(`dlmrt.models.experts`), the one a CUDA device runs; `check_moe_dtype` refuses the dtypes its
kernel does not take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dlmrt.core.errors import ArgumentError
from dlmrt.models import llada2_moe


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


def check_moe_dtype(model: nn.Module) -> None:
    if moe_layers(model) and next(model.parameters()).dtype != torch.bfloat16:
        raise ArgumentError("a MoE model's roofline runs its experts as grouped GEMMs, which are bfloat16 only: "
                            "give --dtype bfloat16")
