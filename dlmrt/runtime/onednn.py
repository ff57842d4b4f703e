"""Linear layers on oneDNN with prepacked weights: the CPU path's matmuls, eager and compiled.

    packed = PackedModel(model)   # a copy sharing model's tensors, its larger linears packed for oneDNN
    packed.refresh()              # re-pack what changed in `model` since

Design notes: docs/runtime-modules.md#onednn.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from dlmrt.models import Denoiser
from dlmrt.models.experts import StackedLinear

# Below this many weights a linear layer runs faster on torch's default BLAS: a oneDNN call costs about
# 10 us more before any arithmetic (docs/runtime-modules.md#onednn has the crossover).
MIN_PACKED_WEIGHTS = 1 << 16


def available(model: Denoiser) -> bool:
    """Whether this torch can run the model's linear layers on oneDNN (float32 on a CPU)."""
    return model.device.type == "cpu" and model.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def worth_packing(module: nn.Module) -> bool:
    """A plain `nn.Linear` (not a subclass, whose forward may do more) with enough weights, or stacked
    experts' linears with enough weights each."""
    if type(module) is StackedLinear:
        return module.weight[0].numel() >= MIN_PACKED_WEIGHTS
    return type(module) is nn.Linear and module.weight.numel() >= MIN_PACKED_WEIGHTS


def packed_twin(module: nn.Module) -> nn.Module:
    return PackedExperts(module) if isinstance(module, StackedLinear) else PackedLinear(module)


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
        self.register_parameter("bias", linear.bias)
        self.pack(linear.weight)

    def pack(self, weight: Tensor) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self._packed_from = (weight, _version(weight))  # a tuple: a Parameter attribute would register

    def stale(self, weight: Tensor) -> bool:
        packed_from, version = self._packed_from
        return weight is not packed_from or _version(weight) != version

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.dlmrt.onednn_linear(x, self.packed_weight, self.bias, self.out_features)


class PackedExperts(StackedLinear):
    """Stacked experts' linears, each expert's weight packed for oneDNN: expert `e` as a `PackedLinear` of
    that expert computes it (the stack itself stays, shared, for the grouped form)."""

    def __init__(self, stacked: StackedLinear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = stacked.in_features, stacked.out_features
        self.register_parameter("weight", stacked.weight)
        self.pack(stacked.weight)

    def pack(self, weight: Tensor) -> None:
        self.packed_weights = [torch.ops.mkldnn._reorder_linear_weight(row) for row in weight.detach()]
        self._packed_from = (weight, _version(weight))  # a tuple: a Parameter attribute would register
        if weight is not self.weight:
            self.register_parameter("weight", weight)

    stale = PackedLinear.stale

    def forward(self, x: Tensor, expert: int | None = None, offsets: Tensor | None = None) -> Tensor:
        if offsets is not None:
            return super().forward(x, offsets=offsets)
        return torch.ops.dlmrt.onednn_linear(x, self.packed_weights[expert], None, self.out_features)


def _version(tensor: Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version  # an inference tensor cannot change in place


class PackedModel:
    """A copy of a denoiser's module tree that shares its tensors and every other object its modules hold
    (a tokenizer, a tensor-parallel group), except that each linear layer worth packing becomes a
    `PackedLinear` (the one extra copy of those weights this costs)."""

    def __init__(self, model: Denoiser):
        self.model = copy.deepcopy(model, memo=_shared_objects(model))
        self._slots: list[tuple[nn.Module, str, nn.Module]] = []  # (model's module, tensor name, the copy's)
        for name, module in model.named_modules():
            twin = self.model.get_submodule(name)
            for child_name, child in module.named_children():
                if worth_packing(child):
                    setattr(twin, child_name, packed_twin(child))
            self._slots += [(module, leaf, twin) for leaf in (*module._parameters, *module._buffers)]

    def refresh(self) -> None:
        """Bring the copy up to date with the model: re-pack a weight written in place or replaced, and
        take any other tensor the model was given since."""
        for module, leaf, twin in self._slots:
            tensor = getattr(module, leaf)
            if isinstance(twin, (PackedLinear, PackedExperts)) and leaf == "weight":
                if twin.stale(tensor):
                    twin.pack(tensor)
            elif getattr(twin, leaf) is not tensor:
                (twin._parameters if leaf in twin._parameters else twin._buffers)[leaf] = tensor


def _shared_objects(model: Denoiser) -> dict[int, object]:
    """A deepcopy memo under which only modules and the containers that may hold them are copied: the
    tensors and every other attribute of a module stay the model's own."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for module in model.modules():
        for value in vars(module).values():
            if not isinstance(value, (nn.Module, list, tuple, dict)):
                shared[id(value)] = value
    return shared
