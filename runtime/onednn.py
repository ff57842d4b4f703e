"""Linear layers on oneDNN with prepacked weights: the CPU fast path's matmuls.

torch's CPU matmuls go to its default BLAS (MKL in the PyPI wheels). At the step's shapes (a block
of 32 tokens against weights that do not fit in cache) oneDNN with weights packed once into its
blocked layout runs them 2-3x faster on the AVX-512 machines we measured (`scripts/bench_device_loop.py`
prints both rates), in float32 with float32 accumulation: a different summation order, not a lower
precision. torch.compile's own weight prepacking picks MKL's packed format for float32 on x86, which
is no faster there, so the compile mode packs the weights itself.

`prepack_linears(model)` returns a copy of the denoiser's module tree that shares every tensor with
it, except that each `nn.Linear` becomes a `PackedLinear` holding the packed weight (the one extra
copy of the weights that this costs). The packed matmul is the op `dlmrt::onednn_linear`, so that
torch.compile calls it as it is (inductor lowers oneDNN's own linear only for frozen constants). It is
registered with a plain `torch.library.Library` rather than `torch.library.custom_op`, whose wrapper
costs about 5 us more per call: a tenth of a small step.
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
