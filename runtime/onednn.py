"""Linear layers on oneDNN with prepacked weights: the CPU fast path's matmuls.

Design notes: docs/runtime-modules.md#onednn.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from dlmrt.export.models import Denoiser


def available(model: Denoiser) -> bool:
    """Whether this torch can run the model's linear layers on oneDNN (float32 on a CPU)."""
    return model.device.type == "cpu" and model.dtype == torch.float32 and torch.backends.mkldnn.is_available()


_LIBRARY = torch.library.Library("dlmrt", "FRAGMENT")
_LIBRARY.define("onednn_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor")


def _onednn_linear(x: Tensor, packed_weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight, bias, "none", [], "")


# CompositeExplicitAutograd: the packed weight dispatches as an MkldnnCPU tensor, not a CPU one.
_LIBRARY.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("dlmrt::onednn_linear")
def _(x, packed_weight, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """`nn.Linear` over a weight packed for oneDNN."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.dlmrt.onednn_linear(x, self.packed_weight, self.bias, self.out_features)


def prepack_linears(model: Denoiser) -> Denoiser:
    """A copy of `model` sharing its tensors, with every linear layer on oneDNN (see the module doc)."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    if model.tokenizer is not None:
        shared[id(model.tokenizer)] = model.tokenizer
    packed = copy.deepcopy(model, memo=shared)
    for module in list(packed.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child))
    return packed
