"""FP8 linear layers for the torch path: e4m3 weights with a scale per output channel, activations
quantized per token at each call, the product through `torch._scaled_mm`.

    kernel = fp8_linear.kernel_for(model.device)     # "scaled_mm", "dequantize", or one clear error
    swapped = fp8_linear.quantize_model(model)       # in place: the blocks' nn.Linears become Fp8Linear

Only the Linears inside `model.blocks()` are swapped. The embeddings, the LM head and the ORL adapter
keep the model's dtype: the head's logits are the confidences the unmasking policy thresholds, the head
is a small share of a large model's weights (LLaDA-8B: 1.0 of 8.0 GB a step in bf16), and the floor
issue 47 sets (about 8 GB a step at LLaDA-8B) is the one with a bf16 head. A MoE router is no Linear
and stays too. Cast the model (`.to(dtype)`) before quantizing: a cast afterwards would cast the e4m3
weights as well.

Scales are computed once (weights) or on the device (activations: amax over each token's features), so
a step has no host read and CUDA graphs capture it as it is. Design notes: docs/fp8.md.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dlmrt.core.errors import ArgumentError

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value
# _scaled_mm on CUDA needs both dimensions of the weight to be multiples of 16
ALIGNMENT = 16
# The smallest amax a scale is taken from: an all-zero row quantizes to zeros at any positive scale
_MIN_AMAX = 1e-12
KERNELS = ("scaled_mm", "dequantize")
# _scaled_mm on a GPU: e4m3 tensor cores from compute capability 8.9 (Ada, Hopper and later)
MIN_CAPABILITY = (8, 9)


def quantize_rows(t: Tensor) -> tuple[Tensor, Tensor]:
    """(e4m3 values, float32 scales [rows, 1]) of a 2-D tensor, one scale per row: amax / 448, so that
    each row's largest |value| maps to e4m3's largest finite value."""
    # Four kernels in all, each run per call on the activations. No clamp before the cast: |t| <= amax makes
    # |t / scale| at most 448 up to rounding, which e4m3's round to nearest takes to 448.
    amax = torch.linalg.vector_norm(t, ord=float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp_min(_MIN_AMAX) / E4M3_MAX
    return (t / scale).to(FP8), scale


def dequantize_rows(values: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The inverse of `quantize_rows`, in `dtype`."""
    return (values.float() * scale).to(dtype)


def _scaled_mm_runs(device: torch.device) -> bool:
    """Whether this torch runs `_scaled_mm` on `device` with per-row and per-column scales."""
    try:
        a = torch.ones(ALIGNMENT, ALIGNMENT, device=device).to(FP8)
        ones = torch.ones(ALIGNMENT, 1, device=device)
        torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def kernel_for(device: torch.device | str) -> str:
    """The product an Fp8Linear runs on `device`: `scaled_mm` where torch runs it there (a GPU of compute
    capability 8.9 or newer; a CPU whose torch has it; the meta device), else on a CPU `dequantize` (the
    e4m3 values times their scales in the compute dtype, then a plain matmul). Anything else is refused."""
    device = torch.device(device)
    if device.type == "meta":
        return "scaled_mm"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        name = f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
        if capability < MIN_CAPABILITY:
            raise ArgumentError(f"--precision fp8 needs a GPU of compute capability 8.9 or newer (FP8 tensor "
                                f"cores); {name}: drop --precision fp8")
        if not _scaled_mm_runs(device):
            raise ArgumentError(f"torch {torch.__version__} runs no row-wise scaled FP8 matmul (_scaled_mm) on this "
                                f"GPU ({name}): drop --precision fp8, or use a torch that does")
        return "scaled_mm"
    if device.type == "cpu":
        return "scaled_mm" if _scaled_mm_runs(device) else "dequantize"
    raise ArgumentError(f"--precision fp8 runs on CUDA (compute capability 8.9 or newer) or a CPU, not on "
                        f"{device.type}: give --device cuda or cpu, or drop --precision fp8")


class Fp8Linear(nn.Module):
    """An `nn.Linear` with its weight in e4m3 and a float32 scale per output channel; each call quantizes
    its input per token (per row of the flattened input) and returns the model's dtype."""

    def __init__(self, linear: nn.Linear, kernel: str):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"unknown fp8 kernel {kernel!r}: give one of {', '.join(KERNELS)}")
        self.in_features, self.out_features, self.kernel = linear.in_features, linear.out_features, kernel
        self.dtype = linear.weight.dtype
        values, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_fp8", values)  # [N, K]
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())  # [1, N]: scale_b's layout
        self.register_parameter("bias", linear.bias)
        # CUDA's row-wise scaled product writes bfloat16 only; the CPU's writes the model's dtype
        self.product_dtype = torch.bfloat16 if linear.weight.device.type == "cuda" else self.dtype

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        values, scale = quantize_rows(rows)  # [M, K], [M, 1]
        if self.kernel == "scaled_mm":
            # weight_fp8.t() is column-major, the layout _scaled_mm takes for its second operand
            y = torch._scaled_mm(values, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale,
                                 out_dtype=self.product_dtype).to(self.dtype)
        else:  # the reference: dequantized each call, so that the e4m3 weight stays the only copy
            weight = dequantize_rows(self.weight_fp8, self.weight_scale.t(), self.dtype)
            y = dequantize_rows(values, scale, self.dtype) @ weight.t()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def fp8_candidates(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linears `quantize_model` swaps, by name: plain `nn.Linear`s inside the model's blocks whose
    dimensions are multiples of 16."""
    inside = {id(m) for block in model.blocks() for m in block.modules()}
    return {name: m for name, m in model.named_modules()
            if id(m) in inside and type(m) is nn.Linear
            and m.in_features % ALIGNMENT == 0 and m.out_features % ALIGNMENT == 0}


def quantize_model(model: nn.Module, kernel: str | None = None) -> list[str]:
    """Swap `fp8_candidates(model)` for Fp8Linears in place (`kernel`: default `kernel_for` the model's
    device); returns the swapped names."""
    kernel = kernel or kernel_for(model.device)
    candidates = fp8_candidates(model)
    if not candidates:
        raise ArgumentError(f"{model.name} has no linear layer in its blocks with both dimensions multiples of "
                            f"{ALIGNMENT}: it cannot run in fp8; drop --precision fp8")
    with torch.no_grad():
        for name, linear in candidates.items():
            model.set_submodule(name, Fp8Linear(linear, kernel))
    return list(candidates)
