"""FLOP formulas for the ops torch's FLOP registry misses, shared by the bench gate's counter
(`counted.flop_counter`) and the roofline (`op_costs`).

Each formula takes the op's arguments with tensors replaced by their shapes, and `out_shape`, as
torch's registry formulas do (`torch.utils.flop_counter.shape_wrapper`).
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import flop_registry, sdpa_flop_count, shape_wrapper


def _attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """The CPU's flash attention, counted as the other attention kernels are."""
    return sdpa_flop_count(query, key, value)


def _packed_linear(x, packed_weight, bias, out_features, *args, out_shape=None, **kwargs) -> int:
    """A oneDNN linear of the CPU path (dlmrt/runtime/onednn.py), counted as the linear it stands for."""
    return 2 * math.prod(x) * out_features


def _grouped_mm(a, b, *args, out_shape=None, **kwargs) -> int:
    """`torch._grouped_mm`: every row of `a` meets one group's matrix, 2 * M * K * N in all. Two 2-D
    operands are grouped along K (each group multiplies its slice of K), so K is counted once."""
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * math.prod(out_shape) * a[-1]


def custom_formulas() -> dict:
    """{overload packet: formula} beside torch's registry (the oneDNN op is registered on import)."""
    from dlmrt.runtime import onednn  # noqa: F401  (registers torch.ops.dlmrt.onednn_linear)

    return {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention,
            torch.ops.dlmrt.onednn_linear: _packed_linear,
            torch.ops.aten._grouped_mm: _grouped_mm}


def all_formulas() -> dict:
    """torch's registry and `custom_formulas`, each taking the op's arguments and `out_val`."""
    return {**flop_registry, **{packet: shape_wrapper(f) for packet, f in custom_formulas().items()}}
