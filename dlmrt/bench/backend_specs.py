"""The torch cases `dlmrt bench --backend` names: `torch[:MODE][:fp8]`.

    torch_case("cudagraph:fp8")   # "cudagraph:fp8": captured steps over the blocks' linears in FP8
    torch_case("fp8")             # "auto:fp8"
    torch_case("")                # "auto"
    fp8_model(model)              # the copy of `model` an fp8 case runs (dlmrt/runtime/fp8_linear.py)
"""

from __future__ import annotations

import copy

TORCH_MODES = ("eager", "compile", "cudagraph", "auto")
TORCH_PRECISIONS = ("fp8",)
TORCH_SPEC = f"torch[:{'|'.join(TORCH_MODES)}][:{'|'.join(TORCH_PRECISIONS)}]"


def torch_case(tail: str) -> str | None:
    """A torch case's `MODE` or `MODE:PRECISION` (mode auto where none is given) from what follows
    `torch:` in its spec; None where `tail` names no torch case."""
    parts = tail.split(":") if tail else []
    precision = parts.pop() if parts and parts[-1] in TORCH_PRECISIONS else None
    if len(parts) > 1 or (parts and parts[0] not in TORCH_MODES):
        return None
    mode = parts[0] if parts else "auto"
    return f"{mode}:{precision}" if precision else mode


def split_case(case: str) -> tuple[str, str | None]:
    """`torch_case`'s value as (mode, precision or None)."""
    mode, _, precision = case.partition(":")
    return mode, precision or None


def fp8_model(model):
    """A copy of `model` with its blocks' linear layers in FP8, on the model's device."""
    from dlmrt.runtime import fp8_linear

    quantized = copy.deepcopy(model)
    fp8_linear.quantize_model(quantized)
    return quantized
